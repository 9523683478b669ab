"""Microbatch relabelling (``terms.Relabel``) commutes with the other operators and with
every family.

What is proven, precisely:

- ``relabel`` applies a map ``pi`` to the microbatch of every compute op (bare or inside an
  overlap) and changes nothing else (``model.relabel``). ``pi`` is a permutation of
  ``0..m-1``: it maps ``[0, m)`` into itself and has an inverse there.
- It commutes with ``par`` and ``restrict`` (same ``pi``), distributes over ``seq`` with the
  block permutation ``pi_a (+) pi_b`` (itself a permutation of ``0..m_a+m_b-1``), composes
  (``relabel(relabel(t, p1), p2) = relabel(t, p2 . p1)``) and is the identity for ``pi = id``;
  all on every rank, length and content (array model).
- It commutes with ``split_bw`` (any ``pi``) and with ``merge_bw`` (any injective ``pi``:
  ``_merge`` compares microbatches only for equality), on every sequence (induction).
- Families: a family is ``Weave(pattern)``, and ``weave_rank`` decides which stream unit
  each step pops from the pattern, the environment ``p r m v g n`` and the units' chunks and
  identities only -- never from a microbatch value (``pattern.RankStreams``). In the model,
  the weave is *any* selection (how many steps, which steps are overlaps, each popped
  unit's stream, index and letter) that is a function of those inputs alone; the law
  proves that relabelling the woven program equals weaving the relabelled streams, for
  every pattern, rank, stream length and content. That ``pattern.py`` has this shape is
  read from the code, not proven; ``tests/test_proofs.py`` checks the law's conclusion on the
  real families.
"""

from __future__ import annotations

import z3

from . import model
from .core import Obligation, all_sizes, law
from .model import (B, I, W, Op, OpSeq, Work, compute, cons, empty, head, init, is_compute_of,
                    last, par, prog_eq, prog_var, relabel, restrict, recfun, seq, tail, unit,
                    with_kind, work)
from .sequences import _block, merge_go_fn, split_fn

EVERYTHING = all_sizes("every rank, program length and content, microbatch count")


def perm_var(name: str, m) -> tuple:
    """A permutation of ``[0, m)`` with its inverse, as uninterpreted functions."""
    pi = z3.Function(name, z3.IntSort(), z3.IntSort())
    inv = z3.Function(name + "_inv", z3.IntSort(), z3.IntSort())
    return pi, inv, is_perm(pi, inv, m)


def is_perm(pi, inv, m):
    x = z3.Int("x")
    inside = z3.And(0 <= x, x < m)
    return z3.ForAll([x], z3.Implies(inside, z3.And(0 <= pi(x), pi(x) < m, 0 <= inv(x), inv(x) < m,
                                                    inv(pi(x)) == x, pi(inv(x)) == x)))


def mbs_in_range(a, lo, hi):
    """Every compute op of ``a`` (bare or in an overlap) has ``lo <= mb < hi``."""
    r, i = z3.Ints("r i")
    op = a.at(r, i)

    def ok(w):
        return z3.And(lo <= Work.mb(w), Work.mb(w) < hi)
    return z3.ForAll([r, i], z3.Implies(z3.And(0 <= i, i < a.length(r)), z3.And(
        z3.Implies(Op.is_compute(op), ok(Op.cw(op))),
        z3.Implies(Op.is_overlap(op), z3.And(ok(Op.ow1(op)), ok(Op.ow2(op)))))))


@law("relabel_par",
     "relabel(par(a,b), pi) = par(relabel(a,pi), relabel(b,pi)), defined iff par(a,b) is",
     EVERYTHING)
def relabel_par():
    (a, ha), (b, hb) = prog_var("a"), prog_var("b")
    pi = z3.Function("pi", z3.IntSort(), z3.IntSort())
    ab, d1 = par(a, b)
    both, d2 = par(relabel(a, pi), relabel(b, pi))
    hyps = tuple(ha + hb)
    yield Obligation("defined iff", d1 == d2, hyps)
    yield Obligation("equal", prog_eq(relabel(ab, pi), both), hyps + (d1,))


