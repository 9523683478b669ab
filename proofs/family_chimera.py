"""Chimera's word on the V of ``n = p/2`` virtual ranks (``proofs.family_bidirectional``
maps it onto the ``p`` real ranks: rank ``r`` runs virtual rank ``h = min(r, p-1-r)``'s
word). Chunk 0 of virtual rank ``h`` is virtual stage ``h``, chunk 1 is ``2n-1-h``; a
chunk's local microbatches are ``0..m'-1`` (``m' = m/2``, a multiple of ``n``).

**The model.** ``m'/n`` basic units, unit ``u`` naming microbatches ``u n + j``; each unit
is five phases of letters ``kind chunk base`` (microbatch ``base + j`` in iteration ``j``):

    phase  n      body
    1      n-h    F0 j
    2      h      F1 j;  F0 n-h+j
    3      n-h    F1 h+j;  B1 j
    4      h      B0 j;  B1 n-h+j
    5      n-h    B0 h+j

``4n`` steps a unit. The units are *chained* as Chimera's generator chains its
pipelines (unit ``u+1`` enters when unit ``u``'s first microbatch is back): the word is
the units in order, except that each unit's phase 5 and the next unit's phase 1 (``n-h``
letters each) alternate, ``B0 F0`` by ``B0 F0``. That this is what ``derive`` returns
(mapped onto the real ranks) is checked op for op for every even ``p <= 8``, ``m <= 24``
by tests/test_proofs_bidirectional.py.

**All sizes** (symbolic ``n >= 1``, ``h < n``, unit-local microbatch ``x < n``; one unit
is a ``proofs.word.Word``): completeness by an explicit inverse, letter by letter (each
letter a required unit found at its position, each required unit at its position), the
units partition the microbatches (``x = u n + j`` for exactly one ``u < U``, ``j < n``),
and the chaining permutes positions only (the alternating block is phase 5 then phase 1,
``2(n-h)`` letters, position ``t`` being letter ``t/2`` of phase 5 or 1 by ``t``'s parity,
one to one). Memory: a closed-form level per step satisfies the recurrence, each unit
ends at level 0, every step stays within ``n + 1 + h`` and phase 3's first ``F1``
reaches it; a chained block starts at phase 5's level ``n - h``, each ``B0 F0`` pair
returns to it, which is the next unit's level after its phase 1. Dependency: the clock
of unit ``u``'s ``F`` at virtual stage ``d`` of microbatch ``u n + x`` is
``4n u + d + 2x``, of its ``B`` ``4n u + 4n-1-d + 2x`` (the generator's tick): it
increases along every virtual rank's word (within a unit and through each chained
block) and along every input (``F`` from stage ``d-1``, ``B`` from ``F`` at ``d`` and
``B`` at ``d+1``).

No Z3 term is made at import: the symbols and the unit word are built when a law first
reads them; ``n``, ``h``, ``PEAK`` and ``SPAN`` are module attributes made on first read
(PEP 562), which a test may replace.
"""

from __future__ import annotations

import functools
import sys

import z3

from mpipe_verified.ir import Compute

from . import word
from .core import Obligation
from .model import B, F
from .shape import ite


def phases(n, h):
    """``(count, steps)`` per phase of one unit; a step is one letter ``(kind, chunk,
    base)`` naming unit-local microbatch ``base + j`` in iteration ``j``."""
    return ((n - h, (("F", 0, 0),)),
            (h, (("F", 1, 0), ("F", 0, n - h))),
            (n - h, (("F", 1, h), ("B", 1, 0))),
            (h, (("B", 0, 0), ("B", 1, n - h))),
            (n - h, (("B", 0, h),)))


def virtual_stage(n, h, chunk):
    """Virtual stage of ``chunk`` on virtual rank ``h``: ``h``, or ``2n-1-h``."""
    return h if chunk == 0 else 2 * n - 1 - h


