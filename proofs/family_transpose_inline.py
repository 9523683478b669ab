"""``transpose`` with inline ownership over a 1F1B body (source side; modes recompute,
owner, frozen and none), for every ``p >= 1, m >= 1``.

**The model.** Inline ownership keeps every microbatch's segment work on the home rank
0, right next to the body op it feeds or follows: the segment forward ``SF(x)`` just
before ``F(0, x)`` and, in the trainable modes (``t = 1``: recompute, owner), the segment
backward ``SB(x)`` just after ``B(0, x)``. Nothing of the segment leaves rank 0, so no
recompute is needed (its forward and backward share a rank), the cut requires no
collective and none is run. Ranks ``r >= 1`` run 1F1B's program (``proofs.families``).
With ``w = min(p-1, m)``, rank 0's program is three runs of blocks,

    warmup   (SF F)^w                  positions [0, S0),  S0 = 2w
    steady   (SF F B SB^t)^(m-w)       positions [S0, S1), S1 = S0 + (3+t)(m-w)
    cooldown (B SB^t)^w                positions [S1, (3+t) m)

(the steady block ``j`` holds ``SF(w+j) F(w+j) B(j) SB(j)``, the cooldown block ``j``
``B(m-w+j) SB(m-w+j)``): the 1F1B shape ``F^w (F B)* B^w`` with the segment ops woven in.
Its inverse ``pos0`` gives each unit's position. Block lengths are constants for each
``t``, so both ``t`` are proven separately in linear integer arithmetic.

**Proofs.** Completeness: ``op0`` and ``pos0`` are inverse bijections between rank 0's
positions and its units; ranks ``r >= 1`` are 1F1B's bijection; and the inline cut
requires no collective. Dependency: a unit-duration timing witness, three times 1F1B's
closed-form timing for body ops, one less for ``SF(x)`` and one more for ``SB(x)``, that
every rank's order and every input (the body's, ``SF(x) -> F(0, x)``, ``B(0, x) ->
SB(x)``, ``SF(x) -> SB(x)``) respects: the data-flow graph is acyclic and the timing
reaches every op, so ``proofs.lowered`` gives matching and deadlock of the lowered plan
(no collective is among its events). Memory: rank 0's level (``SF`` stores ``t``, ``F``
1, ``B`` and ``SB`` free one each) as a closed form that satisfies the level's
recurrence, with peak ``(1+t) min(p, m)`` (= ``body(0) + t min(p, m)``); ranks ``r >= 1``
keep 1F1B's ``min(p - r, m)``.

``programs`` expands the model; ``tests/test_proofs_transpose_inline.py`` compares it, and the
lowering model of ``proofs.expanded.lowered``, with the package's ``derive`` and ``lower``
for every ``p <= 8, m <= 24`` and mode.
"""

from __future__ import annotations

import z3

from . import families
from .core import Obligation, all_sizes, law
from .lowered import deadlock_obligations, matching_obligations
from .model import B, F
from .shape import div, ite, mn

NAME = "transpose"
MODES = ("recompute", "owner", "frozen", "none")
TRAINABLE = ("recompute", "owner")
BODY, SEG = 0, 1  # an op of rank 0: the body's stage 0, or the segment

p, m, k, x = families.p, families.m, families.k, families.x  # t (1 trainable, 0 not) is
# a Python integer: each t is its own linear obligation
SIZES0 = (p >= 1, m >= 1)
EXAMPLE = ((p, z3.IntVal(3)), (m, z3.IntVal(4)), (k, z3.IntVal(0)), (x, z3.IntVal(0)))


def covers(params) -> bool:
    """Inline ownership of a source segment over a 1F1B body, any mode and size."""
    return (params.get("body") == "1f1b" and params.get("ownership") == "inline"
            and params.get("side") == "source" and params.get("mode") in MODES
            and params.get("chunks") is None)


def trainable(mode: str) -> int:
    return 1 if mode in TRAINABLE else 0


def peak0(tt: int, p_, m_):
    """Rank 0's unit-model peak ``(1+t) min(p, m)`` (Z3 terms or Python integers)."""
    return (1 + tt) * mn(p_, m_)


def peak_of(pp: int, mm: int, tt: int, r_: int) -> int:
    """Rank ``r_``'s unit-model peak: ``peak0`` on rank 0, else 1F1B's ``min(p - r, m)``."""
    return peak0(tt, pp, mm) if r_ == 0 else min(pp - r_, mm)


