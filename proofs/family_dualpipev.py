"""DualPipeV (``algebra.families.DUALPIPEV``): V placement (chunk 0 is stage ``r``, chunk
1 stage ``2p-1-r``, both on rank ``r``), ``m >= 2p``; the steady state overlaps a forward
of one chunk with a backward of the other in one step.

**The model** (DeepSeek's and torch 2.13's order). With ``a = p-1-r``, ``S = m-2p+r+1``,
``h = (r+1)//2``, ``e = r+1-2h`` (1 on even ranks) and ``t`` (1 on the last rank, else
0), reading the pattern is reading eleven phases of steps, each a body repeated ``n``
times; in iteration ``j`` a letter names ``kind chunk`` and a microbatch affine in ``j``
(``<X Y>``: one overlapped step):

    phase  n      body
    1      2a     F0 j
    2      r+1    F0 2a+j;  F1 j
    3      a      I1 j;  W1 j;  F1 r+1+j
    4      t      F0 2p-r-1+j;  B1 a+j;  <F1 p+j  B0 j>
    5      S-t    <F0 2p-r-1+t+j  B1 a+t+j>;  <F1 p+t+j  B0 t+j>
    6      a      B1 a+S+j;  <F1 p+S+j  B0 S+j>
    7      h      B1 2a+S+j;  B0 S+a+j
    8      e      B1 2a+S+h+j;  I0 S+a+h+j
    9      h      I1 2a+S+h+e+j;  I0 S+a+h+e+j
    10     a      W  wq(j);  I0 m-p+r+1+j
    11     r+1    W  wq(a+j)

Every letter pops (``m >= 2p``: no stream runs dry before its last letter). An unchunked
``W`` pops the oldest queued weight gradient, so the ``n``-th ``W`` after phase 3 pops
the ``n``-th ``I`` of phases 8-10: ``wq(n)`` (``queued``). That this is what ``derive``
returns is checked op for op for every ``p <= 8``, ``2p <= m <= 24`` by
tests/test_proofs_family_models.py. So chunk 0's microbatches ``< S+a+h`` get a full
``B``, the rest ``I`` and ``W``; chunk 1's in ``[a, 2a+S+h+e)`` a full ``B``, the rest
``I`` and ``W``.

**All sizes.** Every step ``k`` is step ``o`` of an iteration ``j`` of one phase
(``k = s + b j + o``), and each claim is proven step by step for symbolic ``p >= 1,
m >= 2p``, ``r`` and ``j``. Completeness: each member of each step is a required unit
found at that unit's position (an explicit inverse), a single step has no second member,
and each required unit sits at its position: a bijection between the steps' members and
the required units. Dependency: a closed-form clock (unit durations: rank ``r``'s step
``k`` starts at ``k + r``, plus one tick for each main-step iteration ``1..r`` begun)
advances along every rank (less one tick on the last rank from its third main step on),
and every input of every unit, across ranks, the V's turn and full or split backwards,
finished before its step, so no member of an overlapped step needs another's output.
The unit-model peak ``2p + 1`` on every rank: a closed-form level before each step
(``level_at``; every letter pops) satisfies the level's recurrence step to step and
across phase boundaries, every step stays within the peak, and the first main step's
``F0`` reaches it.

**Matching and deadlock**, all sizes: the clock ranks every step above its predecessor on
its rank and above the step producing each input of each member, so the data-flow graph
of the steps is acyclic and lowering's data-flow timing (any durations) reaches every
step. Lowering and the timing treat an overlapped step as one op (its members' inputs
needed before it, their transfers after it), as the clock does, so ``proofs.lowered``
proves matching and deadlock of the lowered plan.
"""

from __future__ import annotations

import functools

import z3

from mpipe_verified.ir import Compute, Overlap

from .core import Obligation, all_sizes, law, memo_terms
from .family_zbv import stage
from .lowered import family_laws
from .model import B, F, I, W
from .shape import div, ite

