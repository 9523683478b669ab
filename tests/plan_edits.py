"""Hand edits of lowered plans shared by several test files."""

from __future__ import annotations

import functools
import pathlib

import attrs

from mpipe_verified.algebra.families import family
from mpipe_verified.formats.plan_json import read_plan_json
from mpipe_verified.ir import Plan, Recv
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
