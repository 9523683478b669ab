"""The models the family laws reason about, expanded to concrete programs, so that
``tests/test_proofs_expanded.py`` can compare them op for op with the package's ``derive`` and
``lower``.

``SCHEDULES`` maps a family to ``(p, m, v) -> programs``: per rank, the ``(kind, stage,
mb)`` list of the closed form its laws are proven about (a family whose laws are about
the package's own derived instances, the bounded ones, has no entry). ``lowered`` expands
the lowering model of ``proofs.lowered`` for a schedule: every op and every transfer is
one event, keyed ``(time, class, order, rank, index, member)`` with the data-flow times
of ``semantics.schedule_times`` (transfers, class 0, at their producer's finish, before
the ops, class 1, starting then; among transfers at one time activations by descending
stage, then gradients by ascending stage); each rank's program is its events in key
order, a transfer appending its ``SEND`` on the producer's rank and its ``RECV`` on the
consumer's.
"""

from __future__ import annotations

from typing import Callable

from mpipe_verified.ir import GRAD, Idle, Recv, Schedule, Send, computes_of
from mpipe_verified.semantics import Chain, schedule_times

from . import families, family_interleaved, family_looped_bfs
from .model import F

Programs = tuple[tuple[tuple[str, int, int], ...], ...]


def _closed(op_of, ops_per_rank=2):
    def expand(pp: int, mm: int, vv=None) -> Programs:
        out = []
        for r in range(pp):
            prog = []
            for k in range(ops_per_rank * mm):
                kind, mb = op_of(k, r, pp, mm)
                prog.append(("F" if kind == F else "B", r, mb))
            out.append(tuple(prog))
        return tuple(out)
    return expand


SCHEDULES: dict[str, Callable[..., Programs]] = {
    "gpipe": _closed(families.gpipe_op),
    "1f1b": _closed(families.one_f_one_b_op),
    "interleaved-1f1b": family_interleaved.programs,
    "looped-bfs": family_looped_bfs.programs,
}


def _order(payload) -> tuple[int, int]:
    return (1, payload.stage) if payload.kind == GRAD else (0, -payload.stage)


def lowered(schedule: Schedule) -> tuple[tuple, ...]:
    """The lowering model's programs for ``schedule``, whose timing reaches every op
    (with several pipelines, the point-to-point body: the replica tail is left out)."""
    chain = Chain(schedule.placement, schedule.cut, pipelines=schedule.pipelines,
                  seq_chunks=schedule.seq_chunks)
    timing = schedule_times(schedule.programs, schedule.placement, cut=schedule.cut,
                            chain=chain)
    if timing.stuck:
        raise ValueError("the lowering model covers schedules whose timing reaches every op")
    events = []
    for rank, program in enumerate(schedule.programs):
        for index, op in enumerate(program):
            if isinstance(op, Idle):
                continue
            events.append(((timing.start[rank][index], 1, (0, 0), rank, index, 0),
                           ((rank, op),)))
            for c in computes_of(op):
                for member, (there, payload) in enumerate(chain.destinations(c, rank)):
                    key = (timing.finish[rank][index], 0, _order(payload), rank, index, member)
                    events.append((key, ((rank, Send(there, payload)),
                                         (there, Recv(rank, payload)))))
    out: list[list] = [[] for _ in schedule.programs]
    for _, appends in sorted(events, key=lambda e: e[0]):
        for rank, op in appends:
            out[rank].append(op)
    return tuple(map(tuple, out))