KINDS = {"F": F, "B": B, "I": I, "W": W}
QUEUED = "queued"  # a W letter whose unit is wq(base + j)


def _dims(p, m, r):
    """``a``, ``S``, ``h``, ``e`` (1 on even ranks: the middle pair's ``B1 I0``) and
    ``t`` (1 on the last rank: its first main step runs ``F0`` and ``B1`` apart)."""
    a, h = p - 1 - r, div(r + 1, 2)
    return a, m - 2 * p + r + 1, h, r + 1 - 2 * h, ite(r == p - 1, 1, 0)


def phases(p, m, r):
    """``(n, steps)`` per phase; a step is a tuple of letters ``(kind, chunk, base)``
    naming microbatch ``base + j`` in iteration ``j`` (``chunk`` ``QUEUED``: ``W`` of
    ``wq(base + j)``). Works on ints and Z3 terms alike."""
    a, S, h, e, t = _dims(p, m, r)
    return (
        (2 * a, ((("F", 0, 0),),)),
        (r + 1, ((("F", 0, 2 * a),), (("F", 1, 0),))),
        (a, ((("I", 1, 0),), (("W", 1, 0),), (("F", 1, r + 1),))),
        (t, ((("F", 0, 2 * p - r - 1),), (("B", 1, a),), (("F", 1, p), ("B", 0, 0)))),
        (S - t, ((("F", 0, 2 * p - r - 1 + t), ("B", 1, a + t)),
                 (("F", 1, p + t), ("B", 0, t)))),
        (a, ((("B", 1, a + S),), (("F", 1, p + S), ("B", 0, S)))),
        (h, ((("B", 1, 2 * a + S),), (("B", 0, S + a),))),
        (e, ((("B", 1, 2 * a + S + h),), (("I", 0, S + a + h),))),
        (h, ((("I", 1, 2 * a + S + h + e),), (("I", 0, S + a + h + e),))),
        (a, ((("W", QUEUED, 0),), (("I", 0, m - p + r + 1),))),
        (r + 1, ((("W", QUEUED, a),),)),
    )


def queued(p, m, r, n):
    """``(chunk, mb)`` of the ``n``-th ``I`` of phases 8-10 (FIFO: what the ``n``-th
    unchunked ``W`` pops): phase 8's ``I0``, then phase 9's pairs ``I1 I0``, then phase
    10's ``I0``s; chunk 0's are microbatches ``S+a+h, S+a+h+1, ...`` in turn."""
    a, S, h, e, _ = _dims(p, m, r)
    k = n - e
    one = z3.And(k >= 0, k < 2 * h, k % 2 == 0) if isinstance(k, z3.ExprRef) else (
        0 <= k < 2 * h and k % 2 == 0)
    mb0 = ite(n < e, S + a + h + n, ite(k < 2 * h, S + a + h + e + div(k, 2),
                                        m - p + r + 1 + n - e - 2 * h))
    return ite(one, 1, 0), ite(one, 2 * a + S + h + e + div(k, 2), mb0)


def unit(p, m, r, letter, j):
    """``(kind, chunk, mb)`` a letter names in iteration ``j``."""
    kd, c, base = letter
    if c == QUEUED:
        return (kd,) + tuple(queued(p, m, r, base + j))
    return kd, c, base + j


def model(p: int, m: int, v: int | None = None):
    """Per-rank programs of DualPipeV as the model reads them (``v`` is always 2)."""
    out = []
    for r in range(p):
        prog = []
        for n, body in phases(p, m, r):
            for j in range(max(0, n)):
                for step in body:
                    ops = tuple(Compute(kd, stage(p, r, c), x)
                                for kd, c, x in (unit(p, m, r, lt, j) for lt in step))
                    prog.append(ops[0] if len(ops) == 1 else Overlap(ops))
        out.append(tuple(prog))
    return tuple(out)


