"""Interleaved 1F1B's invariants (``algebra.families.interleaved_1f1b``): ``p`` ranks,
``v >= 2`` looped chunks (stage ``c p + r`` on rank ``r``), ``m`` microbatches in rounds of
``g = ceil(m / max(1, m // p))`` (``R = ceil(m / g)`` rounds, the last of
``h = m - (R-1) g``).

**The model.** Rank ``r`` reads ``F^{W} (F B)*`` with ``W = (v-1) g + 2 (p-1-r)`` against
its ``n = v m`` forwards and backwards, so its program is the closed form of
``proofs.shape`` with ``w = min(W, n)``. Its streams list the units round by round, chunk
by chunk (backwards: chunks descending), so microbatch ``x`` of round ``q`` (``j = x - q
g``, ``d = g`` in a full round, ``h`` in the last) and chunk ``c`` is forward number
``uF = q g v + c d + j`` and backward number ``uB = q g v + (v-1-c) d + j``.

**Stream facts** (nonlinear, proven over symbolic ``p, m, v, g, R``): ``1 <= d <= g``;
``uF, uB`` lie in ``[0, n)`` and are injective (so, ``v m`` units into ``n = v m``
places, bijective); the previous chunk of a microbatch is ``d`` forwards earlier and the
next one ``d`` backwards earlier; ``uB >= uF - (v-1) d`` with ``(v-1) d <= (v-1) g``; and
where ``m < p`` or ``h >= p``, ``d >= p`` or (``d = m < p`` and ``(v-1) g + m = n``).

**Shape facts** (linear, over abstract ``n``, ``G1 = (v-1) g``, ``d``, ``D``): the closed
form is a bijection between positions and units (completeness); the unit-model level
satisfies its recurrence and peaks at ``min(W + 1, n)`` (memory); and the lexicographic
potential ``(position, r)`` for forwards, ``(position, -r)`` for backwards, strictly
increases along every input of every op (``F(s-1, x)``, ``B(s+1, x)`` and the own
``F(s, x)``; the wrap from rank ``p-1`` to rank 0 and back between chunks included) and
along each rank's order, so the data-flow graph is acyclic: the timing reaches every op
(dependency), and ``proofs.lowered`` gives matching and deadlock of the lowered plan.

**Where it stops.** Where the last round would be shorter than ``p`` (``m >= p``,
``h < p``) the wrap edge ``F(p-1, uF - d) -> F(0, uF)`` would go down in position, and
for ``g + h <= 2p - 3`` rank 0's wrap forward and rank ``p-1``'s backward of the round
before wait on each other (``p = 6, m = 37``: a deadlock). The family evens such rounds
out (the same ``R`` rounds, sizes ``ceil(m/R)`` then ``floor(m/R)``, all ``>= p``);
their varying sizes are not modelled symbolically here. Those instances are covered for
``p <= 8, m <= 16``, chunks 2 and 3, by the bounded law
``interleaved_1f1b_short_last_round`` (package-derived and lowered instances checked by
the verification kernel's obligations, ``proofs.instances``), and swept to ``p <= 8,
m <= 5p`` plus selected larger sizes by tests/test_rounds_sweep.py.
"""

from __future__ import annotations

import z3

from mpipe_verified.algebra.families import family

from . import instances, shape
from .core import Obligation, all_sizes, bounded, law
from .lowered import deadlock_obligations, matching_obligations
from .model import B, F

NAME = "interleaved-1f1b"
P_MAX, M_MAX, CHUNKS = 8, 16, (2, 3)


