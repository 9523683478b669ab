"""ZBV (``algebra.families.ZBV``): V placement, chunk 0 is stage ``r``, chunk 1 stage
``2p-1-r``, both on rank ``r``.

**The model.** With ``a = p - r``, ``L = max(m, 2p-1) - p``, reading the pattern is
reading a *word* of eight phases, each a body repeated ``n`` times; letter ``o`` of
iteration ``j`` names ``kind chunk`` and microbatch ``base + j``:

    phase  n                     body (letter: base)
    1      2a-1                  F0: 0
    2      r                     F1: 0,  F0: 2a-1
    3      a                     F1: r,  I1: 0,  W1: 0
    4      L                     F0: 2p-r-1, I0: 0, W0: 0, F1: p, I1: a, W1: a
    5      r                     I0: L,  I1: a+L
    6      a                     I0: L+r, W0: L
    7      max(0, m-a-L)         W1: a+L
    8      max(0, m-a-L)         W0: a+L

A letter whose microbatch is ``< m`` pops exactly that unit; one whose microbatch is
``>= m`` pops nothing (each stream's letters name ``0, 1, 2, ...`` in word order and each
``W`` comes after its ``I``, so the interpreter's next unit of a stream is the letter's).
The rank's program is the word's *present* letters in order (``model``); that this is
what ``derive`` returns is checked op for op for every ``p <= 8, m <= 24`` by
tests/test_proofs_family_models.py.

**All sizes.** Every position ``k`` of the word is letter ``o`` of an iteration ``j``
of one phase (``k = s + b j + o``), so each claim is proven letter by letter for symbolic
``p, m, r, j``. Completeness: each letter names its unit, and a present one is found at
that unit's position (an explicit inverse), so present positions and units are in
bijection. Dependency: for ``M = max(m, 2p-1)`` the word for ``m`` is the word for ``M``
without the letters naming a microbatch ``>= m`` (phases 1-6 coincide, 7 and 8 are
prefixes), and on ``M``'s word the only letters that pop nothing are the ``F0`` of phase
4's last ``p-1-r`` iterations, so "index among ``M``'s present letters, plus ``r``" is a
closed-form clock; Z3 checks that it advances along every rank and that every input of
every unit (``F``, ``I``, ``W`` of both chunks, across ranks and the V's turn on the last
rank) finishes before its consumer starts (unit durations). The unit-model peak,
``min(2p, m+1+r, 2m)`` on rank ``r``: a closed-form level before each letter
(``level_at``: earlier phases whole, then the phase's iterations so far) satisfies the
level's recurrence letter to letter and across phase boundaries (empty phases included),
so it is the level; every step stays within the peak, and a closed-form letter reaches
it.

**Matching and deadlock**, all sizes: the clock ranks every op above its predecessor on
its rank and above the producer of each input, so the data-flow graph is acyclic and
lowering's data-flow timing (any durations) reaches every op; ``proofs.lowered`` proves
matching and deadlock of the lowered plan of every such schedule. The V's turn on rank
``p-1`` (stage ``p-1`` to ``p`` and back) is local: lowering makes no transfer for it,
and the model has none.
"""

from __future__ import annotations

import functools

import z3

from mpipe_verified.ir import Compute

from . import word as words
from .core import Obligation, all_sizes, law
from .lowered import family_laws
from .word import k, m, mn, mx, p, r, x


def phases(p, m, r):
    """The word's phases: ``(n, ((kind, chunk, base), ...))``; works on ints and on Z3
    terms alike."""
    a, big = p - r, mx(m, 2 * p - 1)
    L = big - p
    tail = mx(0, m - a - L)
    return (
        (2 * a - 1, (("F", 0, 0),)),
        (r, (("F", 1, 0), ("F", 0, 2 * a - 1))),
        (a, (("F", 1, r), ("I", 1, 0), ("W", 1, 0))),
        (L, (("F", 0, 2 * p - r - 1), ("I", 0, 0), ("W", 0, 0), ("F", 1, p), ("I", 1, a),
             ("W", 1, a))),
        (r, (("I", 0, L), ("I", 1, a + L))),
        (a, (("I", 0, L + r), ("W", 0, L))),
        (tail, (("W", 1, a + L),)),
        (tail, (("W", 0, a + L),)),
    )


def stage(p, r, chunk):
    return r if chunk == 0 else 2 * p - 1 - r