def backward_is_full(p, m, r, chunk, x):
    """Whether microbatch ``x`` of ``chunk`` gets a full ``B`` (else ``I`` and ``W``)."""
    a, S, h, e, _ = _dims(p, m, r)
    if chunk == 0:
        return x < S + a + h
    return z3.And(a <= x, x < 2 * a + S + h + e)


# ---------------------------------------------------------------- symbolic steps

p, m, r, k, x = z3.Ints("p m r k x")
SIZES = (p >= 1, m >= 2 * p, 0 <= r, r < p)
PHASES = phases(p, m, r)


def _spans():
    out, at = [], z3.IntVal(0)
    for n, body in PHASES:
        out.append((n, body, at))
        at = at + n * len(body)
    return out, at


SPANS, LENGTH = _spans()
NONE = (z3.IntVal(-1), z3.IntVal(-1), z3.IntVal(-1))


@memo_terms
def member(k_, slot: int):
    """``(kind, chunk, mb)`` of member ``slot`` of step ``k_`` (all -1: no such member)."""
    out = NONE
    for n, body, s in reversed(SPANS):
        b = len(body)
        j, o = (k_ - s) / b, (k_ - s) % b
        here = NONE
        for idx in reversed(range(b)):
            step = body[idx]
            if slot < len(step):
                kd, c, mb = unit(p, m, r, step[slot], j)
                got = (z3.IntVal(KINDS[kd]), c, mb)
            else:
                got = NONE
            here = tuple(z3.If(o == idx, g, h) for g, h in zip(got, here))
        inside = z3.And(s <= k_, k_ < s + n * b)
        out = tuple(z3.If(inside, g, h) for g, h in zip(here, out))
    return out


@memo_terms
def position(kd: str, c: int, x_):
    """``(step, slot)`` of the member naming ``kd c(x_)``: the inverse of ``member``."""
    a, S, h, e, _ = _dims(p, m, r)
    pos, slot = z3.IntVal(-1), z3.IntVal(-1)
    for n, body, s in reversed(SPANS):
        for o, step in enumerate(body):
            for sl, (lk, lc, base) in enumerate(step):
                if lk != kd:
                    continue
                if lc == QUEUED:  # invert wq: the W ordinal n, then its iteration
                    if c == 1:
                        jj = x_ - (2 * a + S + h + e)
                        ok, nth = z3.And(0 <= jj, jj < h), e + 2 * jj
                    else:
                        jj = x_ - (S + a + h)  # chunk 0's I0s: e, then h pairs, then a
                        ok = z3.And(0 <= jj, jj < e + h + a)
                        nth = z3.If(jj < e, jj, z3.If(jj < e + h, e + 2 * (jj - e) + 1,
                                                      e + 2 * h + jj - e - h))
                    j = nth - base
                elif lc == c:
                    j, ok = x_ - base, z3.BoolVal(True)
                else:
                    continue
                found = z3.And(ok, 0 <= j, j < n)
                pos = z3.If(found, s + len(body) * j + o, pos)
                slot = z3.If(found, sl, slot)
    return pos, slot


def required(kind, chunk, mb):
    full = z3.If(chunk == 0, backward_is_full(p, m, r, 0, mb),
                 backward_is_full(p, m, r, 1, mb))
    return z3.Or(kind == F, z3.And(kind == B, full), z3.And(z3.Or(kind == I, kind == W),
                                                            z3.Not(full)))


UNITS = [(kd, c) for kd in "FBIW" for c in (0, 1)]
MODEL = ("the model, = the package's programs for p <= 8, 2p <= m <= 24 "
         "(tests/test_proofs_family_models.py)")


def covers(params) -> bool:
    """The laws' instances: every ``m >= 2p`` (the family's own condition)."""
    return params["microbatches"] >= 2 * params["pp"]


def peaks(params) -> tuple[int, ...]:
    """The proven per-rank peak of an instance (the command line's)."""
    return (peak_of(params["pp"], params["microbatches"], 0),) * params["pp"]


