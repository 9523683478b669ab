"""Seq1F1B's invariants (``algebra.families.seq1f1b``), for all sizes: ``p`` ranks (stage
``r`` on rank ``r``), ``m`` samples of ``S >= 1`` sequence chunks each (microbatch
``x S + j`` is chunk ``j`` of sample ``x``), every rank.

**The model.** Rank ``r`` reads ``F^{p-r+S-2} (F B)*`` against its ``n = m S`` chunk
forwards and backwards: the closed form of ``proofs.shape`` with warmup
``w = min(p - r + S - 2, n)`` (1F1B's ``p - 1 - r`` plus the rest of the first sample).
Its forward stream lists the samples ascending, each sample's chunks ascending; its
backward stream the samples ascending, each sample's chunks descending. So chunk ``j`` of
sample ``x`` is forward number ``uF = x S + j`` (its microbatch) and backward number
``uB = x S + (S-1-j)``; every rank has the same streams.

**Stream facts** (nonlinear, proven over symbolic ``m, S``): ``uF, uB`` lie in ``[0, n)``
and are injective, with explicit inverses (``x = u div S``, ``j = u mod S``; backwards
``j = S-1 - u mod S``), so they are bijections onto ``[0, n)``; the previous chunk's
forward is one forward earlier, the next chunk's backward one backward earlier (the chunk
rules of docs/semantics.md §2.5); ``uB >= uF - (S-1)``.

**Shape facts** (linear, over abstract ``n`` and ``S``): the closed form is a bijection
between positions and units (completeness); the level peaks at ``min(p - r + S - 1, n)``
(memory); and the lexicographic potential ``(position, r)`` for forwards,
``(position, -r)`` for backwards strictly increases along every input: ``F(r-1, x)``
(the same forward number on rank ``r-1``, whose warmup is one longer), ``B(r+1, x)``, the
own ``F(r, x)`` (``uB >= uF - (S-1)`` and ``w >= S - 1`` or ``w = n``), the previous
chunk's ``F`` and the next chunk's ``B`` on the rank (one number earlier: the shape's
positions increase with the number), and along each rank's order. So the data-flow graph
is acyclic: lowering's timing reaches every op (dependency), and ``proofs.lowered`` gives
matching and deadlock of the lowered plan. Nothing is left bounded.
"""

from __future__ import annotations

import functools

import z3

from . import family_interleaved as il, shape
from .core import Obligation, all_sizes, law
from .model import F

NAME = "seq1f1b"


def peak(p_: int, m_: int, s: int, r_: int) -> int:
    """Rank ``r_``'s unit-model peak: its warmup plus one, at most every chunk."""
    return min(p_ - r_ + s - 1, m_ * s)


def _valid(params) -> bool:
    s = params.get("seq_chunks")
    return type(s) is int and s >= 1


def peaks(params) -> tuple[int, ...]:
    """The command line's per-rank peaks (``microbatches``: the samples)."""
    pp, mm, s = params["pp"], params["microbatches"], params["seq_chunks"]
    return tuple(peak(pp, mm, s, r_) for r_ in range(pp))


def u_f(x_, j_, s_):
    return x_ * s_ + j_


def u_b(x_, j_, s_):
    return x_ * s_ + (s_ - 1 - j_)


