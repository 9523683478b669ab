"""Safety laws the verifier can compose with: deadlock freedom is preserved by ``par`` and
by ``seq``.

**Plans.** A plan gives each rank ``r`` a length ``len(r)`` and, per position ``i``, a kind
(``COMPUTE``, ``SEND``, ``RECV``) and a peer rank. Matching is FIFO per ordered pair
(docs/semantics.md §2.3): ``c(r, i, k, q)`` counts the ops of kind ``k`` with peer ``q`` before
position ``i`` on rank ``r`` (its defining equations are hypotheses), an op's FIFO index is
``c`` at its own position, and the send ``(r, i)`` to ``q`` is matched with the receive
``(q, j)`` from ``r`` of the same index.

**Deadlock freedom** is the certificate of ``verify.passes.deadlock`` (single ops, no
groups or collectives): step times ``t(r, i)``, strictly increasing along every rank, every
channel balanced (as many sends ``r -> q`` as receives at ``q`` from ``r``: nothing left
unmatched), and every matched pair at the same time. Such times exist exactly when the
plan runs to its end under rendezvous: run the ops in time order.

The laws construct the composition's witness from the parts' witnesses and prove it is
one; the two ``false_*`` laws show the harness rejects the tempting wrong versions.
"""

from __future__ import annotations

import z3

from .core import Obligation, all_sizes, bounded, law

IntS, BoolS = z3.IntSort(), z3.BoolSort()
COMPUTE, SEND, RECV = 0, 1, 2


class _Plan:
    def __init__(self, name: str, **given) -> None:
        def fn(key, *sig):
            return given.get(key) or z3.Function(f"{name}_{key}", *sig)
        self.name = name
        self.len = fn("len", IntS, IntS)
        self.kind = fn("kind", IntS, IntS, IntS)
        self.peer = fn("peer", IntS, IntS, IntS)
        self.c = z3.Function(f"{name}_count", IntS, IntS, IntS, IntS, IntS)

    def valid(self, r, i):
        return z3.And(0 <= i, i < self.len(r))

    def counts(self, r, i, k, q):
        return z3.If(z3.And(self.kind(r, i) == k, self.peer(r, i) == q), 1, 0)

    def count_defs(self):
        """The defining equations of the FIFO counter."""
        r, i, k, q = z3.Ints("r i k q")
        return [z3.ForAll([r, k, q], self.c(r, 0, k, q) == 0),
                z3.ForAll([r, i, k, q], z3.Implies(
                    self.valid(r, i), self.c(r, i + 1, k, q) == self.c(r, i, k, q) + self.counts(r, i, k, q)))]

    def idx(self, r, i):
        return self.c(r, i, self.kind(r, i), self.peer(r, i))

    def tot(self, r, k, q):
        return self.c(r, self.len(r), k, q)

    def matched(self, r, i, q, j):
        return z3.And(self.valid(r, i), self.valid(q, j), self.kind(r, i) == SEND,
                      self.peer(r, i) == q, self.kind(q, j) == RECV, self.peer(q, j) == r,
                      self.idx(r, i) == self.idx(q, j))

    def ordered(self, t):
        r, i = z3.Ints("r i")
        return z3.ForAll([r, i], z3.Implies(z3.And(0 <= i, i + 1 < self.len(r)), t(r, i) < t(r, i + 1)))

    def balanced(self):
        r, q = z3.Ints("r q")
        return z3.ForAll([r, q], self.tot(r, SEND, q) == self.tot(q, RECV, r))

    def meet(self, t):
        r, i, q, j = z3.Ints("r i q j")
        return z3.ForAll([r, i, q, j], z3.Implies(self.matched(r, i, q, j), t(r, i) == t(q, j)))

    def certificate(self, t):
        return [self.ordered(t), self.balanced(), self.meet(t)]


def _lengths(*plans):
    r = z3.Int("r")
    return [z3.ForAll([r], p.len(r) >= 0) for p in plans]


