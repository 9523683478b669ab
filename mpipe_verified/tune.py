"""``mpipe-verify tune``: the fastest verified schedule for a spec's model under its
memory limit.

The spec fixes the *model*: its cost model (``[cost]``, segments, ``[comm]``, ``[memory]
static``), its memory limit, its rank and microbatch counts and, for a transpose spec, the
cut segment (its name, side and whether it is trainable). ``tune`` searches the
*schedule* (``candidates``), in a fixed order, the spec's own term first:

- every body family of ``TUNED`` (the seven before looped-bfs, interleaved-zb and
  hanayo, so a search's answer stays what it was), ``interleaved-1f1b`` with 2, 3 and 4
  chunks;
- each body as derived, and with its weight gradients deferred (``defer_w`` with each lag
  of ``LAGS``; a body without split backward is split first, ``split_bw``);
- for a transpose spec, every mode the model permits (a trainable source: ``recompute``
  and ``owner``; a trainable sink: ``owner``; a frozen or parameter-free segment keeps
  its mode) and every ownership (``inline`` is the encoder on its home rank);
- for a spec without a cut, the newer dimensions where the model makes them worth a try
  (``tune_dimensions``: dualpipe and chimera, seq1f1b, offload), each as one candidate;
  what is not tried is reported with its reason, and ``document``'s ``why`` says why
  the best won.

Every candidate is the spec's model on that schedule (``comparison.on_body``: the costs
re-cut to the candidate's stage count, as ``simulate --compare`` does), lowered and timed
with ``sim.simulate`` (``comparison.time_spec``). A candidate that does not derive (e.g.
``dualpipev`` with ``m < 2p``) is skipped. Candidates are ranked by makespan (ties: search
order); the fastest whose simulated peak fits the limit is verified (all five properties
with the spec's limit, ``check.check``), and if it is not verified the next one is.
The *baseline* is the fastest plain family with the segment inline that fits (the bare
family for a spec without a cut), verified the same way. The Pareto table holds every
candidate tried that no other beats on both makespan and peak memory.

Then the *placement* phase (``refine``): for the ``REFINE`` fastest (body, mode) groups
of transpose candidates that fit, the owner of each microbatch's encoder work is solved as
an optimisation problem of its own (``Transpose.placement_problem``, solved with Z3's
``Optimize`` by ``algebra.placement.solve``, cached by the problem) and the owners are
tried as one more candidate (``ownership="given"``, labelled ``optimal`` when Z3 proved
its optimum, ``bounded`` when its resource limit stopped it first), timed like the others.
It is ranked with them, so it wins only if its simulated makespan is lower; a solve that
stops without an assignment adds nothing (the heuristic ownerships stand).

``budget`` (seconds from ``start``; the CLI starts the clock before it loads the spec)
bounds the whole search: the families' derivations (the space is derived lazily, each
family when its first candidate is due, once), each candidate's derivation, lowering and
simulation, and the placement phase. The deadline is checked between candidates, between
those steps and inside the simulation (``sim.DeadlinePassed``), and a solve's process is
stopped at it, so the search overruns the budget by at most one step of one candidate.
Then the winner and the baseline are verified (the *final verification*, after the
budget): the spec and plan of the running best and baseline are kept from the search and
verified as they are, not derived and lowered again (the same plan, so the same verdict).
If the budget runs out before the spec's own term is timed, the final step times and
verifies it, so the spec's own schedule is always tried. Without a budget the result
depends only on the spec (the order and the ranking are fixed, and each solve is bounded
by Z3's deterministic resource limit), but for one guard: a placement solve still running
after ``placement.HARD_SECONDS`` (a machine too loaded to finish its resource budget in
that time) is dropped, and the heuristic owners stand. The verified plan is whichever wins;
its verdict never depends on time.
"""

from __future__ import annotations

from typing import Callable, Iterator

import attrs

