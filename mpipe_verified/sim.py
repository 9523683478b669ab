"""Cost-model simulator: the plan's run under the shared semantics (``semantics.execute``)
with real durations, reporting makespan, busy and bubble fractions and memory timelines.

There is one interpreter: ``simulate`` is ``semantics.execute`` (the verifier's run of
docs/semantics.md §2) with durations, plus ``semantics.memory_levels`` for memory. The
durations, sizes and transfer costs come from ``cost.py`` (``CostModel``, ``CommCost``).

Activation moves (``OFFLOAD``/``RELOAD``) cost their rank's compute stream nothing: each
runs on the rank's copy stream for ``CommCost.move`` (bytes over the host link), and the
backward that needs a reloaded activation waits for its copy (``semantics.execute``'s
``copy_time``): a reload posted early enough is hidden, one posted too late stalls.

Timing defaults to the eager model: a real backend posts sends asynchronously (``isend``)
so a sender does not stall until its receiver arrives. Whether the plan is *safe* under
strict rendezvous is the verifier's question, not the simulator's.

``timeline(target, duration, memory, comm_model)`` is what the SVG timeline and the Chrome
trace draw: a timed run of a plan as far as it runs. It lowers a compute-only schedule
(``lower.as_plan``), then times the plan with ``simulate`` (compute ops take ``duration``,
transfers are free). A plan that cannot run to completion under ``comm_model`` (a
counterexample) is timed by ``semantics.execute`` as far as it runs: ``start[r]``/
``finish[r]`` then cover only the executed prefix of rank ``r``, and ``waits`` names each
rank's blocked position. Memory levels follow docs/semantics.md §2.6
(``semantics.memory_steps``) over the executed steps.

A caller with a time limit (``tune --budget``) passes ``deadline`` (a ``now()`` value,
``time.monotonic()`` unless a test drives a fake clock through ``_now``): ``simulate``
raises ``DeadlinePassed`` at its next step once it has passed (after the run, and before
each rank's memory curve).
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from .cost import NO_COMM_COST, CommCost
from .ir import Op, Plan, Schedule
from .lower import as_plan
from .semantics import (EAGER, UNIT_MEMORY, MemoryModel, Wait, execute, memory_levels,
                        standard_duration)


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


class DeadlinePassed(Exception):
    """A caller's time limit passed before the work was done (see the module docstring)."""


_now: Callable[[], float] = time.monotonic  # the clock of every deadline (tests: a fake)


def now() -> float:
    """The clock deadlines are on (``time.monotonic``): ``tune`` reads its start and
    ``check_deadline`` the time from it, so a test that replaces ``_now`` with a fake
    clock drives every budget check deterministically."""
    return _now()


def check_deadline(deadline: float | None) -> None:
    """Raise ``DeadlinePassed`` once ``now()`` has reached ``deadline``."""
    if deadline is not None and _now() >= deadline:
        raise DeadlinePassed


def simulate(plan: Plan, duration: Callable[[Op], float] = standard_duration,
             comm: CommCost = NO_COMM_COST, memory: MemoryModel = UNIT_MEMORY,
             comm_model: str = EAGER, deadline: float | None = None) -> SimResult:
    """Time ``plan`` under §2 with the given costs (``deadline``: see the module
    docstring)."""
    moves = comm.move if comm.move_bytes or comm.host_latency else None
    run = execute(plan, comm_model, duration, comm.time, copy_time=moves)
    if not run.completed:
        w = run.waits[0]
        raise SimulationError(f"the plan does not run to completion: rank {w.rank} position "
                              f"{w.index}: {w.reason}")
    check_deadline(deadline)
    makespan = run.makespan
    busy = tuple(sum(duration(op) for op in prog) for prog in plan.programs)
    bubble = tuple((1.0 - b / makespan) if makespan else 0.0 for b in busy)
    curves = []
    for rank in range(plan.num_ranks):
        check_deadline(deadline)
        curves.append(memory_curve(plan, rank, memory, run.start, run.finish))
    peaks = {rank: peak for rank, (_, peak) in enumerate(curves)}
    return SimResult(makespan, busy, bubble, peaks, tuple(c for c, _ in curves), run.start,
                     run.finish)


def memory_curve(plan: Plan, rank: int, memory: MemoryModel, start, finish
                 ) -> tuple[tuple[tuple[float, float], ...], float]:
    """``((time, level), ...)`` at each step of ``rank`` that moves memory (its peak at
    the step's start, its level after it at the finish) and the peak, over the steps that
    ran (``start[rank]`` may stop early in a run that got stuck)."""
    level = memory.static_of(rank)
    points, peak = [(0.0, level)], level
    ran = len(start[rank])
    for index, (before, alloc, freed, after) in enumerate(memory_levels(plan, rank, memory)):
        if index >= ran:
            break
        if alloc or freed:
            peak = max(peak, before + alloc)
            points.append((start[rank][index], before + alloc))
            points.append((finish[rank][index], after))
    return tuple(points), peak


# ---------------------------------------------------------------- timeline


@attrs.frozen
class Timeline:
    """``start[r][i]``/``finish[r][i]``: times of op ``i`` of rank ``r`` (executed prefix
    only); ``memory[r]``: ``(time, level)`` points of rank ``r``'s memory curve;
    ``waits``: one entry per rank that did not finish (empty when the run completed)."""

    plan: Plan
    start: tuple[tuple[float, ...], ...]
    finish: tuple[tuple[float, ...], ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    peak_memory: dict[int, float]
    makespan: float
    waits: tuple[Wait, ...] = ()
    comm_model: str = EAGER

    @property
    def completed(self) -> bool:
        return not self.waits

    def executed(self, rank: int) -> int:
        """How many ops of ``rank`` ran."""
        return len(self.start[rank])

    def busy(self, rank: int, duration: Callable[[Op], float]) -> float:
        prog = self.plan.programs[rank]
        return sum(duration(prog[i]) for i in range(self.executed(rank)))

    def blocked_since(self, rank: int) -> float:
        """When ``rank`` posted its blocked op (the end of its executed prefix)."""
        return self.finish[rank][-1] if self.finish[rank] else 0.0


def timeline(target: Schedule | Plan, duration: Callable[[Op], float] = standard_duration,
             memory: MemoryModel = UNIT_MEMORY, comm_model: str = EAGER) -> Timeline:
    """Time ``target`` (see the module docstring)."""
    plan = as_plan(target, duration)
    try:
        run = simulate(plan, duration, memory=memory, comm_model=comm_model)
    except SimulationError:
        return _partial(plan, duration, memory, comm_model)
    return Timeline(plan, run.start, run.finish, run.memory, dict(run.peak_memory),
                    run.makespan, (), comm_model)


def _partial(plan: Plan, duration, memory: MemoryModel, comm_model: str) -> Timeline:
    run = execute(plan, comm_model, duration)
    curves = [memory_curve(plan, rank, memory, run.start, run.finish)
              for rank in range(plan.num_ranks)]
    peaks = {rank: peak for rank, (_, peak) in enumerate(curves)}
    curves = [c for c, _ in curves]
    return Timeline(plan, run.start, run.finish, tuple(curves), peaks, run.makespan,
                    run.waits, comm_model)
