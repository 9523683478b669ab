"""Laws of ``lower`` (``mpipe_verified.lower``).

**The model of ``lower``.** ``lower(schedule)`` times the schedule by data flow
(``semantics.schedule_times``), makes one *event* per op and one per transfer (a pair: the
``SEND`` on the producer's rank, the ``RECV`` on the consumer's), sorts all events by a key
``(time, class, rank, index, member)`` — distinct for distinct events — and gives each rank
the ops its events append, in key order (the *projection* onto the rank; ``Idle`` steps make
no event and are dropped). Ops a stuck rank never reaches are appended afterwards in program
order, i.e. with keys after every timed event; the model covers them by their keys.

In the proofs an event is its key (an integer: only the strict order of keys matters, and
keys are distinct); an event list is a Z3 sequence of keys; ``filter(p, s)`` keeps the
events satisfying ``p`` in order; ``proj(q, s)`` maps the events that touch a rank
(``q``) to the op they append there (an uninterpreted ``op_of``). ``sorted`` is strict
sortedness (every element below all later ones), ``mem`` membership. The shared lemmas
(filter keeps sortedness, a strictly sorted list is determined by its elements, ...) are
proven by induction in every law that uses them.
"""

from __future__ import annotations

import z3

from .core import Obligation, all_sizes, law
from .model import IntSeq, Op, OpSeq, cons, empty, head, recfun, tail

IntS, BoolS = z3.IntSort(), z3.BoolSort()
Pred = z3.ArraySort(IntS, BoolS)
OP_OF = z3.Function("op_of", IntS, Op)  # the op an event appends on the rank at hand


def allgt_fn():
    """``allgt(x, s)``: every element of ``s`` is greater than ``x``."""
    return recfun("ev_allgt", (IntS, IntSeq), BoolS, lambda f, x, s: z3.Or(
        z3.Length(s) == 0, z3.And(x < head(s), f(x, tail(s)))))


def sorted_fn():
    allgt = allgt_fn()
    return recfun("ev_sorted", (IntSeq,), BoolS, lambda f, s: z3.Or(
        z3.Length(s) == 0, z3.And(allgt(head(s), tail(s)), f(tail(s)))))


def mem_fn():
    return recfun("ev_mem", (IntS, IntSeq), BoolS, lambda f, v, s: z3.And(
        z3.Length(s) > 0, z3.Or(head(s) == v, f(v, tail(s)))))


def filter_fn():
    return recfun("ev_filter", (Pred, IntSeq), IntSeq, lambda f, p, s: z3.If(
        z3.Length(s) == 0, empty(IntSeq),
        z3.If(p[head(s)], cons(head(s), f(p, tail(s))), f(p, tail(s)))))


def proj_fn():
    """``proj(q, s)``: the ops appended on a rank by the events of ``s`` touching it."""
    return recfun("ev_proj", (Pred, IntSeq), OpSeq, lambda f, q, s: z3.If(
        z3.Length(s) == 0, empty(OpSeq),
        z3.If(q[head(s)], cons(OP_OF(head(s)), f(q, tail(s))), f(q, tail(s)))))


def _vars():
    s, t, s2, t2 = (z3.Const(n, IntSeq) for n in ("s", "t", "s2", "t2"))
    x, y, v = z3.Ints("x y v")
    p, q = z3.Const("p", Pred), z3.Const("q", Pred)
    return s, t, s2, t2, x, y, v, p, q


# Unfolding equations of the recursive functions on a non-empty list ``y::u``. Each is
# proven once (``unfold_obligations``, with every argument free), so any instance is valid.
def u_filter(p, y, u):
    flt = filter_fn()
    return flt(p, cons(y, u)) == z3.If(p[y], cons(y, flt(p, u)), flt(p, u))


def u_allgt(x, y, u):
    return allgt_fn()(x, cons(y, u)) == z3.And(x < y, allgt_fn()(x, u))


def u_sorted(y, u):
    return sorted_fn()(cons(y, u)) == z3.And(allgt_fn()(y, u), sorted_fn()(u))


def u_mem(v, y, u):
    return mem_fn()(v, cons(y, u)) == z3.Or(y == v, mem_fn()(v, u))


