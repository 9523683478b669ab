"""``transpose``: move a cut segment's work into a body schedule's bubbles (the
HyperParallel-Mpipe schedule, arXiv 2607.03229; ``cut``/``transpose``).

``Transpose(body, ...)`` derives the body term's schedule, cuts one segment off it (a
``source`` encoder feeding the body's first stage, or a detached ``sink`` generator fed by
its last stage), assigns each microbatch's segment forward an *owner* rank and weaves the
segment's ops into the owners' programs. The body may itself be a transpose (several
encoders, or an encoder and a sink: ``Transpose(Transpose(t, "vision"), "audio")``): the
segments already cut stay as they are, are timed as part of the body, and the new one
is woven around them; the cut lists the sources first, in the order they were cut (the
body's first stage receives their outputs in that order), then the sinks.

- ownership ``inline``: the baseline, every microbatch on the segment's home rank (rank 0
  for a source, the last rank for a sink), right next to the body op it feeds or follows;
- ``full``: round-robin over all microbatches (``mb % p``);
- ``min``: the first ``NT = min(p, m)`` microbatches round-robin (the last NT for a sink),
  the rest inline;
- ``cost``: cost-aware: microbatches in order of need, each to the rank where its work
  (with ``owner`` mode, forward and backward together) costs the least estimated delay,
  given the idle time left on each rank (per-microbatch ``costs``; ties go to the least
  loaded rank). The greedy is kept only if the operator's own estimate of the woven
  schedule (``_estimate``) does not finish later than round-robin's; otherwise the
  result is the round-robin one;
- ``given``: the owners listed in ``owners`` (one rank per microbatch), e.g. the
  solution of the placement problem (``placement_problem``, solved by
  ``algebra.placement.solve`` with Z3's ``Optimize``; ``mpipe-verify tune`` writes its
  winner this way). The positions then follow the placement rules (``gap_fill``).

Placement (``algebra.gap_fill``): each microbatch's segment work goes into its owner's
idle gaps in the body's estimated timeline, at positions bounded by the body's own times,
so the woven program is acyclic whenever the body is.

The ``costs`` are also the segment's durations a spec gives the simulator (``[transpose]
costs`` or ``[cost.segments.NAME] F``), and a spec's ``[cost]`` F and B set
``body_forward``/``body_backward``; the family ``transpose_family`` builds the term.

Modes: ``recompute`` (trainable, parameters broadcast from home at the start, the home
rank re-runs the forward (``R``) from the shipped input, then the segment backward after
the body's first-stage backward); ``owner`` (trainable, broadcast at the start, the owner
runs the backward and all ranks all-reduce the gradients at the end); ``frozen`` (no
parameters to move, no backward); ``none`` (parameter-free: only data loading moves; same
structure as frozen, zero cost by default).
"""

from __future__ import annotations

import math

import attrs

from ..cost import CostModel, SegmentCost
from ..errors import ParameterError
from ..errors import require as _need
from ..ir import SINK, SOURCE, Collective, Cut, Schedule, SegmentWork
from ..semantics import GRADS, PARAMS, collective_tag, schedule_times
from .gap_fill import EPS, Weaver
from .placement import Problem

MODES = ("recompute", "owner", "frozen", "none")
OWNERSHIPS = ("inline", "full", "min", "cost")  # the rules; or GIVEN with owners listed
GIVEN = "given"
SIDES = (SOURCE, SINK)


def _floats(values) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in values)
    except (TypeError, ValueError):
        raise ParameterError(f"segment costs must be numbers, got {values!r}") from None


def _ints(values) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        raise ParameterError(f"owners must be a list of ranks, got {values!r}") from None
    _need(all(isinstance(x, int) and not isinstance(x, bool) for x in out),
          f"owners must be a list of ranks, got {values!r}")
    return out


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ParameterError(f"a cost must be a number, got {value!r}") from None


