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
tests/test_family_models_b.py.

**All sizes.** Completeness is proven on the word for symbolic ``p, m, r`` and position
``k``: present positions and units are in bijection, with an explicit inverse (a unit's
position). Dependency: for ``M = max(m, 2p-1)`` the word for ``m`` is the word for ``M``
without the letters naming a microbatch ``>= m`` (phases 1-6 coincide, 7 and 8 are
prefixes), and on ``M``'s word the only letters that pop nothing are the ``F0`` of phase
4's last ``p-1-r`` iterations, so "index among ``M``'s present letters, plus ``r``" is a
closed-form clock; Z3 checks that it advances along every rank and that every input of
every unit (``F``, ``I``, ``W`` of both chunks, across ranks and the V's turn on the last
rank) finishes before its consumer starts (unit durations). The unit-model peak,
``min(2p, m+1+r, 2m)`` on rank ``r``, is proven from closed-form counts of the present
``F`` and ``W`` letters before each position: the counts satisfy the level's recurrence
(so they are the level), every step stays within the peak, and a closed-form position
reaches it.

**Bounded.** Matching and deadlock are checked on the package's lowered plans for every
``p <= P_MAX, m <= M_MAX`` (``proofs.instances``): the lowering orders transfers by a
data-flow timing with the standard durations, whose closed form over symbolic ``p, m``
(and so the lowered word, with its sends and receives) is not derived here.
"""

from __future__ import annotations

import z3

from mpipe_verified.algebra.families import family
from mpipe_verified.ir import Compute

from . import instances
from .core import Obligation, all_sizes, bounded, law
from .model import F, I, W

P_MAX, M_MAX = 10, 32
KINDS = {"F": F, "I": I, "W": W}


def _max(a, b):
    return a if isinstance(a, int) and isinstance(b, int) and a >= b else (
        b if isinstance(a, int) and isinstance(b, int) else z3.If(a >= b, a, b))


def _min(a, b):
    return -_max(-a, -b)


def phases(p, m, r):
    """The word's phases: ``(n, ((kind, chunk, base), ...))``; works on ints and on Z3
    terms alike."""
    a, big = p - r, _max(m, 2 * p - 1)
    L = big - p
    tail = _max(0, m - a - L)
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
    for r in range(p):
        prog = []
        for n, body in phases(p, m, r):
            for j in range(max(0, n)):
                prog += [Compute(kd, stage(p, r, c), base + j) for kd, c, base in body
                         if base + j < m]
        out.append(tuple(prog))
    return tuple(out)


# ---------------------------------------------------------------- symbolic word

p, m, r, k, x = z3.Ints("p m r k x")
SIZES = (p >= 1, m >= 1, 0 <= r, r < p)


class Word:
    """Rank ``r_``'s word for ``m_`` microbatches, over the symbolic ``p``: its phases,
    each phase's first position and the length."""

    def __init__(self, m_=m, r_=r) -> None:
        self.m, self.r = m_, r_
        self.phases = phases(p, m_, r_)
        self.starts, at = [], z3.IntVal(0)
        for n, body in self.phases:
            self.starts.append(at)
            at = at + _max(n, 0) * len(body)
        self.length = at

    def spans(self):
        """``(n, body, start)`` of each phase."""
        return [(n, body, s) for (n, body), s in zip(self.phases, self.starts)]

    def letter(self, k_):
        """``(kind, chunk, mb)`` of the letter at position ``k_`` (``0 <= k_ < length``)."""
        kind, chunk, mb = z3.IntVal(-1), z3.IntVal(-1), z3.IntVal(-1)
        for n, body, s in reversed(self.spans()):
            b = len(body)
            j, o = (k_ - s) / b, (k_ - s) % b
            lk, lc, lm = z3.IntVal(KINDS[body[-1][0]]), z3.IntVal(body[-1][1]), body[-1][2] + j
            for idx in reversed(range(b - 1)):
                kd, c, base = body[idx]
                lk = z3.If(o == idx, KINDS[kd], lk)
                lc = z3.If(o == idx, c, lc)
                lm = z3.If(o == idx, base + j, lm)
            inside = z3.And(s <= k_, k_ < s + _max(n, 0) * b)
            kind, chunk, mb = (z3.If(inside, lk, kind), z3.If(inside, lc, chunk),
                               z3.If(inside, lm, mb))
        return kind, chunk, mb

    def position(self, kd: str, c: int, x_):
        """The position of the letter naming ``kd c(x_)`` (the inverse of ``letter`` on
        present letters)."""
        pos = z3.IntVal(-1)
        for n, body, s in reversed(self.spans()):
            for o, (lk, lc, base) in enumerate(body):
                if (lk, lc) == (kd, c):
                    j = x_ - base
                    pos = z3.If(z3.And(0 <= j, j < n), s + len(body) * j + o, pos)
        return pos

    def count(self, kd: str, k_):
        """Present ``kd`` letters (either chunk) before position ``k_``."""
        total = z3.IntVal(0)
        for n, body, s in self.spans():
            b = len(body)
            for o, (lk, _, base) in enumerate(body):
                if lk == kd:
                    full = _max(0, _min(n, self.m - base))
                    upto = (k_ - s - o + b - 1) / b  # iterations whose letter lies before k_
                    part = _max(0, _min(_min(upto, n), self.m - base))
                    total = total + z3.If(k_ <= s, 0, z3.If(k_ >= s + n * b, full, part))
        return total


