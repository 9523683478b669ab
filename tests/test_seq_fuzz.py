"""Fuzzing plans of sequence chunks (``strategies.random_seq_term``,
``random_seq_mutant``): every seq1f1b variant verifies and the reference accepts it, and
on every one-edit mutant (the plain edits and ``CHUNK_MUTATIONS``) the verifier's verdict
and its violated properties are the reference's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

import strategies as S
from mpipe_verified.verify import verify


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["plain", "groups", "collectives"]), st.data())
def test_seq_terms_verify_and_the_reference_accepts_them(how, data):
    ch = S.DrawChooser(data.draw)
    plan = S.decorate(S.lowered(S.random_seq_term(ch)), ch, how)
    assert plan.seq_chunks > 1
    report = verify(plan)
    assert report.status == "verified", [str(v) for v in report.violations]
    assert not S.reference_verdict(plan)


@pytest.mark.parametrize("kind", [*S.CHUNK_MUTATIONS, "swap_adjacent", "move", "drop",
                                  "duplicate", "payload", "swap_sends"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_seq_mutant_verdicts_agree_with_the_reference(kind, data):
    base, kind, description, mutant, limit = S.random_seq_mutant(S.DrawChooser(data.draw),
                                                                 kind)
    status, found = S.verifier_verdict(mutant, limit)
    expected = S.reference_verdict(mutant, limit)
    assert S.classify(status, found, expected) == "agree", (
        description, f"limit={limit}", status, sorted(found), sorted(expected))
