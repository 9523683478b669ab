"""The verification kernel: the execution semantics read a second time, as rules over one
plan, and the proof obligations those rules generate, discharged by Z3.

Trusted base of a VERIFIED: this file, the reader that built the plan, and Z3. The kernel
imports nothing of the package but the IR's value types (``ir``), so a bug in the
semantics module, the fast passes or the lowering can make a verdict undecided but never
make a wrong plan verified. The plan is read once into integer columns (``_Rules``), and
each rule is an array expression over them. ``prove(plan, witness, ...)`` generates every
obligation from the plan alone; the untrusted *witness* only supplies numbers:

- completeness: each required unit of work (one ``F``; one ``B`` or one ``I`` and one
  ``W``, none for a frozen segment or a ``forward_only`` plan; one ``R`` where a recompute
  is due) counted on the rank that owns it; no op outside the chain; the cut well formed;
  each collective the cut requires (``_Rules.required_collectives``) exactly once on
  every rank that needs it;
- dependency: each input of each op (``_Rules.tokens``) was produced earlier on its rank,
  at the position the witness names;
- matching: the k-th send from a to b meets the k-th receive at b from a, equal counts,
  equal payloads; every collective call well formed and agreeing with its instance;
- deadlock: the witness gives each comm step a time ``fin``, posted at the ``fin`` of
  the comm step before it (``post``, 0 first): ``post <= fin``, each blocking end has a
  partner and completes after it was posted, each collective after every member posted
  it. If such times exist no run gets stuck: a stuck op with the least ``fin`` would wait
  on a partner posted after another stuck op completed, which completes earlier still;
- memory: the witness's levels start at the static part, each is the last plus the
  step's allocations minus its frees (``_moves``), every step's peak within the reported
  peak, which is reached and within the limit.

Each obligation is a numeric fact for a linear template. The facts of a class are
sorted (an int64 class outside ``confirm`` keeps each distinct fact once) and compressed
exactly into affine runs; Z3 is asked
whether some point of some run violates its template (``unsat`` proves the property,
``sat`` names a violated fact, ``unknown`` is never success). ``confirm`` checks a claimed
counterexample from the plan alone.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import defaultdict
from fractions import Fraction
from functools import cached_property
from itertools import chain, repeat
import operator
from operator import attrgetter

import attrs
import numpy as np
import z3

from .ir import (PROPERTIES, SINK, SOURCE, Collective, Compute, Group, Idle, Leaf, Marker,
                 Overlap, Payload, Plan, Recv, Send)

CERTIFICATE_FORMAT = "mpipe-certificate/1"

# ---------------------------------------------------------------- the rules

F, B, I, W, R, SEND, RECV, COLL = range(8)  # a member's kind; F..R are compute kinds
# token kinds, numbered in the order of their names (so codes sort as the names do)
GRAD, INPUT, OUT, PARAMS, STORED, WDONE, WREADY = range(7)
_CARRIED = {"act": OUT, "grad": GRAD, "input": INPUT}  # what a payload carries
_STEP = {Compute: 0, Overlap: 1, Send: 2, Recv: 3, Group: 4, Collective: 5, Idle: 6, Marker: 6}
_COMM = (2, 3, 4, 5)  # the steps that can block


def _dense(x: np.ndarray) -> np.ndarray:
    """Each value's rank among the distinct values: int64 from 0, order kept."""
    return np.unique(x, return_inverse=True)[1].reshape(-1)


def _distinct(key: np.ndarray) -> np.ndarray:
    """One row of each distinct value of ``key`` (ints >= 0, as ``_key`` makes them), in
    the order of the values."""
    span = int(key.max()) + 1
    if span > 4 * len(key):
        return np.unique(key, return_index=True)[1]
    last = np.full(span, -1, np.int64)
    last[key] = np.arange(len(key))
    return last[last >= 0]


def _key(*cols) -> np.ndarray:
    """One int64 per row of the columns (any ints: -1, huge, exact), ordered as the rows
    are lexicographically, so two rows share a key only when they are equal. Each column
    is made digits first (``_digits``), so every key is in ``0 .. BOUND - 1``: the keys so
    far and the digits are renumbered densely (order kept) where a product would reach
    ``BOUND``."""
    key = _digits(cols[0])[0]
    for col in cols[1:]:
        col, span = _digits(col)
        if len(key) and (int(key.max()) + 1) * span >= BOUND:
            key, col = _dense(key), _dense(col)
            span = int(col.max()) + 1
        key = key * span + col
    return key


def _digits(col: np.ndarray) -> tuple:
    """``(digits, span)``: ``col``'s values as int64 ``0 <= digit < span <= BOUND``, in the
    same order: less the least value, or renumbered densely where they span ``BOUND`` or
    more."""
    if not len(col):
        return col.astype(np.int64), 1
    low, high = int(col.min()), int(col.max())
    if high - low >= BOUND:
        col = _dense(col)
        return col, int(col.max()) + 1
    return (col - low if low else col).astype(np.int64, copy=False), high - low + 1