WORD = Word()
STARTS, LENGTH = WORD.starts, WORD.length
word, position = WORD.letter, WORD.position


UNITS = [(kd, c) for kd in "FIW" for c in (0, 1)]
ALL = all_sizes("every p >= 1, m >= 1, rank r < p and word position; the word model of "
                "the pattern, = the package's programs for p <= 8, m <= 24 "
                "(tests/test_family_models_b.py)")


@law("zbv_completeness",
     "ZBV: rank r runs F, I and W of its two stages (r and 2p-1-r) exactly once for every "
     "microbatch, and nothing else", ALL, family="zbv", property="completeness")
def zbv_completeness():
    kind, chunk, mb = word(k)
    in_word = z3.And(0 <= k, k < LENGTH)
    back = position_of(kind, chunk, mb)
    yield Obligation("ZBV: every position holds a letter of this rank's two chunks, and a "
                     "present one is found at its unit's position",
                     z3.Implies(in_word, z3.And(
                         z3.Or(*[z3.And(kind == KINDS[kd], chunk == c) for kd, c in UNITS]),
                         0 <= mb, z3.Implies(mb < m, back == k))), SIZES)
    for kd, c in UNITS:
        at = position(kd, c, x)
        k2, c2, mb2 = word(at)
        yield Obligation(f"ZBV: each {kd}{c}(r, x) sits at its position",
                         z3.Implies(z3.And(0 <= x, x < m), z3.And(
                             0 <= at, at < LENGTH, k2 == KINDS[kd], c2 == c, mb2 == x)),
                         SIZES)


def position_of(kind, chunk, mb):
    out = z3.IntVal(-1)
    for kd, c in UNITS:
        out = z3.If(z3.And(kind == KINDS[kd], chunk == c), position(kd, c, mb), out)
    return out


# ---------------------------------------------------------------- memory


def level(k_):
    return WORD.count("F", k_) - WORD.count("W", k_)


def peak_of(p_, m_, r_):
    return _min(_min(2 * p_, m_ + 1 + r_), 2 * m_)


@law("zbv_peak_memory",
     "ZBV: the peak of stored activations (unit model: F stores 1, its W frees it) on rank "
     "r is min(2p, m + 1 + r, 2m)",
     all_sizes("every p >= 1, m >= 1, rank and word position; closed-form counts proven to "
               "satisfy the level's recurrence; the word model, = the package's programs "
               "for p <= 8, m <= 24 (tests/test_family_models_b.py)"),
     family="zbv", property="memory")
def zbv_peak_memory():
    peak = peak_of(p, m, r)
    yield Obligation("ZBV: level(0) = 0", level(0) == 0, SIZES)
    j = z3.Int("j")
    for i, ((n, body), s) in enumerate(zip(phases(p, m, r), STARTS)):
        for o, (kd, _, base) in enumerate(body):
            at = s + len(body) * j + o  # letter o of iteration j of phase i
            case = (z3.And(0 <= j, j < n),) + SIZES
            present = base + j < m
            delta = z3.If(present, {"F": 1, "W": -1}.get(kd, 0), 0)
            alloc = z3.If(present, 1 if kd == "F" else 0, 0)
            steps = []
            for counted in "FW":
                step = WORD.count(counted, at + 1) == WORD.count(counted, at) + z3.If(
                    present, 1 if kd == counted else 0, 0)
                steps.append(step)
                yield Obligation(f"ZBV phase {i + 1} {kd}: the count of present {counted} "
                                 f"grows by its letter", step, case)
            yield Obligation(f"ZBV phase {i + 1} {kd}: level(k+1) = level(k) + (+1 for a "
                             f"present F, -1 for a present W)",
                             level(at + 1) == level(at) + delta, case, lemmas=tuple(steps))
            yield Obligation(f"ZBV phase {i + 1} {kd}: the step's peak <= min(2p, m+1+r, 2m)",
                             level(at) + alloc <= peak, case)
    yield Obligation("ZBV: the phases cover the word",
                     z3.Implies(z3.And(0 <= k, k < LENGTH), z3.Or(*[
                         z3.And(s <= k, k < s + _max(n, 0) * len(body))
                         for (n, body), s in zip(phases(p, m, r), STARTS)])), SIZES)
    at = reach()
    kw, _, mw = word(at)
    yield Obligation("ZBV: the peak is reached",
                     z3.And(0 <= at, at < LENGTH, kw == F, mw < m, level(at) + 1 == peak),
                     SIZES)


def reach():
    """A position whose step reaches the peak: ``min(2p-1, 2(p-r) + 2m - 3)``."""
    return _min(2 * p - 1, 2 * (p - r) + 2 * m - 3)


