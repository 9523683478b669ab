"""Interleaved zero bubble (``algebra.families.interleaved_zb``, torch's
``ScheduleInterleavedZeroBubble``): interleaved 1F1B's rounds and stream order
(``proofs.family_interleaved``: ``v >= 2`` chunks, stage ``c p + r`` on rank ``r``, rounds of
``g`` microbatches) with split backwards, ``(v-1) g + p-1-r`` warmup forwards, rank ``r``
holding back its first ``r`` weight gradients.

**As a word, all sizes for m >= p - 1.** With ``G1 = (v-1) g``, ``w = G1 + p-1-r`` and
``n = v m`` units, the pattern ``F^{w} (F I)^{r} (F I W)* W*`` reads as ZB-H1's word
(``proofs.family_zb``) over unit numbers (``proofs.word``; a letter's number is its
place in its stream, ``W`` popping the oldest ``I`` without its ``W``):

    phase  n          body
    1      w          F: 0
    2      r          F: w, I: 0
    3      n-w-r      F: w+r, I: r, W: 0
    4      w          I: n-w, W: n-w-r
    5      r          W: n-r

exactly when ``w + r <= n``, i.e. ``G1 + p - 1 <= v m``, which holds iff ``m >= p - 1``
(stream fact, nonlinear). Completeness: the word is a bijection between positions and
numbers (``proofs.word``), and the stream numbers are a bijection with the units
(interleaved 1F1B's stream facts). Memory: the level per letter (``F`` stores 1, its ``W``
frees it) peaks at ``min(G1 + p, v m)`` on every rank. Dependency: interleaved 1F1B's
lexicographic potential, ``(position, r)`` for ``F``, ``(position, -r)`` for ``I``, the
position for ``W``, increases along every input (``F`` from rank ``r-1``, or rank ``p-1``'s
previous chunk ``d`` numbers earlier; ``I`` from its ``F`` and rank ``r+1``'s ``I``, or rank
0's next chunk; ``W`` from its ``I``) where ``m = p - 1`` (one round) or the last round
has ``h >= p / 2`` microbatches (the full ones have ``g >= p``; a last round shorter than
``g`` fills the last ``v h`` numbers, stream facts): the graph is acyclic, lowering's
timing reaches every op, ``proofs.lowered`` gives matching and deadlock. (Interleaved
1F1B's potential needs ``h >= p``: its steady state alternates two letters, this one
three.) That the word is the package's program is checked op for op, and that the
potential fails on the model exactly where ``2 h < p`` (tests/test_proofs_loop_families.py).

**Below the region, a word too** (``m < p - 1``: one round, ``g = m``, ``G1 = (v-1) m``,
so ``w + r = G1 + p - 1 > n``). The pattern read whole is ``phases_short``:

    phase  n          body
    1      w          F: 0
    2      r          F: w, I: 0
    3      n          F: w+r, I: r, W: 0

with every letter numbered ``>= n`` absent (its stream ran dry: the warmup on ranks
``r <= p-1-m``, the held-back phase's forwards on the others); ``(F I W)*`` runs exactly
``n`` iterations, its ``W`` numbers ``0..n-1`` all present. Completeness and memory are
proven on it as in the region (the peak is ``n = v m``, reached by the last forward, in
phase 1 or phase 2), so those two cells hold for every size.

Dependency there: one round, so a wrap changes the chunk. The level ``Lam(u) = min(u //
m, v - 1)`` of a forward number (its chunk), ``v - 1 + Lam(t)`` from the first input
gradient on (``t`` the input gradients reached: the turn's forwards of the last chunk
interleave only with the last chunk's input gradients), is nondecreasing in the word's
position; the potential ``(level, position, r)`` for ``F``, ``(level, position)`` for
``I`` and ``W`` goes up along each rank, along the chains (same level, position as in
the region) and across the wraps (one level up). ``Lam``'s facts are proven of
``min(u // m, v - 1)`` (stream facts, nonlinear) and used, instantiated, in the linear
obligations (``_potential_short``).

**Bounded, the rest** (law ``interleaved_zb_outside_region``): dependency, matching and
deadlock with ``m >= p`` and a last round of ``h < p / 2`` (the wrap edge goes down in
position, as for interleaved 1F1B; rank 0 idles there): package-derived and lowered
instances for ``p <= P_MAX``, ``m <= M_MAX``, chunks 2 and 3, checked by the
verification kernel's obligations.
"""

from __future__ import annotations

import functools

