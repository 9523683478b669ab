"""Disagreements between ``verify`` and the reference judge (``tests/reference.py``) that
were bugs in the verifier, each as a minimal plan kept as a regression test."""

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
    "no name": lambda seg: (attrs.evolve(seg, name=None),),
    "a number for a name": lambda seg: (attrs.evolve(seg, name=5),),
}


@pytest.mark.parametrize("edit", MALFORMED_CUTS.values(), ids=MALFORMED_CUTS.keys())
def test_a_malformed_cut_is_refused_where_the_plan_is_built(edit):
    """A cut that does not fit its plan cannot reach the verifier: building the plan
    refuses it (then neither the passes nor the kernel index past a short rank list)."""
    with pytest.raises(ValueError, match="segment"):
        _malformed(edit)


@pytest.mark.parametrize("edit", MALFORMED_CUTS.values(), ids=MALFORMED_CUTS.keys())
def test_the_kernel_finds_a_malformed_cut_on_its_own(edit):
    """Should such a plan be made anyway (the IR's check bypassed), the kernel fails every
    property (never proves one) and confirms completeness."""
    from mpipe_verified import kernel
    plan = _owner_plan()
    from mpipe_verified.verify import verify
    witness = verify(plan).witness
    broken = attrs.evolve(plan)
    object.__setattr__(broken, "cut", Cut(edit(plan.cut.segments[0])))
    verdicts = kernel.prove(broken, witness)
    assert {v.status for v in verdicts.values()} == {"failed"}
    assert kernel.confirm(broken, "completeness", [("cut",)]) == ["violated"]
