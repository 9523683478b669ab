"""The verifier: one entry point, five properties, every verdict from the kernel.

``verify(plan, memory_limit=None, comm_model="rendezvous")`` runs each property's fast
linear pass (``properties``) over the shared semantics: untrusted, it proposes
counterexamples or its part of a witness. A property with findings is *violated* once
the kernel (``..kernel``) confirms every finding from the plan alone, with Z3. A property
without findings is *proven* once the kernel proves it from the plan and the witness,
with Z3. A finding the kernel does not confirm, a witness it refutes, and anything Z3
cannot decide make the report *undecided* (exit 3), never verified.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Iterator

from .. import kernel
from ..forking import can_fork, forked
from ..ir import Plan
from ..semantics import (COMM_MODELS, RENDEZVOUS, UNIT_MEMORY, MemoryModel, op_table,
                         pair_collectives, pair_p2p)
from . import properties
from .report import (PROPERTIES, Certificate, CertificateError, Report, Violation,
                     check_certificate, plan_digest)

__all__ = ["verify", "verify_loaded", "verify_split", "Report", "Violation", "Certificate", "CertificateError",
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
        table = op_table(plan)
        local = _local_properties(plan, table, limits, memory_model, comm_model, rlimit)
        comm = _comm_properties(plan, table, comm_model, rlimit)
        return _report(plan, _merged(local, comm), limits, comm_model, clock)


def _merged(local: dict, comm: dict) -> dict:
    return {**local, **comm, "hints": {**local["hints"], **comm["hints"]}}


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
    """``(plan, verify_split(plan, ...))`` for ``plan = load()``, loaded with the
    collector paused."""
    _check_model(comm_model)
    with collector_paused():
        plan = load()
        return plan, verify_split(plan, memory_limit, comm_model, memory_model, rlimit)


def verify_split(plan: Plan, memory_limit=None, comm_model: str = RENDEZVOUS,
                 memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None) -> Report:
    """``verify(plan, ...)`` on two cores: a forked child inherits the plan, its op table
    and the kernel's columns (nothing is pickled; it copies only the pages whose
    reference counts it touches) and decides dependency and deadlock (and matching, for
    a plan without a table) while this process decides completeness, memory, matching
    for a plan with a table, and the digest (the halves take about equal time). Same
    verdicts as ``verify``."""
    _check_model(comm_model)
    if not can_fork():
        return verify(plan, memory_limit, comm_model, memory_model, rlimit)
    limits = properties.memory_limits(memory_limit, plan.num_ranks)
    clock = time.perf_counter()
    with collector_paused():  # built once, inherited by the child:
        table = op_table(plan)
        kernel.read(plan)  # after the fork, each touch of an op object copies its page
    with collector_paused(), forked(_comm_properties, plan, table, comm_model,
                                     rlimit) as comm:
        local = _local_properties(plan, table, limits, memory_model, comm_model, rlimit)
        # while the child works: the digest a certificate would need
        digest = plan_digest(plan) if all(
            local[name][0] == "proved" for name in ("completeness", "memory")) else None
        return _report(plan, _merged(local, comm()), limits, comm_model, clock, digest)


def _check_model(comm_model: str) -> None:
    if comm_model not in COMM_MODELS:
        raise ValueError(f"comm model must be one of {COMM_MODELS}, got {comm_model!r}")


def _report(plan: Plan, decided: dict, limits, comm_model: str, clock: float,
            digest: str | None = None) -> Report:
    """Assemble the verdict: violated if any property has confirmed violations, undecided
    if any is unknown, verified (with a certificate and its witness) only if the kernel
    proved all five. ``limits``: one memory bound per rank or None
    (``properties.memory_limits``). ``digest``: ``plan_digest(plan)`` if already known."""
    decided = dict(decided)
    peaks, highest, sizes = decided.pop("peaks"), decided.pop("highest"), decided.pop("sizes")
    hints = decided.pop("hints")
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
    certificate = witness = None
    if status == "verified":
        certificate = Certificate(digest or plan_digest(plan), PROPERTIES,
                                  _limits(limits), comm_model)
        witness = _witness(hints)
    return Report(status, tuple(violations), peaks, stats, certificate, tuple(undecided),
                  witness, sizes, limits, highest_peak=highest)


def _witness(hints: dict) -> kernel.Witness:
    levels, peaks, peak_at = hints["memory"] or (None, None, None)
    return kernel.Witness(hints["deadlock"], hints["dependency"], levels, peaks, peak_at)


def _local_properties(plan, table, limits, memory_model, comm_model, rlimit) -> dict:
    """Completeness, memory and, for a plan with a ``table``, matching (the half that
    needs no pairing, run or producers).
    ``table``: ``semantics.op_table(plan)``; ``limits``: one memory bound per rank or None
    (``properties.memory_limits``)."""
    sizes = kernel.Sizes.of(plan, memory_model)
    judge = _Judge(plan, comm_model, sizes, limits, rlimit)
    out = {"completeness": judge("completeness", lambda: properties.completeness(plan,
                                                                                 table))}
    mem = {}

    def memory():
        found = properties.memory(plan, memory_model, limits, table)
        findings, hint, mem["peaks"], mem["highest"] = found
        return findings, hint
    out["memory"] = judge("memory", memory)
    if table is not None:  # its transfers pair by columns: no pairing to share
        out["matching"] = judge("matching", lambda: properties.matching(plan, table=table))
    return {**out, "peaks": mem["peaks"], "highest": mem["highest"], "sizes": sizes,
            "hints": judge.hints}


def _comm_properties(plan, table, comm_model, rlimit) -> dict:
    """Dependency, then deadlock (both by ``table``'s columns where it has one, which
    pair the transfers themselves), and matching where ``table`` is None (else
    ``_local_properties`` decides it), over one op-by-op pairing of the plan's sends,
    receives and collectives when there is no table."""
    judge = _Judge(plan, comm_model, None, None, rlimit)
    out = {"dependency": judge("dependency", lambda: properties.dependency(plan, table))}
    pairing = collectives = None  # a table's plan is paired by columns, only if needed
    if table is None:
        pairing, collectives = pair_p2p(plan), pair_collectives(plan)
        out["matching"] = judge("matching", lambda: properties.matching(plan, pairing,
                                                                         collectives))
    out["deadlock"] = judge("deadlock", lambda: properties.deadlock(plan, comm_model, pairing,
                                                                     collectives, table))
    return {**out, "hints": judge.hints}


class _Judge:
    """Runs one property's fast pass, then has the kernel decide: every finding confirmed
    (``violated``), or the property proven from the pass's hint (``proved``); anything
    else is ``unknown``. Keeps each pass's hint for the witness of a certificate."""

    def __init__(self, plan, comm_model, sizes, limits, rlimit) -> None:
        self.plan, self.comm_model, self.sizes = plan, comm_model, sizes
        self.limits, self.rlimit = limits, rlimit
        self.hints: dict = {}

    def __call__(self, name: str, run) -> tuple[str, dict, list[Violation]]:
        started = time.perf_counter()
        findings, self.hints[name] = run()
        linear = time.perf_counter() - started
        status, detail = (self._confirm(name, findings) if findings
                          else self._prove(name))
        detail["linear_seconds"] = round(linear, 4)
        detail["kernel_seconds"] = round(time.perf_counter() - started - linear, 4)
        found = [f.violation for f in findings] if status == "violated" else []
        return status, detail, found

    def _confirm(self, name, findings) -> tuple[str, dict]:
        answers = kernel.confirm(self.plan, name, [f.claim for f in findings],
                                 self.comm_model, self.sizes, self.limits, self.rlimit)
        for finding, answer in zip(findings, answers):
            if answer == "unknown":
                return "unknown", {"reason": "Z3 could not confirm a counterexample"}
            if answer != "violated":
                return "unknown", {"reason": f"the kernel did not confirm the counterexample "
                                             f"'{finding.violation.message}' (internal error)"}
        detail = {"confirmed": len(findings)}
        if getattr(findings, "unlisted", 0):  # found beyond the cap: counted, not listed
            detail["unlisted"] = findings.unlisted
        return "violated", detail

    def _prove(self, name) -> tuple[str, dict]:
        witness = _witness({"deadlock": None, "dependency": None, "memory": None,
                            **self.hints})
        verdict = kernel.prove(self.plan, witness, self.comm_model, self.sizes, self.limits,
                               self.rlimit, properties=(name,))[name]
        detail = {"facts": verdict.facts, "runs": verdict.runs}
        if verdict.status == "proved":
            return "proved", detail
        if verdict.status == "failed":
            return "unknown", {**detail, "reason": f"the kernel refuted the passes' witness at "
                                                   f"{verdict.detail} (internal error)"}
        return "unknown", {**detail, "reason": verdict.detail or "unknown"}


def _limits(limits) -> tuple[float, ...] | None:
    """The certificate's per-rank memory limits, as floats."""
    return None if limits is None else tuple(float(x) for x in limits)
