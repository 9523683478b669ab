"""The verifier: one entry point, five properties, every verdict from the kernel.

``verify(plan, memory_limit=None, comm_model="rendezvous")`` runs each property's fast
linear pass (``passes``) over the shared semantics: untrusted, it proposes
counterexamples or its part of a witness. The trusted shell (``..question``) forms the
question (limits, sizes, declared sizes, the input as read) and has the kernel
(``..kernel``) decide each property: *violated* once it confirms every finding from the
plan alone, *proven* once it proves the property from the plan and the witness. Its
``Verdict`` is the report's status; this module only adds the explanations (the
findings' messages, peaks as the passes computed them, timings). A finding the kernel
does not confirm, a witness it refutes, a plan that is not the question's, and anything
Z3 cannot decide make the report *undecided* (exit 3), never verified.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Iterator

from .. import kernel
from ..forking import can_fork, forked
from ..ir import Plan
from ..question import Asked, Question
from ..figures import figures
from ..semantics import (COMM_MODELS, RENDEZVOUS, UNIT_MEMORY, MemoryModel, host_peaks,
                         op_table, pair_collectives, pair_p2p, plan_offloads)
from . import passes
from .report import PROPERTIES, Certificate, CertificateError, Report, Violation, plan_digest

__all__ = ["verify", "verify_loaded", "verify_split", "Report", "Violation", "Certificate",
           "CertificateError", "Question", "plan_digest", "PROPERTIES"]


def verify(plan: Plan, memory_limit=None, comm_model: str = RENDEZVOUS,
           memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None,
           question: Question | None = None) -> Report:
    """Judge ``plan`` under docs/semantics.md §2. The question: ``question``, or one
    formed from ``comm_model``, ``memory_limit`` (None, a number, or one number per rank;
    another count is a ``ValueError``) and ``memory_model`` (the unit model by name, or
    the caller's own). ``rlimit`` caps Z3's resources per query (for tests and for
    callers that prefer "undecided" to waiting)."""
    asked = _asked(plan, question, memory_limit, comm_model, memory_model)
    clock = time.perf_counter()
    with collector_paused():
        table = op_table(plan, overlapped=True)
        local = _local_properties(asked, table, rlimit)
        comm = _comm_properties(asked, table, rlimit)
        return _report(asked, _merged(local, comm), clock)


def question_of(memory_limit=None, comm_model: str = RENDEZVOUS,
                memory_model: MemoryModel = UNIT_MEMORY) -> Question:
    """The question a caller of ``verify`` asks with these arguments: the unit model by
    name when ``memory_model`` is ``UNIT_MEMORY``, else the caller's own model."""
    _check_model(comm_model)
    return Question(comm_model, memory_limit,
                    "unit" if memory_model is UNIT_MEMORY else memory_model)


def _asked(plan, question, memory_limit, comm_model, memory_model) -> Asked:
    return Asked(plan, question or question_of(memory_limit, comm_model, memory_model))


def _passes_memory(asked: Asked) -> MemoryModel:
    """The memory model the passes use: the unit model, the caller's own, or a view of
    the sizes the trusted shell computed from a spec's numbers (so the passes' witness
    sums what the kernel sums)."""
    memory = asked.question.memory
    if memory == "unit":
        return UNIT_MEMORY
    if isinstance(memory, MemoryModel):
        return memory
    sizes = asked.sizes  # each stored and buffer size is one number of the spec: a float
    stored = {key: float(v) for key, v in sizes.stored.items()}  # says it exactly
    buffer = {key: float(v) for key, v in sizes.buffer.items()}
    kw = {"buffer": lambda p: buffer.get(p, 0.0)} if buffer else {}
    return MemoryModel(stored=lambda stage, segment: stored.get((segment, stage), 1.0),
                       static=sizes.static, **kw)  # static parts are exact sums


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
                  memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None,
                  question: Question | None = None) -> tuple[Plan, Report]:
    """``(plan, verify_split(plan, ...))`` for ``plan = load()``, loaded with the
    collector paused."""
    _check_model(comm_model)
    with collector_paused():
        plan = load()
        return plan, verify_split(plan, memory_limit, comm_model, memory_model, rlimit,
                                  question)


def verify_split(plan: Plan, memory_limit=None, comm_model: str = RENDEZVOUS,
                 memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None,
                 question: Question | None = None) -> Report:
    """``verify(plan, ...)`` on two cores: a forked child inherits the plan, its op table
    and the kernel's columns (nothing is pickled; it copies only the pages whose
    reference counts it touches) and decides dependency and deadlock (and matching, for
    a plan without a table) while this process decides completeness, memory, matching
    for a plan with a table, and the digest (the halves take about equal time). Same
    verdicts as ``verify``."""
    if not can_fork():
        return verify(plan, memory_limit, comm_model, memory_model, rlimit, question)
    asked = _asked(plan, question, memory_limit, comm_model, memory_model)
    clock = time.perf_counter()
    with collector_paused():  # built once, inherited by the child:
        table = op_table(plan, overlapped=True)
        kernel.read(plan)  # after the fork, each touch of an op object copies its page
    with collector_paused(), forked(_comm_properties, asked, table, rlimit) as comm:
        local = _local_properties(asked, table, rlimit)
        asked.digest()  # while the child works: every verdict states it
        return _report(asked, _merged(local, comm()), clock)


def _check_model(comm_model: str) -> None:
    if comm_model not in COMM_MODELS:
        raise ValueError(f"comm model must be one of {COMM_MODELS}, got {comm_model!r}")


