"""Every standard family, judged by the independent reference interpreter (``reference``).

For each family at pp 4 and 8 and several microbatch counts: the lowered plan runs to
completion under rendezvous, is complete, respects every dependency, matches every send
with the right receive, never sends between stages of one rank, and its torch CSV export
runs *as written*. Then the unit-time figures (idle per rank) and the unit-model memory
peaks each family is known for, and the parameter errors.
"""

from __future__ import annotations

import csv
import functools
import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

import reference
from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.errors import ParameterError
from mpipe_verified.formats.torch_csv import format_torch_csv, parse_torch_csv
from mpipe_verified.ir import Group, Plan, Recv, Send, computes_of
from mpipe_verified.lower import lower
from mpipe_verified.semantics import (execute, pair_p2p, peak_memory, schedule_times,
                                      standard_duration)

PPS = (4, 8)


def _ms(name: str, p: int) -> list[int]:
    if name == "dualpipev":
        return [2 * p, 2 * p + 1, 3 * p]
    return sorted({1, 3, p, p + 1, 2 * p, 3 * p})


CASES = [(name, p, m, v)
         for name in FAMILIES
         for p in PPS
         for v in ((2, 3) if name == "interleaved-1f1b" else (None,))
         for m in _ms(name, p)]


def _id(case) -> str:
    name, p, m, v = case
    return f"{name}-p{p}-m{m}" + ("" if v is None else f"-v{v}")


@functools.lru_cache(maxsize=None)
def derived(name: str, p: int, m: int, v: int | None = None):
    schedule = family(name, p, m, v).derive()
    return schedule, lower(schedule)


@functools.lru_cache(maxsize=None)
def judged(name: str, p: int, m: int, v: int | None = None) -> reference.Result:
    return reference.run_plan(derived(name, p, m, v)[1])


def assert_clean(res: reference.Result) -> None:
    assert res.completed, f"deadlock, stuck ranks: {res.stuck}"
    assert not res.incomplete, res.incomplete[:5]
    assert res.first_violation is None, res.first_violation
    assert not res.mismatches, res.mismatches[:5]
    assert not res.problems, res.problems[:5]


# ------------------------------------------------------------- correctness


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_lowered_family_runs_under_reference(case):
    schedule, plan = derived(*case)
    assert_clean(judged(*case))
    placement = plan.placement
    for rank, program in enumerate(plan.programs):
        # lowering keeps each rank's compute order
        assert ([c for op in program for c in computes_of(op)]
                == [c for op in schedule.programs[rank] for c in computes_of(op)])
        for op in program:
            assert not isinstance(op, Group)
            if isinstance(op, (Send, Recv)):
                p = op.payload
                assert op.peer != rank, f"rank {rank}: {op} talks to its own rank"
                assert placement.rank_of(p.stage) != placement.rank_of(p.consumer_stage)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_exported_torch_csv_runs_as_written(case):
    _, plan = derived(*case)
    text = format_torch_csv(plan)
    back = parse_torch_csv(text, "export.csv")
    assert back == plan
    assert back.has_comms()
    assert_clean(reference.run_plan(back))
    # the judge also reads the CSV cells themselves, with no package parser in between
    rows = list(csv.reader(io.StringIO(text, newline="")))
    assert_clean(reference.run(rows, list(plan.placement.stage_to_rank), case[2]))


@given(name=st.sampled_from(sorted(FAMILIES)), p=st.integers(1, 6), m=st.integers(1, 14),
       v=st.integers(2, 4))
def test_random_parameters_run_under_reference(name, p, m, v):
    if name == "dualpipev" and m < 2 * p:
        return
    schedule, plan = derived(name, p, m, v if name == "interleaved-1f1b" else None)
    assert_clean(reference.run_plan(plan))
    assert_clean(reference.run_plan(parse_torch_csv(format_torch_csv(plan), "x.csv")))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_reference_peaks_agree_with_package(case):
    _, plan = derived(*case)
    ours = peak_memory(plan)
    assert [ours[r][0] for r in range(plan.num_ranks)] == judged(*case).peak


@given(name=st.sampled_from(sorted(FAMILIES)), p=st.integers(1, 5), m=st.integers(1, 12),
       swaps=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6), st.integers(0, 10**6)),
                      min_size=1, max_size=3))