class _Rules:
    """The plan as columns, and the rules over them.

    Members: every step's ops (an overlapped step's computes, a group's sends and
    receives, else the step itself; idle steps and markers hold none), a row each in
    program order: ``pos`` its step (rank ``r``'s steps are numbered from ``base[r]``),
    ``rank``, ``kind`` (``F B I W R SEND RECV COLL``) and a compute op's ``name``,
    ``stage`` and ``mb``; ``comm`` lists the sends' rows, then the receives', and ``p2p``
    what they carry. Names are numbered in sorted order ("" first); stages, mbs and peers
    are the plan's numbers (int64 when all are below ``BOUND``, else Python's)."""

    def __init__(self, plan: Plan) -> None:
        self.p, self.m, self.forward_only = plan.num_ranks, plan.num_microbatches, plan.forward_only
        self.where = np.array(plan.placement.stage_to_rank + (0,), np.int64)
        self.stages, self.cut = len(self.where) - 1, plan.cut.segments
        self.units = [("", s) for s in range(self.stages)] + [(s.name, 0) for s in self.cut]
        self.segs = {s.name: s for s in self.cut}
        self._read(plan)

    def cut_ok(self) -> bool:
        """Distinct, named segments; one forward (and backward) rank per microbatch, each
        an existing rank; the home an existing rank."""
        ranks = range(self.p)
        return len(self.segs) == len(self.cut) and all(
            type(s.name) is str and s.name and len(s.forward_rank) == self.m
            and s.home in ranks
            and all(r in ranks for r in s.forward_rank)
            and (s.backward_rank is None or (len(s.backward_rank) == self.m
                                             and all(r in ranks for r in s.backward_rank)))
            for s in self.cut)

    def _read(self, plan: Plan) -> None:
        steps = list(chain.from_iterable(plan.programs))
        self.base = np.cumsum([0] + [len(prog) for prog in plan.programs])
        self.step = step = _types(steps)
        ops, pos = steps, np.arange(len(steps))
        many = np.flatnonzero((step == 1) | (step == 4))
        if len(many):  # an overlapped step or a group: a row per member
            size = np.ones(len(steps), np.int64)
            size[many] = [len(steps[k].ops) for k in many.tolist()]
            ops = list(chain.from_iterable(op.ops if t in (1, 4) else (op,) for op, t in
                                           zip(steps, step.tolist())))
            pos, step = np.repeat(pos, size), _types(ops)
        keep = np.flatnonzero(step < 6)  # idle steps and markers hold nothing
        if len(keep) < len(ops):
            ops, pos, step = _pick(ops, keep), pos[keep], step[keep]
        self.rank_of = np.repeat(np.arange(self.p), np.diff(self.base))
        self.ops, self.pos, self.rank, n = ops, pos, self.rank_of[pos], len(ops)
        at = [np.flatnonzero(step == code) for code in (0, 2, 3, 5)]
        self.comm, self.sends = np.concatenate(at[1:3]), len(at[1])  # sends, then receives
        comp, coll = _pick(ops, at[0]), _pick(ops, at[3])
        c = [list(map(attrgetter(a), comp)) for a in ("kind", "stage", "mb", "segment")]
        tags = [op.tag.partition(":")[2] for op in coll]
        self.names = sorted({"", *(x for x in self.segs if type(x) is str), *c[3], *tags})
        code = {x: k for k, x in enumerate(self.names)}
        self.kind, self.name = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.kind[at[0]], self.kind[at[1]], self.kind[at[2]], self.kind[at[3]] = (
            _ints(map(_KIND.__getitem__, c[0])), SEND, RECV, COLL)
        self.name[at[0]], self.name[at[3]] = (_ints(map(code.__getitem__, x)) for x in (c[3], tags))
        self.stage, self.mb = (_scatter(n, at[0], _column(x)) for x in c[1:3])
        self.body = code[""]
        if self.cut_ok():
            self._cut_columns()

    @cached_property
    def p2p(self) -> tuple:
        """Per send and receive (``comm`` order): its payload, the peer, and what the
        payload carries: token kind, name (text), stage, mb."""
        ops = _pick(self.ops, self.comm)
        payloads = list(map(attrgetter("payload"), ops))
        kind, stage, mb, name = (list(map(attrgetter(a), payloads))
                                 for a in ("kind", "stage", "mb", "segment"))
        peer = [*map(attrgetter("dst"), ops[:self.sends]),
                *map(attrgetter("src"), ops[self.sends:])]
        return (payloads, _column(peer), _ints(map(_CARRIED.__getitem__, kind)), name,
                _column(stage), _column(mb))

    def _cut_columns(self) -> None:
        """Per name code: its segment's index in the cut (-1: the body, or a name the cut
        lacks, which reads as body work and is stray), side, home; per segment and mb,
        the forward and backward ranks (-1: frozen)."""
        segs, w = [self.segs.get(x) for x in self.names], max(self.m, 1) if self.cut else 1
        self.seg = np.array([-1 if s is None else self.cut.index(s) for s in segs], np.int64)
        attr = lambda f: np.array([f(s) for s in self.cut] + [0], np.int64)  # noqa: E731
        self.source, self.sink = attr(lambda s: s.side == SOURCE), attr(lambda s: s.side == SINK)
        self.trainable, self.home = attr(lambda s: s.backward_rank is not None), attr(
            lambda s: s.home)
        pad = (-1,) * (w - self.m)
        self.fwd = np.array([s.forward_rank + pad for s in self.cut] + [(-1,) * w], np.int64)
        self.bwd = np.array([(s.backward_rank or (-1,) * self.m) + pad for s in self.cut]
                            + [(-1,) * w], np.int64)
        self.mbix = (np.where(self.mb < self.m, self.mb, 0) if self.cut else 0 * self.mb).astype(
            np.int64)

    @cached_property
    def tokens(self) -> tuple:
        """``(need, need kind, made)``: ``need`` and ``made`` list ``(row, token code)`` per
        input and output of each member, ``need`` by step, then token (sorted inputs):
        - a forward of the body needs the previous stage's output (at stage 0: each
          source's output); a backward (``B`` or ``I``) its stored activation and the
          next stage's gradient (none at the last stage); ``W`` its ``I``'s weight
          gradient (``wgrad_ready``); ``R`` its shipped input;
        - a segment's forward (or ``R``) also needs the broadcast parameters when it is
          trainable and run off home; a sink's forward the body's last output; a
          source's backward the body's first-stage gradient;
        - a send needs what it carries; the all-reduce ``grads:NAME`` of a trainable
          segment (not in a forward-only plan) needs each local ``W`` (``wdone``);
        - ``F`` makes ``out``, ``stored`` (and ``input``, for a segment's), ``B`` makes
          ``grad`` and ``wdone``, ``I`` ``grad`` and ``wgrad_ready``, ``W`` ``wdone``,
          ``R`` ``stored``; a receive makes what it carries, the broadcast ``params:NAME``
          the parameters."""
        k, seg, c, (_, _, kind, names, stage, mb) = (
            self.kind, self.seg[self.name], self.comm, self.p2p)
        names = sorted({*self.names, *names})  # payloads' names too, in order
        code = {x: j for j, x in enumerate(names)}
        g = np.searchsorted(names, self.names)[self.name]
        g[c] = _ints(map(code.__getitem__, self.p2p[3]))
        s, b, tok = (_scatter(len(k), c, x, base) for x, base in
                     ((stage, self.stage), (mb, self.mb), (kind, np.zeros(len(k), np.int64))))
        body = code[""]
        comp, cut, bi, fr = k <= R, seg >= 0, (k == B) | (k == I), (k == F) | (k == R)
        main = comp & ~cut  # the body's work (and work of a segment the cut lacks)
        need = [(main & (k == F) & (s > 0), OUT, g, s - 1, b),
                *((main & (k == F) & (s == 0), OUT, code[x.name], 0, b)
                  for x in self.cut if x.side == SOURCE),
                (k == W, WREADY, g, s, b), (k == R, INPUT, g, s, b), (bi, STORED, g, s, b),
                (main & bi & (s < self.stages - 1), GRAD, g, s + 1, b),
                (cut & bi & (self.source[seg] == 1), GRAD, body, 0, b),
                (cut & (k == F) & (self.sink[seg] == 1), OUT, body, self.stages - 1, b),
                (cut & fr & (self.trainable[seg] == 1) & (self.rank != self.home[seg]),
                 PARAMS, g, 0, 0), (k == SEND, tok, g, s, b)]
        made = [(k == F, OUT, g, s, b), (k == F, STORED, g, s, b),
                ((k == F) & (g != body), INPUT, g, s, b), (bi, GRAD, g, s, b),
                ((k == B) | (k == W), WDONE, g, s, b), (k == I, WREADY, g, s, b),
                (k == R, STORED, g, s, b), (k == RECV, tok, g, s, b)]
        extra_need, extra_made = [], []
        for row in np.flatnonzero(k == COLL).tolist():
            op, rank = self.ops[row], int(self.rank[row])
            role, _, name = op.tag.partition(":")
            if (op.kind == "all_reduce" and role == "grads" and name in self.segs
                    and not self.forward_only):
                extra_need += [(row, WDONE, code[name], 0, mb) for mb, r in
                               enumerate(self.segs[name].backward_rank or ()) if r == rank]
            if op.kind == "broadcast" and role == "params":
                extra_made.append((row, PARAMS, code[name], 0, 0))
        parts = [_rows(need, extra_need), _rows(made, extra_made)]
        # one code per (kind, name, stage, mb), equal iff the tuples are (stage -1 too)
        token = np.split(_key(*(np.concatenate([x[c] for x in parts]) for c in range(1, 5))),
                         [len(parts[0][0])])
        nrow, mrow = parts[0][0], parts[1][0]
        order = np.argsort(_key(self.pos[nrow], token[0]), kind="stable")  # sorted inputs
        return (np.stack([nrow, token[0]])[:, order], parts[0][1][order],
                np.stack([mrow, token[1]]))

    @cached_property
    def pairs(self) -> tuple:
        """FIFO pairing by counting, over the sends and receives (``comm`` rows, each side
        in program order): per end, whether it is a send, its channel ``(src, dst)``, the
        channel coded as one int, its number ``k`` on its side of the channel, the other
        side's ``k``-th end (its place in ``comm``; -1 when that side has only
        ``count <= k``) and that side's count."""
        ends, peer = self.comm, self.p2p[1]
        send = self.kind[ends] == SEND
        src, dst = np.where(send, self.rank[ends], peer), np.where(send, peer, self.rank[ends])
        chan = _dense(_key(src, dst)) if len(ends) else ends  # a peer may be any int
        side = chan * 2 + send
        order = np.argsort(side, kind="stable")
        start = np.searchsorted(side[order], np.arange(2 * int(chan.max(initial=-1)) + 3))
        k = np.empty_like(ends)
        k[order] = np.arange(len(ends)) - start[side[order]]
        count = np.diff(start)[side ^ 1]
        partner = np.where(k < count, order[np.minimum(start[side ^ 1] + k, len(ends) - 1)], -1)
        return send, src, dst, chan, k, partner, count

    def owner(self) -> np.ndarray:
        """Per compute member, the rank that must run it (-1: none, it is not work of
        this plan): a body stage's rank (never for ``R``), a segment's forward rank for
        ``F``, its backward rank otherwise."""
        k, seg, s, b = self.kind, self.seg[self.name], self.stage, self.mb
        mb = self.mbix
        body = self.where[np.minimum(s, self.stages).astype(np.int64)]
        body = np.where((s < self.stages) & (k != R), body, -1)
        cut = np.where(k == F, self.fwd[seg, mb], self.bwd[seg, mb])
        return np.where(seg < 0, body, np.where((s == 0) & (b < self.m), cut, -1))

    def stores(self) -> np.ndarray:
        """Per member: a forward keeps its activation unless it is a segment's, run where
        no backward of it runs (a frozen segment, or a forward shipped to another rank's
        backward); ``R`` always keeps it; a forward-only plan keeps nothing."""
        k, seg, b = self.kind, self.seg[self.name], self.mb
        local = self.bwd[seg, self.mbix] == self.rank
        return ((k == R) | ((k == F) & ((seg < 0) | ((b < self.m) & local)))) & (
            not self.forward_only)

    def backward_due(self, seg) -> bool:
        """Does every unit of ``seg`` (None: the body) need one ``B``, or ``I`` and ``W``?"""
        return not self.forward_only and (seg is None or seg.backward_rank is not None)

    def recompute_due(self, seg, mb: int) -> bool:
        return (not self.forward_only and seg is not None and seg.recompute
                and seg.backward_rank is not None
                and seg.backward_rank[mb] != seg.forward_rank[mb])

    def required_collectives(self) -> dict:
        """``tag -> (kind, root, ranks that must call it)`` for every collective the cut
        requires."""
        out = {}
        for seg in self.cut:
            if seg.backward_rank is None:
                continue
            fwd = {seg.forward_rank[mb] for mb in range(self.m)}
            fwd |= {seg.backward_rank[mb] for mb in range(self.m) if self.recompute_due(seg, mb)}
            if fwd - {seg.home}:
                out["params:" + seg.name] = ("broadcast", seg.home, fwd | {seg.home})
            back = set() if self.forward_only else set(seg.backward_rank)
            if back - {seg.home}:
                out["grads:" + seg.name] = ("all_reduce", None, back | {seg.home})
        return out


