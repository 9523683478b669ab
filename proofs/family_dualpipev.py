"""DualPipeV (``algebra.families.DUALPIPEV``): V placement, ``m >= 2p``; the steady state
overlaps a forward of one chunk with a backward of the other in one step.

**Bounded.** Every property is checked on the package's derived and lowered plans for
every ``p <= 8`` and ``2p <= m <= 24`` (``proofs.instances``: the verification kernel's
obligations, one Z3 query per ``p``). The unit-model peak on every rank is ``2p + 1``.
All sizes is not proven: the pattern's overlapped steps and the cooldown's mixed
``B``/``I``/``W`` letters make the word's closed form (its phases and which letters pop,
as ``proofs.family_zbv`` derives for ZBV) a larger derivation than was done, and the
lowering's order rests on a data-flow timing with no closed form here.
"""

from __future__ import annotations

from mpipe_verified.algebra.families import family

from . import instances
from .core import bounded, law

P_MAX, M_MAX = 8, 24
SCOPE = bounded(f"p <= {P_MAX}, 2p <= m <= {M_MAX}; package-derived and lowered instances, "
                "each checked by the verification kernel's obligations; all sizes needs a "
                "closed form of the pattern's overlapped word and of the lowering's "
                "data-flow timing, which is not derived")


def _instances(pp: int):
    return (family("dualpipev", pp, mm).derive() for mm in range(2 * pp, M_MAX + 1))


def peak(p: int, m: int, r: int) -> int:
    """DualPipeV's unit-model peak on rank ``r``."""
    return 2 * p + 1


def _law(name: str, prop: str, statement: str, **extra):
    @law(name, f"DualPipeV: {statement}", SCOPE, weight=3,
         family="dualpipev", property=prop)
    def run():
        yield from instances.obligations("DualPipeV", _instances, P_MAX, prop, **extra)
    return run


dualpipev_completeness = _law(
    "dualpipev_completeness", "completeness", "every F, B, or I and W, of each stage and microbatch exactly once on "
    "the rank owning the stage, and nothing else")
dualpipev_dependency = _law(
    "dualpipev_dependency", "dependency", "in the lowered plan every op's inputs are on its rank before it runs "
    "(an overlapped step's members read their inputs before the step)")
dualpipev_matching = _law(
    "dualpipev_matching", "matching", "the lowered plan pairs every send with the receive of the same payload, "
    "FIFO per channel, none left over")
dualpipev_deadlock = _law(
    "dualpipev_deadlock", "deadlock", "the lowered plan runs to completion under rendezvous (a completion-time "
    "witness checked by Z3)")
dualpipev_peak_memory = _law(
    "dualpipev_peak_memory", "memory", "the peak of stored activations (unit model) on every rank is 2p + 1",
    peak=peak)
