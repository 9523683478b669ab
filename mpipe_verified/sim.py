"""Cost-model simulator: the plan's run under the shared semantics (``semantics.execute``)
with real durations, reporting makespan, busy and bubble fractions and memory timelines.

Costs: compute ops take ``CostModel.duration`` (per kind, optionally per segment and
stage); a point-to-point transfer takes ``latency + bytes / bandwidth`` once both ends
have met (rendezvous) or once the send is posted (eager); a collective takes
``collective_latency + bytes / bandwidth``. Memory follows DESIGN §3.6 via
``semantics.memory_steps``.

Timing defaults to the eager model: a real backend posts sends asynchronously (``isend``)
so a sender does not stall until its receiver arrives. Whether the plan is *safe* under
strict rendezvous is the verifier's question, not the simulator's.
"""

from __future__ import annotations

from typing import Callable

import attrs

from .ir import Collective, Group, Op, Plan, Recv, Send, computes_of, p2p_of
from .semantics import (EAGER, UNIT_MEMORY, MemoryModel, execute, memory_steps,
                        standard_duration)


@attrs.frozen
class CommCost:
    """Transfer costs: seconds (or any time unit) per message and per byte."""

    latency: float = 0.0
    bandwidth: float = float("inf")
    payload_bytes: Callable[[object], float] = lambda payload: 0.0
    collective_latency: float = 0.0
    collective_bytes: Callable[[Collective], float] = lambda op: 0.0

    def time(self, op: Op) -> float:
        if isinstance(op, Collective):
            return self.collective_latency + self.collective_bytes(op) / self.bandwidth
        members = p2p_of(op)
        if not members:
            return 0.0
        size = max(self.payload_bytes(m.payload) for m in members)
        return self.latency + size / self.bandwidth


NO_COMM_COST = CommCost()


@attrs.frozen
class SimResult:
    """``busy[r]``: compute time on rank r; ``bubble[r] = 1 - busy[r] / makespan``;
    ``memory[r]``: ``(time, level)`` after each step that changed memory."""

    makespan: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_memory: dict[int, float]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    start: tuple[tuple[float, ...], ...]
    finish: tuple[tuple[float, ...], ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all rank-time: ``1 - sum(busy) / (ranks * makespan)``."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


class SimulationError(Exception):
    """The plan cannot run to completion (it deadlocks); verify it for the cycle."""


def simulate(plan: Plan, duration: Callable[[Op], float] = standard_duration,
             comm: CommCost = NO_COMM_COST, memory: MemoryModel = UNIT_MEMORY,
             comm_model: str = EAGER) -> SimResult:
    """Time ``plan`` under §3 with the given costs."""
    run = execute(plan, comm_model, duration, comm.time)
    if not run.completed:
        w = run.waits[0]
        raise SimulationError(f"the plan does not run to completion: rank {w.rank} position "
                              f"{w.index}: {w.reason}")
    makespan = run.makespan
    busy = tuple(sum(duration(op) for op in prog) for prog in plan.programs)
    bubble = tuple((1.0 - b / makespan) if makespan else 0.0 for b in busy)
    timelines, peaks = [], {}
    for rank in range(plan.num_ranks):
        level = memory.static_of(rank)
        points, peak = [(0.0, level)], level
        for index, (alloc, freed) in enumerate(memory_steps(plan, rank, memory)[0]):
            if alloc or freed:
                peak = max(peak, level + alloc)
                points.append((run.start[rank][index], level + alloc))
                level += alloc - freed
                points.append((run.finish[rank][index], level))
        timelines.append(tuple(points))
        peaks[rank] = peak
    return SimResult(makespan, busy, bubble, peaks, tuple(timelines), run.start, run.finish)