def peaks(params) -> tuple[int, ...]:
    pp, tt = params["pp"], trainable(params["mode"])
    return tuple(peak_of(pp, params["microbatches"], tt, r_) for r_ in range(pp))


# ---------------------------------------------------------------- rank 0's closed form


def _bounds(tt: int, p_, m_):
    w = mn(p_ - 1, m_)
    s0 = 2 * w
    return w, s0, s0 + (3 + tt) * (m_ - w)


def length0(tt: int, m_=m):
    return (3 + tt) * m_


def op0(k_, tt: int, p_=p, m_=m):
    """``(kind, part, mb)`` of rank 0's op ``k_`` (Z3 terms or Python integers)."""
    w, s0, s1 = _bounds(tt, p_, m_)
    jw, ow = div(k_, 2), k_ % 2
    js, os_ = div(k_ - s0, 3 + tt), (k_ - s0) % (3 + tt)
    jc, oc = div(k_ - s1, 1 + tt), (k_ - s1) % (1 + tt)
    warm, steady = k_ < s0, k_ < s1
    kind = ite(warm, F, ite(steady, ite(os_ <= 1, F, B), B))
    part = ite(warm, ite(ow == 0, SEG, BODY),
               ite(steady, ite(os_ == 0, SEG, ite(os_ == 3, SEG, BODY)),
                   ite(oc == 1, SEG, BODY)))
    unit = ite(warm, jw, ite(steady, ite(os_ <= 1, w + js, js), m_ - w + jc))
    return kind, part, unit


def pos0(kind, part, x_, tt: int, p_=p, m_=m):
    """The position of unit ``(kind, part, x_)`` on rank 0 (``op0``'s inverse)."""
    w, s0, s1 = _bounds(tt, p_, m_)
    sf = ite(x_ < w, 2 * x_, s0 + (3 + tt) * (x_ - w))
    b = ite(x_ < m_ - w, s0 + (3 + tt) * x_ + 2, s1 + (1 + tt) * (x_ - (m_ - w)))
    return ite(kind == F, ite(part == SEG, sf, sf + 1), ite(part == SEG, b + 1, b))


def level0(k_, tt: int, p_=p, m_=m):
    """Activations stored on rank 0 before position ``k_`` (unit model)."""
    w, s0, s1 = _bounds(tt, p_, m_)
    base = w * (1 + tt)
    os_ = (k_ - s0) % (3 + tt)
    steady = base + ite(os_ == 0, 0, ite(os_ == 1, tt, ite(os_ == 2, tt + 1, tt)))
    cool = base - div(k_ - s1, 1 + tt) * (1 + tt) - (k_ - s1) % (1 + tt)
    return ite(k_ <= s0, div(k_, 2) * (1 + tt) + (k_ % 2) * tt,
               ite(k_ <= s1, steady, cool))


def _label(kind, part) -> str:
    return ("S" if part == SEG else "") + ("F" if kind == F else "B")


def _units(tt: int):
    """Rank 0's unit kinds: body F and B, segment F, and segment B when trainable."""
    return ((F, BODY), (F, SEG), (B, BODY)) + (((B, SEG),) if tt else ())


def programs(pp: int, mm: int, mode: str, segment: str = "vision"):
    """The model's programs, expanded: per rank, ``(kind, stage, mb, segment)``."""
    tt = trainable(mode)
    rank0 = []
    for kk in range(length0(tt, mm)):
        kind, part, unit = op0(kk, tt, pp, mm)
        rank0.append(("F" if kind == F else "B", 0, unit, segment if part == SEG else ""))
    body = [tuple(("F" if kd == F else "B", rr, mb, "")
                  for kd, mb in (families.one_f_one_b_op(kk, rr, pp, mm)
                                 for kk in range(2 * mm)))
            for rr in range(1, pp)]
    return (tuple(rank0), *body)


# ---------------------------------------------------------------- obligations