def position_of(kind, chunk, mb):
    out = (z3.IntVal(-1), z3.IntVal(-1))
    for kd, c in UNITS:
        got = position(kd, c, mb)
        hit = z3.And(kind == KINDS[kd], chunk == c)
        out = tuple(z3.If(hit, g, h) for g, h in zip(got, out))
    return out


def cover():
    """Every step ``k`` is step ``o`` of an iteration ``j`` of one phase."""
    def decomposed(n, body, s):
        b = len(body)
        return z3.And(s <= k, k < s + n * b, 0 <= (k - s) / b, (k - s) / b < n,
                      k == s + b * ((k - s) / b) + (k - s) % b)
    yield Obligation("DualPipeV: each step is step o of iteration j of a phase (k = s + b j "
                     "+ o, 0 <= j < n)", z3.Implies(z3.And(0 <= k, k < LENGTH), z3.Or(*[
                         decomposed(n, body, s) for n, body, s in SPANS])), SIZES)


@law("dualpipev_completeness",
     "DualPipeV: rank r runs, for each of its stages (r and 2p-1-r) and microbatch, F once "
     "and either B once or I and W once each (as the model assigns), and nothing else",
     all_sizes(f"every p >= 1, m >= 2p, rank r < p, step and member; {MODEL}"),
     family="dualpipev", property="completeness", covers=covers)
def dualpipev_completeness():
    j = z3.Int("j")
    yield from cover()
    for i, (n, body, s) in enumerate(SPANS):
        for o, step in enumerate(body):
            at = s + len(body) * j + o
            claims = []
            for sl in (0, 1):
                kind, chunk, mb = member(at, sl)
                if sl == len(step):
                    claims.append(kind == -1)  # a single step has no second member
                    continue
                kd, c, x_ = unit(p, m, r, step[sl], j)
                back = position_of(kind, chunk, mb)
                claims += [kind == KINDS[kd], chunk == c, mb == x_, 0 <= mb, mb < m,
                           required(kind, chunk, mb), back[0] == at, back[1] == sl]
            yield Obligation(f"DualPipeV phase {i + 1} step {o}: each member is a required "
                             f"unit of rank r found at that unit's position, and there is "
                             f"no other", z3.And(*claims), (0 <= j, j < n) + SIZES)
    yield from sits()


def sits():
    """Each required unit is the member at its position (``position``)."""
    for kd, c in UNITS:
        at, sl = position(kd, c, x)
        got = [z3.And(*[g == w for g, w in zip(member(at, s_), (KINDS[kd], c, x))])
               for s_ in (0, 1)]
        need = required(z3.IntVal(KINDS[kd]), z3.IntVal(c), x)
        yield Obligation(f"DualPipeV: each required {kd}{c}(r, x) sits at its position",
                         z3.Implies(z3.And(0 <= x, x < m, need), z3.And(
                             0 <= at, at < LENGTH, z3.Or(z3.And(sl == 0, got[0]),
                                                         z3.And(sl == 1, got[1])))), SIZES)


# ---------------------------------------------------------------- memory


def _delta(step) -> int:
    """A step's change of the level (unit model: F stores 1, B or W frees it)."""
    kinds = [lt[0] for lt in step]
    return kinds.count("F") - kinds.count("B") - kinds.count("W")


def level_at(i: int, j_, o: int):
    """The level before step ``o`` of iteration ``j_`` of phase ``i``: the earlier phases
    whole, the iterations before ``j_``, then the steps before ``o`` (every letter pops,
    ``m >= 2p``). Linear in the symbols, so each step of the recurrence is too."""
    total = z3.IntVal(0)
    for n, body, _ in SPANS[:i]:
        total = total + n * sum(_delta(st) for st in body)
    body = SPANS[i][1]
    return total + j_ * sum(_delta(st) for st in body) + sum(_delta(st) for st in body[:o])


