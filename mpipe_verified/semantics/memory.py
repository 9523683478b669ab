"""Memory (docs/semantics.md §2.6): what each step allocates and frees (``step_effects``)
and what a free releases (``lifetimes``, over flat arrays of events), per rank op by op
(``memory_steps``, any sizes) or by columns (``memory_moves``, integer sizes), and the
levels and peaks that follow (``memory_levels``; by columns, ``column_levels``).

Both forms evaluate ``step_effects`` (the column form once per op class) and hand their
events to ``lifetimes``; they differ only in how they sum: ``memory_steps`` adds the
sizes as the model gives them (floats, or exact rationals) in program order, the column
form adds integers by arrays.
"""

from __future__ import annotations

import math
from typing import Callable

import attrs

from ..ir import (BACKWARD, FORWARD, INPUT, RANK_MOVES, RECOMPUTE, WEIGHT_GRAD, Collective,
                  Idle, Marker, Offload, Op, Payload, Plan, Recv, Reload, Send, computes_of,
                  p2p_of)
from .rules import TRANSFER_TOKENS, Chain, payload_token
from .table import OpTable


def _no_buffer(payload: Payload) -> float:
    return 0.0


@attrs.frozen
class MemoryModel:
    """§2.6. ``stored(stage, segment)`` is what an ``F`` keeps for its backward (freed by
    ``B``, or by ``W`` when split); ``buffer(payload)`` is a receive buffer, freed when the
    consuming op finishes; ``static[rank]`` is the fixed part. ``rng_state`` is the RNG
    state a shipped raw input carries (its recompute replays the forward's random draws):
    an ``input`` payload's receive buffer is ``buffer(payload) + rng_state``. Default: the
    unit model (buffers and RNG states free)."""

    stored: Callable[[int, str], float] = lambda stage, segment: 1.0
    buffer: Callable[[Payload], float] = _no_buffer
    static: tuple[float, ...] = ()
    rng_state: float = 0.0

    @property
    def buffers_free(self) -> bool:
        """Whether ``buffer`` is the default, which makes every receive buffer free (a
        function of its own is not inspected, even one that always returns 0)."""
        return self.buffer is _no_buffer

    def static_of(self, rank: int) -> float:
        return self.static[rank] if rank < len(self.static) else 0.0

    def received(self, payload: Payload) -> float:
        """The receive buffer of ``payload``: ``buffer(payload)``, plus ``rng_state`` for a
        shipped raw input."""
        return self.buffer(payload) + (self.rng_state if payload.kind == INPUT else 0.0)


UNIT_MEMORY = MemoryModel()


def memory_steps(plan: Plan, rank: int, model: MemoryModel = UNIT_MEMORY,
                 live_at: int | None = None, exact: Callable | None = None
                 ) -> tuple[list[tuple[float, float]], list]:
    """Per op of ``rank``: ``(allocated, freed)``. A step's allocations count before its
    frees, so its peak is ``before + allocated``; what a free releases is ``lifetimes``'.
    With ``live_at``, also the tensors live at that step's peak as ``(description,
    size)``. With ``exact``, every size is ``exact(size)`` before it is summed (exact
    rationals, not float sums), in program order."""
    import numpy as np
    chain = Chain.of(plan)
    stored, buffer = model.stored, model.received
    if exact is not None:
        stored, buffer = (lambda s, seg: exact(model.stored(s, seg))), (
            lambda p: exact(model.received(p)))
    keys: list[int] = []  # per event (a step's allocations, then its frees): its key's number
    entries: list = []  # per event: what it allocates, or None for a free
    per_step: list[int] = []  # the events of each step
    allocated: list = []  # per step, the sum of its allocations
    freed: list = []  # per step, the sum of what its frees release (below)
    number: dict = {}
    add_key, add_entry = keys.append, entries.append
    cut = 0  # the events before the peak of step live_at
    for index, op in enumerate(plan.programs[rank]):
        kind = type(op)
        if (kind is Send and op.payload.kind not in RANK_MOVES) or kind is Idle \
                or kind is Marker or kind is Collective:
            allocated.append(0.0)  # allocates and frees nothing
            freed.append(0.0)
            per_step.append(0)
            if index == live_at:
                cut = len(keys)
            continue
        allocs, frees = step_effects(op, rank, chain, stored, buffer)
        alloc = 0.0 if exact is None else 0
        for key, entry in allocs:
            add_key(number.setdefault(key, len(number)))
            add_entry(entry)
            alloc += entry[2]
        if index == live_at:
            cut = len(keys)
        for key in frees:
            add_key(number.setdefault(key, len(number)))
            add_entry(None)
        allocated.append(alloc)
        freed.append(0)
        per_step.append(len(allocs) + len(frees))
    free = np.fromiter((entry is None for entry in entries), dtype=bool, count=len(entries))
    released, until = lifetimes(free, (np.array(keys, dtype=np.int64),))
    hit = np.flatnonzero(released >= 0)
    step_of = np.repeat(np.arange(len(per_step), dtype=np.int64), per_step)
    for step, e in zip(step_of[hit].tolist(), released[hit].tolist()):
        freed[step] += entries[e][2]  # in program order, as the frees come
    snapshot = [] if live_at is None else _live(entries, until.tolist(), cut)
    return list(zip(allocated, freed)), snapshot


