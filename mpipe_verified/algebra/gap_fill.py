"""The gap filler of ``transpose``: where each microbatch's segment work goes in the body's
programs (``Weaver``), for the owners an ownership rule picks or lists.

The operator times the body with its own estimate of the costs
(``body_forward`` per forward, ``body_backward`` per backward, half of it per ``I``/``W``;
a segment forward costs ``costs[mb]``, its backward twice and its recompute once that)
and lists every rank's idle gaps. A source's first forward delays the whole body (nothing
can start before it), so the timeline is shifted by its cost first. Then, microbatch by
microbatch in order of need:

- a source forward goes into the owner's *latest* idle gap that ends before rank 0 needs
  the output (``F(0, mb)``'s start), so warmup bubbles fill first and an output waits as
  little as possible; failing that it is pushed in just early enough (before the first op
  that finishes after its latest useful start), delaying that rank;
- a backward (``owner`` mode), a recompute (``recompute`` mode: the home rank re-runs the
  forward from the shipped input) or a sink's work goes into the *earliest* gap after its
  input arrives (a recompute between the body's first-stage backwards of the previous
  microbatch and of its own, so recomputed activations do not pile up),
  or, failing that, right after the body op it follows on the home rank, or at the end of
  another owner's program or pushed in after its input arrives, whichever delays less;
- on the home rank itself, with ``inline`` ownership, everything stays adjacent to the
  body op it feeds or follows (the baseline a real framework runs).

Work pushed into a rank delays that rank's later ops in the estimate (``_Rank.delay_from``).
The positions follow estimates only: the woven program is an ordinary schedule, lowered
and verified like any other, and ``sim.simulate`` times it with the spec's real costs.
Safety does not rest on the estimate: every position is bounded by the body's own times
(``_Rank.start0``): a forward never goes after an op that starts once the body op it
feeds has finished, a backward (or a sink's work) never before an op that starts before
its input was produced. So no inserted op waits, directly or through other ranks, on
something that waits on it, and the woven program is acyclic whenever the body is.
"""

from __future__ import annotations

import bisect
import math

from ..cost import CostModel
from ..ir import (BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, SOURCE, Compute, Op, Schedule,
                  computes_of)
from .placement import HOME, MOVED, Problem, Work

EPS = 1e-9  # times closer than this are equal (the estimate sums floats)


def _index_of(gap) -> float:
    return gap[2]


def _end_of(gap) -> float:
    return gap[1] + EPS


class _Lengths:
    """A max-tree over gap lengths: ``first_at_least(i, c)`` is the first index at or
    after ``i`` whose length is at least ``c`` (the count when there is none), in
    O(log n); building it is O(n)."""

    def __init__(self, lengths: list[float]) -> None:
        n = 1
        while n < len(lengths):
            n *= 2
        tree = [-math.inf] * (2 * n)
        tree[n:n + len(lengths)] = lengths
        for k in range(n - 1, 0, -1):
            tree[k] = max(tree[2 * k], tree[2 * k + 1])
        self.n, self.count, self.tree = n, len(lengths), tree

    def first_at_least(self, i: int, c: float) -> int:
        tree, n = self.tree, self.n
        if i >= self.count:
            return self.count
        k = i + n
        while tree[k] < c:  # climb to the next subtree on the right
            while k & 1:
                k >>= 1
            if k == 0:
                return self.count
            k += 1
        while k < n:  # descend to its first leaf holding at least c
            k = 2 * k if tree[2 * k] >= c else 2 * k + 1
        return min(k - n, self.count)


