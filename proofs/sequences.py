"""Laws of the sequence operators of ``algebra.terms``: ``seq``, ``par``, the empty term,
and ``split_bw`` / ``merge_bw``.

``seq``/``par`` are modelled on ``model.Prog`` (array sequences: every rank, every length,
every content at once); ``split_bw``/``merge_bw`` on Z3's native sequences with recursive
functions that transcribe ``terms.SplitBW.derive`` and ``terms._merge`` step by step, and
are proven by induction on the sequence (base and step each refuted by Z3).
"""

from __future__ import annotations

import z3

from .core import Obligation, all_sizes, law
from .model import (B, F, I, W, Op, OpSeq, compute, cons, empty, empty_prog, head, init,
                    is_compute_of, last, par, prog_eq, prog_var, recfun, restrict, seq, tail, unit,
                    with_kind)

EVERYTHING = all_sizes("every rank, program length and content, microbatch count")


# ---------------------------------------------------------------- seq


@law("seq_assoc",
     "seq(seq(a,b),c) = seq(a,seq(b,c)): same definedness, placement, microbatch count and "
     "per-rank sequences (b's microbatches shifted by m_a, c's by m_a+m_b)",
     EVERYTHING)
def seq_assoc():
    yield from _associativity(seq)


def _associativity(op):
    """``op(op(a,b),c)`` and ``op(a,op(b,c))`` are defined together and then equal."""
    (a, ha), (b, hb), (c, hc) = prog_var("a"), prog_var("b"), prog_var("c")
    hyps = tuple(ha + hb + hc)
    ab, d1 = op(a, b)
    lhs, d2 = op(ab, c)
    bc, d3 = op(b, c)
    rhs, d4 = op(a, bc)
    yield Obligation("defined iff", z3.And(d1, d2) == z3.And(d3, d4), hyps)
    yield Obligation("equal", prog_eq(lhs, rhs), hyps + (d1, d2))


@law("seq_identity",
     "seq(e,a) = a = seq(a,e) for the empty term e (a's placement, 0 microbatches, no ops)",
     EVERYTHING)
def seq_identity():
    a, ha = prog_var("a")
    e = empty_prog(a.placement, 0)
    left, d1 = seq(e, a)
    right, d2 = seq(a, e)
    yield Obligation("left identity", z3.And(d1, prog_eq(left, a)), tuple(ha))
    yield Obligation("right identity", z3.And(d2, prog_eq(right, a)), tuple(ha))


# ---------------------------------------------------------------- par


@law("par_comm",
     "par(a,b) = par(b,a) on disjoint busy ranks (and one is defined iff the other is)",
     EVERYTHING)
def par_comm():
    (a, ha), (b, hb) = prog_var("a"), prog_var("b")
    hyps = tuple(ha + hb)
    ab, d1 = par(a, b)
    ba, d2 = par(b, a)
    yield Obligation("defined iff", d1 == d2, hyps)
    yield Obligation("equal", prog_eq(ab, ba), hyps + (d1,))


@law("par_assoc",
     "par(par(a,b),c) = par(a,par(b,c)): defined iff a, b, c are pairwise disjoint, and "
     "then equal",
     EVERYTHING)
def par_assoc():
    yield from _associativity(par)


@law("par_identity",
     "par(a,e) = a = par(e,a) for the empty term e with a's placement and microbatches",
     EVERYTHING)
def par_identity():
    a, ha = prog_var("a")
    e = empty_prog(a.placement, a.m)
    right, d1 = par(a, e)
    left, d2 = par(e, a)
    yield Obligation("right identity", z3.And(d1, prog_eq(right, a)), tuple(ha))
    yield Obligation("left identity", z3.And(d2, prog_eq(left, a)), tuple(ha))


@law("par_restrict_partition",
     "par(restrict(t,R), restrict(t,not R)) = t: splitting the ranks and putting the halves "
     "back together is the identity",
     EVERYTHING)
def par_restrict_partition():
    t, ht = prog_var("t")
    keep = z3.Function("keep", z3.IntSort(), z3.BoolSort())
    both, d = par(restrict(t, keep), restrict(t, lambda r: z3.Not(keep(r))))
    yield Obligation("defined and equal", z3.And(d, prog_eq(both, t)), tuple(ht))


@law("seq_par_interchange",
     "seq(par(a,b), par(c,d)) = par(seq(a,c), seq(b,d)) when a, c use only ranks R, b, d "
     "only ranks outside R, and the left side is defined (then so is the right)",
     EVERYTHING)
def seq_par_interchange():
    (a, ha), (b, hb), (c, hc), (d, hd) = (prog_var(n) for n in "abcd")
    in_r = z3.Function("in_R", z3.IntSort(), z3.BoolSort())
    r = z3.Int("r")
    sides = (z3.ForAll([r], z3.Implies(z3.Not(in_r(r)), z3.And(a.length(r) == 0,
                                                               c.length(r) == 0))),
             z3.ForAll([r], z3.Implies(in_r(r), z3.And(b.length(r) == 0, d.length(r) == 0))))
    hyps = tuple(ha + hb + hc + hd) + sides
    ab, d1 = par(a, b)
    cd, d2 = par(c, d)
    lhs, d3 = seq(ab, cd)
    ac, d4 = seq(a, c)
    bd, d5 = seq(b, d)
    rhs, d6 = par(ac, bd)
    left_defined = z3.And(d1, d2, d3)
    # (not iff: the right side only needs m_a + m_c = m_b + m_d)
    yield Obligation("left defined -> right defined", z3.And(d4, d5, d6),
                     hyps + (left_defined,))
    yield Obligation("equal", prog_eq(lhs, rhs), hyps + (left_defined,))


