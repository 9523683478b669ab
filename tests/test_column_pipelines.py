"""The column passes read plans of several pipelines, overlapped steps and collective calls
(``op_table(plan, overlapped=True)``, what the verifier builds) and propose exactly what
the op-by-op passes propose: the same findings-or-not, the same dependency producers,
memory levels and peaks, and deadlock-run times (collectives included) under both comm
models; on valid plans of every family of several pipelines and of overlapped steps, and
on one-edit mutants of them and of other plans."""

import attrs
from hypothesis import given, settings, strategies as st

from mpipe_verified.algebra import family
from mpipe_verified.ir import Collective, Compute, Overlap, Placement, Plan
from mpipe_verified.question import Question
from mpipe_verified.semantics import (COMM_MODELS, UNIT_MEMORY, Chain, MemoryModel, comm_ticks,
                                      op_table, work_complete)
from mpipe_verified.lower import lower
from mpipe_verified.verify import passes
import strategies as S

WIDE = (("dualpipe", 4, 8, None), ("dualpipe", 2, 6, None), ("chimera", 4, 8, None),
        ("bitpipe", 4, 8, None), ("dualpipev", 3, 6, None), ("zbv", 2, 4, None),
        ("1f1b", 3, 5, None))


def _agree(plan, model=UNIT_MEMORY, limits=None) -> None:
    """Each pass by the verifier's table and op by op: findings or not, and the hint."""
    table = op_table(plan, overlapped=True)
    if table is None:
        return
    runs = {"completeness": lambda t: passes.completeness(plan, t),
            "dependency": lambda t: passes.dependency(plan, t),
            "matching": lambda t: passes.matching(plan, table=t),
            **{comm: lambda t, comm=comm: passes.deadlock(plan, comm, table=t)
               for comm in COMM_MODELS},
            "memory": lambda t: passes.memory(plan, model, limits, t)}
    for name, run in runs.items():
        fast, slow = run(table), run(None)
        assert (bool(fast[0]),) + tuple(fast[1:]) == (bool(slow[0]),) + tuple(slow[1:]), name


def _columns_apply(plan) -> None:
    """A valid plan is answered by the columns themselves, as op by op would."""
    table = op_table(plan, overlapped=True)
    chain = Chain.of(plan)
    assert table is not None and work_complete(table, chain)
    assert passes._producers(table, chain) == passes.dependency(plan)[1]
    assert passes._levels(table, UNIT_MEMORY, None) is not None
    assert passes._clean(plan, table)
    for comm in COMM_MODELS:
        assert comm_ticks(table, comm, calls=True) == passes.deadlock(plan, comm)[1]


def test_the_column_forms_apply_to_plans_of_several_pipelines_and_overlaps():
    for name, p, m, v in WIDE:
        plan = lower(family(name, p, m, v).derive())
        _columns_apply(plan)
        _agree(plan)
        _agree(plan, MemoryModel(stored=lambda stage, segment: float(stage % 3 + 1),
                                 static=(1.0,) * p), (6,) * p)


def test_transfers_alone_are_timed_in_the_run_with_the_collectives():
    """Without ``calls``, ``comm_ticks`` lists the transfers' times of the run that has
    the collectives in it."""
    plan = lower(family("dualpipe", 4, 8).derive())
    table = op_table(plan, overlapped=True)
    every = comm_ticks(table, "rendezvous", calls=True)
    alone = comm_ticks(table, "rendezvous")
    kept = [[t for op, t in zip([o for o in program if type(o).__name__ in
                                 ("Send", "Recv", "Collective")], ticks)
             if type(op) is not Collective] for program, ticks in zip(plan.programs, every)]
    assert [list(x) for x in alone] == kept
    assert sum(map(len, every)) > sum(map(len, alone))


def test_overlaps_are_read_only_when_asked_and_never_with_sequence_chunks():
    both = Overlap((Compute("F", 0, 0), Compute("B", 0, 1)))
    plan = Plan(Placement((0,), 1), 2, ((Compute("F", 0, 1), both, Compute("B", 0, 0)),))
    assert op_table(plan) is None and op_table(plan, overlapped=True) is not None
    assert op_table(attrs.evolve(plan, seq_chunks=2), overlapped=True) is None
    _agree(plan)


@st.composite
def wide_mutants(draw):
    """``(base, mutant, memory limit)``: a plan of ``WIDE`` or of the strategies'
    families (collectives and groups sometimes added) and one edit of it."""
    ch = S.DrawChooser(draw)
    if draw(st.booleans()):
        name, p, m, v = ch.pick(list(WIDE))
        base = lower(family(name, p, m, v).derive())
        kinds = [k for k in S.MUTATIONS if k in S.applicable(base)]
        broken = S.mutate(base, ch.pick(kinds), ch)[0] if kinds else base
        return base, broken, S.memory_limit_for(base, ch)
    base, _, _, broken, limit = S.random_mutant(ch, families=True)
    return base, broken, limit


def _sized(sizes: list[int], ranks: int) -> MemoryModel:
    """Integer stored sizes by stage (cycling through ``sizes``) and static parts."""
    return MemoryModel(stored=lambda stage, segment: float(sizes[stage % len(sizes)]),
                       static=tuple(float(r % 3) for r in range(ranks)))


@settings(max_examples=100, deadline=None)
@given(wide_mutants(), st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_column_passes_agree_with_op_by_op_on_wide_plans(mutant, sizes):
    base, broken, limit = mutant
    for plan in (base, broken):
        _agree(plan)
        _agree(plan, _sized(sizes, base.num_ranks),
               Question(memory_limit=limit).limits(plan.num_ranks))
