"""A family's program as a *word*: phases, each a body of letters repeated ``n`` times,
read for symbolic ``p``, ``m`` and rank ``r`` (``proofs.family_zbv``, ``proofs.family_zb``,
``proofs.family_chimera``).

A phase is ``(n, body)``; a letter ``(kind, chunk, base)`` of iteration ``j`` names
``kind chunk`` of microbatch ``base + j``; a letter naming a microbatch ``>= m`` pops
nothing (it is not *present*), every other pops exactly its unit, so the rank's program
is the word's present letters in order. Letter ``o`` of iteration ``j`` of a phase
starting at ``s`` sits at position ``s + b j + o`` (``b`` the body's length).

The proofs are letter by letter: ``cover`` proves that every position is such a letter
of one phase, and each claim about a letter is an obligation over symbolic ``j`` in
``[0, n)``. Completeness: each letter names its unit and a present one is found at the
unit's position (``position``, an explicit inverse), and each unit sits at its position.
Memory: ``level_at`` is a closed form of the level before each letter, linear in the
symbols; it starts at 0, grows by each letter's change and is continuous across phase
boundaries (empty phases included), so it is the level.
"""

from __future__ import annotations

from typing import Callable

import z3

from .core import Obligation, memo_terms
from .model import B, F, I, W

KINDS = {"F": F, "B": B, "I": I, "W": W}
p, m, r, k, x, j = z3.Ints("p m r k x j")


