"""``transpose``: move a cut segment's work into a body schedule's bubbles (the
HyperParallel-Mpipe schedule; DESIGN §6 ``cut``/``transpose``).

``Transpose(body, ...)`` derives the body term's schedule, cuts one segment off it (a
``source`` encoder feeding the body's first stage, or a detached ``sink`` generator fed by
its last stage), assigns each microbatch's segment forward an *owner* rank and weaves the
segment's ops into the owners' programs:

- ownership ``inline``: the baseline, every microbatch on the segment's home rank (rank 0
  for a source, the last rank for a sink), right next to the body op it feeds or follows;
- ``full``: round-robin over all microbatches (``mb % p``);
- ``min``: the first ``NT = min(p, m)`` microbatches round-robin (the last NT for a sink),
  the rest inline;
- ``cost``: cost-aware: microbatches in order of need, each to the rank whose forward
  would finish earliest within its idle time (per-microbatch ``costs``).

An owner runs a source forward just before the first op of its own program that starts
after the forward's latest useful start (the time rank 0 needs the output, minus the
forward's cost), so warmup idle slots fill first; a sink forward (and its backward) go
where the owner idles in cooldown: at the end of its program.

Modes: ``recompute`` (trainable, parameters broadcast from home at the start, the home
rank re-runs the forward (``R``) from the shipped input right after the body's first-stage
backward, then the segment backward); ``owner`` (trainable, broadcast at the start, the
owner runs the backward at its program's end and all ranks all-reduce the gradients);
``frozen`` (no parameters to move, no backward); ``none`` (parameter-free: only data
loading moves; same structure as frozen, zero cost by default).
"""

from __future__ import annotations

import attrs

from ..errors import ParameterError
from ..ir import (BACKWARD, BODY, FORWARD, INPUT_GRAD, RECOMPUTE, SINK, SOURCE, Collective,
                  Compute, Cut, Op, Schedule, SegmentWork, computes_of)
from ..semantics import schedule_times

MODES = ("recompute", "owner", "frozen", "none")
OWNERSHIPS = ("inline", "full", "min", "cost")
SIDES = (SOURCE, SINK)


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ParameterError(message)


