"""``mpipe-verify tune``: the fastest verified schedule for a spec's model under its
memory limit.

The spec fixes the *model*: its cost model (``[cost]``, segments, ``[comm]``, ``[memory]
static``), its memory limit, its rank and microbatch counts and, for a transpose spec, the
cut segment (its name, side and whether it is trainable). ``tune`` searches the
*schedule* (``candidates``), in a fixed order, the spec's own term first:

- every body family, ``interleaved-1f1b`` with 2, 3 and 4 chunks;
- each body as derived, and with its weight gradients deferred (``defer_w`` with each lag
  of ``LAGS``; a body without split backward is split first, ``split_bw``);
- for a transpose spec, every mode the model permits (a trainable source: ``recompute``
  and ``owner``; a trainable sink: ``owner``; a frozen or parameter-free segment keeps
  its mode) and every ownership (``inline`` is the encoder on its home rank).

Every candidate is the spec's model on that schedule (``comparison.on_body``: the costs
re-cut to the candidate's stage count, as ``simulate --compare`` does), lowered and timed
with ``sim.simulate`` (``comparison.time_spec``). A candidate that does not derive (e.g.
``dualpipev`` with ``m < 2p``) is skipped. Candidates are ranked by makespan (ties: search
order); the fastest whose simulated peak fits the limit is verified (all five properties
with the spec's limit, ``verify.verify``), and if it is not verified the next one is.
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

``budget`` (seconds) stops the search between candidates (and bounds each solve); the
spec's own term is always tried, and the winner and baseline are verified after the
search. Without a budget the result depends only on the spec (the order and the ranking
are fixed, and each solve is bounded by Z3's deterministic resource limit).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import attrs

from .algebra import families, placement, terms
from .algebra.transpose import GIVEN, OWNERSHIPS, SOURCE, Transpose
from .comparison import on_body, time_spec
from .errors import ParameterError
from .formats.spec import Spec
from .ir import WEIGHT_GRAD, Schedule, computes_of
from .show import figure
from .sim import SimulationError

CHUNKS = (2, 3, 4)
LAGS = ("1", "2", "r")
HEURISTICS = OWNERSHIPS  # the ownership rules every candidate is tried with
REFINE = 3  # (body, mode) groups whose placement is solved with Z3's Optimize


@attrs.frozen
class Candidate:
    """One schedule of the search: its label (``family[/vN][+defer_w(L)] mode/ownership``),
    its body term (None: the spec's own term) and the changes to a transpose. ``on``
    builds it on a model (derived only then: the space is walked lazily)."""

    label: str
    family: str  # the body family ("" for the spec's own term)
    plain: bool  # a family as derived (no defer_w)
    ownership: str | None  # None without a cut
    body: object = None
    changes: tuple[tuple[str, object], ...] = ()
    group: str = ""  # a transpose's body label and mode: candidates that share a body

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
    seconds: float
    placements: tuple[Placement, ...] = ()


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


def _bodies(p: int, m: int) -> Iterator[tuple[str, str, object, bool]]:
    """``(family, label, body term, plain)`` for every body of the search space."""
    for name in families.FAMILIES:
        for chunks in (CHUNKS if name == "interleaved-1f1b" else (None,)):
            label = name if chunks is None else f"{name}/v{chunks}"
            try:
                body = families.family(name, p, m, chunks)
                split = any(c.kind == WEIGHT_GRAD for prog in body.derive().programs
                            for op in prog for c in computes_of(op))
            except ParameterError:
                continue
            yield name, label, body, True
            base = body if split else terms.SplitBW(body)
            for lag in LAGS:
                yield name, f"{label}+defer_w({lag})", terms.DeferW(base, lag), False


def _modes(t: Transpose) -> tuple[str, ...]:
    if not t.trainable:
        return (t.mode,)
    return ("recompute", "owner") if t.side == SOURCE else ("owner",)


def candidates(spec: Spec) -> Iterator[Candidate]:
    """The search space of ``spec``'s model, in search order (the spec's own term first)."""
    s = spec.schedule
    term = spec.term
    own = term.ownership if isinstance(term, Transpose) else None
    yield Candidate("the spec's own schedule", "", False, own)
    for name, label, body, plain in _bodies(s.num_ranks, s.num_microbatches):
        if not isinstance(term, Transpose):
            yield Candidate(label, name, plain, None, body)
            continue
        for mode in _modes(term):
            for ownership in HEURISTICS:
                yield Candidate(f"{label} {mode}/{ownership}", name, plain, ownership, body,
                                (("mode", mode), ("ownership", ownership)), f"{label} {mode}")


def _time(model: Spec, c: Candidate, order: int, body: Derived | None) -> Tried | None:
    """``c`` on ``model`` with its body already derived (``body``), timed (None when it
    does not derive on this model)."""
    try:
        timed = time_spec((c if body is None else attrs.evolve(c, body=body)).on(model),
                          check=False)
    except (ParameterError, SimulationError):
        return None
    peak = max(timed.run.peak_memory.values(), default=0.0)
    return Tried(c, str(timed.term), timed.run.makespan, peak,
                 timed.within_limit() is not False, order)


def _verified(model: Spec, ranked, check: Callable[[Tried], bool] = lambda t: True
              ) -> Verified | None:
    """The first of ``ranked`` that ``check`` admits, fits and is verified."""
    for t in ranked:
        if not (t.fits and check(t)):
            continue
        spec = t.candidate.on(model)
        timed = time_spec(spec)
        if timed.report.verified:
            return Verified(t, timed.report.status, spec)
    return None


def pareto(tried) -> tuple[Tried, ...]:
    """The candidates no other beats on both makespan and peak, fastest first."""
    out: list[Tried] = []
    for t in sorted(tried, key=lambda t: (t.makespan, t.peak, t.order)):
        if not out or t.peak < out[-1].peak - 1e-9:
            out.append(t)
    return tuple(out)


def refine(spec: Spec, tried, left: Callable[[], float | None], cache: dict
           ) -> Iterator[Placement]:
    """The placement phase (see the module docstring): for the ``REFINE`` fastest groups
    of ``tried`` that fit, the owners solved with Z3's ``Optimize``, within ``left()``
    seconds (None: no wall-clock limit), timed as one more candidate each."""
    best: dict[str, Tried] = {}
    for t in sorted(tried, key=lambda t: (t.makespan, t.order)):
        if t.fits and t.candidate.group and t.candidate.ownership in HEURISTICS:
            best.setdefault(t.candidate.group, t)
    order = max((t.order for t in tried), default=0)
    for group, t in list(best.items())[:REFINE]:
        seconds = left()
        if seconds is not None and seconds <= 0:
            return
        body = Derived(t.candidate.body, t.candidate.body.derive())
        model = attrs.evolve(t.candidate, body=body).on(spec)
        problem = model.term.placement_problem(model.cost)
        if problem not in cache:
            cache[problem] = placement.solve(problem, timeout=seconds)
        solution = cache[problem]
        found = None
        if solution.owners is not None:
            order += 1
            mode = dict(t.candidate.changes)["mode"]
            c = attrs.evolve(t.candidate, label=f"{group}/{solution.status}",
                             ownership=GIVEN, changes=(
                                 ("mode", mode), ("ownership", GIVEN),
                                 ("owners", solution.owners)))
            found = _time(spec, c, order, body)
        yield Placement(group, solution, found)


def tune(spec: Spec, budget: float | None = None,
         progress: Callable[[int, Tried | None], None] = lambda n, best: None) -> Result:
    """Search ``spec``'s schedule space, then solve the placement of its best transpose
    candidates (see the module docstring)."""
    start = time.monotonic()
    space = list(candidates(spec))
    tried: list[Tried] = []
    best: Tried | None = None
    body: Derived | None = None
    complete = True
    for order, c in enumerate(space):
        if order and budget is not None and time.monotonic() - start >= budget:
            complete = False
            break
        if c.body is not None and (body is None or body.term is not c.body):
            body = Derived(c.body, c.body.derive())  # the last body only: bounded memory
        t = _time(spec, c, order, body if c.body is not None else None)
        if t is not None:
            tried.append(t)
            best = _better(best, t)
        progress(order + 1, best)
    def left() -> float | None:
        return None if budget is None else budget - (time.monotonic() - start)
    placements = []
    for found in refine(spec, tried, left, {}):
        placements.append(found)
        if found.tried is not None:
            tried.append(found.tried)
            best = _better(best, found.tried)
        progress(len(tried), best)
    ranked = sorted(tried, key=lambda t: (t.makespan, t.order))
    winner = _verified(spec, ranked)
    baseline = _verified(spec, ranked, lambda t: t.candidate.plain and (
        t.candidate.ownership in (None, "inline")))
    return Result(winner, baseline, tuple(tried), pareto(tried),
                  len(space) + len(placements), complete,
                  time.monotonic() - start, tuple(placements))


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
           "seconds": round(result.seconds, 3),
           "placements": [solved(p) for p in result.placements]}
    if result.best and result.baseline:
        doc["baseline"]["speedup"] = round(result.baseline.tried.makespan
                                           / result.best.tried.makespan, 6)
    return doc


def render(doc: dict) -> str:
    """The text form of a ``tune`` document."""
    lines = [f"{doc['source']}: tried {doc['tried']} of {doc['candidates']} candidates "
             f"in {doc['seconds']:.1f} s" + ("" if doc["complete"] else
                                            " (stopped by --budget)")]
    best, base = doc["best"], doc["baseline"]
    if best is None:
        lines.append("no candidate fits the memory limit and is verified")
    else:
        lines.append(f"best: {best['schedule']}: makespan {best['makespan']:.6g}, peak "
                     f"memory {best['peak_memory']:.6g}, {best['status'].upper()}")
        lines.append(f"  {best['expression']}")
    if base is not None:
        speed = f", {base['speedup']:.3f}x faster" if "speedup" in base else ""
        lines.append(f"baseline (the fastest plain family that fits, any segment inline): "
                     f"{base['schedule']}: makespan {base['makespan']:.6g}{speed}")
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