def _completeness(tt: int):
    n = length0(tt)
    kind, part, unit = op0(k, tt)
    yield Obligation(f"rank 0 (t={tt}): each position holds a unit found at that unit's "
                     "position",
                     z3.Implies(z3.And(0 <= k, k < n), z3.And(
                         z3.Or(kind == F, kind == B), z3.Or(part == BODY, part == SEG),
                         z3.Implies(z3.And(kind == B, part == SEG), tt == 1),
                         0 <= unit, unit < m, pos0(kind, part, unit, tt) == k)),
                     SIZES0, example=EXAMPLE)
    for kd, pt in _units(tt):
        at = pos0(kd, pt, x, tt)
        k2, p2, u2 = op0(at, tt)
        yield Obligation(f"rank 0 (t={tt}): each {_label(kd, pt)}(x) sits at its position",
                         z3.Implies(z3.And(0 <= x, x < m), z3.And(
                             0 <= at, at < n, k2 == kd, p2 == pt, u2 == x)),
                         SIZES0, example=EXAMPLE)


def _no_collective():
    """The cut's rule (``semantics.Chain.required_collectives``): a parameter broadcast
    when some forward, or a recompute's backward, runs off home; a gradient all-reduce
    when some backward does. Inline puts every one on home: neither is required."""
    own, back = z3.Function("owner", z3.IntSort(), z3.IntSort()), z3.Function(
        "backward_rank", z3.IntSort(), z3.IntSort())
    recompute, home = z3.Bool("recompute"), z3.Int("home")
    inside = z3.And(0 <= x, x < m)
    inline = z3.ForAll([x], z3.Implies(inside, z3.And(own(x) == home, back(x) == home)))
    broadcast = z3.Exists([x], z3.And(inside, z3.Or(own(x) != home, z3.And(
        recompute, back(x) != own(x), back(x) != home))))
    all_reduce = z3.Exists([x], z3.And(inside, back(x) != home))
    yield Obligation("the inline cut requires no parameter broadcast and no gradient "
                     "all-reduce", z3.Not(z3.Or(broadcast, all_reduce)),
                     (m >= 1, home == 0, inline))


def _time(r_, kind, part, x_):
    """The witness timing: 1F1B's closed-form times, three times over, for body ops;
    ``SF(x)`` one before ``F(0, x)``, ``SB(x)`` one after ``B(0, x)``."""
    tf = 3 * families._one_f_one_b_tf(r_, x_)
    tb = 3 * families._one_f_one_b_tb(r_, x_)
    return ite(kind == F, ite(part == SEG, tf - 1, tf), ite(part == SEG, tb + 1, tb))


# The inputs at the cut, (producer, consumer) of one microbatch on rank 0: the segment's
# output into F(0, x); B(0, x)'s gradient and SF(x)'s stored activation into SB(x).
SEGMENT_EDGES = (((F, SEG), (F, BODY)), ((B, BODY), (B, SEG)), ((F, SEG), (B, SEG)))


def _flow():
    """The witness timing respects every rank's order and every input."""
    yield from families._dataflow(families.one_f_one_b_op,
                                  lambda r_, x_: _time(r_, F, BODY, x_),
                                  lambda r_, x_: _time(r_, B, BODY, x_), "1F1B body (x3)")
    inside = z3.And(0 <= x, x < m)
    for tt in (0, 1):
        kind, part, unit = op0(k, tt)
        k2, p2, u2 = op0(k + 1, tt)
        yield Obligation(f"rank 0 (t={tt}): its ops run in order",
                         z3.Implies(z3.And(0 <= k, k + 1 < length0(tt)),
                                    _time(0, kind, part, unit) + 1 <= _time(0, k2, p2, u2)),
                         SIZES0, example=EXAMPLE)
    for (ka, pa), (kb, pb) in SEGMENT_EDGES:
        name = f"{_label(ka, pa)}(x) before {_label(kb, pb)}(x) on rank 0"
        yield Obligation(f"segment: {name} (finishes before the other starts)",
                         z3.Implies(inside, _time(0, ka, pa, x) + 1 <= _time(0, kb, pb, x)),
                         SIZES0, example=EXAMPLE)


def _order():
    """On rank 0, each backward comes after its forward (segment and body)."""
    for tt in (0, 1):
        for pt in (BODY, SEG) if tt else (BODY,):
            yield Obligation(f"rank 0 (t={tt}): {_label(B, pt)}(x) after {_label(F, pt)}(x)",
                             z3.Implies(z3.And(0 <= x, x < m),
                                        pos0(F, pt, x, tt) < pos0(B, pt, x, tt)),
                             SIZES0, example=EXAMPLE)


