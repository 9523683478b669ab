"""The check spine: a target read or derived -> lowered -> verified -> simulated, once.

``check(target, question)`` is what every command that judges a schedule runs (``cli``'s
``check`` and ``export``, ``diff``, ``simulate`` through ``comparison``, ``tune`` and the
executor's ``certify``): a compute-only schedule is lowered for the caller's durations
(``as_plan``; a plan is judged as written), the plan is verified for ``question``
(``judge``; on two cores from ``TWO_PROCESS_OPS`` ops where the caller asks, as ``check``
and ``export`` do) and, when the caller gives a
``Timing`` and the verdict lets the plan run (``runs`` by default), simulated. The
result, ``Checked(plan, report, run)``, keeps what each step made.

Invariant: ``report`` answers ``question`` about ``plan`` (``Question.answered``), so a
verdict on another question or another plan is undecided, never verified.

The policy above the spine lives beside it: ``check.parametric`` answers a standard
family instance by its proven laws and accepts certificates; ``check.policy`` picks that
road for an input and words the checked input's JSON object.
"""

from __future__ import annotations

from typing import Callable

import attrs

from ..cost import NO_COMM_COST, CommCost
from ..ir import Op, Plan, Schedule
from ..lower import as_plan
from ..question import Question
from ..semantics import EAGER, UNIT_MEMORY, MemoryModel, standard_duration
from ..sim import SimResult, SimulationError, check_deadline, simulate
from ..verify import Report, verify, verify_split

TWO_PROCESS_OPS = 50_000  # plans this big are verified on two cores (verify_split)


@attrs.frozen
class Timing:
    """How a checked plan is simulated: transfer costs, memory model and the comm model
    it is timed under; ``deadline`` (a ``sim.now()`` value) bounds the simulation."""

    comm: CommCost = NO_COMM_COST
    memory: MemoryModel = UNIT_MEMORY
    comm_model: str = EAGER
    deadline: float | None = None


@attrs.frozen
class Checked:
    """What ``check`` made: the plan judged, its ``report`` (None when not verified),
    its ``run`` (None when not simulated) and ``failure``, the simulator's refusal when
    the run could not complete."""

    plan: Plan
    report: Report | None
    run: SimResult | None = None
    failure: SimulationError | None = None


def runs(report: Report | None) -> bool:
    """The plan runs to completion: not verified, verified, or only over its memory limit
    (a plan that does not fit is still timed)."""
    return report is None or report.verified or (bool(report.violations)
                                                 and not report.undecided and all(
        v.property == "memory" for v in report.violations))


def check(target: Schedule | Plan, question: Question | None,
          duration: Callable[[Op], float] = standard_duration, rlimit: int | None = None,
          timing: Timing | None = None, when: Callable[[Report | None], bool] = runs,
          split: bool = False, phase: Callable[[str], None] = lambda text: None) -> Checked:
    """Lower ``target`` for ``duration``, verify it for ``question`` (None: not verified)
    with Z3's ``rlimit`` per query, and with ``timing`` simulate it when ``when(report)``.
    ``split``: a big plan is verified on two cores (``check`` and ``export`` ask for it;
    off by default, as for a caller with threads of its own). ``phase(text)`` hears each step as it starts. ``QuestionError`` (bad input) and ``DeadlinePassed`` (checked between the
    steps) propagate; a simulation that cannot complete is ``Checked.failure``."""
    plan = as_plan(target, duration)
    deadline = timing.deadline if timing is not None else None
    check_deadline(deadline)
    report = None
    if question is not None:
        two = split and plan.num_ops >= TWO_PROCESS_OPS
        phase(f"verifying {plan.num_ops} ops with Z3" + (" on two cores" if two else ""))
        report = judge(plan, question, rlimit, split)
    check_deadline(deadline)
    if timing is None or not when(report):
        return Checked(plan, report)
    try:
        run = simulate(plan, duration, timing.comm, timing.memory, timing.comm_model, deadline)
    except SimulationError as e:
        return Checked(plan, report, failure=e)
    return Checked(plan, report, run)


def judge(plan: Plan, question: Question, rlimit: int | None = None,
          split: bool = False) -> Report:
    """``plan`` judged op by op for ``question``: ``verify``, or on two cores
    (``verify_split``) from ``TWO_PROCESS_OPS`` ops; the report answers ``question``."""
    two = split and plan.num_ops >= TWO_PROCESS_OPS
    report = (verify_split if two else verify)(plan, rlimit=rlimit, question=question)
    return question.answered(report, plan)


def passes_under(plan: Plan, question: Question, rlimit: int | None) -> list[str]:
    """The weaker comm models under which ``plan``, deadlocked under rendezvous, runs to
    completion (``["eager"]`` or ``[]``), as the verifier judges ``question`` under each."""
    report = verify(plan, rlimit=rlimit, question=attrs.evolve(question, comm_model=EAGER))
    return [EAGER] if report.stats["properties"]["deadlock"]["status"] == "proved" else []
