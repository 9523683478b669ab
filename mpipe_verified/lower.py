"""Lowering: compute-only schedule → plan with ``SEND``/``RECV`` (the algebra's ``lower``).

Construction: time the schedule (``semantics.schedule_times``) with the cost model's
durations (the standard unit costs by default; a spec may lower with its own ``[cost]``
so the order of its transfers fits the run it will have), then replay one global event
list: each compute op at its start time, and each transfer as a *pair* — the ``SEND``
appended on the producer's rank and the matching ``RECV`` on the consumer's rank — at the
producer's finish time (transfers before computes at equal times; among transfers at
equal times, each rank's sends before its receives along a chain of stages,
``_send_first``). Every rank's program is the projection of that list (each rank's own
events sorted by the list's order), so the list itself is a run
in which each pair meets at once: the plan completes under rendezvous with every op posted
on its own (no groups needed, so the torch CSV form runs as written), and per-pair FIFO
order holds because both ends of the k-th pair are appended by the same event. Stages on
one rank exchange nothing.

The guarantees hold for any durations: they only use that the event list is a run. A
compute op's duration is taken as at least a tiny positive amount (1e-9 of the total, so
it still advances the clock), so a transfer never sorts before the op that produces it (a
zero-cost segment forward, mode ``none``).

Several pipelines (docs/semantics.md §2.9): each rank that holds a replica of a model
stage whose replicas sit on several ranks ends with the all-reduce ``replica:J``, in
ascending J on every rank, after all its work (so after every backward it needs).

A schedule that cannot run (a rank waits for an input that never comes) still lowers, so
the verifier can say why: the ops after the stuck point keep their order, each ``SEND``
right after its producer and each ``RECV`` right before its consumer.
"""

from __future__ import annotations

from typing import Callable

import attrs

from .ir import Collective, Idle, Op, Plan, Recv, Schedule, Send, build_many, computes_of
from .semantics import (REPLICA, Chain, offloads, payload_token, schedule_times,
                        standard_duration)


def lower(schedule: Schedule, duration: Callable[[Op], float] = standard_duration) -> Plan:
    """Insert communication, ordered by a run with ``duration``; see the module docstring
    for the guarantees. The plan keeps the schedule's pipelines and sequence chunks."""
    plan = _lowered(schedule, duration)
    plan = attrs.evolve(plan, pipelines=schedule.pipelines) if schedule.pipelines else plan
    return plan if schedule.seq_chunks == 1 else attrs.evolve(plan, seq_chunks=schedule.seq_chunks)


def _lowered(schedule: Schedule, duration: Callable[[Op], float]) -> Plan:
    placement = schedule.placement
    programs = schedule.programs
    chain = Chain(placement, schedule.cut, schedule.forward_only, schedule.pipelines,
                  offloads(schedule.programs), schedule.seq_chunks)
    total = sum(duration(op) for prog in programs for op in prog if computes_of(op))
    tiny = 1e-9 * (total if total > 0 else 1.0)  # resolvable at every time of the run

    def at_least_tiny(op: Op) -> float:
        d = duration(op)
        return d if d >= tiny or not computes_of(op) else tiny
    timing = schedule_times(programs, placement, at_least_tiny, chain=chain)
    events: list[list[tuple]] = [[] for _ in programs]  # per rank: (time, ..., op)
    moved: list[tuple] = []  # per transfer: its key, and where its payload goes
    for rank, program in enumerate(programs):
        starts, finishes, mine = timing.start[rank], timing.finish[rank], events[rank].append
        for index in range(len(starts)):
            op = program[index]
            if type(op) is Idle:
                continue
            mine((starts[index], 1, _NO_TIE, rank, index, 0, op))
            for c in computes_of(op):
                for member, (there, payload) in enumerate(chain.destinations(c, rank)):
                    moved.append(((finishes[index], 0, _send_first(payload), rank, index,
                                   member), there, payload))
    _add_transfers(events, moved)
    out: list[list[Op]] = []
    for mine in events:  # each rank's projection of the one sorted event list
        mine.sort()  # (kind, producer rank, index, member) tell any two apart: no op compared
        out.append([event[6] for event in mine])
    if any(len(timing.start[rank]) < len(program) for rank, program in enumerate(programs)):
        _append_stuck(out, programs, timing, chain)
    _append_replica_sums(out, chain)
    return Plan(placement, schedule.num_microbatches, tuple(map(tuple, out)), schedule.cut,
                schedule.forward_only)


