"""ZB-H1 and ZB-H2 invariants (``algebra.families.ZB_H1``, ``ZB_H2``): one stage per rank
(stage ``r`` on rank ``r``), split backward (``I`` then ``W``).

**As words, all sizes in a region.** While every stream lasts, each pattern reads as a
word (``proofs.word``) of five phases, each a body repeated ``n`` times (letter: the
microbatch of iteration 0). ZB-H1, ``F^{w} (F I)^{r} (F I W)* (I W)* W*`` with ``w =
p-1-r``, for ``m >= p``; ZB-H2, ``F^{w} (I F)^{2r} (I W F)* (I W)* W*`` with ``w =
2(p-1-r)+1``, for ``m >= 2p - 1``:

    phase  ZB-H1: n, body                  ZB-H2: n, body
    1      w       F: 0                    w          F: 0
    2      r       F: w, I: 0              2r         I: 0, F: w
    3      m-p+1   F: p-1, I: r, W: 0      m-2p+1     I: 2r, W: 0, F: 2p-1
    4      w       I: m-p+1+r, W: m-p+1    w          I: m-w, W: m-2p+1
    5      r       W: m-r                  2r         W: m-2r

In the region every letter names a microbatch ``< m`` (so pops it): ``m`` of each kind.
That this is what ``derive`` returns is checked op for op for every ``p <= 8, m <= 24``
in the region by tests/test_proofs_family_models.py. Completeness (a bijection with an
explicit inverse) and the unit-model peak (``F`` stores 1, its ``W`` frees it; ``p``,
resp. ``2p - 1``; the level per letter, ``proofs.word``) are proven letter by letter for
symbolic ``p, m, r`` in the region. Dependency: a closed-form clock (unit durations) --
ZB-H1's "position ``k`` plus ``r``, plus ``w`` from the first ``I`` on" (rank ``r`` waits
``w`` steps for its first gradient, then never again), ZB-H2's ``k + r`` (its extra
warmup fills that wait) -- advances along every rank and every input (``F`` from rank
``r-1``, ``I`` from its own ``F`` and rank ``r+1``'s ``I``, ``W`` from its ``I``)
finishes before its consumer starts. So the data-flow graph is acyclic, lowering's timing
reaches every op, and ``proofs.lowered`` gives matching and deadlock of the lowered plan.

**Bounded, below the region** (laws ``zb_h1_few_microbatches``, ``zb_h2_few_microbatches``):
package-derived and lowered instances for every ``p <= 8`` and ``m`` below the region,
each property stated by the verification kernel's own obligations (``proofs.instances``).
There the warmup forwards run out before the phase they belong to ends, on some ranks and
not on others depending on ``m`` against ``r``, so the word has a case per order in which
the streams run dry; those words are not derived.
"""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import z3

from mpipe_verified.algebra.families import family
from mpipe_verified.ir import Compute

from . import instances, word as words
from .core import Obligation, all_sizes, bounded, law
from .lowered import deadlock_obligations, matching_obligations
from .word import k, m, p, r, x

P_MAX, M_MAX = 8, 16
PEAKS = {"zb-h1": (lambda pp, mm, r_: min(pp, mm), "min(p, m)"),
         "zb-h2": (lambda pp, mm, r_: min(2 * pp - 1, mm), "min(2p - 1, m)")}


def _peaks(name):
    """The command line's per-rank peak of an instance."""
    peak = PEAKS[name][0]
    return lambda params: tuple(peak(params["pp"], params["microbatches"], r_)
                                for r_ in range(params["pp"]))


def _checked(name, title, prop, sizes):
    """The kernel's obligations of ``prop`` on every lowered instance of ``sizes(p)``."""
    stated = PEAKS[name][0] if prop == "memory" else None
    return instances.obligations(title, sizes, P_MAX, prop, stated)


STATEMENTS = {
    "completeness": "F, I and W once each per stage and microbatch, on the rank owning the "
                    "stage, and nothing else",
    "dependency": "a data-flow timing respects every input and each rank's order: the "
                  "schedule runs",
    "matching": "the lowered plan pairs each send with its receive (FIFO per rank pair, "
                "equal counts and payloads)",
    "deadlock": "the lowered plan runs to completion under rendezvous (completion-time "
                "witness: each op's place in lowering's event order)",
}


# ---------------------------------------------------------------- as words, all sizes