@law("relabel_restrict", "relabel(restrict(a,R), pi) = restrict(relabel(a,pi), R)", EVERYTHING)
def relabel_restrict():
    a, ha = prog_var("a")
    pi = z3.Function("pi", z3.IntSort(), z3.IntSort())
    keep = z3.Function("keep", z3.IntSort(), z3.BoolSort())
    yield Obligation("equal", prog_eq(relabel(restrict(a, keep), pi),
                                      restrict(relabel(a, pi), keep)), tuple(ha))


@law("relabel_seq",
     "relabel(seq(a,b), pa(+)pb) = seq(relabel(a,pa), relabel(b,pb)) for well-formed a, b "
     "(mbs of a in [0,m_a), of b in [0,m_b)); pa(+)pb is a permutation of [0,m_a+m_b)",
     EVERYTHING)
def relabel_seq():
    (a, ha), (b, hb) = prog_var("a"), prog_var("b")
    pa, pa_inv, pa_ok = perm_var("pa", a.m)
    pb, pb_inv, pb_ok = perm_var("pb", b.m)

    def block(p, q, x):  # pa (+) pb
        return z3.If(x < a.m, p(x), a.m + q(x - a.m))
    x = z3.Int("x")
    both = z3.Function("pab", z3.IntSort(), z3.IntSort())
    both_inv = z3.Function("pab_inv", z3.IntSort(), z3.IntSort())
    defs = (z3.ForAll([x], both(x) == block(pa, pb, x)),
            z3.ForAll([x], both_inv(x) == block(pa_inv, pb_inv, x)))
    hyps = tuple(ha + hb) + (a.m >= 0, b.m >= 0, pa_ok, pb_ok)
    # the hypotheses hold for two empty programs with the identity maps (vacuity check)
    ident = z3.Var(0, z3.IntSort())
    example = ((a.m, z3.IntVal(0)), (b.m, z3.IntVal(0)), (a.length, z3.IntVal(0)),
               (b.length, z3.IntVal(0)),
               *((f, ident) for f in (pa, pa_inv, pb, pb_inv, both, both_inv)))
    yield Obligation("pa(+)pb is a permutation of [0, m_a+m_b)",
                     is_perm(both, both_inv, a.m + b.m), hyps + defs, example=example)
    ab, d1 = seq(a, b)
    rab, d2 = seq(relabel(a, pa), relabel(b, pb))
    wf = (mbs_in_range(a, 0, a.m), mbs_in_range(b, 0, b.m))
    yield Obligation("equal", z3.And(d1 == d2, prog_eq(relabel(ab, both), rab)),
                     hyps + defs + wf + (d1,))


@law("relabel_compose",
     "relabel(relabel(a,p1),p2) = relabel(a, p2.p1) and relabel(a, id) = a", EVERYTHING)
def relabel_compose():
    a, ha = prog_var("a")
    p1 = z3.Function("p1", z3.IntSort(), z3.IntSort())
    p2 = z3.Function("p2", z3.IntSort(), z3.IntSort())
    yield Obligation("compose", prog_eq(relabel(relabel(a, p1), p2),
                                        relabel(a, lambda x: p2(p1(x)))), tuple(ha))
    yield Obligation("identity", prog_eq(relabel(a, lambda x: x), a), tuple(ha))


# ---------------------------------------------------------------- native sequences

PI = z3.Function("relabel_pi", z3.IntSort(), z3.IntSort())
IDENTITY = z3.Var(0, z3.IntSort())  # the body of the identity map, for ``substitute_funs``


def relabel_op(op):
    return model.relabel_op(op, PI)


