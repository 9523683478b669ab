"""The five properties' obligations, generated from the plan's rules alone; the untrusted
witness only supplies numbers. Each obligation is a numeric fact for a small linear
template (``smt.TEMPLATES``), kept by class in ``Facts``:

- completeness: each required unit of work (one ``F``; one ``B`` or one ``I`` and one
  ``W``, none for a frozen segment or a ``forward_only`` plan; one ``R`` where a recompute
  is due) counted on the rank that owns it; no op outside the chain; the cut well formed;
  each collective the cut requires (``Rules.required_collectives``) exactly once on
  every rank that needs it;
- dependency: each input of each op (``Rules.tokens``) was produced earlier on its rank,
  at the position the witness names;
- matching: the k-th send from a to b meets the k-th receive at b from a, equal counts,
  equal payloads; no rank receives a token (an activation, gradient or raw input) twice;
  every collective call well formed and agreeing with its instance;
- deadlock: the witness gives each comm step a time ``fin``, posted at the ``fin`` of
  the comm step before it (``post``, 0 first): ``post <= fin``, each blocking end has a
  partner and completes after it was posted, each collective after every member posted
  it. If such times exist no run gets stuck: a stuck op with the least ``fin`` would wait
  on a partner posted after another stuck op completed, which completes earlier still;
- memory: the witness's levels start at the static part, each is the last plus the
  step's allocations minus its frees (``moves``), every step's peak within the reported
  peak, which is reached and within the limit.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

import numpy as np

from .columns import as_column, distinct, exact, ints, pick, row_keys
from .inputs import Sizes, Witness
from .rules import (B, BLOCKING, COLL, GRAD, INPUT, MOVED, OFF, OUT, R, RECV, REL, SEND, SINK,
                    SOURCE, W, Rules)

class Facts:
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
        """One fact per row ``j`` of the equal-length ``columns`` (``as_column`` arrays), in
        class ``(cls, classes[j])`` (one int per row), about the place ``at`` (or ``at(j)``).
        A class holds a set of facts: without ``where``, int64 facts are kept once each,
        in sorted order (so runs are long)."""
        keys = np.zeros(len(columns[0]), np.int64) if classes is None else classes
        columns = [as_column(c) for c in columns]  # differences may leave it
        self.count += len(keys)
        if self.where is None and len(keys) and all(c.dtype == np.int64 for c in columns):
            order = distinct(row_keys(keys, *columns))
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


def _completeness(rules: Rules, facts: Facts, _witness) -> None:
    ok = rules.cut_ok()
    facts.flag("cut", ok, at=("cut",))
    if rules.pipes:
        ok = ok and rules.pipes_ok()
        facts.flag("pipelines", rules.pipes_ok(), at=("pipelines",))
    if rules.seq != 1:
        ok = ok and rules.seq_ok()
        facts.flag("seq_chunks", rules.seq_ok(), at=("seq_chunks",))
    if not ok:
        return
    m, units, ns = rules.m, rules.units, rules.stages
    comp = np.flatnonzero(rules.kind <= R)
    due_work = len(units) * m // max(len(rules.pipes), 1)  # each pipeline: its own mbs
    if due_work > len(comp):  # fewer ops than required forwards: never enumerate m
        facts.add("le", "work", due_work, len(comp), at=("work",))
        return
    seg, s, b = rules.seg[rules.name[comp]], rules.stage[comp], rules.mb[comp]
    unit = np.where(seg < 0, np.where(rules.name[comp] == rules.body, s, -1),
                    np.where(s == 0, ns + seg, -1))
    stray = (unit < 0) | (unit >= len(units)) | (b < 0) | (b >= m)  # so unit, b: digits
    if rules.pipes:  # a body stage's work of another pipeline's microbatch
        stray |= (seg < 0) & ~rules.runs(s, b)
    for row in comp[stray].tolist():
        facts.flag("stray", False, at=("stray", int(rules.rank[row]), rules.index_of(row)))
    comp, unit, b = comp[~stray], unit[~stray].astype(np.int64), b[~stray].astype(np.int64)
    kind = np.where(rules.owner()[comp] == rules.rank[comp], rules.kind[comp], 5)
    counts = np.bincount((unit * m + b) * 6 + kind, minlength=len(units) * m * 6)
    f, bw, i, w, r, wrong = counts.reshape(len(units), m, 6).transpose(2, 0, 1)
    segw = [rules.segs.get(x) if x else None for x, _ in units]
    due = np.array([[int(rules.recompute_due(x, mb)) for mb in range(m)] if x else [0] * m
                    for x in segw], np.int64).reshape(len(units), m)
    back = np.array([rules.backward_due(x) for x in segw], bool)
    one, zero, every = np.ones_like(f), np.zeros_like(f), np.arange(len(units))
    if rules.pipes:  # a stage owes the work of its own pipeline's microbatches only
        one = (rules.pipe_of[None, :] == (np.arange(len(units)) // rules.n)[:, None]).astype(
            np.int64)
    for name, have, want, sel in [("F", f, one, every), ("misplaced", wrong, zero, every),
                                  ("R", r, due, every), ("B|I", bw + i, one, every[back]),
                                  ("I=W", i, w, every[back]),  # one B, or one I and one W
                                  ("no backward", bw + i + w, zero, every[~back])]:
        facts.extend("eq", name, [have[sel].ravel(), want[sel].ravel()], np.repeat(sel, m),
                     at=lambda j, sel=sel: ("unit", *units[sel[j // m]], j % m))
    _required_collectives(rules, facts)
    _moves(rules, facts)


def _moves(rules: Rules, facts: Facts) -> None:
    """Activation moves (§2.10): each names an activation of the plan (a unit and a
    microbatch below ``m``; none in a forward-only plan or one of sequence chunks); per rank and activation at most
    one offload and as many reloads as offloads; at most one lend sent, as many returns
    received as lends sent, as many returns sent as lends received."""
    g, s, b, names = rules.flow
    moved, lend = np.zeros(len(rules.kind), bool), np.zeros(len(rules.kind), bool)
    moved[rules.comm], lend[rules.comm] = rules.moved()
    rows = np.flatnonzero((rules.kind == OFF) | (rules.kind == REL) | moved)
    count: dict = defaultdict(lambda: [0] * 6)
    units = set(rules.units)
    for row in rows.tolist():
        key = (int(rules.rank[row]), names[g[row]], int(s[row]), int(b[row]))
        kind = int(rules.kind[row])
        column = ({OFF: 0, REL: 1}[kind] if kind in (OFF, REL) else
                  (2 if lend[row] else 5) if kind == SEND else (4 if lend[row] else 3))
        count[key][column] += 1
        facts.flag("move", key[1:3] in units and key[3] < rules.m and not rules.forward_only
                   and rules.seq == 1, at=("move", *key))
    for key, (off, rel, lent, back, held, gave) in count.items():
        facts.add("le", "offloads", off, 1, at=("move", *key))
        facts.add("eq", "reloads", rel, off, at=("move", *key))
        facts.add("le", "lends", lent, 1, at=("move", *key))
        facts.add("eq", "returns", back, lent, at=("move", *key))
        facts.add("eq", "given back", gave, held, at=("move", *key))


def _required_collectives(rules: Rules, facts: Facts) -> None:
    required = rules.required_collectives()
    calls: dict = defaultdict(int)
    for row in np.flatnonzero(rules.kind == COLL).tolist():
        op, rank = rules.ops[row], int(rules.rank[row])
        role, sep, _ = op.tag.partition(":")
        if not sep or role not in ("params", "grads", "replica"):
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


def _dependency(rules: Rules, facts: Facts, witness: Witness) -> None:
    """Input ``k`` of the rank's inputs (each op's, in sorted order) was made at the
    witness position ``q``: an op there produces it, and ``0 <= q < index``."""
    if witness.producers is None or len(witness.producers) != rules.p:
        facts.flag("witness", False, at=("witness",))
        return
    (row, token), kind, made = rules.tokens
    rank, count = rules.rank[row], np.bincount(rules.rank[row], minlength=rules.p).tolist()
    q = as_column(chain.from_iterable(tuple(g[:c]) + (-1,) * (c - len(g)) for g, c in
                                    zip(witness.producers, count)))
    n = np.diff(rules.base)[rank]
    ok = np.array((q >= 0) & (q < n), bool)  # exact, whatever q's magnitude
    at = rules.base[rank] + np.where(ok, q, 0).astype(np.int64)
    both = row_keys(np.concatenate([at, rules.pos[made[0]]]), np.concatenate([token, made[1]]))
    found = within(both[:len(at)], both[len(at):])
    facts.extend("one", "made", [(ok & found).astype(np.int64)])
    facts.extend("le", "made at", [0 * at, q])  # 0 <= q, and q < the op's own position:
    facts.extend("lt", "made before", [0 * at, rules.pos[row] - rules.base[rank] - q])
    for r, (g, c) in enumerate(zip(witness.producers, count)):
        facts.add("eq", "listed", c, len(g), at=("witness",))


def within(x: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Per item of ``x``: does ``of`` hold it?"""
    of = np.sort(of)
    at = np.minimum(np.searchsorted(of, x), len(of) - 1)
    return of[at] == x if len(of) else np.zeros(len(x), bool)