def u_proj(q, y, u):
    proj = proj_fn()
    return proj(q, cons(y, u)) == z3.If(q[y], cons(OP_OF(y), proj(q, u)), proj(q, u))


def unfold_obligations(prefix: str = ""):
    s, t, s2, t2, x, y, v, p, q = _vars()
    mem = mem_fn()
    for name, claim in (("filter", u_filter(p, y, t)), ("allgt", u_allgt(x, y, t)),
                        ("sorted", u_sorted(y, t)), ("mem", u_mem(v, y, t)),
                        ("proj", u_proj(q, y, t)),
                        ("mem of []", z3.Not(mem(v, empty(IntSeq))))):
        yield Obligation(f"{prefix}unfold {name}", claim)


def _cases(name, goal, conds, hyps, lemmas, example):
    """One obligation per case ``(label, condition, example)``; the conditions must cover
    every case (they are complementary at each use)."""
    for label, cond, extra in conds:
        yield Obligation(f"{name} ({label})", goal, hyps + (cond,), lemmas=lemmas,
                         example=example + extra)


def sorted_filter_kit(prefix: str = ""):
    """Obligations proving, by induction, the lemmas of ``sorted_filter_lemma``: a strictly
    sorted list whose elements are exactly the ``p``-elements of a strictly sorted ``e``
    is ``filter(p, e)``. Each induction step is split on the branch the recursive
    functions take at the head, with their unfolding equations as lemmas."""
    allgt, srt, mem, flt = allgt_fn(), sorted_fn(), mem_fn(), filter_fn()
    s, t, s2, t2, x, y, v, p, q = _vars()
    z = z3.Int("z")
    yield from unfold_obligations(prefix)
    true_p, false_p = z3.K(IntS, z3.BoolVal(True)), z3.K(IntS, z3.BoolVal(False))
    ex = ((t, empty(IntSeq)), (t2, empty(IntSeq)))
    on_p = (("p holds at the head", p[y], ((p, true_p),)),
            ("p fails at the head", z3.Not(p[y]), ((p, false_p),)))

    # K1: allgt(x, s) -> allgt(x, filter(p, s))
    k1 = lambda x_, u, p_=p: z3.Implies(allgt(x_, u), allgt(x_, flt(p_, u)))
    yield Obligation(f"{prefix}allgt survives filter: base", k1(x, empty(IntSeq)))
    yield from _cases(f"{prefix}allgt survives filter: step", k1(x, cons(y, t)), on_p,
                      (k1(x, t),),
                      (u_filter(p, y, t), u_allgt(x, y, t), u_allgt(x, y, flt(p, t))),
                      ex)
    # K2: sorted(s) -> sorted(filter(p, s))
    k2 = lambda u: z3.Implies(srt(u), srt(flt(p, u)))
    yield Obligation(f"{prefix}filter keeps sortedness: base", k2(empty(IntSeq)))
    yield from _cases(f"{prefix}filter keeps sortedness: step", k2(cons(y, t)), on_p,
                      (k2(t),),
                      (u_filter(p, y, t), u_sorted(y, t), u_sorted(y, flt(p, t)), k1(y, t)),
                      ex)
    # K3: mem(v, filter(p, s)) = mem(v, s) and p[v]
    k3 = lambda u: mem(v, flt(p, u)) == z3.And(mem(v, u), p[v])
    yield Obligation(f"{prefix}members of a filter: base", k3(empty(IntSeq)),
                     lemmas=(z3.Not(mem(v, empty(IntSeq))),))
    yield from _cases(f"{prefix}members of a filter: step", k3(cons(y, t)),
                      (("p at the head, v = head", z3.And(p[y], v == y), ((p, true_p), (v, y))),
                       ("p at the head, v != head", z3.And(p[y], v != y),
                        ((p, true_p), (v, y + 1))),
                       ("not p at the head", z3.Not(p[y]), ((p, false_p),))),
                      (k3(t),),
                      (u_filter(p, y, t), u_mem(v, y, t), u_mem(v, y, flt(p, t))),
                      ex)
    # K4: allgt(x, s) and mem(v, s) -> x < v
    k4 = lambda x_, v_, u: z3.Implies(z3.And(allgt(x_, u), mem(v_, u)), x_ < v_)
    yield Obligation(f"{prefix}allgt bounds members: base", k4(x, v, empty(IntSeq)),
                     lemmas=(z3.Not(mem(v, empty(IntSeq))),))
    yield Obligation(f"{prefix}allgt bounds members: step", k4(x, v, cons(y, t)),
                     (k4(x, v, t),), lemmas=(u_allgt(x, y, t), u_mem(v, y, t)), example=ex)
    # K5: two strictly sorted lists with the same members are equal (induction on s,
    # for every s2; base and step split on s2 = [] / s2 = z::t2)
    same = lambda a, b: z3.ForAll([v], mem(v, a) == mem(v, b))
    k5 = lambda a, b: z3.Implies(z3.And(srt(a), srt(b), same(a, b)), a == b)
    nil = empty(IntSeq)
    yield Obligation(f"{prefix}sorted list determined by members: base, s2 = []", k5(nil, nil))
    yield Obligation(f"{prefix}sorted list determined by members: base, s2 = z::t2",
                     k5(nil, cons(z, t2)),
                     lemmas=(u_mem(z, z, t2), z3.Not(mem(z, nil))))
    yield Obligation(f"{prefix}sorted list determined by members: step, s2 = []",
                     k5(cons(y, t), nil),
                     lemmas=(u_mem(y, y, t), z3.Not(mem(y, nil))))
    yield Obligation(f"{prefix}sorted list determined by members: step, s2 = z::t2",
                     k5(cons(y, t), cons(z, t2)), (k5(t, t2),),
                     lemmas=(u_sorted(y, t), u_sorted(z, t2),
                             z3.ForAll([v], u_mem(v, y, t)), z3.ForAll([v], u_mem(v, z, t2)),
                             k4(y, z, t), k4(z, y, t2), k4(y, y, t), k4(z, z, t2)),
                     example=ex)
    # K6: the corollary used by the laws
    yield Obligation(f"{prefix}the p-events of a sorted list, sorted, are its filter",
                     sorted_filter_lemma(p, z3.Const("e", IntSeq), z3.Const("ea", IntSeq)),
                     lemmas=filter_lemmas())