def peak_of(p_, m_, r_):
    """The unit-model peak on rank ``r_`` (ints or Z3 terms)."""
    return 2 * p_ + 1


PEAK = peak_of(p, m, r)


@law("dualpipev_peak_memory",
     "DualPipeV: the peak of stored activations (unit model: F stores 1, B or W frees it) on "
     "every rank is 2p + 1",
     all_sizes(f"every p >= 1, m >= 2p, rank and step; a closed-form level per step proven "
               f"to satisfy the level's recurrence, step to step and across phase "
               f"boundaries; {MODEL}"),
     family="dualpipev", property="memory", covers=covers, peak=peaks)
def dualpipev_peak_memory():
    j = z3.Int("j")
    yield from cover()
    yield Obligation("DualPipeV: the level before the first step is 0",
                     level_at(0, 0, 0) == 0, SIZES)
    for i in range(len(SPANS) - 1):
        yield Obligation(f"DualPipeV: the level after phase {i + 1} is the level before "
                         f"phase {i + 2}", level_at(i, SPANS[i][0], 0) == level_at(i + 1, 0, 0),
                         SIZES)
    for i, (n, body, _) in enumerate(SPANS):
        for o, step in enumerate(body):
            case = (0 <= j, j < n) + SIZES
            after = level_at(i, j, o + 1) if o + 1 < len(body) else level_at(i, j + 1, 0)
            yield Obligation(f"DualPipeV phase {i + 1} step {o}: the level after it is the "
                             f"level before it + F - B - W of the step",
                             after == level_at(i, j, o) + _delta(step), case)
            fwd = sum(1 for lt in step if lt[0] == "F")
            yield Obligation(f"DualPipeV phase {i + 1} step {o}: the step's peak <= 2p + 1",
                             level_at(i, j, o) + fwd <= PEAK, case)
    assert SPANS[3][1][0][0][0] == SPANS[4][1][0][0][0] == "F"  # the first main step's F0
    yield Obligation("DualPipeV: the peak is reached at the first main step's F0 (phase 4, "
                     "iteration 0, step 0 on the last rank; phase 5's on the others)",
                     z3.Or(z3.And(SPANS[3][0] >= 1, level_at(3, 0, 0) + 1 == PEAK),
                           z3.And(SPANS[4][0] >= 1, level_at(4, 0, 0) + 1 == PEAK)), SIZES)


# ---------------------------------------------------------------- dependency


def clock(r_, k_):
    """The timing witness (unit durations, an overlapped step included): rank ``r_``'s
    step ``k_`` starts at ``k_ + r_``, plus one tick for each of the main steps'
    iterations ``1..r_`` begun (the V's turn: the last chunk-1 forwards reach rank ``r_``
    late), less one on the last rank (``r_ >= 1``) from its third main step on (its first
    main step's ``F0`` and ``B1`` run apart, in the tick the first late one would take)."""
    a = p - 1 - r_
    s4 = 2 * a + 2 * (r_ + 1) + 3 * a
    late = (k_ - s4) / 2
    apart = z3.If(z3.And(r_ == p - 1, r_ >= 1, k_ >= s4 + 2), 1, 0)
    return k_ + r_ + z3.If(k_ < s4, 0, z3.If(late > r_, r_, late)) - apart


def _at(r_, kd: str, c: int, x_):
    """Rank ``r_``'s step holding ``kd c(x_)`` (its grad-producing backward: ``B`` or
    ``I``, whichever the model assigns, for ``kd == "grad"``)."""
    here = _Rank(r_)
    if kd != "grad":
        return here.position(kd, c, x_)[0]
    full = here.full(c, x_)
    return z3.If(full, here.position("B", c, x_)[0], here.position("I", c, x_)[0])


class _Rank:
    """Positions on rank ``r_`` (the module's ``position`` is rank ``r``'s)."""

    def __init__(self, r_) -> None:
        self.sub = [(r, r_)]

    def position(self, kd, c, x_):
        return tuple(z3.substitute(e, *self.sub) for e in position(kd, c, x_))

    def full(self, c, x_):
        return z3.substitute(backward_is_full(p, m, r, c, x_), *self.sub)


