"""What an op of a file may name (docs/semantics.md §6: bad input, not a violation): a
rank, stage or microbatch inside the ranges its plan declares, and a move of something.

A plan-json file declares its ranks (``num_ranks``), body stages (``stage_to_rank``),
microbatches (``num_microbatches``, cut by ``seq_chunks`` into samples) and segments (the
cut, one stage each); a torch CSV holds the rows and stages its cells place and the
microbatches they name, and ``check --ranks/--stages/--microbatches`` declare smaller
ones. ``beyond`` finds the first op (rank by rank, in program order) that names a rank,
stage or microbatch outside those ranges (a collective's root is judged as one of its
members: a root outside them is the verifier's); ``of_nothing`` the first ``RELOAD`` whose
activation its rank never offloads anywhere in its program, and the first end of a
``return`` whose rank never took part in a lend of that activation (the owner never sent
one, the holder never received one). A reload before its offload, an op on the wrong rank
or of another pipeline's microbatch names what the plan has: the verifier judges those.

Each finding is a ``Named``: the op's rank and place in its program, the path of the
field inside the op (``("payload", "mb")``, ``("ops", 1, "stage")``: plan-json's keys) and
the message, which each reader places in its own terms (a CSV cell, a JSON path). Time
linear in the ops; nothing is sized by an index.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from ..ir import (LEND, RANK_MOVES, RETURN, Collective, Compute, Group, Idle, Marker, Offload, Op,
                  Overlap, Plan, Recv, Reload, Schedule, Send)


class Named(NamedTuple):
    """An op at ``index`` of ``rank``'s program naming what its plan lacks; ``field``:
    the path of the offending value inside the op (empty: the op itself), ``op`` its
    text (a group's or overlap's member), ``why`` what is wrong."""

    rank: int
    index: int
    field: tuple
    op: str
    why: str

    @property
    def message(self) -> str:
        return f"{self.op}: {self.why}"


class Ranges(NamedTuple):
    """The ranks ``0..ranks-1``, body stages ``0..stages-1`` and microbatches
    ``0..microbatches-1`` a plan declares (``seq_chunks`` chunks per sample), and the
    names of its cut's segments (each one stage, stage 0)."""

    ranks: int
    stages: int
    microbatches: int
    seq_chunks: int = 1
    segments: frozenset = frozenset()

    @classmethod
    def of(cls, plan: Plan | Schedule) -> "Ranges":
        return cls(plan.placement.num_ranks, plan.placement.num_stages, plan.num_microbatches,
                   plan.seq_chunks, frozenset(s.name for s in plan.cut.segments))

    def mb(self, mb: int) -> str | None:
        """Why microbatch ``mb`` is out of range, or None."""
        m, s = self.microbatches, self.seq_chunks
        if mb < m:
            return None
        if not m:
            return f"expected no microbatch (the plan has none), got {mb}"
        why = f"expected a microbatch in 0..{m - 1}, got {mb}"
        if s > 1:
            why += (f" (chunk {mb % s} of sample {mb // s} is out of range: {m // s} samples "
                    f"of {s} chunks)")
        return why

    def stage(self, stage: int, segment: str) -> str | None:
        """Why ``stage`` of ``segment`` (``""``: the body) is out of range, or None (a
        segment the cut lacks is the verifier's to judge)."""
        if segment:
            if segment not in self.segments or stage == 0:
                return None
            return f"expected stage 0 (segment {segment!r} has one stage), got {stage}"
        if stage < self.stages:
            return None
        if not self.stages:
            return f"expected no body stage (the plan places none), got {stage}"
        return f"expected a stage in 0..{self.stages - 1}, got {stage}"

    def rank(self, rank: int) -> str | None:
        """Why ``rank`` (a peer or a collective's member) is out of range, or None."""
        return None if rank < self.ranks else (f"expected a rank in 0..{self.ranks - 1}, "
                                               f"got {rank}")


def beyond(plan: Plan | Schedule, ranges: Ranges | None = None) -> Named | None:
    """The first op of ``plan`` naming a rank, stage or microbatch outside ``ranges``
    (default: the plan's own), or the first program beyond its ranks."""
    ranges = ranges or Ranges.of(plan)
    m, stages, ranks = ranges.microbatches, ranges.stages, ranges.ranks
    for rank, program in enumerate(plan.programs):
        if rank >= ranges.ranks:
            return Named(rank, 0, (), f"rank {rank}'s program",
                         f"expected ranks 0..{ranges.ranks - 1}")
        for index, op in enumerate(program):
            kind = type(op)
            if kind is Compute:
                if op.mb < m and op.stage < stages and not op.segment:
                    continue  # the common ops, at a glance
            elif kind is Send or kind is Recv:
                p = op.payload
                if (op.dst if kind is Send else op.src) < ranks and p.mb < m \
                        and p.stage < stages and not p.segment:
                    continue
            found = op_beyond(op, ranges)
            if found is not None:
                field, why = found
                return Named(rank, index, field, _shown(op, field), why)
    return None


