"""The plan read as rules: one pass over the plan into integer columns (``Rules``), and
each rule of the semantics an array expression over them: what every op needs and
produces (``Rules.tokens``), who must run it (``Rules.owner``), what it stores
(``Rules.stores``), which collectives the cut requires (``Rules.required_collectives``)
and how sends meet receives (``Rules.pairs``). ``rules_of`` reads a plan once for the
calls on it that follow."""

from __future__ import annotations

import weakref
from functools import cached_property
from itertools import chain
from operator import attrgetter

import numpy as np

from ..ir import (SINK, SOURCE, Collective, Compute, Group, Idle, Marker, Offload, Overlap, Plan,
                  Recv, Reload, Send)
from .columns import as_column, dense, ints, pick, row_keys

F, B, I, W, R, SEND, RECV, COLL, OFF, REL = range(10)  # a member's kind; F..R compute
# token kinds, numbered in the order of their names (so codes sort as the names do)
(GRAD, HELD, INPUT, KV, KV_GRAD, OFFLOADED, OUT, PARAMS, RELOADED, RETURNED, STORED,
 WDONE, WREADY) = range(13)
_CARRIED = {"act": OUT, "grad": GRAD, "input": INPUT}  # what a payload carries
# rank moves (§2.10): what a send of a lend/return needs, and what its receive makes
_SENT, _RECEIVED = {"lend": STORED, "return": HELD}, {"lend": HELD, "return": RETURNED}
MOVED = ("lend", "return")  # the payload kinds of rank moves
_STEP = {Compute: 0, Overlap: 1, Send: 2, Recv: 3, Group: 4, Collective: 5, Idle: 6, Marker: 6,
         Offload: 7, Reload: 8}
BLOCKING = (2, 3, 4, 5)  # the steps that can block


