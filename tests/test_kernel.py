"""The verification kernel on its own: exact compression, templates that say what they
mean, forged witnesses that must not certify, counterexamples it must not confirm."""

import functools
from collections import Counter
from fractions import Fraction

import attrs
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from mpipe_verified import kernel
from mpipe_verified.ir import Placement, Plan
from mpipe_verified.kernel.certificates import read_sizes, sizes_json
from mpipe_verified.kernel.columns import BOUND, as_column
from mpipe_verified.kernel.obligations import Facts
from mpipe_verified.kernel.smt import REAL, TEMPLATES, affine_runs, compress, decide, holds, literal
from mpipe_verified.semantics import MemoryModel
from mpipe_verified.verify import verify, verify_loaded
from plan_edits import defer_receives, fixture, lowered


BIG = st.sampled_from([BOUND - 1, BOUND, 1 << 63, 1 << 70])


@given(st.lists(st.tuples(st.integers(-3, 3) | BIG, st.integers(-3, 3) | BIG.map(lambda x: -x)),
                max_size=30), st.booleans())
def test_runs_cover_exactly_the_facts(facts, as_array):
    """Every fact lies in exactly one run, and every run point is a fact (in 64-bit
    arrays and in Python's exact arithmetic, whatever the magnitudes; given as tuples or
    as the kernel's columns)."""
    if as_array and facts:
        columns = [as_column(column) for column in zip(*facts)]
        given = (np.column_stack(columns) if all(c.dtype == np.int64 for c in columns)
                 else facts)
    else:
        given = facts
    points = Counter(tuple(a_ + d_ * j for a_, d_ in zip(a, d))
                     for a, d, n in affine_runs(given) for j in range(n))
    assert points == Counter(facts)


@given(st.lists(st.tuples(st.sampled_from(["le", "level"]), st.integers(0, 3),
                          st.tuples(st.integers(-3, 3) | BIG, st.integers(0, 2))),
                max_size=60))
def test_two_level_compression_covers_exactly_the_facts(added):
    """Runs of runs (``a + ra*i + d*j``) list every fact of every class exactly once."""
    facts = Facts()
    for template, cls, fact in added:
        facts.add(template, cls, *fact)
    points = Counter((t, tuple(a_ + r_ * i + d_ * j for a_, r_, d_ in zip(a, ra, d)))
                     for t, (a, ra, c, d, n) in compress(facts)
                     for i in range(c) for j in range(n))
    assert points == Counter((t, fact) for t, _, fact in added)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(-3, 3) | BIG, st.integers(-3, 3)),
                max_size=40), st.booleans())
def test_a_class_of_facts_is_a_set_and_its_runs_cover_it_exactly(rows, where):
    """``extend``: the runs cover exactly the facts added, every distinct fact of a class
    once (64-bit facts are kept once each; with ``where``, as ``confirm`` needs, or with
    Python's numbers, every row is kept); ``count`` counts every row added."""
    facts = Facts(where=where)
    if rows:
        cls, a, b = (as_column(c) for c in zip(*rows))
        facts.extend("le", "x", [a, b], cls)
    points = Counter((t, tuple(a_ + r_ * i + d_ * j for a_, r_, d_ in zip(a, ra, d)))
                     for t, (a, ra, c, d, n) in compress(facts)
                     for i in range(c) for j in range(n))
    once = rows and not where and all(as_column(c).dtype == np.int64 for c in zip(*rows))
    kept = Counter(set(rows)) if once else Counter(rows)
    assert points == Counter(("le", x[1:]) for x in kept.elements())
    assert facts.count == len(rows)


ARITY = {"one": 1, "eq": 2, "le": 2, "lt": 2, "level": 5, "eqr": 2, "ler": 2}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(ARITY)), st.data())
@example("level", None)
def test_smt_templates_say_what_the_python_reading_says(template, data):
    """``decide`` reads a template's SMT-LIB text; ``holds`` (which names the violated
    fact) reads it in Python: on any exact fact the two agree."""
    assert set(ARITY) == set(TEMPLATES)
    if data is None:  # over by 1e-10, as rationals
        fact = (Fraction(1.0000000001), 0, 0, Fraction(1.0000000001), 1)
    else:
        numbers = st.integers(-2, 2) if template not in REAL else st.fractions(
            -2, 2, max_denominator=7)
        fact = tuple(data.draw(st.lists(numbers, min_size=ARITY[template],
                                        max_size=ARITY[template])))
    facts = Facts()
    facts.add(template, "cls", *fact)
    status, _ = decide(compress(facts), None)
    assert status == ("proved" if holds(template, fact) else "failed")


def _witness(finish) -> kernel.Witness:
    return kernel.Witness(finish, None, None, None, None)