def _add_transfers(events: list[list[tuple]], moved: list[tuple]) -> None:
    """Each transfer's two events: its ``SEND`` on the producer's rank, its ``RECV`` on
    ``there``, both under its key. The ops are built in bulk (``ir.build_many``): the
    ranks are the placement's and the payloads the chain's, already checked."""
    keys, there, payloads = zip(*moved) if moved else ((), (), ())
    sends = build_many(Send, len(moved), {"dst": there, "payload": payloads})
    recvs = build_many(Recv, len(moved), {"src": [k[3] for k in keys], "payload": payloads})
    for key, to, send, recv in zip(keys, there, sends, recvs):
        events[key[3]].append(key + (send,))
        events[to].append(key + (recv,))


def with_replica_sums(plan: Plan) -> Plan:
    """``plan`` with the replica all-reduces its pipelines require appended where missing
    (as ``lower`` places them); ``plan`` itself when it has one pipeline."""
    if not plan.pipelines:
        return plan
    out = [list(prog) for prog in plan.programs]
    _append_replica_sums(out, Chain.of(plan))
    return attrs.evolve(plan, programs=tuple(map(tuple, out)))


def _append_replica_sums(out: list[list[Op]], chain: Chain) -> None:
    """Several pipelines: each rank holding a replica of a model stage J whose replicas
    sit on several ranks ends its program with the all-reduce ``replica:J`` (after all its
    work), in ascending J on every rank (one agreed order: no collective waits on
    another). A call the schedule already makes is kept, not repeated."""
    made: dict[int, set] = {}  # per rank, the tags of the collectives it calls already
    for tag, (kind, _, ranks) in sorted(chain.required_collectives().items(),
                                        key=lambda item: _replica_order(item[0])):
        if not tag.startswith(REPLICA + ":"):
            continue
        for rank in sorted(ranks):
            if rank not in made:
                made[rank] = ({op.tag for op in out[rank] if type(op) is Collective}
                              if Collective in set(map(type, out[rank])) else set())
            if tag not in made[rank]:
                out[rank].append(Collective(kind, tuple(sorted(ranks)), tag))


def _replica_order(tag: str) -> tuple:
    role, _, name = tag.partition(":")
    return (role, int(name) if name.isdigit() else -1, name)


def _append_stuck(out: list[list[Op]], programs, timing, chain: Chain) -> None:
    """Append each rank's ops after its stuck point, in program order: each ``SEND`` right
    after its producer, each ``RECV`` right before the first op that needs its token."""
    late: dict[tuple[int, int], list[Op]] = {}
    early: dict[tuple[int, int], list[Op]] = {}
    needed = _first_needs(programs, chain)
    for rank, program in enumerate(programs):
        for index in range(len(timing.start[rank]), len(program)):
            for c in computes_of(program[index]):
                for there, payload in chain.destinations(c, rank):
                    late.setdefault((rank, index), []).append(Send(there, payload))
                    consumer = needed[there].get(payload_token(payload))
                    if consumer is not None:
                        early.setdefault((there, consumer), []).append(Recv(rank, payload))
    for rank, program in enumerate(programs):
        for index in range(len(timing.start[rank]), len(program)):
            if isinstance(program[index], Idle):
                continue
            out[rank].extend(early.get((rank, index), ()))
            out[rank].append(program[index])
            out[rank].extend(late.get((rank, index), ()))


_NO_TIE = (0, 0)


def _send_first(payload) -> tuple[int, int]:
    """Order of transfers that happen at the same time: activations (and inputs) by
    descending producing stage, then gradients by ascending stage. Along a chain of stages
    every rank then posts its own send before it receives the next item from upstream,
    so a transfer's duration delays only its own consumer (with the rank order instead, a
    rank waits for ``RECV_F(k+1)`` before it posts ``SEND_F(k)``, and with transfer costs
    those waits chain from rank to rank)."""
    if payload.kind == "grad":
        return (1, payload.stage)
    return (0, -payload.stage)


def _first_needs(programs, chain: Chain) -> list[dict[tuple, int]]:
    """Per rank: each token's first position that needs it (``Chain.needs``), so a
    transfer's ``RECV`` goes right before the op that consumes its token."""
    out: list[dict[tuple, int]] = []
    for rank, program in enumerate(programs):
        first: dict[tuple, int] = {}
        for index, op in enumerate(program):
            for token in chain.needs(op, rank):
                first.setdefault(token, index)
        out.append(first)
    return out


def as_plan(target: Schedule | Plan, duration: Callable[[Op], float] = standard_duration
            ) -> Plan:
    """A plan as ``check`` judges it: a compute-only schedule is lowered (ordered for
    ``duration``, the spec's costs), a plan is kept."""
    return lower(target, duration) if isinstance(target, Schedule) else target