def _monotone(X: _Plan, hyps, ex=()):
    """Obligations: ``c`` never decreases along a rank (induction on j), so an op's FIFO
    index is below its channel's total. Returns the lemma."""
    r, i, j, k, q = z3.Ints("r i j k q")
    claim = lambda j_: z3.Implies(z3.And(0 <= i, i <= j_, j_ <= X.len(r)),
                                  X.c(r, i, k, q) <= X.c(r, j_, k, q))
    yield Obligation(f"{X.name}: counter monotone, base j = i", z3.Implies(
        z3.And(0 <= i, i <= X.len(r)), X.c(r, i, k, q) <= X.c(r, i, k, q)), hyps, example=ex)
    yield Obligation(f"{X.name}: counter monotone, step j -> j+1", claim(j + 1),
                     hyps + (claim(j),), example=ex)
    mono = z3.ForAll([r, i, j, k, q], claim(j))
    below = z3.ForAll([r, i], z3.Implies(X.valid(r, i),
                                         X.idx(r, i) + 1 <= X.tot(r, X.kind(r, i), X.peer(r, i))))
    yield Obligation(f"{X.name}: an op's FIFO index is below its channel total", below, hyps,
                     lemmas=(mono,), example=ex)
    yield Obligation(f"{X.name}: counters are >= 0",
                     z3.ForAll([r, j, k, q], z3.Implies(z3.And(0 <= j, j <= X.len(r)),
                                                        X.c(r, j, k, q) >= 0)),
                     hyps, lemmas=(mono,), example=ex)


def _empty_example(*plans):
    """A point satisfying the hypotheses: every plan empty, every counter 0."""
    zero = z3.IntVal(0)
    out = []
    for X in plans:
        if isinstance(X.len, z3.FuncDeclRef):
            out.append((X.len, zero))
        out.append((X.c, zero))
    return tuple(out)


def _induction_on_i(name, claim, lo, hi, hyps, lemmas=(), example=()):
    """``claim(i)`` for ``lo <= i <= hi``: base ``claim(lo)``, step ``i -> i+1`` for
    ``lo <= i < hi``."""
    i = z3.Int("i_ind")
    yield Obligation(f"{name}: base", claim(lo), hyps, lemmas=lemmas, example=example)
    yield Obligation(f"{name}: step", z3.Implies(z3.And(lo <= i, i < hi), claim(i + 1)),
                     hyps + (z3.Implies(z3.And(lo <= i, i <= hi), claim(i)),), lemmas=lemmas,
                     example=example)


# ---------------------------------------------------------------- par


def _par_setup():
    in_a = z3.Function("inA", IntS, BoolS)
    A, B = _Plan("A"), _Plan("B")

    def pick(fa, fb):
        return lambda r, *rest: z3.If(in_a(r), fa(r, *rest), fb(r, *rest))
    P = _Plan("P", len=pick(A.len, B.len), kind=pick(A.kind, B.kind), peer=pick(A.peer, B.peer))
    r = z3.Int("r")
    placement = [z3.ForAll([r], z3.Implies(z3.Not(in_a(r)), A.len(r) == 0)),
                 z3.ForAll([r], z3.Implies(in_a(r), B.len(r) == 0))]
    return in_a, A, B, P, placement


@law("par_deadlock_free",
     "par(A,B) of deadlock-free plans on disjoint ranks is deadlock-free: the union of "
     "their step times is a certificate (a side's balanced channels keep its messages "
     "inside its own ranks)",
     all_sizes("every rank, length, op kind and peer; induction on positions"))
def par_deadlock_free():
    in_a, A, B, P, placement = _par_setup()
    tA, tB = z3.Function("tA", IntS, IntS, IntS), z3.Function("tB", IntS, IntS, IntS)
    hyps = tuple(_lengths(A, B) + placement + A.count_defs() + B.count_defs() + P.count_defs()
                 + A.certificate(tA) + B.certificate(tB))
    ex = _empty_example(A, B, P)
    r, k, q = z3.Ints("r k q")
    agree = []
    for X, side in ((A, in_a(r)), (B, z3.Not(in_a(r)))):
        claim = lambda i_, X=X, side=side: z3.Implies(side, P.c(r, i_, k, q) == X.c(r, i_, k, q))
        yield from _induction_on_i(f"par counter = {X.name}'s counter on {X.name}'s ranks",
                                   claim, 0, P.len(r), hyps, example=ex)
        i = z3.Int("i")
        agree.append(z3.ForAll([r, i, k, q], z3.Implies(z3.And(0 <= i, i <= P.len(r)), claim(i))))
    mono = yield from _monotone_both(A, B, hyps, ex)
    tP = lambda r_, i_: z3.If(in_a(r_), tA(r_, i_), tB(r_, i_))
    yield from _certificate_obligations("par", P, tP, hyps, tuple(agree + mono), ex,
                                        lambda r_, i_: in_a(r_), "on A's ranks", "on B's ranks")