_KIND = {x: k for k, x in enumerate("FBIWR")}


def _types(ops: list) -> np.ndarray:
    return np.fromiter(map(_STEP.__getitem__, map(type, ops)), np.int64, len(ops))


def _scatter(n: int, rows: np.ndarray, values: np.ndarray, base=None) -> np.ndarray:
    """``base`` (zeros of length ``n``) with ``values`` at ``rows``, in a dtype that holds
    both."""
    out = (np.zeros(n, np.int64) if base is None else base).astype(
        np.result_type(values, np.int64 if base is None else base))
    out[rows] = values
    return out


def _ints(values) -> np.ndarray:
    return np.fromiter(values, np.int64)


def _pick(items: list, rows: np.ndarray) -> list:
    return list(map(items.__getitem__, rows.tolist()))


def _rows(rules: list, extra: list) -> tuple:
    """``(row, kind, name, stage, mb)`` columns: for each rule ``(mask, kind, name, stage,
    mb)`` (arrays over the members, or one number for all), its rows where ``mask``
    holds; then the ``extra`` rows."""
    out = [[] for _ in range(5)]
    for mask, *cols in rules:
        rows = np.flatnonzero(mask)
        out[0].append(rows)
        for k, c in enumerate(cols, 1):
            out[k].append(c[rows] if isinstance(c, np.ndarray) else np.full(len(rows), c))
    for k, col in enumerate(zip(*extra) if extra else ()):
        out[k].append(np.array(col, np.int64))
    return (np.concatenate(out[0]).astype(np.int64), *map(np.concatenate, out[1:]))


_READ: list = [lambda: None, None]  # the plan read last (not kept alive), its rules


def _rules(plan: Plan) -> _Rules:
    """The plan's rules and columns, read once per (immutable) plan."""
    if _READ[0]() is not plan:
        _READ[:] = [weakref.ref(plan), _Rules(plan)]
    return _READ[1]


def read(plan: Plan) -> None:
    """Read ``plan`` into the kernel's columns now, transfers included (kept for the
    calls on this plan that follow)."""
    _rules(plan).p2p


# ---------------------------------------------------------------- obligations


class _Facts:
    """Facts grouped by ``(template, class)``. With ``where``, each fact also records the
    plan location it is about (for ``confirm``). ``count``: the facts added."""

    def __init__(self, where: bool = False) -> None:
        self.lanes: dict = defaultdict(list)
        self.where: list | None = [] if where else None
        self.count = 0

    def add(self, template: str, cls, *values, at=None) -> None:
        self.lanes[(template, cls)].append(values)
        self.count += 1
        if self.where is not None:
            self.where.append((at, template, values))

    def extend(self, template: str, cls, columns: list, classes=None, at=None) -> None:
        """One fact per row ``j`` of the equal-length ``columns`` (``_column`` arrays), in
        class ``(cls, classes[j])`` (one int per row), about the place ``at`` (or ``at(j)``).
        A class holds a set of facts: without ``where``, int64 facts are kept once each,
        in sorted order (so runs are long)."""
        keys = np.zeros(len(columns[0]), np.int64) if classes is None else classes
        columns = [_column(c) for c in columns]  # differences may leave it
        self.count += len(keys)
        if self.where is None and len(keys) and all(c.dtype == np.int64 for c in columns):
            order = _distinct(_key(keys, *columns))
        else:
            order = np.argsort(keys, kind="stable")
        for part in np.split(order, np.flatnonzero(np.diff(keys[order])) + 1) if len(keys) else ():
            rows = [c[part] for c in columns]
            lane = (np.column_stack(rows) if all(c.dtype == np.int64 for c in rows)
                    else list(zip(*(c.tolist() for c in rows))))
            self.lanes[(template, cls, int(keys[part[0]]), len(self.lanes))] = lane
            if self.where is not None:  # ``at``: a place, or the place of row j
                self.where += [(at(j) if callable(at) else at, template, tuple(x)) for j, x in
                               zip(part.tolist(), np.asarray(lane).tolist())]

    def flag(self, cls, ok: bool, at=None) -> None:
        self.add("one", cls, int(bool(ok)), at=at)


BOUND = 1 << 62


def _column(values, bound: int = BOUND) -> np.ndarray:
    """Exact numbers as an array: int64 when every value is an int of magnitude below
    ``bound`` (so no difference of two of them overflows), else Python's own numbers
    (objects). An int64 array is kept, or made exact where it leaves the bound; an array
    of any other dtype is kept as it is (the kernel's are int64 or already exact
    objects)."""
    if isinstance(values, np.ndarray):
        inside = values.dtype != np.int64 or not len(values) or (
            -bound < values.min() and values.max() < bound)
        return values if inside else values.astype(object)
    values = list(values)
    if set(map(type, values)) <= {int}:
        try:
            x = np.array(values, np.int64)
            if not len(x) or (-bound < x.min() and x.max() < bound):
                return x
        except OverflowError:  # beyond 64 bits
            pass
    return np.array(values, object)


