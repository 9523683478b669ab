"""The costs of a plan's ops: what a spec's ``[cost]``, ``[cost.segments.NAME]``, ``[comm]``
and ``[memory] static`` describe, for the simulator (``sim.simulate``) and the verifier's
memory sizes.

- ``CostModel`` (what a spec's ``[cost]``, ``[cost.segments.NAME]``, ``[comm]`` and
  ``[memory] static`` describe): compute durations per kind and body stage, a cut
  segment's per-microbatch forward/backward/recompute durations, stored activation sizes,
  receive-buffer sizes of segment payloads, static memory per rank (a replicated segment
  copy counts on every rank that holds one), and the transfer costs below.
- ``CommCost``: a point-to-point transfer takes ``latency + bytes / bandwidth`` from the
  moment both ends are posted (NCCL moves data only while both kernels run). It is
  charged to the *receive* (the receiving rank cannot use the data earlier); a send
  costs its rank nothing (``isend`` on a comm stream: the sender computes on). A
  collective takes ``collective_latency + factor · bytes / bandwidth`` once every member
  has reached it, with the ring factor of its algorithm: broadcast 1 (pipelined),
  all-reduce ``2(n-1)/n``, gather ``(n-1)/n`` over ``n`` members. A ``replica:J``
  all-reduce (several pipelines) moves model stage J's weight gradients
  (``stage_parameter_bytes``) over the ranks holding a replica of it.
- Activation moves (docs/semantics.md §2.10): an ``OFFLOAD``/``RELOAD`` takes
  ``host_latency + stored_bytes / host_bandwidth`` on its rank's copy stream
  (``CommCost.move``; ``sim.simulate`` overlaps it with compute and makes the backward
  that needs a reloaded activation wait for its copy); a ``lend``/``return`` is a
  point-to-point transfer of ``stored_bytes`` on the link like any other.
- Sequence chunks (a plan's ``seq_chunks`` S > 1): the ``[cost]`` durations are a mean
  chunk's; with ``attention`` a the share of a duration spent in causal attention, chunk
  ``j`` (microbatch ``u``, ``j = u % S``) costs ``(1 - a) + a (2j + 1) / S`` of it (the
  weight gradient ``W`` is all linear). Summed over the S chunks this is S mean chunks,
  whatever a. ``CostModel.chunked(S)`` turns a whole-sample model into that: durations,
  stored activations and the bytes of body transfers and moves over S.
"""

from __future__ import annotations

from typing import Callable

import attrs

from .ir import (ACT, BACKWARD, FORWARD, GRAD, INPUT, INPUT_GRAD, LEND, RECOMPUTE, RETURN, SINK,
                 WEIGHT_GRAD, Collective, Compute, Cut, Offload, Op, Payload, Placement, Recv,
                 Reload, computes_of, p2p_of)
from .semantics import GRADS, PARAMS, MemoryModel, collective_segment
from .semantics.rules import REPLICA


def _ring_factor(op: Collective) -> float:
    n = len(op.ranks)
    if n <= 1:
        return 0.0
    return {"broadcast": 1.0, "all_reduce": 2.0 * (n - 1) / n, "gather": (n - 1) / n}[op.kind]


@attrs.frozen
class CommCost:
    """Transfer costs (see the module docstring): time units per message and per byte."""

    latency: float = 0.0
    bandwidth: float = float("inf")
    payload_bytes: Callable[[object], float] = lambda payload: 0.0
    collective_latency: float = 0.0
    collective_bytes: Callable[[Collective], float] = lambda op: 0.0
    move_bytes: float = 0.0
    host_bandwidth: float = float("inf")
    host_latency: float = 0.0

    def move(self, op: Op) -> float:
        """An ``OFFLOAD``/``RELOAD`` on its rank's copy stream: ``host_latency +
        move_bytes / host_bandwidth``; 0 for every other op."""
        if type(op) is not Offload and type(op) is not Reload:
            return 0.0
        return self.host_latency + (self.move_bytes / self.host_bandwidth
                                    if self.move_bytes else 0.0)

    def transfer(self, payload: Payload) -> float:
        """One message: ``latency + bytes / bandwidth``."""
        return self.latency + self.payload_bytes(payload) / self.bandwidth

    def time(self, op: Op) -> float:
        """What ``op`` adds after its partners are posted (``semantics.execute``'s
        ``comm_time``): a receive (or a group holding one) its slowest transfer, a bare
        send nothing, a collective its latency plus ring-factor bytes over bandwidth."""
        if isinstance(op, Collective):
            size = self.collective_bytes(op)
            return self.collective_latency + (
                _ring_factor(op) * size / self.bandwidth if size else 0.0)
        recvs = [m for m in p2p_of(op) if isinstance(m, Recv)]
        if not recvs:
            return 0.0
        return max(self.transfer(m.payload) for m in recvs)


