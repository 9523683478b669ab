"""The law harness: a law is a named statement with a scope whose proof is a list of Z3
*obligations*; running the law asks Z3 to refute each obligation.

An ``Obligation`` is ``hypotheses ⊢ goal``. Z3 is given the hypotheses and ``Not(goal)``:

- ``unsat`` for every obligation: the law is **proved**;
- ``sat`` for some obligation: the law **failed**, and the model is the counterexample;
- anything else: the law is **unknown**, never proved, and says which limit stopped it
  (``unknown (resource limit)``, ``undecided (time)``, or Z3's own reason).

Every Z3 check is bounded by Z3's ``rlimit``, a count of solver steps that does not
depend on the machine's speed or load: each proof step (one obligation's refutation)
gets ``Budget.rlimit`` units, each vacuity check ``Budget.vacuity_rlimit``. Z3 counts
resource units per context, cumulatively, but applies a solver's ``rlimit`` parameter
relative to the count when ``check`` starts (``scoped_rlimit``), so each step gets its
whole budget whatever ran before it in the process. The shipped laws' budgets are set
from their measured use with a wide margin (docs/proofs.md, "Budgets"): they always
decide, on any machine, under any load. A wall-clock limit (``Budget.guard_seconds``)
remains only as an outer guard against a check that never returns; it reports
``undecided (time)`` and is far above what any shipped law takes.

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

``run_all`` checks each law in a fresh forked process, so no law's resource use or time
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
# What stopped an undecided step (``LawResult.undecided_by``): Z3's resource limit, the
# outer wall-clock guard, or Z3's own ``unknown`` (incomplete theory, quantifiers).
BY_RLIMIT, BY_TIME, BY_SOLVER = "resource limit", "time", "solver"
# Z3 resource units per proof step and per vacuity check (see docs/proofs.md, "Budgets",
# for the measured use of every shipped law and the margin these leave).
DEFAULT_RLIMIT = 10_000_000
VACUITY_RLIMIT = 2_500_000
RLIMIT_MAX = 2**32 - 1  # Z3's rlimit parameter is an unsigned 32-bit number
# Outer wall-clock guard on each Z3 check, in seconds: never what decides a shipped law.
GUARD_SECONDS = 300.0


@dataclass(frozen=True)
class Budget:
    """The limits of every Z3 check of a law: ``rlimit`` resource units per obligation's
    refutation, ``vacuity_rlimit`` per vacuity check (deterministic), and the outer
    wall-clock guard ``guard_seconds`` on each check."""

    rlimit: int = DEFAULT_RLIMIT
    vacuity_rlimit: int = VACUITY_RLIMIT
    guard_seconds: float = GUARD_SECONDS

    def __post_init__(self) -> None:
        for name in ("rlimit", "vacuity_rlimit"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= RLIMIT_MAX:
                raise ValueError(f"{name} must be an integer from 1 to {RLIMIT_MAX}, "
                                 f"got {value!r}")
        if not 0 < self.guard_seconds < float("inf"):
            raise ValueError(f"guard_seconds must be a finite number > 0, got "
                             f"{self.guard_seconds!r}")

    @property
    def guard_ms(self) -> int:
        return min(max(1, int(self.guard_seconds * 1000)), RLIMIT_MAX)  # a uint, too


DEFAULT_BUDGET = Budget()


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
    # Z3 resource units of the law's costliest refutation and vacuity check (what the
    # budgets are measured against), and what left it undecided (``BY_*``), if anything.
    rlimit_used: int = 0
    vacuity_rlimit_used: int = 0
    undecided_by: str | None = None

    def to_json(self) -> dict:
        out = {"name": self.name, "status": self.status, "scope": self.scope,
               "seconds": round(self.seconds, 3), "statement": self.statement,
               "obligations": self.obligations, "detail": self.detail,
               "rlimit_used": self.rlimit_used,
               "vacuity_rlimit_used": self.vacuity_rlimit_used}
        if self.undecided_by is not None:
            out["undecided_by"] = self.undecided_by
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
               obligations: int = 0, **used) -> "LawResult":
        return LawResult(self.name, self.statement, self.scope, status, seconds, detail,
                         obligations, self.family, self.property, **used)

    def __call__(self, budget: Budget = DEFAULT_BUDGET) -> LawResult:
        return check(self, budget)

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


def _solver() -> z3.Solver:
    return z3.Then("simplify", "solve-eqs", "smt").solver()


@dataclass(frozen=True)
class Step:
    """One Z3 check: ``answer`` (``z3.sat``/``unsat``/``unknown``), the resource units it
    used, and, when unknown, what stopped it (``BY_*``) and Z3's reason."""

    answer: z3.CheckSatResult
    used: int
    undecided_by: str | None = None
    reason: str = ""

    def why(self, rlimit: int, guard_seconds: float) -> str:
        """The words for an undecided step."""
        if self.undecided_by == BY_RLIMIT:
            return f"unknown (resource limit: rlimit {rlimit} used up)"
        if self.undecided_by == BY_TIME:
            return (f"undecided (time: the {guard_seconds:g} s wall-clock guard stopped it "
                    f"after {self.used} resource units)")
        return f"unknown (z3: {self.reason})"