def _live(entries, until, cut: int) -> list:
    """What is live after the first ``cut`` events (``lifetimes``' ``until``), as
    ``(description, size)`` in the order the keys became live: an allocation that
    replaced another keeps its key's place."""
    replaced = {end: e for e, end in enumerate(until)
                if entries[e] is not None and end < len(entries) and entries[end] is not None}
    live = []
    for e in range(cut):
        if entries[e] is not None and until[e] >= cut:
            first = e
            while first in replaced:
                first = replaced[first]
            live.append((first, e))
    return [(f"{entries[e][0]} {entries[e][1]}", entries[e][2]) for _, e in sorted(live)]


def lifetimes(free, keys: tuple, time: tuple = ()) -> tuple:
    """What a free releases (§2.6), stated once, over memory events (arrays, one entry per
    event): ``free`` says whether it frees (else it allocates), the columns ``keys``
    together name its key, and the columns ``time`` order the events (most significant
    first; events of equal time in the order listed, a step's allocations before its
    frees). Under each key an allocation becomes what is live (what it replaces is
    never released) and a free releases what is live, leaving nothing. Returns
    ``(released, until)``: per free, the place of the allocation it releases, or -1; per
    allocation, the place of the event that ends its life (the free that releases it or
    the allocation that replaces it), or the number of events."""
    import numpy as np
    n = len(free)
    order = np.lexsort(tuple(reversed(time)) + tuple(reversed(keys)))
    same = np.ones(max(n - 1, 0), dtype=bool)  # each event and the next, by key and time
    for column in keys:
        column = column[order]
        same &= column[1:] == column[:-1]
    freeing = free[order]
    released = np.full(n, -1, dtype=np.int64)
    hit = same & freeing[1:] & ~freeing[:-1]
    released[order[1:][hit]] = order[:-1][hit]
    until = np.full(n, n, dtype=np.int64)
    ended = same & ~freeing[:-1]
    until[order[:-1][ended]] = order[1:][ended]
    return released, until