# ---------------------------------------------------------------- split_bw / merge_bw


def _block(x):
    """What ``SplitBW`` makes of one step: ``B(w)`` -> ``I(w) W(w)``; anything else kept
    (an overlap is kept whole: ``SplitBW`` only splits bare compute ops)."""
    w = Op.cw(x)
    return z3.If(is_compute_of(x, B),
                 z3.Concat(unit(Op.compute(with_kind(w, I))), unit(Op.compute(with_kind(w, W)))),
                 unit(x))


def split_fn():
    """``split(s)``: ``_block`` of each step, concatenated (``SplitBW.derive`` per rank)."""
    return recfun("split_bw", (OpSeq,), OpSeq, lambda f, s: z3.If(
        z3.Length(s) == 0, empty(), z3.Concat(_block(head(s)), f(tail(s)))))


def merge_go_fn():
    """``go(out, s)`` is ``terms._merge`` with ``out`` as its output list: for each op of
    ``s`` in order, a bare ``W(w)`` whose predecessor in ``out`` is ``I(w)`` (same stage,
    microbatch, segment) replaces it by ``B(w)``; any other op is appended."""
    def body(f, out, s):
        x = head(s)
        merges = z3.And(is_compute_of(x, W), z3.Length(out) > 0,
                        last(out) == Op.compute(with_kind(Op.cw(x), I)))
        return z3.If(z3.Length(s) == 0, out,
                     z3.If(merges, f(z3.Concat(init(out), unit(Op.compute(with_kind(Op.cw(x), B)))),
                                     tail(s)),
                           f(z3.Concat(out, unit(x)), tail(s))))
    return recfun("merge_go", (OpSeq, OpSeq), OpSeq, body)


def no_split_fn():
    """No bare ``I`` or ``W`` step (a schedule "without split backwards")."""
    return recfun("no_split", (OpSeq,), z3.BoolSort(), lambda f, s: z3.Or(
        z3.Length(s) == 0,
        z3.And(z3.Not(is_compute_of(head(s), I)), z3.Not(is_compute_of(head(s), W)),
               f(tail(s)))))


@law("split_merge_identity",
     "merge_bw(split_bw(s)) = s for every per-rank sequence s without bare I or W steps "
     "(B -> I W -> B)",
     all_sizes("induction on |s|, generalised over merge's output list"))
def split_merge_identity():
    split, go, ok = split_fn(), merge_go_fn(), no_split_fn()
    s, t, o = z3.Const("s", OpSeq), z3.Const("t", OpSeq), z3.Const("o", OpSeq)
    x = z3.Const("x", Op)

    def claim(seq_, out):  # Q(s, out): no_split(s) -> go(out, split(s)) = out ++ s
        return z3.Implies(ok(seq_), go(out, split(seq_)) == z3.Concat(out, seq_))
    yield Obligation("lemma base: s = []", claim(empty(), o))
    # step, in two parts: unfolding no_split(x::t), then the step under its consequences
    x_ok = z3.And(z3.Not(is_compute_of(x, I)), z3.Not(is_compute_of(x, W)))
    yield Obligation("lemma step (unfold): no_split(x::t) -> x is no I/W and no_split(t)",
                     z3.Implies(ok(cons(x, t)), z3.And(x_ok, ok(t))))
    w, u = Op.cw(x), z3.Const("u", OpSeq)
    i_w = z3.Concat(unit(Op.compute(with_kind(w, I))), unit(Op.compute(with_kind(w, W))))
    yield Obligation("go of I(w) W(w): x = B(w) -> go(o, I(w) W(w) ++ u) = go(o ++ [x], u)",
                     z3.Implies(is_compute_of(x, B),
                                go(o, z3.Concat(i_w, u)) == go(z3.Concat(o, unit(x)), u)))
    ih = claim(t, z3.Concat(o, unit(x)))  # the induction hypothesis at out = o ++ [x]
    goal = go(o, split(cons(x, t))) == z3.Concat(o, cons(x, t))
    at = ((t, empty()), (o, empty()))
    yield Obligation("lemma step, x = B(w)", goal,
                     (is_compute_of(x, B), ok(t), ih,
                      go(o, z3.Concat(i_w, split(t))) == go(z3.Concat(o, unit(x)), split(t))),
                     example=at + ((x, compute(B, 0, 0)),))
    yield Obligation("lemma step, x not a bare B", goal,
                     (z3.Not(is_compute_of(x, B)), x_ok, ok(t), ih),
                     example=at + ((x, compute(F, 0, 0)),))
    lemma = z3.ForAll([s, o], claim(s, o))
    yield Obligation("merge_bw(split_bw(s)) = s",
                     z3.Implies(ok(s), go(empty(), split(s)) == s), lemmas=(lemma,))
