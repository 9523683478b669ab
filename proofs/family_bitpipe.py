"""BitPipe (``algebra.families.BIDIRECTIONAL``): two V-shaped pipelines in opposite
directions over one model (docs/semantics.md §2.9), four stages a rank; its five
invariants **bounded**: every package-derived, lowered instance with ``p <= 8`` (even) and
``m <= 16`` a multiple of ``p`` is checked by the verification kernel's obligations
(``proofs.instances``), the replica all-reduces the lowering appends included. No word
model is derived: its rounds depend on ``min(r, p-1-r)`` across four chunks, and the
twin reduction of DualPipe and Chimera (``proofs.family_bidirectional``) maps two
pipelines of one stage a rank onto a V, not two V's. Unit-model peak
``3p/2 + 1 + min(r, p-1-r)``."""

from __future__ import annotations

from mpipe_verified.algebra.families import family

from . import instances
from .core import bounded, law

P_MAX, M_MAX = 8, 16
STATEMENTS = {
    "completeness": "F and B once each per stage and microbatch of its pipeline, on the "
                    "rank owning the stage, each replica all-reduce once on every rank "
                    "holding a replica, and nothing else",
    "dependency": "every input made before its consumer (the package's data-flow timing), "
                  "each replica all-reduce after every local weight gradient it sums",
    "matching": "the lowered plan pairs each send with its receive, none leaves its "
                "pipeline, the replica all-reduces line up",
    "deadlock": "the lowered plan runs to completion under rendezvous",
    "memory": "the unit-model peak of rank r is as stated (3p/2 + 1 + min(r, p-1-r))",
}


def _instances(pp: int):
    return ([family("bitpipe", pp, mm).derive() for mm in range(pp, M_MAX + 1, pp)]
            if pp % 2 == 0 else [])


def _peak(pp: int, mm: int, r: int) -> int:
    return 3 * pp // 2 + 1 + min(r, pp - 1 - r)


def _law(prop: str):
    scope = bounded(f"p <= {P_MAX} even, m <= {M_MAX} (m a multiple of p); package-derived "
                    "and lowered instances, each checked by the verification kernel's "
                    "obligations")

    @law(f"bitpipe_{prop}", f"BitPipe: {STATEMENTS[prop]}", scope, weight=3,
         family="bitpipe", property=prop)
    def checked():
        yield from instances.obligations(f"BitPipe, {prop}", _instances, P_MAX, prop,
                                         _peak if prop == "memory" else None)
    return checked


(bitpipe_completeness, bitpipe_dependency, bitpipe_matching, bitpipe_deadlock,
 bitpipe_memory) = (_law(prop) for prop in
                    ("completeness", "dependency", "matching", "deadlock", "memory"))
