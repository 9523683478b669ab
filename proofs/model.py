"""The symbolic model of per-rank sequences shared by the proofs.

**Ops.** ``Work`` is one unit of compute work ``work(kind, stage, mb, seg)`` with kind
codes ``F=0, B=1, I=2, W=3`` (``seg`` numbers the segment). ``Op`` is a step of a rank:
``compute(w)`` (an ``ir.Compute``), ``overlap(w1, w2)`` (an ``ir.Overlap`` of exactly two
compute ops: DualPipeV's use; patterns allow ``<L L+>`` with more, which the laws whose
scope says "overlaps of two ops" do not cover), ``other(tag)`` (``Idle`` or ``Marker``: kept, never changed),
``send(peer, payload)`` / ``recv(peer, payload)`` (payload kind 0 = act, 1 = grad).

**Two representations of a sequence.**

- Array model: a term's value is ``Prog(placement, m, length(r), at(r, i))``: a placement
  (an uninterpreted integer id: only equality matters to the operators), the microbatch
  count, and per rank a length and an index function (uninterpreted Z3 functions).
  Concatenation and pointwise maps are closed forms, so the laws of ``seq``, ``par``,
  ``restrict`` and ``relabel`` are (nearly) quantifier-free after negation and hold for
  every rank, length and content.
- Z3's native sequence sort ``OpSeq`` with recursive functions (``RecFunction``) for
  operators that move positions (``split_bw``, ``merge_bw``, filters); their laws are
  proven by explicit induction on the length (``proofs.core``).
"""

from __future__ import annotations

import itertools
from typing import Callable

import z3

F, B, I, W = 0, 1, 2, 3

_work = z3.Datatype("Work")
_work.declare("work", ("kind", z3.IntSort()), ("stage", z3.IntSort()), ("mb", z3.IntSort()),
              ("seg", z3.IntSort()))
Work = _work.create()

_op = z3.Datatype("Op")
_op.declare("compute", ("cw", Work))
_op.declare("overlap", ("ow1", Work), ("ow2", Work))
_op.declare("other", ("tag", z3.IntSort()))
_op.declare("send", ("speer", z3.IntSort()), ("spay", Work))
_op.declare("recv", ("rpeer", z3.IntSort()), ("rpay", Work))
Op = _op.create()

OpSeq = z3.SeqSort(Op)
IntSeq = z3.SeqSort(z3.IntSort())

kind, stage, mb, seg = Work.kind, Work.stage, Work.mb, Work.seg
_fresh = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}!{next(_fresh)}"


def work(k, s, m, g=0):
    return Work.work(k, s, m, g)


def with_kind(w, k):
    return Work.work(k, Work.stage(w), Work.mb(w), Work.seg(w))


def with_mb(w, m):
    return Work.work(Work.kind(w), Work.stage(w), m, Work.seg(w))


def compute(k, s, m, g=0):
    return Op.compute(work(k, s, m, g))


def is_compute_of(op, k):
    """``op`` is a bare ``Compute`` of kind ``k`` (not inside an overlap)."""
    return z3.And(Op.is_compute(op), kind(Op.cw(op)) == k)


def map_computes(op, fn: Callable):
    """``terms._map_computes`` on one step: ``fn`` on a compute op and on each member of
    an overlap; every other step unchanged."""
    return z3.If(Op.is_compute(op), Op.compute(fn(Op.cw(op))),
                 z3.If(Op.is_overlap(op), Op.overlap(fn(Op.ow1(op)), fn(Op.ow2(op))), op))


# ---------------------------------------------------------------- programs (array model)


class Prog:
    """A compute-only schedule (or a plan): placement id, microbatch count, and per rank
    ``length(r)`` and ``at(r, i)``."""

    def __init__(self, placement, m, length: Callable, at: Callable) -> None:
        self.placement, self.m, self.length, self.at = placement, m, length, at

    def map_ops(self, fn: Callable) -> "Prog":
        return Prog(self.placement, self.m, self.length, lambda r, i: fn(self.at(r, i)))


def prog_var(name: str) -> tuple[Prog, list]:
    """An arbitrary program: uninterpreted lengths (>= 0) and op functions."""
    length = z3.Function(f"{name}_len", z3.IntSort(), z3.IntSort())
    at = z3.Function(f"{name}_at", z3.IntSort(), z3.IntSort(), Op)
    r = z3.Int(fresh("r"))
    hyp = z3.ForAll([r], length(r) >= 0)
    return Prog(z3.Int(f"{name}_pl"), z3.Int(f"{name}_m"), length, at), [hyp]


