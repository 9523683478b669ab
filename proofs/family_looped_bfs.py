"""Looped BFS's invariants (``algebra.families.looped_bfs``, torch's ``ScheduleLoopedBFS``),
for all sizes: ``p`` ranks, ``v >= 1`` looped chunks (stage ``c p + r`` on rank ``r``),
``m`` microbatches.

**The model.** Rank ``r`` reads ``F* B*`` against its ``n = v m`` forwards and backwards:
the closed form of ``proofs.shape`` with ``w = n`` (GPipe's shape over ``n`` units). Its
forward stream lists chunk 0's microbatches ascending, then chunk 1's, ...; its backward
stream the chunks descending, each chunk's microbatches descending. So chunk ``c`` of
microbatch ``x`` is forward number ``uF = c m + x`` and backward number
``uB = (v-1-c) m + (m-1-x)``.

**Stream facts** (nonlinear, proven over symbolic ``m, v``): ``uF, uB`` lie in ``[0, n)``,
with explicit inverses (``c = u div m, x = u mod m``; backwards ``c = v-1 - u div m,
x = m-1 - u mod m``), so they are bijections onto ``[0, n)``; the previous chunk of a
microbatch is ``m`` forwards earlier, the next one ``m`` backwards earlier.

**Shape facts** (linear, over abstract ``n`` and ``d`` for the chunk distance ``m``):
the closed form is a bijection between positions and units (completeness); the level
peaks at ``n`` (memory); and the lexicographic potential ``(position, r)`` for forwards,
``(position, -r)`` for backwards, strictly increases along every input (``F(s-1, x)``,
``B(s+1, x)``, the own ``F(s, x)``; the wrap from rank ``p-1`` to rank 0 between chunks
and back included, for every ``m >= 1``: a chunk's forwards sit ``m`` places after the
previous chunk's) and along each rank's order, so the data-flow graph is acyclic:
lowering's timing reaches every op (dependency), and ``proofs.lowered`` gives matching
and deadlock of the lowered plan. No timing is derived: when ``m < p`` rank 0 idles
before each next chunk, and the potential needs no closed form of those waits.
"""

from __future__ import annotations

import functools

import z3

from . import family_interleaved as il, shape
from .core import Obligation, all_sizes, law
from .model import B, F

NAME = "looped-bfs"


def peak_of(pp: int, mm: int, v: int, r: int) -> int:
    """Every forward is stored before the first backward: ``v m`` on every rank."""
    return v * mm


def _valid(params) -> bool:
    v = params.get("chunks")
    return isinstance(v, int) and v >= 1


peaks = il.chunked_peaks(peak_of)


def u_f(c_, x_, m_):
    return c_ * m_ + x_


def u_b(c_, x_, m_, v_):
    return (v_ - 1 - c_) * m_ + (m_ - 1 - x_)


