"""Matching and deadlock of a lowered plan, for every schedule that runs.

**The model of ``lower`` on a schedule whose data-flow timing reaches every op** (the
event part of ``proofs.lowering``'s model; ``lower``'s stuck-rank fallback is never taken
then): every op and every transfer is one *event*; the events are sorted by a key that is
distinct for distinct events, and an event is its index in that sorted list ``E`` (an
integer >= 0). A transfer event touches two ranks, its producer's ``a`` and its
consumer's ``b != a``: it appends ``SEND(b, payload)`` on ``a`` and ``RECV(a, payload)`` on
``b``, with one payload (a function of the event). Rank ``q``'s program is the list
``E_q`` of the events touching ``q``, in key order (strictly sorted, its members the
members of ``E`` touching ``q``). ``chan`` marks the transfer events from ``a`` to ``b``:
exactly the ops of ``E_a`` that are sends to ``b`` and the ops of ``E_b`` that are
receives from ``a``.

**Matching** (FIFO pairing per ordered rank pair): the sends ``a -> b`` in ``a``'s order
and the receives at ``b`` from ``a`` in ``b``'s order are one event list (both are
``filter(chan, E)``), so the k-th send and the k-th receive are the two ends of one
transfer: equal counts, equal payloads, nothing unmatched.

**Deadlock** (the verifier's rule: completion times ``fin`` that never decrease along a
rank, every blocking end has a FIFO partner, each end of a pair completes after the other
end was posted, ``post(i) = fin(i-1)``, 0 for the first): the witness is ``fin(op) =`` its
event. Along a rank it strictly increases (``E_q`` is strictly sorted), partners are one
event, so ``fin`` is equal at both ends, and each end was posted (at its predecessor's
event, smaller, or at 0) before the other completes.

What is family-specific is only the hypothesis that the timing reaches every op; each
family's matching and deadlock laws prove it with the family's data-flow witness.
"""

from __future__ import annotations

import z3

from .core import Obligation, law
from .lowering import (IntS, Pred, allgt_fn, filter_fn, filter_lemmas, mem_fn,
                       sorted_filter_kit, sorted_fn, u_allgt, u_sorted)
from .model import IntSeq, cons, empty

BoolS = z3.BoolSort()


def _setup():
    e, ea, eb = (z3.Const(n, IntSeq) for n in ("E", "E_a", "E_b"))
    ta, tb, chan = (z3.Const(n, Pred) for n in ("touches_a", "touches_b", "chan_ab"))
    srt, mem = sorted_fn(), mem_fn()
    v = z3.Int("v")
    hyps = (srt(e), srt(ea), srt(eb),
            z3.ForAll([v], mem(v, ea) == z3.And(mem(v, e), ta[v])),
            z3.ForAll([v], mem(v, eb) == z3.And(mem(v, e), tb[v])),
            z3.ForAll([v], z3.Implies(chan[v], z3.And(ta[v], tb[v]))),
            *[z3.ForAll([v], z3.Implies(z3.And(0 <= v, v < z3.Length(q)), q[v] >= 0))
              for q in (ea, eb)])
    nil = empty(IntSeq)
    example = ((e, nil), (ea, nil), (eb, nil))
    return e, ea, eb, ta, tb, chan, hyps, example


def _channel_lemma(prefix: str):
    """``filter(chan, E_a) == filter(chan, E_b)``: both are ``filter(chan, E)``."""
    e, ea, eb, ta, tb, chan, hyps, ex = _setup()
    flt = filter_fn()
    for side, eq in (("a", ea), ("b", eb)):
        yield Obligation(f"{prefix}the channel's events on rank {side} are filter(chan, E)",
                         flt(chan, eq) == flt(chan, e), hyps, lemmas=filter_lemmas(),
                         example=ex)
    yield Obligation(f"{prefix}the sends a -> b in a's order are the receives at b from a "
                     f"in b's order (one event list)", flt(chan, ea) == flt(chan, eb), hyps,
                     lemmas=(flt(chan, ea) == flt(chan, e), flt(chan, eb) == flt(chan, e)),
                     example=ex)


def matching_obligations(prefix: str = "lowering: "):
    """The channel lemma, and FIFO pairing from it: the k-th send and the k-th receive are
    one transfer event (so one payload), and the counts are equal."""
    return lowering_obligations(("matching",), prefix)


def deadlock_obligations(prefix: str = "lowering: "):
    """``fin = event`` meets the verifier's deadlock rule on every rank pair."""
    return lowering_obligations(("deadlock",), prefix)


def lowering_obligations(which=("matching", "deadlock"), prefix: str = "lowering: "):
    """The shared lemmas once, then the matching and/or deadlock parts."""
    yield from sorted_filter_kit(prefix)
    yield from _channel_lemma(prefix)
    if "matching" in which:
        yield from _matching(prefix)
    if "deadlock" in which:
        yield from _deadlock(prefix)