def instances(rules: Rules) -> dict:
    """Collective instances: ``(sorted member set, k) -> {rank: (index, op)}``, the k-th
    call over that member set on each rank."""
    calls, seen = defaultdict(dict), defaultdict(int)
    for row in np.flatnonzero(rules.kind == COLL).tolist():
        op, rank = rules.ops[row], int(rules.rank[row])
        group = tuple(sorted(set(op.ranks)))
        calls[(group, seen[(group, rank)])][rank] = (rules.index_of(row), op)
        seen[(group, rank)] += 1
    return calls


def _matching(rules: Rules, facts: Facts, _witness) -> None:
    send, src, dst, chan, k, partner, count = rules.pairs
    first = np.unique(chan, return_index=True)[1]
    sends, recvs = (np.bincount(chan[x], minlength=len(first)).tolist() for x in (send, ~send))
    where = [("channel", int(src[j]), int(dst[j])) for j in first.tolist()]
    for c, at in enumerate(where):
        facts.add("eq", "count", sends[c], recvs[c], at=at)
    a = np.flatnonzero(send & (partner >= 0))
    got = rules.p2p[0]
    same = ints(map(_same, pick(got, a), pick(got, partner[a])))
    facts.extend("one", "payload", [same], chan[a], at=lambda j: where[chan[a[j]]])
    _received_once(rules, facts)
    if rules.pipes:  # several pipelines: no activation or gradient leaves its pipeline
        _, _, kind, name, stage, _ = rules.p2p
        body = np.array([x == "" for x in name], bool)
        out = body & (((kind == OUT) & (stage % rules.n == rules.n - 1))
                      | ((kind == GRAD) & (stage % rules.n == 0)))
        for j in np.flatnonzero(out).tolist():
            row = int(rules.comm[j])
            facts.flag("flow", False, at=("call", int(rules.rank[row]), rules.index_of(row)))
    for (group, _), where in instances(rules).items():
        ref = where[min(where)][1]
        for rank, (index, op) in where.items():
            members, at = op.ranks, ("call", rank, index)
            facts.flag("call", len(set(members)) == len(members) and rank in members
                       and all(0 <= r < rules.p for r in members)
                       and (op.root is None if op.kind == "all_reduce" else op.root in members)
                       and (op.kind, op.tag, op.root) == (ref.kind, ref.tag, ref.root), at=at)
        facts.add("eq", "callers", sum(r in where for r in group), len(group),
                  at=("call", min(where), where[min(where)][0]))


