"""ZB-H1 and ZB-H2 invariants (``algebra.families.ZB_H1``, ``ZB_H2``): one stage per rank
(stage ``r`` on rank ``r``), split backward (``I`` then ``W``).

**ZB-H1 for m >= p, all sizes.** With ``w = p-1-r`` the pattern ``F^{w} (F I)^{r}
(F I W)* (I W)* W*`` reads, while every stream lasts, as a word (``proofs.word``) of five
phases, each a body repeated ``n`` times (letter: the microbatch of iteration 0):

    phase  n        body
    1      w        F: 0
    2      r        F: w,  I: 0
    3      m-p+1    F: p-1,  I: r,  W: 0
    4      w        I: m-p+1+r,  W: m-p+1
    5      r        W: m-r

For ``m >= p`` every letter names a microbatch ``< m`` (so pops it): ``m`` of each kind.
That this is what ``derive`` returns is checked op for op for every ``p <= 8, p <= m <=
24`` by tests/test_family_models_b.py. Completeness (a bijection with an explicit
inverse) and the unit-model peak ``p`` (``F`` stores 1, its ``W`` frees it; the level
per letter, ``proofs.word``) are proven letter by letter for symbolic ``p, m >= p, r``.
Dependency: the clock "position ``k`` plus ``r``, plus ``w`` from the first ``I`` on"
(rank ``r`` waits ``w`` steps for its first gradient, then never again; unit durations)
advances along every rank and every input (``F`` from rank ``r-1``, ``I`` from its own
``F`` and rank ``r+1``'s ``I``, ``W`` from its ``I``) finishes before its consumer
starts. So the data-flow graph is acyclic, lowering's timing reaches every op, and
``proofs.lowered`` gives matching and deadlock of the lowered plan.

**Bounded.** ZB-H1 with ``m < p`` (law ``zb_h1_few_microbatches``) and ZB-H2 everywhere:
package-derived and lowered instances for every ``p <= 8, m <= 16``, each property stated
by the verification kernel's own obligations (``proofs.instances``). For ``m < p`` ZB-H1's
phases stop early in an order that depends on ``m`` against ``r`` (warmup forwards run
out before the ``(F I)`` phase ends on some ranks and not others), so its word has more
cases than the one above; ZB-H2's pattern (``2r`` held-back weight gradients, ``I F``
pairs) has no word derived here.
"""

from __future__ import annotations

import functools

import z3

from mpipe_verified.algebra.families import family
from mpipe_verified.ir import Compute

from . import instances, word as words
from .core import Obligation, all_sizes, bounded, law
from .lowered import deadlock_obligations, matching_obligations
from .word import k, m, p, r, x

P_MAX, M_MAX = 8, 16
SCOPE = bounded(f"p <= {P_MAX}, m <= {M_MAX}; package-derived and lowered instances, each "
                "checked by the verification kernel's obligations (no closed form of the "
                "phases that stop early for small m)")


def covers(params) -> bool:
    return params["pp"] <= P_MAX and params["microbatches"] <= M_MAX


PEAKS = {"zb-h1": (lambda pp, mm, v, r_: min(pp, mm), "min(p, m)"),
         "zb-h2": (lambda pp, mm, v, r_: min(2 * pp - 1, mm), "min(2p - 1, m)")}


def _peaks(name):
    peak = PEAKS[name][0]
    return lambda params: tuple(peak(params["pp"], params["microbatches"], None, r_)
                                for r_ in range(params["pp"]))


def _checked(name, title, prop, sizes):
    pk = PEAKS[name][0] if prop == "memory" else None
    stated = None if pk is None else (lambda pp, mm, r_: pk(pp, mm, None, r_))
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


def _bounded_cells(name: str, title: str, weight: int):
    """ZB-H2's five cells: package-derived instances, ``p <= 8, m <= 16``."""
    prefix = name.replace("-", "_")

    def sizes(pp):
        return [family(name, pp, mm).derive() for mm in range(1, M_MAX + 1)]

    def cell(prop, statement, **extra):
        return law(f"{prefix}_{prop}", f"{title}: {statement}", SCOPE, weight=weight,
                   family=name, property=prop, covers=covers, **extra)(
                       lambda: _checked(name, title, prop, sizes))
    return (cell("completeness", STATEMENTS["completeness"]),
            cell("dependency", STATEMENTS["dependency"]),
            cell("memory", f"the unit-model peak on every rank is exactly {PEAKS[name][1]}",
                 peak=_peaks(name)),
            cell("matching", STATEMENTS["matching"]),
            cell("deadlock", STATEMENTS["deadlock"]))


(zb_h2_completeness, zb_h2_dependency, zb_h2_memory, zb_h2_matching,
 zb_h2_deadlock) = _bounded_cells("zb-h2", "ZB-H2", 4)


# ---------------------------------------------------------------- ZB-H1, m >= p


def h1_phases(p_, m_, r_):
    """ZB-H1's word for ``m >= p``: ``(n, ((kind, chunk, base), ...))`` per phase."""
    w = p_ - 1 - r_
    return ((w, (("F", 0, 0),)),
            (r_, (("F", 0, w), ("I", 0, 0))),
            (m_ - p_ + 1, (("F", 0, p_ - 1), ("I", 0, r_), ("W", 0, 0))),
            (w, (("I", 0, m_ - p_ + 1 + r_), ("W", 0, m_ - p_ + 1))),
            (r_, (("W", 0, m_ - r_),)))


