"""The algebra operators' documented meanings (``algebra.terms`` docstring), on concrete
and random instances, judged where it matters by the reference interpreter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import reference
from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.algebra.pattern import parse_pattern
from mpipe_verified.algebra.terms import (DeferW, MergeBW, Par, Relabel, Restrict, Seq,
                                          SplitBW, Weave)
from mpipe_verified.errors import ParameterError
from mpipe_verified.ir import Compute, Plan, computes_of
from mpipe_verified.lower import lower
from mpipe_verified.semantics import required_work

UNSPLIT = ("gpipe", "1f1b", "interleaved-1f1b")  # families without I/W
SINGLE_CHUNK = ("gpipe", "1f1b", "zb-h1", "zb-h2")  # looped, one stage per rank


@st.composite
def terms(draw, names=tuple(sorted(FAMILIES))):
    name = draw(st.sampled_from(names))
    p = draw(st.integers(1, 6))
    m = draw(st.integers(2 * p if name == "dualpipev" else 1, 2 * p + 4))
    v = draw(st.integers(2, 3)) if name == "interleaved-1f1b" else None
    return family(name, p, m, v)


def runs_clean(schedule) -> reference.Result:
    res = reference.run_plan(lower(schedule))
    assert res.ok, (res.stuck, res.incomplete[:3], res.first_violation, res.mismatches[:3])
    return res


def kinds(schedule) -> set[str]:
    return {c.kind for prog in schedule.programs for op in prog for c in computes_of(op)}


# ------------------------------------------------------------- split / merge


@given(terms(UNSPLIT))
def test_merge_after_split_is_identity(t):
    split = SplitBW(t).derive()
    assert "B" not in kinds(split) and {"I", "W"} <= kinds(split)
    assert MergeBW(SplitBW(t)).derive() == t.derive()


@given(terms(UNSPLIT))
def test_split_puts_w_right_after_its_i(t):
    for prog in SplitBW(t).derive().programs:
        for a, b in zip(prog, prog[1:]):
            if isinstance(a, Compute) and a.kind == "I":
                assert b == Compute("W", a.stage, a.mb)


# ------------------------------------------------------------- seq


@given(p=st.integers(1, 5),
       parts=st.lists(st.tuples(st.sampled_from(SINGLE_CHUNK), st.integers(1, 8)),
                      min_size=3, max_size=3))
def test_seq_is_associative(p, parts):
    a, b, c = (family(name, p, m) for name, m in parts)
    left, right = Seq(Seq(a, b), c).derive(), Seq(a, Seq(b, c)).derive()
    assert left == right
    assert left.num_microbatches == sum(m for _, m in parts)
    runs_clean(left)


def test_seq_renumbers_the_second_term():
    s = Seq(family("gpipe", 2, 2), family("gpipe", 2, 1)).derive()
    assert [str(op) for op in s.programs[1]] == ["1F0", "1F1", "1B0", "1B1", "1F2", "1B2"]


def test_seq_needs_equal_placements():
    with pytest.raises(ParameterError, match="same placement"):
        Seq(family("1f1b", 4, 4), family("zbv", 4, 8)).derive()


# ------------------------------------------------------------- par / restrict


@given(t=terms(), data=st.data())
def test_par_of_restricts_over_a_partition_is_the_original(t, data):
    p = t.ranks
    blocks = data.draw(st.lists(st.integers(0, 2), min_size=p, max_size=p))
    parts = [tuple(r for r in range(p) if blocks[r] == b) for b in range(3)]
    term = Restrict(t, parts[0])
    for part in parts[1:]:
        term = Par(term, Restrict(t, part))
    assert term.derive() == t.derive()
    assert Par(Restrict(t, parts[1]), Restrict(t, parts[0])).derive() == \
        Par(Restrict(t, parts[0]), Restrict(t, parts[1])).derive()


def test_par_rejects_overlapping_ranks():
    t = family("1f1b", 4, 4)
    with pytest.raises(ParameterError, match="disjoint ranks"):
        Par(Restrict(t, (0, 1)), Restrict(t, (1, 2))).derive()


# ------------------------------------------------------------- defer_w


@given(terms(UNSPLIT))
def test_defer_w_lag_zero_on_a_split_term_is_identity(t):
    assert DeferW(SplitBW(t), "0").derive() == SplitBW(t).derive()


@given(p=st.integers(1, 8), m=st.integers(1, 20))
def test_zb_h1_is_1f1b_split_with_w_deferred_by_rank(p, m):
    """ZB-H1's pattern, written as operators: split 1F1B's backwards and let rank r run
    each W r input-gradients later."""
    assert DeferW(SplitBW(family("1f1b", p, m)), "r").derive() == family("zb-h1", p, m).derive()


@given(t=terms(UNSPLIT), lag=st.sampled_from(["1", "r", "p-1-r", "p", "m", "2*p+m"]))
def test_defer_w_keeps_work_and_runs(t, lag):
    deferred = DeferW(SplitBW(t), lag).derive()
    split = SplitBW(t).derive()
    for a, b in zip(deferred.programs, split.programs):
        assert sorted(a) == sorted(b)
        non_w = [op for op in a if op.kind != "W"]
        assert non_w == [op for op in b if op.kind != "W"]
    runs_clean(deferred)


# ------------------------------------------------------------- relabel


@given(t=terms(), data=st.data())
def test_relabel_by_a_permutation_keeps_completeness(t, data):
    m = t.microbatches
    perm = tuple(data.draw(st.permutations(range(m))))
    relabeled = Relabel(t, perm).derive()
    assert required_work(Plan.from_schedule(relabeled)) == []
    res = runs_clean(relabeled)
    assert not res.incomplete
    inverse = tuple(sorted(range(m), key=perm.__getitem__))
    assert Relabel(Relabel(t, perm), inverse).derive() == t.derive()


def test_relabel_needs_a_permutation():
    with pytest.raises(ParameterError, match="permutation"):
        Relabel(family("1f1b", 2, 3), (0, 0, 1)).derive()


# ------------------------------------------------------------- patterns


@pytest.mark.parametrize("text,column", [
    ("FX", 2),
    ("F B )", 5),
    ("(F B", 1),
    ("F (B", 3),
    ("<F>", 1),
    ("F <F B", 3),
    ("^3 F", 1),
    ("* F", 1),
    ("F^", 2),
    ("F B^x", 5),
    ("F^{p-1", 3),
])
def test_pattern_syntax_errors_name_the_column(text, column):
    with pytest.raises(ParameterError, match=f"column {column}\\b"):
        parse_pattern(text)
    with pytest.raises(ParameterError, match=f"column {column}\\b"):
        Weave(4, 4, text)


@pytest.mark.parametrize("text,column", [("F X", 3), ("F B   ?", 7), ("(F B) *  $", 10)])
def test_unreadable_character_column_points_at_it_not_at_blanks(text, column):
    """The column must be the unreadable character's, not the blank before it."""
    with pytest.raises(ParameterError, match=f"column {column}\\b"):
        parse_pattern(text)