def relabel_fn():
    """``relabel(s)`` with the (arbitrary) map ``relabel_pi``, step by step."""
    return recfun("relabel_s", (OpSeq,), OpSeq, lambda f, s: z3.If(
        z3.Length(s) == 0, empty(), cons(relabel_op(head(s)), f(tail(s)))))


def _relabel_cat(rl):
    """Lemma obligations: relabel(u ++ v) = relabel(u) ++ relabel(v), |relabel(u)| = |u|."""
    v, t = z3.Const("v", OpSeq), z3.Const("t", OpSeq)
    x = z3.Const("x", Op)

    def cat_claim(u_):
        return rl(z3.Concat(u_, v)) == z3.Concat(rl(u_), rl(v))
    yield Obligation("relabel(u ++ v) base", cat_claim(empty()))
    yield Obligation("relabel(u ++ v) step", cat_claim(cons(x, t)), (cat_claim(t),),
                     example=((t, empty()), (v, empty())))

    def len_claim(u_):
        return z3.Length(rl(u_)) == z3.Length(u_)
    yield Obligation("|relabel(u)| base", len_claim(empty()))
    yield Obligation("|relabel(u)| step", len_claim(cons(x, t)), (len_claim(t),),
                     example=((t, empty()),))


@law("relabel_split",
     "relabel(split_bw(s), pi) = split_bw(relabel(s, pi)) for every sequence s and map pi",
     all_sizes("induction on |s|; overlaps of two ops"))
def relabel_split():
    rl, split = relabel_fn(), split_fn()
    yield from _relabel_cat(rl)
    t, x = z3.Const("t", OpSeq), z3.Const("x", Op)

    def claim(s):
        return rl(split(s)) == split(rl(s))
    blk = rl(_block(x)) == _block(relabel_op(x))
    yield Obligation("block: relabel(block(x)) = block(relabel(x))", blk)

    def split_cons(x_, t_):
        return split(cons(x_, t_)) == z3.Concat(_block(x_), split(t_))
    rl_cons = rl(cons(x, t)) == cons(relabel_op(x), rl(t))
    yield Obligation("unfold split at x::t", split_cons(x, t))
    yield Obligation("unfold rl at x::t", rl_cons)
    yield Obligation("base", claim(empty()))
    yield Obligation("step", claim(cons(x, t)),
                     (claim(t),),
                     lemmas=(rl(z3.Concat(_block(x), split(t))) == z3.Concat(rl(_block(x)),
                                                                             rl(split(t))),
                             blk, split_cons(x, t), split_cons(relabel_op(x), rl(t)), rl_cons),
                     example=((t, empty()),))


@law("relabel_merge",
     "relabel(merge_bw(s), pi) = merge_bw(relabel(s, pi)) for every sequence s and "
     "injective pi",
     all_sizes("induction on |s|, generalised over merge's output list; overlaps of two "
               "ops"))
