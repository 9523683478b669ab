"""Lowering: compute-only schedule → plan with ``SEND``/``RECV`` (DESIGN §6 ``lower``).

Construction: time the schedule with the standard unit costs (``semantics.schedule_times``),
then replay one global event list: each compute op at its start time, and each transfer
as a *pair* — the ``SEND`` appended on the producer's rank and the matching ``RECV`` on the
consumer's rank — at the producer's finish time (transfers before computes at equal
times). Every rank's program is the projection of that list, so the list itself is a run
in which each pair meets at once: the plan completes under rendezvous with every op posted
on its own (no groups needed, so the torch CSV form runs as written), and per-pair FIFO
order holds because both ends of the k-th pair are appended by the same event. Stages on
one rank exchange nothing.

A schedule that cannot run (a rank waits for an input that never comes) still lowers, so
the verifier can say why: the ops after the stuck point keep their order, each ``SEND``
right after its producer and each ``RECV`` right before its consumer.
"""

from __future__ import annotations

from .ir import Compute, Idle, Op, Plan, Recv, Schedule, Send, computes_of
from .semantics import Chain, schedule_times


def lower(schedule: Schedule) -> Plan:
    """Insert communication; see the module docstring for the guarantees."""
    placement = schedule.placement
    programs = schedule.programs
    chain = Chain(placement, schedule.cut)
    timing = schedule_times(programs, placement, cut=schedule.cut)
    events: list[tuple[float, int, int, int, int, tuple]] = []
    where: dict[Compute, tuple[int, int]] = {}
    for rank, program in enumerate(programs):
        for index, op in enumerate(program):
            for c in computes_of(op):
                where[c] = (rank, index)
    late: dict[tuple[int, int], list[Op]] = {}
    early: dict[tuple[int, int], list[Op]] = {}
    for rank, program in enumerate(programs):
        timed = len(timing.start[rank])
        for index, op in enumerate(program):
            if isinstance(op, Idle):
                continue
            if index < timed:
                events.append((timing.start[rank][index], 1, rank, index, 0, (rank, op)))
            for c in computes_of(op):
                for member, (there, payload) in enumerate(chain.destinations(c, rank)):
                    send, recv = Send(there, payload), Recv(rank, payload)
                    if index < timed:
                        t = timing.finish[rank][index]
                        events.append((t, 0, rank, index, member, (rank, send, there, recv)))
                        continue
                    late.setdefault((rank, index), []).append(send)
                    consumer = _consumer_position(payload, where)
                    if consumer is not None:
                        early.setdefault(consumer, []).append(recv)
    events.sort(key=lambda e: e[:5])
    out: list[list[Op]] = [[] for _ in programs]
    for event in events:
        payload = event[5]
        if len(payload) == 2:
            out[payload[0]].append(payload[1])
        else:
            out[payload[0]].append(payload[1])
            out[payload[2]].append(payload[3])
    for rank, program in enumerate(programs):
        for index in range(len(timing.start[rank]), len(program)):
            if isinstance(program[index], Idle):
                continue
            out[rank].extend(early.get((rank, index), ()))
            out[rank].append(program[index])
            out[rank].extend(late.get((rank, index), ()))
    return Plan(placement, schedule.num_microbatches, tuple(map(tuple, out)), schedule.cut)


def _consumer_position(payload, where: dict) -> tuple[int, int] | None:
    """Where the op consuming ``payload`` runs (an activation: the consumer's ``F``; a
    gradient: its ``B`` or ``I``; an input: its ``R``), or None if the schedule lacks it."""
    seg, stage, mb = payload.consumer_segment, payload.consumer_stage, payload.mb
    kinds = {"act": ("F",), "grad": ("B", "I"), "input": ("R",)}[payload.kind]
    return next((where[c] for c in (Compute(k, stage, mb, seg) for k in kinds) if c in where),
                None)
