"""Our compute orders against the orders PyTorch's own schedule classes generate.

torch's orders come from ``torch_fixtures.torch_schedule_csv`` (the schedule classes
built on mock stages, dumped with torch's own ``_dump_csv``), read with
``parse_torch_csv``. Wherever torch produces an order, ours is the same op sequence per
rank once torch's idle cells and FSDP markers are dropped. Every difference is one of:

- **interleaved-1f1b, m not a multiple of the rounds**: torch requires
  ``m % max(1, m // p) == 0`` and refuses the rest; our rounds take ``ceil(m / rounds)``
  microbatches (the last round shorter), so any m works, and the result is valid.
- **ZBV**: torch pads its rows with idle cells (its step grid); ours has no idle steps
  because the lowering times the program itself. The op sequences are equal.
- **GPipe**: torch's ``ScheduleGPipe`` is a single-stage schedule; the fixture builds it
  on a mock stage and dumps its ``pipeline_order`` (no derivation from documentation
  was needed). That order ends every rank with ``REDUCE_GRAD``, a marker we accept and
  ignore; otherwise it is ours.

"Valid" is judged by the reference interpreter: complete, and the lowered plan runs to
completion with every dependency met and every send matched.
"""

from __future__ import annotations

import pytest

import reference
from mpipe_verified.algebra.families import family
from mpipe_verified.formats.torch_csv import parse_torch_csv
from mpipe_verified.ir import Idle, Marker, Plan, Schedule
from mpipe_verified.lower import lower
from torch_fixtures import torch_schedule_csv

pytest.importorskip("torch")


def compute_rows(plan_or_schedule) -> list[list[str]]:
    return [[str(op) for op in prog if not isinstance(op, (Idle, Marker))]
            for prog in plan_or_schedule.programs]


def torch_order(name: str, p: int, m: int, v: int) -> Plan:
    return parse_torch_csv(torch_schedule_csv(name, p, m, v, "compute_only"), f"{name}.csv")


def assert_valid(schedule_or_plan) -> None:
    """Complete, and once lowered by us it runs cleanly under the reference."""
    schedule = Schedule(schedule_or_plan.placement, schedule_or_plan.num_microbatches,
                        schedule_or_plan.programs)
    res = reference.run_plan(lower(schedule))
    assert res.ok, (res.stuck, res.incomplete[:3], res.first_violation, res.mismatches[:3])


def assert_torch_lowering_runs(name: str, p: int, m: int, v: int) -> None:
    """torch's own lowering (its compute_comms dump) also runs as written under
    rendezvous."""
    plan = parse_torch_csv(torch_schedule_csv(name, p, m, v, "compute_comms"), "comms.csv")
    res = reference.run_plan(plan)
    assert res.ok, (res.stuck, res.incomplete[:3], res.first_violation, res.mismatches[:3])


def _rounds_divide(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


INTERLEAVED = [(p, m, v) for p in (2, 4, 8) for v in (2, 3)
               for m in sorted({1, 3, p, p + 1, 2 * p, 2 * p + 1, 3 * p})]


@pytest.mark.parametrize("p,m,v", [c for c in INTERLEAVED if _rounds_divide(c[0], c[1])])
def test_interleaved_1f1b_equals_torch(p, m, v):
    theirs = torch_order("Interleaved1F1B", p, m, v)
    ours = family("interleaved-1f1b", p, m, v).derive()
    assert theirs.placement == ours.placement
    assert compute_rows(theirs) == compute_rows(ours)
    assert_valid(ours)
    assert_torch_lowering_runs("Interleaved1F1B", p, m, v)


@pytest.mark.parametrize("p,m,v", [c for c in INTERLEAVED if not _rounds_divide(c[0], c[1])])
def test_interleaved_1f1b_any_m_where_torch_refuses(p, m, v):
    """torch: "Interleaved 1F1B requires the number of microbatches to be a multiple of
    the number of rounds". Ours splits m into max(1, m // p) rounds of ceil(m / rounds),
    so it has an order here, and that order is valid."""
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_schedule_csv("Interleaved1F1B", p, m, v)
    ours = family("interleaved-1f1b", p, m, v).derive()
    assert_valid(ours)
    # the nearest m torch accepts (one microbatch less) is still the same order as ours
    if _rounds_divide(p, m - 1):
        assert compute_rows(torch_order("Interleaved1F1B", p, m - 1, v)) == \
            compute_rows(family("interleaved-1f1b", p, m - 1, v).derive())


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8)
                                 for m in sorted({1, 3, p, p + 1, 2 * p, 3 * p})])
def test_zbv_equals_torch_up_to_idle_cells(p, m):
    """torch lays ZBV out on a step grid and pads it with idle cells; ours has none. The
    per-rank op sequences are identical and both are valid."""
    theirs = torch_order("ZBVZeroBubble", p, m, 2)
    ours = family("zbv", p, m).derive()
    assert theirs.placement == ours.placement
    assert compute_rows(theirs) == compute_rows(ours)
    assert not any(isinstance(op, Idle) for prog in ours.programs for op in prog)
    assert any(isinstance(op, Idle) for prog in theirs.programs for op in prog)
    assert_valid(ours)
    assert_valid(theirs)
    assert_torch_lowering_runs("ZBVZeroBubble", p, m, 2)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in sorted({1, 3, p, 2 * p})])
def test_gpipe_equals_torch_pipeline_order(p, m):
    """torch's ScheduleGPipe is single-stage and has no multi-rank schedule of its own;
    the fixture dumps its ``pipeline_order`` (what torch itself visualises), so the
    comparison needs no order derived from documentation. torch ends each rank with a
    ``REDUCE_GRAD`` marker (ignored); the rest is ours: all forwards, then all backwards
    in microbatch order."""
    theirs = torch_order("GPipe", p, m, 1)
    ours = family("gpipe", p, m).derive()
    assert [str(prog[-1]) for prog in theirs.programs] == [f"{r}REDUCE_GRAD" for r in range(p)]
    assert theirs.placement == ours.placement
    assert compute_rows(theirs) == compute_rows(ours)
    assert_valid(theirs)
    assert_torch_lowering_runs("GPipe", p, m, 1)