def mx(a, b):
    """``max`` on ints and Z3 terms alike."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return z3.If(a >= b, a, b)


def mn(a, b):
    return -mx(-a, -b)


class Word:
    """Rank ``r_``'s word for ``m_`` microbatches over the symbolic ``p``, read from
    ``phases(p, m_, r_)``; ``sizes`` are the hypotheses on ``p, m, r`` the laws assume and
    ``title`` names the family in obligations."""

    def __init__(self, phases: Callable, sizes: tuple, title: str, m_=m, r_=r) -> None:
        self.m, self.r, self.sizes, self.title = m_, r_, sizes, title
        self.phases = phases(p, m_, r_)
        self.starts, at = [], z3.IntVal(0)
        for n, body in self.phases:
            self.starts.append(at)
            at = at + mx(n, 0) * len(body)
        self.length = at

    def spans(self):
        """``(n, body, start)`` of each phase."""
        return [(n, body, s) for (n, body), s in zip(self.phases, self.starts)]

    @memo_terms
    def letter(self, k_):
        """``(kind, chunk, mb)`` of the letter at position ``k_`` (``0 <= k_ < length``)."""
        kind, chunk, mb = z3.IntVal(-1), z3.IntVal(-1), z3.IntVal(-1)
        for n, body, s in reversed(self.spans()):
            b = len(body)
            jj, o = (k_ - s) / b, (k_ - s) % b
            lk, lc, lm = z3.IntVal(KINDS[body[-1][0]]), z3.IntVal(body[-1][1]), body[-1][2] + jj
            for idx in reversed(range(b - 1)):
                kd, c, base = body[idx]
                lk = z3.If(o == idx, KINDS[kd], lk)
                lc = z3.If(o == idx, c, lc)
                lm = z3.If(o == idx, base + jj, lm)
            inside = z3.And(s <= k_, k_ < s + mx(n, 0) * b)
            kind, chunk, mb = (z3.If(inside, lk, kind), z3.If(inside, lc, chunk),
                               z3.If(inside, lm, mb))
        return kind, chunk, mb

    @memo_terms
    def position(self, kd: str, c: int, x_):
        """The position of the letter naming ``kd c(x_)`` (the inverse of ``letter`` on
        present letters)."""
        pos = z3.IntVal(-1)
        for n, body, s in reversed(self.spans()):
            for o, (lk, lc, base) in enumerate(body):
                if (lk, lc) == (kd, c):
                    jj = x_ - base
                    pos = z3.If(z3.And(0 <= jj, jj < n), s + len(body) * jj + o, pos)
        return pos

    def position_of(self, units, kind, chunk, mb):
        out = z3.IntVal(-1)
        for kd, c in units:
            out = z3.If(z3.And(kind == KINDS[kd], chunk == c), self.position(kd, c, mb), out)
        return out

    def letters(self):
        """``(phase index, letter index, (kind, chunk, base), position, case)``: letter
        ``o`` of iteration ``j`` of each phase at position ``s + b j + o``, ``case`` the
        hypotheses (``0 <= j < n`` and the sizes)."""
        for i, (n, body, s) in enumerate(self.spans()):
            for o, letter_ in enumerate(body):
                yield i, o, letter_, s + len(body) * j + o, (z3.And(0 <= j, j < n),) + self.sizes

    # ------------------------------------------------------------ obligations

    def cover(self):
        """Every position of the word is letter ``o`` of an iteration ``j`` of a phase."""
        def decomposed(n, body, s):
            b = len(body)
            return z3.And(s <= k, k < s + mx(n, 0) * b, 0 <= (k - s) / b, (k - s) / b < n,
                          k == s + b * ((k - s) / b) + (k - s) % b)
        yield Obligation(f"{self.title}: each position of the word is letter o of iteration "
                         f"j of a phase (k = s + b j + o, 0 <= j < n)",
                         z3.Implies(z3.And(0 <= k, k < self.length), z3.Or(*[
                             decomposed(n, body, s) for n, body, s in self.spans()])),
                         self.sizes)

    def sits(self, units, label: str = ""):
        """Each unit ``kd c(x)``, ``x < m``, is the letter at its position."""
        for kd, c in units:
            at = self.position(kd, c, x)
            k2, c2, mb2 = self.letter(at)
            yield Obligation(f"{self.title}: {label}each {kd}{c}(r, x) sits at its position",
                             z3.Implies(z3.And(0 <= x, x < m), z3.And(
                                 0 <= at, at < self.length, k2 == KINDS[kd], c2 == c,
                                 mb2 == x)), self.sizes)

    def completeness(self, units):
        """Present positions and units (``kd c(x)``, ``x < m``) are in bijection."""
        yield from self.cover()
        for i, o, (kd, c, base), at, case in self.letters():
            kind, chunk, mb = self.letter(at)
            yield Obligation(f"{self.title} phase {i + 1} letter {o}: it names "
                             f"{kd}{c}(base + j), and a present one is found at its unit's "
                             f"position",
                             z3.And(kind == KINDS[kd], chunk == c, mb == base + j, mb >= 0,
                                    z3.Implies(mb < m, self.position_of(
                                        units, kind, chunk, mb) == at)), case)
        yield from self.sits(units)

    def level_at(self, sign: dict, i: int, j_, o: int):
        """The level before letter ``o`` of iteration ``j_`` of phase ``i`` (each present
        letter adds ``sign[kind]``): the earlier phases whole, then each letter of phase
        ``i`` over the iterations before ``j_`` (and ``j_`` itself for letters before
        ``o``). Division-free, so each step of the recurrence is linear."""
        def present(t, base):  # of a letter's first t iterations, those naming mb < m
            return mx(0, mn(t, self.m - base))
        spans = self.spans()
        total = z3.IntVal(0)
        for n, body, _ in spans[:i]:
            total = total + sum(sign[kd] * present(n, base) for kd, _, base in body
                                if sign[kd])
        for o2, (kd, _, base) in enumerate(spans[i][1]):
            if sign[kd]:
                total = total + sign[kd] * present(j_ + (1 if o2 < o else 0), base)
        return total

    def memory(self, sign: dict, peak, peak_text: str, reached):
        """The level (``level_at``) satisfies the level's recurrence, every step's peak (the
        level plus what a present ``F`` stores) is at most ``peak``, and it is reached:
        ``reached`` lists ``(condition, phase index, iteration, letter index)`` of an ``F``
        letter, the conditions covering every case."""
        spans = self.spans()
        yield from self.cover()
        yield Obligation(f"{self.title}: the level before the first letter is 0",
                         self.level_at(sign, 0, 0, 0) == 0, self.sizes)
        for i in range(len(spans) - 1):
            yield Obligation(f"{self.title}: the level after phase {i + 1} is the level "
                             f"before phase {i + 2}", self.level_at(sign, i, spans[i][0], 0)
                             == self.level_at(sign, i + 1, 0, 0), self.sizes)
        for i, o, (kd, _, base), _, case in self.letters():
            present = base + j < self.m
            after = (self.level_at(sign, i, j, o + 1) if o + 1 < len(spans[i][1])
                     else self.level_at(sign, i, j + 1, 0))
            yield Obligation(f"{self.title} phase {i + 1} letter {o} ({kd}): the level after "
                             f"it is the level before it, {sign[kd]:+d} if present",
                             after == self.level_at(sign, i, j, o) + z3.If(present, sign[kd],
                                                                          0), case)
            alloc = z3.If(present, 1 if kd == "F" else 0, 0)
            yield Obligation(f"{self.title} phase {i + 1} letter {o} ({kd}): the step's peak "
                             f"<= {peak_text}", self.level_at(sign, i, j, o) + alloc <= peak,
                             case)
        for cond, i, j_, o in reached:
            kd, _, base = spans[i][1][o]
            assert kd == "F"
            yield Obligation(f"{self.title}: the peak is reached at phase {i + 1}'s letter "
                             f"{o} (F) of iteration {j_} when {cond}",
                             z3.And(0 <= j_, j_ < spans[i][0], base + j_ < self.m,
                                    self.level_at(sign, i, j_, o) + 1 == peak),
                             self.sizes + (cond,))