def relabel_merge():
    rl, go = relabel_fn(), merge_go_fn()
    yield from _relabel_cat(rl)
    injective = model.injective(PI)
    o, t, x, y = z3.Const("o", OpSeq), z3.Const("t", OpSeq), z3.Const("x", Op), z3.Const("y", Op)
    yield Obligation("relabel_op is injective",
                     z3.Implies(relabel_op(x) == relabel_op(y), x == y), (injective,),
                     example=((PI, IDENTITY),))
    # last/init of a relabelled non-empty list, from o = init(o) ++ [last(o)]
    split_o = z3.Concat(init(o), unit(last(o)))
    yield Obligation("o = init(o) ++ [last(o)] for |o| > 0",
                     z3.Implies(z3.Length(o) > 0, o == split_o))
    a_, y_ = z3.Const("a", OpSeq), z3.Const("y", Op)
    yield Obligation("last(a ++ [y]) = y and init(a ++ [y]) = a",
                     z3.And(last(z3.Concat(a_, unit(y_))) == y_, init(z3.Concat(a_, unit(y_))) == a_))
    yield Obligation("rl([y]) = [rl_op(y)]", rl(unit(y_)) == unit(relabel_op(y_)))
    rl_o = z3.Concat(rl(init(o)), unit(relabel_op(last(o))))
    last_init = z3.Implies(z3.Length(o) > 0, z3.And(last(rl(o)) == relabel_op(last(o)),
                                                    init(rl(o)) == rl(init(o))))
    yield Obligation("|o| > 0 -> last(rl o) = rl(last o) and init(rl o) = rl(init o)",
                     last_init,
                     lemmas=(z3.Implies(z3.Length(o) > 0, o == split_o),
                             rl(split_o) == z3.Concat(rl(init(o)), rl(unit(last(o)))),
                             rl(unit(last(o))) == unit(relabel_op(last(o))),
                             z3.Length(rl(init(o))) == z3.Length(init(o)),
                             last(rl_o) == relabel_op(last(o)), init(rl_o) == rl(init(o))))

    def claim(s, out):
        return go(rl(out), rl(s)) == rl(go(out, s))
    yield Obligation("base", claim(empty(), o))
    def merges_at(out, op):  # the test of terms._merge (merge_go_fn)
        return z3.And(is_compute_of(op, W), z3.Length(out) > 0,
                      last(out) == Op.compute(with_kind(Op.cw(op), I)))
    merges, rl_merges = merges_at(o, x), merges_at(rl(o), relabel_op(x))
    inj_instance = z3.Implies(relabel_op(last(o)) == relabel_op(Op.compute(with_kind(Op.cw(x), I))),
                              last(o) == Op.compute(with_kind(Op.cw(x), I)))
    yield Obligation("merge test: merges(rl o, rl x) iff merges(o, x)", rl_merges == merges,
                     (injective,),
                     lemmas=(last_init, z3.Length(rl(o)) == z3.Length(o), inj_instance),
                     example=((PI, IDENTITY),))
    b_w = unit(Op.compute(with_kind(Op.cw(x), B)))
    merged = z3.Concat(init(o), b_w)
    appended = z3.Concat(o, unit(x))
    # unfolding go and rl at x::t (free o, x, t: every instance is valid)
    def go_merge(o_, x_, t_):
        return z3.Implies(merges_at(o_, x_), go(o_, cons(x_, t_)) == go(
            z3.Concat(init(o_), unit(Op.compute(with_kind(Op.cw(x_), B)))), t_))

    def go_append(o_, x_, t_):
        return z3.Implies(z3.Not(merges_at(o_, x_)),
                          go(o_, cons(x_, t_)) == go(z3.Concat(o_, unit(x_)), t_))
    rl_cons = rl(cons(x, t)) == cons(relabel_op(x), rl(t))
    b_rl = z3.Implies(Op.is_compute(x), Op.compute(with_kind(Op.cw(relabel_op(x)), B))
                      == relabel_op(Op.compute(with_kind(Op.cw(x), B))))
    yield Obligation("unfold go at x::t, merging", go_merge(o, x, t))
    yield Obligation("unfold go at x::t, appending", go_append(o, x, t))
    yield Obligation("unfold rl at x::t", rl_cons)
    yield Obligation("B of a relabelled compute op = relabelled B", b_rl)
    rl_x, rl_t, rl_o = relabel_op(x), rl(t), rl(o)
    facts = (last_init, rl_merges == merges, rl_cons, b_rl,
             go_merge(o, x, t), go_merge(rl_o, rl_x, rl_t),
             go_append(o, x, t), go_append(rl_o, rl_x, rl_t),
             rl(unit(Op.compute(with_kind(Op.cw(x), B)))) == unit(relabel_op(
                 Op.compute(with_kind(Op.cw(x), B)))),
             rl(unit(x)) == unit(rl_x),
             rl(merged) == z3.Concat(rl(init(o)), rl(b_w)),
             rl(appended) == z3.Concat(rl(o), rl(unit(x))))
    yield Obligation("step, merging", claim(cons(x, t), o),
                     (injective, merges, claim(t, merged)), lemmas=facts,
                     example=((o, unit(compute(I, 0, 0))), (x, compute(W, 0, 0)), (t, empty()),
                              (PI, IDENTITY)))
    yield Obligation("step, appending", claim(cons(x, t), o),
                     (injective, z3.Not(merges), claim(t, appended)), lemmas=facts,
                     example=((o, empty()), (x, compute(W, 0, 0)), (t, empty()),
                              (PI, IDENTITY)))