def _monotone_both(A, B, hyps, ex):
    """Yield both sides' monotonicity obligations; return their goals (as lemmas)."""
    mono = []
    for X in (A, B):
        obs = list(_monotone(X, hyps, ex))
        yield from obs
        mono += [obs[-2].goal, obs[-1].goal]
    return mono


def _certificate_obligations(name, P, tP, hyps, lemmas, ex, in_a, a_where, b_where):
    """The composed times ``tP`` certify ``P``: strictly increasing on every rank, every
    channel balanced, and every matched pair meeting, in four cases by which side
    (``in_a(rank, position)``) each end lies on."""
    yield Obligation(f"{name}: steps strictly increase on every rank", P.ordered(tP), hyps,
                     lemmas=lemmas, example=ex)
    yield Obligation(f"{name}: every channel balanced", P.balanced(), hyps, lemmas=lemmas,
                     example=ex)
    r, i, q, j = z3.Ints("r i q j")
    meets = z3.Implies(P.matched(r, i, q, j), tP(r, i) == tP(q, j))
    send_a, recv_a = in_a(r, i), in_a(q, j)
    for label, case in ((f"both {a_where}", z3.And(send_a, recv_a)),
                        (f"send {a_where}, receive {b_where}", z3.And(send_a, z3.Not(recv_a))),
                        (f"send {b_where}, receive {a_where}", z3.And(z3.Not(send_a), recv_a)),
                        (f"both {b_where}", z3.And(z3.Not(send_a), z3.Not(recv_a)))):
        yield Obligation(f"{name}: matched pair meets ({label})", meets, hyps + (case,),
                         lemmas=lemmas, example=ex)


# ---------------------------------------------------------------- seq


def _seq_setup():
    A, B = _Plan("A"), _Plan("B")

    def cat(fa, fb):
        return lambda r, i: z3.If(i < A.len(r), fa(r, i), fb(r, i - A.len(r)))
    S = _Plan("S", len=lambda r: A.len(r) + B.len(r), kind=cat(A.kind, B.kind),
              peer=cat(A.peer, B.peer))
    return A, B, S


def _seq_law(shift: bool):
    A, B, S = _seq_setup()
    tA, tB = z3.Function("tA", IntS, IntS, IntS), z3.Function("tB", IntS, IntS, IntS)
    hi_a, lo_b = z3.Ints("max_tA min_tB")
    r, i, k, q = z3.Ints("r i k q")
    # plans are finite: A's times have a maximum, B's a minimum
    bounds = [z3.ForAll([r, i], z3.Implies(A.valid(r, i), tA(r, i) <= hi_a)),
              z3.ForAll([r, i], z3.Implies(B.valid(r, i), tB(r, i) >= lo_b))]
    hyps = tuple(_lengths(A, B) + A.count_defs() + B.count_defs() + S.count_defs()
                 + A.certificate(tA) + B.certificate(tB) + bounds)
    ex = _empty_example(A, B, S)
    first = lambda i_: z3.Implies(z3.And(0 <= i_, i_ <= A.len(r)), S.c(r, i_, k, q) == A.c(r, i_, k, q))
    yield from _induction_on_i("seq counter = A's counter on A's part", first, 0, A.len(r), hyps,
                               example=ex)
    first_l = z3.ForAll([r, i, k, q], first(i))
    second = lambda i_: z3.Implies(z3.And(0 <= i_, i_ <= B.len(r)),
                                   S.c(r, A.len(r) + i_, k, q) == A.tot(r, k, q) + B.c(r, i_, k, q))
    yield from _induction_on_i("seq counter = A's total + B's counter on B's part", second, 0,
                               B.len(r), hyps, lemmas=(first_l,), example=ex)
    second_l = z3.ForAll([r, i, k, q], second(i))
    mono = yield from _monotone_both(A, B, hyps, ex)
    delta = hi_a - lo_b + 1 if shift else 0
    tS = lambda r_, i_: z3.If(i_ < A.len(r_), tA(r_, i_), tB(r_, i_ - A.len(r_)) + delta)
    yield from _certificate_obligations("seq", S, tS, hyps, (first_l, second_l) + tuple(mono),
                                        ex, lambda r_, i_: i_ < A.len(r_), "in A's part",
                                        "in B's part")


