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
    """Every producer list of the right length, each entry any position (or -1), put to
    the kernel: none proves ``dependency``."""
    honest = verify(attrs.evolve(plan, seq_chunks=1)).witness
    chain = Chain.of(plan)
    needs = sum(len(chain.needs(op, 0)) for op in plan.programs[0])
    n = len(plan.programs[0])
    for given in itertools.product(range(-1, n), repeat=needs):
        forged = attrs.evolve(honest, producers=(given,))
        if kernel.prove(plan, forged, properties=("dependency",))["dependency"].status \
                == "proved":
            return False
    return True


def test_seq_chunks_is_validated():
    with pytest.raises(ValueError, match="does not divide"):
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
    assert not _no_witness_proves_dependency(plan)  # the search finds the honest one


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
