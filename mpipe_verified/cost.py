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
  all-reduce ``2(n-1)/n``, gather ``(n-1)/n`` over ``n`` members.
"""

from __future__ import annotations

from typing import Callable

import attrs

from .ir import (ACT, BACKWARD, FORWARD, GRAD, INPUT, INPUT_GRAD, RECOMPUTE, SINK, WEIGHT_GRAD,
                 Collective, Compute, Cut, Op, Payload, Recv, computes_of, p2p_of)
from .semantics import GRADS, PARAMS, MemoryModel, collective_segment


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
    broadcast, or its gradients all-reduced)."""

    latency: float = 0.0
    bandwidth: float = float("inf")
    activation_bytes: float = 0.0
    segment_output_bytes: float = 0.0
    segment_input_bytes: float = 0.0
    parameter_bytes: float = 0.0
    collective_latency: float = 0.0

    def payload_bytes(self, p: Payload) -> float:
        if p.kind == INPUT:
            return self.segment_input_bytes
        if p.segment or (p.kind == GRAD and p.to_segment):  # a segment's output, its gradient
            return self.segment_output_bytes
        return self.activation_bytes  # the body's (its last output to a sink included)

    def collective_bytes(self, op: Collective) -> float:
        tagged = collective_segment(op)
        return self.parameter_bytes if tagged and tagged[0] in (PARAMS, GRADS) else 0.0

    def comm_cost(self) -> CommCost:
        return CommCost(self.latency, self.bandwidth, self.payload_bytes,
                        self.collective_latency, self.collective_bytes)


NO_COMM = CommModel()


@attrs.frozen
class CostModel:
    """Durations and memory sizes of a plan's ops (a spec's cost tables).

    Body: ``F``/``B``/``I``/``W``/``R`` durations, each one number or one per stage;
    ``activation`` stored per forward, one number or one per stage. ``segments``: the
    cut segments' ``SegmentCost`` by name (an unnamed segment costs ``SegmentCost()``).
    ``comm``: transfer costs. ``static``: the fixed memory of each rank (one number or one
    per rank), before any segment copy."""

    F: float | tuple[float, ...] = 1.0
    B: float | tuple[float, ...] = 2.0
    I: float | tuple[float, ...] = 1.0  # noqa: E741
    W: float | tuple[float, ...] = 1.0
    activation: float | tuple[float, ...] = 1.0
    R: float | tuple[float, ...] = 1.0
    segments: tuple[tuple[str, SegmentCost], ...] = ()
    comm: CommModel = NO_COMM
    static: float | tuple[float, ...] = 0.0

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
        return _at(getattr(self, c.kind), c.stage)

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

    def rescaled(self, stages: int, to_stages: int) -> "CostModel":
        """The same model with its body cut into ``to_stages`` stages instead of
        ``stages`` (another family's placement): per-stage durations and stored
        activations scale with the share of the model a stage holds; boundary payloads,
        segments and static memory stay."""
        if stages == to_stages:
            return self
        kw = {k: _rebin(getattr(self, k), stages, to_stages)
              for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE, "activation")}
        return attrs.evolve(self, **kw)
