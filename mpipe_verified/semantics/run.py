"""How a plan runs (docs/semantics.md §2.1-2.4): one runner, ``run_steps``, over flat
steps, each posted when its rank reaches it and done once the steps it waits for are
posted, after its cost. ``execute`` (any plan: durations, rendezvous or eager, groups and
collectives) and ``comm_ticks`` (the deadlock run of a table's plan by columns, every
meeting a tick) both call it; they differ only in the steps they hand it.

``schedule_times`` is the data-flow timing of compute-only programs (inputs across the
chain, implicit transfers), with collectives grouped as ``pairing.pair_collectives``
groups them. It is not handed to ``run_steps``: its ops wait for tokens (a producer's
finish plus the transfer delay, wherever the token first appears), not for a partner's
post, and it runs before any transfer exists (lowering times a schedule with it).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable

import attrs

from ..ir import (BACKWARD, FORWARD, INPUT_GRAD, NO_CUT, RECOMPUTE, WEIGHT_GRAD, Collective,
                  Cut, Group, Offload, Op, Placement, Plan, Recv, Reload, Send, computes_of)
from .pairing import (CollectivePairing, P2PColumns, P2PPairing, collective_instances,
                      p2p_columns, pair_collectives, pair_p2p)
from .rules import Chain, Token, offloads, payload_token, produces
from .table import OpTable

RENDEZVOUS, EAGER = "rendezvous", "eager"
COMM_MODELS = (RENDEZVOUS, EAGER)


@attrs.frozen
class Wait:
    """Rank ``rank`` is stuck at ``index`` waiting for ``on`` (a position on another rank,
    or None when nothing can ever arrive)."""

    rank: int
    index: int
    on: tuple[int, int] | None
    reason: str


@attrs.frozen
class Execution:
    """Result of running a plan. ``start``/``finish`` give each executed op's times
    (per rank, aligned with the program); a stuck rank's list stops at its blocked op.
    ``waits`` holds one entry per rank that did not finish."""

    start: tuple[tuple[float, ...], ...]
    finish: tuple[tuple[float, ...], ...]
    waits: tuple[Wait, ...]

    @property
    def completed(self) -> bool:
        return not self.waits

    @property
    def makespan(self) -> float:
        return max((f[-1] for f in self.finish if f), default=0.0)


def unit_duration(op: Op) -> float:
    """One step for a compute op, zero for comm and bookkeeping."""
    return float(len(computes_of(op)) > 0)


NEVER, FREE, SEVERAL = -1, -2, -3  # a step's wait: forever, nothing, each of several steps


def run_steps(bounds: list[int], wait: list[int], cost: list, zero=0,
              several: dict | None = None) -> tuple[list, list, list[int], list[int]]:
    """The one runner of §2.1-2.4. Steps are numbered rank-major: rank ``r``'s are
    ``bounds[r]`` to ``bounds[r + 1] - 1``, in program order. A rank posts a step when it
    reaches it (when the step before it finishes; ``zero`` first); the step waits for the
    post of ``wait[k]`` (another step; ``NEVER``: forever; ``FREE``: nothing;
    ``SEVERAL``: each step of ``several[k]`` in order, a ``NEVER`` among them forever)
    and finishes ``cost[k]`` after the latest of its own post and theirs. Each rank
    advances until it blocks and is woken when the step it waits for is posted: linear
    time, one visit per step and per wake-up.

    Returns ``(posted, finish, at, blocked)``: per step its post and finish times (None
    where never reached or finished); per rank the first step it did not finish
    (``bounds[r + 1]``: all done) and, if stuck, the step it waits for (``NEVER``: none
    can come)."""
    n = len(bounds) - 1
    posted: list = [None] * len(wait)
    finish: list = [None] * len(wait)
    waiters: list = [None] * len(wait)  # the ranks waiting for each step to be posted
    at, ready, blocked = bounds[:-1], [zero] * n, [NEVER] * n
    todo = list(range(n))
    while todo:
        rank = todo.pop()
        k, end, t = at[rank], bounds[rank + 1], ready[rank]
        while k < end:
            posted[k] = t
            woken = waiters[k]
            if woken is not None:
                todo.extend(woken)
                waiters[k] = None
            other = wait[k]
            if other >= 0:  # one step (a send's or receive's partner)
                seen = posted[other]
                if seen is None:
                    _wait_for(waiters, other, rank)
                    blocked[rank] = other
                    break
                if seen > t:
                    t = seen
            elif other != FREE:
                if other == SEVERAL:
                    other, latest = _latest(several[k], posted, t)
                    if other == FREE:
                        t = latest
                if other != FREE:
                    if other >= 0:
                        _wait_for(waiters, other, rank)
                    blocked[rank] = other
                    break
            t += cost[k]
            finish[k] = t
            k += 1
        at[rank], ready[rank] = k, t
    return posted, finish, at, blocked


def _wait_for(waiters: list, step: int, rank: int) -> None:
    if waiters[step] is None:
        waiters[step] = [rank]
    else:
        waiters[step].append(rank)


def _latest(steps, posted: list, t) -> tuple:
    """``(FREE, the latest of t and the posts of steps)`` once every one is posted, else
    ``(the first step not posted, t)`` (``NEVER`` when a step can never be)."""
    for step in steps:
        if step < 0:
            return NEVER, t
        seen = posted[step]
        if seen is None:
            return step, t
        if seen > t:
            t = seen
    return FREE, t


def execute(plan: Plan, comm_model: str = RENDEZVOUS,
            duration: Callable[[Op], float] = unit_duration,
            comm_time: Callable[[Op], float] = lambda op: 0.0,
            p2p: P2PPairing | None = None,
            collectives: CollectivePairing | None = None,
            copy_time: Callable[[Op], float] | None = None) -> Execution:
    """Run ``plan`` under §2.1–2.4 and return every op's start/finish time.

    Each rank runs its ops in order. A compute op takes ``duration(op)``. Under
    ``rendezvous`` a send or receive completes when both ends are posted, at the later
    post time plus ``comm_time``; a ``Group`` posts all members at once and completes
    when all have matched; a collective completes when every member has reached it.
    Under ``eager`` a send completes at once and a receive when its send has been posted.
    Ops with no partner block forever. ``run_steps`` runs it, in time linear in the plan
    size; an op's start is its post.

    ``copy_time`` (the simulator's, None: moves are instant): each ``OFFLOAD``/``RELOAD``
    also runs on a copy stream of its rank (offloads on one, device to host; reloads on
    another, host to device, each after its activation's offload), in program order, from
    its post for ``copy_time(op)``, overlapping compute; the first backward (``B`` or
    ``I``) of a reloaded activation after its ``RELOAD`` waits for that copy to finish (a
    reload posted too late stalls it). The copy streams are extra ranks of ``run_steps``.
    """
    p2p = p2p or pair_p2p(plan)
    collectives = collectives or pair_collectives(plan)
    programs = plan.programs
    bounds = [0]
    for program in programs:
        bounds.append(bounds[-1] + len(program))
    wait, cost, several = _op_steps(plan, bounds, comm_model == EAGER, duration, comm_time,
                                    p2p, collectives)
    real = bounds
    if copy_time is not None:
        bounds = _copy_streams(plan, real, wait, cost, copy_time)
    posted, finish, at, blocked = run_steps(bounds, wait, cost, 0.0, several)
    if bounds is not real and any(at[r] < real[r + 1] for r in range(plan.num_ranks)):
        return execute(plan, comm_model, duration, comm_time, p2p, collectives)
    bounds = real
    start = tuple(tuple(posted[bounds[r]:at[r]]) for r in range(plan.num_ranks))
    done = tuple(tuple(finish[bounds[r]:at[r]]) for r in range(plan.num_ranks))
    waits = tuple(_describe_wait(plan, r, at[r] - bounds[r], _position(bounds, blocked[r]),
                                 collectives)
                  for r in range(plan.num_ranks) if at[r] < bounds[r + 1])
    return Execution(start, done, waits)


def _op_steps(plan, bounds, eager, duration, comm_time, p2p, collectives) -> tuple:
    """``run_steps``'s ``(wait, cost, several)`` for the ops of ``plan``: a compute or
    bookkeeping op waits for nothing and costs ``duration(op)``; a send or receive waits
    for its partner (an eager send for nothing), a group for the partner of each member
    (in member order; an eager send for nothing), a collective for every member's call of
    its instance (in member order), and each costs ``comm_time(op)``; an end without a
    partner, or a call whose instance misses a member, waits forever."""
    wait: list[int] = []
    cost: list = []
    several: dict[int, list[int]] = {}
    partner = p2p.partner
    for rank, program in enumerate(plan.programs):
        for index, op in enumerate(program):
            kind = type(op)
            if kind is Send or kind is Recv:
                other = partner.get((rank, index, 0))
                wait.append(FREE if eager and kind is Send else
                            NEVER if other is None else bounds[other[0]] + other[1])
            elif kind is Group or kind is Collective:
                several[len(wait)] = (_call_waits(rank, index, collectives, bounds)
                                      if kind is Collective else
                                      _group_waits(rank, index, op, eager, partner, bounds))
                wait.append(SEVERAL)
            else:
                wait.append(FREE)
                cost.append(duration(op))
                continue
            cost.append(comm_time(op))
    return wait, cost, several


def _copy_streams(plan: Plan, bounds: list[int], wait: list, cost: list,
                  copy_time: Callable[[Op], float]) -> list[int]:
    """``bounds`` with the copy streams of each rank that moves activations appended as
    ranks to ``wait``/``cost`` (see ``execute``): offloads on one (device to host),
    reloads on another (host to device). Per move a copy step, waiting for the move's
    post, then a done step, posted when the copy finishes; a reload first waits for its
    activation's offload to be done, and the first backward of a reloaded activation
    after its ``RELOAD`` waits for the reload's done step."""
    out = list(bounds)
    for rank, program in enumerate(plan.programs):
        moves = [(index, op) for index, op in enumerate(program)
                 if type(op) is Offload or type(op) is Reload]
        if not moves:
            continue
        offloaded: dict[tuple, int] = {}  # (segment, stage, mb) -> its offload's done step
        reloaded: dict[int, tuple] = {}  # a reload's position -> (key, its done step)
        for stream in (Offload, Reload):
            first = len(wait)
            for index, op in moves:
                if type(op) is not stream:
                    continue
                key = (op.segment, op.stage, op.mb)
                if stream is Reload and key in offloaded:
                    wait.append(offloaded[key])  # the copy back after the copy out
                    cost.append(0.0)
                wait.append(bounds[rank] + index)
                cost.append(copy_time(op))
                wait.append(FREE)
                cost.append(0.0)
                if stream is Offload:
                    offloaded[key] = len(wait) - 1
                else:
                    reloaded[index] = (key, len(wait) - 1)
            if len(wait) > first:
                out.append(len(wait))
        _wait_for_reloads(program, bounds[rank], wait, reloaded)
    return out


def _wait_for_reloads(program, base: int, wait: list, reloaded: dict) -> None:
    """The first backward (``B`` or ``I``) of each reloaded activation after its
    ``RELOAD`` waits for that reload's done step (``reloaded``: by the reload's
    position)."""
    due: dict[tuple, int] = {}
    for index, op in enumerate(program):
        if index in reloaded:
            key, done = reloaded[index]
            due[key] = done
            continue
        if not due or wait[base + index] != FREE:
            continue
        for c in computes_of(op):
            if c.kind in (BACKWARD, INPUT_GRAD):
                done = due.pop((c.segment, c.stage, c.mb), None)
                if done is not None:
                    wait[base + index] = done
                    break


def _group_waits(rank, index, op, eager, partner, bounds) -> list[int]:
    """The steps a group waits for: each member's partner, in member order (an eager send
    none; ``NEVER`` for a member without a partner)."""
    out = []
    for member, c in enumerate(op.ops):
        if eager and isinstance(c, Send):
            continue  # buffered: never blocks, partner or not
        other = partner.get((rank, index, member))
        out.append(NEVER if other is None else bounds[other[0]] + other[1])
    return out


def _call_waits(rank, index, collectives: CollectivePairing, bounds) -> list[int]:
    """The steps a collective call waits for: every member's call of its instance, in
    member order (``NEVER`` when the caller is no member or a member never calls)."""
    key = collectives.instance_of.get((rank, index))
    if key is None:
        return [NEVER]
    where = collectives.members[key]
    return [bounds[r] + where[r] if r in where else NEVER for r in key[0]]


def _position(bounds: list[int], step: int) -> tuple[int, int] | None:
    """The ``(rank, index)`` of a step (None for ``NEVER``)."""
    if step < 0:
        return None
    rank = bisect_right(bounds, step) - 1
    return rank, step - bounds[rank]


def _describe_wait(plan, rank, index, on, collectives: CollectivePairing) -> Wait:
    op = plan.programs[rank][index]
    if on is None and type(op) is Collective:
        return Wait(rank, index, None, _collective_never(op, rank, index, collectives))
    if on is None:
        return Wait(rank, index, None, f"{op} has no matching partner: it waits forever")
    return Wait(rank, index, on, f"{op} waits for rank {on[0]} to reach position {on[1]} "
                                 f"({plan.programs[on[0]][on[1]]})")


def _collective_never(op: Collective, rank: int, index: int,
                      collectives: CollectivePairing) -> str:
    """Why a collective call can never complete: its caller is not a member, or some
    member never makes the same call (its instance, ``pair_collectives``)."""
    if (rank, index) not in collectives.instance_of:
        return f"{op} never completes: rank {rank} is not one of its members"
    group, k = collectives.instance_of[(rank, index)]
    absent = [r for r in group if r not in collectives.members[(group, k)]]
    who = f"rank {absent[0]} never makes" if len(absent) == 1 else f"ranks {absent} never make"
    return f"{op} waits forever: {who} call #{k} over ranks {list(group)}"


def wait_cycle(execution: Execution) -> list[Wait]:
    """The wait-for cycle among stuck ranks (each stuck rank waits on exactly one
    position; following those edges from any rank that waits on a stuck rank ends in a
    cycle). Empty when the stuck ranks only wait on missing partners."""
    by_rank = {w.rank: w for w in execution.waits}
    for w in execution.waits:
        path: list[Wait] = []
        seen: dict[int, int] = {}
        cur = w
        while cur is not None and cur.rank not in seen:
            seen[cur.rank] = len(path)
            path.append(cur)
            cur = by_rank.get(cur.on[0]) if cur.on is not None else None
        if cur is not None:
            return path[seen[cur.rank]:]
    return []


def comm_ticks(table: OpTable, comm_model: str = RENDEZVOUS,
               pairs: P2PColumns | None = None) -> tuple | None:
    """``execute(plan, comm_model, duration=0, comm_time=1)`` on the table's plan, by
    columns: per rank, the finish time of each comm step, or None when the run gets stuck
    (``execute`` then says where). Compute, idle and marker steps take no time, so
    ``run_steps`` is handed the comm steps alone (``p2p_columns``' rows, rank-major),
    each waiting for its partner (an eager send for nothing, an end without a partner
    forever) and costing a tick."""
    import numpy as np
    pairs = pairs or p2p_columns(table)
    n = table.plan.num_ranks
    bounds = np.searchsorted(table.rank[pairs.rows], np.arange(n + 1)).tolist()
    wait = pairs.partner  # the end each end waits for (-1: none, NEVER)
    if comm_model == EAGER:
        wait = np.where(pairs.send, FREE, wait)
    _, finish, at, _ = run_steps(bounds, wait.tolist(), [1] * len(pairs.rows))
    if at != bounds[1:]:
        return None
    return tuple(tuple(finish[bounds[r]:bounds[r + 1]]) for r in range(n))


# ---------------------------------------------------------------- compute-only timing


STANDARD_DURATIONS = {FORWARD: 1.0, BACKWARD: 2.0, INPUT_GRAD: 1.0, WEIGHT_GRAD: 1.0,
                      RECOMPUTE: 1.0}


def standard_duration(op: Op) -> float:
    """Unit cost model: ``F`` 1, ``B`` 2, ``I`` 1, ``W`` 1, ``R`` 1; an overlapped step
    costs the sum of its ops; everything else is free."""
    return sum(STANDARD_DURATIONS[c.kind] for c in computes_of(op))


@attrs.frozen
class ScheduleTiming:
    """Times of a compute-only schedule whose transfers are implicit: an op starts when
    its rank is free and its inputs have arrived (``delay`` after they were produced).
    ``start[r]`` covers the ops that could run; ``stuck`` names each rank that could not
    finish, its op index and the token it waits for."""

    start: tuple[tuple[float, ...], ...]
    finish: tuple[tuple[float, ...], ...]
    stuck: tuple[tuple[int, int, Token], ...]

    @property
    def makespan(self) -> float:
        return max((f[-1] for f in self.finish if f), default=0.0)


def schedule_times(programs, placement: Placement,
                   duration: Callable[[Op], float] = standard_duration,
                   delay: float = 0.0, cut: Cut = NO_CUT,
                   forward_only: bool = False, chain: "Chain | None" = None,
                   seq_chunks: int = 1) -> ScheduleTiming:
    """Data-flow timing of compute-only programs (§2.5 inputs across the chain, implicit
    transfers). Linear time: each rank advances until an input is missing, then waits.
    Collectives in a compute-only schedule are timed as zero-cost barriers: a call
    finishes when every member has reached its call of the same instance
    (``pairing.collective_instances``). ``chain``: the programs' chain when the caller
    has one (its ``destinations`` are then computed once for both)."""
    chain = chain or Chain(placement, cut, forward_only, offloaded=offloads(programs),
                           seq_chunks=seq_chunks)
    make = produces if chain.seq_chunks == 1 else chain.produces
    n = placement.num_ranks
    have: list[dict[tuple, float]] = [dict() for _ in range(n)]
    start: list[list[float]] = [[] for _ in range(n)]
    finish: list[list[float]] = [[] for _ in range(n)]
    waiting: dict[tuple[int, tuple], int] = {}
    arrivals: dict[tuple, dict[int, float]] = {}
    calls: list[CollectivePairing] = []  # the instances, found at the first collective
    todo = list(range(n))
    while todo:
        rank = todo.pop()
        program, here, starts, finishes = programs[rank], have[rank], start[rank], finish[rank]
        free = finishes[-1] if finishes else 0.0
        while len(starts) < len(program):
            op = program[len(starts)]
            t0, missing = _ready_at(chain.needs(op, rank), here, free)
            collective = type(op) is Collective
            if collective:
                if not calls:
                    calls.append(collective_instances(programs, n))
                barrier, group = _barrier(calls[0], rank, len(starts))
                if missing is None:
                    missing = _arrive(barrier, group, rank, free, arrivals, have)
                    if missing is None:
                        t0 = max(t0, here[barrier])
            if missing is not None:
                waiting[(rank, missing)] = rank
                break
            free = t0 + duration(op)
            starts.append(t0)
            finishes.append(free)
            for token in make(op):
                here.setdefault(token, free)
            for c in computes_of(op):
                for there, payload in chain.destinations(c, rank):
                    token = payload_token(payload)
                    have[there].setdefault(token, free + delay)
                    if waiting.pop((there, token), None) is not None:
                        todo.append(there)
            for member in (group if collective else ()):
                if waiting.pop((member, barrier), None) is not None:
                    todo.append(member)
    stuck = tuple((r, len(start[r]), Token(*tok)) for (r, tok) in waiting
                  if len(start[r]) < len(programs[r]))
    return ScheduleTiming(tuple(map(tuple, start)), tuple(map(tuple, finish)),
                          tuple(sorted(stuck)))


def _ready_at(wanted, have: dict, free: float) -> tuple[float, tuple | None]:
    """``(when every token of wanted is there and the rank is free, None)``, or ``(_, the
    first missing token)``."""
    t0 = free
    for token in wanted:
        at = have.get(token)
        if at is None:
            return t0, token
        if at > t0:
            t0 = at
    return t0, None


def _barrier(calls: CollectivePairing, rank: int, index: int) -> tuple[tuple, tuple]:
    """``(token, members)`` of the collective call at ``(rank, index)``: the token means
    "every member reached its call of this instance" (instance k over ranks G:
    ``("barrier", "G", k, 0)``); a caller outside the set gets its call's token and no
    members (it never passes)."""
    key = calls.instance_of.get((rank, index))
    group = key[0] if key is not None else ()
    if key is None:  # not a member: its call is numbered all the same
        key = next(k for k, where in calls.members.items() if where.get(rank) == index)
    return ("barrier", ",".join(map(str, key[0])), key[1], 0), group


def _arrive(token, group, rank, free, arrivals, have) -> tuple | None:
    """Record that ``rank`` reached its call (``token``); once every member has, publish
    the token to every member at the latest arrival (a caller outside the set never
    arrives). Returns the token still missing (None: the barrier is passed)."""
    if group:
        arrived = arrivals.setdefault(token, {})
        arrived[rank] = free
        if len(arrived) == len(group):
            at = max(arrived.values())
            for member in group:
                have[member].setdefault(token, at)
    return None if token in have[rank] else token