from .algebra import families, placement, terms
from .algebra.transpose import GIVEN, OWNERSHIPS, SOURCE, Transpose
from . import check as spine
from .comparison import faster, on_body, samples, time_spec
from .errors import ParameterError
from .figures import figure
from .ir import WEIGHT_GRAD, Plan, Schedule, computes_of
from .question import Question
from .sim import DeadlinePassed, SimulationError, check_deadline, now
from .spec import Spec
from .tune_dimensions import (Skipped, bidirectional, extra_size, offloaded, sequence_chunks,
                              why)

CHUNKS = (2, 3, 4)
LAGS = ("1", "2", "r")
HEURISTICS = OWNERSHIPS  # the ownership rules every candidate is tried with
TUNED = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev")
REFINE = 3  # (body, mode) groups whose placement is solved with Z3's Optimize
OWN = "the spec's own schedule"


@attrs.frozen
class Candidate:
    """One schedule of the search: its label (``family[/vN][+defer_w(L)] mode/ownership``),
    its body term (None: the spec's own term) and the changes to a transpose. ``on``
    builds it on a model (derived only then: the space is walked lazily). ``source`` is
    the same body over its family's schedule derived once (``Derived``), what the search
    derives it from; it prints and derives as ``body`` and is dropped once timed."""

    label: str
    family: str  # the body family ("" for the spec's own term)
    plain: bool  # a family as derived (no defer_w)
    ownership: str | None  # None without a cut
    body: object = None
    changes: tuple[tuple[str, object], ...] = ()
    group: str = ""  # a transpose's body label and mode: candidates that share a body
    source: object = attrs.field(default=None, eq=False, repr=False)

    def on(self, model: Spec) -> Spec:
        if self.body is None:
            return model
        return on_body(model, self.body, self.label, **dict(self.changes))


@attrs.frozen
class Tried:
    """A candidate timed: its makespan and per-rank peak under the spec's memory model."""

    candidate: Candidate
    expression: str
    makespan: float
    peak: float
    fits: bool
    order: int


@attrs.frozen
class Verified:
    """A tried candidate that is verified, with its spec (what ``-o`` writes)."""

    tried: Tried
    status: str
    spec: Spec


@attrs.frozen
class Placement:
    """One solve of the placement phase: the group, Z3's solution and the candidate it
    gave (None when the solve stopped without an assignment or it does not derive)."""

    group: str
    solution: placement.Solution
    tried: Tried | None


@attrs.frozen
class Result:
    best: Verified | None
    baseline: Verified | None
    tried: tuple[Tried, ...]
    pareto: tuple[Tried, ...]
    total: int  # candidates in the space (tried or not), the placement phase's included
    complete: bool  # every candidate was tried (the budget did not stop the search)
    seconds: float  # the whole run: the search and the final verification
    placements: tuple[Placement, ...] = ()
    search_seconds: float = 0.0  # the search alone (what ``budget`` bounds)
    budget: float | None = None
    segment: str | None = None  # the cut segment (None: the spec has no cut)
    skipped: tuple[Skipped, ...] = ()  # the dimensions not tried, and why
    memory_limit: float | tuple[float, ...] | None = None


@attrs.frozen
class Derived:
    """A body term with its schedule derived once (shared by the candidates that differ
    only in mode and ownership): it derives to that schedule and prints as the term."""

    term: object
    schedule: Schedule = attrs.field(eq=False, repr=False)

    def derive(self) -> Schedule:
        return self.schedule

    def __str__(self) -> str:
        return str(self.term)


def _families(p: int, m: int) -> Iterator[tuple[str, str, object]]:
    """``(family, label, term)`` for every family term that builds for ``p`` and ``m``
    (not derived: cheap)."""
    for name in TUNED:
        for chunks in (CHUNKS if name == "interleaved-1f1b" else (None,)):
            label = name if chunks is None else f"{name}/v{chunks}"
            try:
                yield name, label, families.family(name, p, m, chunks)
            except ParameterError:
                continue