# ---------------------------------------------------------------- families (weave)


@law("relabel_weave",
     "for every family (a weave pattern) and injective pi: relabelling the woven program "
     "equals weaving the pattern over the relabelled streams",
     all_sizes("every pattern, rank, stream length and content; weave modelled as a "
               "microbatch-blind selection; overlaps of two ops"))
def relabel_weave():
    IntS, BoolS = z3.IntSort(), z3.BoolSort()
    Arr = z3.ArraySort(IntS, IntS)
    Arr2 = z3.ArraySort(IntS, Arr)
    Eq = z3.ArraySort(IntS, z3.ArraySort(IntS, z3.ArraySort(IntS, z3.ArraySort(IntS, BoolS))))
    # one rank's streams (stream 0 = forwards, 1 = backwards; index j): each unit's chunk,
    # stage and microbatch, and each stream's length
    chunk, st, mb = (z3.Const(n, Arr2) for n in ("chunk", "stage", "mb"))
    length = z3.Const("length", Arr)
    seg = z3.Int("seg")
    # The selection reads the pattern and env (fixed symbols), the chunks, stages and lengths,
    # and the units' identities: which units have equal microbatches (``eq``). Each output
    # step k is one popped unit or an overlap of two; member j of step k is unit
    # ``index(..)`` of stream ``which(..)``, popped by letter ``letter(..)``.
    view = (chunk, st, length)
    nsteps = z3.Function("nsteps", Arr2, Arr2, Arr, Eq, IntS)
    is_ov = z3.Function("is_overlap", Arr2, Arr2, Arr, Eq, IntS, BoolS)
    which = z3.Function("stream", Arr2, Arr2, Arr, Eq, IntS, IntS, IntS)
    index = z3.Function("index", Arr2, Arr2, Arr, Eq, IntS, IntS, IntS)
    letter = z3.Function("letter", Arr2, Arr2, Arr, Eq, IntS, IntS, IntS)
    s1, i1, s2, i2 = z3.Ints("s1 i1 s2 i2")

    def weave(mbs):
        eq = z3.Lambda([s1], z3.Lambda([i1], z3.Lambda([s2], z3.Lambda([i2], mbs[s1][i1] == mbs[s2][i2]))))

        def unit_(k, j):
            s, ix = which(*view, eq, k, j), index(*view, eq, k, j)
            return work(letter(*view, eq, k, j), st[s][ix], mbs[s][ix], seg)

        def at(k):
            return z3.If(is_ov(*view, eq, k), Op.overlap(unit_(k, 0), unit_(k, 1)),
                         Op.compute(unit_(k, 0)))
        return nsteps(*view, eq), at
    pi = z3.Function("pi", IntS, IntS)
    injective = model.injective(pi)
    s_, i_ = z3.Ints("s i")
    relabelled = z3.Lambda([s_], z3.Lambda([i_], pi(mb[s_][i_])))
    n1, at1 = weave(mb)
    n2, at2 = weave(relabelled)
    k = z3.Int("k")
    yield Obligation("relabel(weave(streams)) = weave(relabel(streams))", z3.And(
        n1 == n2, z3.ForAll([k], z3.Implies(z3.And(0 <= k, k < n1),
                                           model.relabel_op(at1(k), pi) == at2(k)))),
        (injective,), example=((pi, IDENTITY),))

