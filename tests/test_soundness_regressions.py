"""Disagreements between ``verify`` and the reference judge (``tests/reference.py``) that
are bugs in the verifier, each as a minimal plan. A known, not yet fixed one is marked
``xfail(strict=True)``: the day the verifier is fixed the test passes, strict turns that
into a failure, and the mark must go."""

from __future__ import annotations

import attrs
import pytest

import reference
import strategies as S
from mpipe_verified.algebra.transpose import transpose_family
from mpipe_verified.ir import Compute, Cut
from mpipe_verified.lower import lower


def _with_stray_segment_forward():
    """A valid transpose (1f1b body on 2 ranks, 2 microbatches, source segment
    ``vision`` in owner mode, round-robin: forward and backward of mb 1 on rank 1) plus
    ``vision:0F2`` on rank 0: a forward of a microbatch the plan does not have."""
    plan = lower(transpose_family(2, 2, body="1f1b", side="source", mode="owner",
                                  ownership="full").derive())
    assert reference.judge_plan(plan).ok
    programs = list(plan.programs)
    programs[0] += (Compute("F", 0, 2, "vision"),)
    return attrs.evolve(plan, programs=tuple(programs))


@pytest.mark.xfail(strict=True, raises=IndexError, reason=(
    "kernel._Rules.stores indexes seg.backward_rank[c.mb] without checking c.mb < m, so "
    "the memory obligations raise IndexError on a trainable segment's F whose mb is past "
    "the last microbatch (verify crashes instead of reporting completeness)"))
def test_segment_forward_past_the_last_microbatch_is_incomplete_not_a_crash():
    plan = _with_stray_segment_forward()
    # no such unit: completeness only (it runs on home, needs nothing, stores nothing)
    assert reference.judge_plan(plan).violated == {"completeness"}
    assert S.verifier_verdict(plan) == ("violated", {"completeness"})


def _owner_plan():
    return lower(transpose_family(2, 2, body="1f1b", side="source", mode="owner",
                                  ownership="full").derive())


def _malformed(edit):
    plan = _owner_plan()
    seg = plan.cut.segments[0]
    return attrs.evolve(plan, cut=Cut(edit(seg)))


MALFORMED_CUTS = {  # the valid plan of _owner_plan under a cut that is not well formed
    "forward_rank one short": lambda seg: (attrs.evolve(seg, forward_rank=(0,)),),
    "backward_rank one short": lambda seg: (attrs.evolve(seg, backward_rank=(0,)),),
    "home outside the ranks": lambda seg: (attrs.evolve(seg, home=5),),
    "forward rank outside the ranks": lambda seg: (attrs.evolve(seg, forward_rank=(0, 7)),),
    "one segment twice": lambda seg: (seg, seg),
}


@pytest.mark.xfail(strict=True, raises=(AssertionError, IndexError), reason=(
    "the fast passes (semantics.Chain, verify/properties.completeness) never check that "
    "the cut is well formed, which the kernel's completeness requires (_Rules.cut_ok): "
    "they propose counterexamples the kernel cannot confirm or a witness it refutes, so "
    "verify answers 'undecided (internal error)' where the kernel alone finds completeness "
    "violated; a backward_rank shorter than m raises IndexError in "
    "semantics.Chain.expected_rank (and kernel._Rules.stores)"))
@pytest.mark.parametrize("edit", MALFORMED_CUTS.values(), ids=MALFORMED_CUTS.keys())
def test_a_malformed_cut_is_refused_or_violates_completeness(edit):
    """A cut that does not fit its plan never ends in a crash or an undecided verdict:
    either building the plan refuses it (``ValueError``), or ``verify`` reports what the
    reference reports, completeness violated."""
    try:
        plan = _malformed(edit)
    except ValueError:
        return  # refused where the plan is built: no such plan reaches verify
    expected = reference.judge_plan(plan).violated
    assert expected == {"completeness"}
    status, found = S.verifier_verdict(plan)
    assert S.classify(status, found, expected) == "agree", (status, found)