def _edges():
    """``(name, condition on r, consumer kinds, chunk, producer)``: each input (§2.5) of
    each unit of rank ``r``, the producer as ``(rank offset, kind, chunk)``; ``grad`` is
    the neighbour stage's ``B`` or ``I``."""
    back = ("B", "I")
    return (("F0(r) after F0(r-1)", r >= 1, ("F",), 0, (-1, "F", 0)),
            ("F1(r) after F1(r+1)", r + 1 < p, ("F",), 1, (1, "F", 1)),
            ("F1(p-1) after F0(p-1)", r == p - 1, ("F",), 1, (0, "F", 0)),
            ("B0/I0(r) after F0(r)", True, back, 0, (0, "F", 0)),
            ("B0/I0(r) after the gradient of stage r+1", r + 1 < p, back, 0, (1, "grad", 0)),
            ("B0/I0(p-1) after the gradient of stage p", r == p - 1, back, 0,
             (0, "grad", 1)),
            ("B1/I1(r) after F1(r)", True, back, 1, (0, "F", 1)),
            ("B1/I1(r) after the gradient of stage 2p-r", r >= 1, back, 1, (-1, "grad", 1)),
            ("W0(r) after I0(r)", True, ("W",), 0, (0, "I", 0)),
            ("W1(r) after I1(r)", True, ("W",), 1, (0, "I", 1)))


@functools.cache
def flow() -> tuple[Obligation, ...]:
    """The data-flow witness: the units at their positions, and a clock that ranks every
    step above its predecessor on its rank and above the step producing each input of
    each member, so the data-flow graph of the steps has no cycle and the data-flow
    timing reaches every step, whatever the durations (built once: the dependency,
    matching and deadlock laws share it)."""
    return tuple(_flow())


def _flow():
    yield from sits()
    yield Obligation("DualPipeV dependency: each rank's steps run in order",
                     z3.Implies(z3.And(0 <= k, k + 1 < LENGTH),
                                clock(r, k + 1) >= clock(r, k) + 1), SIZES)
    for name, cond, kinds, c, (dr, pk, pc) in _edges():
        for kd in kinds:
            need = required(z3.IntVal(KINDS[kd]), z3.IntVal(c), x)
            start = clock(r, _at(r, kd, c, x))
            done = clock(r + dr, _at(r + dr, pk, pc, x)) + 1
            yield Obligation(f"DualPipeV dependency: {name} ({kd}) finished",
                             z3.Implies(z3.And(0 <= x, x < m, need, cond), done <= start),
                             SIZES)


CLOCK = "closed-form timing witness; each unit at its position (as in dualpipev_completeness)"


@law("dualpipev_dependency",
     "DualPipeV: a data-flow timing exists (unit durations; an overlapped step's members "
     "read their inputs before the step): every op's inputs are on its rank before it runs",
     all_sizes(f"every p >= 1, m >= 2p, rank, step and microbatch; {CLOCK}; {MODEL}"),
     family="dualpipev", property="dependency", covers=covers)
def dualpipev_dependency():
    yield from flow()


# ---------------------------------------------------------------- lowered

LOWERED = all_sizes(f"every p >= 1, m >= 2p, rank pair; {CLOCK}, an acyclic data-flow "
                    f"order of the steps (an overlapped step is one op of lowering, its "
                    f"members' inputs read before it, their outputs sent after it), so "
                    f"lowering's timing reaches every step; the lowering model of "
                    f"proofs.lowered (= lower for p <= 8, 2p <= m <= 24, "
                    f"tests/test_proofs_expanded.py); {MODEL}")


dualpipev_matching, dualpipev_deadlock = family_laws("dualpipev", "DualPipeV", LOWERED, flow,
                                                     family="dualpipev", covers=covers)