def h1_phases(p_, m_, r_):
    """ZB-H1's word for ``m >= p``: ``(n, ((kind, chunk, base), ...))`` per phase."""
    w = p_ - 1 - r_
    return ((w, (("F", 0, 0),)),
            (r_, (("F", 0, w), ("I", 0, 0))),
            (m_ - p_ + 1, (("F", 0, p_ - 1), ("I", 0, r_), ("W", 0, 0))),
            (w, (("I", 0, m_ - p_ + 1 + r_), ("W", 0, m_ - p_ + 1))),
            (r_, (("W", 0, m_ - r_),)))


def h2_phases(p_, m_, r_):
    """ZB-H2's word for ``m >= 2p - 1``."""
    w = 2 * (p_ - 1 - r_) + 1
    return ((w, (("F", 0, 0),)),
            (2 * r_, (("I", 0, 0), ("F", 0, w))),
            (m_ - 2 * p_ + 1, (("I", 0, 2 * r_), ("W", 0, 0), ("F", 0, 2 * p_ - 1))),
            (w, (("I", 0, m_ - w), ("W", 0, m_ - 2 * p_ + 1))),
            (2 * r_, (("W", 0, m_ - 2 * r_),)))


UNITS = [("F", 0), ("I", 0), ("W", 0)]
SIGN = {"F": 1, "I": 0, "W": -1}  # unit model: F stores 1, its W frees it


def _edges():
    """``(name, condition on r, consumer kind, (rank offset, producer kind))``: each input
    (``semantics.needs``) of each unit of rank ``r`` (stage ``r``)."""
    return (("F(r) after F(r-1)", r >= 1, "F", (-1, "F")),
            ("I(r) after F(r)", True, "I", (0, "F")),
            ("I(r) after I(r+1)", r + 1 < p, "I", (1, "I")),
            ("W(r) after I(r)", True, "W", (0, "I")))


@attrs.frozen(eq=False)  # compared (and cached) by identity
class Worded:
    """A family read as a word (``proofs.word``) where ``region(p, m)`` holds, with its
    closed-form clock (unit durations) and peak."""

    name: str
    title: str
    phases: Callable
    region: Callable  # (p, m) -> bool, on ints and Z3 terms
    region_text: str
    clock: Callable  # (rank, position) -> start time
    clock_text: str
    peak: Callable  # (p, m, r) -> the peak
    peak_text: str
    reached: tuple  # word.Word.memory's cases

    @property
    def sizes(self) -> tuple:
        return (p >= 1, self.region(p, m), 0 <= r, r < p)

    def word(self, r_=r) -> words.Word:
        return words.Word(self.phases, self.sizes, self.title, m, r_)

    def model(self, pp: int, mm: int) -> tuple[tuple[Compute, ...], ...]:
        """Per-rank programs as the model reads them (inside the region)."""
        return tuple(tuple(Compute(kd, r_, base + jj) for n, body in self.phases(pp, mm, r_)
                           for jj in range(n) for kd, _, base in body)
                     for r_ in range(pp))

    def covers(self, params) -> bool:
        return bool(self.region(params["pp"], params["microbatches"]))

    def flow(self) -> tuple[Obligation, ...]:
        """The data-flow witness: the clock ranks every op above its predecessor and above
        each input's producer, so the data-flow graph is acyclic and the data-flow timing
        reaches every op, whatever the durations (built once for three laws)."""
        return _flow(self)

    def laws(self) -> tuple:
        """The five cells: completeness, dependency, memory, matching, deadlock."""
        here = self.word()
        model = (f"{self.region_text}; the word model (proofs.word), = the package's "
                 f"programs for p <= 8 in the region, m <= 24 "
                 f"(tests/test_proofs_family_models.py); the rest of m is law "
                 f"{self.name.replace('-', '_')}_few_microbatches (bounded)")
        lowered = all_sizes(f"every p >= 1, rank pair; {self.clock_text}, an acyclic "
                            f"data-flow order, so lowering's timing reaches every op; the "
                            f"lowering model of proofs.lowered (= lower for p <= 8, m <= 24, "
                            f"tests/test_proofs_expanded.py); {model}")

        def cell(prop, statement, scope, obligations, **extra):
            return law(f"{self.name.replace('-', '_')}_{prop}", f"{self.title}: {statement}",
                       scope, family=self.name, property=prop, covers=self.covers,
                       **extra)(obligations)
        return (
            cell("completeness", STATEMENTS["completeness"],
                 all_sizes(f"every p >= 1, rank r < p and word position; {model}"),
                 lambda: here.completeness(UNITS)),
            cell("dependency", STATEMENTS["dependency"],
                 all_sizes(f"every p >= 1, rank, position and microbatch; "
                           f"{self.clock_text}; {model}"), self.flow),
            cell("memory", f"the unit-model peak on every rank is exactly "
                 f"{PEAKS[self.name][1]} ({self.peak_text} in the region)",
                 all_sizes(f"every p >= 1, rank and word position; a closed-form level "
                           f"per letter proven to satisfy the level's recurrence; {model}"),
                 lambda: here.memory(SIGN, self.peak(p, m, r), self.peak_text,
                                     self.reached), peak=_peaks(self.name)),
            cell("matching", STATEMENTS["matching"], lowered,
                 lambda: [*matching_obligations(), *self.flow()]),
            cell("deadlock", STATEMENTS["deadlock"], lowered,
                 lambda: [*deadlock_obligations(), *self.flow()]))