def _count(ctx: z3.Context) -> int:
    """The context's resource count so far (Z3 counts per context, cumulatively)."""
    stats = z3.Solver(ctx=ctx).statistics()
    return int(stats.get_key_value("rlimit count")) if "rlimit count" in stats.keys() else 0


def run_check(s: z3.Solver, rlimit: int, guard_ms: int) -> Step:
    """``s.check()`` within ``rlimit`` resource units (relative to the context's count
    when the check starts) and the wall-clock guard ``guard_ms``."""
    s.set("rlimit", rlimit)
    s.set("timeout", guard_ms)
    before = _count(s.ctx)
    answer = s.check()
    stats = s.statistics()
    after = (int(stats.get_key_value("rlimit count")) if "rlimit count" in stats.keys()
             else _count(s.ctx))
    used = max(0, after - before)
    if answer != z3.unknown:
        return Step(answer, used)
    reason = s.reason_unknown()
    by = (BY_RLIMIT if used >= rlimit else BY_TIME if "timeout" in reason
          else BY_SOLVER)
    return Step(answer, used, by, reason)


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


@dataclass(frozen=True)
class Refutation:
    """``refute``'s answer: ``status`` (``PROVED``/``FAILED``/``UNKNOWN``), ``detail``,
    the resource units used and, when unknown, what stopped it (``BY_*``)."""

    status: str
    detail: str
    used: int
    undecided_by: str | None = None


def refute(ob: Obligation, budget: Budget = DEFAULT_BUDGET) -> Refutation:
    """Ask Z3 for a model of the hypotheses and the negated goal, within ``budget.rlimit``
    resource units (and the outer guard)."""
    if ob.smt is not None:
        s = z3.Then(*GROUND_TACTIC).solver()
        s.from_string(ob.smt[0] + f"(assert (not {ob.smt[1]}))")
    else:
        s = _solver()
        s.add(*ob.hypotheses)
        s.add(*ob.lemmas)
        s.add(z3.Not(ob.goal))
    step = run_check(s, budget.rlimit, budget.guard_ms)
    if step.answer == z3.unsat:
        return Refutation(PROVED, "", step.used)
    if step.answer == z3.sat:
        return Refutation(FAILED, f"{ob.name}: counterexample {_model_excerpt(s)}", step.used)
    return Refutation(UNKNOWN, f"{ob.name}: "
                      f"{step.why(budget.rlimit, budget.guard_seconds)}",
                      step.used, step.undecided_by)


def vacuous(ob: Obligation, budget: Budget = DEFAULT_BUDGET) -> str | None:
    """``"vacuous"`` when Z3 shows the hypotheses inconsistent, ``"unchecked"`` when it
    cannot tell within ``budget.vacuity_rlimit``, ``None`` when they are satisfiable (or
    there are none). With an ``example``, Z3 first checks the hypotheses at that point (a
    model by construction)."""
    return _vacuity(ob, budget)[0]


