"""Lowering (``lower.py``): it only inserts sends and receives (idle steps dropped,
markers kept), and its guarantee holds for any durations: whatever the costs the run is
ordered by, the lowered plan of every family runs to completion under rendezvous with
each op posted on its own, judged by the independent reference interpreter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from mpipe_verified.algebra import terms as algebra_terms
from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.ir import COMM_STEP, Compute, Idle, Marker, Plan, Schedule
from mpipe_verified.lower import as_plan, lower


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lowering_only_inserts_comm_ops(name):
    """``lower_work_conservation`` on the real lowering (Idle steps are dropped)."""
    sched = family(name, 4, 8, 2 if name == "interleaved-1f1b" else None).derive()
    plan = lower(sched)
    for prog, lowered in zip(sched.programs, plan.programs):
        assert [op for op in lowered if not isinstance(op, COMM_STEP)] == \
            [op for op in prog if not isinstance(op, Idle)]


def test_lowering_drops_idle_steps_and_keeps_markers():
    placement = algebra_terms.make_placement("looped", 1, 1)
    prog = (Compute("F", 0, 0), Idle(), Marker(0, "UNSHARD"), Compute("B", 0, 0))
    plan = lower(Schedule(placement, 1, (prog,)))
    assert plan.programs[0] == (Compute("F", 0, 0), Marker(0, "UNSHARD"), Compute("B", 0, 0))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(FAMILIES)), st.integers(2, 4),
       st.dictionaries(st.sampled_from("FBIW"), st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.25])))
def test_the_lowered_plan_runs_whatever_the_durations(name, p, costs):
    chunks = 2 if name == "interleaved-1f1b" else None
    sched = family(name, p, 2 * p, chunks).derive()
    plan = lower(sched, lambda op: costs.get(getattr(op, "kind", ""), 1.0))
    result = reference.run_plan(plan)
    assert result.ok, (result.stuck, result.mismatches[:3], result.problems[:3])


def test_as_plan_lowers_a_schedule_and_keeps_a_plan():
    sched = family("1f1b", 2, 4).derive()
    plan = as_plan(sched)
    assert isinstance(plan, Plan) and plan == lower(sched)
    assert as_plan(plan) is plan
