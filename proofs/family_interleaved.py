"""Interleaved 1F1B's invariants, bounded (``proofs.ground``): every ``p <= 8, m <= 16``
and chunks 2 and 3, on package-derived instances; matching and deadlock of the lowered
plan by ``proofs.lowered`` (all sizes) once the bounded data-flow timing reaches every op.

Not all sizes: the schedule has no closed form here. Its rank programs are 1F1B-shaped
over ``n = m v`` units, but the unit order (rounds of ``g = ceil(m / max(1, m // p))``
microbatches, the last one shorter) is nonlinear in ``m``, ``v`` and ``g``, and a
data-flow timing for ``m < p`` must include the idle steps where rank 0 waits for the
previous chunk to come round the ring, for which no closed form is proven.
"""

from __future__ import annotations

from .core import bounded, law
from .ground import family_obligations
from .lowered import deadlock_obligations, matching_obligations

NAME = "interleaved-1f1b"
P_MAX, M_MAX, CHUNKS = 8, 16, (2, 3)
SCOPE = bounded(f"p <= {P_MAX}, m <= {M_MAX}, chunks in {{2, 3}}; package-derived "
                "instances (no closed form of the round-robin unit order and its timing)")


def covers(params) -> bool:
    return (params["pp"] <= P_MAX and params["microbatches"] <= M_MAX
            and params.get("chunks") in CHUNKS)


def rounds_group(pp: int, mm: int) -> int:
    """Microbatches per round (``algebra.families.interleaved_1f1b``)."""
    return -(-mm // max(1, mm // pp))


def peak_of(pp: int, mm: int, v: int, r: int) -> int:
    """Rank r's unit-model peak: its warmup forwards plus one, at most all ``m v``."""
    return min((v - 1) * rounds_group(pp, mm) + 2 * (pp - 1 - r) + 1, mm * v)


def peaks(params) -> tuple[int, ...]:
    pp, mm, v = params["pp"], params["microbatches"], params["chunks"]
    return tuple(peak_of(pp, mm, v, r) for r in range(pp))


def _ground(prop, peak=None):
    return family_obligations(NAME, prop, P_MAX, M_MAX, CHUNKS, peak)


def _cell(prop: str, statement: str, weight: int, obligations, **extra):
    return law(f"interleaved_1f1b_{prop}", f"interleaved 1F1B: {statement}", SCOPE,
               weight=weight, family=NAME, property=prop, covers=covers, **extra)(obligations)


interleaved_completeness = _cell(
    "completeness", "every F(s, x) and B(s, x) exactly once, on the rank owning s, and "
    "nothing else", 6, lambda: _ground("completeness"))
interleaved_dependency = _cell(
    "dependency", "a data-flow timing (the package's) respects every input and each "
    "rank's order: the schedule runs", 10, lambda: _ground("dependency"))
interleaved_memory = _cell(
    "memory", "the unit-model peak on rank r is exactly min((v-1) g + 2 (p-1-r) + 1, m v), "
    "g = ceil(m / max(1, m // p))", 6, lambda: _ground("memory", peak_of), peak=peaks)
interleaved_matching = _cell(
    "matching", "the lowered plan pairs each send with its receive (FIFO per rank pair, "
    "equal counts and payloads)", 10,
    lambda: [*matching_obligations(), *_ground("matching")])
interleaved_deadlock = _cell(
    "deadlock", "the lowered plan runs to completion under rendezvous (completion-time "
    "witness: each op's place in lowering's event order)", 10,
    lambda: [*deadlock_obligations(), *_ground("deadlock")])