import z3

from mpipe_verified.algebra.families import family

from . import family_interleaved as il
from . import instances, word as words
from .core import Obligation, all_sizes, bounded, law
from .word import p, r
from .word import m as n  # the word's bound is the number of units: n = v m

NAME = "interleaved-zb"
P_MAX, M_MAX, CHUNKS = 8, 16, (2, 3)
UNITS = [("F", 0), ("I", 0), ("W", 0)]
SIGN = {"F": 1, "I": 0, "W": -1}  # unit model: F stores 1, its W frees it


def peak_of(pp: int, mm: int, v: int, r_: int) -> int:
    """The warmup, the ``r`` held-back forwards and one steady forward, at most ``v m``."""
    return min((v - 1) * il.rounds_group(pp, mm) + pp, v * mm)


peaks = il.chunked_peaks(peak_of)


def in_region(pp: int, mm: int) -> bool:
    return mm >= pp - 1


def flows(pp: int, mm: int) -> bool:
    """Where a potential argument holds: one round (``m < p``: the region's potential for
    ``m = p - 1``, ``_potential_short`` below it) or a last round of ``h >= p / 2`` (the
    others have ``g >= p``)."""
    return mm < pp or 2 * il.last_round(pp, mm) >= pp


def _chunks(params) -> bool:
    v = params.get("chunks")
    return isinstance(v, int) and v >= 2


def covers(params) -> bool:
    """Completeness and memory: every instance (the word in the region, ``phases_short``
    below it)."""
    return _chunks(params)


def covers_flow(params) -> bool:
    return _chunks(params) and flows(params["pp"], params["microbatches"])


# ---------------------------------------------------------------- the word

# interleaved 1F1B's symbols (the same Z3 terms; ``mm``, ``e`` and every hypothesis are
# built when a law is stated): importing this module creates no Z3 term
g1, g, d, dd, u, uf, ub = il.g1, il.g, il.d_, il.dd, il.u, il.uf, il.ub


def phases(p_, n_, r_, g1_=g1):
    """The word of rank ``r_`` over ``n_`` units (``G1 = g1_``), in the region."""
    w = g1_ + p_ - 1 - r_
    return ((w, (("F", 0, 0),)),
            (r_, (("F", 0, w), ("I", 0, 0))),
            (n_ - w - r_, (("F", 0, w + r_), ("I", 0, r_), ("W", 0, 0))),
            (w, (("I", 0, n_ - w), ("W", 0, n_ - w - r_))),
            (r_, (("W", 0, n_ - r_),)))


def phases_short(p_, n_, r_, g1_=g1):
    """The word of rank ``r_`` below the region (``G1 + p - 1 > n``): the pattern read
    whole, ``(F I W)*`` one phase of ``n`` iterations (its ``W`` numbers ``0..n-1`` are
    all present, so it runs exactly those); letters numbered ``>= n`` are absent."""
    w = g1_ + p_ - 1 - r_
    return ((w, (("F", 0, 0),)),
            (r_, (("F", 0, w), ("I", 0, 0))),
            (n_, (("F", 0, w + r_), ("I", 0, r_), ("W", 0, 0))))


TITLE = "interleaved ZB"
TITLE_SHORT = "interleaved ZB, m < p - 1"


@functools.cache
def _sizes() -> tuple:
    """The abstract sizes: ``G1 = (v-1) g >= g >= 1``, ``mm`` microbatches,
    ``n = v mm >= 2 mm`` units, ``G1 + p - 1 <= n`` (the region; stream facts)."""
    mm = z3.Int("mm")
    return (p >= 1, g >= 1, mm >= 1, g1 >= g, n >= 2 * mm, g1 + mm <= n, g1 + p - 1 <= n,
            0 <= r, r < p)


@functools.cache
def _sizes_short() -> tuple:
    """Below the region: one round (``g = m``, ``G1 = (v-1) m``), ``G1 + p - 1 > n``."""
    mm = z3.Int("mm")
    return (p >= 1, g >= 1, mm >= 1, g1 >= g, n >= 2 * mm, g1 + mm <= n, g1 + p - 1 > n,
            0 <= r, r < p)


def word(r_=r, phases_=phases) -> words.Word:
    return words.Word(phases_, _sizes(), TITLE, n, r_)


def word_short(r_=r, phases_=phases_short) -> words.Word:
    return words.Word(phases_, _sizes_short(), TITLE_SHORT, n, r_)