def _bodies(p: int, m: int, deadline: float | None = None
            ) -> Iterator[tuple[str, str, object, bool, object]]:
    """``(family, label, body term, plain, source)`` for every body of the search space,
    each family derived once (``source``: the body over that derivation, ``Derived``);
    ``deadline``: ``DeadlinePassed`` before a derivation once it has passed."""
    for name, label, body in _families(p, m):
        check_deadline(deadline)
        try:
            derived = Derived(body, body.derive())
        except ParameterError:
            continue
        split = any(c.kind == WEIGHT_GRAD for prog in derived.schedule.programs
                    for op in prog for c in computes_of(op))
        yield name, label, body, True, derived
        base, over = (body, derived) if split else (terms.SplitBW(body),
                                                    terms.SplitBW(derived))
        for lag in LAGS:
            yield (name, f"{label}+defer_w({lag})", terms.DeferW(base, lag), False,
                   terms.DeferW(over, lag))


def _modes(t: Transpose) -> tuple[str, ...]:
    if not t.trainable:
        return (t.mode,)
    return ("recompute", "owner") if t.side == SOURCE else ("owner",)


def _own(spec: Spec) -> Candidate:
    term = spec.term
    return Candidate(OWN, "", False, term.ownership if isinstance(term, Transpose) else None)


def candidates(spec: Spec, deadline: float | None = None, skipped: list | None = None,
               binds: Callable[[], bool] = lambda: True) -> Iterator[Candidate]:
    """The search space of ``spec``'s model, in search order (the spec's own term first),
    walked lazily (each family derived when its first candidate is due); then, for a
    spec without a cut, the dimensions of ``tune_dimensions`` (what is not tried goes to
    ``skipped`` with its reason; ``binds``: whether memory binds so far)."""
    term = spec.term
    yield _own(spec)
    yield from _classic(spec, deadline)
    if isinstance(term, Transpose):
        return
    skipped = [] if skipped is None else skipped
    for found in _extra(spec, binds):
        check_deadline(deadline)
        if isinstance(found, Skipped):
            skipped.append(found)
            continue
        name, label, body = found
        try:
            source = Derived(body, body.derive())
        except ParameterError as e:
            skipped.append(Skipped(label, str(e)))
            continue
        yield Candidate(label, name, False, None, body, source=source)


def _extra(spec: Spec, binds: Callable[[], bool]):
    """The bidirectional families, sequence chunks and offload, in that order."""
    s = spec.schedule
    yield from bidirectional(spec, on_body)
    yield from sequence_chunks(spec)
    yield from offloaded(spec, _families(s.num_ranks, samples(s)), binds)


def _classic(spec: Spec, deadline: float | None) -> Iterator[Candidate]:
    """The classic families and their ``defer_w`` variants (and modes and ownerships)."""
    s = spec.schedule
    term = spec.term
    for name, label, body, plain, source in _bodies(s.num_ranks, samples(s),
                                                    deadline):
        if not isinstance(term, Transpose):
            yield Candidate(label, name, plain, None, body, source=source)
            continue
        for mode in _modes(term):
            for ownership in HEURISTICS:
                yield Candidate(f"{label} {mode}/{ownership}", name, plain, ownership, body,
                                (("mode", mode), ("ownership", ownership)), f"{label} {mode}",
                                source)


def space_size(spec: Spec) -> int:
    """How many candidates ``candidates(spec)`` yields, counted without deriving (a family
    that builds but does not derive would count here and not there)."""
    s = spec.schedule
    term = spec.term
    per_body = len(_modes(term)) * len(HEURISTICS) if isinstance(term, Transpose) else 1
    classic = sum(1 for _ in _families(s.num_ranks, samples(s)))
    extra = 0 if isinstance(term, Transpose) else extra_size(spec, classic)
    return 1 + classic * (1 + len(LAGS)) * per_body + extra