def step_effects(op: Op, rank: int, chain: Chain, stored: Callable, buffer: Callable
                 ) -> tuple[list, list]:
    """What one step of ``rank`` allocates and frees (§2.6): ``(allocs, frees)``, each
    alloc ``(key, (what, item, size))`` (it becomes what is live under that key; the
    allocations count before the frees), each free a key (it frees what is live under
    that key, if anything). ``stored(stage, segment)`` and ``buffer(payload)`` give the
    sizes. A forward (or recompute) keeps its activation where the chain says so; ``B`` or
    ``W`` frees it; a receive allocates its buffer (none of size 0), which the op
    consuming its token frees. Device memory only (§2.10): an ``OFFLOAD`` frees the stored
    activation, a ``RELOAD`` allocates it again (what host memory holds: ``host_peaks``);
    a ``SEND`` that lends or returns it frees it, the ``RECV`` allocates it (its stored
    size) on the receiving rank."""
    kind = type(op)
    if kind is Offload or kind is Reload:
        key = ("stored", op.segment, op.stage, op.mb)
        if kind is Offload:
            return [], [key]
        return [(key, ("reloaded activation of", op, stored(op.stage, op.segment)))], []
    allocs, frees = [], []
    for c in computes_of(op):
        if c.kind in (FORWARD, RECOMPUTE):
            if chain.stores(c, rank):
                size = stored(c.stage, c.segment)
                allocs.append((("stored", c.segment, c.stage, c.mb), ("activation of", c, size)))
        elif c.kind in (BACKWARD, WEIGHT_GRAD):
            frees.append(("stored", c.segment, c.stage, c.mb))
        # a receive buffer is freed by the op that consumes its token (§2.6)
        frees.extend(("buffer", t) for t in chain.needs(c, rank) if t[0] in TRANSFER_TOKENS)
    for r in p2p_of(op):
        p = r.payload
        if p.kind in RANK_MOVES:  # §2.10: a lent activation lives on the holder's device
            key = ("stored", p.segment, p.stage, p.mb)
            if isinstance(r, Send):
                frees.append(key)
            else:
                allocs.append((key, ("moved activation of", r, stored(p.stage, p.segment))))
        elif isinstance(r, Recv):
            size = buffer(r.payload)
            if size:
                allocs.append((("buffer", payload_token(r.payload)), ("receive buffer of", r, size)))
    return allocs, frees


BIG = 2**52  # integer sizes summed below this are exact as floats too


def memory_moves(table: OpTable, model: MemoryModel, extra=()) -> tuple | None:
    """``memory_steps`` of every rank by columns: per op of the table, what it allocates
    and what it frees, as integer arrays. ``step_effects`` is evaluated per op class
    (``rule_columns``) and what each free releases is ``lifetimes``'. None when receive
    buffers are not free (their size may depend on more than an op's class), a size or a
    number of ``extra`` (the static parts and limits the sums will meet) is not an
    integer, they could sum beyond ``BIG`` (where float sums stop being exact), or the
    table cannot state the rules."""
    if not model.buffers_free:
        return None
    chain = Chain.of(table.plan)

    def effects(rank, op):
        return step_effects(op, rank, chain, model.stored, model.received)
    allocs = table.rule_columns(lambda rank, op: [(entry[2],) + _flat(key) for key, entry
                                                  in effects(rank, op)[0]])
    frees = table.rule_columns(lambda rank, op: [_flat(key) for key in effects(rank, op)[1]])
    if allocs is None or frees is None:
        return None
    sizes = [name[0] for name in allocs[3]] + list(extra)
    if not all(integral(x) for x in sizes) or \
            sum(abs(int(x)) for x in sizes) * (table.plan.num_ops + 1) >= BIG:
        return None
    return _released(table, allocs, frees)


def _flat(key: tuple) -> tuple:
    """A memory key with its microbatch last: ``("stored", seg, stage, mb)`` as it is,
    ``("buffer", token)`` as ``("buffer", *token)``."""
    return key if key[0] != "buffer" else ("buffer",) + key[1]


def integral(x) -> bool:
    """An int, or a finite float with an integer value."""
    return isinstance(x, (int, float)) and math.isfinite(x) and float(x).is_integer()


def _released(table: OpTable, allocs, frees) -> tuple:
    """Per op: what it allocates and what it frees (integers), from ``rule_columns`` of
    the allocations (size first) and the frees."""
    import numpy as np
    a_row, a_tok, a_shift, a_names = allocs
    f_row, f_tok, f_shift, f_names = frees
    names: dict = {}
    for name in a_names:
        names.setdefault(name[1:], len(names))
    a_name = np.array([names[name[1:]] for name in a_names] or [0], dtype=np.int64)
    f_name = np.array([names.get(name, -1) for name in f_names] or [0], dtype=np.int64)
    a_size = np.array([int(name[0]) for name in a_names] or [0], dtype=np.int64)
    # the events of each step, allocations (phase 0) before frees (phase 1), ordered by
    # rank, key and microbatch: a free releases the size of the event just before it on
    # its key if that is an allocation (what it left live), else nothing
    rows = np.concatenate([a_row, f_row])
    name = np.concatenate([a_name[a_tok], f_name[f_tok]])
    mb = table.mb[rows] + np.concatenate([a_shift, f_shift])
    free = np.concatenate([np.zeros(len(a_row), bool), np.ones(len(f_row), bool)])
    size = np.concatenate([a_size[a_tok], np.zeros(len(f_row), np.int64)])
    # a key is (rank, name, microbatch); a step's allocations come before its frees
    released = lifetimes(free, (table.rank[rows], name, mb), (rows, free))[0]
    hit = np.flatnonzero(released >= 0)
    n = len(table.cls)
    alloc = np.bincount(rows, weights=size, minlength=n).astype(np.int64) if len(rows) \
        else np.zeros(n, np.int64)
    freed = np.bincount(rows[hit], weights=size[released[hit]], minlength=n).astype(
        np.int64) if len(hit) else np.zeros(n, np.int64)
    return alloc, freed


