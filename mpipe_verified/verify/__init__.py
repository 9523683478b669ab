"""The verifier: one entry point, five properties, every verdict backed by Z3.

``verify(plan, memory_limit=None, comm_model="rendezvous")`` runs each property's linear
pass (``properties``) over the shared semantics. A property with findings is *violated*
once Z3 confirms each finding (the ground fact breaks its template, or the wait-for
cycle's core is unsatisfiable). A property without findings is *proven* once Z3 shows
that no fact of its certificate violates its template (``obligations.prove``). Anything
Z3 cannot decide makes the report *undecided* (exit 3), never verified.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import numbers
import time
from typing import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

from ..ir import Plan
from ..semantics import (COMM_MODELS, RENDEZVOUS, UNIT_MEMORY, MemoryModel, pair_collectives,
                         pair_p2p)
from . import properties
from .obligations import check_unsat, confirm, prove
from .report import (PROPERTIES, Certificate, CertificateError, Report, Violation,
                     check_certificate, plan_digest)

__all__ = ["verify", "verify_loaded", "Report", "Violation", "Certificate", "CertificateError",
           "check_certificate", "plan_digest", "PROPERTIES"]


def verify(plan: Plan, memory_limit=None, comm_model: str = RENDEZVOUS,
           memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None) -> Report:
    """Judge ``plan`` under docs/semantics.md §2 with ``comm_model``. ``memory_limit``: None, a
    number, or one number per rank (another count is a ``ValueError``). ``rlimit`` caps Z3's resources per query (for tests
    and for callers that prefer "undecided" to waiting)."""
    _check_model(comm_model)
    limits = properties.memory_limits(memory_limit, plan.num_ranks)
    clock = time.perf_counter()
    with collector_paused():
        decided = {**_local_properties(plan, limits, memory_model, rlimit),
                   **_comm_properties(plan, comm_model, rlimit)}
        return _report(plan, decided, limits, comm_model, clock)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a block that builds or walks a big plan:
    the plan and the facts are acyclic, but each collection would scan all of them again
    (a third of the time at 2*10^5 ops). Reference counting still frees everything."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def verify_loaded(load: Callable[[], Plan], memory_limit=None, comm_model: str = RENDEZVOUS,
                  memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None
                  ) -> tuple[Plan, Report]:
    """``verify(load())`` on two cores: fork *before* loading, so each process builds its
    own copy of the plan (forking after would make both processes copy every page they
    touch), then this process decides completeness, dependency and memory while the
    child decides matching and deadlock. ``load`` must be deterministic and picklable (e.g. a
    ``functools.partial`` of a module-level function). Same verdicts as ``verify``. A
    per-rank ``memory_limit`` of the wrong length is refused (``ValueError``) once the
    plan is loaded, after the child finished."""
    _check_model(comm_model)
    if memory_limit is not None:  # its values now, its length once the plan is loaded
        if not isinstance(memory_limit, numbers.Real):
            memory_limit = tuple(memory_limit)
        properties.memory_limits(memory_limit, len(memory_limit)
                                 if isinstance(memory_limit, tuple) else 1)
    clock = time.perf_counter()
    if "fork" not in mp.get_all_start_methods():
        with collector_paused():
            plan = load()
        return plan, verify(plan, memory_limit, comm_model, memory_model, rlimit)
    with collector_paused(), ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        future = pool.submit(_load_then_comm, load, comm_model, rlimit)
        plan = load()
        limits = properties.memory_limits(memory_limit, plan.num_ranks)
        local = _local_properties(plan, limits, memory_model, rlimit)
        # while the child works: the digest a certificate would need
        digest = plan_digest(plan) if all(
            local[name][0] == "proved" for name in local if name != "peaks") else None
        decided = {**local, **future.result()}
        return plan, _report(plan, decided, limits, comm_model, clock, digest)


def _load_then_comm(load, comm_model, rlimit) -> dict:
    return _comm_properties(load(), comm_model, rlimit)


def _check_model(comm_model: str) -> None:
    if comm_model not in COMM_MODELS:
        raise ValueError(f"comm model must be one of {COMM_MODELS}, got {comm_model!r}")


def _report(plan: Plan, decided: dict, limits, comm_model: str, clock: float,
            digest: str | None = None) -> Report:
    """Assemble the verdict: violated if any property has confirmed violations, undecided
    if any is unknown, verified (with a certificate) only if all five are proven.
    ``limits``: one memory bound per rank or None (``properties.memory_limits``).
    ``digest``: ``plan_digest(plan)`` if already known."""
    decided = dict(decided)
    peaks = decided.pop("peaks")
    violations, undecided = [], []
    stats = {"ops": plan.num_ops, "ranks": plan.num_ranks, "comm_model": comm_model,
             "properties": {}}
    for name in PROPERTIES:
        status, detail, found = decided[name]
        stats["properties"][name] = {"status": status, **detail}
        violations.extend(found)
        if status == "unknown":
            undecided.append(f"{name}: {detail.get('reason', 'solver returned unknown')}")
    stats["seconds"] = round(time.perf_counter() - clock, 4)
    status = "violated" if violations else "undecided" if undecided else "verified"
    certificate = None
    if status == "verified":
        certificate = Certificate(digest or plan_digest(plan), PROPERTIES,
                                  _limits(limits), comm_model)
    return Report(status, tuple(violations), peaks, stats, certificate, tuple(undecided))


def _local_properties(plan, limits, memory_model, rlimit) -> dict:
    """Completeness, dependency and memory (the half that needs no pairing or run).
    ``limits``: one memory bound per rank or None (``properties.memory_limits``)."""
    out = {}
    for name, run in (("completeness", lambda: properties.completeness(plan)),
                      ("dependency", lambda: properties.dependency(plan))):
        out[name] = _timed(run, rlimit)
    mem = {}

    def memory():
        findings, obligations, mem["peaks"] = properties.memory(plan, memory_model, limits)
        return findings, obligations
    out["memory"] = _timed(memory, rlimit)
    out["peaks"] = mem["peaks"]
    return out


def _comm_properties(plan, comm_model, rlimit) -> dict:
    """Matching and deadlock, over one pairing of the plan's sends and receives."""
    pairing, collectives = pair_p2p(plan), pair_collectives(plan)
    return {"matching": _timed(lambda: properties.matching(plan, pairing, collectives), rlimit),
            "deadlock": _timed(lambda: properties.deadlock(plan, comm_model, pairing,
                                                           collectives), rlimit)}


def _timed(run, rlimit) -> tuple[str, dict, list[Violation]]:
    """Run one property's linear pass, then Z3's decision; returns ``(status, detail,
    confirmed violations)``."""
    started = time.perf_counter()
    findings, obligations = run()
    linear = time.perf_counter() - started
    status, detail = _decide(findings, obligations, rlimit)
    detail["linear_seconds"] = round(linear, 4)
    detail["z3_seconds"] = round(time.perf_counter() - started - linear, 4)
    found = [f.violation for f in findings] if status == "violated" else []
    return status, detail, found


def _limits(limits) -> tuple[float, ...] | None:
    """The certificate's per-rank memory limits, as floats."""
    return None if limits is None else tuple(float(x) for x in limits)


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
        detail = {"confirmed": confirmed}
        if getattr(findings, "unlisted", 0):  # found beyond the cap: counted, not listed
            detail["unlisted"] = findings.unlisted
        return "violated", detail
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
    return check_unsat(finding.core(), rlimit, sat="holds", unsat="violated")