def test_a_forged_run_that_ignores_program_order_does_not_prove_deadlock_freedom():
    """Both ranks receive first: no run completes. Times that let each receive meet its
    send (posted 'before' the receive ahead of it finished) break program order."""
    plan = fixture("recv_first_deadlock")
    assert verify(plan).status == "violated"
    big = -(1 << 62) + 1  # gaps near 2**63: the facts must stay exact
    for finish in [((4, 2), (2, 4)), ((1, 1), (1, 1)), ((0, 0), (0, 0)), ((5, 9), (9, 5)),
                   ((big, 3), (2, 2))]:
        verdict = kernel.prove(plan, _witness(finish), properties=("deadlock",))["deadlock"]
        assert verdict.status == "failed", finish


def test_a_buffer_is_freed_only_on_the_rank_that_received_it():
    """Rank 0 receives an activation (buffer 2) and never reads it; rank 1 reads the same
    activation, made by itself: rank 1's levels go up to 4 (two stored activations, twice),
    and nothing of rank 0's buffer is freed there. A limit of 2 is violated, not undecided,
    and a witness that frees rank 0's buffer on rank 1 proves nothing."""
    plan = fixture("buffer_kept_by_another_rank")
    model = MemoryModel(buffer=lambda payload: 2)
    honest = verify(plan, memory_model=model)
    assert honest.status == "verified" and honest.peak_memory == {0: 2, 1: 4}
    assert verify(plan, memory_limit=2, memory_model=model).status == "violated"
    levels = ((0, 2), (0, 1, 0, 1, 2, 1, 0, -1, -2))  # rank 1 credited rank 0's buffer
    forged = attrs.evolve(honest.witness, levels=levels, peaks=(2, 2))
    verdict = kernel.prove(plan, forged, sizes=honest.sizes, limits=(2, 2),
                           properties=("memory",))["memory"]
    assert verdict.status == "failed"


def test_eager_unmatched_send_needs_no_partner_but_keeps_program_order():
    plan = fixture("eager_extra_send")
    honest = verify(plan, comm_model="eager")
    assert honest.stats["properties"]["deadlock"]["status"] == "proved"
    assert honest.stats["properties"]["matching"]["status"] == "violated"
    prove = functools.partial(kernel.prove, plan, comm_model="eager", properties=("deadlock",))
    assert prove(_witness(((2, 3), (1,))))["deadlock"].status == "proved"
    assert prove(_witness(((2, 1), (1,))))["deadlock"].status == "failed"  # order broken
    # under rendezvous the same send has no partner: no witness proves it
    assert kernel.prove(plan, _witness(((2, 3), (1,))),
                        properties=("deadlock",))["deadlock"].status == "failed"


def test_a_witness_for_another_plan_does_not_prove_this_one():
    """The producer positions, times and levels of a valid plan, put to a broken copy (a
    forward moved after the backward that needs it): dependency is not proved."""
    plan = lowered("1f1b", 4, 8)
    report = verify(plan)
    program = list(plan.programs[3])
    f = next(i for i, op in enumerate(program) if str(op) == "3F0")
    b = next(i for i, op in enumerate(program) if str(op) == "3B0")
    program[f], program[b] = program[b], program[f]
    broken = attrs.evolve(plan, programs=plan.programs[:3] + (tuple(program),))
    verdicts = kernel.prove(broken, report.witness, sizes=report.sizes)
    assert verdicts["dependency"].status == "failed"
    assert verdicts["completeness"].status == "proved"


def test_an_empty_plan_is_still_proved_by_z3(monkeypatch):
    """A property without facts is proved by a Z3 query too (the empty disjunction)."""
    import z3
    answers = []
    real = z3.Solver.check

    def counted(self, *args):
        answers.append(real(self, *args))
        return answers[-1]
    monkeypatch.setattr(z3.Solver, "check", counted)
    plan = Plan(Placement((0,), 1), 0, ((),))
    witness = kernel.Witness(((),), ((),), ((0,),), (0,), (-1,))
    assert {v.status for v in kernel.prove(plan, witness).values()} == {"proved"}
    assert answers == [z3.unsat] * 5


def _deferred_receives(name, p, m):
    return defer_receives(lowered(name, p, m))