def model(p: int, m: int, v: int | None = None) -> tuple[tuple[Compute, ...], ...]:
    """Per-rank programs of ZBV as the model reads them (``v`` is always 2)."""
    out = []
    for rank in range(p):
        prog = []
        for n, body in phases(p, m, rank):
            for j in range(max(0, n)):
                prog += [Compute(kd, stage(p, rank, c), base + j) for kd, c, base in body
                         if base + j < m]
        out.append(tuple(prog))
    return tuple(out)


# ---------------------------------------------------------------- symbolic word

SIZES = (p >= 1, m >= 1, 0 <= r, r < p)


def Word(m_=m, r_=r) -> words.Word:
    """Rank ``r_``'s ZBV word for ``m_`` microbatches."""
    return words.Word(phases, SIZES, "ZBV", m_, r_)


WORD = Word()
LENGTH = WORD.length
UNITS = [(kd, c) for kd in "FIW" for c in (0, 1)]
ALL = all_sizes("every p >= 1, m >= 1, rank r < p and word position; the word model of "
                "the pattern, = the package's programs for p <= 8, m <= 24 "
                "(tests/test_proofs_family_models.py)")


@law("zbv_completeness",
     "ZBV: rank r runs F, I and W of its two stages (r and 2p-1-r) exactly once for every "
     "microbatch, and nothing else", ALL, family="zbv", property="completeness")
def zbv_completeness():
    yield from WORD.completeness(UNITS)


# ---------------------------------------------------------------- memory


SIGN = {"F": 1, "I": 0, "W": -1}  # unit model: F stores 1, its W frees it


def peak_of(p_, m_, r_):
    return mn(mn(2 * p_, m_ + 1 + r_), 2 * m_)


def peaks(params) -> tuple[int, ...]:
    """The proven per-rank peak of a ZBV instance (the command line's)."""
    pp, mm = params["pp"], params["microbatches"]
    return tuple(peak_of(pp, mm, r_) for r_ in range(pp))


@law("zbv_peak_memory",
     "ZBV: the peak of stored activations (unit model: F stores 1, its W frees it) on rank "
     "r is min(2p, m + 1 + r, 2m)",
     all_sizes("every p >= 1, m >= 1, rank and word position; a closed-form level per "
               "letter proven to satisfy the level's recurrence, letter to letter and "
               "across phase boundaries; the word model, = the package's programs for "
               "p <= 8, m <= 24 (tests/test_proofs_family_models.py)"),
     family="zbv", property="memory", peak=peaks)
def zbv_peak_memory():
    # the peak's step: phase 2's F1 of microbatch m-1 when m <= r, else phase 3's first F1
    yield from WORD.memory(SIGN, peak_of(p, m, r), "min(2p, m+1+r, 2m)",
                           ((m <= r, 1, m - 1, 0), (m > r, 2, z3.IntVal(0), 0)))


# ---------------------------------------------------------------- dependency

BIG = mx(m, 2 * p - 1)  # M: for m < 2p-1 the program is M's restricted to mb < m


def _skipped(w: words.Word, k_):
    """Letters of ``w`` (built for ``M``) before ``k_`` that pop nothing there: the ``F0``
    of phase 4's iterations ``j >= M - 2p + r + 1``, whose microbatch is ``>= M``."""
    n4, _, s4 = w.spans()[3]
    upto = mn((k_ - s4 + 5) / 6, n4)  # phase-4 F0 letters before k_
    return mx(0, upto - (w.m - 2 * p + w.r + 1))


def clock(w: words.Word, k_):
    """The timing witness: rank ``r``'s letter ``k_`` of ``M``'s word starts at its index
    among ``M``'s present letters plus ``r`` (unit durations)."""
    return k_ - _skipped(w, k_) + w.r