def test_package_semantics_agree_with_the_judge_on_broken_plans(name, p, m, swaps):
    """Swap ops inside lowered plans (which may deadlock or mismatch them): the package's
    ``execute``/``pair_p2p`` must reach the judge's verdict."""
    if name == "dualpipev" and m < 2 * p:
        m = 2 * p
    _, plan = derived(name, p, m, 2 if name == "interleaved-1f1b" else None)
    progs = [list(prog) for prog in plan.programs]
    for r, i, j in swaps:
        prog = progs[r % p]
        if prog:
            i, j = i % len(prog), j % len(prog)
            prog[i], prog[j] = prog[j], prog[i]
    broken = Plan(plan.placement, m, tuple(map(tuple, progs)))
    res, ex = reference.run_plan(broken), execute(broken)
    assert ex.completed == res.completed
    assert sorted(w.rank for w in ex.waits) == sorted(res.stuck)
    for w in ex.waits:
        assert res.stuck[w.rank][0] == w.index
    if res.completed:
        assert len(pair_p2p(broken).mismatched) == len(res.mismatches)


# ------------------------------------------------------------- unit-time figures


def idle_per_rank(schedule, duration=standard_duration) -> list[float]:
    """Compute idle per rank: makespan minus the rank's busy time (no comm cost)."""
    t = schedule_times(schedule.programs, schedule.placement, duration)
    assert not t.stuck
    return [t.makespan - sum(duration(op) for op in prog) for prog in schedule.programs]


def idle_inside_busy_span(schedule) -> list[float]:
    """Idle between a rank's first op start and its last op end."""
    t = schedule_times(schedule.programs, schedule.placement)
    return [(t.finish[r][-1] - t.start[r][0]) - sum(map(standard_duration, prog))
            for r, prog in enumerate(schedule.programs)]


def _cases(name, min_m=lambda p: 1):
    return [c for c in CASES if c[0] == name and c[2] >= min_m(c[1])]


@pytest.mark.parametrize("case", _cases("gpipe") + _cases("1f1b"), ids=_id)
def test_gpipe_and_1f1b_idle_is_3_per_downstream_rank(case):
    """F=1, B=2: every rank idles (p-1)*(F+B) = 3(p-1), for any m."""
    p = case[1]
    assert idle_per_rank(derived(*case)[0]) == [3 * (p - 1)] * p


@pytest.mark.parametrize("case", _cases("interleaved-1f1b", lambda p: p), ids=_id)
def test_interleaved_idle_shrinks_by_chunks(case):
    """With v chunks per rank each chunk costs F=1/v, B=2/v, and once m >= p every rank
    idles (p-1)*(F+B)/v = 3(p-1)/v, also for m not a multiple of p (our rounds absorb
    the remainder). For m < p the warmup cannot fill and the bubble is larger."""
    _, p, m, v = case
    durations = {"F": 1 / v, "B": 2 / v}

    def duration(op):
        return sum(durations[c.kind] for c in computes_of(op))

    idle = idle_per_rank(derived(*case)[0], duration)
    assert idle == pytest.approx([3 * (p - 1) / v] * p)


@pytest.mark.parametrize("case", _cases("zb-h1", lambda p: p), ids=_id)
def test_zb_h1_idle_is_a_third_of_1f1b(case):
    """F=I=W=1 (B=2): ZB-H1 idles p-1 per rank, a third of 1F1B's 3(p-1), once m >= p."""
    _, p, m, _ = case
    assert idle_per_rank(derived(*case)[0]) == [p - 1] * p
    assert idle_per_rank(derived("1f1b", p, m)[0]) == [3 * (p - 1)] * p


@pytest.mark.parametrize("case", _cases("zb-h2", lambda p: 2 * p) + _cases("zbv", lambda p: 2 * p),
                         ids=_id)
def test_zb_h2_and_zbv_have_no_idle_inside_busy_span(case):
    assert idle_inside_busy_span(derived(*case)[0]) == [0.0] * case[1]


# ------------------------------------------------------------- memory (unit model)


@pytest.mark.parametrize("case", _cases("1f1b"), ids=_id)
def test_1f1b_peak_is_min_of_downstream_ranks_and_m(case):
    _, p, m, _ = case
    assert judged(*case).peak == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("case", _cases("zb-h1"), ids=_id)
def test_zb_h1_peak_matches_1f1b(case):
    """ZB-H1's maximum over ranks equals 1F1B's, min(p, m). Per rank, though, ZB-H1 holds
    min(p, m) *everywhere* (1F1B's rank r holds only min(p - r, m)): rank r defers each
    W by r steps, keeping r more activations alive, and that delay is what lets the
    input-gradient wave return fast enough to cut the bubble to a third."""
    _, p, m, _ = case
    assert max(judged(*case).peak) == max(judged("1f1b", p, m).peak) == min(p, m)
    assert judged(*case).peak == [min(p, m)] * p


