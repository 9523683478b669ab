"""Fuzzing plans with activation moves (docs/semantics.md §2.10): random terms under the
offload modifier verify and the reference judge accepts them; one edit of their moves
(``plan_edits.MOVE_EDITS``: a reload dropped or put after its backward, an offload
dropped, repeated or put after its backward) or one of the generic mutations
(``strategies.mutate``) is judged by the verifier as by the reference, property by
property, under no limit or the base plan's peaks."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

import strategies as S
from mpipe_verified.algebra.terms import Offloaded
from plan_edits import MOVE_EDITS, edit_moves


def _offloaded_base(data):
    ch = S.DrawChooser(data.draw)
    term = S.random_term(ch, depth=1)
    gap, prefetch = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 2))
    return S.lowered(Offloaded(term, gap, prefetch)), ch


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_offloaded_terms_verify_and_the_reference_agrees(data):
    plan, _ = _offloaded_base(data)
    assert S.verifier_verdict(plan) == ("verified", set())
    assert S.reference_verdict(plan) == set()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), kind=st.sampled_from(MOVE_EDITS + ("drop", "move", "swap_adjacent",
                                                          "duplicate")))
def test_edits_of_plans_with_moves_are_judged_as_the_reference_judges_them(data, kind):
    plan, ch = _offloaded_base(data)
    if not any(type(op).__name__ == "Offload" for prog in plan.programs for op in prog):
        return  # nothing far enough apart to offload
    if kind in MOVE_EDITS:
        mutant, what = edit_moves(plan, kind, ch.pick)
    elif kind not in S.applicable(plan):
        return
    else:
        mutant, what = S.mutate(plan, kind, ch)
    limit = S.memory_limit_for(plan, ch)
    status, found = S.verifier_verdict(mutant, limit)
    expected = S.reference_verdict(mutant, limit)
    assert S.classify(status, found, expected) == "agree", (what, status, found, expected)