def _matching(prefix: str):
    e, ea, eb, ta, tb, chan, hyps, ex = _setup()
    flt = filter_fn()
    payload = z3.Function("payload", IntS, IntS)
    sa, sb = flt(chan, ea), flt(chan, eb)
    k = z3.Int("k")
    yield Obligation(f"{prefix}FIFO pairing: equal counts, and the k-th send and k-th "
                     f"receive carry one payload",
                     z3.And(z3.Length(sa) == z3.Length(sb), z3.Implies(
                         z3.And(0 <= k, k < z3.Length(sa)),
                         payload(sa[k]) == payload(sb[k]))),
                     hyps, lemmas=(sa == sb,), example=ex)


def _deadlock(prefix: str):
    e, ea, eb, ta, tb, chan, hyps, ex = _setup()
    srt, allgt = sorted_fn(), allgt_fn()
    s, y, t = z3.Const("s", IntSeq), z3.Int("y"), z3.Const("t", IntSeq)
    i, j = z3.Ints("i j")
    # a strictly sorted list increases at every position: induction on the list, the
    # step split on the position (the hypothesis instantiated at i - 1)
    inc = lambda u, i_: z3.Implies(z3.And(srt(u), 0 <= i_, i_ + 1 < z3.Length(u)),
                                   u[i_] < u[i_ + 1])
    nil = empty(IntSeq)
    yield Obligation(f"{prefix}a sorted list increases: base", inc(nil, i))
    rest = z3.SubSeq(t, 1, z3.Length(t) - 1)
    split = z3.Implies(z3.Length(t) > 0, t == cons(t[0], rest))
    yield Obligation(f"{prefix}a non-empty list is its head and its rest", split)
    head_below = z3.Implies(z3.And(allgt(y, t), z3.Length(t) > 0), y < t[0])
    yield Obligation(f"{prefix}allgt bounds the first element", head_below,
                     lemmas=(u_allgt(y, t[0], rest), split))
    shift = z3.And((cons(y, t))[i] == z3.If(i == 0, y, t[i - 1]),
                   (cons(y, t))[i + 1] == t[i])
    yield Obligation(f"{prefix}positions of y::t", z3.Implies(
        z3.And(0 <= i, i + 1 < z3.Length(cons(y, t))), shift))
    for label, case in (("position 0", i == 0), ("later positions", i > 0)):
        yield Obligation(f"{prefix}a sorted list increases: step, {label}",
                         inc(cons(y, t), i), (case, inc(t, i - 1)),
                         lemmas=(u_sorted(y, t), head_below, z3.Implies(
                             z3.And(0 <= i, i + 1 < z3.Length(cons(y, t))), shift)),
                         example=((t, nil), (i, z3.IntVal(0 if label == "position 0" else 1))))
    lemma_inc = z3.ForAll([s, i], inc(s, i))
    sorted_ranks = tuple(z3.ForAll([i], inc(q, i)) for q in (ea, eb))
    yield Obligation(f"{prefix}fin strictly increases along each rank (so never decreases)",
                     z3.And(*sorted_ranks), hyps, lemmas=(lemma_inc,), example=ex)
    # partners: the k-th channel event, at position i on a and j on b
    flt = filter_fn()
    sa = flt(chan, ea)
    k = z3.Int("k")
    partners = z3.And(0 <= k, k < z3.Length(sa), 0 <= i, i < z3.Length(ea), ea[i] == sa[k],
                      0 <= j, j < z3.Length(eb), eb[j] == flt(chan, eb)[k])
    post_a = z3.If(i == 0, 0, ea[i - 1])
    post_b = z3.If(j == 0, 0, eb[j - 1])
    yield Obligation(f"{prefix}FIFO partners have one completion time, and each end "
                     f"completes after the other end was posted",
                     z3.Implies(partners, z3.And(ea[i] == eb[j], post_b <= ea[i],
                                                 post_a <= eb[j])),
                     hyps, lemmas=(sa == flt(chan, eb), *sorted_ranks),
                     example=ex)


def family_laws(prefix: str, title: str, scope: str, flow, **extra) -> tuple:
    """A family's matching and deadlock laws (``family``, ``covers``: ``extra``): the
    obligations above and ``flow()``, the family's proof that its data-flow graph is
    acyclic (the one hypothesis)."""
    matching = law(f"{prefix}_matching", f"{title}: the lowered plan pairs every send with "
                   "the receive of the same payload, FIFO per channel, none left over", scope,
                   property="matching", **extra)(lambda: [*matching_obligations(), *flow()])
    deadlock = law(f"{prefix}_deadlock", f"{title}: the lowered plan runs to completion under "
                   "rendezvous (completion-time witness: each op's place in lowering's event "
                   "order)", scope, property="deadlock",
                   **extra)(lambda: [*deadlock_obligations(), *flow()])
    return matching, deadlock