def _same(x, y) -> bool:
    """Equal payloads (one object is equal to itself: a lowered plan's two ends share it)."""
    return x is y or x == y


def _received_once(rules: Rules, facts: Facts) -> None:
    """Each receive of a token (not a rank move's: ``_moves`` counts those) is the first
    of that token on its rank for its crossing of the cut (``_crossing``): the receives
    of it before, in program order, are 0."""
    _, _, (mrow, mtok) = rules.tokens
    moved = np.zeros(len(rules.kind), bool)
    moved[rules.comm] = rules.moved()[0]
    got = (rules.kind[mrow] == RECV) & ~moved[mrow]
    rows = mrow[got]
    end = np.full(len(rules.kind), -1, np.int64)
    end[rules.comm] = np.arange(len(rules.comm))
    codes: dict = {None: 0}
    sides = {s.name: s.side for s in rules.cut}
    part = ints(codes.setdefault(_crossing(rules, sides, rules.p2p[0][j]), len(codes))
                for j in end[rows])
    key = row_keys(rules.rank[rows], mtok[got], part)
    order = np.lexsort((rows, key))
    new = np.ones(len(order), bool)
    new[1:] = key[order][1:] != key[order][:-1]
    starts = np.flatnonzero(new)
    before = np.empty(len(order), np.int64)
    before[order] = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts,
                                                                            len(order)]))
    facts.extend("eq", "received once", [before, 0 * before],
                 at=lambda j: ("received", int(rules.rank[rows[j]]), rules.index_of(rows[j])))