def _runs(facts) -> list:
    """Exact compression, greedy from the left: a run takes the next fact and every
    following one while the difference stays that of its first two, as ``(first fact,
    difference, length)``; every fact lies in exactly one run. ``facts``: one per row of
    an int64 array (magnitudes below ``BOUND``: no difference overflows), or tuples, read
    as such an array if they allow it, else as Python's exact numbers."""
    if not len(facts):
        return []
    x = facts if isinstance(facts, np.ndarray) else np.array(facts, dtype=object)
    x = _column(x.flat).reshape(x.shape) if x.dtype == object else x
    d = np.diff(x, axis=0)
    starts = np.flatnonzero(np.concatenate(([True], (d[1:] != d[:-1]).any(axis=1))))
    runs, k, n = [], 0, len(facts)
    for end in (np.append(starts[1:], len(d)) - 1).tolist():  # last diff of each block
        if k <= end:  # the run from fact k takes the block's rest and the fact after it
            runs.append((tuple(x[k].tolist()), tuple(d[k].tolist()), end - k + 2))
            k = end + 2
    if k == n - 1:
        runs.append((tuple(x[k].tolist()), (0,) * x.shape[1], 1))
    return runs


def _num(v) -> str:
    """An exact number (an int or a Fraction, nothing else) as SMT-LIB text."""
    if type(v) is int:
        return f"(- {-v})" if v < 0 else str(v)
    if type(v) is not Fraction:
        raise TypeError(f"an obligation holds {v!r}, not an exact number")
    text = f"(/ {abs(v.numerator)}.0 {v.denominator}.0)"
    return f"(- {text})" if v < 0 else text


def _affine(a, ra, d, real: bool) -> str:
    """``a + ra*i + d*j`` as SMT-LIB text."""
    i, j = ("(to_real i)", "(to_real j)") if real else ("i", "j")
    terms = [_num(a)] + [f"(* {_num(c)} {v})" for c, v in ((ra, i), (d, j)) if c]
    return terms[0] if len(terms) == 1 else f"(+ {' '.join(terms)})"


_TEMPLATES = {  # template -> (SMT-LIB text of "the fact x holds", the same test in Python)
    "one": ("(= {0} 1)", lambda x: x[0] == 1),  # a plan fact holds
    "eq": ("(= {0} {1})", lambda x: x[0] == x[1]),
    "le": ("(<= {0} {1})", lambda x: x[0] <= x[1]),
    "lt": ("(< {0} {1})", lambda x: x[0] < x[1]),
    "level": ("(and (<= (+ {0} {1}) {4}) (= {3} (- (+ {0} {1}) {2})))",  # peak within the
              lambda x: x[0] + x[1] <= x[4] and x[3] == x[0] + x[1] - x[2]),  # bound, chained
}
_TEMPLATES.update(eqr=_TEMPLATES["eq"], ler=_TEMPLATES["le"])  # the same over the reals
_REAL = frozenset({"level", "eqr", "ler"})


def _holds(template: str, x) -> bool:
    return _TEMPLATES[template][1](x)


QUERY_DECLS = "(declare-const i Int)(declare-const j Int)"


def _violated(runs) -> str:
    """SMT-LIB formula over ``i``, ``j``: some run has a point ``(i, j)`` in range that
    violates its template."""
    parts = []
    for template, (a, ra, c, d, n) in runs:
        real = template in _REAL
        x = [_affine(*v, real) for v in zip(a, ra, d)]
        parts.append(f"(and (<= 0 i) (< i {c}) (<= 0 j) (< j {n}) "
                     f"(not {_TEMPLATES[template][0].format(*x)}))")
    return "(or false " + " ".join(parts) + ")"


CHUNK = 512


def _compress(facts: _Facts) -> list:
    """``(template, (a, ra, c, d, n))``: the facts ``a + ra*i + d*j`` for ``i < c``,
    ``j < n``. Level 1: each class's facts as runs; level 2: the runs of one template,
    difference and length, whose first facts again change by a constant step. Exact, as
    each level is: every fact is exactly one point."""
    same: dict = defaultdict(list)
    for (t, *_), lane in facts.lanes.items():
        for a, d, n in _runs(lane):
            same[(t, d, n)].append(a)
    return [(t, (a, ra, c, d, n)) for (t, d, n), starts in same.items()
            for a, ra, c in _runs(starts)]


def _decide(runs: list, rlimit: int | None) -> tuple[str, str]:
    """``("proved", "")``, ``("failed", the violated fact)`` or ``("unknown", reason)``."""
    for first in range(0, max(len(runs), 1), CHUNK):
        chunk = runs[first:first + CHUNK]
        solver = _solver(rlimit)
        solver.from_string(QUERY_DECLS + f"(assert {_violated(chunk)})")
        answer = solver.check()
        if answer == z3.unknown:
            return "unknown", _why_unknown(solver, rlimit)
        if answer == z3.sat:
            model = solver.model()
            i, j = (model.eval(z3.Int(v), model_completion=True).as_long() for v in "ij")
            return "failed", next(
                (f"{t}{x}" for t, (a, ra, c, d, n) in chunk if 0 <= i < c and 0 <= j < n
                 for x in [tuple(a_ + r_ * i + d_ * j for a_, r_, d_ in zip(a, ra, d))]
                 if not _holds(t, x)), f"a fact at i={i}, j={j}")
    return "proved", ""


# Z3 resource units per query when the caller gives no ``rlimit``: a deterministic cap
# (the count does not depend on the machine's speed or load), 400x the costliest query
# measured (about 250,000 units: a 64-microbatch transpose example; a query holds at most
# ``CHUNK`` runs). The wall-clock limit is only an outer guard against a check that never
# returns, above what this budget takes even on a loaded machine.
QUERY_RLIMIT = 100_000_000
GUARD_MS = 600_000


def _solver(rlimit: int | None) -> z3.Solver:
    """A fresh solver within ``rlimit`` resource units (``QUERY_RLIMIT`` when None; Z3
    applies it from the count at each check), and no check runs past 10 minutes."""
    solver = z3.Solver()
    solver.set("timeout", GUARD_MS)
    solver.set("rlimit", QUERY_RLIMIT if rlimit is None else rlimit)
    return solver


def _why_unknown(solver: z3.Solver, rlimit: int | None) -> str:
    """Which limit left a query undecided: the resource limit, the wall-clock guard, or
    Z3's own reason."""
    reason = solver.reason_unknown()
    if "timeout" in reason:
        return f"undecided (time: the {GUARD_MS // 1000} s wall-clock guard stopped Z3)"
    if reason in ("canceled", "max. resource limit exceeded"):
        budget = QUERY_RLIMIT if rlimit is None else rlimit
        return f"unknown (resource limit: rlimit {budget} used up)"
    return reason


def _word(answer, violated) -> str:
    """``confirm``'s word for Z3's ``answer``: ``violated`` when it is ``violated``."""
    return "violated" if answer == violated else "unknown" if answer == z3.unknown else "rejected"


# ---------------------------------------------------------------- the witness


@attrs.frozen
class Witness:
    """Untrusted numbers for the obligations. ``finish[r][k]``: completion time of the
    k-th comm step of rank r; ``producers[r]``: for each op in order and each of its
    inputs in sorted token order, the position that produced it; ``levels[r]``: the
    memory level before each step that allocates or frees something, then after the
    last; ``peaks[r]``: the claimed peak and ``peak_at[r]`` the position of the step that
    reaches it (-1: the static part, for an empty program)."""

    finish: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 2, (int,)))
    producers: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 2, (int,)))
    levels: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 2, EXACT))
    peaks: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 1, EXACT))
    peak_at: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 1, (int,)))

    def to_json(self) -> dict:
        return {"finish": [list(f) for f in self.finish],
                "producers": [list(p) for p in self.producers],
                "levels": [[_text(x) for x in lv] for lv in self.levels],
                "peaks": [_text(x) for x in self.peaks], "peak_at": list(self.peak_at)}

    @classmethod
    def from_json(cls, data: dict) -> "Witness":
        """The numbers as written (the validators refuse what is not an int where one is
        due); a level or peak may also be an ``"a/b"`` text or a finite float."""
        return cls(tuple(map(tuple, data["finish"])), tuple(map(tuple, data["producers"])),
                   tuple(map(_exacts, data["levels"])), _exacts(data["peaks"]),
                   tuple(data["peak_at"]))


