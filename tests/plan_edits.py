"""Hand edits of lowered plans shared by several test files."""

from __future__ import annotations

import functools
import pathlib

import attrs

from mpipe_verified.algebra.families import family
from mpipe_verified.formats.plan_json import read_plan_json
from mpipe_verified.ir import Offload, Plan, Recv, Reload, computes_of
from mpipe_verified.lower import lower
from mpipe_verified.semantics import needs, produces

FIXTURE_DIR = pathlib.Path(__file__).resolve().parent / "fixtures"


def fixture(name: str) -> Plan:
    """The plan of ``tests/fixtures/NAME.json`` (written by ``fixtures/make_fixtures.py``)."""
    return read_plan_json(FIXTURE_DIR / f"{name}.json")


@functools.lru_cache(maxsize=None)
def lowered(name: str, p: int, m: int, v: int | None = None) -> Plan:
    """The lowered plan of a standard family (plans are immutable: cached)."""
    return lower(family(name, p, m, v).derive())


def with_program(plan: Plan, rank: int, ops) -> Plan:
    """``plan`` with rank ``rank``'s program replaced by ``ops``."""
    programs = list(plan.programs)
    programs[rank] = tuple(ops)
    return attrs.evolve(plan, programs=tuple(programs))


def props(report) -> set[str]:
    """The properties a report finds violated."""
    return {v.property for v in report.violations}


def defer_receives(plan: Plan) -> Plan:
    """The pattern of pytorch/pytorch#172668: every RECV moved to just before the compute
    op that consumes it (instead of where the lowering posted it)."""
    stages = plan.placement.num_stages
    programs = []
    for program in plan.programs:
        pending = [op for op in program if isinstance(op, Recv)]
        out = []
        for op in program:
            if isinstance(op, Recv):
                continue
            wanted = set(needs(op, stages))
            for recv in [r for r in pending if set(produces(r)) & wanted]:
                out.append(recv)
                pending.remove(recv)
            out.append(op)
        assert not pending, "every receive has a consumer"
        programs.append(tuple(out))
    return attrs.evolve(plan, programs=tuple(programs))


# ---------------------------------------------------------------- activation moves

MOVE_EDITS = ("drop_reload", "reload_after_backward", "drop_offload",
              "offload_after_backward", "duplicate_offload", "reload_first")


def _moves_at(plan: Plan, kind) -> list[tuple[int, int]]:
    return [(r, i) for r, prog in enumerate(plan.programs) for i, op in enumerate(prog)
            if isinstance(op, kind)]


def _backward_at(plan: Plan, rank: int, move) -> int:
    """The position of the first backward (``B`` or ``I``) of ``move``'s activation."""
    return next(i for i, op in enumerate(plan.programs[rank]) for c in computes_of(op)
                if c.kind in "BI" and (c.segment, c.stage, c.mb) == (move.segment, move.stage,
                                                                      move.mb))


def edit_moves(plan: Plan, kind: str, pick) -> tuple[Plan, str]:
    """One ``MOVE_EDITS`` edit of a plan with offloads; ``pick(list)`` chooses."""
    moves = _moves_at(plan, Reload if "reload" in kind else Offload)
    rank, i = pick(moves)
    prog = list(plan.programs[rank])
    op = prog[i]
    if kind.startswith("drop"):
        del prog[i]
    elif kind == "duplicate_offload":
        prog.insert(i, op)
    elif kind == "reload_first":
        prog.insert(0, prog.pop(i))
    else:  # just after the backward that needs it
        b = _backward_at(plan, rank, op)
        del prog[i]
        prog.insert(b if i < b else b + 1, op)
    return with_program(plan, rank, prog), f"{kind} rank {rank} #{i} {op}"