@attrs.frozen
class Transpose:
    body: object
    segment: str = "vision"
    side: str = SOURCE
    mode: str = "recompute"
    ownership: str = "full"
    costs: tuple[float, ...] = ()  # per-microbatch forward cost of the segment (default 1)
    body_forward: float = 1.0
    body_backward: float = 2.0

    def __attrs_post_init__(self) -> None:
        _need(self.side in SIDES, f"transpose side must be one of {SIDES}, got {self.side!r}")
        _need(self.mode in MODES, f"transpose mode must be one of {MODES}, got {self.mode!r}")
        _need(self.ownership in OWNERSHIPS,
              f"transpose ownership must be one of {OWNERSHIPS}, got {self.ownership!r}")
        _need(bool(self.segment) and self.segment.isidentifier(),
              f"segment name must be an identifier, got {self.segment!r}")
        _need(not (self.side == SINK and self.mode == "recompute"),
              "a sink segment is transposed with mode 'owner', 'frozen' or 'none' "
              "(central recompute applies to source encoders)")
        _need(all(c >= 0 for c in self.costs), "segment costs must be >= 0")

    def derive(self) -> Schedule:
        body = self.body.derive()
        _need(not body.cut.segments, "transpose applies to a body without a cut")
        p, m = body.num_ranks, body.num_microbatches
        _need(not self.costs or len(self.costs) == m,
              f"costs needs one entry per microbatch ({m}), got {len(self.costs)}")
        costs = self.costs or ((0.0 if self.mode == "none" else 1.0),) * m
        home = 0 if self.side == SOURCE else body.placement.stage_to_rank[-1]
        owners = self._owners(body, costs, home)
        work = self._segment_work(owners, home, p)
        programs = [list(prog) for prog in body.programs]
        self._weave(body, programs, work, costs)
        if work.broadcast:
            tag = f"params:{self.segment}"
            for prog in programs:
                prog.insert(0, Collective("broadcast", tuple(range(p)), tag, home))
        if work.all_reduce:
            for prog in programs:
                prog.append(Collective("all_reduce", tuple(range(p)), f"grads:{self.segment}"))
        return Schedule(body.placement, m, tuple(map(tuple, programs)), Cut((work,)))

    # ------------------------------------------------------------ ownership

    def _owners(self, body: Schedule, costs, home: int) -> tuple[int, ...]:
        p, m = body.num_ranks, body.num_microbatches
        nt = min(p, m)
        if self.ownership == "inline":
            return (home,) * m
        if self.ownership == "full":
            return tuple(mb % p for mb in range(m))
        if self.ownership == "min":
            chosen = range(nt) if self.side == SOURCE else range(m - nt, m)
            rr = {mb: k % p for k, mb in enumerate(chosen)}
            return tuple(rr.get(mb, home) for mb in range(m))
        return self._cost_aware(body, costs)

    def _cost_aware(self, body: Schedule, costs) -> tuple[int, ...]:
        """Earliest finish within idle time: microbatches in order of need, each to the
        rank where ``max(ready, idle start) + cost`` is smallest, charging the rank for
        the work (ties to the rank with more idle time)."""
        p, m = body.num_ranks, body.num_microbatches
        timing = self._body_timing(body)
        first_busy = [timing.start[r][0] if timing.start[r] else 0.0 for r in range(p)]
        load = [0.0] * p
        owners = []
        for mb in range(m):
            def finish(r):
                overrun = max(0.0, load[r] + costs[mb] - first_busy[r])
                return (load[r] + costs[mb] + 2 * overrun, -first_busy[r], r)
            best = min(range(p), key=finish)
            load[best] += costs[mb]
            owners.append(best)
        return tuple(owners)

    def _segment_work(self, owners, home: int, p: int) -> SegmentWork:
        trainable = self.mode in ("recompute", "owner")
        if not trainable:
            backward = None
        elif self.mode == "recompute":
            backward = (home,) * len(owners)
        else:
            backward = owners
        moved = any(o != home for o in owners)
        return SegmentWork(self.segment, self.side, owners, backward,
                           recompute=self.mode == "recompute", home=home,
                           broadcast=trainable and moved and p > 1,
                           all_reduce=self.mode == "owner" and moved and p > 1)

    # ------------------------------------------------------------ placement in programs

    def _body_timing(self, body: Schedule):
        def duration(op: Op) -> float:
            return sum(self.body_forward if c.kind == FORWARD else
                       self.body_backward if c.kind == BACKWARD else self.body_backward / 2
                       for c in computes_of(op))
        return schedule_times(body.programs, body.placement, duration)

    def _weave(self, body: Schedule, programs, work: SegmentWork, costs) -> None:
        seg, m = self.segment, body.num_microbatches
        timing = self._body_timing(body)
        position = {c: (r, i) for r, prog in enumerate(body.programs)
                    for i, op in enumerate(prog) for c in computes_of(op)}
        last = body.placement.num_stages - 1
        before: dict[tuple[int, int], list[Op]] = {}
        after: dict[tuple[int, int], list[Op]] = {}
        tail: dict[int, list[Op]] = {}
        for mb in range(m):
            owner = work.forward_rank[mb]
            fwd = Compute(FORWARD, 0, mb, seg)
            if self.side == SOURCE:
                r0, i0 = position[Compute(FORWARD, 0, mb)]
                if owner == r0:
                    before.setdefault((r0, i0), []).append(fwd)
                else:
                    need = timing.start[r0][i0] - costs[mb]
                    at = _first_at_or_after(timing.start[owner], need)
                    before.setdefault((owner, at), []).append(fwd)
                if work.trainable:
                    self._source_backward(mb, work, position, after, tail)
            else:
                rl, il = position[Compute(FORWARD, last, mb)]
                ops = [fwd] + ([Compute(BACKWARD, 0, mb, seg)] if work.trainable else [])
                if owner == rl:
                    after.setdefault((rl, il), []).extend(ops)
                else:
                    tail.setdefault(owner, []).extend(ops)
        for r, prog in enumerate(body.programs):
            out: list[Op] = []
            for i, op in enumerate(prog):
                out.extend(before.get((r, i), ()))
                out.append(op)
                out.extend(after.get((r, i), ()))
            out.extend(before.get((r, len(prog)), ()))
            out.extend(tail.get(r, ()))
            programs[r] = out

    def _source_backward(self, mb, work, position, after, tail) -> None:
        seg = self.segment
        grad_op = (Compute(BACKWARD, 0, mb) if Compute(BACKWARD, 0, mb) in position
                   else Compute(INPUT_GRAD, 0, mb))
        r0, i0 = position[grad_op]
        ops: list[Op] = []
        if work.needs_recompute(mb):
            ops.append(Compute(RECOMPUTE, 0, mb, seg))
        ops.append(Compute(BACKWARD, 0, mb, seg))
        if work.backward_rank[mb] == r0:
            after.setdefault((r0, i0), []).extend(ops)
        else:
            tail.setdefault(work.backward_rank[mb], []).extend(ops)

    def __str__(self) -> str:
        extra = f", costs={list(self.costs)}" if self.costs else ""
        if (self.body_forward, self.body_backward) != (1.0, 2.0):
            extra += f", body_forward={self.body_forward}, body_backward={self.body_backward}"
        return (f"transpose({self.body}, segment={self.segment!r}, side={self.side!r}, "
                f"mode={self.mode!r}, ownership={self.ownership!r}{extra})")


def _first_at_or_after(starts, t: float) -> int:
    """Index of the first op starting at or after ``t`` (``len`` if none)."""
    return next((i for i, s in enumerate(starts) if s >= t), len(starts))