@attrs.frozen
class Sizes:
    """Memory sizes, exact and >= 0: ``stored[(segment, stage)]`` (default 1),
    ``buffer[payload]`` the receive buffer of a payload (default 0), ``static[rank]``
    (default 0)."""

    stored: dict = attrs.field(factory=dict)
    buffer: dict = attrs.field(factory=dict)
    static: tuple = ()

    def __attrs_post_init__(self) -> None:
        values = (*self.stored.values(), *self.buffer.values(), *self.static)
        if not all(type(v) in EXACT and v >= 0 for v in values):
            raise ValueError("memory sizes must be exact numbers >= 0")

    @classmethod
    def of(cls, plan: Plan, model) -> "Sizes":
        """Sizes from a memory model with ``stored(stage, segment)``, ``buffer(payload)``,
        ``rng_state`` and ``static_of(rank)``, for every key the plan mentions: a receive
        buffer holds its payload, and a shipped raw input also the RNG state it ran with.
        The model is asked once per receive (it is a function of the payload)."""
        rules = _rules(plan)
        stored = {(seg, s): _exact(model.stored(s, seg)) for seg, s in rules.units}
        got = list(map(attrgetter("payload"), _pick(rules.ops, np.flatnonzero(rules.kind == RECV))))
        rng = map({"input": model.rng_state}.get, map(attrgetter("kind"), got), repeat(0))
        size = list(map(operator.add, map(model.buffer, got), rng))
        if set(map(type, size)) - {int, float}:  # else 0 and 0.0 are the only zeros
            size = list(map(_exact, size))
        keep = np.flatnonzero(_ints(map(bool, size)))
        got, size = _pick(got, keep), _pick(size, keep)
        typed = list(zip(map(type, size), size))
        exact = {x: _exact(x[1]) for x in dict.fromkeys(typed)}  # once per distinct number
        return cls(stored, dict(zip(got, map(exact.__getitem__, typed))),
                   tuple(_exact(model.static_of(r)) for r in range(plan.num_ranks)))

    def to_json(self) -> dict:
        return {"stored": [[seg, s, _text(v)] for (seg, s), v in sorted(self.stored.items())],
                "buffer": [[_payload_json(p), _text(v)]
                           for p, v in sorted(self.buffer.items(), key=repr)],
                "static": [_text(v) for v in self.static]}

    @classmethod
    def from_json(cls, data: dict) -> "Sizes":
        def payload(d: dict) -> Payload:
            shape, leaves = d["shape"], d.get("leaves")
            return Payload(d["kind"], d["stage"], d["mb"], d["segment"],
                           None if shape is None else tuple(shape), d["dtype"], d["to_segment"],
                           None if leaves is None else tuple(
                               Leaf(x, None if s is None else tuple(s), t) for x, s, t in leaves))
        return cls({(str(seg), _int(s)): _exact(v) for seg, s, v in data["stored"]},
                   {payload(p): _exact(v) for p, v in data["buffer"]},
                   tuple(_exact(v) for v in data["static"]))


def _payload_json(p: Payload) -> dict:
    """A buffer's payload as JSON; ``leaves`` only for a structured payload (``[path,
    shape, dtype]`` each), so certificates of single-tensor plans read as before."""
    out = {"kind": p.kind, "stage": p.stage, "mb": p.mb, "segment": p.segment,
           "dtype": p.dtype, "shape": None if p.shape is None else list(p.shape),
           "to_segment": p.to_segment}
    if p.leaves is not None:
        out["leaves"] = [[x.path, None if x.shape is None else list(x.shape), x.dtype]
                         for x in p.leaves]
    return out


EXACT = (int, Fraction)


def _numbers(name: str, value, depth: int, kinds: tuple) -> None:
    """``value`` is None, or tuples nested ``depth`` deep holding only ``kinds``."""
    if value is None:
        return
    rows = (value,) if depth == 1 else value
    if type(value) is not tuple or set(map(type, rows)) - {tuple} or set(
            map(type, chain.from_iterable(rows))) - set(kinds):
        raise ValueError(f"witness {name} must be tuples of {' or '.join(k.__name__ for k in kinds)}")


def _exact(x):
    """A number exactly: int, Fraction, an ``"a/b"`` text (short), or a finite float."""
    if isinstance(x, bool):
        raise ValueError("a size must be a number")
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():  # the common case, without a Fraction
        return int(x)
    if isinstance(x, str):
        if len(x) > 64 or "e" in x.lower():
            raise ValueError(f"not a short exact number: {x[:20]!r}")
        x = Fraction(x)
    x = Fraction(x)  # a float converts exactly (non-finite floats raise)
    return x.numerator if x.denominator == 1 else x


def _exacts(values) -> tuple:
    values = tuple(values)
    return values if set(map(type, values)) <= {int} else tuple(map(_exact, values))


def _int(x) -> int:
    if type(x) is not int:
        raise ValueError(f"expected an integer, got {x!r}")
    return x


def _text(x):
    return x if isinstance(x, int) else str(x)


# ---------------------------------------------------------------- the five properties


