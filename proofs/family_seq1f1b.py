"""``seq1f1b`` (``algebra.families.seq1f1b``): 1F1B over sequence chunks, ``m`` samples
of ``S`` chunks each (microbatch ``sample * S + j``), forwards chunk-ascending and
backwards chunk-descending per sample, warmup ``p - r + S - 2`` chunk forwards.

**Bounded.** Every property, the chunk rules of docs/semantics.md §2.5 included, is
checked on the package's derived and lowered plans for every ``p <= P_MAX``,
``m <= M_MAX`` and ``2 <= S <= S_MAX`` (``proofs.instances``: the verification kernel's
obligations, one Z3 query per ``p``). All sizes would need a closed form of the weave
over chunk streams and of its lowering, with the chunk tokens in the dependency model
(``proofs/families.py`` states 1F1B's; the chunk rule adds an order between the
stream's own entries that its model does not state).

**Peak (unit model).** ``min(p - r + S - 1, m * S)`` on rank ``r``: the warmup's
forwards plus the one steady forward before the first backward, or every chunk when
there are no more.
"""

from __future__ import annotations

from mpipe_verified.algebra.families import family

from . import instances
from .core import Obligation, bounded, law

P_MAX, M_MAX, S_MAX = 5, 5, 4
SCOPE = bounded(f"p <= {P_MAX}, m <= {M_MAX} samples, 2 <= S <= {S_MAX} chunks per "
                "sample; package-derived and lowered instances, each checked by the "
                "verification kernel's obligations (the chunk rules included)")


def peak(p: int, m: int, s: int, r: int) -> int:
    return min(p - r + s - 1, m * s)


def _obligations(prop: str):
    for pp in range(1, P_MAX + 1):
        parts = []
        for mm in range(1, M_MAX + 1):
            for s in range(2, S_MAX + 1):
                stated = ((lambda p, m, r, s=s: peak(p, m // s, s, r)) if prop == "memory"
                          else None)  # m: the plan's microbatches, m // s samples
                sched = family("seq1f1b", pp, mm, seq_chunks=s).derive()
                parts.append(instances.violation(sched, prop, stated))
        yield Obligation(f"seq1f1b p={pp}: {prop} for m <= {M_MAX}, S <= {S_MAX}",
                         smt=instances.none_of(parts))


def _law(name: str, prop: str, statement: str):
    @law(name, f"seq1f1b: {statement}", SCOPE, weight=2, family="seq1f1b", property=prop)
    def run():
        yield from _obligations(prop)
    return run


seq1f1b_completeness = _law(
    "seq1f1b_completeness", "completeness",
    "every stage's F and B of every chunk of every sample exactly once, on the stage's rank")
seq1f1b_dependency = _law(
    "seq1f1b_dependency", "dependency",
    "in the lowered plan every op's inputs are on its rank before it runs: each chunk's "
    "forward after the previous chunk's, each chunk's backward after the next chunk's")
seq1f1b_matching = _law(
    "seq1f1b_matching", "matching",
    "the lowered plan pairs every send with the receive of the same payload, FIFO per "
    "channel")
seq1f1b_deadlock = _law(
    "seq1f1b_deadlock", "deadlock",
    "the lowered plan runs to completion under rendezvous (a completion-time witness "
    "checked by Z3)")
seq1f1b_peak_memory = _law(
    "seq1f1b_peak_memory", "memory",
    "the unit-model peak on rank r is min(p - r + S - 1, m * S)")
