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

``4n`` steps a unit. That this is what ``derive`` returns (mapped onto the real ranks) is
checked op for op for every even ``p <= 8``, ``m <= 24`` by
tests/test_proofs_family_models.py.

**All sizes** (symbolic ``n >= 1``, ``h < n``, unit-local microbatch ``x < n``; one unit
is a ``proofs.word.Word``): completeness by an explicit inverse, letter by letter (each letter a required unit found at
its position, each required unit at its position), and the units partition the
microbatches (``x = u n + j`` for exactly one ``u < U``, ``j < n``). Memory: a closed-form
level per step satisfies the recurrence, each unit ends at level 0, every step stays
within ``n + 1 + h`` and phase 3's first ``F1`` reaches it. Dependency: the clock of unit
``u``'s ``F`` at virtual stage ``d`` of microbatch ``u n + x`` is ``u (6n-2) + d + 2x``,
of its ``B`` ``u (6n-2) + 4n-1-d + 2x``: it increases along every virtual rank's word
(across units too) and along every input (``F`` from stage ``d-1``, ``B`` from ``F`` at
``d`` and ``B`` at ``d+1``).
"""

from __future__ import annotations

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
    """Per virtual rank, its program: ``Compute(kind, virtual stage, local microbatch)``."""
    out = []
    for h in range(n):
        prog = []
        for u in range(m // n):
            for count, body in phases(n, h):
                for j in range(count):
                    prog += [Compute(kd, virtual_stage(n, h, c), u * n + base + j)
                             for kd, c, base in body]
        out.append(tuple(prog))
    return tuple(out)


# ---------------------------------------------------------------- symbolic unit

# One unit of virtual rank h as a word (proofs.word) over n = word.p virtual ranks,
# h = word.r, with word.m = n unit-local microbatches a chunk (every letter present).
n, h, x, j = word.p, word.r, word.x, word.j
u, U = z3.Ints("u U")
SIZES = (n >= 1, 0 <= h, h < n, word.m == n)  # a unit: n microbatches a chunk
UNIT = word.Word(lambda p_, m_, r_: phases(p_, r_), SIZES, "Chimera unit", m_=n, r_=h)
LENGTH = UNIT.length  # 4n steps
UNITS = [(kd, c) for kd in "FB" for c in (0, 1)]


def completeness():
    """Each letter is a required unit at its position and each required unit sits at its
    position (``word.Word.completeness``); the units partition the microbatches."""
    yield from UNIT.completeness(UNITS)
    yield Obligation("Chimera: a unit is 4n steps", LENGTH == 4 * n, SIZES)
    yield from units_partition()


def units_partition():
    """``x < U n`` is ``u n + j`` for exactly one ``u < U``, ``j < n`` (unit ``u``)."""
    u2, j2 = z3.Ints("u2 j2")
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


# ---------------------------------------------------------------- memory

SIGN = {"F": 1, "B": -1}
PEAK = n + 1 + h


def memory():
    """The level's recurrence, every step within ``n + 1 + h``, reached at phase 3's first
    ``F1`` (``word.Word.memory``), and each unit back at level 0 (so the next starts at 0)."""
    yield from UNIT.memory(SIGN, PEAK, "n + 1 + h", [(z3.BoolVal(True), 2, 0, 0)])
    spans = UNIT.spans()
    yield Obligation("Chimera: the level after a unit is 0 (the next unit starts at 0)",
                     UNIT.level_at(SIGN, len(spans) - 1, spans[-1][0], 0) == 0, SIZES)


# ---------------------------------------------------------------- dependency

SPAN = 6 * n - 2  # a unit's clock span: unit u's clock is u SPAN + [0, 6n - 3]


def clock(kind, d, x_, unit=0):
    """The timing witness of ``kind`` at virtual stage ``d``, unit-local microbatch
    ``x_``, in unit ``unit``."""
    return unit * SPAN + ite(kind == F, d + 2 * x_, 4 * n - 1 - d + 2 * x_)


def step_clock(k_, unit=0):
    kind, chunk, mb = UNIT.letter(k_)
    return clock(kind, z3.If(chunk == 0, h, 2 * n - 1 - h), mb, unit)


def dependency():
    """The clock increases along each virtual rank's word (across units) and along every
    input, so the data-flow graph has no cycle."""
    k, d = z3.Int("k"), z3.Int("d")
    yield from UNIT.sits(UNITS)  # the letters read by the clock are the units
    yield Obligation("Chimera dependency: each rank's steps run in order within a unit",
                     z3.Implies(z3.And(0 <= k, k + 1 < LENGTH),
                                step_clock(k + 1) >= step_clock(k) + 1), SIZES)
    yield Obligation("Chimera dependency: and from a unit's last step to the next unit's "
                     "first", step_clock(0, u + 1) >= step_clock(LENGTH - 1, u) + 1,
                     SIZES + (u >= 0,))
    live = (0 <= x, x < n, n >= 1, u >= 0)  # any unit u, unit-local microbatch x
    edges = (("F(d) after F(d-1)", F, F, -1, z3.And(1 <= d, d < 2 * n)),
             ("B(d) after F(d)", B, F, 0, z3.And(0 <= d, d < 2 * n)),
             ("B(d) after B(d+1)", B, B, 1, z3.And(0 <= d, d + 1 < 2 * n)))
    for name, kind, made_by, dd, where in edges:
        yield Obligation(f"Chimera dependency: {name} finished (one unit)",
                         z3.Implies(where, clock(made_by, d + dd, x, u) + 1
                                    <= clock(kind, d, x, u)), live)