NO_COMM_COST = CommCost()


# ---------------------------------------------------------------- cost model

def _at(value, index: int) -> float:
    return float(value[index]) if isinstance(value, tuple) else float(value)


def _rebin_list(values: tuple[float, ...], count: int) -> tuple[float, ...]:
    """Per-stage amounts of a model cut into ``len(values)`` stages, re-cut into ``count``
    equal stages: each new stage gets the integral of the old piecewise-constant density
    over its share of the model (exact when one count divides the other)."""
    n = len(values)
    out = []
    for j in range(count):
        lo, hi = j / count, (j + 1) / count
        total = 0.0
        for i, v in enumerate(values):
            a, b = max(lo, i / n), min(hi, (i + 1) / n)
            if b > a:
                total += v * (b - a) * n
        out.append(total)
    return tuple(out)


def _scaled(value, factor: float):
    """A per-stage cost (one number or one per stage) times ``factor``."""
    if isinstance(value, tuple):
        return tuple(float(v) * factor for v in value)
    return float(value) * factor


def _rebin(value, old: int, new: int):
    """A per-stage cost (one number or one per stage) for a body of ``new`` stages instead
    of ``old``: the same model cut finer or coarser (a stage of half the layers costs
    half)."""
    if old == new:
        return value
    if isinstance(value, tuple):
        return _rebin_list(value, new)
    return float(value) * old / new


@attrs.frozen
class SegmentCost:
    """Costs of a cut segment (``[cost.segments.NAME]``). ``F``, ``B``, ``R``: durations
    of the segment's forward, backward and recompute, one number or one per microbatch
    (``B`` defaults to twice, ``R`` to once the microbatch's forward). Memory (same unit
    as ``[memory] limit``): ``activation`` is kept by a forward (or recompute) until its
    backward; ``output`` is the buffer of a shipped output waiting on the consumer (the
    body's first rank for a source, the sink's owner for the body's last output);
    ``input`` the buffer of a shipped raw input waiting for its recompute; ``static`` one
    copy of the parameters (with gradients and optimizer state when trainable), counted
    on the home rank and every rank that runs a backward; ``replica`` a forward-only copy
    (the weights alone; default: ``static``), counted on every other rank that runs a
    forward."""

    F: float | tuple[float, ...] = 1.0
    B: float | tuple[float, ...] | None = None
    R: float | tuple[float, ...] | None = None
    activation: float = 1.0
    output: float = 0.0
    input: float = 0.0
    static: float = 0.0
    replica: float | None = None

    def forward(self, mb: int) -> float:
        return _at(self.F, mb)

    def backward(self, mb: int) -> float:
        return 2.0 * self.forward(mb) if self.B is None else _at(self.B, mb)

    def recompute(self, mb: int) -> float:
        return self.forward(mb) if self.R is None else _at(self.R, mb)


DEFAULT_SEGMENT = SegmentCost()


@attrs.frozen
class CommModel:
    """``[comm]``: point-to-point ``latency`` and ``bandwidth`` (bytes per time unit),
    payload sizes in bytes (``activation_bytes`` for the body's activations and
    gradients, its last output to a sink included, ``segment_output_bytes`` for a segment's output and the gradient sent back
    to it, ``segment_input_bytes`` for a raw input shipped for a recompute), and the
    collectives' ``collective_latency`` and ``parameter_bytes`` (a segment's parameters
    broadcast, or its gradients all-reduced). Added for the schedules of several
    pipelines and activation moves (all default to free): ``stage_parameter_bytes``, one
    model stage's weight gradients (its ``replica:J`` all-reduce); ``stored_bytes``, one
    stored body activation (a ``lend``/``return`` on the link, an ``OFFLOAD``/``RELOAD``
    on the host link); ``host_bandwidth`` and ``host_latency``, the host link's."""

    latency: float = 0.0
    bandwidth: float = float("inf")
    activation_bytes: float = 0.0
    segment_output_bytes: float = 0.0
    segment_input_bytes: float = 0.0
    parameter_bytes: float = 0.0
    collective_latency: float = 0.0
    stored_bytes: float = 0.0
    host_bandwidth: float = float("inf")
    host_latency: float = 0.0
    stage_parameter_bytes: float = 0.0

    def payload_bytes(self, p: Payload) -> float:
        if p.kind == INPUT:
            return self.segment_input_bytes
        if p.kind == LEND or p.kind == RETURN:  # a stored activation, lent or given back
            return self.stored_bytes
        if p.segment or (p.kind == GRAD and p.to_segment):  # a segment's output, its gradient
            return self.segment_output_bytes
        return self.activation_bytes  # the body's (its last output to a sink included)

    def collective_bytes(self, op: Collective) -> float:
        tagged = collective_segment(op)
        if tagged and tagged[0] == REPLICA:
            return self.stage_parameter_bytes
        return self.parameter_bytes if tagged and tagged[0] in (PARAMS, GRADS) else 0.0

    def comm_cost(self) -> CommCost:
        return CommCost(self.latency, self.bandwidth, self.payload_bytes,
                        self.collective_latency, self.collective_bytes, self.stored_bytes,
                        self.host_bandwidth, self.host_latency)