def _completeness(rules: _Rules, facts: _Facts, _witness) -> None:
    ok = rules.cut_ok()
    facts.flag("cut", ok, at=("cut",))
    if not ok:
        return
    m, units, ns = rules.m, rules.units, rules.stages
    comp = np.flatnonzero(rules.kind <= R)
    if len(units) * m > len(comp):  # fewer ops than required forwards: never enumerate m
        facts.add("le", "work", len(units) * m, len(comp), at=("work",))
        return
    seg, s, b = rules.seg[rules.name[comp]], rules.stage[comp], rules.mb[comp]
    unit = np.where(seg < 0, np.where(rules.name[comp] == rules.body, s, -1),
                    np.where(s == 0, ns + seg, -1))
    stray = (unit < 0) | (unit >= len(units)) | (b < 0) | (b >= m)  # so unit, b: digits
    for row in comp[stray].tolist():
        facts.flag("stray", False, at=("stray", int(rules.rank[row]), _index(rules, row)))
    comp, unit, b = comp[~stray], unit[~stray].astype(np.int64), b[~stray].astype(np.int64)
    kind = np.where(rules.owner()[comp] == rules.rank[comp], rules.kind[comp], 5)
    counts = np.bincount((unit * m + b) * 6 + kind, minlength=len(units) * m * 6)
    f, bw, i, w, r, wrong = counts.reshape(len(units), m, 6).transpose(2, 0, 1)
    segw = [rules.segs.get(x) if x else None for x, _ in units]
    due = np.array([[int(rules.recompute_due(x, mb)) for mb in range(m)] if x else [0] * m
                    for x in segw], np.int64).reshape(len(units), m)
    back = np.array([rules.backward_due(x) for x in segw], bool)
    one, zero, every = np.ones_like(f), np.zeros_like(f), np.arange(len(units))
    for name, have, want, sel in [("F", f, one, every), ("misplaced", wrong, zero, every),
                                  ("R", r, due, every), ("B|I", bw + i, one, every[back]),
                                  ("I=W", i, w, every[back]),  # one B, or one I and one W
                                  ("no backward", bw + i + w, zero, every[~back])]:
        facts.extend("eq", name, [have[sel].ravel(), want[sel].ravel()], np.repeat(sel, m),
                     at=lambda j, sel=sel: ("unit", *units[sel[j // m]], j % m))
    _required_collectives(rules, facts)


def _index(rules: _Rules, row: int) -> int:
    """The position on its rank of the step that holds member ``row``."""
    return int(rules.pos[row] - rules.base[rules.rank[row]])


def _required_collectives(rules: _Rules, facts: _Facts) -> None:
    required = rules.required_collectives()
    calls: dict = defaultdict(int)
    for row in np.flatnonzero(rules.kind == COLL).tolist():
        op, rank = rules.ops[row], int(rules.rank[row])
        role, sep, _ = op.tag.partition(":")
        if not sep or role not in ("params", "grads"):
            continue  # a collective of the user's own: only well-formedness applies
        need = required.get(op.tag)
        facts.flag("tagged", need is not None and op.kind == need[0]
                   and op.root == need[1] and need[2] <= set(op.ranks),
                   at=("collective", op.tag, rank))
        calls[(op.tag, rank)] += 1
    for tag, (_, _, ranks) in required.items():
        for r in range(rules.p):
            facts.add("eq" if r in ranks else "le", ("calls", tag, r in ranks),
                      calls[(tag, r)], 1, at=("collective", tag, r))


def _dependency(rules: _Rules, facts: _Facts, witness: Witness) -> None:
    """Input ``k`` of the rank's inputs (each op's, in sorted order) was made at the
    witness position ``q``: an op there produces it, and ``0 <= q < index``."""
    if witness.producers is None or len(witness.producers) != rules.p:
        facts.flag("witness", False, at=("witness",))
        return
    (row, token), kind, made = rules.tokens
    rank, count = rules.rank[row], np.bincount(rules.rank[row], minlength=rules.p).tolist()
    q = _column(chain.from_iterable(tuple(g[:c]) + (-1,) * (c - len(g)) for g, c in
                                    zip(witness.producers, count)))
    n = np.diff(rules.base)[rank]
    ok = np.array((q >= 0) & (q < n), bool)  # exact, whatever q's magnitude
    at = rules.base[rank] + np.where(ok, q, 0).astype(np.int64)
    both = _key(np.concatenate([at, rules.pos[made[0]]]), np.concatenate([token, made[1]]))
    found = _within(both[:len(at)], both[len(at):])
    facts.extend("one", "made", [(ok & found).astype(np.int64)])
    facts.extend("le", "made at", [0 * at, q])  # 0 <= q, and q < the op's own position:
    facts.extend("lt", "made before", [0 * at, rules.pos[row] - rules.base[rank] - q])
    for r, (g, c) in enumerate(zip(witness.producers, count)):
        facts.add("eq", "listed", c, len(g), at=("witness",))


def _within(x: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Per item of ``x``: does ``of`` hold it?"""
    of = np.sort(of)
    at = np.minimum(np.searchsorted(of, x), len(of) - 1)
    return of[at] == x if len(of) else np.zeros(len(x), bool)


def _instances(rules: _Rules) -> dict:
    """Collective instances: ``(sorted member set, k) -> {rank: (index, op)}``, the k-th
    call over that member set on each rank."""
    calls, seen = defaultdict(dict), defaultdict(int)
    for row in np.flatnonzero(rules.kind == COLL).tolist():
        op, rank = rules.ops[row], int(rules.rank[row])
        group = tuple(sorted(set(op.ranks)))
        calls[(group, seen[(group, rank)])][rank] = (_index(rules, row), op)
        seen[(group, rank)] += 1
    return calls


def _matching(rules: _Rules, facts: _Facts, _witness) -> None:
    send, src, dst, chan, k, partner, count = rules.pairs
    first = np.unique(chan, return_index=True)[1]
    sends, recvs = (np.bincount(chan[x], minlength=len(first)).tolist() for x in (send, ~send))
    where = [("channel", int(src[j]), int(dst[j])) for j in first.tolist()]
    for c, at in enumerate(where):
        facts.add("eq", "count", sends[c], recvs[c], at=at)
    a = np.flatnonzero(send & (partner >= 0))
    got = rules.p2p[0]
    same = _ints(map(operator.eq, _pick(got, a), _pick(got, partner[a])))
    facts.extend("one", "payload", [same], chan[a], at=lambda j: where[chan[a[j]]])
    for (group, _), where in _instances(rules).items():
        ref = where[min(where)][1]
        for rank, (index, op) in where.items():
            members, at = op.ranks, ("call", rank, index)
            facts.flag("call", len(set(members)) == len(members) and rank in members
                       and all(0 <= r < rules.p for r in members)
                       and (op.root is None if op.kind == "all_reduce" else op.root in members)
                       and (op.kind, op.tag, op.root) == (ref.kind, ref.tag, ref.root), at=at)
        facts.add("eq", "callers", sum(r in where for r in group), len(group),
                  at=("call", min(where), where[min(where)][0]))


def _deadlock(rules: _Rules, facts: _Facts, witness: Witness, eager: bool) -> None:
    """Per rank, each comm step's time ``fin``, posted at ``post`` (the ``fin`` of the comm
    step before it, 0 for the first): ``post <= fin``; each blocking end of a pair
    (both under rendezvous, the receive under eager) completes after its partner was
    posted, ``post(partner) < fin(end)``; an end without a partner waits forever; a
    collective completes after every member posted it, and only members call it."""
    comm = np.flatnonzero(np.isin(rules.step, _COMM))
    per_rank = np.bincount(rules.rank_of[comm], minlength=rules.p).tolist()
    fins = [_column(t) for t in witness.finish or ()]  # a time beyond BOUND is refused
    if witness.finish is None or [len(f) for f in fins] != per_rank or any(
            f.dtype != np.int64 for f in fins):
        facts.flag("witness", False, at=("witness",))
        return
    fin = np.concatenate([np.zeros(0, np.int64), *fins])
    post = np.concatenate([np.zeros(0, np.int64), *(np.r_[0, f][:len(f)] for f in fins)])
    nth = np.full(len(rules.step), -1, np.int64)  # a step of the plan -> its comm step
    nth[comm] = np.arange(len(comm))
    facts.extend("le", "order", [0 * fin, fin - post])  # gaps repeat far more than times
    send, _, _, chan, k, partner, count = rules.pairs
    ends, block = rules.comm, ~send | (not eager)
    j = np.flatnonzero(block & (partner >= 0))
    a, z = nth[rules.pos[ends[j]]], nth[rules.pos[ends[partner[j]]]]
    facts.extend("lt", "meet", [0 * a, fin[a] - post[z]])
    for j in np.flatnonzero(block & (partner < 0)).tolist():
        row = int(ends[j])  # no partner: waits forever
        facts.add("lt", "partner", int(k[j]), int(count[j]),
                  at=("stuck", int(rules.rank[row]), _index(rules, row)))
    for (group, _), where in _instances(rules).items():
        facts.add("eq", "callers", sum(r in where for r in group), len(group))
        steps = [nth[rules.base[r] + i] for r, (i, _) in where.items()]
        meet = max(int(post[x]) for x in steps)
        for r, x in zip(where, steps):
            facts.flag("member", r in group)  # a non-member's call never completes
            facts.add("lt", ("collective", r), meet, int(fin[x]))


def _memory(rules: _Rules, facts: _Facts, witness: Witness, sizes: "Sizes", limits) -> None:
    """The witness lists a level before each step that allocates or frees something, and
    one after the last; a step that moves nothing keeps the level (sizes are >= 0, so its
    peak is within the next step's, or the final level's)."""
    if witness.levels is None or not (len(witness.levels) == len(witness.peaks)
                                      == len(witness.peak_at) == rules.p):
        facts.flag("witness", False, at=("witness",))
        return
    alloc, freed = _moves(rules, sizes)
    for rank in range(rules.p):
        levels, peak, at = witness.levels[rank], witness.peaks[rank], witness.peak_at[rank]
        static = sizes.static[rank] if rank < len(sizes.static) else 0
        lo, hi = rules.base[rank], rules.base[rank + 1]
        moving = np.flatnonzero((alloc[lo:hi] != 0) | (freed[lo:hi] != 0))
        if not levels or len(levels) != len(moving) + 1 or not -1 <= at < hi - lo:
            facts.flag("witness", False, at=("witness",))
            continue
        level = _column(levels)
        facts.extend("level", rank, [level[:-1], alloc[lo + moving], freed[lo + moving],
                                     level[1:], _column([peak] * len(moving))])
        top = static if at == -1 else (levels[np.searchsorted(moving, at)]
                                       + alloc[lo + at:lo + at + 1].tolist()[0])
        facts.add("eqr", "static", levels[0], static)
        facts.add("ler", "final", levels[-1], peak)
        facts.add("eqr", "peak", top, peak)
        if limits is not None:
            facts.add("ler", "limit", peak, _exact(limits[rank]), at=("peak", rank))


def _moves(rules: _Rules, sizes: "Sizes") -> tuple:
    """Per step of the plan, the exact ``(allocated, freed)``: a forward (or recompute)
    that stores allocates its activation (``sizes.stored``, default 1), freed by its
    ``B`` or ``W``; a receive allocates its buffer (``sizes.buffer``, default 0), freed by
    the compute op that consumes what it carried. Allocations count before frees; a free
    releases its key's latest allocation, unless already freed."""
    k, comp = rules.kind, rules.kind <= R
    keep = np.flatnonzero(rules.stores())
    first, back = np.unique(_key(rules.name[keep], rules.stage[keep]), return_index=True,
                            return_inverse=True)[1:]
    size = _column((sizes.stored.get((rules.names[rules.name[j]], int(rules.stage[j])), 1)
                    for j in keep[first].tolist()), 1 << 32)
    gone = np.flatnonzero(comp & ((k == B) | (k == W)))
    unit = _key(*(np.concatenate([x[keep], x[gone]]) for x in (rules.name, rules.stage, rules.mb)))
    # keys and token codes are below BOUND, so 2 * key + 1 stays in int64
    events = [(keep, 2 * unit[:len(keep)], size[back.reshape(-1)]),
              (gone, 2 * unit[len(keep):], None)]  # stored activations: even keys
    if sizes.buffer:  # receive buffers: odd keys (without sizes, no buffer is allocated)
        (nrow, ntok), kind, (mrow, mtok) = rules.tokens
        recv = np.flatnonzero(k == RECV)
        got = [sizes.buffer.get(x, 0) for x in rules.p2p[0][rules.sends:]]
        has = np.array([x != 0 for x in got], bool)
        use = comp[nrow] & np.isin(kind, (OUT, GRAD, INPUT))
        events += [(recv[has], 2 * mtok[k[mrow] == RECV][has] + 1,
                    _column([x for x in got if x], 1 << 32)),
                   (nrow[use], 2 * ntok[use] + 1, None)]
    step, key = (np.concatenate([rules.pos[e[0]] if c == 0 else e[1] for e in events])
                 for c in (0, 1))
    fr = np.concatenate([np.full(len(e[0]), e[2] is None, np.int64) for e in events])
    kind = np.int64 if all(e[2] is None or e[2].dtype == np.int64 for e in events) else object
    amount = np.concatenate([np.zeros(len(e[0]), kind) if e[2] is None else e[2].astype(kind)
                             for e in events])
    alloc, freed = (np.zeros(len(rules.step), kind) for _ in "af")
    key = _key(rules.rank_of[step], key)  # a rank frees only what it allocated
    order = np.lexsort((fr, step, key))  # by key, then step, allocations first
    key, step, fr, amount = key[order], step[order], fr[order], amount[order]
    live = np.zeros(len(key), bool)  # a free right after an allocation of its key
    live[1:] = (key[1:] == key[:-1]) & (fr[:-1] == 0) & (fr[1:] == 1)
    np.add.at(alloc, step[fr == 0], amount[fr == 0])
    np.add.at(freed, step[live], amount[np.flatnonzero(live) - 1])
    return alloc, freed


# ---------------------------------------------------------------- verdicts


@attrs.frozen
class Verdict:
    """A property's verdict: ``proved``, ``failed`` (``detail``: the violated fact) or
    ``unknown`` (``detail``: Z3's reason); ``facts`` and ``runs`` count the obligations."""

    status: str
    detail: str = ""
    facts: int = 0
    runs: int = 0


def _obligations(name: str, rules: _Rules, witness, comm_model, sizes, limits,
                 where: bool = False) -> _Facts:
    facts = _Facts(where)
    if name == "deadlock":
        _deadlock(rules, facts, witness, comm_model == "eager")
    elif name == "memory":
        _memory(rules, facts, witness, sizes or Sizes(), limits)
    else:
        {"completeness": _completeness, "dependency": _dependency,
         "matching": _matching}[name](rules, facts, witness)
    return facts


def prove(plan: Plan, witness: Witness, comm_model: str = "rendezvous", sizes=None,
          limits=None, rlimit: int | None = None, properties=PROPERTIES) -> dict:
    """Each property's ``Verdict`` for ``plan`` under ``comm_model`` (``rendezvous`` or
    ``eager``), ``sizes`` (default: the unit model) and ``limits`` (one bound per rank,
    or None)."""
    if comm_model not in ("rendezvous", "eager"):
        raise ValueError(f"unknown comm model {comm_model!r}")
    if limits is not None and len(limits) != plan.num_ranks:
        raise ValueError(f"{len(limits)} memory limits for {plan.num_ranks} ranks")
    rules, out = _rules(plan), {}
    if not rules.cut_ok():  # every rule below reads the cut
        return {name: Verdict("failed", "the cut does not fit the plan") for name in properties}
    for name in properties:
        facts = _obligations(name, rules, witness, comm_model, sizes, limits)
        runs = _compress(facts)
        out[name] = Verdict(*_decide(runs, rlimit), facts.count, len(runs))
    return out


def violation(plan: Plan, witness: Witness, name: str, comm_model: str = "rendezvous",
              sizes=None, limits=None) -> str:
    """The whole query ``prove`` decides for property ``name``, as one SMT-LIB formula over
    the integers declared by ``QUERY_DECLS``: satisfiable iff some obligation fails (a cut
    that does not fit the plan: ``true``). For callers that combine many plans' queries
    into one Z3 call (the bounded family laws)."""
    rules = _rules(plan)
    if not rules.cut_ok():
        return "true"
    return _violated(_compress(_obligations(name, rules, witness, comm_model, sizes,
                                            limits)))


def confirm(plan: Plan, name: str, claims, comm_model: str = "rendezvous", sizes=None,
            limits=None, rlimit: int | None = None) -> list[str]:
    """For each claimed counterexample of property ``name``: ``violated`` when the kernel
    finds it in the plan and Z3 agrees that the fact breaks its template, ``unknown``
    when Z3 cannot say, else ``rejected``. Claims: ``("unit", segment, stage, mb)``,
    ``("stray"|"input"|"call"|"stuck", rank, index)``, ``("collective", tag, rank)``,
    ``("channel", src, dst)``, ``("cut",)``, ``("work",)``, ``("peak", rank, index)``,
    ``("cycle", ((rank, index), ...))``; each needs nothing but the plan."""
    def answers(group: list) -> list | None:
        try:
            return _confirm(_rules(plan), name, group, comm_model, sizes, limits, rlimit)
        except (IndexError, KeyError, TypeError, ValueError):  # a claim names no such place
            return None
    claims = list(claims)
    found = answers(claims)
    return found if found is not None else [(answers([c]) or ["rejected"])[0] for c in claims]


def _confirm(rules: _Rules, name: str, claims: list, comm_model, sizes, limits, rlimit) -> list:
    if not rules.cut_ok() and name != "completeness":
        return ["rejected"] * len(claims)
    if name == "deadlock":
        waits = _waits(rules, comm_model == "eager")
        return [_confirm_wait(c, waits, rlimit) for c in claims]
    if name == "dependency":
        bad = [_missing_inputs(rules, c) for c in claims]
    elif name == "memory":
        bad = [_over_limit(rules, c, sizes or Sizes(), limits) for c in claims]
    else:
        facts = _obligations(name, rules, None, comm_model, sizes, limits, where=True)
        found = defaultdict(list)
        for at, template, values in facts.where:
            if not _holds(template, values):
                found[at].append((template, values))
        bad = [found.get(tuple(c), [])[:1] for c in claims]
    return [_ground(b, rlimit) for b in bad]


def _ground(facts: list, rlimit) -> str:
    """Z3's word on a claimed violation: some listed ground fact breaks its template."""
    if not facts:
        return "rejected"
    template, values = facts[0]
    solver, real = _solver(rlimit), template in _REAL
    fact = _TEMPLATES[template][0].format(*(_affine(v, 0, 0, real) for v in values))
    solver.from_string(f"(assert (not {fact}))")
    return _word(solver.check(), z3.sat)


def _missing_inputs(rules: _Rules, claim) -> list:
    """An input of the op at ``(rank, index)`` that no earlier op on the rank produces."""
    rank, index, n = _place(rules, claim)
    if not 0 <= index < n:
        return []
    at = rules.base[rank] + index
    (nrow, need), _, (mrow, made) = rules.tokens
    made = made[(rules.pos[mrow] >= rules.base[rank]) & (rules.pos[mrow] < at)]
    need = need[rules.pos[nrow] == at]
    return [("one", (0,))] if not _within(need, made).all() else []


def _over_limit(rules: _Rules, claim, sizes: Sizes, limits) -> list:
    """The level at step ``index`` of ``rank`` (``-1``: the static part) over its limit."""
    rank, index, n = _place(rules, claim)
    if limits is None or not (0 <= index < n or index == -1 == n - 1):
        return []  # a step of the program, or -1 for the static part of an empty one
    top = sizes.static[rank] if rank < len(sizes.static) else 0
    if index != -1:
        lo = rules.base[rank]
        alloc, freed = (x[lo:lo + n].tolist() for x in _moves(rules, sizes))
        top += sum(alloc[:index]) - sum(freed[:index]) + alloc[index]
    return [("ler", (top, _exact(limits[rank])))]


def _place(rules: _Rules, claim) -> tuple:
    """A claim ``(_, rank, index)``: its rank, index and the length of the rank's program."""
    _, rank, index = claim
    if type(rank) is not int or not 0 <= rank < rules.p:
        raise IndexError(f"no rank {rank!r}")
    return rank, index, int(rules.base[rank + 1] - rules.base[rank])


def _confirm_wait(claim, waits: dict, rlimit) -> str:
    """A rank stuck on an endpoint with no FIFO partner (or a collective call that a member
    never makes, or that its caller is not a member of), or a wait-for cycle: each op of
    the cycle waits on a partner that its next rank posts only after its own op there;
    Z3 then finds no completion times (each op would complete after the next one, around
    the cycle)."""
    if claim[0] == "stuck":
        return _ground([f for _, f in waits.get(tuple(claim[1:]), ()) if not _holds(*f)][:1],
                       rlimit)
    cycle = [tuple(at) for at in claim[1]]
    if not cycle or not all(at in waits for at in cycle):  # each a blocking comm step
        return "rejected"
    t, solver = [z3.Int(f"t{k}") for k in range(len(cycle))], _solver(rlimit)
    for k, at in enumerate(cycle):
        nxt_rank, nxt_index = cycle[(k + 1) % len(cycle)]
        later = [on[1] for on, _ in waits[at] if on and on[0] == nxt_rank]
        if not later:
            return "rejected"  # it waits on nothing of the next rank
        solver.add(z3.Implies(max(later) > nxt_index, t[k] > t[(k + 1) % len(t)]))
    return _word(solver.check(), z3.unsat)


def _waits(rules: _Rules, eager: bool) -> dict:
    """``(rank, index) -> [(position waited on or None, fact)]`` for every blocking comm
    step: per blocking endpoint, the k-th of its channel, its FIFO partner (None when the
    other side has only ``count <= k`` ends) and the fact ``k < count``; per collective
    call of a member, the other members' calls and the fact "callers = members" of its
    instance; per call of a non-member, nothing and its failing ``member`` flag (it
    never completes)."""
    out: dict = defaultdict(list)
    send, _, _, _, k, partner, count = rules.pairs
    ends = rules.comm.tolist()
    for j in np.flatnonzero(~send | (not eager)).tolist():
        row, z = ends[j], int(partner[j])
        out[(int(rules.rank[row]), _index(rules, row))].append(
            ((int(rules.rank[ends[z]]), _index(rules, ends[z])) if z >= 0 else None,
             ("lt", (int(k[j]), int(count[j])))))
    for (group, _), where in _instances(rules).items():
        fact = ("eq", (sum(r in where for r in group), len(group)))
        for rank, (index, _) in where.items():
            if rank not in group:  # a non-member's call never completes
                out[(rank, index)].append((None, ("one", (0,))))
                continue
            out[(rank, index)] += [((r, i), fact) for r, (i, _) in where.items()
                                   if r != rank and r in group] or [(None, fact)]
    return out


# ---------------------------------------------------------------- portable certificates


def digest(plan: Plan) -> str:
    """SHA-256 of the plan's canonical text (what a certificate is about)."""
    return hashlib.sha256(plan.canonical_text().encode()).hexdigest()


def certificate(plan: Plan, witness: Witness, comm_model: str, sizes: Sizes, limits) -> dict:
    """The portable certificate: what is claimed about which plan, and the witness."""
    return {"format": CERTIFICATE_FORMAT, "digest": digest(plan), "comm_model": comm_model,
            "properties": list(PROPERTIES),
            "memory_limit": None if limits is None else [_text(_exact(x)) for x in limits],
            "sizes": sizes.to_json(), "witness": witness.to_json()}


def recheck(plan: Plan, data, rlimit: int | None = None, comm_model: str | None = None,
            limits=None, sizes: Sizes | None = None) -> tuple[bool, list[str]]:
    """Re-prove all five properties of ``plan`` from a certificate (``certificate``'s
    JSON): ``(True, [])``, or ``(False, reasons)`` when it does not establish them. What
    is proved is under the certificate's comm model, memory limits and sizes;
    ``comm_model``, ``limits`` (one per rank) and ``sizes``, when given, must be the
    certificate's."""
    try:
        if comm_model is not None and data.get("comm_model") != comm_model:
            return False, [f"the certificate is for the {data.get('comm_model')} model, not "
                           f"{comm_model}"]
        if limits is not None and (type(data.get("memory_limit")) is not list or [
                _exact(x) for x in data["memory_limit"]] != [_exact(x) for x in limits]):
            return False, [f"the certificate proves the memory limit "
                           f"{data.get('memory_limit')}, not {list(limits)}"]
        if data.get("format") != CERTIFICATE_FORMAT:
            return False, [f"not a {CERTIFICATE_FORMAT} certificate"]
        if data["digest"] != digest(plan):
            return False, ["the certificate is for another plan (digest differs)"]
        if sorted(data["properties"]) != sorted(PROPERTIES):
            return False, ["the certificate does not claim all five properties"]
        limit = data["memory_limit"]
        if limit is not None and type(limit) is not list:
            return False, ["memory_limit must be null or a list of one number per rank"]
        limits = None if limit is None else tuple(_exact(x) for x in limit)
        claimed, witness = Sizes.from_json(data["sizes"]), Witness.from_json(data["witness"])
        if sizes is not None and claimed != sizes:
            return False, ["the certificate's memory sizes are not the ones required"]
        verdicts = prove(plan, witness, data["comm_model"], claimed, limits, rlimit)
    except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError,
            ZeroDivisionError) as error:
        return False, [f"malformed certificate: {type(error).__name__}: {error}"]
    reasons = [f"{name}: {v.status} {v.detail}".strip() for name, v in verdicts.items()
               if v.status != "proved"]
    return not reasons, reasons