def _report(asked: Asked, decided: dict, clock: float) -> Report:
    """The report: the kernel's verdict (``Asked.verdict``: its status, digest and
    proved peaks), the confirmed violations' messages, the peaks as the passes computed
    them, and, when verified, the certificate and its witness."""
    plan, question = asked.plan, asked.question
    decided = dict(decided)
    peaks, highest, hints = decided.pop("peaks"), decided.pop("highest"), decided.pop("hints")
    witness = _witness(hints)
    verdict = asked.verdict({name: decided[name][0] for name in PROPERTIES})
    violations, undecided = [], []
    stats = {"ops": plan.num_ops, "ranks": plan.num_ranks,
             "comm_model": question.comm_model, "properties": {}}
    for name in PROPERTIES:
        answer, detail, found = decided[name]
        stats["properties"][name] = {"status": answer.status, **_detail(answer), **detail}
        if answer.status == "violated" and verdict.status == "violated":
            violations.extend(found)
        if answer.status == "unknown":
            undecided.append(f"{name}: {answer.reason or 'solver returned unknown'}")
    if verdict.refusal is not None:
        undecided.append(f"not verified: {verdict.refusal} (internal error)")
    host = host_peaks(plan, _passes_memory(asked)) if plan_offloads(plan) else {}
    if host:  # what offloads keep in host memory (§2.10: reported, not limited)
        stats["host_peak_memory"] = figures(host)
    stats["seconds"] = round(time.perf_counter() - clock, 4)
    certificate = None
    if verdict.status == "verified":
        certificate = Certificate(verdict.digest, PROPERTIES, _limits(verdict.limits),
                                  question.comm_model)
    if verdict.peaks is not None:  # the peaks the kernel proved, exact sums
        peaks = {rank: _number(peak) for rank, peak in enumerate(verdict.peaks)}
        highest = max(verdict.peaks, default=highest)
    return Report(verdict, tuple(violations), peaks, stats, certificate, tuple(undecided),
                  witness if certificate is not None else None, asked.sizes, verdict.limits,
                  highest_peak=highest)


def _number(x):
    """An exact peak as the report shows it: an int as it is, else the nearest float."""
    return x if type(x) is int else float(x)


def _detail(answer) -> dict:
    out = {} if answer.runs is None else {"facts": answer.facts, "runs": answer.runs}
    if answer.confirmed:
        out["confirmed"] = answer.confirmed
    if answer.reason:
        out["reason"] = answer.reason
    return out


def _witness(hints: dict) -> kernel.Witness:
    levels, peaks, peak_at = hints.get("memory") or (None, None, None)
    return kernel.Witness(hints.get("deadlock"), hints.get("dependency"), levels, peaks,
                          peak_at)


def _local_properties(asked: Asked, table, rlimit) -> dict:
    """Completeness, memory and, for a plan with a ``table``, matching (the half that
    needs no pairing, run or producers). ``table``: ``semantics.op_table(plan,
    overlapped=True)``."""
    plan, judge = asked.plan, _Judge(asked, rlimit)
    out = {"completeness": judge("completeness", lambda: passes.completeness(plan,
                                                                                 table))}
    mem = {}

    def memory():
        found = passes.memory(plan, _passes_memory(asked), asked.limits, table)
        findings, hint, mem["peaks"], mem["highest"] = found
        return findings, hint
    out["memory"] = judge("memory", memory)
    if table is not None:  # its transfers pair by columns: no pairing to share
        calls = len(table.call_rows())  # its collectives, if any, paired as with no table
        out["matching"] = judge("matching", lambda: passes.matching(
            plan, collectives=pair_collectives(plan) if calls else None, table=table))
    return {**out, "peaks": mem["peaks"], "highest": mem["highest"], "hints": judge.hints}


def _comm_properties(asked: Asked, table, rlimit) -> dict:
    """Dependency, then deadlock (both by ``table``'s columns where it has one, which
    pair the transfers themselves), and matching where ``table`` is None (else
    ``_local_properties`` decides it), over one op-by-op pairing of the plan's sends,
    receives and collectives when there is no table."""
    plan, judge = asked.plan, _Judge(asked, rlimit)
    comm_model = asked.question.comm_model
    out = {"dependency": judge("dependency", lambda: passes.dependency(plan, table))}
    pairing = collectives = None  # a table's plan is paired by columns, only if needed
    if table is None:
        pairing, collectives = pair_p2p(plan), pair_collectives(plan)
        out["matching"] = judge("matching", lambda: passes.matching(plan, pairing,
                                                                         collectives))
    out["deadlock"] = judge("deadlock", lambda: passes.deadlock(plan, comm_model, pairing,
                                                                     collectives, table))
    return {**out, "hints": judge.hints}


class _Judge:
    """Runs one property's fast pass, then has the trusted shell decide it
    (``Asked.decide``: the findings confirmed, or the property proven from the pass's
    hint). Keeps each pass's hint for the witness of a certificate."""

    def __init__(self, asked: Asked, rlimit) -> None:
        self.asked, self.rlimit = asked, rlimit
        self.hints: dict = {}

    def __call__(self, name: str, run) -> tuple:
        """``(Answer, timings, violations)``."""
        started = time.perf_counter()
        findings, self.hints[name] = run()
        linear = time.perf_counter() - started
        answer = self.asked.decide(name, [f.claim for f in findings],
                                   _witness({name: self.hints[name]}), self.rlimit)
        detail = {"linear_seconds": round(linear, 4),
                  "kernel_seconds": round(time.perf_counter() - started - linear, 4)}
        if answer.status == "violated" and getattr(findings, "unlisted", 0):
            detail["unlisted"] = findings.unlisted  # found beyond the cap: counted, not listed
        return answer, detail, [f.violation for f in findings] if findings else []


def _limits(limits) -> tuple[float, ...] | None:
    """The certificate's per-rank memory limits, as floats."""
    return None if limits is None else tuple(float(x) for x in limits)