def empty_prog(placement, m=0) -> Prog:
    """The empty term: ``placement``, ``m`` microbatches, no op on any rank."""
    return Prog(placement, m, lambda r: z3.IntVal(0), lambda r, i: Op.other(0))


def prog_eq(x: Prog, y: Prog):
    """Equal schedules: placement, microbatch count, and every rank's sequence."""
    r, i = z3.Int(fresh("r")), z3.Int(fresh("i"))
    return z3.And(x.placement == y.placement, x.m == y.m,
                  z3.ForAll([r], x.length(r) == y.length(r)),
                  z3.ForAll([r, i], z3.Implies(z3.And(0 <= i, i < x.length(r)),
                                               x.at(r, i) == y.at(r, i))))


# ---------------------------------------------------------------- the operators on Prog


def shift_work(w, d):
    return with_mb(w, Work.mb(w) + d)


def seq(a: Prog, b: Prog) -> tuple[Prog, object]:
    """``terms.Seq``: per-rank ``a_r ++ shift(b_r, m_a)``; ``m = m_a + m_b``. Returns the
    result and its precondition (equal placements)."""
    def at(r, i):
        return z3.If(i < a.length(r), a.at(r, i),
                     map_computes(b.at(r, i - a.length(r)), lambda w: shift_work(w, a.m)))
    return (Prog(a.placement, a.m + b.m, lambda r: a.length(r) + b.length(r), at),
            a.placement == b.placement)


def busy(x: Prog, r):
    return x.length(r) > 0


def disjoint(a: Prog, b: Prog):
    r = z3.Int(fresh("r"))
    return z3.ForAll([r], z3.Not(z3.And(busy(a, r), busy(b, r))))


def par(a: Prog, b: Prog) -> tuple[Prog, object]:
    """``terms.Par``: rank ``r`` runs ``a_r or b_r`` (Python's ``or`` on tuples: ``a_r``
    when non-empty). Precondition: equal placement and microbatches, disjoint busy
    ranks."""
    def length(r):
        return z3.If(busy(a, r), a.length(r), b.length(r))

    def at(r, i):
        return z3.If(busy(a, r), a.at(r, i), b.at(r, i))
    pre = z3.And(a.placement == b.placement, a.m == b.m, disjoint(a, b))
    return Prog(a.placement, a.m, length, at), pre


def relabel_work(w, perm):
    return with_mb(w, perm(Work.mb(w)))


def relabel_op(op, perm: Callable):
    """One op with microbatch ``mb`` of each compute unit made ``perm(mb)``."""
    return map_computes(op, lambda w: relabel_work(w, perm))


def injective(perm) -> z3.BoolRef:
    """``perm`` (a Z3 function Int -> Int) maps distinct microbatches apart."""
    a, b = z3.Ints("a b")
    return z3.ForAll([a, b], z3.Implies(perm(a) == perm(b), a == b))


def relabel(a: Prog, perm: Callable) -> Prog:
    """``terms.Relabel``: microbatch ``mb`` becomes ``perm(mb)`` in every compute op."""
    return a.map_ops(lambda op: relabel_op(op, perm))


def restrict(a: Prog, keep: Callable) -> Prog:
    """``terms.Restrict``: ranks not kept become empty."""
    return Prog(a.placement, a.m, lambda r: z3.If(keep(r), a.length(r), 0), a.at)


# ---------------------------------------------------------------- native sequences


def head(s):
    return s[0]


def tail(s):
    return z3.SubSeq(s, 1, z3.Length(s) - 1)


def cons(x, s):
    return z3.Concat(z3.Unit(x), s)


def last(s):
    return s[z3.Length(s) - 1]


def init(s):
    return z3.SubSeq(s, 0, z3.Length(s) - 1)


def unit(x):
    return z3.Unit(x)


def empty(sort=OpSeq):
    return z3.Empty(sort)


_REC: dict[str, z3.FuncDeclRef] = {}


def recfun(name: str, domain: tuple, rng, body: Callable) -> z3.FuncDeclRef:
    """A recursive function, defined once per process (Z3 declarations are global)."""
    if name not in _REC:
        f = z3.RecFunction(name, *domain, rng)
        _REC[name] = f
        args = [z3.Const(f"{name}_arg{k}", sort) for k, sort in enumerate(domain)]
        z3.RecAddDefinition(f, args, body(f, *args))
    return _REC[name]