NO_COMM = CommModel()


@attrs.frozen
class CostModel:
    """Durations and memory sizes of a plan's ops (a spec's cost tables).

    Body: ``F``/``B``/``I``/``W``/``R`` durations, each one number or one per stage;
    ``activation`` stored per forward, one number or one per stage. ``segments``: the
    cut segments' ``SegmentCost`` by name (an unnamed segment costs ``SegmentCost()``).
    ``comm``: transfer costs. ``static``: the fixed memory of each rank (one number or one
    per rank), before any segment copy, the weight copies below included.

    ``attention``: the share of a body duration spent in causal attention (chunk position
    costs, module docstring); ``seq_chunks``: the chunks per sample of the plan timed (set
    from its schedule, never written in a spec). ``weights``: one model stage's parameter
    state (weights, gradients, optimizer) per copy, one number or one per stage: already
    part of ``static`` as placed on the spec's own schedule (``placed_weights``), and
    moved with the stages when another schedule places them (``comparison.on_body``)."""

    F: float | tuple[float, ...] = 1.0
    B: float | tuple[float, ...] = 2.0
    I: float | tuple[float, ...] = 1.0  # noqa: E741
    W: float | tuple[float, ...] = 1.0
    activation: float | tuple[float, ...] = 1.0
    R: float | tuple[float, ...] = 1.0
    segments: tuple[tuple[str, SegmentCost], ...] = ()
    comm: CommModel = NO_COMM
    static: float | tuple[float, ...] = 0.0
    attention: float = 0.0
    weights: float | tuple[float, ...] = 0.0
    seq_chunks: int = 1

    def segment(self, name: str) -> SegmentCost:
        return next((cost for n, cost in self.segments if n == name), DEFAULT_SEGMENT)

    def compute_time(self, c: Compute) -> float:
        if c.segment:
            seg = self.segment(c.segment)
            if c.kind == FORWARD:
                return seg.forward(c.mb)
            if c.kind == RECOMPUTE:
                return seg.recompute(c.mb)
            if c.kind == BACKWARD:
                return seg.backward(c.mb)
            return seg.backward(c.mb) / 2  # a split segment backward: I or W
        base = _at(getattr(self, c.kind), c.stage)
        if self.seq_chunks > 1 and self.attention and c.kind != WEIGHT_GRAD:
            a, j = self.attention, c.mb % self.seq_chunks
            return base * ((1.0 - a) + a * (2 * j + 1) / self.seq_chunks)
        return base

    def duration(self, op: Op) -> float:
        """Like ``semantics.standard_duration``: the sum over the step's compute ops."""
        return sum(self.compute_time(c) for c in computes_of(op))

    def stored(self, stage: int, segment: str = "") -> float:
        if segment:
            return self.segment(segment).activation
        return _at(self.activation, stage)

    def buffer(self, cut: Cut) -> Callable[[Payload], float]:
        """Receive-buffer sizes: a segment's shipped output (and a sink's input), the
        gradient shipped back to a source's owner, and a shipped raw input; the body's own
        transfers are part of its stored activations."""
        sinks = {seg.name for seg in cut.segments if seg.side == SINK}

        def size(p: Payload) -> float:
            if p.kind == INPUT:
                return self.segment(p.segment).input
            if p.kind == ACT and p.segment:
                return self.segment(p.segment).output
            if p.kind == ACT and p.to_segment in sinks:
                return self.segment(p.to_segment).output
            if p.kind == GRAD and p.to_segment:  # the gradient of a source's output
                return self.segment(p.to_segment).output
            return 0.0
        return size

    def static_memory(self, cut: Cut, num_ranks: int) -> tuple[float, ...]:
        """Per rank: ``static`` plus, per segment, ``SegmentCost.static`` on its home rank
        and its backward ranks and ``SegmentCost.replica`` on its other forward owners."""
        out = [_at(self.static, r) for r in range(num_ranks)]
        for seg in cut.segments:
            cost = self.segment(seg.name)
            full = {seg.home, *(seg.backward_rank or ())}
            replica = cost.static if cost.replica is None else cost.replica
            for r in full:
                if r < num_ranks:
                    out[r] += cost.static
            for r in set(seg.forward_rank) - full:
                if r < num_ranks:
                    out[r] += replica
        return tuple(out)

    def memory_model_for(self, cut: Cut, num_ranks: int) -> MemoryModel:
        """§2.6 with these sizes for a plan with ``cut`` on ``num_ranks`` ranks."""
        return MemoryModel(stored=self.stored, buffer=self.buffer(cut),
                           static=self.static_memory(cut, num_ranks))

    def comm_cost(self) -> CommCost:
        return self.comm.comm_cost()

    def placed_weights(self, placement: Placement, pipelines: int = 1) -> tuple[float, ...]:
        """Per rank: ``weights`` of every stage it holds (stage ``s`` is model stage
        ``s % n`` of ``n = stages / pipelines``)."""
        n = placement.num_stages // max(1, pipelines)
        out = [0.0] * placement.num_ranks
        for s, r in enumerate(placement.stage_to_rank):
            out[r] += _at(self.weights, s % n)
        return tuple(out)

    def chunked(self, seq_chunks: int) -> "CostModel":
        """The same model with samples cut into ``seq_chunks`` chunks instead of
        ``self.seq_chunks`` (module docstring): body durations, stored activations, body
        transfer and move bytes scale with the tokens of a chunk."""
        if seq_chunks == self.seq_chunks:
            return self
        factor = self.seq_chunks / seq_chunks
        kw = {k: _scaled(getattr(self, k), factor)
              for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE, "activation")}
        comm = attrs.evolve(self.comm,
                            activation_bytes=self.comm.activation_bytes * factor,
                            stored_bytes=self.comm.stored_bytes * factor)
        return attrs.evolve(self, comm=comm, seq_chunks=seq_chunks, **kw)

    def moved(self, old: Placement, old_pipelines: int, new: Placement,
              new_pipelines: int, weights) -> "CostModel":
        """``static`` with the weight copies of ``old`` (``self.weights``) replaced by
        those of ``new`` (``weights``, per stage of the new cut)."""
        if not any(w for w in (self.weights if isinstance(self.weights, tuple)
                               else (self.weights,))):
            return attrs.evolve(self, weights=weights)
        before = self.placed_weights(old, old_pipelines)
        after = attrs.evolve(self, weights=weights).placed_weights(new, new_pipelines)
        static = tuple(_at(self.static, r) - b + a
                       for r, (b, a) in enumerate(zip(before, after)))
        return attrs.evolve(self, weights=weights, static=static)

    def untiled(self, pipelines: int) -> "CostModel":
        """Per-stage lists of a schedule of ``pipelines`` pipelines (one entry per stage,
        replicas included) as lists per model stage: the first pipeline's entries."""
        if pipelines <= 1:
            return self
        kw = {k: getattr(self, k)[:len(getattr(self, k)) // pipelines]
              for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE, "activation")
              if isinstance(getattr(self, k), tuple)}
        return attrs.evolve(self, **kw)

    def tiled(self, pipelines: int) -> "CostModel":
        """Per-stage lists repeated for each of ``pipelines`` pipelines (stage ``i*n + J``
        is a replica of model stage J)."""
        if pipelines <= 1:
            return self
        kw = {k: getattr(self, k) * pipelines
              for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE, "activation")
              if isinstance(getattr(self, k), tuple)}
        return attrs.evolve(self, **kw)

    def rescaled(self, stages: int, to_stages: int) -> "CostModel":
        """The same model with its body cut into ``to_stages`` stages instead of
        ``stages`` (another family's placement): per-stage durations, stored activations,
        weights and their bytes scale with the share of the model a stage holds; boundary
        payloads, segments and static memory stay."""
        if stages == to_stages:
            return self
        kw = {k: _rebin(getattr(self, k), stages, to_stages)
              for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE, "activation",
                        "weights")}
        comm = attrs.evolve(self.comm, stored_bytes=_rebin(self.comm.stored_bytes, stages,
                                                           to_stages),
                            stage_parameter_bytes=_rebin(self.comm.stage_parameter_bytes,
                                                         stages, to_stages))
        return attrs.evolve(self, comm=comm, **kw)