def model(pp: int, m_: int, vv: int):
    """Per-rank programs as the model reads them: ``(kind, stage, mb)`` in order."""
    gg = il.rounds_group(pp, m_)
    rr = -(-m_ // gg)
    hh = m_ - (rr - 1) * gg
    fwd, bwd = {}, {}
    for xx in range(m_):
        qq = xx // gg
        for cc in range(vv):
            fwd[il.u_f(qq, cc, xx, gg, vv, rr, hh)] = (cc, xx)
            bwd[il.u_b(qq, cc, xx, gg, vv, rr, hh)] = (cc, xx)
    out = []
    read = phases if in_region(pp, m_) else phases_short
    for r_ in range(pp):
        prog = []
        for count, body in read(pp, vv * m_, r_, (vv - 1) * gg):
            for jj in range(count):
                for kd, _, base in body:
                    if base + jj < vv * m_:  # a letter past the stream is absent
                        cc, xx = (fwd if kd == "F" else bwd)[base + jj]
                        prog.append((kd, cc * pp + r_, xx))
        out.append(tuple(prog))
    return tuple(out)


def _stream_region():
    """Interleaved 1F1B's stream order, and the two facts this word needs of it."""
    q, c, x = il.q, il.c, il.x
    hyps = il.STREAM + il._unit(q, c, x) + il.ROUNDS
    dq = il.d_of(q)
    yield Obligation("stream: m >= p - 1 gives G1 + p - 1 <= v m (the word's region)",
                     z3.Implies(il.m >= il.p - 1, il.G1 + il.p - 1 <= il.N), hyps,
                     example=il.STREAM_EXAMPLE)
    yield Obligation("stream: in the region, every round has >= p / 2 microbatches when "
                     "the last one has, or m = p - 1 in one round", z3.Implies(
                         z3.And(il.m >= il.p - 1, z3.Or(il.m < il.p, 2 * il.h >= il.p)),
                         z3.And(dq <= il.m, z3.Or(il.g >= il.p, z3.And(
                             il.g == il.m, il.m == il.p - 1)), z3.Or(2 * dq >= il.p, z3.And(
                                 dq == il.m, il.m == il.p - 1, il.G1 + il.m == il.N)))),
                     hyps, example=il.STREAM_EXAMPLE)
    span = il.v * dq
    yield Obligation("stream: a round shorter than g is the last: its units' numbers are "
                     ">= v m - v d, and 2 d <= v d <= G1 + d", z3.And(
                         z3.Or(dq == il.g, z3.And(il.u_f(q, c, x) >= il.N - span,
                                                  il.u_b(q, c, x) >= il.N - span)),
                         2 * dq <= span, span <= il.G1 + dq), hyps,
                     example=il.STREAM_EXAMPLE)


def _stream_short():
    """Below the region the word is ``phases_short``: ``m < p - 1`` gives ``G1 + p - 1 > v m``."""
    yield Obligation("stream: m < p - 1 gives G1 + p - 1 > v m (below the word's region)",
                     z3.Implies(il.m < il.p - 1, il.G1 + il.p - 1 > il.N),
                     il.STREAM + il.ROUNDS, example=il.STREAM_EXAMPLE)


def _completeness(phases_=phases, short=phases_short):
    """Stream facts, then the word's bijection in the region and below it (``phases_``,
    ``short``: a test states a wrong one)."""
    yield from il._stream_obligations(("round size", "in range", "sizes"))
    yield from il._injective()
    yield from _stream_region()
    yield from _stream_short()
    yield from word(r, phases_).completeness(UNITS)
    yield from word_short(r, short).completeness(UNITS)


def _memory(peak=None):
    """The level per letter and its peak ``min(G1 + p, n)`` (a test states a wrong one)."""
    peak = z3.If(g1 + p <= n, g1 + p, n) if peak is None else peak
    yield from il._stream_obligations(("sizes",))
    yield from _stream_region()
    w = g1 + p - 1 - r
    reached = ((g1 + p <= n, 2, z3.IntVal(0), 0),  # phase 3's first F
               (z3.And(g1 + p - 1 == n, r >= 1), 1, r - 1, 0),  # phase 2's last F
               (z3.And(g1 + p - 1 == n, r == 0), 0, w - 1, 0))  # phase 1's last F
    yield from word().memory(SIGN, peak, "min(G1 + p, n)", reached)
    yield from _stream_short()
    reached_short = ((w >= n, 0, n - 1, 0),  # phase 1's last present F
                     (w < n, 1, n - w - 1, 0))  # phase 2's last present F
    yield from word_short().memory(SIGN, peak, "min(G1 + p, n)", reached_short)


# The inputs ``_potential`` checks (``semantics.needs``), as in ``family_looped_bfs``.
EDGES = {"F": (("F", -1),), "I": (("F", 0), ("I", 1)), "W": (("I", 0),)}


def _lex_lt(a, b):
    return z3.Or(a[0] < b[0], z3.And(a[0] == b[0], a[1] < b[1]))


def rounds_known():
    """What the stream facts give of a round of size ``d`` (``e`` for ``v d``) at a wrap
    edge from unit number ``u - d`` to ``u``."""
    mm, e = z3.Ints("mm e")
    return z3.And(d <= mm, mm >= p - 1, z3.Or(g >= p, z3.And(g == mm, mm == p - 1)),
                  z3.Or(2 * d >= p, z3.And(d == mm, mm == p - 1, g1 + mm == n)),
                  z3.Or(d == g, z3.And(u - d >= n - e, e >= 2 * d, e <= g1 + d)))


def _potential(rounds=None):
    """Every input edge goes up in the potential; each rank's order goes up in the
    position. ``d`` is a round's size, ``D`` stands for ``(v-1) d`` (stream facts);
    ``rounds`` what is known of ``d`` (``rounds_known``; a test drops it and sees the
    wrap fail)."""
    rounds = rounds_known() if rounds is None else rounds
    here, below, above = word(), word(r - 1), word(r + 1)
    first, last = word(z3.IntVal(0)), word(p - 1)
    inside = z3.And(0 <= u, u < n)
    wrap = z3.And(1 <= d, d <= u, u < n, d <= g, rounds)
    edges = (
        ("F(s-1, x) on rank r-1 before F(s, x)",
         z3.Implies(z3.And(1 <= r, inside), _lex_lt((below.position("F", 0, u), r - 1),
                                                    (here.position("F", 0, u), r)))),
        ("I(s+1, x) on rank r+1 before I(s, x)",
         z3.Implies(z3.And(r + 1 < p, inside), _lex_lt((above.position("I", 0, u), -r - 1),
                                                       (here.position("I", 0, u), -r)))),
        ("the previous chunk's F on rank p-1 before F on rank 0",
         z3.Implies(wrap, _lex_lt((last.position("F", 0, u - d), p - 1),
                                  (first.position("F", 0, u), 0)))),
        ("the next chunk's I on rank 0 before I on rank p-1",
         z3.Implies(wrap, _lex_lt((first.position("I", 0, u - d), 0),
                                  (last.position("I", 0, u), 1 - p)))),
        ("F(s, x) before I(s, x) on its rank",
         z3.Implies(z3.And(0 <= uf, uf < n, 0 <= ub, ub < n, ub >= uf - dd, 0 <= dd,
                           dd <= g1),
                    here.position("F", 0, uf) < here.position("I", 0, ub))),
        ("I(s, x) before W(s, x) on its rank",
         z3.Implies(inside, here.position("I", 0, u) < here.position("W", 0, u))),
    )
    for name, goal in edges:
        yield Obligation(f"potential: {name}", goal, _sizes())


def _flow():
    yield from il._stream_obligations(("round size", "in range", "next chunk",
                                       "backward not far before", "sizes"))
    yield from _stream_region()
    for r_ in (r, r - 1, r + 1, z3.IntVal(0), p - 1):
        yield from words.Word(phases, _sizes() + (0 <= r_, r_ < p), TITLE, n, r_).sits(
            UNITS, "")
    yield from _potential()
    yield from _flow_short()


# ---------------------------------------------------------------- below the region

@functools.cache
def _level_symbols():
    """``Lam`` (a number's chunk level, ``min(u // m, v - 1)``) and ``top`` (``v - 1``):
    built when a law is stated."""
    return z3.Function("Lam", z3.IntSort(), z3.IntSort()), z3.Int("top")


def _lam_facts(*terms, wraps=()):
    """What ``_stream_levels`` proves of ``Lam``, at ``terms`` (and its step at ``wraps``)."""
    lam, top = _level_symbols()
    out = [top >= 1]
    for t in terms:
        out += [z3.Implies(t >= 0, z3.And(0 <= lam(t), lam(t) <= top)),
                z3.Implies(z3.And(0 <= t, t < g), lam(t) == 0),
                z3.Implies(t >= g1, lam(t) == top)]
    out += [z3.Implies(z3.And(0 <= a, a <= b), lam(a) <= lam(b))
            for a in terms for b in terms if a is not b]
    out += [z3.Implies(z3.And(g <= t, t < n), lam(t - g) + 1 == lam(t)) for t in wraps]
    return tuple(out)


def _stream_levels():
    """Below the region there is one round (``d = g = m``, ``G1 + m = v m``), and
    ``Lam(a) = min(a // m, v - 1)`` is monotone, in ``[0, v - 1]``, 0 on the first ``m``
    numbers, ``v - 1`` from ``G1`` on, and one more ``m`` numbers later."""
    a, b = z3.Ints("a b")
    hyps = il.STREAM + il.ROUNDS + (il.m < il.p - 1,)

    def lam(t):
        return z3.If(t / il.m >= il.v - 1, il.v - 1, t / il.m)
    facts = (
        ("one round of m", z3.And(il.g == il.m, il.R == 1, il.h == il.m, il.G1 + il.m == il.N)),
        ("Lam is monotone", z3.Implies(z3.And(0 <= a, a <= b), lam(a) <= lam(b))),
        ("Lam lies in [0, v - 1]", z3.Implies(0 <= a, z3.And(0 <= lam(a), lam(a) <= il.v - 1))),
        ("Lam is 0 below m", z3.Implies(z3.And(0 <= a, a < il.m), lam(a) == 0)),
        ("Lam is v - 1 from G1 on", z3.Implies(a >= il.G1, lam(a) == il.v - 1)),
        ("Lam goes up by one every m numbers",
         z3.Implies(z3.And(il.m <= a, a < il.N), lam(a - il.m) + 1 == lam(a))))
    for name, goal in facts:
        yield Obligation(f"stream, m < p - 1: {name}", goal, hyps, example=il.STREAM_EXAMPLE
                         if name == "one round of m" else None)


def level(wd: words.Word, k_):
    """The level of position ``k_`` of a short word: ``Lam`` of the forward number in phase
    1, ``top + Lam`` of the input-gradient count reached after it (phases 2 and 3)."""
    lam, top = _level_symbols()
    w = g1 + p - 1 - wd.r
    return z3.If(k_ < w, lam(k_), top + lam(_reached(wd, k_)))


def _reached(wd: words.Word, k_):
    w = g1 + p - 1 - wd.r
    return z3.If(k_ < w + 2 * wd.r, (k_ - w) / 2, wd.r + (k_ - w - 2 * wd.r) / 3)


def _lex3_lt(a, b):
    return z3.Or(a[0] < b[0], z3.And(a[0] == b[0], _lex_lt(a[1:], b[1:])))


def _potential_short():
    """Below the region: the potential ``(level, position, r)`` for ``F``, ``(level,
    position)`` for ``I`` and ``W``. The level is nondecreasing in the position, so each
    rank's order goes up; the wraps go up in the level, the chains in the position."""
    sizes = _sizes_short() + (d == g, g1 + g == n)
    here, below, above = word_short(), word_short(r - 1), word_short(r + 1)
    first, last = word_short(z3.IntVal(0)), word_short(p - 1)
    k1, k2 = z3.Ints("k1 k2")
    inside = z3.And(0 <= u, u < n)

    def at(wd, kd, u_):
        pos = wd.position(kd, 0, u_)
        return level(wd, pos), pos, _lam_facts(pos, _reached(wd, pos), u_)

    def edge(name, cond, src, dst, rs):
        (ls, ps, fs), (ld, pd, fd) = src, dst
        goal = (_lex3_lt((ls, ps, rs[0]), (ld, pd, rs[1])) if rs else
                _lex_lt((ls, ps), (ld, pd)))
        return Obligation(f"potential, m < p - 1: {name}", z3.Implies(cond, goal),
                          sizes + fs + fd + _lam_facts(u, u - g, wraps=(u,)))
    yield Obligation("potential, m < p - 1: the level is nondecreasing in the position",
                     z3.Implies(z3.And(0 <= k1, k1 < k2, k2 < here.length),
                                level(here, k1) <= level(here, k2)),
                     sizes + _lam_facts(k1, k2, _reached(here, k1), _reached(here, k2)))
    yield edge("F(s-1, x) on rank r-1 before F(s, x)", z3.And(1 <= r, inside),
               at(below, "F", u), at(here, "F", u), (r - 1, r))
    yield edge("I(s+1, x) on rank r+1 before I(s, x)", z3.And(r + 1 < p, inside),
               at(above, "I", u), at(here, "I", u), ())
    wrap = z3.And(g <= u, u < n)
    yield edge("the previous chunk's F on rank p-1 before F on rank 0", wrap,
               at(last, "F", u - g), at(first, "F", u), (p - 1, 0))
    yield edge("the next chunk's I on rank 0 before I on rank p-1", wrap,
               at(first, "I", u - g), at(last, "I", u), ())
    yield Obligation("potential, m < p - 1: F(s, x) before I(s, x) on its rank", z3.Implies(
        z3.And(0 <= uf, uf < n, 0 <= ub, ub < n, ub >= uf - dd, 0 <= dd, dd <= g1),
        here.position("F", 0, uf) < here.position("I", 0, ub)), sizes)
    yield Obligation("potential, m < p - 1: I(s, x) before W(s, x) on its rank", z3.Implies(
        inside, here.position("I", 0, u) < here.position("W", 0, u)), sizes)


def _flow_short():
    yield from _stream_short()
    yield from _stream_levels()
    for r_ in (r, r - 1, r + 1, z3.IntVal(0), p - 1):
        yield from words.Word(phases_short, _sizes_short() + (0 <= r_, r_ < p), TITLE_SHORT,
                              n, r_).sits(UNITS, "")
    yield from _potential_short()


WORDS = ("the word models (proofs.word) over interleaved 1F1B's stream order, the region's "
         "for m >= p - 1 and the short word below it (one round, letters past the stream "
         "absent), = the package's programs for p <= 8, m <= 24, v <= 4 "
         "(tests/test_proofs_loop_families.py)")
REST = "the rest is law interleaved_zb_outside_region (bounded)"
ALL = all_sizes(f"every p >= 1, v >= 2, m >= 1, rank and word position; nonlinear "
                f"stream facts over symbolic p, m, v, g; {WORDS}")
FLOW = all_sizes(f"every p >= 1, v >= 2, m < p (one round) or a last round of h >= p / 2 "
                 f"microbatches; lexicographic potential, below m = p - 1 over (chunk "
                 f"level, position); {WORDS}; {REST} (a last round of h < p / 2: rank 0 "
                 f"idles at the wrap, no closed-form timing proven)")


def _cell(prop: str, statement: str, scope: str, cover, obligations, **extra):
    return law(f"interleaved_zb_{prop}", f"interleaved zero bubble: {statement}", scope,
               weight=3, family=NAME, property=prop, covers=cover, **extra)(obligations)


interleaved_zb_completeness = _cell(
    "completeness", "every F(s, x), I(s, x) and W(s, x) exactly once, on the rank owning s "
    "(stage c p + r on rank r), and nothing else", ALL, covers, _completeness)
interleaved_zb_dependency, interleaved_zb_matching, interleaved_zb_deadlock = il.flow_cells(
    _cell, FLOW, covers_flow, _flow)
interleaved_zb_memory = _cell(
    "memory", "the unit-model peak on rank r is exactly min((v-1) g + p, v m), "
    "g = ceil(m / max(1, m // p))", ALL, covers, _memory, peak=peaks)


def _outside(prop: str):
    """The kernel's obligations of ``prop`` on every instance the flow cells leave."""
    for pp in range(1, P_MAX + 1):
        parts = [instances.violation(family(NAME, pp, m_, v).derive(), prop,
                                     lambda p_, m2, r_, v=v: peak_of(p_, m2, v, r_))
                 for m_ in range(1, M_MAX + 1) for v in CHUNKS if not flows(pp, m_)]
        yield Obligation(f"{TITLE} outside the region p={pp}: {prop} of every instance",
                         smt=instances.none_of(parts))


@law("interleaved_zb_outside_region",
     "interleaved zero bubble with m >= p and a last round of h < p / 2 microbatches: "
     "every input made before its consumer (the package's data-flow timing), the lowered "
     "plan matched and deadlock-free under rendezvous",
     bounded(f"p <= {P_MAX}, m <= {M_MAX}, chunks 2, 3, the instances outside the all-sizes "
             f"flow cells; package-derived and lowered, each checked by the verification "
             f"kernel's obligations (there the previous chunk's forward on rank p - 1 sits "
             f"later than its successor on rank 0, which idles at the wrap; no closed-form "
             f"timing is proven)"), weight=4)
def interleaved_zb_outside_region():
    for prop in ("dependency", "matching", "deadlock"):
        yield from _outside(prop)
