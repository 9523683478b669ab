"""The affine compression of certificate facts is exact: the points of the runs are the
facts, each exactly once (a run that invented or lost a point would let Z3 prove a
property from the wrong facts)."""

from collections import Counter

from hypothesis import example, given, settings, strategies as st

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


def test_deadlock_certificate_includes_program_order(monkeypatch):
    """A forged run whose times ignore program order must not certify a deadlocking plan:
    both ranks receive first, and the forged times let each receive meet its send."""
    from mpipe_verified.semantics import Execution
    from mpipe_verified.verify import properties, verify
    from plan_edits import fixture

    plan = fixture("recv_first_deadlock")
    assert verify(plan).status == "violated"
    # rank 0: recv meets at 4, send at 2 (posted at 1, before the recv finished)
    forged = Execution(start=((3.0, 1.0), (1.0, 3.0)), finish=((4.0, 2.0), (2.0, 4.0)),
                       waits=())
    monkeypatch.setattr(properties, "execute", lambda *a, **k: forged)
    report = verify(plan)
    assert report.status != "verified"
    assert report.stats["properties"]["deadlock"]["status"] == "unknown"


from plan_edits import lowered  # noqa: E402


def _deferred_receives(name, p, m):
    from plan_edits import defer_receives
    return defer_receives(lowered(name, p, m))


import functools  # noqa: E402
import pytest  # noqa: E402


@pytest.mark.parametrize("make", [
    functools.partial(lowered, "interleaved-1f1b", 8, 32, 2),
    functools.partial(_deferred_receives, "1f1b", 4, 8),
])
@pytest.mark.parametrize("rlimit", [None, 1])
def test_two_process_verdicts_equal_one_process(make, rlimit):
    """verify_loaded (this process decides completeness, dependency and memory, the child
    matching and deadlock) reaches the same verdicts as verify."""
    from mpipe_verified.verify import verify, verify_loaded
    one = verify(make(), rlimit=rlimit)
    _, two = verify_loaded(make, rlimit=rlimit)
    assert two.status == one.status
    assert [v.message for v in two.violations] == [v.message for v in one.violations]
    assert {k: v["status"] for k, v in two.stats["properties"].items()} == \
        {k: v["status"] for k, v in one.stats["properties"].items()}
    assert (two.certificate is None) == (one.certificate is None)


ARITY = {"lt": 2, "le": 2, "eq": 4, "rendezvous": 7, "collective": 4, "unit": 8, "memory": 5}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(ARITY)), st.data())
def test_smt_text_templates_say_what_the_z3_templates_say(template, data):
    """``prove`` reads the SMT-LIB text of a template, ``confirm`` the Python-built one:
    on any ground fact both must agree (a typo in either would prove the wrong thing)."""
    from mpipe_verified.verify.obligations import SMT_TEMPLATES, TEMPLATES, confirm
    assert set(ARITY) == set(TEMPLATES) == set(SMT_TEMPLATES)
    fact = tuple(data.draw(st.lists(st.integers(-2, 2), min_size=ARITY[template],
                                    max_size=ARITY[template])))
    obligations = Obligations()
    obligations.add(template, "cls", 0, fact)
    expected = "violated" if confirm(template, fact) == "violated" else "proved"
    assert prove(obligations).status == expected


def test_eager_unmatched_send_keeps_its_program_order(monkeypatch):
    """Under eager an unmatched send never blocks, so the run completes without pairing
    it; a forged run posting it before the receive ahead of it finished must not certify."""
    from mpipe_verified.semantics import Execution
    from mpipe_verified.verify import properties, verify
    from plan_edits import fixture

    plan = fixture("eager_extra_send")
    honest = verify(plan, comm_model="eager")
    assert honest.stats["properties"]["deadlock"]["status"] == "proved"
    assert honest.stats["properties"]["matching"]["status"] == "violated"
    forged = Execution(start=((0.0, 0.0), (0.0,)), finish=((1.0, 1.0), (1.0,)), waits=())
    monkeypatch.setattr(properties, "execute", lambda *a, **k: forged)
    report = verify(plan, comm_model="eager")
    assert report.stats["properties"]["deadlock"]["status"] == "unknown"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-4, 4, allow_nan=False, allow_infinity=False), min_size=5,
                max_size=5))
@example([1.0000000001, 0.0, 0.0, 1.0000000001, 1.0])  # over by 1e-10: violated
@example([0.1, 0.2, 0.1, 0.2, 0.3])  # the rationals of 0.1 and 0.2 sum above 0.3's
@example([0.1, 0.2, 0.1, 0.2, 0.30000000000000004])  # holds exactly
def test_real_facts_are_read_exactly_by_prove_and_confirm(values):
    """Floats in a real template are the rationals they denote, in ``prove``'s SMT text
    and in ``confirm`` alike: both agree with exact rational arithmetic."""
    from fractions import Fraction
    from mpipe_verified.verify.obligations import confirm
    before, alloc, free, after, bound = map(Fraction, values)
    holds = before + alloc <= bound and after == before + alloc - free
    fact = tuple(values)
    assert confirm("memory", fact) == ("holds" if holds else "violated")
    obligations = Obligations()
    obligations.add("memory", "cls", 0, fact)
    assert prove(obligations).status == ("proved" if holds else "violated")


def test_no_facts_is_still_proved_by_z3(monkeypatch):
    """A property without facts (a one-rank plan has no channels) is proved by a Z3
    query too (the empty disjunction is unsat), not by default."""
    import z3
    from mpipe_verified.verify import obligations as module
    checks = []
    real_check = z3.Solver.check

    def counted(self, *args):
        result = real_check(self, *args)
        checks.append(result)
        return result
    monkeypatch.setattr(z3.Solver, "check", counted)
    outcome = module.prove(Obligations())
    assert outcome.status == "proved" and outcome.runs == 0 and outcome.facts == 0
    assert checks == [z3.unsat]


def test_check_unsat_names_the_answer():
    import z3
    from mpipe_verified.verify.obligations import check_unsat
    x = z3.Int("x")
    assert check_unsat(z3.And(x > 0, x < 0)) == "unsat"
    assert check_unsat(x > 0, sat="holds", unsat="violated") == "holds"
    assert check_unsat(z3.And(x > 0, x < 0), unsat="violated") == "violated"
