"""The affine compression of certificate facts is exact: the points of the runs are the
facts, each exactly once (a run that invented or lost a point would let Z3 prove a
property from the wrong facts)."""

from collections import Counter

from hypothesis import given, strategies as st

from mpipe_verified.verify.obligations import Obligations, prove


def _points(obligations):
    out = Counter()
    for template, run in obligations.runs():
        for i in range(run.count):
            for j in range(run.length + run.rlength * i):
                out[(template, run.point(i, j))] += 1
    return out


lanes = st.lists(st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)), max_size=8),
                 max_size=6)


@given(lanes)
def test_runs_cover_exactly_the_facts(lane_facts):
    obligations = Obligations()
    expected = Counter()
    for lane, facts in enumerate(lane_facts):
        for fact in facts:
            obligations.add("le", "cls", lane, fact)
            expected[("le", fact)] += 1
    assert _points(obligations) == expected


def test_lanes_whose_starts_stop_growing_are_not_merged():
    """Regression: starts 0, 1, 1 across three lanes once merged into 0, 1, 2."""
    obligations = Obligations()
    for lane, start in enumerate((0, 1, 1)):
        obligations.add("le", "cls", lane, (start, 5))
    assert _points(obligations) == Counter({("le", (0, 5)): 1, ("le", (1, 5)): 2})


def test_a_violating_fact_hidden_by_a_bad_merge_is_found():
    obligations = Obligations()
    for lane, fact in enumerate([(0, 5), (1, 5), (9, 5)]):
        obligations.add("le", "cls", lane, fact)
    outcome = prove(obligations)
    assert outcome.status == "violated" and outcome.witness == ("le", (9, 5))