def filter_lemmas():
    """K2, K3 and K5 of ``sorted_filter_kit``, universally quantified (proven there):
    filter keeps sortedness, the members of a filter, and a strictly sorted list is
    determined by its members."""
    srt, mem, flt = sorted_fn(), mem_fn(), filter_fn()
    s, t, s2, t2, x, y, v, p, q = _vars()
    same = z3.ForAll([v], mem(v, s) == mem(v, s2))
    return (z3.ForAll([p, s], z3.Implies(srt(s), srt(flt(p, s)))),
            z3.ForAll([v, p, s], mem(v, flt(p, s)) == z3.And(mem(v, s), p[v])),
            z3.ForAll([s, s2], z3.Implies(z3.And(srt(s), srt(s2), same), s == s2)))


def sorted_filter_lemma(p, e, ea):
    """A strictly sorted ``ea`` whose members are the ``p``-members of a strictly sorted
    ``e`` is ``filter(p, e)`` (proven by ``sorted_filter_kit`` for all ``p, e, ea``)."""
    srt, mem, flt = sorted_fn(), mem_fn(), filter_fn()
    v = z3.Int("v")
    return z3.Implies(
        z3.And(srt(e), srt(ea), z3.ForAll([v], mem(v, ea) == z3.And(mem(v, e), p[v]))),
        flt(p, e) == ea)


# ---------------------------------------------------------------- timing locality


