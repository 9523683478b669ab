"""The verifier: one entry point, five properties, every verdict backed by Z3.

``verify(plan, memory_limit=None, comm_model="rendezvous")`` runs each property's linear
pass (``properties``) over the shared semantics. A property with findings is *violated*
once Z3 confirms each finding (the ground fact breaks its template, or the wait-for
cycle's core is unsatisfiable). A property without findings is *proven* once Z3 shows
that no fact of its certificate violates its template (``obligations.prove``). Anything
Z3 cannot decide makes the report *undecided* (exit 3), never verified.
"""

from __future__ import annotations

import time

import z3

from ..ir import Plan
from ..semantics import COMM_MODELS, RENDEZVOUS, UNIT_MEMORY, MemoryModel, pair_collectives, pair_p2p
from . import properties
from .obligations import _answer, confirm, prove
from .report import (PROPERTIES, Certificate, CertificateError, Report, Violation,
                     check_certificate, plan_digest)

__all__ = ["verify", "Report", "Violation", "Certificate", "CertificateError",
           "check_certificate", "plan_digest", "PROPERTIES"]


def verify(plan: Plan, memory_limit=None, comm_model: str = RENDEZVOUS,
           memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None) -> Report:
    """Judge ``plan`` under DESIGN §3 with ``comm_model``. ``memory_limit``: None, a
    number, or one number per rank. ``rlimit`` caps Z3's resources per query (for tests
    and for callers that prefer "undecided" to waiting)."""
    if comm_model not in COMM_MODELS:
        raise ValueError(f"comm model must be one of {COMM_MODELS}, got {comm_model!r}")
    clock = time.perf_counter()
    pairing, collectives = pair_p2p(plan), pair_collectives(plan)
    mem_findings, mem_obligations, peaks = properties.memory(plan, memory_model, memory_limit)
    passes = {
        "completeness": properties.completeness(plan),
        "dependency": properties.dependency(plan),
        "matching": properties.matching(plan, pairing, collectives),
        "deadlock": properties.deadlock(plan, comm_model, pairing, collectives),
        "memory": (mem_findings, mem_obligations),
    }
    linear_s = time.perf_counter() - clock
    violations, undecided, stats = [], [], {"ops": plan.num_ops, "ranks": plan.num_ranks,
                                            "comm_model": comm_model, "properties": {}}
    for name in PROPERTIES:
        findings, obligations = passes[name]
        started = time.perf_counter()
        status, detail = _decide(findings, obligations, rlimit)
        stats["properties"][name] = {"status": status, **detail,
                                     "z3_seconds": round(time.perf_counter() - started, 4)}
        if status == "violated":
            violations.extend(f.violation for f in findings)
        elif status == "unknown":
            undecided.append(f"{name}: {detail.get('reason', 'solver returned unknown')}")
    stats["linear_seconds"] = round(linear_s, 4)
    stats["seconds"] = round(time.perf_counter() - clock, 4)
    if violations:
        status = "violated"
    elif undecided:
        status = "undecided"
    else:
        status = "verified"
    certificate = None
    if status == "verified":
        limit = None if memory_limit is None else tuple(
            float(memory_limit) if isinstance(memory_limit, (int, float)) else float(x)
            for x in ([memory_limit] * plan.num_ranks if isinstance(memory_limit, (int, float))
                      else memory_limit))
        certificate = Certificate(plan_digest(plan), PROPERTIES, limit, comm_model)
    return Report(status, tuple(violations), peaks, stats, certificate, tuple(undecided))


def _decide(findings, obligations, rlimit) -> tuple[str, dict]:
    """Z3's verdict on one property: ``proved``, ``violated`` or ``unknown``."""
    if findings:
        confirmed = 0
        for finding in findings:
            answer = _confirm(finding, rlimit)
            if answer == "unknown":
                return "unknown", {"reason": "Z3 could not confirm a counterexample"}
            if answer != "violated":
                return "unknown", {"reason": f"Z3 rejected the counterexample "
                                             f"'{finding.violation.message}' (internal error)"}
            confirmed += 1
        return "violated", {"confirmed": confirmed}
    outcome = prove(obligations, rlimit)
    detail = {"facts": outcome.facts, "runs": outcome.runs}
    if outcome.status == "proved":
        return "proved", detail
    if outcome.status == "violated":
        return "unknown", {**detail, "reason": f"Z3 found a violating fact {outcome.witness} "
                                               "the linear pass missed (internal error)"}
    return "unknown", {**detail, "reason": outcome.reason or "unknown"}


def _confirm(finding, rlimit) -> str:
    if finding.fact is not None:
        return confirm(*finding.fact, rlimit=rlimit)
    solver = z3.Solver()
    if rlimit is not None:
        solver.set("rlimit", rlimit)
    solver.add(finding.core())
    result = solver.check()
    return _answer(result, sat="holds", unsat="violated")
