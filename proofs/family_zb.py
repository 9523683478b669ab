"""ZB-H1 and ZB-H2 invariants, bounded (``proofs.instances``): every ``p <= 8, m <= 16``
on package-derived and lowered instances, each property stated by the verification
kernel's own obligations.

Not all sizes: no closed form of these patterns is proven. Their phases (``(F I)^r``,
``(F I W)*``, ...) stop early in different orders when ``m`` is small against ``p`` and
``r``, and the deferred ``W`` queue makes each case's closed form, its inverse and a
data-flow timing for it a separate derivation that is not done yet.
"""

from __future__ import annotations

from mpipe_verified.algebra.families import family

from . import instances
from .core import bounded, law

P_MAX, M_MAX = 8, 16
SCOPE = bounded(f"p <= {P_MAX}, m <= {M_MAX}; package-derived and lowered instances, each "
                "checked by the verification kernel's obligations (no closed form of the "
                "phases that stop early for small m)")


def covers(params) -> bool:
    return params["pp"] <= P_MAX and params["microbatches"] <= M_MAX


PEAKS = {"zb-h1": (lambda pp, mm, v, r: min(pp, mm), "min(p, m)"),
         "zb-h2": (lambda pp, mm, v, r: min(2 * pp - 1, mm), "min(2p - 1, m)")}


def _cells(name: str, title: str, weight: int):
    prefix = name.replace("-", "_")
    peak, peak_text = PEAKS[name]

    def checked(prop, pk=None):
        def sizes(pp):
            return [family(name, pp, mm).derive() for mm in range(1, M_MAX + 1)]
        stated = None if pk is None else (lambda pp, mm, r: pk(pp, mm, None, r))
        return instances.obligations(title, sizes, P_MAX, prop, stated)

    def cell(prop, statement, obligations, **extra):
        return law(f"{prefix}_{prop}", f"{title}: {statement}", SCOPE, weight=weight,
                   family=name, property=prop, covers=covers, **extra)(obligations)
    return (
        cell("completeness", "F, I and W once each per stage and microbatch, on the rank "
             "owning the stage, and nothing else", lambda: checked("completeness")),
        cell("dependency", "a data-flow timing (the package's) respects every input and "
             "each rank's order: the schedule runs", lambda: checked("dependency")),
        cell("memory", f"the unit-model peak on every rank is exactly {peak_text}",
             lambda: checked("memory", peak),
             peak=lambda params: tuple(peak(params["pp"], params["microbatches"], None, r)
                                       for r in range(params["pp"]))),
        cell("matching", "the lowered plan pairs each send with its receive (FIFO per rank "
             "pair, equal counts and payloads)",
             lambda: checked("matching")),
        cell("deadlock", "the lowered plan runs to completion under rendezvous "
             "(completion-time witness: each op's place in lowering's event order)",
             lambda: checked("deadlock")),
    )


(zb_h1_completeness, zb_h1_dependency, zb_h1_memory, zb_h1_matching,
 zb_h1_deadlock) = _cells("zb-h1", "ZB-H1", 4)
(zb_h2_completeness, zb_h2_dependency, zb_h2_memory, zb_h2_matching,
 zb_h2_deadlock) = _cells("zb-h2", "ZB-H2", 4)
