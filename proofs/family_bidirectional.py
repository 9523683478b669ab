"""DualPipe, Chimera and BitPipe (``algebra.families.BIDIRECTIONAL``): two pipelines over one model
(docs/semantics.md §2.9), their five invariants **bounded**: every package-derived,
lowered instance with ``p <= 8`` (even), ``m <= 16`` the family allows is checked by the
verification kernel's obligations (``proofs.instances``), the replica all-reduces the
lowering appends included. No word model is derived for them yet (DualPipe's phases
depend on ``min(r, p-1-r)`` and on whether r is a middle rank, Chimera's and BitPipe's
on the same depth), so nothing is claimed for all sizes. Unit-model peaks: DualPipe
``p + 1`` on every rank, Chimera ``p/2 + 1 + min(r, p-1-r)``, BitPipe
``3p/2 + 1 + min(r, p-1-r)``."""

from __future__ import annotations

from mpipe_verified.algebra.families import family

from . import instances
from .core import bounded, law

P_MAX, M_MAX = 8, 16
SIZES = {"dualpipe": lambda pp: range(2 * pp, M_MAX + 1, 2),
         "chimera": lambda pp: range(pp, M_MAX + 1, pp),
         "bitpipe": lambda pp: range(pp, M_MAX + 1, pp)}
PEAKS = {"dualpipe": lambda pp, mm, r_: pp + 1,
         "chimera": lambda pp, mm, r_: pp // 2 + 1 + min(r_, pp - 1 - r_),
         "bitpipe": lambda pp, mm, r_: 3 * pp // 2 + 1 + min(r_, pp - 1 - r_)}
STATEMENTS = {
    "completeness": "F and B (or I and W) once each per stage and microbatch of its "
                    "pipeline, on the rank owning the stage, each replica all-reduce "
                    "once on every rank holding a replica, and nothing else",
    "dependency": "every input made before its consumer (the package's data-flow timing), "
                  "each replica all-reduce after every local weight gradient it sums",
    "matching": "the lowered plan pairs each send with its receive, none leaves its "
                "pipeline, the replica all-reduces line up",
    "deadlock": "the lowered plan runs to completion under rendezvous",
    "memory": "the unit-model peak of rank r is as stated",
}


def _instances(name: str):
    def sizes(pp):
        return [family(name, pp, mm).derive() for mm in SIZES[name](pp)] if pp % 2 == 0 \
            else []
    return sizes


def _law(name: str, title: str, prop: str, peak_text: str):
    allowed = "m >= 2p even" if name == "dualpipe" else "m a multiple of p"
    scope = bounded(f"p <= {P_MAX} even, m <= {M_MAX} ({allowed}); package-derived and "
                    "lowered instances, each checked by the verification kernel's "
                    "obligations")
    statement = f"{title}: {STATEMENTS[prop]}" + (f" ({peak_text})" if prop == "memory"
                                                  else "")

    @law(f"{name}_{prop}", statement, scope, weight=3, family=name, property=prop)
    def checked():
        yield from instances.obligations(f"{title}, {prop}", _instances(name), P_MAX, prop,
                                         PEAKS[name] if prop == "memory" else None)
    return checked


PROPERTIES = ("completeness", "dependency", "matching", "deadlock", "memory")
(dualpipe_completeness, dualpipe_dependency, dualpipe_matching, dualpipe_deadlock,
 dualpipe_memory) = (_law("dualpipe", "DualPipe", prop, "p + 1") for prop in PROPERTIES)
(chimera_completeness, chimera_dependency, chimera_matching, chimera_deadlock,
 chimera_memory) = (_law("chimera", "Chimera", prop, "p/2 + 1 + min(r, p-1-r)")
                    for prop in PROPERTIES)
(bitpipe_completeness, bitpipe_dependency, bitpipe_matching, bitpipe_deadlock,
 bitpipe_memory) = (_law("bitpipe", "BitPipe", prop, "3p/2 + 1 + min(r, p-1-r)")
                    for prop in PROPERTIES)
