"""A timed run of a plan, as far as it runs: what the SVG timeline and the Chrome trace draw.

``timeline(target, duration, memory, comm_model)`` lowers a compute-only schedule
(``lower``), then times the plan with the simulator (``sim.simulate``: compute ops take
``duration``, transfers are free). A plan that cannot run to completion under
``comm_model`` (a counterexample) is timed by ``semantics.execute`` as far as it runs:
``start[r]``/``finish[r]`` then cover only the executed prefix of rank ``r``, and
``waits`` names each rank's blocked position. Memory levels follow docs/semantics.md §2.6
(``semantics.memory_steps``) over the executed steps.
"""

from __future__ import annotations

from typing import Callable

import attrs

from ..ir import Op, Plan, Schedule
from ..lower import lower
from ..semantics import EAGER, UNIT_MEMORY, MemoryModel, Wait, execute, standard_duration
from ..sim import SimulationError, memory_curve, simulate


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


def as_plan(target: Schedule | Plan, duration: Callable[[Op], float] = standard_duration
            ) -> Plan:
    """A plan as ``check`` judges it: a compute-only schedule is lowered (ordered for
    ``duration``, the spec's costs), a plan is kept."""
    return lower(target, duration) if isinstance(target, Schedule) else target


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