class _Sched:
    """A compute-only schedule's data-flow system (``semantics.schedule_times``, delay 0):
    lengths, durations, up to two needed tokens per op (``has``, ``need``), the ops that
    deliver a token to a rank (``delivers``: produced there, or sent there), and the
    producer the timing reads (``pr``: the op delivering the needed token)."""

    def __init__(self, name: str, **given) -> None:
        def fn(key, *sig):
            return given.get(key) or z3.Function(f"{name}_{key}", *sig)
        self.len = fn("len", IntS, IntS)
        self.d = fn("d", IntS, IntS, IntS)
        self.has = fn("has", IntS, IntS, IntS, BoolS)
        self.need = fn("need", IntS, IntS, IntS, IntS)
        self.delivers = fn("delivers", IntS, IntS, IntS, IntS, BoolS)
        self.pr_rank = fn("pr_rank", IntS, IntS, IntS, IntS)
        self.pr_idx = fn("pr_idx", IntS, IntS, IntS, IntS)

    def valid(self, r, i):
        return z3.And(0 <= i, i < self.len(r))

    def start_rhs(self, T, r, i):
        """``max(previous finish, finish of each needed producer)``."""
        prev = z3.If(i == 0, 0, T(r, i - 1) + self.d(r, i - 1))
        rhs = prev
        for j in (0, 1):
            fin = T(self.pr_rank(r, i, j), self.pr_idx(r, i, j)) + \
                self.d(self.pr_rank(r, i, j), self.pr_idx(r, i, j))
            rhs = z3.If(z3.And(self.has(r, i, j), fin > rhs), fin, rhs)
        return rhs

    def solves(self, T):
        r, i = z3.Ints("r i")
        return z3.ForAll([r, i], z3.Implies(self.valid(r, i), T(r, i) == self.start_rhs(T, r, i)))

    def basics(self):
        r, i = z3.Ints("r i")
        return [z3.ForAll([r], self.len(r) >= 0),
                z3.ForAll([r, i], z3.Implies(self.valid(r, i), self.d(r, i) >= 0))]

    def producers(self):
        """Each needed token is delivered to the op's rank by the recorded producer."""
        r, i, j = z3.Ints("r i j")
        pr = (self.pr_rank(r, i, j), self.pr_idx(r, i, j))
        return z3.ForAll([r, i, j], z3.Implies(z3.And(self.valid(r, i), self.has(r, i, j)),
                                               z3.And(self.valid(*pr),
                                                      self.delivers(*pr, r, self.need(r, i, j)))))

    def unique(self):
        """At most one op delivers a given token to a given rank."""
        r, i, q, tok, r2, i2 = z3.Ints("r i q tok r2 i2")
        return z3.ForAll([r, i, r2, i2, q, tok], z3.Implies(
            z3.And(self.valid(r, i), self.valid(r2, i2), self.delivers(r, i, q, tok),
                   self.delivers(r2, i2, q, tok)), z3.And(r == r2, i == i2)))

    def well_formed(self):
        return self.basics() + [self.producers(), self.unique()]

    def executable(self, rho):
        """``rho`` ranks every op above its predecessor and its producers (the data-flow
        graph is acyclic: the schedule runs to its end)."""
        r, i, j = z3.Ints("r i j")
        return z3.ForAll([r, i], z3.Implies(self.valid(r, i), z3.And(
            rho(r, i) >= 0, z3.Implies(i > 0, rho(r, i - 1) < rho(r, i)),
            *[z3.Implies(self.has(r, i, j_), rho(self.pr_rank(r, i, j_), self.pr_idx(r, i, j_))
                         < rho(r, i)) for j_ in (0, 1)])))