def op_beyond(op: Op, ranges: Ranges) -> tuple[tuple, str] | None:
    """``(field, why)`` for the first value of ``op`` outside ``ranges``, or None."""
    kind = type(op)
    if kind is Overlap or kind is Group:
        for k, member in enumerate(op.ops):
            found = op_beyond(member, ranges)
            if found is not None:
                return ("ops", k, *found[0]), found[1]
        return None
    if kind is Send or kind is Recv:
        p = op.payload
        checks = ((("dst",) if kind is Send else ("src",), ranges.rank(op.peer)),
                  (("payload", "stage"), ranges.stage(p.stage, p.segment)),
                  (("payload", "mb"), ranges.mb(p.mb)))
    elif kind is Collective:  # a root outside the members, whatever it is: the verifier's
        checks = tuple((("members", k), ranges.rank(r)) for k, r in enumerate(op.ranks))
    elif kind is Compute or kind is Offload or kind is Reload:
        checks = ((("stage",), ranges.stage(op.stage, op.segment)), (("mb",), ranges.mb(op.mb)))
    elif kind is Marker:
        checks = ((("stage",), ranges.stage(op.stage, "")),
                  (("mb",), None if op.mb is None else ranges.mb(op.mb)))
    else:
        return None
    return next(((field, why) for field, why in checks if why is not None), None)


def _shown(op: Op, field: tuple) -> str:
    """The op the field belongs to, as text (a group's or overlap's member)."""
    return str(op.ops[field[1]]) if field[:1] == ("ops",) else str(op)


def of_nothing(plan: Plan | Schedule) -> Named | None:
    """The first ``RELOAD`` (rank by rank) of an activation its rank never offloads, or
    end of a ``return`` whose rank never sends (its owner) or receives (its holder) a
    lend of that activation, anywhere in its program."""
    for rank, program in enumerate(plan.programs):
        moves = [(index, field, op) for index, step in enumerate(program)
                 if type(step) not in _NO_MOVES and (type(step) is not Send and type(step)
                                                     is not Recv or step.payload.kind in
                                                     RANK_MOVES)
                 for field, op in _moves(step)]
        if not moves:
            continue
        had = {(type(op), getattr(op, "payload", None) is not None and op.payload.kind,
                _activation(op)) for _, _, op in moves}
        for index, field, op in moves:
            why = _nothing(op, had)
            if why is not None:
                return Named(rank, index, field, str(op), why)
    return None


_NO_MOVES = frozenset((Compute, Overlap, Collective, Idle, Marker))  # step types: none


def _moves(step: Op) -> Iterable[tuple[tuple, Op]]:
    """``(field, op)`` of each move in ``step``: offloads, reloads, ends of lends and
    returns (a group's members by their path)."""
    kind = type(step)
    if kind is Offload or kind is Reload:
        yield (), step
    elif kind is Send or kind is Recv:
        if step.payload.kind in RANK_MOVES:
            yield (), step
    elif kind is Group:
        for k, member in enumerate(step.ops):
            if member.payload.kind in RANK_MOVES:
                yield ("ops", k), member


def _activation(op: Op) -> tuple:
    p = getattr(op, "payload", op)
    return (p.segment, p.stage, p.mb)


def _nothing(op: Op, had: set) -> str | None:
    """Why ``op`` moves nothing on its rank (``had``: its rank's moves as ``(type, payload
    kind or False, activation)``), or None."""
    key, kind = _activation(op), type(op)
    if kind is Reload and (Offload, False, key) not in had:
        return ("a reload of nothing: its rank never offloads that activation "
                "(an OFFLOAD of the same stage and microbatch)")
    if kind is Recv and op.payload.kind == RETURN and (Send, LEND, key) not in had:
        return ("a return of nothing: its rank never lends that activation (a send of "
                "payload lend)")
    if kind is Send and op.payload.kind == RETURN and (Recv, LEND, key) not in had:
        return ("a return of nothing: its rank never holds that activation (a receive "
                "of payload lend)")
    return None


def first_naming(plan: Plan | Schedule, stage: int | None = None, mb: int | None = None
                 ) -> Named | None:
    """The first op (rank by rank) naming body stage ``stage`` or microbatch ``mb`` or
    more (the plan's largest: where a count that does not fit a reading shows,
    ``--seq-chunks``, ``--bidirectional``)."""
    big = 1 << 62
    return beyond(plan, Ranges(big, big if stage is None else stage, big if mb is None else mb))