def _restriction():
    """The word for ``m`` is the word for ``M`` with the letters naming a microbatch
    ``>= m`` left out: phases 1-6 coincide and phases 7 and 8 are prefixes."""
    wm, wM = WORD, Word(BIG, r)
    t_m, t_M = wm.phases[6][0], wM.phases[6][0]
    s7 = wm.starts[6]
    shift = t_M - t_m
    yield from wm.cover()
    for i, o, _, at, case in wm.letters():
        there = at + shift if i == 7 else at
        yield Obligation(f"ZBV dependency: phase {i + 1} letter {o} of m's word is M's "
                         f"letter at the mapped position (identity, phase 8 shifted)",
                         z3.And(shift >= 0, *[a == b for a, b in zip(wm.letter(at),
                                                                    wM.letter(there))]),
                         case)
    _, _, mb = wM.letter(k)
    gap = z3.Or(z3.And(s7 + t_m <= k, k < s7 + t_M), z3.And(wM.starts[7] + t_m <= k,
                                                              k < wM.length))
    yield Obligation("ZBV dependency: M's letters left out name a microbatch >= m",
                     z3.Implies(gap, mb >= m), SIZES)


def _edges():
    """``(name, condition on r, consumer, producer)``: each input of each unit (§2.5),
    a unit being ``(rank offset, kind, chunk)``."""
    return (("F0(r) after F0(r-1)", r >= 1, (0, "F", 0), (-1, "F", 0)),
            ("F1(r) after F1(r+1)", r + 1 < p, (0, "F", 1), (1, "F", 1)),
            ("F1(p-1) after F0(p-1)", r == p - 1, (0, "F", 1), (0, "F", 0)),
            ("I0(r) after F0(r)", True, (0, "I", 0), (0, "F", 0)),
            ("I0(r) after I0(r+1)", r + 1 < p, (0, "I", 0), (1, "I", 0)),
            ("I0(p-1) after I1(p-1)", r == p - 1, (0, "I", 0), (0, "I", 1)),
            ("I1(r) after F1(r)", True, (0, "I", 1), (0, "F", 1)),
            ("I1(r) after I1(r-1)", r >= 1, (0, "I", 1), (-1, "I", 1)),
            ("W0(r) after I0(r)", True, (0, "W", 0), (0, "I", 0)),
            ("W1(r) after I1(r)", True, (0, "W", 1), (0, "I", 1)))


@functools.cache
def flow() -> tuple[Obligation, ...]:
    """The data-flow witness: the clock ranks every op above its predecessor on its rank
    and above the producer of each of its inputs, so the data-flow graph has no cycle and
    the data-flow timing reaches every op, whatever the durations (built once: the
    dependency, matching and deadlock laws share it)."""
    return tuple(_flow())


def _flow():
    yield from _restriction()
    wM = Word(BIG, r)
    _, _, mb = wM.letter(k)
    yield Obligation("ZBV dependency: each rank's letters run in order (the clock never "
                     "goes back and advances past every letter naming a microbatch < m)",
                     z3.Implies(z3.And(0 <= k, k + 1 < wM.length),
                                clock(wM, k + 1) >= clock(wM, k) + z3.If(mb < m, 1, 0)),
                     SIZES)
    yield from wM.sits(UNITS, "dependency, in M's word, ")
    for name, cond, (_, kd, c), (dr, pk, pc) in _edges():
        there = Word(BIG, r + dr)
        start = clock(wM, wM.position(kd, c, x))
        done = clock(there, there.position(pk, pc, x)) + 1
        yield Obligation(f"ZBV dependency: {name} finished",
                         z3.Implies(z3.And(0 <= x, x < m, cond), done <= start), SIZES)


CLOCK = ("closed-form timing witness over the word for M = max(m, 2p-1), of which m's word "
         "is the restriction to microbatches < m")
WORDS = ("the word model, = the package's programs for p <= 8, m <= 24 "
         "(tests/test_proofs_family_models.py)")


@law("zbv_dependency",
     "ZBV: a data-flow timing exists (unit durations: every op after each of its inputs "
     "finished, each rank in order): every op's inputs are on its rank before it runs",
     all_sizes(f"every p >= 1, m >= 1, rank, position and microbatch; {CLOCK}; {WORDS}"),
     family="zbv", property="dependency")
def zbv_dependency():
    yield from flow()


# ---------------------------------------------------------------- lowered

LOWERED = all_sizes(f"every p >= 1, m >= 1, rank pair; {CLOCK}, an acyclic data-flow "
                    f"order, so lowering's timing reaches every op (the V's turn on rank "
                    f"p-1 is local: no transfer); the lowering model of proofs.lowered (= "
                    f"lower for p <= 8, m <= 24, tests/test_proofs_expanded.py); {WORDS}")


zbv_matching, zbv_deadlock = family_laws("zbv", "ZBV", LOWERED, flow, family="zbv")