def _timing_obligations():
    in_a = z3.Function("inA", IntS, BoolS)
    A, Bs = _Sched("A"), _Sched("B")
    r, i, j, q, tok = z3.Ints("r i j q tok")

    def pick(fa, fb):  # par: rank r's data from A when r is an A rank, else from B
        return lambda rr, *rest: z3.If(in_a(rr), fa(rr, *rest), fb(rr, *rest))
    P = _Sched("P", len=pick(A.len, Bs.len), d=pick(A.d, Bs.d), has=pick(A.has, Bs.has),
               need=pick(A.need, Bs.need), delivers=pick(A.delivers, Bs.delivers))
    placement = [z3.ForAll([r], z3.Implies(z3.Not(in_a(r)), A.len(r) == 0)),
                 z3.ForAll([r], z3.Implies(in_a(r), Bs.len(r) == 0))]
    closed = [z3.ForAll([r, i, q, tok], z3.Implies(A.delivers(r, i, q, tok), in_a(q))),
              z3.ForAll([r, i, q, tok], z3.Implies(Bs.delivers(r, i, q, tok), z3.Not(in_a(q))))]
    wf = A.well_formed() + Bs.well_formed() + [P.producers()]
    # vacuity example: both schedules empty, nothing delivered
    no = z3.BoolVal(False)
    ex = ((A.len, z3.IntVal(0)), (Bs.len, z3.IntVal(0)), (A.delivers, no), (Bs.delivers, no))
    # 0. par(A,B) is well formed: lengths and durations from A and B; its deliverers are
    #    unique because A's and B's are and neither delivers to the other's ranks
    p_basics = P.basics()
    yield Obligation("timing: par(A,B) has lengths >= 0 and durations >= 0",
                     z3.And(*p_basics), tuple(wf + placement), example=ex)
    yield Obligation("timing: par(A,B) has one deliverer per token and rank (closedness)",
                     P.unique(), tuple(wf + placement + closed), example=ex)
    wf = wf + p_basics + [P.unique()]  # proven just above
    # 1. uniqueness of the timing (strong induction on rho: a solution agreeing below x0
    #    agrees at x0; so the package's timing of par(A,B) is the union of 4 below)
    T1, T2 = (z3.Function(n, IntS, IntS, IntS) for n in ("T1", "T2"))
    rho = z3.Function("rho", IntS, IntS, IntS)
    x_r, x_i = z3.Ints("x_r x_i")
    below = z3.ForAll([r, i], z3.Implies(z3.And(P.valid(r, i), rho(r, i) < rho(x_r, x_i)),
                                         T1(r, i) == T2(r, i)))
    yield Obligation("timing: solutions agree (strong induction step on rho)",
                     z3.Implies(z3.And(P.valid(x_r, x_i), below), T1(x_r, x_i) == T2(x_r, x_i)),
                     tuple(wf + placement + [P.executable(rho), P.solves(T1), P.solves(T2)]),
                     example=ex)
    # 2. in par(A, B), an A rank's op reads the same producers as in A (closedness)
    same_pr = []
    for side, X, inside in ((A, A, lambda rr: in_a(rr)), (Bs, Bs, lambda rr: z3.Not(in_a(rr)))):
        claim = z3.ForAll([r, i, j], z3.Implies(
            z3.And(inside(r), P.valid(r, i), P.has(r, i, j)),
            z3.And(P.pr_rank(r, i, j) == X.pr_rank(r, i, j),
                   P.pr_idx(r, i, j) == X.pr_idx(r, i, j))))
        same_pr.append(claim)
        yield Obligation(f"timing: producers in par(A,B) = producers in {'A' if X is A else 'B'}",
                         claim, tuple(wf + placement + closed), example=ex)
    # 3. par(A, B) is executable when A and B are: their data-flow ranks together rank it
    rho_a, rho_b = (z3.Function(n, IntS, IntS, IntS) for n in ("rhoA", "rhoB"))
    yield Obligation("timing: par(A,B) is executable (A's and B's data-flow orders combined)",
                     P.executable(lambda rr, ii: z3.If(in_a(rr), rho_a(rr, ii), rho_b(rr, ii))),
                     tuple(wf + placement + closed + [A.executable(rho_a), Bs.executable(rho_b)]),
                     lemmas=tuple(same_pr), example=ex)
    # 4. the union of A's and B's timings solves par(A, B)'s equations
    TA, TB = z3.Function("TA", IntS, IntS, IntS), z3.Function("TB", IntS, IntS, IntS)
    union = lambda rr, ii: z3.If(in_a(rr), TA(rr, ii), TB(rr, ii))
    yield Obligation("timing: A's timing and B's timing together solve par(A,B)",
                     P.solves(union),
                     tuple(wf + placement + closed + [A.solves(TA), Bs.solves(TB)]),
                     lemmas=tuple(same_pr), example=ex)


# ---------------------------------------------------------------- the laws