def _memory(tt: int):
    n, peak = length0(tt), peak0(tt, p, m)
    kind, part, _ = op0(k, tt)
    alloc = ite(kind == F, ite(part == SEG, tt, 1), 0)
    delta = ite(kind == F, ite(part == SEG, tt, 1), -1)
    inside = z3.And(0 <= k, k < n)
    name = f"rank 0 (t={tt})"
    yield Obligation(f"{name}: level(0) = 0", level0(0, tt) == 0, SIZES0, example=EXAMPLE)
    yield Obligation(f"{name}: level(k+1) = level(k) + (F: 1, SF: t, B and SB: -1)",
                     z3.Implies(inside, level0(k + 1, tt) == level0(k, tt) + delta),
                     SIZES0, example=EXAMPLE)
    yield Obligation(f"{name}: every step's peak <= (1+t) min(p, m)",
                     z3.Implies(inside, level0(k, tt) + alloc <= peak), SIZES0,
                     example=EXAMPLE)
    w = mn(p - 1, m)
    witness = ite(m > w, 2 * w + 1, 2 * w - 1)
    kw, pw, _ = op0(witness, tt)
    yield Obligation(f"{name}: the peak (1+t) min(p, m) is reached",
                     z3.And(0 <= witness, witness < n, kw == F, pw == BODY,
                            level0(witness, tt) + 1 == peak), SIZES0, example=EXAMPLE)


def _body_memory():
    peak = families._Peak(lambda r_: mn(p - r_, m), "min(p - r, m)")
    yield from families._peak(families.one_f_one_b_op, families._one_f_one_b_nf,
                              families._one_f_one_b_nb, peak, mn(families.warmup(), m - 1),
                              "1F1B body")


MODEL = ("the model's closed form, = the package's derive and lower for p <= 8, m <= 24 "
         "and every mode (tests/test_proofs_transpose_inline.py)")
ALL = all_sizes(f"every p >= 1, m >= 1, mode, rank and position; inline ownership, source "
                f"side, body 1f1b; {MODEL}")
FLOW = all_sizes(f"every p >= 1, m >= 1, mode, rank pair; inline ownership, source side, "
                 f"body 1f1b; closed-form timing witness; the lowering model of "
                 f"proofs.lowered; {MODEL}")


def _cell(prop: str, statement: str, scope: str, obligations, **extra):
    return law(f"transpose_inline_{prop}", f"transpose, inline ownership, 1F1B body: "
               f"{statement}", scope, weight=2, family=NAME, property=prop, covers=covers,
               **extra)(obligations)


transpose_inline_completeness = _cell(
    "completeness", "rank 0 runs SF(x) F(0, x) B(0, x) and, trainable, SB(x) exactly once "
    "per microbatch (closed form (SF F)^w (SF F B SB^t)* (B SB^t)^w), rank r >= 1 1F1B's "
    "program; the cut requires no collective and none is run", ALL,
    lambda: [*_completeness(0), *_completeness(1),
             *families._complete(families.one_f_one_b_op, families.one_f_one_b_pos,
                                 "1F1B body"), *_no_collective()])
transpose_inline_dependency = _cell(
    "dependency", "every op's inputs (the segment's output into F(0, x), B(0, x)'s gradient "
    "and the stored activation into SB(x)) come before it in a data-flow timing that "
    "reaches every op: the schedule runs", FLOW,
    lambda: [*_order(), *families._order(families.one_f_one_b_pos, "1F1B body"), *_flow()])
transpose_inline_matching = _cell(
    "matching", "the lowered plan pairs each send with its receive (FIFO per rank pair, "
    "equal counts and payloads)", FLOW, lambda: [*matching_obligations(), *_flow()])
transpose_inline_deadlock = _cell(
    "deadlock", "the lowered plan runs to completion under rendezvous (completion-time "
    "witness: each op's place in lowering's event order; no collective)", FLOW,
    lambda: [*deadlock_obligations(), *_flow()])
transpose_inline_memory = _cell(
    "memory", "the unit-model peak is (1+t) min(p, m) on rank 0 (t = 1 for recompute and "
    "owner, 0 for frozen and none) and min(p - r, m) on rank r >= 1", ALL,
    lambda: [*_memory(0), *_memory(1), *_body_memory()], peak=peaks)