@attrs.frozen
class Transpose:
    body: object
    segment: str = "vision"
    side: str = SOURCE
    mode: str = "recompute"
    ownership: str = "cost"
    # per-microbatch forward cost of the segment (default 1; 0 with mode "none")
    costs: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    body_forward: float = attrs.field(default=1.0, converter=_float)
    body_backward: float = attrs.field(default=2.0, converter=_float)
    # ownership "given": each microbatch's owner rank
    owners: tuple[int, ...] = attrs.field(default=(), converter=_ints)

    def __attrs_post_init__(self) -> None:
        _need(self.side in SIDES, f"transpose side must be one of {SIDES}, got {self.side!r}")
        _need(self.mode in MODES, f"transpose mode must be one of {MODES}, got {self.mode!r}")
        _need(self.ownership in OWNERSHIPS + (GIVEN,),
              f"transpose ownership must be one of {OWNERSHIPS + (GIVEN,)}, "
              f"got {self.ownership!r}")
        _need(isinstance(self.segment, str) and bool(self.segment)
              and self.segment.isidentifier(),
              f"segment name must be an identifier, got {self.segment!r}")
        _need(not (self.side == SINK and self.mode == "recompute"),
              "a sink segment is transposed with mode 'owner', 'frozen' or 'none' "
              "(central recompute applies to source encoders)")
        _need(all(math.isfinite(c) and c >= 0 for c in self.costs),
              "segment costs must be finite numbers >= 0")
        _need(all(math.isfinite(c) and c > 0 for c in (self.body_forward, self.body_backward)),
              "body_forward and body_backward must be positive numbers")
        _need((self.ownership == GIVEN) == bool(self.owners),
              "ownership 'given' takes owners (one rank per microbatch), and owners "
              "go with ownership 'given' only")

    def derive(self) -> Schedule:
        body, home = self._body()
        if body.seq_chunks != 1:
            raise ParameterError("transpose takes a body without sequence chunks")
        if body.pipelines:  # a cut segment over several pipelines is not defined
            raise ParameterError(f"transpose takes a body of one pipeline, not "
                                 f"{len(body.pipelines)} (DualPipe, Chimera, BitPipe)")
        cost = self.estimate_cost()
        timing = schedule_times(body.programs, body.placement, cost.duration, cut=body.cut)
        schedule = self._weave(body, timing, cost, home, self.ownership)
        p = body.num_ranks
        if self.ownership == "cost" and p > 1:  # keep the greedy only where it pays
            round_robin = self._weave(body, timing, cost, home, "full")
            if self._estimate(round_robin, cost) < self._estimate(schedule, cost) - EPS:
                schedule = round_robin
        return schedule

    def _body(self) -> tuple[Schedule, int]:
        """The body's schedule (checked against this term) and the segment's home rank."""
        body = self.body.derive()
        _need(body.cut.get(self.segment) is None,
              f"segment {self.segment!r} is already cut from the body (name each "
              "transposed segment differently)")
        _need(not body.forward_only, "transpose applies to a training term (for an evaluation "
                                     "run, take forward_only of the transposed term)")
        p, m = body.num_ranks, body.num_microbatches
        _need(not self.costs or len(self.costs) == m,
              f"costs needs one entry per microbatch ({m}), got {len(self.costs)}")
        _need(not self.owners or (len(self.owners) == m
                                  and all(0 <= r < p for r in self.owners)),
              f"owners needs one rank in 0..{p - 1} per microbatch ({m}), "
              f"got {list(self.owners)}")
        return body, 0 if self.side == SOURCE else body.placement.stage_to_rank[-1]

    def placement_problem(self, cost: CostModel | None = None) -> Problem:
        """The choice of owners as an optimisation problem of its own (see
        ``algebra.placement``), in the body's timeline under ``cost`` (a spec's model;
        default: this term's own estimate), shifted and with deadlines and releases as
        the placement rules (``gap_fill``) take them."""
        body, home = self._body()
        cost = cost or self.estimate_cost()
        timing = schedule_times(body.programs, body.placement, cost.duration, cut=body.cut)
        return Weaver(self, body, timing, cost, home, self.ownership).problem()

    def estimate_cost(self) -> CostModel:
        """The operator's own cost model (also a spec's default for this term): a body
        forward costs ``body_forward``, a backward ``body_backward`` and an ``I``/``W``
        half of it; a segment forward ``costs[mb]`` (default 1, 0 with mode ``none``), its
        backward twice and its recompute once that (``cost.SegmentCost``'s defaults)."""
        bf, bb = self.body_forward, self.body_backward
        seg_f = self.costs or (0.0 if self.mode == "none" else 1.0)
        return CostModel(F=bf, B=bb, I=bb / 2, W=bb / 2,
                         segments=((self.segment, SegmentCost(F=seg_f)),))

    def _weave(self, body: Schedule, timing, cost: CostModel, home: int,
               ownership: str) -> Schedule:
        """The body with the segment woven in, placed from the body's ``timing``."""
        p, m = body.num_ranks, body.num_microbatches
        weaver = Weaver(self, body, timing, cost, home, ownership)
        owners = weaver.place()
        work = self._segment_work(owners, home, p)
        programs = weaver.programs()
        if work.broadcast:
            tag = collective_tag(PARAMS, self.segment)
            for prog in programs:
                prog.insert(0, Collective("broadcast", tuple(range(p)), tag, home))
        if work.all_reduce:
            tag = collective_tag(GRADS, self.segment)
            for prog in programs:
                prog.append(Collective("all_reduce", tuple(range(p)), tag))
        segments = sorted((*body.cut.segments, work), key=lambda seg: seg.side != SOURCE)
        return Schedule(body.placement, m, tuple(map(tuple, programs)), Cut(tuple(segments)))

    def _estimate(self, schedule: Schedule, cost: CostModel) -> float:
        """The makespan of a woven schedule under the operator's own cost estimate.
        The collectives are zero-cost barriers at the very start and end of every program
        (one per trainable segment moved off home), so they are timed as rank-local ones (the broadcast on its own rank, which leaves
        the parameters there at time 0; the all-reduce, needing only local work, left out):
        the same makespan and the same verdict on finishing, without the O(p) work per
        member a p-rank barrier costs."""
        programs = tuple(_local_collectives(prog, rank)
                         for rank, prog in enumerate(schedule.programs))
        timing = schedule_times(programs, schedule.placement, cost.duration,
                                cut=schedule.cut)
        return math.inf if timing.stuck else timing.makespan

    @property
    def trainable(self) -> bool:
        return self.mode in ("recompute", "owner")

    def _segment_work(self, owners, home: int, p: int) -> SegmentWork:
        trainable = self.trainable
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

    def __str__(self) -> str:
        extra = f", costs={list(self.costs)}" if self.costs else ""
        if (self.body_forward, self.body_backward) != (1.0, 2.0):
            extra += f", body_forward={self.body_forward}, body_backward={self.body_backward}"
        return (f"transpose({self.body}, segment={self.segment!r}, side={self.side!r}, "
                f"mode={self.mode!r}, ownership={self.ownership!r}{extra}"
                + (f", owners={list(self.owners)})" if self.owners else ")"))