@law("lower_par",
     "lower(par(A,B)) = par(lower(A), lower(B)) for executable A, B on disjoint ranks with no "
     "message between them: same timing, same per-rank event order, same projection",
     all_sizes("every rank, length and content; executable, well-formed schedules; "
               "induction on lists and on the data-flow order; the step from the timing "
               "part to the event part (par(A,B)'s events are A's and B's with their keys "
               "from lower(A) and lower(B)) is assumed, not checked"))
def lower_par():
    yield from _timing_obligations()
    yield from sorted_filter_kit()
    srt, mem, flt, proj = sorted_fn(), mem_fn(), filter_fn(), proj_fn()
    s, t, s2, t2, x, y, v, p, q = _vars()
    nil = empty(IntSeq)
    true_p, false_p = z3.K(IntS, z3.BoolVal(True)), z3.K(IntS, z3.BoolVal(False))
    ex = ((t, nil),)
    # K7: every event touching the rank (q) is a p-event -> projecting filter(p, s) is
    # projecting s
    q_in_p = z3.ForAll([v], z3.Implies(q[v], p[v]))
    k7 = lambda u: proj(q, flt(p, u)) == proj(q, u)
    yield Obligation("projection ignores other events: base", k7(nil), (q_in_p,))
    unf = (u_filter(p, y, t), u_proj(q, y, t), u_proj(q, y, flt(p, t)))
    yield from _cases("projection ignores other events: step", k7(cons(y, t)),
                      (("p and q at the head", z3.And(p[y], q[y]), ((p, true_p), (q, true_p))),
                       ("p, not q at the head", z3.And(p[y], z3.Not(q[y])),
                        ((p, true_p), (q, false_p))),
                       ("not p at the head", z3.Not(p[y]), ((p, false_p), (q, false_p)))),
                      (q_in_p, k7(t)), unf, ex)
    # K8: no event of s touches the rank -> empty projection
    k8 = lambda u: z3.Implies(z3.ForAll([v], z3.Implies(mem(v, u), z3.Not(q[v]))),
                              proj(q, u) == empty(OpSeq))
    yield Obligation("no event touches the rank: base", k8(nil))
    yield Obligation("no event touches the rank: step", k8(cons(y, t)), (k8(t),),
                     lemmas=(u_proj(q, y, t), z3.ForAll([v], u_mem(v, y, t))), example=ex)
    # The law on one rank r. e = the sorted events of par(A,B): by the timing part, A's
    # events carry the keys they have in lower(A) (their key is (time, class, rank, index,
    # member) and A's times are unchanged), so e's members are ea's and eb's, the sorted
    # events of A and of B. in_a tags A's events; touch = the events appending an op on r.
    # No message between A and B: A's events touch only A ranks, B's only B ranks.
    e, ea, eb = (z3.Const(n, IntSeq) for n in ("e", "ea", "eb"))
    in_a, touch = z3.Const("in_a", Pred), z3.Const("touch", Pred)
    r_in_a = z3.Bool("r_is_an_A_rank")
    hyps = (srt(e), srt(ea), srt(eb),
            z3.ForAll([v], mem(v, e) == z3.Or(mem(v, ea), mem(v, eb))),
            z3.ForAll([v], z3.Implies(mem(v, ea), in_a[v])),
            z3.ForAll([v], z3.Implies(mem(v, eb), z3.Not(in_a[v]))),
            z3.ForAll([v], z3.Implies(touch[v], in_a[v] == r_in_a)))
    not_a = z3.Lambda([v], z3.Not(in_a[v]))
    low_p, low_a, low_b = proj(touch, e), proj(touch, ea), proj(touch, eb)
    at = ((e, nil), (ea, nil), (eb, nil))
    w = z3.Int("w")
    for name, side, pred in (("A", ea, in_a), ("B", eb, not_a)):
        yield Obligation(f"events: members of {name}'s events = members of par(A,B)'s "
                         f"events that are {name}'s",
                         mem(w, side) == z3.And(mem(w, e), pred[w]), hyps, example=at)
    members = (z3.ForAll([v], mem(v, ea) == z3.And(mem(v, e), in_a[v])),
               z3.ForAll([v], mem(v, eb) == z3.And(mem(v, e), not_a[v])))
    instances = (flt(in_a, e) == ea, flt(not_a, e) == eb)
    yield Obligation("events: the A-events of par(A,B)'s sorted events are A's sorted "
                     "events (and the others B's)",
                     z3.And(*instances), hyps,
                     lemmas=members + (sorted_filter_lemma(in_a, e, ea),
                                       sorted_filter_lemma(not_a, e, eb)),
                     example=at)

    def k7_at(p_, u):
        return z3.Implies(z3.ForAll([v], z3.Implies(touch[v], p_[v])),
                          proj(touch, flt(p_, u)) == proj(touch, u))

    def k8_at(u):
        return z3.Implies(z3.ForAll([v], z3.Implies(mem(v, u), z3.Not(touch[v]))),
                          proj(touch, u) == empty(OpSeq))
    o = z3.Const("o", OpSeq)
    yield Obligation("a list is empty or has a positive length",
                     z3.Or(z3.Length(o) > 0, o == empty(OpSeq)))
    goal = low_p == z3.If(z3.Length(low_a) > 0, low_a, low_b)
    for label, case, mine, other, mine_ev, other_ev, pred in (
            ("an A rank", r_in_a, low_a, low_b, ea, eb, in_a),
            ("a B rank", z3.Not(r_in_a), low_b, low_a, eb, ea, not_a)):
        ex_case = at + ((r_in_a, z3.BoolVal(label == "an A rank")),)
        h = hyps + (case,)
        only_mine = z3.ForAll([v], z3.Implies(touch[v], pred[v]))
        none_other = z3.ForAll([v], z3.Implies(mem(v, other_ev), z3.Not(touch[v])))
        yield Obligation(f"r {label}: the events touching r are all its side's",
                         z3.And(only_mine, none_other), h, example=ex_case)
        yield Obligation(f"r {label}: lower(par(A,B)) on r = its side's lowering on r, and "
                         f"the other side's lowering is empty on r",
                         z3.And(low_p == mine, other == empty(OpSeq)), h,
                         lemmas=(only_mine, none_other) + instances +
                         (k7_at(pred, e), k8_at(other_ev)),
                         example=ex_case)
        yield Obligation(f"r {label}: rank r of lower(par(A,B)) = rank r of "
                         f"par(lower(A), lower(B))", goal, h,
                         lemmas=(low_p == mine, other == empty(OpSeq),
                                 z3.Or(z3.Length(low_a) > 0, low_a == empty(OpSeq))),
                         example=ex_case)