@pytest.mark.parametrize("make", [
    functools.partial(lowered, "interleaved-1f1b", 8, 32, 2),
    functools.partial(_deferred_receives, "1f1b", 4, 8),
])
@pytest.mark.parametrize("rlimit", [None, 1])
def test_two_process_verdicts_equal_one_process(make, rlimit):
    """verify_loaded (this process decides completeness and memory, the forked child
    dependency, matching and deadlock) reaches the same verdicts as verify."""
    one = verify(make(), rlimit=rlimit)
    _, two = verify_loaded(make, rlimit=rlimit)
    assert two.status == one.status
    assert [v.message for v in two.violations] == [v.message for v in one.violations]
    assert {k: v["status"] for k, v in two.stats["properties"].items()} == \
        {k: v["status"] for k, v in one.stats["properties"].items()}
    assert (two.certificate is None) == (one.certificate is None)
    assert two.witness == one.witness


def test_the_kernel_imports_only_the_ir():
    """The kernel shares no code with the semantics, the passes or the lowering: of the
    package it imports the IR alone, and beyond the standard library only attrs, numpy
    and Z3."""
    import ast
    import pathlib
    import sys
    files = sorted(pathlib.Path(kernel.__file__).parent.glob("*.py"))
    source = "\n".join(f.read_text() for f in files)
    trees = [ast.parse(f.read_text()) for f in files]
    nodes = [node for tree in trees for node in ast.walk(tree)]
    own = {f.stem for f in files}  # ``from .rules import ...``: the kernel's own modules
    local = {(node.level, node.module) for node in nodes
             if isinstance(node, ast.ImportFrom) and node.level}
    assert {module for level, module in local if level > 1} == {"ir"}
    assert {module for level, module in local if level == 1} <= own
    named = {alias.name for node in nodes if isinstance(node, ast.Import)
             for alias in node.names} | {node.module for node in nodes
                                         if isinstance(node, ast.ImportFrom) and not node.level}
    assert {x.split(".")[0] for x in named} - set(sys.stdlib_module_names) == {
        "attrs", "numpy", "z3"}
    # nor the hint a reader leaves for the passes
    assert "op_cells" not in source and "_KNOWN_CELLS" not in source


