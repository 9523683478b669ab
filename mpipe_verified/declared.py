"""Declared sizes: the stage, microbatch and rank counts a schedule must have, for inputs
that do not carry them.

A torch CSV holds one row per rank and the cells it holds, nothing more: a file whose
last microbatch or last stage row was dropped reads as a smaller schedule that is
complete on its own terms. ``declare(target, stages=S, microbatches=M, ranks=R)``
states the sizes through the schedule or plan itself, so the verifier's ordinary
``completeness`` property reports the missing work by name:

- ``microbatches``: ``num_microbatches = M``; every stage owes the work of microbatches
  ``0..M-1``;
- ``ranks``: ``R`` programs; a rank the file has no row for runs nothing (an empty
  program);
- ``stages``: a placement of ``S`` stages; each stage the file mentions stays on the
  rank (row) that holds it, and a stage the file never mentions is placed looped, on
  rank ``s % R`` (``R``: the declared or the file's rank count).

Invariants: the programs are unchanged (same ops, same order), so every position in a
report is still the file's; a declared count below what the input holds (fewer stages,
microbatches or ranks than it has), or above ``MAX_SIZE``, is a ``ParameterError``, not a
guess (a file's reader names the first op beyond it first: ``formats.ranges``).

Ranks that run nothing: every rank costs the verifier time and memory (its program, its
memory levels, its peak, its row in every report), and a rank without an op pays for
none of it. So neither a file (``idle_rank_beyond``: both readers) nor a declaration may
leave more than ``MAX_IDLE_RANKS`` ranks without an op (idle steps aside); every other
rank runs an op. Likewise a stage (its units of work, its sizes): neither a plan-json
placement nor a declaration may hold more than ``MAX_IDLE_STAGES`` stages that no
compute op of the body computes (``idle_stage_beyond``; a torch CSV places only the
stages its cells name). So the verifier's cost stays bounded by the plan's ops.

A plan with a cut keeps its microbatch count: its segments name a rank per microbatch,
which no declaration can make up.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import attrs

from .errors import ParameterError
from .ir import Idle, Op, Placement, Plan, Schedule, computes_of

SIZES = ("stages", "microbatches", "ranks")
MAX_SIZE = 10**6  # as for indices in a file: a declared count costs no more than that
MAX_IDLE_RANKS = 4096  # ranks without an op, in a file or after a declaration
MAX_IDLE_STAGES = 4096  # stages no op computes, likewise
IDLE_RANKS = (f"at most {MAX_IDLE_RANKS} ranks may run nothing (each costs time and memory "
              "that no op accounts for)")
IDLE_STAGES = (f"at most {MAX_IDLE_STAGES} stages may go uncomputed (each costs time and "
               "memory that no op accounts for)")


def idle_rank_beyond(programs: Sequence[Iterable[Op]]) -> int | None:
    """The index of the ``MAX_IDLE_RANKS + 1``-th program that holds no op but idle steps,
    or None if there are not that many. Stops there: its cost is bounded by the ops and
    programs before it."""
    if len(programs) <= MAX_IDLE_RANKS:
        return None
    idle = (r for r, program in enumerate(programs)
            if all(type(op) is Idle for op in program))
    return next(itertools.islice(idle, MAX_IDLE_RANKS, None), None)


def idle_stage_beyond(programs: Iterable[Iterable[Op]], num_stages: int) -> int | None:
    """The ``MAX_IDLE_STAGES + 1``-th stage of ``0..num_stages-1`` that no compute op of
    the body computes, or None if there are not that many (time linear in the ops, and in
    the stages up to that one)."""
    if num_stages <= MAX_IDLE_STAGES:
        return None
    computed = {c.stage for program in programs for op in program for c in computes_of(op)
                if not c.segment}
    idle = (s for s in range(num_stages) if s not in computed)
    return next(itertools.islice(idle, MAX_IDLE_STAGES, None), None)


def declare(target: Schedule | Plan, stages: int | None = None,
            microbatches: int | None = None, ranks: int | None = None) -> Schedule | Plan:
    """``target`` with the declared sizes (None: keep its own; ``target`` itself when
    nothing is declared); see the module docstring."""
    for name, value in zip(SIZES, (stages, microbatches, ranks)):
        if value is not None and not 1 <= value <= MAX_SIZE:
            raise ParameterError(f"{name} must be in 1..{MAX_SIZE}, got {value}")
    if stages is None and microbatches is None and ranks is None:
        return target
    have = target.placement
    num_ranks = have.num_ranks if ranks is None else ranks
    if num_ranks < have.num_ranks:
        raise ParameterError(f"it has {have.num_ranks} ranks, more than the "
                             f"{num_ranks} declared")
    num_stages = have.num_stages if stages is None else stages
    if num_stages < have.num_stages:
        raise ParameterError(f"it holds stages 0..{have.num_stages - 1}, more than the "
                             f"{num_stages} declared")
    m = target.num_microbatches if microbatches is None else microbatches
    if m < target.num_microbatches:
        raise ParameterError(f"it holds microbatches 0..{target.num_microbatches - 1}, more "
                             f"than the {m} declared")
    if target.cut.segments and m != target.num_microbatches:
        raise ParameterError(f"{m} microbatches declared for a plan of "
                             f"{target.num_microbatches} with a cut: each segment names its "
                             "forward and backward rank per microbatch")
    if getattr(target, "pipelines", ()) and (m, num_stages) != (target.num_microbatches,
                                                                have.num_stages):
        raise ParameterError("stages or microbatches declared for a plan of several "
                             "pipelines: each pipeline names its own microbatches")
    programs = target.programs + ((),) * (num_ranks - have.num_ranks)
    if num_ranks > have.num_ranks and idle_rank_beyond(programs) is not None:
        busy = sum(any(type(op) is not Idle for op in program) for program in target.programs)
        raise ParameterError(f"{num_ranks} ranks declared, {num_ranks - busy} of them "
                             f"without an op: {IDLE_RANKS}")
    if num_stages > have.num_stages and idle_stage_beyond(programs, num_stages) is not None:
        raise ParameterError(f"{num_stages} stages declared, more than {MAX_IDLE_STAGES} of "
                             f"them computed by no op: {IDLE_STAGES}")
    placement = Placement(have.stage_to_rank + tuple(
        s % num_ranks for s in range(have.num_stages, num_stages)), num_ranks)
    return attrs.evolve(target, placement=placement, num_microbatches=m, programs=programs)