@law("lower_work_conservation",
     "if a rank's lowered sequence is its events sorted by key and its compute events are "
     "exactly the program's non-Idle steps, one event each with keys increasing along the "
     "program, then deleting the comm ops gives back the program (Idle steps dropped)",
     all_sizes("every rank, program length and content; induction on lists; that the real "
               "lowering meets the hypotheses is checked by tests/test_proofs.py "
               "test_lowering_only_inserts_comm_ops, not proved"))
def lower_work_conservation():
    yield from sorted_filter_kit()
    srt, mem, flt, proj = sorted_fn(), mem_fn(), filter_fn(), proj_fn()
    v = z3.Int("v")
    # rank r: lowered = the rank's events in key order (sorted); compute = its compute
    # events; prog = the program's non-idle steps as events in program order, whose keys
    # increase along the program (start times never decrease along a rank, ties broken by
    # the index; a stuck rank's unreached ops come after every timed event, in order)
    low, prog = z3.Const("lowered", IntSeq), z3.Const("program", IntSeq)
    is_compute = z3.Const("is_compute", Pred)
    everything = z3.Lambda([v], z3.BoolVal(True))
    hyps = (srt(low), srt(prog),
            z3.ForAll([v], mem(v, prog) == z3.And(mem(v, low), is_compute[v])))
    # deleting comm ops = keeping the compute events, then reading their ops
    yield Obligation("compute ops of the lowered rank, in order, = the program",
                     proj(everything, flt(is_compute, low)) == proj(everything, prog),
                     hyps, lemmas=(sorted_filter_lemma(is_compute, low, prog),),
                     example=((low, empty(IntSeq)), (prog, empty(IntSeq))))