def _vacuity(ob: Obligation, budget: Budget) -> tuple[str | None, int]:
    """``vacuous``'s answer and the resource units of its costliest check."""
    if ob.smt is not None:  # ground facts defining functions at distinct points (by
        return None, 0      # construction, see proofs.families): consistent
    if not ob.hypotheses:
        return None, 0
    used = 0
    if ob.example:
        s = _solver()
        s.add(*[_at(h, ob.example) for h in ob.hypotheses])
        step = run_check(s, budget.vacuity_rlimit, budget.guard_ms)
        used = step.used
        if step.answer == z3.sat:
            return None, used
    s = _solver()
    s.add(*ob.hypotheses)
    step = run_check(s, budget.vacuity_rlimit, budget.guard_ms)
    used = max(used, step.used)
    if step.answer == z3.unsat:
        return "vacuous", used
    return (None if step.answer == z3.sat else "unchecked"), used


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


def check(law: Law, budget: Budget = DEFAULT_BUDGET) -> LawResult:
    """Refute every obligation of ``law`` within ``budget`` (see the module docstring for
    the verdicts)."""
    started = time.perf_counter()
    status, details, count = PROVED, [], 0
    try:
        obligations = law.obligations()
    except Exception as e:  # a law that cannot even be stated is not proved
        return law.result(UNKNOWN, time.perf_counter() - started, f"could not build: {e!r}")
    unchecked, used, vacuity_used, undecided_by = [], 0, 0, None
    for ob in obligations:
        count += 1
        r = refute(ob, budget)
        verdict, detail, used = r.status, r.detail, max(used, r.used)
        if verdict == PROVED:
            v, units = _vacuity(ob, budget)
            vacuity_used = max(vacuity_used, units)
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
            undecided_by = undecided_by or r.undecided_by
            details.append(detail)
    if unchecked and status == PROVED:
        details.append("hypotheses not shown satisfiable within "
                       f"rlimit {budget.vacuity_rlimit}: {', '.join(unchecked)}")
    return law.result(status, time.perf_counter() - started, "; ".join(details), count,
                      rlimit_used=used, vacuity_rlimit_used=vacuity_used,
                      undecided_by=undecided_by if status == UNKNOWN else None)


_PENDING: list[Law] = []  # the laws of the current ``run_all``, read by forked workers


def _worker(index: int, budget: Budget, conn) -> None:
    law = _PENDING[index]
    try:
        result = check(law, budget)
    except BaseException as e:  # noqa: BLE001 - a crashed law decides nothing
        result = law.result(UNKNOWN, 0.0, f"worker failed: {e!r}")
    conn.send(result)
    conn.close()


def run_all(laws: Sequence[Law], budget: Budget = DEFAULT_BUDGET,
            jobs: int | None = None) -> list[LawResult]:
    """Check ``laws`` within ``budget``, each in a fresh forked process (``jobs`` at a
    time; default: one per CPU): Z3's global state then never carries over from one law
    to the next, so a law's resource use and time do not depend on which laws ran before
    it. Without ``fork`` (or with ``jobs=0``) the laws run one after another in this
    process."""
    import multiprocessing as mp  # here: a prover of one family's laws never forks
    import multiprocessing.connection  # noqa: F401 - mp.connection.wait
    laws = list(laws)
    if jobs == 0 or "fork" not in mp.get_all_start_methods() or not laws:
        return [check(law, budget) for law in laws]
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
                proc = ctx.Process(target=_worker, args=(i, budget, writer), daemon=True)
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


def undecided_counts(results: Sequence[LawResult]) -> dict[str, int]:
    """How many undecided laws each limit (``BY_*``) stopped."""
    counts: dict[str, int] = {}
    for r in results:
        if r.status == UNKNOWN:
            key = r.undecided_by or BY_SOLVER
            counts[key] = counts.get(key, 0) + 1
    return counts


def exit_code(results: Sequence[LawResult]) -> int:
    """0: all proved; 1: some failed; 3: some unknown and none failed."""
    statuses = {r.status for r in results}
    if FAILED in statuses:
        return 1
    if UNKNOWN in statuses:
        return 3
    return 0
