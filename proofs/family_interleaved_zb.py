"""Interleaved zero bubble (``algebra.families.interleaved_zb``, torch's
``ScheduleInterleavedZeroBubble``): interleaved 1F1B's rounds with split backwards,
``(v-1) g + p-1-r`` warmup forwards, rank ``r`` holding back its first ``r`` weight
gradients.

**Bounded** (``proofs.instances.chunked_family_laws``): every property of the package's
derived and lowered plans for ``p <= P_MAX``, ``m <= M_MAX``, chunks 2 and 3, checked by
the verification kernel's obligations. The unit-model peak is ``min((v-1) g + p, v m)``
on every rank, ``g = ceil(m / max(1, m // p))``: the warmup, rank ``r``'s ``r`` held-back
weight gradients and one steady forward. All sizes would follow interleaved 1F1B's
potential argument (``proofs.family_interleaved``) with the W queue added; not done.
"""

from __future__ import annotations

from .instances import chunked_family_laws

P_MAX, M_MAX, CHUNKS = 4, 8, (2, 3)


def peak(p: int, m: int, v: int, r: int) -> int:
    g = -(-m // max(1, m // p))
    return min((v - 1) * g + p, v * m)


(interleaved_zb_completeness, interleaved_zb_dependency, interleaved_zb_matching,
 interleaved_zb_deadlock, interleaved_zb_memory) = chunked_family_laws(
    "interleaved-zb", "interleaved zero bubble", peak, "min((v-1) g + p, v m), "
    "g = ceil(m / max(1, m // p))", P_MAX, M_MAX, CHUNKS)