def _crossing(rules: Rules, sides: dict, p) -> str | None:
    """The segment a received payload is for when it crosses the cut (``sides``: each
    segment's side): the body's stage 0 gradient to a source (each source's part is its
    own tensor) or the body's last output to a sink (each sink's copy); None otherwise,
    whatever ``to_segment`` says."""
    side = sides.get(p.to_segment)
    if p.segment != "" or side is None:
        return None
    if (p.kind, p.stage, side) in (("grad", 0, SOURCE), ("act", rules.stages - 1, SINK)):
        return p.to_segment
    return None


def _deadlock(rules: Rules, facts: Facts, witness: Witness, eager: bool) -> None:
    """Per rank, each comm step's time ``fin``, posted at ``post`` (the ``fin`` of the comm
    step before it, 0 for the first): ``post <= fin``; each blocking end of a pair
    (both under rendezvous, the receive under eager) completes after its partner was
    posted, ``post(partner) < fin(end)``; an end without a partner waits forever; a
    collective completes after every member posted it, and only members call it."""
    comm = np.flatnonzero(np.isin(rules.step, BLOCKING))
    per_rank = np.bincount(rules.rank_of[comm], minlength=rules.p).tolist()
    fins = [as_column(t) for t in witness.finish or ()]  # a time beyond BOUND is refused
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
                  at=("stuck", int(rules.rank[row]), rules.index_of(row)))
    for (group, _), where in instances(rules).items():
        facts.add("eq", "callers", sum(r in where for r in group), len(group))
        steps = [nth[rules.base[r] + i] for r, (i, _) in where.items()]
        meet = max(int(post[x]) for x in steps)
        for r, x in zip(where, steps):
            facts.flag("member", r in group)  # a non-member's call never completes
            facts.add("lt", ("collective", r), meet, int(fin[x]))


def _memory(rules: Rules, facts: Facts, witness: Witness, sizes: Sizes, limits) -> None:
    """The witness lists a level before each step that allocates or frees something, and
    one after the last; a step that moves nothing keeps the level (sizes are >= 0, so its
    peak is within the next step's, or the final level's)."""
    if witness.levels is None or not (len(witness.levels) == len(witness.peaks)
                                      == len(witness.peak_at) == rules.p):
        facts.flag("witness", False, at=("witness",))
        return
    alloc, freed = moves(rules, sizes)
    for rank in range(rules.p):
        levels, peak, at = witness.levels[rank], witness.peaks[rank], witness.peak_at[rank]
        static = sizes.static[rank] if rank < len(sizes.static) else 0
        lo, hi = rules.base[rank], rules.base[rank + 1]
        moving = np.flatnonzero((alloc[lo:hi] != 0) | (freed[lo:hi] != 0))
        if not levels or len(levels) != len(moving) + 1 or not -1 <= at < hi - lo:
            facts.flag("witness", False, at=("witness",))
            continue
        level = as_column(levels)
        facts.extend("level", rank, [level[:-1], alloc[lo + moving], freed[lo + moving],
                                     level[1:], as_column([peak] * len(moving))])
        top = static if at == -1 else (levels[np.searchsorted(moving, at)]
                                       + alloc[lo + at:lo + at + 1].tolist()[0])
        facts.add("eqr", "static", levels[0], static)
        facts.add("ler", "final", levels[-1], peak)
        facts.add("eqr", "peak", top, peak)
        if limits is not None:
            facts.add("ler", "limit", peak, exact(limits[rank]), at=("peak", rank))