@pytest.mark.parametrize("case", _cases("zb-h2"), ids=_id)
def test_zb_h2_peak_at_most_2p_minus_1(case):
    _, p, m, _ = case
    assert max(judged(*case).peak) <= 2 * p - 1
    if m >= 2 * p:
        assert max(judged(*case).peak) == 2 * p - 1


# ------------------------------------------------------------- parameter errors


@pytest.mark.parametrize("call,words", [
    (lambda: family("1f1b", 0, 4), ["pp", ">= 1"]),
    (lambda: family("gpipe", 4, 0), ["microbatches", ">= 1"]),
    (lambda: FAMILIES["zb-h1"](0, 4), ["ranks", ">= 1"]),
    (lambda: FAMILIES["zb-h2"](4, 0), ["microbatches", ">= 1"]),
    (lambda: family("interleaved-1f1b", 4, 8, 1), ["chunks >= 2"]),
    (lambda: FAMILIES["interleaved-1f1b"](4, 8, chunks=1), ["chunks >= 2"]),
    (lambda: family("dualpipev", 4, 7), ["microbatches >= 2*pp"]),
    (lambda: FAMILIES["dualpipev"](8, 15), ["microbatches >= 2*pp"]),
    (lambda: family("pipedream", 4, 8), ["unknown family", "'pipedream'"]),
    (lambda: family("zbv", 4, 8, 3), ["chunks"]),
], ids=["pp0", "m0", "ranks0", "weave-m0", "chunks1", "chunks1-direct", "dualpipev-m",
        "dualpipev-m-direct", "unknown", "zbv-chunks"])
def test_invalid_parameters_raise_parameter_error(call, words):
    with pytest.raises(ParameterError) as err:
        call()
    for word in words:
        assert word in str(err.value)


# ------------------------------------------------------------- the judge itself


def _judge(rows, stages, m):
    return reference.run(rows, stages, m)


TWO = [0, 1]  # stage s on rank s


def test_judge_accepts_a_correct_plan():
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    res = _judge(rows, TWO, 1)
    assert res.ok and res.peak == [1, 1]


def test_judge_finds_a_deadlock():
    rows = [["0F0", "0RECV_B0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    res = _judge(rows, TWO, 1)
    assert not res.completed and res.stuck == {0: (1, "0RECV_B0"), 1: (0, "1RECV_F0")}


def test_judge_finds_a_fifo_mismatch():
    rows = [["0F0", "0F1", "0SEND_F1", "0SEND_F0", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
            ["1RECV_F0", "1RECV_F1", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]]
    res = _judge(rows, TWO, 2)
    assert res.completed and len(res.mismatches) == 2
    assert res.mismatches[0] == ((0, 2, "0SEND_F1"), (1, 0, "1RECV_F0"))


def test_judge_finds_dependency_violations():
    rows = [["0F0", "0B0"], ["1F0", "1B0"]]  # compute-only: nothing travels
    res = _judge(rows, TWO, 1)
    assert res.completed
    assert set(res.violations) == {(0, 1, "0B0", ("grad", 1, 0)), (1, 0, "1F0", ("act", 0, 0))}
    res = _judge([["0I0", "0F0", "0W0"]], [0], 1)
    assert res.first_violation == (0, 0, "0I0", ("stored", 0, 0))


def test_judge_checks_completeness_and_local_comm():
    res = _judge([["0F0", "0F0", "1F0", "1I0"], []], TWO, 1)
    assert any("not work of rank 0" in x for x in res.incomplete)
    assert any("F=2 B=0 I=0 W=0" in x for x in res.incomplete)
    assert any("I=1 W=0" in x for x in res.incomplete)
    res = _judge([["0F0", "0SEND_F0", "1RECV_F0", "1F0", "1B0", "0B0"]], [0, 0], 1)
    assert res.problems == ["rank 0 op 1: 0SEND_F0 has peer rank 0"] and not res.completed
    res = _judge([["1SEND_F0"], [], ["2RECV_F0"]], [0, 1, 2], 1)  # stage 1 is not on rank 0
    assert res.problems == ["rank 0 op 0: 1SEND_F0 has peer rank 2"]


def test_judge_counts_overlap_allocations_before_frees():
    rows = [["0F0", "1F0", "(0F1;1B0)OVERLAP_F_B", "1F1", "1B1", "0B0", "0B1"]]
    res = _judge(rows, [0, 0], 2)
    assert res.ok and res.peak == [3]