@pytest.mark.parametrize("text,caret", [
    ("F^{q}", 2),
    ("F B^{1+}", 4),
    ("F^{__import__('os')}", 2),
])
def test_bad_count_errors_name_the_column(text, caret):
    """``parse_pattern``'s docstring: "ParameterError names the offending column". Counts
    are checked while parsing, so a bad count must say where it is (the ``^`` or the
    ``{``)."""
    with pytest.raises(ParameterError, match=f"column ({caret}|{caret + 1})\\b"):
        parse_pattern(text)


@pytest.mark.parametrize("term", [
    lambda: Weave(1, 4, "F^{m//(p-1)} F* B*"),
    lambda: DeferW(SplitBW(family("1f1b", 1, 4)), "m//(p-1)"),
], ids=["weave-count", "defer-lag"])
def test_a_count_dividing_by_zero_is_a_parameter_error(term):
    """Counts are evaluated per rank at ``derive()``; ``m//(p-1)`` at p=1 divides by
    zero. That is a bad parameter and must be a ``ParameterError`` (the CLI turns it into
    one clear line, exit code 2), not a ``ZeroDivisionError`` traceback."""
    with pytest.raises(ParameterError, match="zero|count"):
        term().derive()


def test_a_huge_count_over_exhausted_streams_finishes():
    """Regression test: a repeat whose body pops nothing will never pop again (nothing
    changed), so the weave must stop there instead of spinning through 10^20 empty
    iterations (it once hung: ``mpipe-verify`` on such a spec never answered)."""
    import signal

    def too_slow(*_):
        raise TimeoutError("derive() still running after 3 s: the repeat never stops")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(3)
    try:
        s = Weave(2, 10, "(F B)^{m*m*m*m*m*m*m*m*m*m*m*m*m*m*m*m*m*m*m*m}").derive()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert s == Weave(2, 10, "(F B)*").derive()


@pytest.mark.parametrize("pattern", ["F*", "F* B", "F^{m-1} B*", "F* I*", "F* B^{m-1}"])
def test_a_pattern_that_leaves_work_raises(pattern):
    with pytest.raises(ParameterError, match="unscheduled"):
        Weave(3, 4, pattern).derive()


@given(p=st.integers(1, 5), m=st.integers(2, 10), data=st.data())
def test_any_short_count_leaves_work_unscheduled(p, m, data):
    k = data.draw(st.integers(0, m - 1))
    with pytest.raises(ParameterError, match="unscheduled"):
        Weave(p, m, f"F* B^{k}").derive()
    assert Weave(p, m, f"F* B^{m}").derive() == family("gpipe", p, m).derive()


@pytest.mark.parametrize("var,value", [("v", 2), ("n", 2 * 6), ("g", 6)])
def test_defer_w_lag_variables_mean_what_they_say(var, value):
    """Regression test: ``DeferW``'s lag once passed the pattern-count check, which allows
    ``v g n`` too, and ``derive`` bound them to placeholders (v=1, g=1, n=0) instead of
    the term's values (for interleaved-1f1b with p=4, m=6, chunks=2: v=2, n=m*v=12, g=6).
    A lag may use only p, r, m: the others are refused with a ParameterError."""
    t = SplitBW(family("interleaved-1f1b", 4, 6, 2))
    assert DeferW(t, str(value)).derive() is not None  # the value itself is a fine lag
    with pytest.raises(ParameterError, match=r"may use only .* the variables p, r, m"):
        DeferW(t, var).derive()