def moves(rules: Rules, sizes: Sizes) -> tuple:
    """Per step of the plan, the exact ``(allocated, freed)``: a forward (or recompute)
    that stores allocates its activation (``sizes.stored``, default 1), freed by its
    ``B`` or ``W``; an offload frees it from the device and a reload allocates it again
    (device memory only, §2.10), and so do a send and a receive that lend or return it
    (on their own ranks: the holder keeps it on its device); a receive allocates its buffer (``sizes.buffer``, default 0), freed by
    the compute op that consumes what it carried. Allocations count before frees; a free
    releases its key's latest allocation, unless already freed."""
    k, comp = rules.kind, rules.kind <= R
    g, s, b, names = rules.flow
    moved = np.zeros(len(k), bool)  # the sends and receives that lend or return
    moved[rules.comm] = rules.moved()[0]
    keep = np.flatnonzero(rules.stores() | (k == REL) | (moved & (k == RECV)))  # allocate
    first, back = np.unique(row_keys(g[keep], s[keep]), return_index=True,
                            return_inverse=True)[1:]
    size = as_column((sizes.stored.get((names[g[j]], int(s[j])), 1)
                    for j in keep[first].tolist()), 1 << 32)
    gone = np.flatnonzero((k == B) | (k == W) | (k == OFF) | (moved & (k == SEND)))  # free
    unit = row_keys(*(np.concatenate([x[keep], x[gone]]) for x in (g, s, b)))
    # keys and token codes are below BOUND, so 2 * key + 1 stays in int64
    events = [(keep, 2 * unit[:len(keep)], size[back.reshape(-1)]),
              (gone, 2 * unit[len(keep):], None)]  # stored activations: even keys
    if sizes.buffer:  # receive buffers: odd keys (without sizes, no buffer is allocated)
        (nrow, ntok), kind, (mrow, mtok) = rules.tokens
        recv = np.flatnonzero(k == RECV)
        got = [0 if x.kind in MOVED else sizes.buffer.get(x, 0)  # a moved activation is
               for x in rules.p2p[0][rules.sends:]]  # counted as stored (above)
        has = np.array([x != 0 for x in got], bool)
        use = comp[nrow] & np.isin(kind, (OUT, GRAD, INPUT))
        events += [(recv[has], 2 * mtok[k[mrow] == RECV][has] + 1,
                    as_column([x for x in got if x], 1 << 32)),
                   (nrow[use], 2 * ntok[use] + 1, None)]
    step, key = (np.concatenate([rules.pos[e[0]] if c == 0 else e[1] for e in events])
                 for c in (0, 1))
    fr = np.concatenate([np.full(len(e[0]), e[2] is None, np.int64) for e in events])
    kind = np.int64 if all(e[2] is None or e[2].dtype == np.int64 for e in events) else object
    amount = np.concatenate([np.zeros(len(e[0]), kind) if e[2] is None else e[2].astype(kind)
                             for e in events])
    alloc, freed = (np.zeros(len(rules.step), kind) for _ in "af")
    key = row_keys(rules.rank_of[step], key)  # a rank frees only what it allocated
    order = np.lexsort((fr, step, key))  # by key, then step, allocations first
    key, step, fr, amount = key[order], step[order], fr[order], amount[order]
    live = np.zeros(len(key), bool)  # a free right after an allocation of its key
    live[1:] = (key[1:] == key[:-1]) & (fr[:-1] == 0) & (fr[1:] == 1)
    np.add.at(alloc, step[fr == 0], amount[fr == 0])
    np.add.at(freed, step[live], amount[np.flatnonzero(live) - 1])
    return alloc, freed


def obligations(name: str, rules: Rules, witness, comm_model, sizes, limits,
                 where: bool = False) -> Facts:
    """The facts of property ``name`` that ``plan`` must satisfy (``where``: each with the
    place it is about)."""
    facts = Facts(where)
    if name == "deadlock":
        _deadlock(rules, facts, witness, comm_model == "eager")
    elif name == "memory":
        _memory(rules, facts, witness, sizes or Sizes(), limits)
    else:
        {"completeness": _completeness, "dependency": _dependency,
         "matching": _matching}[name](rules, facts, witness)
    return facts