def _time(model: Spec, c: Candidate, order: int, body: Derived | None,
          deadline: float | None = None) -> tuple[Tried | None, tuple[Spec, Plan] | None]:
    """``c`` on ``model`` with its body already derived (``body``), timed (None when it
    does not derive on this model), with its spec (the candidate's own terms) and plan."""
    try:
        spec = (c if body is None else attrs.evolve(c, body=body)).on(model)
        check_deadline(deadline)
        timed = time_spec(spec, check=False, deadline=deadline)
    except (ParameterError, SimulationError):
        return None, None
    peak = max(timed.run.peak_memory.values(), default=0.0)
    if body is not None:  # the same spec over the candidate's own terms (what -o writes)
        spec = attrs.evolve(spec, term=attrs.evolve(spec.term, body=c.body)
                            if isinstance(spec.term, Transpose) else c.body)
    c = attrs.evolve(c, source=None)
    return (Tried(c, str(timed.term), timed.run.makespan, peak,
                  timed.within_limit() is not False, order), (spec, timed.plan))


def _verified(model: Spec, ranked, kept: dict, done: dict,
              check: Callable[[Tried], bool] = lambda t: True) -> Verified | None:
    """The first of ``ranked`` that ``check`` admits, fits and is verified (with the
    spec's limit and memory model, as ``time_spec`` verifies). ``kept``: the spec and plan
    of candidates timed in the search, by order (else derived and lowered again);
    ``done``: the verdicts so far, by order."""
    for t in ranked:
        if not (t.fits and check(t)):
            continue
        if t.order not in done:
            if t.order in kept:
                spec, target = kept[t.order]
            else:
                spec = t.candidate.on(model)
                target = spec.schedule
            question = Question.of_spec(spec, source=spec.schedule)
            report = spine.check(target, question, spec.duration).report
            done[t.order] = Verified(t, report.status, spec) if report.verified else None
        if done[t.order] is not None:
            return done[t.order]
    return None


def pareto(tried) -> tuple[Tried, ...]:
    """The candidates no other beats on both makespan and peak, fastest first."""
    out: list[Tried] = []
    for t in sorted(tried, key=lambda t: (t.makespan, t.peak, t.order)):
        if not out or t.peak < out[-1].peak - 1e-9:
            out.append(t)
    return tuple(out)


def refine(spec: Spec, tried, deadline: float | None, cache: dict, built: dict | None = None
           ) -> Iterator[Placement]:
    """The placement phase (see the module docstring): for the ``REFINE`` fastest groups
    of ``tried`` that fit, the owners solved with Z3's ``Optimize``, timed as one more
    candidate each (its spec and plan into ``built``, by order); ``deadline`` (None: no
    wall-clock limit) stops it (``DeadlinePassed``) between its steps and bounds each
    solve."""
    best: dict[str, Tried] = {}
    for t in sorted(tried, key=lambda t: (t.makespan, t.order)):
        if t.fits and t.candidate.group and t.candidate.ownership in HEURISTICS:
            best.setdefault(t.candidate.group, t)
    order = max((t.order for t in tried), default=0)
    for group, t in list(best.items())[:REFINE]:
        check_deadline(deadline)
        body = Derived(t.candidate.body, t.candidate.body.derive())
        check_deadline(deadline)
        model = attrs.evolve(t.candidate, body=body).on(spec)
        check_deadline(deadline)
        problem = model.term.placement_problem(model.cost)
        if problem not in cache:
            cache[problem] = _solve(problem, deadline)
        solution = cache[problem]
        found = None
        if solution.owners is not None:
            order += 1
            mode = dict(t.candidate.changes)["mode"]
            c = attrs.evolve(t.candidate, label=f"{group}/{solution.status}",
                             ownership=GIVEN, changes=(
                                 ("mode", mode), ("ownership", GIVEN),
                                 ("owners", solution.owners)))
            found, made = _time(spec, c, order, body, deadline)
            if built is not None and found is not None:
                built[order] = made
        yield Placement(group, solution, found)


def _solve(problem: placement.Problem, deadline: float | None) -> placement.Solution:
    """``placement.solve`` (Z3 bounded by its resource limit) without a deadline; with
    one, Z3 gets the time left as its timeout and its process is stopped at the deadline
    whatever Z3 does (by itself ``placement.solve`` would wait up to ``timeout`` plus its
    start-up allowance), so the solve ends by the deadline."""
    if deadline is None:
        return placement.solve(problem)
    left = deadline - now()
    if left <= 0:
        raise DeadlinePassed
    return placement.solve(problem, timeout=left, wait=left)


