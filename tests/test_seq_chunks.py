"""Sequence chunks (docs/semantics.md §2.5): microbatch ``sample * S + j`` is chunk ``j``;
a chunk's forward needs the previous chunk's forward, a chunk's backward the next chunk's
backward, each on the same rank. Each rule broken alone is rejected by the kernel."""

from __future__ import annotations

import itertools

import attrs
import pytest

from canonical_decoder import decode
from mpipe_verified import kernel
from mpipe_verified.ir import Compute, Placement, Plan, Schedule
from mpipe_verified.lower import lower
from mpipe_verified.semantics import Chain
from mpipe_verified.verify import verify
from reference import judge_plan


def _one_rank(order: str, seq_chunks: int = 2) -> Plan:
    """One rank, one stage, two chunks of one sample: ``order`` like ``"F0 F1 B1 B0"``
    (complete, nothing to match, nothing to wait for)."""
    ops = tuple(Compute(x[0], 0, int(x[1:])) for x in order.split())
    return Plan(Placement((0,), 1), 2, (ops,), seq_chunks=seq_chunks)


def _no_witness_proves_dependency(plan: Plan) -> bool:
    """Each input's true first producer on the rank where there is one before the op;
    every input without one (the chunk rule's) given every position (or -1), in every
    combination: no such witness makes the kernel prove ``dependency``."""
    honest = verify(attrs.evolve(plan, seq_chunks=1)).witness
    chain, program = Chain.of(plan), plan.programs[0]
    made: dict = {}
    fixed, free = [], []
    for index, op in enumerate(program):
        for token in sorted(chain.needs(op, 0)):
            at = made.get(token)
            fixed.append(at if at is not None else -1)
            if at is None:
                free.append(len(fixed) - 1)
        for token in chain.produces(op):
            made.setdefault(token, index)
    for values in itertools.product(range(-1, len(program)), repeat=len(free)):
        given = list(fixed)
        for k, v in zip(free, values):
            given[k] = v
        forged = attrs.evolve(honest, producers=(tuple(given),))
        if kernel.prove(plan, forged, properties=("dependency",))["dependency"].status \
                == "proved":
            return False
    return True


def test_seq_chunks_is_validated():
    with pytest.raises(ValueError, match="dividing the microbatches"):
        Plan(Placement((0,), 1), 3, ((),), seq_chunks=2)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="seq_chunks"):
            Schedule(Placement((0,), 1), 2, ((),), seq_chunks=bad)


def test_the_canonical_header_names_seq_chunks_only_when_not_one():
    plan = _one_rank("F0 F1 B1 B0")
    assert plan.canonical_text().split("\n")[0] == "placement=0;m=2;seq_chunks=2"
    plain = attrs.evolve(plan, seq_chunks=1)
    assert plain.canonical_text().split("\n")[0] == "placement=0;m=2"
    assert decode(plan.canonical_text()) == plan and decode(plain.canonical_text()) == plain
    assert kernel.digest(plan) != kernel.digest(plain)


def test_chunks_in_order_verify():
    plan = _one_rank("F0 F1 B1 B0")
    assert verify(plan).status == "verified"
    assert judge_plan(plan).ok
    assert not _no_witness_proves_dependency(plan)  # the honest producers prove it


@pytest.mark.parametrize("order, cell", [("F1 F0 B1 B0", "0F1"), ("F0 F1 B0 B1", "0B0")])
def test_a_chunk_before_its_predecessor_is_rejected_by_the_kernel(order, cell):
    """The forward of chunk 1 before chunk 0's, or the backward of chunk 0 before chunk
    1's: otherwise valid (verified as two independent microbatches), violated as two
    chunks, named by its cell; no producer positions at all make the kernel prove it."""
    plan = _one_rank(order)
    assert verify(attrs.evolve(plan, seq_chunks=1)).status == "verified"
    report = verify(plan)
    assert report.status == "violated"
    assert [v.property for v in report.violations] == ["dependency"]
    assert report.violations[0].ops[0][2] == cell and "chunk" in report.violations[0].message
    assert judge_plan(plan).violated == {"dependency"}
    assert _no_witness_proves_dependency(plan)


def test_a_lowered_plan_of_chunks_keeps_them_and_is_judged_alike():
    """Two ranks, two samples of two chunks: chunk order kept (verified) or the backward
    stream in microbatch order (violated), the kernel and the reference agreeing."""
    def schedule(backwards):
        programs = []
        for s in range(2):
            f = [Compute("F", s, u) for u in range(4)]
            b = [Compute("B", s, u) for u in backwards]
            programs.append(tuple(f + b))
        return Schedule(Placement((0, 1), 2), 4, tuple(programs), seq_chunks=2)
    good, bad = lower(schedule([1, 0, 3, 2])), lower(schedule([0, 1, 2, 3]))
    assert good.seq_chunks == 2
    assert verify(good).status == "verified" and judge_plan(good).ok
    assert verify(bad).status == "violated" and "dependency" in judge_plan(bad).violated


@pytest.mark.parametrize("order, cell", [("F0 F1 I0 W0 I1 W1", "0I0"),
                                         ("F0 F1 I1 I0 W1 W0", None),
                                         ("F0 F1 I1 W1 I0 W0", None)])
def test_the_split_backward_of_a_chunk_waits_for_the_next_chunk_s_input_gradient(order, cell):
    """``I`` stands for a chunk's backward; ``W`` is free of the chunk rule."""
    plan = _one_rank(order)
    report = verify(plan)
    assert report.status == ("verified" if cell is None else "violated")
    assert judge_plan(plan).ok == (cell is None)
    if cell is not None:
        assert [v.ops[0][2] for v in report.violations] == [cell]
        assert _no_witness_proves_dependency(plan)


def test_the_column_form_gives_the_op_by_op_hint_on_chunks():
    """The dependency hint by columns (classes split by the chunk's place in its sample)
    is the op-by-op one, on seq1f1b plans with 2 and 3 chunks, split or not."""
    from mpipe_verified.algebra.families import family
    from mpipe_verified.algebra.terms import SplitBW
    from mpipe_verified.semantics import op_table
    from mpipe_verified.verify import passes
    for term in (family("seq1f1b", 3, 3), family("seq1f1b", 4, 2, seq_chunks=3),
                 SplitBW(family("seq1f1b", 2, 3, seq_chunks=3))):
        plan = lower(term.derive())
        table = op_table(plan)
        by_columns = passes.dependency(plan, table)[1]
        assert by_columns is not None and by_columns == passes.dependency(plan, None)[1]


def test_with_pipelines_a_sample_s_chunks_lie_in_one_pipeline():
    placement = Placement((0, 1), 2)
    Plan(placement, 4, ((), ()), pipelines=((0, 1), (2, 3)), seq_chunks=2)
    with pytest.raises(ValueError, match="seq_chunks"):
        Plan(placement, 4, ((), ()), pipelines=((0, 2), (1, 3)), seq_chunks=2)