def memory_levels(plan: Plan, rank: int, model: MemoryModel = UNIT_MEMORY,
                  exact: Callable | None = None):
    """Per step of ``rank``: ``(before, allocated, freed, after)``, starting from the
    static part; the step's peak is ``before + allocated`` (allocations count before
    frees). Numbers are summed as the model gives them (a step that moves nothing keeps
    ``before`` as it is); with ``exact``, every size and the static part are ``exact(x)``
    (``memory_steps``)."""
    static = model.static_of(rank)
    level = static if exact is None else exact(static)
    for alloc, freed in memory_steps(plan, rank, model, exact=exact)[0]:
        after = level + (alloc - freed) if alloc or freed else level
        yield level, alloc, freed, after
        level = after


def column_levels(counts, alloc, freed, statics):
    """``memory_levels`` of every rank by columns, for integer moves (``memory_moves``):
    per rank (``counts`` ops each, rank-major), the arrays ``(before, allocated, freed,
    after)`` of its steps from its static part. The same carry as ``memory_levels``, as a
    cumulative sum (exact for integers below ``BIG``, where the op-by-op sum of floats is
    too)."""
    import numpy as np
    start = 0
    for rank, count in enumerate(counts):
        a, f = alloc[start:start + count], freed[start:start + count]
        start += count
        after = statics[rank] + np.cumsum(a - f)
        yield after - (a - f), a, f, after


def memory_trace(plan: Plan, rank: int, model: MemoryModel = UNIT_MEMORY) -> list[float]:
    """Each step's peak level on ``rank`` (static part included)."""
    return [before + alloc for before, alloc, _, _ in memory_levels(plan, rank, model)]


def live_tensors(plan: Plan, rank: int, index: int, model: MemoryModel = UNIT_MEMORY
                 ) -> list[tuple[str, float]]:
    """The tensors live on ``rank`` at the peak of step ``index``."""
    return memory_steps(plan, rank, model, live_at=index)[1]


def host_peaks(plan: Plan, model: MemoryModel = UNIT_MEMORY) -> dict[int, float]:
    """Per rank that offloads anything, the peak of its host memory (§2.10): an
    ``OFFLOAD`` puts its activation's stored size there, the ``RELOAD`` of that activation
    takes it back (host memory has no limit; device memory is what ``peak_memory`` says)."""
    out = {}
    for rank, program in enumerate(plan.programs):
        level, peak, held = 0.0, 0.0, {}
        for op in program:
            kind = type(op)
            if kind is not Offload and kind is not Reload:
                continue
            key = (op.segment, op.stage, op.mb)
            if kind is Offload and key not in held:
                held[key] = model.stored(op.stage, op.segment)
                level += held[key]
                peak = max(peak, level)
            elif kind is Reload and key in held:
                level -= held.pop(key)
        if peak or held:
            out[rank] = peak
    return out


def peak_memory(plan: Plan, model: MemoryModel = UNIT_MEMORY) -> dict[int, tuple[float, int]]:
    """Per rank: ``(peak, index of the step where it is first reached)`` (-1 if empty)."""
    out = {}
    for rank in range(plan.num_ranks):
        levels = memory_trace(plan, rank, model)
        if not levels:
            out[rank] = (model.static_of(rank), -1)
            continue
        peak = max(levels)
        out[rank] = (peak, levels.index(peak))
    return out


