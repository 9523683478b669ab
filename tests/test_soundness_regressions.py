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
from mpipe_verified.ir import Compute
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