def rounds_group(pp: int, mm: int) -> int:
    """Microbatches per round (``algebra.families.interleaved_1f1b``)."""
    return -(-mm // max(1, mm // pp))


def last_round(pp: int, mm: int) -> int:
    g = rounds_group(pp, mm)
    return mm - (-(-mm // g) - 1) * g


def regular(pp: int, mm: int) -> bool:
    """Where the all-sizes data-flow proof holds: ``m < p`` or a last round of ``>= p``."""
    return mm < pp or last_round(pp, mm) >= pp


def peak_of(pp: int, mm: int, v: int, r: int) -> int:
    """Rank r's unit-model peak: its warmup forwards plus one, at most all ``m v``."""
    return min((v - 1) * rounds_group(pp, mm) + 2 * (pp - 1 - r) + 1, mm * v)


def chunked_peaks(peak_of_):
    """The command line's per-rank peaks of a chunked family's instance."""
    def peaks_(params) -> tuple[int, ...]:
        pp, mm, v = params["pp"], params["microbatches"], params["chunks"]
        return tuple(peak_of_(pp, mm, v, r_) for r_ in range(pp))
    return peaks_


peaks = chunked_peaks(peak_of)


def _valid(params) -> bool:
    v = params.get("chunks")
    return isinstance(v, int) and v >= 2


def covers_regular(params) -> bool:
    """The data-flow cells for all sizes: every regular instance."""
    return _valid(params) and regular(params["pp"], params["microbatches"])


# ---------------------------------------------------------------- the stream order

p, m, v, g, R, rounds, x, q, c, x2, q2, c2 = z3.Ints("p m v g R rounds x q c x2 q2 c2")
h = m - (R - 1) * g
N, G1 = v * m, (v - 1) * g
STREAM = (m >= 1, v >= 2, g >= 1, R >= 1, (R - 1) * g < m, m <= R * g)  # R = ceil(m / g)
ROUNDS = (p >= 1, rounds >= 1, z3.Implies(m < p, rounds == 1),  # rounds = max(1, m // p)
          z3.Implies(m >= p, z3.And(rounds * p <= m, m < (rounds + 1) * p)),
          g * rounds >= m, (g - 1) * rounds < m)  # g = ceil(m / rounds)
STREAM_EXAMPLE = ((p, z3.IntVal(2)), (m, z3.IntVal(5)), (v, z3.IntVal(2)), (g, z3.IntVal(3)),
                  (rounds, z3.IntVal(2)), (R, z3.IntVal(2)), (x, z3.IntVal(4)),
                  (q, z3.IntVal(1)), (c, z3.IntVal(1)), (x2, z3.IntVal(0)), (q2, z3.IntVal(0)),
                  (c2, z3.IntVal(0)))


def _unit(q_, c_, x_):
    """Microbatch ``x_`` lies in round ``q_``; ``c_`` is a chunk."""
    return (0 <= x_, x_ < m, 0 <= c_, c_ < v, 0 <= q_, q_ <= R - 1, q_ * g <= x_,
            x_ < (q_ + 1) * g)


def d_of(q_, g_=g, rr=R, h_=h):
    """The size of round ``q_``: ``g``, the last one ``h``."""
    return shape.ite(q_ < rr - 1, g_, h_)


def u_f(q_, c_, x_, g_=g, v_=v, rr=R, h_=h):
    """The forward number of chunk ``c_`` of microbatch ``x_`` (in round ``q_``)."""
    return q_ * g_ * v_ + c_ * d_of(q_, g_, rr, h_) + (x_ - q_ * g_)


def u_b(q_, c_, x_, g_=g, v_=v, rr=R, h_=h):
    """Its backward number (backwards run the chunks in descending order)."""
    return q_ * g_ * v_ + (v_ - 1 - c_) * d_of(q_, g_, rr, h_) + (x_ - q_ * g_)


def round_sizes(pp: int, mm: int) -> list[int]:
    """The rounds' sizes: ``g, ..., g, h``; where ``h < p <= m`` (short), the same
    ``R`` rounds evened out, ``ceil(m / R)`` first, then ``floor(m / R)``."""
    gg = rounds_group(pp, mm)
    rr = -(-mm // gg)
    if regular(pp, mm):
        return [gg] * (rr - 1) + [last_round(pp, mm)]
    return [mm // rr + (qq < mm % rr) for qq in range(rr)]


def programs(pp: int, mm: int, vv: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """The model's programs, expanded: per rank, ``(kind, stage, mb)`` in order. A
    round of size ``d`` starting at microbatch ``a`` holds forward ``a v + c d + j`` and
    backward ``a v + (v-1-c) d + j`` of its microbatch ``a + j`` (``u_f``, ``u_b`` for
    the regular rounds)."""
    gg = rounds_group(pp, mm)
    units, start = {}, 0
    for dd in round_sizes(pp, mm):
        for jj in range(dd):
            for cc in range(vv):
                units[(F, start * vv + cc * dd + jj)] = (cc, start + jj)
                units[(B, start * vv + (vv - 1 - cc) * dd + jj)] = (cc, start + jj)
        start += dd
    out = []
    for r_ in range(pp):
        w = min((vv - 1) * gg + 2 * (pp - 1 - r_), mm * vv)
        prog = []
        for kind, number in shape.expand(w, mm * vv):
            cc, xx = units[(kind, number)]
            prog.append(("F" if kind == F else "B", cc * pp + r_, xx))
        out.append(tuple(prog))
    return tuple(out)


def _stream_obligations(which):
    hyps = STREAM + _unit(q, c, x)
    d = d_of(q)
    facts = {
        "round size": z3.And(1 <= d, d <= g, 0 <= x - q * g, x - q * g < d),
        "in range": z3.And(0 <= u_f(q, c, x), u_f(q, c, x) < N,
                           0 <= u_b(q, c, x), u_b(q, c, x) < N),
        "next chunk": z3.And(z3.Implies(c >= 1, u_f(q, c - 1, x) == u_f(q, c, x) - d),
                             z3.Implies(c + 1 < v, u_b(q, c + 1, x) == u_b(q, c, x) - d)),
        "backward not far before": z3.And(u_b(q, c, x) >= u_f(q, c, x) - (v - 1) * d,
                                          (v - 1) * d <= G1, (v - 1) * d >= 0),
        "regular rounds": z3.Implies(z3.Or(m < p, h >= p), z3.Or(
            d >= p, z3.And(d == m, m < p, G1 + m == N))),
        "sizes": z3.And(N >= 2 * m, G1 >= g, G1 + m <= N),
    }
    for name in which:  # only these two facts need how g is chosen
        yield Obligation(f"stream: {name}", facts[name],
                         hyps + (ROUNDS if name in ("regular rounds", "sizes") else ()),
                         example=STREAM_EXAMPLE)


def _injective():
    """``uF`` and ``uB`` are injective: within a round by the digits ``(c, j)``, across
    rounds because round ``q`` fills ``[q g v, q g v + v d)``."""
    hyps = STREAM + _unit(q, c, x) + _unit(q2, c2, x2)
    for label, fn in (("forward", u_f), ("backward", u_b)):
        def span(q_, c_, x_):
            return z3.And(q_ * g * v <= fn(q_, c_, x_), fn(q_, c_, x_) < q_ * g * v + v * d_of(q_),
                          z3.Implies(q_ < R - 1, q_ * g * v + v * d_of(q_) == (q_ + 1) * g * v))
        yield Obligation(f"stream: round q holds {label}s [q g v, q g v + v d)", span(q, c, x),
                         STREAM + _unit(q, c, x), example=STREAM_EXAMPLE)
        yield Obligation(f"stream: {label}s of one round are distinct",
                         z3.Implies(fn(q, c, x) == fn(q2, c2, x2), z3.And(c == c2, x == x2)),
                         hyps + (q == q2,), example=STREAM_EXAMPLE)
        yield Obligation(f"stream: {label}s of an earlier round come first",
                         fn(q, c, x) < fn(q2, c2, x2), hyps + (q < q2,),
                         lemmas=(span(q, c, x), span(q2, c2, x2)), example=STREAM_EXAMPLE)


# ---------------------------------------------------------------- the shape, abstractly

n_, g1, r, k, u, uf, ub, d_, dd = z3.Ints("n G1 r k u uF uB d D")
ABSTRACT = (p >= 1, m >= 1, g >= 1, n_ >= 2 * m, g1 >= g, g1 + m <= n_, 0 <= r, r < p)
EXAMPLE = ((p, z3.IntVal(2)), (m, z3.IntVal(4)), (g, z3.IntVal(2)), (n_, z3.IntVal(8)),
           (g1, z3.IntVal(2)), (r, z3.IntVal(0)), (k, z3.IntVal(0)), (u, z3.IntVal(2)),
           (uf, z3.IntVal(0)), (ub, z3.IntVal(0)), (d_, z3.IntVal(2)), (dd, z3.IntVal(2)))


def warmup(r_):
    return g1 + 2 * (p - 1 - r_)


def w_of(r_):
    return shape.mn(warmup(r_), n_)


def _completeness(w_of_=w_of, hyps=ABSTRACT, example=EXAMPLE):
    """The shape is a bijection between positions and units (``w_of_``: the rank's
    warmup; ``family_looped_bfs`` states ``w = n`` under its own ``hyps``)."""
    w = w_of_(r)
    kind, unit = shape.op(k, w, n_)
    at = z3.If(kind == F, shape.pos_f(unit, w, n_), shape.pos_b(unit, w, n_))
    yield Obligation("shape: each position holds a forward or backward number found at "
                     "that number's position",
                     z3.Implies(z3.And(0 <= k, k < 2 * n_), z3.And(
                         z3.Or(kind == F, kind == B), 0 <= unit, unit < n_, at == k)),
                     hyps, example=example)
    for kd, letter, pos in ((F, "F", shape.pos_f), (B, "B", shape.pos_b)):
        k2, u2 = shape.op(pos(u, w, n_), w, n_)
        yield Obligation(f"shape: {letter} number u sits at its position",
                         z3.Implies(z3.And(0 <= u, u < n_), z3.And(
                             0 <= pos(u, w, n_), pos(u, w, n_) < 2 * n_, k2 == kd, u2 == u)),
                         hyps, example=example)


def _lex_lt(a, b):
    return z3.Or(a[0] < b[0], z3.And(a[0] == b[0], a[1] < b[1]))


def _potential(w_of_=w_of, wrap=None, near=None, hyps=ABSTRACT, example=EXAMPLE):
    """Every input edge goes up in ``(position, +-r)``; a rank's order goes up in the
    position. ``d``, ``D`` stand for a round's size and ``(v-1) d`` (stream facts: what is
    known of them, ``wrap`` and ``near``; built here, not at import, so that importing the
    laws creates no Z3 terms beyond what it did before they were shared)."""
    if wrap is None:
        wrap = (d_ <= g, z3.Or(d_ >= p, z3.And(d_ == m, m < p, g1 + m == n_)))
    if near is None:
        near = (ub >= uf - dd, 0 <= dd, dd <= g1)
    pf = lambda u_, r_: (shape.pos_f(u_, w_of_(r_), n_), r_)
    pb = lambda u_, r_: (shape.pos_b(u_, w_of_(r_), n_), -r_)
    inside = z3.And(0 <= u, u < n_)
    wrap = z3.And(1 <= d_, d_ <= u, u < n_, *wrap)
    edges = (
        ("F(s-1, x) on rank r-1 before F(s, x)",
         z3.Implies(z3.And(1 <= r, inside), _lex_lt(pf(u, r - 1), pf(u, r)))),
        ("B(s+1, x) on rank r+1 before B(s, x)",
         z3.Implies(z3.And(r + 1 < p, inside), _lex_lt(pb(u, r + 1), pb(u, r)))),
        ("the previous chunk's F on rank p-1 before F on rank 0",
         z3.Implies(wrap, _lex_lt(pf(u - d_, p - 1), pf(u, 0)))),
        ("the next chunk's B on rank 0 before B on rank p-1",
         z3.Implies(wrap, _lex_lt(pb(u - d_, 0), pb(u, p - 1)))),
        ("F(s, x) before B(s, x) on its rank",
         z3.Implies(z3.And(0 <= uf, uf < n_, 0 <= ub, ub < n_, *near),
                    shape.pos_f(uf, w_of_(r), n_) < shape.pos_b(ub, w_of_(r), n_))),
    )
    for name, goal in edges:
        yield Obligation(f"potential: {name}", goal, hyps, example=example)


def _memory(w_of_=w_of, peak=None, text="min((v-1) g + 2 (p-1-r) + 1, v m)", hyps=ABSTRACT,
            example=EXAMPLE):
    """The level's recurrence, and its peak ``peak`` (the warmup plus one, at most ``n``)
    is never passed and reached."""
    w = w_of_(r)
    level = lambda k_: shape.nf(k_, w, n_) - shape.nb(k_, w, n_)
    kind, _ = shape.op(k, w, n_)
    inside = z3.And(0 <= k, k < 2 * n_)
    peak = shape.peak(warmup(r), n_) if peak is None else peak
    yield Obligation("memory: level(0) = 0", level(0) == 0, hyps, example=example)
    yield Obligation("memory: level(k+1) = level(k) + (+1 for F, -1 for B)",
                     z3.Implies(inside, level(k + 1) == level(k) + z3.If(kind == F, 1, -1)),
                     hyps, example=example)
    yield Obligation(f"memory: every step's peak <= {text}",
                     z3.Implies(inside, level(k) + z3.If(kind == F, 1, 0) <= peak),
                     hyps, example=example)
    witness = shape.mn(w, n_ - 1)
    kw, _ = shape.op(witness, w, n_)
    yield Obligation("memory: that peak is reached",
                     z3.And(0 <= witness, witness < 2 * n_, kw == F, level(witness) + 1 == peak),
                     hyps, example=example)


def _flow():
    yield from _stream_obligations(("round size", "in range", "next chunk",
                                    "backward not far before", "regular rounds", "sizes"))
    yield from _potential()


SHAPE = ("the pattern's closed form (proofs.shape) over the package's stream order, = "
         "derive for p <= 8, m <= 24, v <= 4 (tests/test_proofs_expanded.py)")
ALL = all_sizes(f"every p >= 1, m >= 1, v >= 2, rank and position; nonlinear stream facts "
                f"over symbolic p, m, v, g; {SHAPE}")
REGULAR = all_sizes(f"every p, v >= 2 and m < p or with a last round of >= p microbatches "
                    f"(every m a multiple of max(1, m // p) among them); nonlinear stream "
                    f"facts over symbolic p, m, v, g; {SHAPE}; the rest (evened rounds) is "
                    f"law interleaved_1f1b_short_last_round (bounded)")
FLOW = all_sizes(f"every p, v >= 2 and m < p or with a last round of >= p microbatches "
                 f"(every m a multiple of max(1, m // p) among them); lexicographic "
                 f"potential; {SHAPE}; the rest is law interleaved_1f1b_short_last_round "
                 f"(bounded: where the last round would be shorter than p the family "
                 f"evens the rounds out, whose varying sizes no closed form here models)")


def _cell(prop: str, statement: str, scope: str, covers, obligations, weight=3, **extra):
    return law(f"interleaved_1f1b_{prop}", f"interleaved 1F1B: {statement}", scope,
               weight=weight, family=NAME, property=prop, covers=covers, **extra)(obligations)


interleaved_completeness = _cell(
    "completeness", "every F(s, x) and B(s, x) exactly once, on the rank owning s (stage "
    "c p + r on rank r), and nothing else", REGULAR, covers_regular,
    lambda: [*_stream_obligations(("round size", "in range", "sizes")), *_injective(),
             *_completeness()])
interleaved_memory = _cell(
    "memory", "the unit-model peak on rank r is exactly min((v-1) g + 2 (p-1-r) + 1, v m), "
    "g = ceil(m / max(1, m // p))", ALL, _valid,
    lambda: [*_stream_obligations(("sizes",)), *_memory()], peak=peaks)


def flow_cells(cell, scope: str, covers, flow) -> tuple:
    """The dependency, matching and deadlock cells of one data-flow witness ``flow``
    (``cell(prop, statement, scope, covers, obligations)``)."""
    return (
        cell("dependency", "every op's inputs come before it in an acyclic data-flow order, "
             "so the data-flow timing reaches every op: the schedule runs", scope, covers,
             flow),
        cell("matching", "the lowered plan pairs each send with its receive (FIFO per rank "
             "pair, equal counts and payloads)", scope, covers,
             lambda: [*matching_obligations(), *flow()]),
        cell("deadlock", "the lowered plan runs to completion under rendezvous "
             "(completion-time witness: each op's place in lowering's event order)", scope,
             covers, lambda: [*deadlock_obligations(), *flow()]))


interleaved_dependency, interleaved_matching, interleaved_deadlock = flow_cells(
    _cell, FLOW, covers_regular, _flow)

@law("interleaved_1f1b_short_last_round",
     "interleaved 1F1B with m >= p where ceil-sized rounds would leave a last round "
     "shorter than p (the family evens the rounds out instead, all >= p): every op and "
     "nothing else exactly once, every op's inputs are made before it (the package's "
     "data-flow timing), and its lowered plan matches and runs to completion under "
     "rendezvous",
     bounded(f"p <= {P_MAX}, m <= {M_MAX}, chunks 2, 3, the instances with m >= p and a "
             f"last round shorter than p; package-derived and lowered, each checked by the "
             f"verification kernel's obligations"), weight=4)
def interleaved_short_last_round():
    def short(pp):
        return [family(NAME, pp, mm, v).derive() for mm in range(1, M_MAX + 1)
                for v in CHUNKS if not regular(pp, mm)]
    for prop in ("completeness", "dependency", "matching", "deadlock"):
        yield from instances.obligations("interleaved 1F1B, short last round", short,
                                         P_MAX, prop)