class Rules:
    """The plan as columns, and the rules over them.

    Members: every step's ops (an overlapped step's computes, a group's sends and
    receives, else the step itself; idle steps and markers hold none), a row each in
    program order: ``pos`` its step (rank ``r``'s steps are numbered from ``base[r]``),
    ``rank``, ``kind`` (``F B I W R SEND RECV COLL OFF REL``) and a compute op's or an
    activation move's ``name``, ``stage`` and ``mb``; ``comm`` lists the sends' rows, then the receives', and ``p2p``
    what they carry. Names are numbered in sorted order ("" first); stages, mbs and peers
    are the plan's numbers (int64 when all are below ``BOUND``, else Python's)."""

    def __init__(self, plan: Plan) -> None:
        self.p, self.m, self.forward_only = plan.num_ranks, plan.num_microbatches, plan.forward_only
        self.seq = plan.seq_chunks
        self.where = np.array(plan.placement.stage_to_rank + (0,), np.int64)
        self.stages, self.cut = len(self.where) - 1, plan.cut.segments
        self.units = [("", s) for s in range(self.stages)] + [(s.name, 0) for s in self.cut]
        self.segs = {s.name: s for s in self.cut}
        self.pipes = plan.pipelines
        self.n = self.stages // len(self.pipes) if self.pipes_ok() and self.pipes else self.stages
        self._read(plan)

    def seq_ok(self) -> bool:
        """Sequence chunks: an int ``S >= 1`` dividing ``m``, each sample's chunks in one
        pipeline, and not declared forward-only (a chunk keeps what later chunks read)."""
        s = self.seq
        return type(s) is int and s >= 1 and self.m % s == 0 and (s == 1 or (
            not self.forward_only and all(
                not {mb // s for mb in a} & {mb // s for mb in b}
                for i, a in enumerate(self.pipes) for b in self.pipes[i + 1:])))

    def pipes_ok(self) -> bool:
        """No pipelines, or k >= 1 of them: microbatch tuples that partition ``0..m-1``,
        k dividing the stage count, and no cut (read once: ``_pipes_ok``)."""
        return self._pipes_ok

    @cached_property
    def _pipes_ok(self) -> bool:
        p = self.pipes
        return p == () or (type(p) is tuple and all(type(x) is tuple for x in p)
                           and all(type(mb) is int for x in p for mb in x)
                           and sorted(mb for x in p for mb in x) == list(range(self.m))
                           and self.stages % len(p) == 0 and self.stages >= len(p)
                           and not self.cut)

    @cached_property
    def pipe_of(self) -> np.ndarray:
        """Per microbatch, the pipeline it runs in (only with several pipelines)."""
        out = np.zeros(self.m, np.int64)
        for i, mbs in enumerate(self.pipes):
            out[list(mbs)] = i
        return out

    def runs(self, s, b) -> np.ndarray:
        """Per member of stage ``s`` and mb ``b``: is ``b`` a microbatch of the pipeline
        that body stage ``s`` belongs to (always, with one pipeline)?"""
        if not self.pipes or not self.pipes_ok():
            return np.ones(len(s), bool)
        inside = (b >= 0) & (b < self.m)
        mb = np.where(inside, b, 0).astype(np.int64)
        return inside & (self.pipe_of[mb] == (s // self.n))
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
            inner = [steps[k].ops for k in many.tolist()]
            size[many] = list(map(len, inner))
            cuts = [0, *(many + 1).tolist()]  # the steps between, then each one's members
            ops = list(chain.from_iterable(chain.from_iterable(
                (steps[a:b - 1], members) for a, b, members in zip(cuts, cuts[1:], inner))))
            ops += steps[cuts[-1]:]
            member = np.repeat(np.isin(np.arange(len(steps)), many), size)
            pos, step = np.repeat(pos, size), np.repeat(step, size)
            step[member] = _types(pick(ops, np.flatnonzero(member)))
        keep = np.flatnonzero(step != 6)  # idle steps and markers hold nothing
        if len(keep) < len(ops):
            ops, pos, step = pick(ops, keep), pos[keep], step[keep]
        self.rank_of = np.repeat(np.arange(self.p), np.diff(self.base))
        self.ops, self.pos, self.rank, n = ops, pos, self.rank_of[pos], len(ops)
        at = [np.flatnonzero(step == code) for code in (0, 2, 3, 5, 7, 8)]
        self.comm, self.sends = np.concatenate(at[1:3]), len(at[1])  # sends, then receives
        work = np.concatenate([at[0], at[4], at[5]])  # computes, then offloads and reloads
        comp, coll = pick(ops, work), pick(ops, at[3])
        c = [list(map(attrgetter(a), comp[:len(at[0])])) if a == "kind" else
             list(map(attrgetter(a), comp)) for a in ("kind", "stage", "mb", "segment")]
        tags = [op.tag.partition(":")[2] for op in coll]
        self.names = sorted({"", *(x for x in self.segs if type(x) is str), *c[3], *tags})
        code = {x: k for k, x in enumerate(self.names)}
        self.kind, self.name = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.kind[at[0]], self.kind[at[1]], self.kind[at[2]], self.kind[at[3]] = (
            ints(map(_KIND.__getitem__, c[0][:len(at[0])])), SEND, RECV, COLL)
        self.kind[at[4]], self.kind[at[5]] = OFF, REL
        self.name[work], self.name[at[3]] = (ints(map(code.__getitem__, x)) for x in (c[3], tags))
        self.stage, self.mb = (_scatter(n, work, as_column(x)) for x in c[1:3])
        self.body = code[""]
        if self.cut_ok():
            self._cut_columns()

    @cached_property
    def p2p(self) -> tuple:
        """Per send and receive (``comm`` order): its payload, the peer, and what the
        payload carries: token kind (a send of a rank move: what it needs; a receive of
        one: what it makes), name (text), stage, mb."""
        ops = pick(self.ops, self.comm)
        payloads = list(map(attrgetter("payload"), ops))
        kind, stage, mb, name = (list(map(attrgetter(a), payloads))
                                 for a in ("kind", "stage", "mb", "segment"))
        peer = [*map(attrgetter("dst"), ops[:self.sends]),
                *map(attrgetter("src"), ops[self.sends:])]
        carried = [*map({**_CARRIED, **_SENT}.__getitem__, kind[:self.sends]),
                   *map({**_CARRIED, **_RECEIVED}.__getitem__, kind[self.sends:])]
        return (payloads, as_column(peer), ints(carried), name, as_column(stage),
                as_column(mb))

    @cached_property
    def flow(self) -> tuple:
        """Per member: ``(g, s, b)``, the name code, stage and mb of what it computes, moves
        or carries (a transfer's: its payload's), and ``names``, the texts the codes
        number (sorted, so codes compare as the texts do)."""
        c, (_, _, _, names, stage, mb) = self.comm, self.p2p
        names = sorted({*self.names, *names})  # payloads' names too, in order
        code = {x: j for j, x in enumerate(names)}
        g = np.searchsorted(names, self.names)[self.name]
        g[c] = ints(map(code.__getitem__, self.p2p[3]))
        s, b = (_scatter(len(self.kind), c, x, base) for x, base in
                ((stage, self.stage), (mb, self.mb)))
        return g, s, b, names

    def moved(self) -> tuple:
        """Per send and receive (``comm`` order): ``(a rank move, a lend)``, read from what
        the end needs or makes (only a rank move's send needs ``stored`` or ``held``, only
        its receive makes ``held`` or ``returned``)."""
        carried, send = self.p2p[2], np.arange(len(self.comm)) < self.sends
        lend = np.where(send, carried == STORED, carried == HELD)
        return lend | np.where(send, carried == HELD, carried == RETURNED), lend

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
          segment (not in a forward-only plan) needs each local ``W`` (``wdone``), and
          ``replica:J`` each local ``B``/``W`` of every replica of model stage J;
        - several pipelines: a pipeline's first stage's forward needs nothing and its last
          stage's backward no gradient;
        - ``F`` makes ``out``, ``stored`` (and ``input``, for a segment's), ``B`` makes
          ``grad`` and ``wdone``, ``I`` ``grad`` and ``wgrad_ready``, ``W`` ``wdone``,
          ``R`` ``stored``; a receive makes what it carries, the broadcast ``params:NAME``
          the parameters;
        - activation moves (§2.10): ``OFF`` needs ``stored`` and makes ``offloaded``, ``REL``
          needs ``offloaded`` and makes ``reloaded``; a send that lends an activation needs
          it ``stored``, its receive makes it ``held``, a send that returns it needs it
          ``held``, its receive makes it ``returned``; a backward (``B`` or ``I``) of an
          activation its rank offloads (lends) anywhere in its program also needs it
          ``reloaded`` (``returned``);
        - with sequence chunks (``seq`` S > 1; ``mb = sample * S + j``): a forward with
          ``j > 0`` needs ``kv`` of ``(stage, mb - 1)``, which only a forward makes; a
          backward (``B`` or ``I``) with ``j < S - 1`` needs ``kv_grad`` of ``(stage,
          mb + 1)``, which only a backward makes."""
        k, seg, c = self.kind, self.seg[self.name], self.comm
        g, s, b, names = self.flow
        code = {x: j for j, x in enumerate(names)}
        tok = _scatter(len(k), c, self.p2p[2])
        lends = (k == SEND) & (tok == STORED)  # a send that lends what it stores
        body = code[""]
        comp, cut, bi, fr = k <= R, seg >= 0, (k == B) | (k == I), (k == F) | (k == R)
        main = comp & ~cut  # the body's work (and work of a segment the cut lacks)
        # a pipeline's ends (several pipelines): no data flows into or out of them
        inner_in, inner_out = ((s % self.n > 0, s % self.n < self.n - 1) if self.pipes
                               else (s > 0, s < self.stages - 1))
        need = [(main & (k == F) & inner_in, OUT, g, s - 1, b),
                *((main & (k == F) & (s == 0), OUT, code[x.name], 0, b)
                  for x in self.cut if x.side == SOURCE),
                (k == W, WREADY, g, s, b), (k == R, INPUT, g, s, b), (bi, STORED, g, s, b),
                (main & bi & inner_out, GRAD, g, s + 1, b),
                (cut & bi & (self.source[seg] == 1), GRAD, body, 0, b),
                (cut & (k == F) & (self.sink[seg] == 1), OUT, body, self.stages - 1, b),
                (cut & fr & (self.trainable[seg] == 1) & (self.rank != self.home[seg]),
                 PARAMS, g, 0, 0), (k == SEND, tok, g, s, b),
                (k == OFF, STORED, g, s, b), (k == REL, OFFLOADED, g, s, b),
                (bi & self._away(k == OFF, g, s, b), RELOADED, g, s, b),
                (bi & self._away(lends, g, s, b), RETURNED, g, s, b)]
        made = [(k == F, OUT, g, s, b), (k == F, STORED, g, s, b),
                ((k == F) & (g != body), INPUT, g, s, b), (bi, GRAD, g, s, b),
                ((k == B) | (k == W), WDONE, g, s, b), (k == I, WREADY, g, s, b),
                (k == R, STORED, g, s, b), (k == RECV, tok, g, s, b),
                (k == OFF, OFFLOADED, g, s, b), (k == REL, RELOADED, g, s, b)]
        if self.seq > 1:  # the chunk order (docstring)
            j = b % self.seq
            need += [((k == F) & (j > 0), KV, g, s, b - 1),
                     (bi & (j < self.seq - 1), KV_GRAD, g, s, b + 1)]
            made += [(k == F, KV, g, s, b), (bi, KV_GRAD, g, s, b)]
        extra_need, extra_made, replicas = [], [], self.replicas()
        for row in np.flatnonzero(k == COLL).tolist():
            op, rank = self.ops[row], int(self.rank[row])
            role, _, name = op.tag.partition(":")
            if (op.kind == "all_reduce" and role == "grads" and name in self.segs
                    and not self.forward_only):
                extra_need += [(row, WDONE, code[name], 0, mb) for mb, r in
                               enumerate(self.segs[name].backward_rank or ()) if r == rank]
            if op.kind == "broadcast" and role == "params":
                extra_made.append((row, PARAMS, code[name], 0, 0))
            if op.kind == "all_reduce" and role == "replica" and name in replicas:
                extra_need += [(row, WDONE, body, st, mb) for st in range(int(name), self.stages,
                                                                          self.n)
                               if self.where[st] == rank for mb in self.pipes[st // self.n]]
        parts = [_rows(need, extra_need), _rows(made, extra_made)]
        # one code per (kind, name, stage, mb), equal iff the tuples are (stage -1 too)
        token = np.split(row_keys(*(np.concatenate([x[c] for x in parts]) for c in range(1, 5))),
                         [len(parts[0][0])])
        nrow, mrow = parts[0][0], parts[1][0]
        order = np.argsort(row_keys(self.pos[nrow], token[0]), kind="stable")  # sorted inputs
        return (np.stack([nrow, token[0]])[:, order], parts[0][1][order],
                np.stack([mrow, token[1]]))

    def _away(self, off, g, s, b) -> np.ndarray:
        """Per member: does a member of its rank where ``off`` holds name the activation
        ``(g, s, b)`` (name code, stage, mb) it names?"""
        if not off.any():
            return off
        key = row_keys(self.rank, g, s, b)
        return np.isin(key, key[off])

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
        chan = dense(row_keys(src, dst)) if len(ends) else ends  # a peer may be any int
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
        body = np.where((s < self.stages) & (k != R) & self.runs(s, b), body, -1)
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
        for j, ranks in self.replicas().items():
            out["replica:" + j] = ("all_reduce", None, ranks)
        return out

    def replicas(self) -> dict:
        """``str(J) -> ranks`` holding a replica ``i*n + J`` of model stage J (several
        pipelines, not forward-only), where those ranks are more than one."""
        if not self.pipes or not self.pipes_ok() or self.forward_only:
            return {}
        out = {str(j): set(self.where[j:self.stages:self.n].tolist()) for j in range(self.n)}
        return {j: r for j, r in out.items() if len(r) > 1}

    def index_of(self, row: int) -> int:
        """The position on its rank of the step that holds member ``row``."""
        return int(self.pos[row] - self.base[self.rank[row]])


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


def rules_of(plan: Plan) -> Rules:
    """The plan's rules and columns, read once per (immutable) plan."""
    if _READ[0]() is not plan:
        _READ[:] = [weakref.ref(plan), Rules(plan)]
    return _READ[1]


def read(plan: Plan) -> None:
    """Read ``plan`` into the kernel's columns now, transfers included (kept for the
    calls on this plan that follow)."""
    rules_of(plan).p2p
