"""The law harness: a law is a named statement with a scope whose proof is a list of Z3
*obligations*; running the law asks Z3 to refute each obligation.

An ``Obligation`` is ``hypotheses ⊢ goal``. Z3 is given the hypotheses and ``Not(goal)``:

- ``unsat`` for every obligation: the law is **proved**;
- ``sat`` for some obligation: the law **failed**, and the model is the counterexample;
- anything else (``unknown``, timeout, resource limit): the law is **unknown**, never proved.

Hypotheses are definitions (the defining equations of a derived function) and the law's
preconditions; ``lemmas`` are formulas proven by earlier obligations of the same law,
under hypotheses the using obligation also has (an obligation may use a lemma only if its
law proves it first). Recursive functions are Z3 ``RecFunction`` definitions, which are
conservative. Because a proof by contradiction from inconsistent hypotheses proves
nothing, every obligation with hypotheses is also checked for *vacuity*: the hypotheses
must hold at the obligation's ``example`` point, or Z3 must find them satisfiable;
``unsat`` fails the law, ``unknown`` is recorded in the detail. (Lemmas need no such check:
they follow from the definitions and hypotheses. Ground SMT-LIB obligations define each
function at pairwise distinct points, so they are consistent by construction.)

Induction is spelled out, never assumed of Z3: a law proved "by induction" has a ``base``
obligation and a ``step`` obligation whose hypotheses are the induction hypothesis
(instantiated at the terms the step needs, which is sound: an instance of a universally
quantified hypothesis is implied by it); a step is often split into cases that together
cover every case, each with the unfolding equations it needs as lemmas (Z3's recursive
function unfolding gets lost in larger contexts). Strong induction appears as its step:
"if the claim holds at every smaller point, it holds here".

``run_all`` checks each law in a fresh forked process, so no law's verdict or time
depends on what Z3 did before it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import z3

from mpipe_verified.ir import PROPERTIES

PROVED, FAILED, UNKNOWN = "proved", "failed", "unknown"
ALL_SIZES = "all sizes"
# What a family invariant proves: the verifier's five properties (``ir.PROPERTIES``).
DEFAULT_TIMEOUT_MS = 20_000
VACUITY_TIMEOUT_MS = 1_000


BOUNDED = "bounded:"


def bounded(description: str) -> str:
    """Scope text of a bounded law: ``bounded:`` and the bound, e.g. ``bounded: p <= 8,
    m <= 16; package-derived instances``."""
    return f"{BOUNDED} {description}"


def all_sizes(how: str = "") -> str:
    """Scope text of an unbounded law; ``how`` says how (e.g. ``induction on |s|``)."""
    return ALL_SIZES + (f" ({how})" if how else "")


@dataclass(frozen=True)
class Obligation:
    """``hypotheses ⊢ goal``; ``name`` says which part of the proof it is. ``smt``, a pair
    ``(hypotheses, goal)`` of SMT-LIB texts (declarations and assertions; one formula),
    replaces ``goal``/``hypotheses`` for large ground obligations, where building Python Z3
    terms would dominate the time."""

    name: str
    goal: z3.BoolRef | None = None
    hypotheses: tuple = ()
    smt: tuple[str, str] | None = None
    example: tuple = ()  # (const, value) pairs at which the hypotheses hold (vacuity)
    lemmas: tuple = ()  # proven by earlier obligations of the same law (see module doc)


@dataclass(frozen=True)
class LawResult:
    name: str
    statement: str
    scope: str
    status: str
    seconds: float
    detail: str = ""
    obligations: int = 0
    family: str | None = None
    property: str | None = None

    def to_json(self) -> dict:
        out = {"name": self.name, "status": self.status, "scope": self.scope,
               "seconds": round(self.seconds, 3), "statement": self.statement,
               "obligations": self.obligations, "detail": self.detail}
        if self.family is not None:
            out["family"], out["property"] = self.family, self.property
        return out


@dataclass(frozen=True)
class Law:
    """A law: ``build()`` returns its obligations; calling the law checks them."""

    name: str
    statement: str
    scope: str
    build: Callable[[], Iterable[Obligation]] = field(repr=False)
    weight: int = 1  # rough cost: heavier laws are started first by ``run_all``
    family: str | None = None  # a family invariant: the family it is about ...
    property: str | None = None  # ... and which of PROPERTIES it proves
    # Machine-readable scope of a family invariant, over the family's parameters (a
    # mapping with "pp", "microbatches", "chunks" and, for transpose, its options):
    # ``covers(params)`` says whether the law proves that instance (None: every valid
    # instance when the scope is all sizes, none when it is bounded); a memory law's
    # ``peak(params)`` is the proven per-rank unit-model peak (a tuple, rank order).
    covers: Callable[[Mapping[str, object]], bool] | None = field(default=None, repr=False)
    peak: Callable[[Mapping[str, object]], tuple[int, ...]] | None = field(default=None,
                                                                           repr=False)

    def __post_init__(self) -> None:
        if (self.family is None) != (self.property is None):
            raise ValueError(f"law {self.name}: family and property go together")
        if self.property is not None and self.property not in PROPERTIES:
            raise ValueError(f"law {self.name}: unknown property {self.property!r}")
        if not (self.scope.startswith(ALL_SIZES) or self.scope.startswith(BOUNDED)):
            raise ValueError(f"law {self.name}: scope must start with {ALL_SIZES!r} or "
                             f"{BOUNDED!r}, got {self.scope!r}")

    def for_all_sizes(self) -> bool:
        return self.scope.startswith(ALL_SIZES)

    def proves(self, params: Mapping[str, object]) -> bool:
        """Whether this law's scope holds the family instance ``params``."""
        if self.covers is not None:
            return bool(self.covers(params))
        return self.for_all_sizes()

    def result(self, status: str, seconds: float, detail: str = "",
               obligations: int = 0) -> "LawResult":
        return LawResult(self.name, self.statement, self.scope, status, seconds, detail,
                         obligations, self.family, self.property)

    def __call__(self, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> LawResult:
        return check(self, timeout_ms)

    def obligations(self) -> list[Obligation]:
        return list(self.build())


def memo_terms(fn: Callable) -> Callable:
    """Cache a term-building function by its arguments (a Z3 term by its id, the term
    kept alive in the cache so its id is never reused), so laws that share a model build
    its terms once."""
    cache: dict = {}

    def cached(*args):
        key = tuple(a.get_id() if isinstance(a, z3.AstRef) else a for a in args)
        if key not in cache:
            cache[key] = (args, fn(*args))
        return cache[key][1]
    cached.__doc__, cached.__name__ = fn.__doc__, fn.__name__
    return cached


def law(name: str, statement: str, scope: str, weight: int = 1, family: str | None = None,
        property: str | None = None, covers=None, peak=None) -> Callable[[Callable], Law]:
    """Decorator: turn ``def f() -> Iterable[Obligation]`` into a ``Law``."""
    def wrap(fn: Callable[[], Iterable[Obligation]]) -> Law:
        return Law(name, statement, scope, fn, weight=weight, family=family,
                   property=property, covers=covers, peak=peak)
    return wrap


def _solver(timeout_ms: int) -> z3.Solver:
    s = z3.Then("simplify", "solve-eqs", "smt").solver()
    s.set("timeout", timeout_ms)
    return s


def _model_excerpt(solver: z3.Solver, limit: int = 600) -> str:
    try:
        model = solver.model()
    except z3.Z3Exception:
        return ""
    parts = []
    for d in sorted(model.decls(), key=lambda d: d.name()):
        if d.arity() == 0:
            parts.append(f"{d.name()}={model[d]}")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[:limit] + "..."


# Ground SMT-LIB obligations (facts ``f(args) = value`` plus properties over the same
# terms): propagating the facts' values first makes the search trivial.
GROUND_TACTIC = ("propagate-values", "smt")


def refute(ob: Obligation, timeout_ms: int) -> tuple[str, str]:
    """Ask Z3 for a model of the hypotheses and the negated goal: ``(status, detail)``."""
    if ob.smt is not None:
        s = z3.Then(*GROUND_TACTIC).solver()
        s.set("timeout", timeout_ms)
        s.from_string(ob.smt[0] + f"(assert (not {ob.smt[1]}))")
    else:
        s = _solver(timeout_ms)
        s.add(*ob.hypotheses)
        s.add(*ob.lemmas)
        s.add(z3.Not(ob.goal))
    result = s.check()
    if result == z3.unsat:
        return PROVED, ""
    if result == z3.sat:
        return FAILED, f"{ob.name}: counterexample {_model_excerpt(s)}"
    return UNKNOWN, f"{ob.name}: z3 {s.reason_unknown()}"


def vacuous(ob: Obligation) -> str | None:
    """``"vacuous"`` when Z3 shows the hypotheses inconsistent, ``"unchecked"`` when it
    cannot tell quickly, ``None`` when they are satisfiable (or there are none). With an
    ``example``, Z3 first checks the hypotheses at that point (a model by construction)."""
    if ob.smt is not None:  # ground facts defining functions at distinct points (by
        return None         # construction, see proofs.families): consistent
    if not ob.hypotheses:
        return None
    if ob.example:
        s = _solver(VACUITY_TIMEOUT_MS)
        s.add(*[_at(h, ob.example) for h in ob.hypotheses])
        if s.check() == z3.sat:
            return None
    s = _solver(VACUITY_TIMEOUT_MS)
    s.add(*ob.hypotheses)
    result = s.check()
    if result == z3.unsat:
        return "vacuous"
    return None if result == z3.sat else "unchecked"


def _at(formula, example):
    """``formula`` with each ``(symbol, value)`` of ``example`` substituted; a function
    symbol's value is its body over ``z3.Var(0..)``."""
    consts = [(c, v) for c, v in example if not isinstance(c, z3.FuncDeclRef)]
    funs = [(f, v) for f, v in example if isinstance(f, z3.FuncDeclRef)]
    if consts:
        formula = z3.substitute(formula, *consts)
    if funs:
        formula = z3.substitute_funs(formula, *funs)
    return formula


def check(law: Law, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> LawResult:
    """Refute every obligation of ``law`` (see the module docstring for the verdicts)."""
    started = time.perf_counter()
    status, details, count = PROVED, [], 0
    try:
        obligations = law.obligations()
    except Exception as e:  # a law that cannot even be stated is not proved
        return law.result(UNKNOWN, time.perf_counter() - started, f"could not build: {e!r}")
    unchecked = []
    for ob in obligations:
        count += 1
        verdict, detail = refute(ob, timeout_ms)
        if verdict == PROVED:
            v = vacuous(ob)
            if v == "vacuous":
                verdict, detail = FAILED, f"{ob.name}: hypotheses are inconsistent (vacuous)"
            elif v == "unchecked":
                unchecked.append(ob.name)
        if verdict == FAILED:
            status = FAILED
            details.append(detail)
            break
        if verdict == UNKNOWN:
            status = UNKNOWN
            details.append(detail)
    if unchecked and status == PROVED:
        details.append("hypotheses not shown satisfiable within "
                       f"{VACUITY_TIMEOUT_MS} ms: {', '.join(unchecked)}")
    return law.result(status, time.perf_counter() - started, "; ".join(details), count)


_PENDING: list[Law] = []  # the laws of the current ``run_all``, read by forked workers


def _worker(index: int, timeout_ms: int, conn) -> None:
    law = _PENDING[index]
    try:
        result = check(law, timeout_ms)
    except BaseException as e:  # noqa: BLE001 - a crashed law decides nothing
        result = law.result(UNKNOWN, 0.0, f"worker failed: {e!r}")
    conn.send(result)
    conn.close()


def run_all(laws: Sequence[Law], timeout_ms: int = DEFAULT_TIMEOUT_MS,
            jobs: int | None = None) -> list[LawResult]:
    """Check ``laws``, each in a fresh forked process (``jobs`` at a time; default: one
    per CPU): Z3's global state then never carries over from one law to the next, so a
    law's verdict and time do not depend on which laws ran before it. Without ``fork``
    (or with ``jobs=0``) the laws run one after another in this process."""
    import multiprocessing as mp  # here: a prover of one family's laws never forks
    import multiprocessing.connection  # noqa: F401 - mp.connection.wait
    laws = list(laws)
    if jobs == 0 or "fork" not in mp.get_all_start_methods() or not laws:
        return [check(law, timeout_ms) for law in laws]
    jobs = max(1, jobs or os.cpu_count() or 1)
    ctx = mp.get_context("fork")
    _PENDING[:] = laws
    results: list[LawResult | None] = [None] * len(laws)
    running: dict = {}  # reader -> (index, process)
    todo = sorted(range(len(laws)), key=lambda i: -laws[i].weight)
    try:
        while todo or running:
            while todo and len(running) < jobs:
                i = todo.pop(0)
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(i, timeout_ms, writer), daemon=True)
                proc.start()
                writer.close()
                running[reader] = (i, proc)
            for reader in mp.connection.wait(list(running)):
                i, proc = running.pop(reader)
                try:
                    results[i] = reader.recv()
                except EOFError:  # the worker died without an answer
                    results[i] = laws[i].result(UNKNOWN, 0.0, "worker died without an answer")
                reader.close()
                proc.join()
    finally:
        for reader, (_, proc) in running.items():
            proc.kill()
            proc.join()
            reader.close()
        _PENDING.clear()
    return results  # type: ignore[return-value]


def exit_code(results: Sequence[LawResult]) -> int:
    """0: all proved; 1: some failed; 3: some unknown and none failed."""
    statuses = {r.status for r in results}
    if FAILED in statuses:
        return 1
    if UNKNOWN in statuses:
        return 3
    return 0