def programs(pp: int, mm: int, s: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """The model's programs, expanded: per rank, ``(kind, stage, mb)`` in order
    (``mm`` samples; the microbatch of chunk ``j`` of sample ``x`` is ``x S + j``)."""
    n = mm * s
    out = []
    for r_ in range(pp):
        prog = []
        for kind, number in shape.expand(min(pp - r_ + s - 2, n), n):
            x_, j_ = divmod(number, s)
            prog.append(("F", r_, number) if kind == F else ("B", r_, x_ * s + s - 1 - j_))
        out.append(tuple(prog))
    return tuple(out)


# ---------------------------------------------------------------- the stream order
# interleaved 1F1B's symbols (the same Z3 terms) and S, j, j2 made when a law is stated
# (``_symbols``): importing this module creates no Z3 term

m, x, x2, u = il.m, il.x, il.x2, il.u


@functools.cache
def _symbols():
    return z3.Ints("S j j2")


@functools.cache
def _stream_frame():
    """``(STREAM, UNIT, example)``: the sizes, a unit ``(x, j)``, a point where they hold."""
    s_, j, j2 = _symbols()
    return ((m >= 1, s_ >= 1), (0 <= x, x < m, 0 <= j, j < s_),
            ((m, z3.IntVal(3)), (s_, z3.IntVal(2)), (x, z3.IntVal(2)), (j, z3.IntVal(1)),
             (x2, z3.IntVal(0)), (j2, z3.IntVal(0)), (u, z3.IntVal(4))))


def _streams():
    s_, j, j2 = _symbols()
    STREAM, UNIT, EXAMPLE = _stream_frame()
    n = m * s_
    yield Obligation("stream: forward and backward numbers lie in [0, m S)",
                     z3.And(0 <= u_f(x, j, s_), u_f(x, j, s_) < n,
                            0 <= u_b(x, j, s_), u_b(x, j, s_) < n),
                     STREAM + UNIT, example=EXAMPLE)
    for label, fn in (("forward", u_f), ("backward", u_b)):
        yield Obligation(f"stream: distinct chunks have distinct {label} numbers",
                         z3.Implies(fn(x, j, s_) == fn(x2, j2, s_), z3.And(x == x2, j == j2)),
                         STREAM + UNIT + (0 <= x2, x2 < m, 0 <= j2, j2 < s_),
                         example=EXAMPLE)
    for fn, text, j_ in ((u_f, "u div S, u mod S", u % s_),
                         (u_b, "u div S, S-1 - u mod S", s_ - 1 - u % s_)):
        yield Obligation(f"stream: every number u in [0, m S) is a chunk ({text})",
                         z3.Implies(z3.And(0 <= u, u < n), z3.And(
                             0 <= u / s_, u / s_ < m, 0 <= j_, j_ < s_, fn(u / s_, j_, s_) == u)),
                         STREAM, example=EXAMPLE)
    yield Obligation("stream: the previous chunk's forward is one number earlier, the next "
                     "chunk's backward one number earlier (the chunk rules)",
                     z3.And(z3.Implies(j >= 1, u_f(x, j - 1, s_) == u_f(x, j, s_) - 1),
                            z3.Implies(j + 1 < s_, u_b(x, j + 1, s_) == u_b(x, j, s_) - 1)),
                     STREAM + UNIT, example=EXAMPLE)
    yield Obligation("stream: a chunk's backward number is at least its forward number "
                     "minus S - 1, and m S >= 1",
                     z3.And(u_b(x, j, s_) >= u_f(x, j, s_) - (s_ - 1), n >= 1),
                     STREAM + UNIT, example=EXAMPLE)


# ---------------------------------------------------------------- the shape, abstractly

p, n_, r, k, uf, ub = il.p, il.n_, il.r, il.k, il.uf, il.ub


@functools.cache
def _frame() -> dict:
    """The shape's warmup on rank ``r``, its sizes (abstract ``n``) and an example point."""
    s_ = _symbols()[0]
    return {"w_of_": lambda r_: shape.mn(p - r_ + s_ - 2, n_),
            "hyps": (p >= 1, s_ >= 1, n_ >= 1, 0 <= r, r < p),
            "example": ((p, z3.IntVal(3)), (s_, z3.IntVal(2)), (n_, z3.IntVal(4)),
                        (r, z3.IntVal(0)), (k, z3.IntVal(0)), (u, z3.IntVal(2)),
                        (uf, z3.IntVal(1)), (ub, z3.IntVal(0)))}


# The inputs ``_potential`` checks (``semantics.needs`` and the chunk rules,
# ``semantics.rules.Chain``): ``kind: ((producer kind, stage offset, chunk offset), ...)``;
# stage offset -1 is ``F`` of the stage before (rank ``r-1``), +1 the gradient of the
# stage after (rank ``r+1``); chunk offset -1 the previous chunk, +1 the next one.
EDGES = {"F": (("F", -1, 0), ("F", 0, -1)), "B": (("F", 0, 0), ("B", 1, 0), ("B", 0, 1))}


def _completeness():
    return il._completeness(**_frame())


def _potential(w_of_=None):
    """Every input edge goes up in ``(position, +-r)`` (``w_of_``: the warmup; a test
    states a shorter one and sees the own-forward edge fail)."""
    frame = _frame()
    s_, w_of_ = _symbols()[0], w_of_ or frame["w_of_"]
    pf = lambda u_, r_: (shape.pos_f(u_, w_of_(r_), n_), r_)
    pb = lambda u_, r_: (shape.pos_b(u_, w_of_(r_), n_), -r_)
    inside = z3.And(0 <= u, u < n_)
    edges = (
        ("F(s-1, x) on rank r-1 before F(s, x)",
         z3.Implies(z3.And(1 <= r, inside), il._lex_lt(pf(u, r - 1), pf(u, r)))),
        ("B(s+1, x) on rank r+1 before B(s, x)",
         z3.Implies(z3.And(r + 1 < p, inside), il._lex_lt(pb(u, r + 1), pb(u, r)))),
        ("F(s, x) before B(s, x) on its rank",
         z3.Implies(z3.And(0 <= uf, uf < n_, 0 <= ub, ub < n_, ub >= uf - (s_ - 1)),
                    pf(uf, r)[0] < pb(ub, r)[0])),
        ("the previous chunk's F before the chunk's F on its rank",
         z3.Implies(z3.And(1 <= u, u < n_), pf(u - 1, r)[0] < pf(u, r)[0])),
        ("the next chunk's B before the chunk's B on its rank",
         z3.Implies(z3.And(1 <= u, u < n_), pb(u - 1, r)[0] < pb(u, r)[0])),
    )
    for name, goal in edges:
        yield Obligation(f"potential: {name}", goal, frame["hyps"], example=frame["example"])


def _memory(peak_=None):
    """The level's recurrence and its peak ``peak_`` (``min(p - r + S - 1, n)``; a test
    states another)."""
    s_ = _symbols()[0]
    stated = shape.mn(p - r + s_ - 1, n_) if peak_ is None else peak_
    return il._memory(peak=stated, text="min(p - r + S - 1, m S)", **_frame())


def _flow():
    yield from _streams()
    yield from _potential()


SHAPE = ("the pattern's closed form (proofs.shape, w = min(p - r + S - 2, m S)) over the "
         "package's chunk streams, = derive and the lowering model = lower for p <= 8, "
         "m <= 8 samples, S <= 4 (tests/test_proofs_seq1f1b.py)")
ALL = all_sizes(f"every p >= 1, m >= 1 samples, S >= 1 chunks, rank and position; "
                f"nonlinear stream facts over symbolic m, S; {SHAPE}")
FLOW = all_sizes(f"every p >= 1, m >= 1 samples, S >= 1 chunks, rank pair; lexicographic "
                 f"potential over every input, the chunk rules included; {SHAPE}")


def _cell(prop: str, statement: str, scope: str, covers, obligations, **extra):
    """A seq1f1b law for ``prop`` (``peak_memory`` for the memory property); the
    dependency law says which inputs the chunk rules add."""
    if prop == "dependency":
        statement += (" (the chunk rules included: each chunk's forward after the previous "
                      "chunk's on its rank and stage, each chunk's backward after the next "
                      "chunk's)")
    return law(f"seq1f1b_{prop}", f"seq1f1b: {statement}", scope, weight=2, family=NAME,
               property="memory" if prop == "peak_memory" else prop, covers=covers,
               **extra)(obligations)


seq1f1b_completeness = _cell(
    "completeness", "every stage's F and B of every chunk of every sample exactly once, on "
    "the stage's rank, and nothing else", ALL, _valid, lambda: [*_streams(), *_completeness()])
seq1f1b_dependency, seq1f1b_matching, seq1f1b_deadlock = il.flow_cells(_cell, FLOW, _valid,
                                                                       _flow)
seq1f1b_peak_memory = _cell(
    "peak_memory", "the unit-model peak on rank r is exactly min(p - r + S - 1, "
    "m S)", ALL, _valid, lambda: [*_streams(), *_memory()], peak=peaks)