def model(n: int, m: int) -> tuple:
    """Per virtual rank, its program: ``Compute(kind, virtual stage, local microbatch)``,
    the units chained (phase 5 of each alternating with phase 1 of the next)."""
    out = []
    for h in range(n):
        units = []
        for u in range(m // n):
            units.append([[Compute(kd, virtual_stage(n, h, c), u * n + base + j)
                           for j in range(count) for kd, c, base in body]
                          for count, body in phases(n, h)])
        prog = units[0][0]
        for prev, unit in zip(units, units[1:]):
            prog += [*prev[1], *prev[2], *prev[3]]
            prog += [op for pair in zip(prev[4], unit[0]) for op in pair]
        prog += [op for phase in units[-1][1:] for op in phase]
        out.append(tuple(prog))
    return tuple(out)


# ---------------------------------------------------------------- symbolic unit

# One unit of virtual rank h as a word (proofs.word) over n = word.p virtual ranks,
# h = word.r, with word.m = n unit-local microbatches a chunk (every letter present).
UNITS = [(kd, c) for kd in "FB" for c in (0, 1)]
SIGN = {"F": 1, "B": -1}
_LAZY = {"n": lambda: word.p, "h": lambda: word.r,
         "PEAK": lambda: word.p + 1 + word.r,  # the unit-model peak n + 1 + h
         "SPAN": lambda: 4 * word.p}  # unit u+1 enters 4n ticks after unit u


def __getattr__(name: str):
    """``n``, ``h``, ``PEAK``, ``SPAN``: built on first read (a test may replace one)."""
    if name in _LAZY:
        return _LAZY[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _read(name: str):
    """A module attribute as it stands (replaced, or built by ``__getattr__``)."""
    return getattr(sys.modules[__name__], name)


def sizes() -> tuple:
    """A unit: ``n >= 1`` virtual ranks, ``0 <= h < n``, ``n`` microbatches a chunk."""
    n, h = _read("n"), _read("h")
    return (n >= 1, 0 <= h, h < n, word.m == n)


@functools.cache
def unit() -> word.Word:
    """One unit of virtual rank ``h`` as a word (built once, when a law first reads it)."""
    return word.Word(lambda p_, m_, r_: phases(p_, r_), sizes(), "Chimera unit",
                     m_=word.p, r_=word.r)


def completeness():
    """Each letter is a required unit at its position and each required unit sits at its
    position (``word.Word.completeness``); the units partition the microbatches; the
    chaining permutes the positions of each block."""
    n = _read("n")
    yield from unit().completeness(UNITS)
    yield Obligation("Chimera: a unit is 4n steps", unit().length == 4 * n, sizes())
    yield from units_partition()
    yield from chained_block()


def units_partition():
    """``x < U n`` is ``u n + j`` for exactly one ``u < U``, ``j < n`` (unit ``u``)."""
    n, x, j = _read("n"), word.x, word.j
    u, U, u2, j2 = z3.Ints("u U u2 j2")
    room = (n >= 1, U >= 1)
    yield Obligation("Chimera: each microbatch x < U n lies in unit x / n (0 <= x / n < U)",
                     z3.Implies(z3.And(0 <= x, x < U * n), z3.And(
                         0 <= x / n, x / n < U, x == n * (x / n) + x % n)), room,
                     lemmas=(z3.Implies(z3.And(x < U * n, x / n >= U),
                                        n * (x / n) >= U * n),))
    yield Obligation("Chimera: and in no other unit (u n + j = u2 n + j2, j, j2 < n: u = u2)",
                     z3.Implies(z3.And(0 <= j, j < n, 0 <= j2, j2 < n,
                                       u * n + j == u2 * n + j2), u == u2), room,
                     lemmas=(z3.Implies(u >= u2 + 1, u * n >= u2 * n + n),
                             z3.Implies(u2 >= u + 1, u2 * n >= u * n + n)))


def chained_block():
    """Phase 5 (the unit's last ``n-h`` letters) and the next unit's phase 1 (its first
    ``n-h``) are adjacent in the units' concatenation, one letter an iteration each; the
    block's position ``t < 2(n-h)`` is letter ``t/2`` of phase 5 (``t`` even) or of
    phase 1 (odd), one to one: the chained word is a permutation of the concatenation."""
    n, h = _read("n"), _read("h")
    spans = unit().spans()
    assert len(spans[0][1]) == len(spans[4][1]) == 1  # one letter an iteration
    yield Obligation("Chimera chaining: phase 1 opens the unit, phase 5 closes it, n-h "
                     "letters each", z3.And(spans[0][2] == 0, spans[0][0] == n - h,
                                            spans[4][0] == n - h,
                                            spans[4][2] + n - h == unit().length), sizes())
    t, i, i2, e, e2 = z3.Ints("t i i2 e e2")
    bits = (z3.Or(e == 0, e == 1), z3.Or(e2 == 0, e2 == 1))
    yield Obligation("Chimera chaining: block position t < 2(n-h) is 2 (t/2) + t%2, "
                     "t/2 < n-h, and 2i + e = 2i2 + e2 (e, e2 in {0, 1}) only for i = i2, "
                     "e = e2", z3.And(
                         z3.Implies(z3.And(0 <= t, t < 2 * (n - h)), z3.And(
                             t == 2 * (t / 2) + t % 2, 0 <= t / 2, t / 2 < n - h)),
                         z3.Implies(z3.And(*bits, 2 * i + e == 2 * i2 + e2),
                                    z3.And(i == i2, e == e2))), sizes())


# ---------------------------------------------------------------- memory

def memory():
    """The level's recurrence, every step within ``n + 1 + h``, reached at phase 3's first
    ``F1`` (``word.Word.memory``), each unit back at level 0 (so the next starts at 0),
    and each chained block within the peak, ending where the next unit's phase 1 ends."""
    n, h, peak, one = _read("n"), _read("h"), _read("PEAK"), unit()
    yield from one.memory(SIGN, peak, "n + 1 + h", [(z3.BoolVal(True), 2, 0, 0)])
    spans = one.spans()
    yield Obligation("Chimera: the level after a unit is 0 (the next unit starts at 0)",
                     one.level_at(SIGN, len(spans) - 1, spans[-1][0], 0) == 0, sizes())
    before5, after1 = one.level_at(SIGN, 4, 0, 0), one.level_at(SIGN, 1, 0, 0)
    yield Obligation("Chimera chaining: the level is n-h before phase 5 and after the next "
                     "unit's phase 1", z3.And(before5 == n - h, after1 == n - h), sizes())
    yield Obligation("Chimera chaining: each B0 F0 pair of a block goes from n-h to n-h-1 "
                     "and back, its steps' peaks (n-h, n-h-1 + 1) <= n + 1 + h",
                     z3.And(n - h - 1 + 1 == n - h, n - h <= peak, n - h - 1 + 1 <= peak),
                     sizes())


# ---------------------------------------------------------------- dependency

def clock(kind, d, x_, unit_=0):
    """The timing witness of ``kind`` at virtual stage ``d``, unit-local microbatch
    ``x_``, in unit ``unit_`` (Chimera's generator's tick)."""
    n = _read("n")
    return unit_ * _read("SPAN") + ite(kind == F, d + 2 * x_, 4 * n - 1 - d + 2 * x_)


def step_clock(k_, unit_=0):
    n, h = _read("n"), _read("h")
    kind, chunk, mb = unit().letter(k_)
    return clock(kind, z3.If(chunk == 0, h, 2 * n - 1 - h), mb, unit_)


def dependency():
    """The clock increases along each virtual rank's word (within a unit and through each
    chained block) and along every input, so the data-flow graph has no cycle."""
    n, h, x, one = _read("n"), _read("h"), word.x, unit()
    k, d, i, u = z3.Ints("k d i u")
    yield from one.sits(UNITS)  # the letters read by the clock are the units
    yield Obligation("Chimera dependency: each rank's steps run in order within a unit",
                     z3.Implies(z3.And(0 <= k, k + 1 < one.length),
                                step_clock(k + 1) >= step_clock(k) + 1), sizes())
    s5, pair = one.spans()[4][2], (0 <= i, u >= 0)
    yield Obligation("Chimera dependency: in a chained block, unit u's phase-5 letter i "
                     "before unit u+1's phase-1 letter i",
                     z3.Implies(i < n - h, step_clock(i, u + 1)
                                >= step_clock(s5 + i, u) + 1), sizes() + pair)
    yield Obligation("Chimera dependency: and that before unit u's phase-5 letter i+1",
                     z3.Implies(i + 1 < n - h, step_clock(s5 + i + 1, u)
                                >= step_clock(i, u + 1) + 1), sizes() + pair)
    live = (0 <= x, x < n, n >= 1, u >= 0)  # any unit u, unit-local microbatch x
    edges = (("F(d) after F(d-1)", F, F, -1, z3.And(1 <= d, d < 2 * n)),
             ("B(d) after F(d)", B, F, 0, z3.And(0 <= d, d < 2 * n)),
             ("B(d) after B(d+1)", B, B, 1, z3.And(0 <= d, d + 1 < 2 * n)))
    for name, kind, made_by, dd, where in edges:
        yield Obligation(f"Chimera dependency: {name} finished (one unit)",
                         z3.Implies(where, clock(made_by, d + dd, x, u) + 1
                                    <= clock(kind, d, x, u)), live)