# ---------------------------------------------------------------- dependency

BIG = _max(m, 2 * p - 1)  # M: for m < 2p-1 the program is M's restricted to mb < m


def _skipped(w: Word, k_):
    """Letters of ``w`` (built for ``M``) before ``k_`` that pop nothing there: the ``F0``
    of phase 4's iterations ``j >= M - 2p + r + 1``, whose microbatch is ``>= M``."""
    n4, _, s4 = w.spans()[3]
    upto = _min((k_ - s4 + 5) / 6, n4)  # phase-4 F0 letters before k_
    return _max(0, upto - (w.m - 2 * p + w.r + 1))


def clock(w: Word, k_):
    """The timing witness: rank ``r``'s letter ``k_`` of ``M``'s word starts at its index
    among ``M``'s present letters plus ``r`` (unit durations)."""
    return k_ - _skipped(w, k_) + w.r


def _restriction():
    """The word for ``m`` is the word for ``M`` with the letters naming a microbatch
    ``>= m`` left out: phases 1-6 coincide and phases 7 and 8 are prefixes."""
    wm, wM = WORD, Word(BIG, r)
    t_m, t_M = wm.phases[6][0], wM.phases[6][0]
    s8m, s7 = wm.starts[7], wm.starts[6]
    shift = t_M - t_m
    at = z3.If(k < s8m, k, k + shift)
    yield Obligation("ZBV dependency: each letter of m's word is M's letter at the mapped "
                     "position (identity, then phase 8 shifted)",
                     z3.Implies(z3.And(0 <= k, k < wm.length), z3.And(shift >= 0, *[
                         a == b for a, b in zip(wm.letter(k), wM.letter(at))])), SIZES)
    _, _, mb = wM.letter(k)
    gap = z3.Or(z3.And(s7 + t_m <= k, k < s7 + t_M), z3.And(wM.starts[7] + t_m <= k,
                                                              k < wM.length))
    yield Obligation("ZBV dependency: M's letters left out name a microbatch >= m",
                     z3.Implies(gap, mb >= m), SIZES)


def _sits(w: Word, label: str):
    for kd, c in UNITS:
        at = w.position(kd, c, x)
        k2, c2, mb2 = w.letter(at)
        yield Obligation(f"ZBV dependency: in M's word {label}, {kd}{c}(x) sits at its "
                         f"position", z3.Implies(z3.And(0 <= x, x < m), z3.And(
                             0 <= at, at < w.length, k2 == KINDS[kd], c2 == c, mb2 == x)),
                         SIZES)


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


@law("zbv_dependency",
     "ZBV: a data-flow timing exists (unit durations: every op after each of its inputs "
     "finished, each rank in order): every op's inputs are on its rank before it runs",
     all_sizes("every p >= 1, m >= 1, rank, position and microbatch; closed-form timing "
               "witness over the word for M = max(m, 2p-1), of which m's word is the "
               "restriction to microbatches < m; the word model, = the package's programs "
               "for p <= 8, m <= 24 (tests/test_family_models_b.py)"),
     family="zbv", property="dependency")
def zbv_dependency():
    yield from _restriction()
    wM = Word(BIG, r)
    _, _, mb = wM.letter(k)
    yield Obligation("ZBV dependency: each rank's letters run in order (the clock never "
                     "goes back and advances past every letter naming a microbatch < m)",
                     z3.Implies(z3.And(0 <= k, k + 1 < wM.length),
                                clock(wM, k + 1) >= clock(wM, k) + z3.If(mb < m, 1, 0)),
                     SIZES)
    yield from _sits(wM, "of rank r")
    for name, cond, (_, kd, c), (dr, pk, pc) in _edges():
        there = Word(BIG, r + dr)
        start = clock(wM, wM.position(kd, c, x))
        done = clock(there, there.position(pk, pc, x)) + 1
        yield Obligation(f"ZBV dependency: {name} finished",
                         z3.Implies(z3.And(0 <= x, x < m, cond), done <= start), SIZES)


# ---------------------------------------------------------------- bounded, lowered


def _instances(pp: int):
    return (family("zbv", pp, mm).derive() for mm in range(1, M_MAX + 1))


LOWERED = bounded(f"p <= {P_MAX}, m <= {M_MAX}; package-derived and lowered instances, "
                  "each checked by the verification kernel's obligations; all sizes needs "
                  "a closed form of the lowering's data-flow timing (standard durations), "
                  "which is not derived")


@law("zbv_matching",
     "ZBV: the lowered plan pairs every send with the receive of the same payload, FIFO per "
     "channel, none left over", LOWERED, weight=3, family="zbv", property="matching")
def zbv_matching():
    yield from instances.obligations("ZBV", _instances, P_MAX, "matching")


@law("zbv_deadlock",
     "ZBV: the lowered plan runs to completion under rendezvous (a completion-time witness "
     "checked by Z3)", LOWERED, weight=3, family="zbv", property="deadlock")
def zbv_deadlock():
    yield from instances.obligations("ZBV", _instances, P_MAX, "deadlock")