@functools.cache
def _flow(fam: Worded) -> tuple[Obligation, ...]:
    here = fam.word()
    out = list(here.sits(UNITS))
    out.append(Obligation(f"{fam.title} dependency: each rank's letters run in order",
                          z3.Implies(z3.And(0 <= k, k + 1 < here.length),
                                     fam.clock(r, k + 1) >= fam.clock(r, k) + 1), fam.sizes))
    for name, cond, kd, (dr, pk) in _edges():
        start = fam.clock(r, here.position(kd, 0, x))
        done = fam.clock(r + dr, fam.word(r + dr).position(pk, 0, x)) + 1
        out.append(Obligation(f"{fam.title} dependency: {name} finished",
                              z3.Implies(z3.And(0 <= x, x < m, cond), done <= start),
                              fam.sizes))
    return tuple(out)


H1 = Worded(
    "zb-h1", "ZB-H1", h1_phases, lambda p_, m_: m_ >= p_, "m >= p",
    lambda r_, k_: k_ + r_ + z3.If(k_ >= p - r_, p - 1 - r_, 0),
    "closed-form timing witness k + r, plus p-1-r from the first I on", lambda p_, m_, r_: p_,
    "p", ((z3.BoolVal(True), 2, z3.IntVal(0), 0),))  # phase 3's first F
w2 = 2 * (p - 1 - r) + 1
H2 = Worded(
    "zb-h2", "ZB-H2", h2_phases, lambda p_, m_: m_ >= 2 * p_ - 1, "m >= 2p - 1",
    lambda r_, k_: k_ + r_, "closed-form timing witness k + r (no idle step)",
    lambda p_, m_, r_: 2 * p_ - 1, "2p - 1",
    ((m >= 2 * p, 2, z3.IntVal(0), 2),  # phase 3's first F, after its W
     (z3.And(m == 2 * p - 1, r >= 1), 1, 2 * r - 1, 1),  # phase 2's last F
     (z3.And(m == 2 * p - 1, r == 0), 0, w2 - 1, 0)))  # phase 1's last F

(zb_h1_completeness, zb_h1_dependency, zb_h1_memory, zb_h1_matching,
 zb_h1_deadlock) = H1.laws()
(zb_h2_completeness, zb_h2_dependency, zb_h2_memory, zb_h2_matching,
 zb_h2_deadlock) = H2.laws()


def _few(fam: Worded, title: str):
    """The bounded rest: ``p <= 8`` and the microbatch counts below the region."""
    def sizes(pp):
        return [family(fam.name, pp, mm).derive() for mm in range(1, M_MAX + 1)
                if not fam.region(pp, mm)]
    for prop in ("completeness", "dependency", "memory", "matching", "deadlock"):
        yield from _checked(fam.name, title, prop, sizes)


@law("zb_h1_few_microbatches",
     "ZB-H1 with m < p: F, I and W once each per microbatch on the stage's rank, every "
     "input made before its consumer (the package's data-flow timing), the lowered plan "
     "matched and deadlock-free under rendezvous, and the unit-model peak min(p, m)",
     bounded(f"p <= {P_MAX}, m < p; package-derived and lowered instances, each checked by "
             f"the verification kernel's obligations (for m < p the phases stop early in an "
             f"order that depends on m against r; no word for it is derived)"), weight=4)
def zb_h1_few_microbatches():
    yield from _few(H1, "ZB-H1, m < p")


@law("zb_h2_few_microbatches",
     "ZB-H2 with m < 2p - 1: F, I and W once each per microbatch on the stage's rank, every "
     "input made before its consumer (the package's data-flow timing), the lowered plan "
     "matched and deadlock-free under rendezvous, and the unit-model peak min(2p - 1, m)",
     bounded(f"p <= {P_MAX}, m < 2p - 1; package-derived and lowered instances, each "
             f"checked by the verification kernel's obligations (for m < 2p - 1 the phases "
             f"stop early in an order that depends on m against r; no word for it is "
             f"derived)"), weight=4)
def zb_h2_few_microbatches():
    yield from _few(H2, "ZB-H2, m < 2p - 1")