def programs(pp: int, mm: int, vv: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """The model's programs, expanded: per rank, ``(kind, stage, mb)`` in order."""
    units = {}
    for xx in range(mm):
        for cc in range(vv):
            units[(F, u_f(cc, xx, mm))] = (cc, xx)
            units[(B, u_b(cc, xx, mm, vv))] = (cc, xx)
    return tuple(tuple(("F" if kind == F else "B", units[(kind, number)][0] * pp + r_,
                        units[(kind, number)][1])
                       for kind, number in shape.expand(mm * vv, mm * vv))
                 for r_ in range(pp))


# ---------------------------------------------------------------- the stream order

# interleaved 1F1B's symbols (the same Z3 terms): importing this module creates none; the
# hypotheses are built when a law is stated (``_stream_frame``, ``_frame``)
m, v, c, x, c2, x2, u, N = il.m, il.v, il.c, il.x, il.c2, il.x2, il.u, il.N


@functools.cache
def _stream_frame():
    """``(STREAM, UNIT, example)``: the sizes, a unit ``(c, x)``, a point where they hold."""
    return ((m >= 1, v >= 1), (0 <= c, c < v, 0 <= x, x < m),
            ((m, z3.IntVal(3)), (v, z3.IntVal(2)), (c, z3.IntVal(1)), (x, z3.IntVal(2)),
             (c2, z3.IntVal(0)), (x2, z3.IntVal(0)), (u, z3.IntVal(4))))


def _streams():
    STREAM, UNIT, STREAM_EXAMPLE = _stream_frame()
    yield Obligation("stream: forward and backward numbers lie in [0, v m)",
                     z3.And(0 <= u_f(c, x, m), u_f(c, x, m) < N,
                            0 <= u_b(c, x, m, v), u_b(c, x, m, v) < N),
                     STREAM + UNIT, example=STREAM_EXAMPLE)
    for label, fn in (("forward", lambda c_, x_: u_f(c_, x_, m)),
                      ("backward", lambda c_, x_: u_b(c_, x_, m, v))):
        yield Obligation(f"stream: distinct units have distinct {label} numbers",
                         z3.Implies(fn(c, x) == fn(c2, x2), z3.And(c == c2, x == x2)),
                         STREAM + UNIT + (0 <= c2, c2 < v, 0 <= x2, x2 < m),
                         example=STREAM_EXAMPLE)
    inverse = ((u_f(u / m, u % m, m), "u div m, u mod m", u / m, u % m),
               (u_b(v - 1 - u / m, m - 1 - u % m, m, v), "v-1 - u div m, m-1 - u mod m",
                v - 1 - u / m, m - 1 - u % m))
    for number, text, c_, x_ in inverse:
        yield Obligation(f"stream: every number u in [0, v m) is unit ({text})",
                         z3.Implies(z3.And(0 <= u, u < N), z3.And(
                             0 <= c_, c_ < v, 0 <= x_, x_ < m, number == u)),
                         STREAM, example=STREAM_EXAMPLE)
    yield Obligation("stream: the previous chunk's forward is m numbers earlier, the next "
                     "chunk's backward m numbers earlier",
                     z3.And(z3.Implies(c >= 1, u_f(c - 1, x, m) == u_f(c, x, m) - m),
                            z3.Implies(c + 1 < v, u_b(c + 1, x, m, v) == u_b(c, x, m, v) - m)),
                     STREAM + UNIT, example=STREAM_EXAMPLE)


# ---------------------------------------------------------------- the shape, abstractly
# interleaved 1F1B's shape obligations with ``w = n`` on every rank, under these sizes only

p, n_, r, k, uf, ub, d_ = il.p, il.n_, il.r, il.k, il.uf, il.ub, il.d_


@functools.cache
def _frame() -> dict:
    """The shape's warmup ``w = n`` on every rank, its sizes and an example point."""
    return {"w_of_": lambda r_: n_, "hyps": (p >= 1, n_ >= 1, 0 <= r, r < p),
            "example": ((p, z3.IntVal(2)), (n_, z3.IntVal(4)), (r, z3.IntVal(0)),
                        (k, z3.IntVal(0)), (u, z3.IntVal(2)), (uf, z3.IntVal(0)),
                        (ub, z3.IntVal(0)), (d_, z3.IntVal(2)))}

# The inputs ``_potential`` checks (``semantics.needs``): ``kind: ((producer kind, stage
# offset), ...)``; offset -1 is ``F`` of the stage before (rank ``r-1``, or rank ``p-1``'s
# previous chunk), +1 the gradient of the stage after (rank ``r+1``, or rank 0's next chunk).
EDGES = {"F": (("F", -1),), "B": (("F", 0), ("B", 1))}


def _completeness():
    return il._completeness(**_frame())


def _potential(w_of_=None):
    """Every input edge goes up in ``(position, +-r)``; the wrap needs only ``d = m >= 1``,
    and any forward comes before any backward on a rank (a test states a shape without
    warmup, ``w = 0``, and sees that fail)."""
    frame = _frame()
    return il._potential(wrap=(), near=(), **{**frame, "w_of_": w_of_ or frame["w_of_"]})


def _memory(peak=None):
    """The level's recurrence and its peak ``peak`` (``n``; a test states another)."""
    return il._memory(peak=n_ if peak is None else peak, text="n = v m", **_frame())


def _flow():
    yield from _streams()
    yield from _potential()


SHAPE = ("the pattern's closed form (proofs.shape, w = n) over the package's stream order, "
         "= derive for p <= 8, m <= 24, v <= 4 (tests/test_proofs_expanded.py)")
ALL = all_sizes(f"every p >= 1, m >= 1, v >= 1, rank and position; nonlinear stream facts "
                f"over symbolic m, v; {SHAPE}")
FLOW = all_sizes(f"every p >= 1, m >= 1, v >= 1, rank pair; lexicographic potential "
                 f"(m < p included: no closed-form timing needed); {SHAPE}")


def _cell(prop: str, statement: str, scope: str, covers, obligations, **extra):
    return law(f"looped_bfs_{prop}", f"looped BFS: {statement}", scope, weight=2,
               family=NAME, property=prop, covers=covers, **extra)(obligations)


looped_bfs_completeness = _cell(
    "completeness", "every F(s, x) and B(s, x) exactly once, on the rank owning s (stage "
    "c p + r on rank r), and nothing else", ALL, _valid,
    lambda: [*_streams(), *_completeness()])
looped_bfs_dependency, looped_bfs_matching, looped_bfs_deadlock = il.flow_cells(
    _cell, FLOW, _valid, _flow)
looped_bfs_memory = _cell(
    "memory", "the unit-model peak on rank r is exactly v m (every forward is stored before "
    "the first backward)", ALL, _valid, lambda: [*_streams(), *_memory()], peak=peaks)