def h1_model(pp: int, mm: int) -> tuple[tuple[Compute, ...], ...]:
    """Per-rank programs of ZB-H1 (``m >= p``) as the model reads them."""
    return tuple(tuple(Compute(kd, r_, base + jj) for n, body in h1_phases(pp, mm, r_)
                       for jj in range(n) for kd, _, base in body)
                 for r_ in range(pp))


H1_SIZES = (p >= 1, m >= p, 0 <= r, r < p)
UNITS = [("F", 0), ("I", 0), ("W", 0)]


def h1_word(r_=r) -> words.Word:
    return words.Word(h1_phases, H1_SIZES, "ZB-H1", m, r_)


H1 = h1_word()


def h1_covers(params) -> bool:
    return params["microbatches"] >= params["pp"]


def h1_clock(r_, k_):
    """Rank ``r_``'s letter ``k_`` starts at ``k_ + r_``, plus ``w`` from its first ``I``
    (position ``w + 1``) on (unit durations)."""
    return k_ + r_ + z3.If(k_ >= p - r_, p - 1 - r_, 0)


def _h1_edges():
    """``(name, condition on r, consumer kind, (rank offset, producer kind))``: each input
    (``semantics.needs``) of each unit of rank ``r``."""
    return (("F(r) after F(r-1)", r >= 1, "F", (-1, "F")),
            ("I(r) after F(r)", True, "I", (0, "F")),
            ("I(r) after I(r+1)", r + 1 < p, "I", (1, "I")),
            ("W(r) after I(r)", True, "W", (0, "I")))


@functools.cache
def h1_flow() -> tuple[Obligation, ...]:
    """The data-flow witness: the clock ranks every op above its predecessor and above
    each input's producer, so the data-flow graph is acyclic and the data-flow timing
    reaches every op, whatever the durations (built once for three laws)."""
    return tuple(_h1_flow())


def _h1_flow():
    yield from H1.sits(UNITS)
    yield Obligation("ZB-H1 dependency: each rank's letters run in order",
                     z3.Implies(z3.And(0 <= k, k + 1 < H1.length),
                                h1_clock(r, k + 1) >= h1_clock(r, k) + 1), H1_SIZES)
    for name, cond, kd, (dr, pk) in _h1_edges():
        start = h1_clock(r, H1.position(kd, 0, x))
        there = h1_word(r + dr)
        done = h1_clock(r + dr, there.position(pk, 0, x)) + 1
        yield Obligation(f"ZB-H1 dependency: {name} finished",
                         z3.Implies(z3.And(0 <= x, x < m, cond), done <= start), H1_SIZES)


H1_WORD = ("m >= p; the word model (proofs.word), = the package's programs for p <= 8, "
           "p <= m <= 24 (tests/test_family_models_b.py); m < p is law "
           "zb_h1_few_microbatches (bounded)")
H1_CLOCK = "closed-form timing witness k + r + (p-1-r from the first I on)"
H1_LOWERED = all_sizes(f"every p >= 1, rank pair; {H1_CLOCK}, an acyclic data-flow order, "
                       f"so lowering's timing reaches every op; the lowering model of "
                       f"proofs.lowered (= lower for p <= 8, m <= 24, tests/test_models.py); "
                       f"{H1_WORD}")


def _h1_cell(prop: str, statement: str, scope: str, obligations, **extra):
    return law(f"zb_h1_{prop}", f"ZB-H1: {statement}", scope, family="zb-h1", property=prop,
               covers=h1_covers, **extra)(obligations)


zb_h1_completeness = _h1_cell(
    "completeness", STATEMENTS["completeness"],
    all_sizes(f"every p >= 1, rank r < p and word position; {H1_WORD}"),
    lambda: H1.completeness(UNITS))
zb_h1_dependency = _h1_cell(
    "dependency", STATEMENTS["dependency"],
    all_sizes(f"every p >= 1, rank, position and microbatch; {H1_CLOCK}; {H1_WORD}"),
    h1_flow)
zb_h1_memory = _h1_cell(
    "memory", "the unit-model peak on every rank is exactly min(p, m) (p for m >= p)",
    all_sizes(f"every p >= 1, rank and word position; a closed-form level per letter "
              f"proven to satisfy the level's recurrence; {H1_WORD}"),
    lambda: H1.memory({"F": 1, "I": 0, "W": -1}, p, "p", ((z3.BoolVal(True), 2, 0),)),
    peak=_peaks("zb-h1"))
zb_h1_matching = _h1_cell("matching", STATEMENTS["matching"], H1_LOWERED,
                          lambda: [*matching_obligations(), *h1_flow()])
zb_h1_deadlock = _h1_cell("deadlock", STATEMENTS["deadlock"], H1_LOWERED,
                          lambda: [*deadlock_obligations(), *h1_flow()])


@law("zb_h1_few_microbatches",
     "ZB-H1 with m < p: F, I and W once each per microbatch on the stage's rank, every "
     "input made before its consumer (the package's data-flow timing), the lowered plan "
     "matched and deadlock-free under rendezvous, and the unit-model peak min(p, m)",
     bounded(f"p <= {P_MAX}, m < p; package-derived and lowered instances, each checked by "
             f"the verification kernel's obligations (for m < p the phases stop early in an "
             f"order that depends on m against r; no word for it is derived)"), weight=4)
def zb_h1_few_microbatches():
    def sizes(pp):
        return [family("zb-h1", pp, mm).derive() for mm in range(1, pp)]
    for prop in ("completeness", "dependency", "memory", "matching", "deadlock"):
        yield from _checked("zb-h1", "ZB-H1, m < p", prop, sizes)