@law("seq_deadlock_free",
     "seq(A,B) of deadlock-free plans is deadlock-free: A's step times, then B's shifted "
     "after A's last, are a certificate (A's balanced channels keep every message of A "
     "matched inside A, so no pair crosses the seam)",
     all_sizes("every rank, length, op kind and peer; induction on positions"))
def seq_deadlock_free():
    yield from _seq_law(shift=True)


# ---------------------------------------------------------------- false laws


class _Small:
    """A plan with fixed small sizes: ``length`` ops on each of ``ranks`` ranks, with
    symbolic kinds and peers (the same definitions as ``_Plan``, unrolled)."""

    def __init__(self, name: str, ranks: int, length: int, ops=None) -> None:
        self.ranks, self.length = ranks, length
        if ops is None:
            ops = [[(z3.Int(f"{name}_kind_{r}_{n}"), z3.Int(f"{name}_peer_{r}_{n}"))
                    for n in range(length)] for r in range(ranks)]
        self.ops = ops

    def domain(self):
        return [z3.And(k >= COMPUTE, k <= RECV, p >= 0, p < self.ranks, p != r)
                for r, row in enumerate(self.ops) for k, p in row]

    def idx(self, r, n):
        k, p = self.ops[r][n]
        return z3.Sum([z3.If(z3.And(k2 == k, p2 == p), 1, 0) for k2, p2 in self.ops[r][:n]] + [0])

    def tot(self, r, k, q):
        return z3.Sum([z3.If(z3.And(k2 == k, p2 == q), 1, 0) for k2, p2 in self.ops[r]] + [0])

    def certificate(self, t):
        out = [t[r][n] < t[r][n + 1] for r in range(self.ranks) for n in range(self.length - 1)]
        out += [self.tot(r, SEND, q) == self.tot(q, RECV, r)
                for r in range(self.ranks) for q in range(self.ranks)]
        for r in range(self.ranks):
            for n in range(self.length):
                for q in range(self.ranks):
                    for m in range(self.length):
                        (k, p), (k2, p2) = self.ops[r][n], self.ops[q][m]
                        matched = z3.And(k == SEND, p == q, k2 == RECV, p2 == r,
                                         self.idx(r, n) == self.idx(q, m))
                        out.append(z3.Implies(matched, t[r][n] == t[q][m]))
        return out


def _times(name, ranks, length):
    return [[z3.Int(f"{name}_t_{r}_{n}") for n in range(length)] for r in range(ranks)]


@law("false_seq_unshifted",
     "(FALSE on purpose) seq(A,B) of deadlock-free plans is certified by A's step times "
     "followed by B's, unshifted",
     bounded("2 ranks, 2 ops per rank in each plan"))
def false_seq_unshifted():
    A, B = _Small("A", 2, 2), _Small("B", 2, 2)
    S = _Small("S", 2, 4, [a + b for a, b in zip(A.ops, B.ops)])
    tA, tB = _times("A", 2, 2), _times("B", 2, 2)
    tS = [a + b for a, b in zip(tA, tB)]
    yield Obligation("A's then B's times certify seq(A,B)", z3.And(*S.certificate(tS)),
                     tuple(A.domain() + B.domain() + A.certificate(tA) + B.certificate(tB)))


@law("false_par_exchanging",
     "(FALSE on purpose) par(A,B) of plans that exchange messages is deadlock-free when each "
     "side is deadlock-free apart from those messages and every channel is balanced",
     bounded("A on rank 0, B on rank 1, two comm ops each"))
def false_par_exchanging():
    # rank 0 is A, rank 1 is B; every op is a send to or a receive from the other side, so
    # neither side has an internal message and each is deadlock-free on its own
    P = _Small("P", 2, 2)
    comm_only = [z3.Or(k == SEND, k == RECV) for row in P.ops for k, _ in row]
    t = _times("P", 2, 2)
    cert = P.certificate(t)
    times = [x for row in t for x in row]
    balanced = [P.tot(r, SEND, q) == P.tot(q, RECV, r) for r in range(2) for q in range(2)]
    yield Obligation("par(A,B) has a certificate",
                     z3.Exists(times, z3.And(*cert)),
                     tuple(P.domain() + comm_only + balanced))