class _Rank:
    """One rank's estimated timeline. ``start0``/``finish0``: the body's times (fixed;
    every safety bound on a position is taken from them); ``start``/``finish``: the
    estimate after the work pushed in so far (it delays every later op of the rank);
    ``gaps``: idle ``[start, end, index]`` of the estimate (work placed in a gap goes
    before program position ``index``; the last gap is open-ended)."""

    def __init__(self, starts, finishes, shift: float) -> None:
        self.start0 = [s + shift for s in starts]
        self.finish0 = [f + shift for f in finishes]
        self.start, self.finish = list(self.start0), list(self.finish0)
        self.gaps: list[list[float]] = []
        t = 0.0
        for i, (s, f) in enumerate(zip(self.start, self.finish)):
            if s > t + EPS:
                self.gaps.append([t, s, i])
            t = max(t, f)
        self.end = t
        self.gaps.append([t, math.inf, len(self.start)])
        self.pushed = 0.0  # estimated delay this rank already took from pushed-in work
        self.load = 0.0  # segment work placed here
        self._lengths: _Lengths | None = None  # gap lengths (a shift keeps them)

    def first_start0_at_or_after(self, t: float) -> int:
        """The first position whose op starts (in the body's times) at or after ``t``:
        no op from there on can be a prerequisite of anything that finished by ``t``."""
        return bisect.bisect_left(self.start0, t - EPS)  # a rank's starts never decrease

    def fit(self, cost: float, ready: float, deadline: float, horizon: float,
            latest: bool, lo: int, hi: int):
        """The best gap at a position in ``lo..hi`` that holds ``cost`` after ``ready``
        and finishing by ``deadline``: ``(start, gap, overrun)``, where ``overrun`` is how
        far the work runs past ``horizon`` in the open-ended last gap; None if none fits.
        ``latest`` prefers the latest such gap (else the earliest)."""
        gaps = self.gaps  # in time order: ``a``, ``b`` and ``index`` never decrease
        first = max(bisect.bisect_left(gaps, lo, key=_index_of),  # b too early: no fit
                    bisect.bisect_left(gaps, ready + cost, key=_end_of))
        last = bisect.bisect_right(gaps, hi, key=_index_of)
        if not latest:
            return self._earliest(cost, ready, deadline, horizon, first, last)
        fallback = None  # the open-ended gap when it overruns: only if nothing else fits
        for i in range(last - 1, first - 1, -1):
            a, b, _ = gap = gaps[i]
            s = max(a, ready)
            if s + cost > min(b, deadline) + EPS:
                continue
            overrun = max(0.0, s + cost - horizon) if b == math.inf else 0.0
            if overrun > 0:
                fallback = (s, gap, overrun)
                continue
            return (s, gap, overrun)
        return fallback

    def _earliest(self, cost, ready, deadline, horizon, i: int, last: int):
        """``fit``'s earliest gap among ``gaps[i:last]``: a gap shorter than ``cost``
        cannot hold it, so the scan jumps over runs of short gaps (``_Lengths``)."""
        while i < last:
            a, b, _ = gap = self.gaps[i]
            s = max(a, ready)
            if s + cost <= min(b, deadline) + EPS:
                return (s, gap, max(0.0, s + cost - horizon) if b == math.inf else 0.0)
            if self._lengths is None:
                self._lengths = _Lengths([g[1] - g[0] for g in self.gaps])
            i = self._lengths.first_at_least(i + 1, cost - 2 * EPS)
        return None

    def push_before_finish_after(self, t: float, hi: int) -> tuple[int, float]:
        """Position (at most ``hi``) before the first op that finishes after ``t``, and
        the time the inserted work starts (when the previous op ends)."""
        i = min(bisect.bisect_right(self.finish, t + EPS), hi)
        return i, (self.finish[i - 1] if i else 0.0)

    def push_at_or_after(self, t: float, lo: int) -> tuple[int, float]:
        """Position (at least ``lo``) before the first op that starts at or after ``t``."""
        i = max(bisect.bisect_left(self.start, t - EPS), lo)
        return i, max(t, self.finish[i - 1] if i else 0.0)

    def take(self, gap, start: float, cost: float) -> None:
        """Use ``[start, start + cost]`` of ``gap``: what is left on either side stays."""
        a, b, index = gap
        at = self.gaps.index(gap)
        pieces = [[a, start, index]] if start > a + EPS else []
        if b - (start + cost) > EPS:
            pieces.append([start + cost, b, index])
        self.gaps[at:at + 1] = pieces
        self._lengths = None  # rebuilt when next needed

    def delay_from(self, index: int, by: float) -> None:
        """Work pushed in before position ``index`` delays every op from there on."""
        for i in range(index, len(self.start)):
            self.start[i] += by
            self.finish[i] += by
        for gap in self.gaps:
            if gap[2] >= index:
                gap[0] += by
                gap[1] += by


