"""``transpose`` (``algebra.transpose``), source side: modes recompute, owner, frozen and
none; ownership inline, full and min; bodies 1F1B and interleaved 1F1B (2 chunks).

**Bounded.** Every property is checked on the package's derived and lowered plans of all
24 variants for every ``p <= P_MAX, m <= M_MAX`` (``proofs.instances``: the verification
kernel's obligations, one Z3 query per ``p``). Inline ownership over a 1F1B body is also
proven for all sizes (``proofs.family_transpose_inline``: it has a closed form); the other
variants are not: the operator places each segment op by a greedy search over the idle
gaps of the body's estimated timeline (floating-point costs), which has no closed form
over symbolic ``p, m``.

**Peaks (unit model).** With ``body(r)`` the body's peak on rank ``r`` — 1F1B:
``min(p - r, m)``; interleaved 1F1B: ``min(2m, g + 2(p-1-r) + 1)``, ``g = ceil(m /
max(1, m // p))`` microbatches per round — the peak is exactly ``body(r)`` for modes
frozen and none (nothing of the segment is stored) and, over a 1F1B body with inline
ownership, ``body(r) + min(p, m)`` on rank 0 for the trainable modes (each stored segment
activation waits on its home rank for the body's first-stage backward). Elsewhere (full
or min ownership, or an interleaved body, with a trainable mode) the greedy placement
makes the peak irregular: the law proves the bound ``body(r) + m``.
"""

from __future__ import annotations

from mpipe_verified.algebra.transpose import transpose_family

from . import instances
from .core import Obligation, bounded, law

P_MAX, M_MAX = 5, 10
MODES = ("recompute", "owner", "frozen", "none")
OWNERSHIPS = ("inline", "full", "min")
BODIES = ("1f1b", "interleaved-1f1b")
VARIANTS = [(body, mode, own) for body in BODIES for mode in MODES for own in OWNERSHIPS]
SCOPE = bounded(f"p <= {P_MAX}, m <= {M_MAX}, every mode, ownership inline/full/min and "
                "body 1f1b/interleaved-1f1b (2 chunks); package-derived and lowered "
                "instances, each checked by the verification kernel's obligations; all "
                "sizes (proven for inline ownership over a 1F1B body by the "
                "transpose_inline laws) needs a closed form of the operator's greedy gap "
                "placement over floating-point estimates, which it does not have")


def _schedules(pp: int):
    for body, mode, own in VARIANTS:
        for mm in range(1, M_MAX + 1):
            yield (body, mode, own), transpose_family(pp, mm, body=body, mode=mode,
                                                      ownership=own).derive()


def body_peak(body: str, p: int, m: int, r: int) -> int:
    if body == "1f1b":
        return min(p - r, m)
    per_round = -(-m // max(1, m // p))
    return min(2 * m, per_round + 2 * (p - 1 - r) + 1)


def peak(body: str, mode: str, ownership: str):
    """``(peak(p, m, r), exact)``: the stated peak of a variant, and whether it is exact
    (else an upper bound); see the module docstring."""
    if mode in ("frozen", "none"):
        return (lambda p, m, r: body_peak(body, p, m, r)), True
    if body == "1f1b" and ownership == "inline":
        return (lambda p, m, r: body_peak(body, p, m, r) + (min(p, m) if r == 0 else 0)), True
    return (lambda p, m, r: body_peak(body, p, m, r) + m), False


def _obligations(prop: str):
    for pp in range(1, P_MAX + 1):
        parts = []
        for (body, mode, own), sched in _schedules(pp):
            stated, exact = peak(body, mode, own) if prop == "memory" else (None, True)
            parts.append(instances.violation(sched, prop, stated, exact))
        yield Obligation(f"transpose p={pp}: {prop} of every variant and m <= {M_MAX}",
                         smt=instances.none_of(parts))


def _law(name: str, prop: str, statement: str):
    @law(name, f"transpose (source side): {statement}", SCOPE, weight=6,
         family="transpose", property=prop)
    def run():
        yield from _obligations(prop)
    return run


transpose_completeness = _law(
    "transpose_completeness", "completeness",
    "every body and segment unit (F; B, or I and W; R where recomputed) exactly once on "
    "the rank that owns it, the parameter broadcast and gradient all-reduce the cut "
    "requires on every rank that needs them, and nothing else")
transpose_dependency = _law(
    "transpose_dependency", "dependency",
    "in the lowered plan every op's inputs (segment boundaries included) are on its rank "
    "before it runs")
transpose_matching = _law(
    "transpose_matching", "matching",
    "the lowered plan pairs every send with the receive of the same payload, FIFO per "
    "channel, and every collective agrees across its members")
transpose_deadlock = _law(
    "transpose_deadlock", "deadlock",
    "the lowered plan runs to completion under rendezvous, collectives included (a "
    "completion-time witness checked by Z3)")
transpose_peak_memory = _law(
    "transpose_peak_memory", "memory",
    "the unit-model peak on rank r is body(r) for frozen and none, body(r) + min(p, m) on "
    "rank 0 over a 1F1B body with inline ownership, and at most body(r) + m otherwise")