# ---------------------------------------------------------------- the estimate


def _local_collectives(program, rank: int):
    """``program`` with its leading broadcasts on ``rank`` alone and its trailing
    all-reduces left out (see ``Transpose._estimate``)."""
    ops = list(program)
    while ops and isinstance(ops[-1], Collective) and ops[-1].kind == "all_reduce":
        ops.pop()
    lead = 0
    while lead < len(ops) and isinstance(ops[lead], Collective) and ops[lead].kind == "broadcast":
        ops[lead] = Collective("broadcast", (rank,), ops[lead].tag, rank)
        lead += 1
    return tuple(ops)


# ---------------------------------------------------------------- the family

TRANSPOSE = "transpose"


def transpose_family(pp: int, microbatches: int, chunks: int | None = None,
                     body: str = "1f1b", segment: str = "vision", side: str = SOURCE,
                     mode: str | None = None, ownership: str = "cost",
                     costs=(), body_forward: float = 1.0,
                     body_backward: float = 2.0, owners=()) -> Transpose:
    """The ``transpose`` family (``--family transpose``, ``[schedule] family =
    "transpose"``): ``body`` (a family name; ``chunks`` for interleaved-1f1b) with one
    segment transposed. ``mode`` defaults to ``recompute`` for a source and ``owner`` for
    a sink; ``costs`` is one number (every microbatch) or one per microbatch."""
    from .families import family
    if body == "seq1f1b":  # a segment's work is per sample; chunks of one are not cut
        raise ParameterError("transpose takes a body without sequence chunks, not seq1f1b")
    term = family(body, pp, microbatches, chunks)
    if mode is None:
        mode = "recompute" if side == SOURCE else "owner"
    if isinstance(costs, (int, float)) and not isinstance(costs, bool):
        costs = (float(costs),) * microbatches
    return Transpose(term, segment, side, mode, ownership, tuple(costs), body_forward,
                     body_backward, tuple(owners))
