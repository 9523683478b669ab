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

**All sizes** (symbolic ``n >= 1``, ``h < n``, unit-local microbatch ``x < n``):
completeness by an explicit inverse, phase by phase (each letter a required unit found at
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

from .core import Obligation, memo_terms
from .model import B, F
from .shape import ite

KINDS = {"F": F, "B": B}


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

n, h, q, x, j, u, U = z3.Ints("n h q x j u U")
SIZES = (n >= 1, 0 <= h, h < n)
PHASES = phases(n, h)
LENGTH = 4 * n  # steps of one unit


def _spans():
    out, at = [], z3.IntVal(0)
    for count, body in PHASES:
        out.append((count, body, at))
        at = at + count * len(body)
    return tuple(out)


SPANS = _spans()
NONE = (z3.IntVal(-1), z3.IntVal(-1), z3.IntVal(-1))


@memo_terms
def member(k_):
    """``(kind, chunk, local mb)`` at step ``k_`` of a unit (all -1 outside it)."""
    out = NONE
    for count, body, s in reversed(SPANS):
        b = len(body)
        it, o = (k_ - s) / b, (k_ - s) % b
        here = NONE
        for idx in reversed(range(b)):
            kd, c, base = body[idx]
            got = (z3.IntVal(KINDS[kd]), z3.IntVal(c), base + it)
            here = tuple(z3.If(o == idx, g, e) for g, e in zip(got, here))
        inside = z3.And(s <= k_, k_ < s + count * b)
        out = tuple(z3.If(inside, g, e) for g, e in zip(here, out))
    return out


@memo_terms
def position(kd: str, c: int, x_):
    """Step of ``kd c(x_)`` in a unit: the inverse of ``member`` (-1: none)."""
    pos = z3.IntVal(-1)
    for count, body, s in reversed(SPANS):
        for o, (lk, lc, base) in enumerate(body):
            if (lk, lc) == (kd, c):
                it = x_ - base
                pos = z3.If(z3.And(0 <= it, it < count), s + len(body) * it + o, pos)
    return pos


UNITS = [(kd, c) for kd in "FB" for c in (0, 1)]


def cover():
    """Every step ``k`` of a unit is step ``o`` of an iteration of one phase."""
    k = z3.Int("k")

    def decomposed(count, body, s):
        b = len(body)
        return z3.And(s <= k, k < s + count * b, 0 <= (k - s) / b, (k - s) / b < count,
                      k == s + b * ((k - s) / b) + (k - s) % b)
    yield Obligation("Chimera: each step of a unit is step o of iteration j of a phase",
                     z3.Implies(z3.And(0 <= k, k < LENGTH),
                                z3.Or(*[decomposed(*span) for span in SPANS])), SIZES)


def completeness():
    """Each letter is a required unit at its position; each required unit sits at its
    position; the units partition the microbatches."""
    yield from cover()
    for i, (count, body, s) in enumerate(SPANS):
        for o, (kd, c, base) in enumerate(body):
            at = s + len(body) * j + o
            kind, chunk, mb = member(at)
            yield Obligation(f"Chimera phase {i + 1} step {o}: the letter is {kd}{c} of a "
                             f"unit-local microbatch < n, found at its position",
                             z3.And(kind == KINDS[kd], chunk == c, mb == base + j, 0 <= mb,
                                    mb < n, position(kd, c, mb) == at),
                             (0 <= j, j < count) + SIZES)
    for kd, c in UNITS:
        at = position(kd, c, x)
        got = member(at)
        yield Obligation(f"Chimera: each {kd}{c}(h, x), x < n, sits at its position",
                         z3.Implies(z3.And(0 <= x, x < n), z3.And(
                             0 <= at, at < LENGTH, got[0] == KINDS[kd], got[1] == c,
                             got[2] == x)), SIZES)
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


def _delta(letter) -> int:
    return 1 if letter[0] == "F" else -1


def level_at(i: int, it, o: int):
    """The level before step ``o`` of iteration ``it`` of phase ``i`` (a unit starts at 0)."""
    total = z3.IntVal(0)
    for count, body, _ in SPANS[:i]:
        total = total + count * sum(map(_delta, body))
    body = SPANS[i][1]
    return total + it * sum(map(_delta, body)) + sum(map(_delta, body[:o]))


PEAK = n + 1 + h


def memory():
    """The level's recurrence, the unit back at 0, the peak ``n + 1 + h`` bound and met."""
    yield from cover()
    yield Obligation("Chimera: the level before a unit is 0", level_at(0, 0, 0) == 0, SIZES)
    for i in range(len(SPANS) - 1):
        yield Obligation(f"Chimera: the level after phase {i + 1} is the level before phase "
                         f"{i + 2}", level_at(i, SPANS[i][0], 0) == level_at(i + 1, 0, 0),
                         SIZES)
    yield Obligation("Chimera: the level after a unit is 0 (the next unit starts at 0)",
                     level_at(len(SPANS) - 1, SPANS[-1][0], 0) == 0, SIZES)
    for i, (count, body, _) in enumerate(SPANS):
        for o, letter in enumerate(body):
            case = (0 <= j, j < count) + SIZES
            after = level_at(i, j, o + 1) if o + 1 < len(body) else level_at(i, j + 1, 0)
            yield Obligation(f"Chimera phase {i + 1} step {o}: the level after it is the "
                             f"level before it + F - B", after == level_at(i, j, o)
                             + _delta(letter), case)
            fwd = 1 if letter[0] == "F" else 0
            yield Obligation(f"Chimera phase {i + 1} step {o}: the step's peak <= n + 1 + h",
                             level_at(i, j, o) + fwd <= PEAK, case)
    yield Obligation("Chimera: the peak is reached at phase 3's first F1 (n - h >= 1)",
                     z3.And(SPANS[2][0] >= 1, level_at(2, 0, 0) + 1 == PEAK), SIZES)


# ---------------------------------------------------------------- dependency

SPAN = 6 * n - 2  # a unit's clock span: unit u's clock is u SPAN + [0, 6n - 3]


def clock(kind, d, x_, unit=0):
    """The timing witness of ``kind`` at virtual stage ``d``, unit-local microbatch
    ``x_``, in unit ``unit``."""
    return unit * SPAN + ite(kind == F, d + 2 * x_, 4 * n - 1 - d + 2 * x_)


def step_clock(k_, unit=0):
    kind, chunk, mb = member(k_)
    return clock(kind, z3.If(chunk == 0, h, 2 * n - 1 - h), mb, unit)


def dependency():
    """The clock increases along each virtual rank's word (across units) and along every
    input, so the data-flow graph has no cycle."""
    k, d = z3.Int("k"), z3.Int("d")
    yield Obligation("Chimera dependency: each rank's steps run in order within a unit",
                     z3.Implies(z3.And(0 <= k, k + 1 < LENGTH),
                                step_clock(k + 1) >= step_clock(k) + 1), SIZES)
    yield Obligation("Chimera dependency: and from a unit's last step to the next unit's "
                     "first", step_clock(0, u + 1) >= step_clock(LENGTH - 1, u) + 1,
                     SIZES + (u >= 0,))
    live = (0 <= x, x < n, n >= 1, u >= 0)
    edges = (("F(d) after F(d-1)", F, F, -1, z3.And(1 <= d, d < 2 * n)),
             ("B(d) after F(d)", B, F, 0, z3.And(0 <= d, d < 2 * n)),
             ("B(d) after B(d+1)", B, B, 1, z3.And(0 <= d, d + 1 < 2 * n)))
    for name, kind, made_by, dd, where in edges:
        yield Obligation(f"Chimera dependency: {name} finished (one unit)",
                         z3.Implies(where, clock(made_by, d + dd, x, u) + 1
                                    <= clock(kind, d, x, u)), live)