def tune(spec: Spec, budget: float | None = None,
         progress: Callable[[int, Tried | None], None] = lambda n, best: None,
         start: float | None = None) -> Result:
    """Search ``spec``'s schedule space, then solve the placement of its best transpose
    candidates, then verify the best and the baseline (see the module docstring).
    ``budget`` (seconds from ``start``, a ``sim.now()`` value, ``time.monotonic()``,
    default now) bounds the search: it stops at the next step (a derivation, lowering,
    simulation or solve) once the time is spent."""
    start = now() if start is None else start
    deadline = None if budget is None else start + budget
    tried: list[Tried] = []
    placements: list[Placement] = []
    best: Tried | None = None
    base: Tried | None = None  # the running baseline (see _baseline)
    kept: dict[int, tuple[Spec, Plan]] = {}  # the running best's and baseline's plans
    body: Derived | None = None
    complete, walked = True, False  # walked: every candidate of the space was tried
    total = 0
    made: dict[int, tuple[Spec, Plan]] = {}  # the placement phase's specs and plans
    skipped: list[Skipped] = []
    try:
        for order, c in enumerate(candidates(spec, deadline, skipped,
                                             lambda: any(not t.fits for t in tried))):
            total = order + 1
            check_deadline(deadline)
            if c.body is not None and (body is None or body.term is not c.body):
                body = None  # the last body only: bounded memory
                body = Derived(c.body, c.source.derive())
            t, built = _time(spec, c, order, body if c.body is not None else None, deadline)
            if t is not None:
                tried.append(t)
                best, base = _keep(best, base, t, built, kept)
            progress(order + 1, best)
        walked, body = True, None
        for found in refine(spec, tried, deadline, {}, made):
            placements.append(found)
            if found.tried is not None:
                tried.append(found.tried)
                best, base = _keep(best, base, found.tried,
                                   made.pop(found.tried.order, None), kept)
            progress(len(tried), best)
    except DeadlinePassed:
        complete = False
        if not walked:
            total = space_size(spec)
    searched = now() - start
    if not tried:  # the budget ran out before the spec's own schedule was timed
        t, built = _time(spec, _own(spec), 0, None)
        if t is not None:
            tried.append(t)
            best, base = _keep(best, base, t, built, kept)
    ranked = sorted(tried, key=lambda t: (t.makespan, t.order))
    done: dict[int, Verified | None] = {}
    winner = _verified(spec, ranked, kept, done)
    baseline = _verified(spec, ranked, kept, done, _baseline)
    term = spec.term
    return Result(winner, baseline, tuple(tried), pareto(tried), total + len(placements),
                  complete, now() - start, tuple(placements), searched, budget,
                  term.segment if isinstance(term, Transpose) else None, tuple(skipped),
                  spec.memory_limit)


def _baseline(t: Tried) -> bool:
    """A baseline candidate: a plain family with the segment inline (or no cut)."""
    return t.candidate.plain and t.candidate.ownership in (None, "inline")


def _keep(best: Tried | None, base: Tried | None, t: Tried, built, kept: dict
          ) -> tuple[Tried | None, Tried | None]:
    """The running best and baseline after ``t``, keeping only their specs and plans
    (``built``: ``t``'s) for the final verification."""
    best2 = _better(best, t)
    base2 = _better(base, t) if _baseline(t) else base
    if built is not None and t in (best2, base2):
        kept[t.order] = built
    for old in {best, base} - {best2, base2, None}:
        kept.pop(old.order, None)
    return best2, base2


def _better(best: Tried | None, t: Tried) -> Tried | None:
    """The faster of ``best`` and ``t`` among those that fit (``best`` on a tie)."""
    return t if t.fits and (best is None or t.makespan < best.makespan) else best