class Weaver:
    """Chooses owners and positions for one ``Transpose`` term ``t`` (see the module
    docstring) under ``ownership``, its own or the round-robin it is compared with."""

    def __init__(self, t, body: Schedule, timing, cost: CostModel, home: int,
                 ownership: str) -> None:
        self.t, self.body, self.home = t, body, home
        self.seg = cost.segment(t.segment)  # the segment's forward/backward/recompute
        self.ownership = ownership
        self.p, self.m = body.num_ranks, body.num_microbatches
        self.position = {c: (r, i) for r, prog in enumerate(body.programs)
                         for i, op in enumerate(prog) for c in computes_of(op)}
        last = body.placement.num_stages - 1
        if t.side == SOURCE:
            self.order = sorted(range(self.m), key=lambda mb: (self._start_of(
                timing, Compute(FORWARD, 0, mb)), mb))
            shift = self.seg.forward(self.order[0]) if self.m else 0.0
        else:
            self.order = sorted(range(self.m), key=lambda mb: (self._start_of(
                timing, Compute(FORWARD, last, mb)), mb))
            shift = 0.0
        self.ranks = [_Rank(timing.start[r], timing.finish[r], shift) for r in range(self.p)]
        self.horizon = max((rk.end for rk in self.ranks), default=0.0)
        self.last = last
        # (rank, position) -> [(where, estimated start, sequence, op)], see ``_insert``
        self.inserted: dict[tuple[int, int], list[tuple[int, float, float, Op]]] = {}
        self._seq = 0

    def _start_of(self, timing, c: Compute) -> float:
        r, i = self.position[c]
        return timing.start[r][i]

    def _time(self, c: Compute, which: str) -> float:
        """The estimated start or finish of a body op (pushed-in work included)."""
        r, i = self.position[c]
        rk = self.ranks[r]
        return rk.start[i] if which == "start" else rk.finish[i]

    def _time0(self, c: Compute) -> float:
        """The finish of a body op in the body's own times (for safety bounds)."""
        r, i = self.position[c]
        return self.ranks[r].finish0[i]

    def _grad_op(self, mb: int) -> Compute:
        b = Compute(BACKWARD, 0, mb)
        return b if b in self.position else Compute(INPUT_GRAD, 0, mb)

    def _insert(self, rank: int, index: int, at: float, ops, where: int = 1) -> None:
        """Put ``ops`` before program position ``index`` of ``rank``. Ops at one position
        run in the order: right after the previous body op (``where`` 0), placed in the
        gap or pushed in (1, by estimated start time), right before the next body op (2)."""
        for op in ops:
            self._seq += 1
            self.inserted.setdefault((rank, index), []).append((where, at, self._seq, op))

    # ---------------------------------------------------------------- ownership

    def _fixed_owner(self, mb: int) -> int | None:
        own = self.ownership
        if self.t.owners:  # ownership "given" (a term lists owners with it only)
            return self.t.owners[mb]
        if own == "inline":
            return self.home
        if own == "full":
            return mb % self.p
        if own == "min":
            nt = min(self.p, self.m)
            chosen = range(nt) if self.t.side == SOURCE else range(self.m - nt, self.m)
            rr = {x: j % self.p for j, x in enumerate(chosen)}
            return rr.get(mb, self.home)
        return None  # cost-aware: chosen by place()

    def problem(self) -> Problem:
        """The owner choice as a ``placement.Problem`` (see ``Transpose.placement_problem``):
        each rank's idle time in the body's (shifted) timeline up to the horizon; a source
        forward due when the body's first forward of its microbatch starts, an owner-mode
        backward released when the body's first-stage backward of it ends (a recompute
        mode's central backward likewise, on the home rank, and its recompute due when
        that backward starts, on the home rank when another rank owns the forward); a
        sink's work released when the body's last forward of it ends."""
        seg, work = self.seg, []
        for mb in range(self.m):
            if self.t.side == SOURCE:
                r, i = self.position[Compute(FORWARD, 0, mb)]
                work.append(Work(mb, seg.forward(mb), True, self.ranks[r].start0[i]))
                grad = self.position[self._grad_op(mb)]
                begun, done = (self.ranks[grad[0]].start0[grad[1]],
                               self.ranks[grad[0]].finish0[grad[1]])
                if self.t.mode == "owner":
                    work.append(Work(mb, seg.backward(mb), False, done))
                elif self.t.mode == "recompute":
                    work.append(Work(mb, seg.recompute(mb), True, begun, MOVED))
                    work.append(Work(mb, seg.backward(mb), False, done, HOME))
            else:
                r, i = self.position[Compute(FORWARD, self.last, mb)]
                c = seg.forward(mb) + (seg.backward(mb) if self.t.trainable else 0.0)
                work.append(Work(mb, c, False, self.ranks[r].finish0[i]))
        h = self.horizon
        idle = tuple(tuple((a, min(b, h)) for a, b, _ in rk.gaps if min(b, h) > a)
                     for rk in self.ranks)
        return Problem(self.p, self.m, self.home, idle, h, tuple(work))

    def place(self) -> tuple[int, ...]:
        owners = [self.home] * self.m
        for mb in self.order:
            fixed = self._fixed_owner(mb)
            candidates = [fixed] if fixed is not None else range(self.p)
            options = []
            for r in candidates:
                plan = self._plan_owner(mb, r)
                penalty = plan[0]
                rk = self.ranks[r]
                options.append(((rk.pushed + penalty, penalty, rk.load, r != self.home, r),
                                r, plan))
            _, owner, plan = min(options, key=lambda o: o[0])
            self._commit(owner, plan)
            owners[mb] = owner
        if self.t.side == SOURCE and self.t.mode == "recompute":
            for mb in self.order:  # the home rank runs every backward
                self._commit(self.home, (0.0, [self._backward_step(mb, self.home)]))
            for mb in self.order:
                if owners[mb] != self.home:
                    self._place_recompute(mb)
        return tuple(owners)

    # ---------------------------------------------------------------- one microbatch

    def _plan_owner(self, mb: int, r: int):
        """``(penalty, steps)``: the estimated delay of giving ``mb``'s work to rank
        ``r`` and its placements (each as ``_place_one`` returns it)."""
        seg, c = self.t.segment, self.seg.forward(mb)
        trainable = self.t.trainable
        if self.t.side == SOURCE:
            fwd = Compute(FORWARD, 0, mb, seg)
            need = self._time(Compute(FORWARD, 0, mb), "start")
            # no op that starts after F(0, mb) finishes may come before the forward
            hi = self.ranks[r].first_start0_at_or_after(self._time0(Compute(FORWARD, 0, mb)))
            steps = [self._place_one(r, c, 0.0, need, latest=True, ops=(fwd,),
                                     adjacent=self.position[Compute(FORWARD, 0, mb)],
                                     adjacent_after=False, hi=hi)]
            if self.t.mode == "owner":
                steps.append(self._backward_step(mb, r))
        else:
            ops = (Compute(FORWARD, 0, mb, seg),) + (
                (Compute(BACKWARD, 0, mb, seg),) if trainable else ())
            cost = c + self.seg.backward(mb) if trainable else c
            producer = Compute(FORWARD, self.last, mb)
            ready = self._time(producer, "finish")
            lo = self.ranks[r].first_start0_at_or_after(self._time0(producer))
            steps = [self._place_one(r, cost, ready, math.inf, latest=False, ops=ops,
                                     adjacent=self.position[producer], adjacent_after=True,
                                     lo=lo)]
        return sum(s[0] for s in steps), steps

    def _backward_step(self, mb: int, r: int):
        """A source backward of ``mb`` on rank ``r``, after the body's first-stage
        backward (or input gradient) of ``mb``."""
        grad = self._grad_op(mb)
        lo = self.ranks[r].first_start0_at_or_after(self._time0(grad))
        return self._place_one(r, self.seg.backward(mb), self._time(grad, "finish"),
                               math.inf, latest=False,
                               ops=(Compute(BACKWARD, 0, mb, self.t.segment),),
                               adjacent=self.position[grad], adjacent_after=True, lo=lo)

    def _place_one(self, r: int, cost: float, ready: float, deadline: float, latest: bool,
                   ops, adjacent: tuple[int, int], adjacent_after: bool,
                   lo: int = 0, hi: int | None = None):
        """Where ``ops`` (``cost`` in all) go on rank ``r``: ``(penalty, r, gap, index,
        start, cost, ops, where)`` (``where``: see ``_insert``), at a position in
        ``lo..hi`` (bounds from the body's times that keep the program acyclic).
        ``adjacent`` is the body op they feed (or follow): on that op's rank, the fallback
        (and, with inline ownership, the only choice) is right next to it."""
        rk = self.ranks[r]
        hi = len(rk.start) if hi is None else hi
        adj_rank, adj_index = adjacent
        if r == adj_rank:
            index = adj_index + 1 if adjacent_after else adj_index
            at = rk.finish[adj_index] if adjacent_after else rk.start[adj_index] - cost
            adj = (cost, r, None, index, at, cost, ops, 0 if adjacent_after else 2)
            if self.ownership == "inline":
                return adj
        found = rk.fit(cost, ready, deadline, self.horizon, latest, lo, hi)
        if found is not None and found[2] <= 0:
            s, gap, _ = found
            return (0.0, r, gap, int(gap[2]), s, cost, ops, 1)
        options = []
        if r == adj_rank:
            options.append(adj)
        if found is not None:  # the open-ended last gap, running past the horizon
            s, gap, overrun = found
            options.append((overrun, r, gap, int(gap[2]), s, cost, ops, 1))
        if r != adj_rank:
            if deadline < math.inf:
                index, s = rk.push_before_finish_after(deadline - cost, hi)
            else:
                index, s = rk.push_at_or_after(ready, lo)
            options.append((cost, r, None, index, s, cost, ops, 1))
        return min(options, key=lambda o: (o[0], o[3]))

    def _commit(self, owner: int, plan) -> None:
        _, steps = plan
        for penalty, r, gap, index, start, cost, ops, where in steps:
            rk = self.ranks[r]
            if gap is not None and gap not in rk.gaps:  # split by an earlier step
                gap = next((g for g in rk.gaps if g[0] <= start + EPS
                            and start + cost <= g[1] + EPS), None)
            if gap is not None:
                rk.take(gap, start, cost)
            else:  # pushed in (or next to its body op): what follows runs later
                rk.delay_from(index, cost)
                for (rank, i), items in self.inserted.items():
                    if rank == r and i > index:
                        items[:] = [(w, at + cost, seq, op) for w, at, seq, op in items]
            rk.pushed += penalty
            rk.load += cost
            self._insert(r, index, start, ops, where)

    def _place_recompute(self, mb: int) -> None:
        """Central recompute on the home rank: ``R`` in an idle gap after the input's
        arrival (the owner's forward) and between the body's first-stage backwards of the
        previous microbatch and of ``mb`` (so at most one recomputed activation waits for
        its backward), else right before the segment backward (which ``place`` put after
        that body op)."""
        seg, c = self.t.segment, self.seg.forward(mb)
        rk = self.ranks[self.home]
        grad = self._grad_op(mb)
        at = self.position[grad][1]
        before = [self.position[self._grad_op(k)][1] for k in range(self.m)]
        lo = max((i for i in before if i < at), default=-1) + 1
        fwd_done = next(t for items in self.inserted.values()
                        for _, t, _, op in items if op == Compute(FORWARD, 0, mb, seg)) + c
        r_op = Compute(RECOMPUTE, 0, mb, seg)
        found = rk.fit(self.seg.recompute(mb), fwd_done, self._time(grad, "start"),
                       self.horizon, latest=False, lo=lo, hi=at)
        if found is not None and found[2] <= 0:
            s, gap, _ = found
            rk.take(gap, s, self.seg.recompute(mb))
            self._insert(self.home, int(gap[2]), s, (r_op,))
            return
        b_op = Compute(BACKWARD, 0, mb, seg)
        for items in self.inserted.values():
            for n, (where, at, seq, op) in enumerate(items):
                if op == b_op:
                    items.insert(n, (where, at - EPS, seq - 0.5, r_op))
                    return

    def programs(self) -> list[list[Op]]:
        out = []
        for r, prog in enumerate(self.body.programs):
            row: list[Op] = []
            for i in range(len(prog) + 1):
                row.extend(op for *_, op in sorted(self.inserted.get((r, i), ()),
                                                   key=lambda x: x[:3]))
                if i < len(prog):
                    row.append(prog[i])
            out.append(row)
        return out