@pytest.mark.parametrize("name, violated", [
    ("false_accept_no_all_reduce", {"completeness"}),
    ("false_accept_narrow_all_reduce", {"completeness"}),
    ("false_accept_broadcast_for_all_reduce", {"completeness"}),
    ("false_accept_broadcast_root_7", {"completeness", "matching"}),
])
def test_the_collectives_the_cut_requires_are_checked(name, violated, capsys):
    """Owner mode: encoder gradients must be all-reduced over every rank that runs the
    encoder's backward and its home; parameters come from a broadcast rooted at home.
    Each broken variant is rejected with the property it violates, and its sibling's
    certificate (digest made its own) does not prove it."""
    import json
    from mpipe_verified.cli import main
    from plan_edits import FIXTURE_DIR
    assert main(["check", str(FIXTURE_DIR / f"{name}.json"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {v["property"] for v in doc["violations"]} == violated
    valid = fixture("owner_transpose")
    report = verify(valid)
    assert report.verified
    broken = fixture(name)
    cert = report.portable_certificate(valid)
    cert["digest"] = kernel.digest(broken)
    proven, reasons = kernel.recheck(broken, cert)
    assert not proven and any(r.startswith("completeness") for r in reasons)


def test_claims_about_places_that_do_not_exist_are_rejected_not_raised():
    """Claims come from untrusted passes: one about a position past a program's end, a
    rank the plan lacks, or of the wrong shape is rejected, and the others still judged."""
    plan = fixture("recv_first_deadlock")
    dead = [("cycle", ((0, 0), (1, 0)))]
    assert kernel.confirm(plan, "deadlock", dead) == ["violated"]
    for name, bad in [("dependency", ("input", 0, 99)), ("dependency", ("input", 7, 0)),
                      ("memory", ("peak", 9, 0)), ("deadlock", ("stuck", 5, 5)),
                      ("deadlock", ("cycle", ((0, 99), (1, 0)))), ("deadlock", ("cycle",)),
                      ("completeness", ("unit",)), ("deadlock", ("cycle", ((0, -2),))),
                      ("dependency", ("input", -1, 0)), ("memory", ("peak", -1, 0))]:
        answers = kernel.confirm(plan, name, [bad] + (dead if name == "deadlock" else []),
                                 limits=(1, 1))
        assert answers[0] == "rejected", (name, bad)
        assert answers[1:] == (["violated"] if name == "deadlock" else [])


def test_a_witness_or_size_that_is_not_an_exact_number_is_refused():
    """Floats would be truncated in the SMT text: a witness must hold ints (times,
    positions) and ints or Fractions (levels, peaks), in tuples; sizes exact and >= 0."""
    from fractions import Fraction
    plan = lowered("1f1b", 2, 2)
    w = verify(plan).witness
    for bad in [dict(levels=((0.5, 1.5),) + w.levels[1:]), dict(peaks=(1.5,) + w.peaks[1:]),
                dict(finish=({0: 1},) + w.finish[1:]), dict(producers=[list(p) for p in
                                                                       w.producers])]:
        with pytest.raises(ValueError):
            attrs.evolve(w, **bad)
    attrs.evolve(w, levels=tuple(tuple(Fraction(x) for x in lv) for lv in w.levels))
    for sizes in [dict(stored={("", 0): 0.5}), dict(static=(-1,))]:
        with pytest.raises(ValueError):
            kernel.Sizes(**sizes)
    with pytest.raises(TypeError):
        literal(0.5)


def test_sizes_of_asks_the_model_for_every_receive_and_keeps_the_nonzero_ones():
    """``Sizes.of`` against a plain walk over the plan (groups and overlapped steps
    opened) with the semantics' own ``received`` (a shipped raw input also holds the RNG
    state): the same buffer for every payload received, none for a zero-sized one; a
    size the model gives as a float is kept exactly."""
    from mpipe_verified.algebra.transpose import transpose_family
    from mpipe_verified.ir import Recv, p2p_of
    from mpipe_verified.lower import lower
    from strategies import RandomChooser, with_groups
    import random
    plan = with_groups(lower(transpose_family(2, 3, None, body="1f1b", side="source",
                                              mode="recompute").derive()),
                       RandomChooser(random.Random(3)))
    model = MemoryModel(stored=lambda s, seg: 1.5 if seg else 1.0,
                        buffer=lambda p: {"act": 0.25, "grad": 0.0}.get(p.kind, 0.5),
                        static=(2.0, 0.75), rng_state=0.125)
    received = {c.payload for prog in plan.programs for op in prog for c in p2p_of(op)
                if isinstance(c, Recv)}
    assert {p.kind for p in received} == {"act", "grad", "input"}
    want = {p: Fraction(model.received(p)) for p in received if model.received(p)}
    sizes = kernel.Sizes.of(plan, model)
    assert sizes.buffer == want and sizes.static == (2, Fraction(3, 4))
    assert sizes.stored == {("", 0): 1, ("", 1): 1, ("vision", 0): Fraction(3, 2)}
    assert read_sizes(sizes_json(sizes)) == sizes


def test_recheck_says_under_what_it_proved_and_can_require_it(tmp_path, capsys):
    """A certificate proves under its own comm model, limits and sizes: recheck prints
    them, and with --comm-model / --memory-limit requires them (a deadlocking plan
    'certified' under eager is refused once rendezvous is asked for)."""
    import json
    from mpipe_verified.cli import main
    plan = fixture("steady_exchange_ungrouped")
    assert verify(plan).status == "violated"  # deadlocks under rendezvous
    eager = verify(plan, comm_model="eager")
    assert eager.verified
    cert = tmp_path / "cert.json"
    cert.write_text(json.dumps(eager.portable_certificate(plan)))
    from plan_edits import FIXTURE_DIR
    path = str(FIXTURE_DIR / "steady_exchange_ungrouped.json")
    capsys.readouterr()
    assert main(["recheck", path, str(cert)]) == 0
    assert "under the eager model" in capsys.readouterr().out
    assert main(["recheck", path, str(cert), "--comm-model", "rendezvous"]) == 3
    assert main(["recheck", path, str(cert), "--memory-limit", "4"]) == 3


def test_a_certificate_with_short_or_odd_fields_is_not_established():
    plan = lowered("1f1b", 2, 2)
    good = verify(plan).portable_certificate(plan)
    for edit in [lambda c: c["witness"].update(peaks=[]),
                 lambda c: c["witness"].update(peak_at=[0]),
                 lambda c: c.update(memory_limit="72"),
                 lambda c: c["witness"].update(levels=[["1e999999999"], ["0"]]),
                 lambda c: c["sizes"].update(static=["NaN", 0])]:
        import copy
        cert = copy.deepcopy(good)
        edit(cert)
        proven, reasons = kernel.recheck(plan, cert)
        assert not proven and reasons


def test_the_ir_holds_no_nested_or_mixed_steps():
    """A group holds sends and receives, an overlapped step compute ops: the places the
    kernel looks into (one level) are all there is."""
    from mpipe_verified.ir import Collective, Compute, Group, Overlap, Payload, Recv, Send
    recv = Recv(0, Payload("act", 0, 0))
    for bad in [lambda: Group((Group((recv,)),)), lambda: Group((Compute("F", 0, 0),)),
                lambda: Group((Collective("all_reduce", (0, 1)),)),
                lambda: Overlap((Compute("F", 0, 0), Send(0, Payload("act", 0, 0))))]:
        with pytest.raises(ValueError):
            bad()