def _entry(t: Tried) -> dict:
    return {"schedule": t.candidate.label, "makespan": figure(t.makespan),
            "peak_memory": figure(t.peak), "fits": t.fits,
            "expression": t.expression}


def document(result: Result, source: str) -> dict:
    """The ``tune --json`` document."""
    def verified(v: Verified | None) -> dict | None:
        if v is None:
            return None
        return {"schedule": v.tried.candidate.label, "makespan": figure(v.tried.makespan),
                "peak_memory": figure(v.tried.peak), "status": v.status,
                "expression": v.tried.expression}
    def solved(p: Placement) -> dict:
        s = p.solution
        return {"group": p.group, "status": s.status,
                "largest_overflow": None if s.top is None else figure(float(s.top)),
                "total_overflow": None if s.total is None else figure(float(s.total)),
                "owners": None if s.owners is None else list(s.owners),
                "makespan": None if p.tried is None else figure(p.tried.makespan),
                "seconds": round(s.seconds, 3)}
    doc = {"source": source, "best": verified(result.best),
           "pareto": [_entry(t) for t in result.pareto],
           "baseline": verified(result.baseline), "tried": len(result.tried),
           "candidates": result.total, "complete": result.complete,
           "budget": result.budget, "seconds": round(result.seconds, 3),
           "search_seconds": round(result.search_seconds, 3), "segment": result.segment,
           "placements": [solved(p) for p in result.placements],
           "why": why(verified(result.best), [
               dict(_entry(t), classic=t.candidate.plain) for t in result.tried],
               result.memory_limit, result.skipped)}
    if result.best and result.baseline:  # the best's speedup over the baseline
        doc["baseline"]["speedup"] = round(result.baseline.tried.makespan
                                           / result.best.tried.makespan, 6)
    return doc


def render(doc: dict) -> str:
    """The text form of a ``tune`` document."""
    search = doc.get("search_seconds", doc["seconds"])
    counts = (f"{doc['tried']} of {doc['candidates']} candidates evaluated in {search:.1f} s, "
              f"the final verification {max(0.0, doc['seconds'] - search):.1f} s")
    budget = doc.get("budget")
    lines = [f"{doc['source']}: " + (counts if doc["complete"] else
                                     f"the budget ran out (--budget {budget:g} s): {counts}")]
    best, base = doc["best"], doc["baseline"]
    if best is None:
        lines.append("no candidate fits the memory limit and is verified")
    else:
        lines.append(f"best: {best['schedule']}: makespan {best['makespan']:.6g}, peak "
                     f"memory {best['peak_memory']:.6g}, {best['status'].upper()}")
        lines.append(f"  {best['expression']}")
    if doc.get("why"):
        lines.append("why:")
        lines.extend(f"  {line}" for line in doc["why"])
    if base is not None:
        segment = doc.get("segment")
        what = (f"the fastest plain family with the segment {segment!r} inline that fits"
                if segment else "the fastest plain family that fits")
        lines.append(f"baseline ({what}): {base['schedule']}: makespan {base['makespan']:.6g}")
        if best is not None:
            than = faster(best["makespan"], base["makespan"])
            lines.append(f"  the best is {than} than the baseline" if than != "as fast" else
                         "  the best is as fast as the baseline")
    for p in doc["placements"]:
        got = "no assignment" if p["owners"] is None else (
            f"largest overflow {p['largest_overflow']:.6g}, makespan "
            + ("-" if p["makespan"] is None else f"{p['makespan']:.6g}"))
        lines.append(f"placement (Z3 Optimize) of {p['group']}: {p['status']}, {got} "
                     f"({p['seconds']:.1f} s)")
    lines.append("Pareto front (step time against peak memory):")
    lines.append(f"  {'schedule':<40} {'makespan':>10}  {'peak memory':>11}  {'fits':>4}")
    for e in doc["pareto"]:
        lines.append(f"  {e['schedule']:<40} {e['makespan']:>10.6g}  "
                     f"{e['peak_memory']:>11.6g}  {'yes' if e['fits'] else 'NO':>4}")
    return "\n".join(lines) + "\n"
