"""Deciding obligations with Z3: each class of facts compressed, exactly, into affine
runs (``compress``), and one query per chunk of runs, "some point of some run violates
its template" (``decide``): ``unsat`` proves, ``sat`` names the violated fact, ``unknown``
is never success. ``ground`` asks the same of one fact a claim names."""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import numpy as np
import z3

from .columns import as_column
from .obligations import Facts

def affine_runs(facts) -> list:
    """Exact compression, greedy from the left: a run takes the next fact and every
    following one while the difference stays that of its first two, as ``(first fact,
    difference, length)``; every fact lies in exactly one run. ``facts``: one per row of
    an int64 array (magnitudes below ``BOUND``: no difference overflows), or tuples, read
    as such an array if they allow it, else as Python's exact numbers."""
    if not len(facts):
        return []
    x = facts if isinstance(facts, np.ndarray) else np.array(facts, dtype=object)
    x = as_column(x.flat).reshape(x.shape) if x.dtype == object else x
    d = np.diff(x, axis=0)
    starts = np.flatnonzero(np.concatenate(([True], (d[1:] != d[:-1]).any(axis=1))))
    runs, k, n = [], 0, len(facts)
    for end in (np.append(starts[1:], len(d)) - 1).tolist():  # last diff of each block
        if k <= end:  # the run from fact k takes the block's rest and the fact after it
            runs.append((tuple(x[k].tolist()), tuple(d[k].tolist()), end - k + 2))
            k = end + 2
    if k == n - 1:
        runs.append((tuple(x[k].tolist()), (0,) * x.shape[1], 1))
    return runs


def literal(v) -> str:
    """An exact number (an int or a Fraction, nothing else) as SMT-LIB text."""
    if type(v) is int:
        return f"(- {-v})" if v < 0 else str(v)
    if type(v) is not Fraction:
        raise TypeError(f"an obligation holds {v!r}, not an exact number")
    text = f"(/ {abs(v.numerator)}.0 {v.denominator}.0)"
    return f"(- {text})" if v < 0 else text


def affine(a, ra, d, real: bool) -> str:
    """``a + ra*i + d*j`` as SMT-LIB text."""
    i, j = ("(to_real i)", "(to_real j)") if real else ("i", "j")
    terms = [literal(a)] + [f"(* {literal(c)} {v})" for c, v in ((ra, i), (d, j)) if c]
    return terms[0] if len(terms) == 1 else f"(+ {' '.join(terms)})"


TEMPLATES = {  # template -> (SMT-LIB text of "the fact x holds", the same test in Python)
    "one": ("(= {0} 1)", lambda x: x[0] == 1),  # a plan fact holds
    "eq": ("(= {0} {1})", lambda x: x[0] == x[1]),
    "le": ("(<= {0} {1})", lambda x: x[0] <= x[1]),
    "lt": ("(< {0} {1})", lambda x: x[0] < x[1]),
    "level": ("(and (<= (+ {0} {1}) {4}) (= {3} (- (+ {0} {1}) {2})))",  # peak within the
              lambda x: x[0] + x[1] <= x[4] and x[3] == x[0] + x[1] - x[2]),  # bound, chained
}
TEMPLATES.update(eqr=TEMPLATES["eq"], ler=TEMPLATES["le"])  # the same over the reals
REAL = frozenset({"level", "eqr", "ler"})


def holds(template: str, x) -> bool:
    return TEMPLATES[template][1](x)


QUERY_DECLS = "(declare-const i Int)(declare-const j Int)"


def violation_formula(runs) -> str:
    """SMT-LIB formula over ``i``, ``j``: some run has a point ``(i, j)`` in range that
    violates its template."""
    parts = []
    for template, (a, ra, c, d, n) in runs:
        real = template in REAL
        x = [affine(*v, real) for v in zip(a, ra, d)]
        parts.append(f"(and (<= 0 i) (< i {c}) (<= 0 j) (< j {n}) "
                     f"(not {TEMPLATES[template][0].format(*x)}))")
    return "(or false " + " ".join(parts) + ")"


CHUNK = 512


def compress(facts: Facts) -> list:
    """``(template, (a, ra, c, d, n))``: the facts ``a + ra*i + d*j`` for ``i < c``,
    ``j < n``. Level 1: each class's facts as runs; level 2: the runs of one template,
    difference and length, whose first facts again change by a constant step. Exact, as
    each level is: every fact is exactly one point."""
    same: dict = defaultdict(list)
    for (t, *_), lane in facts.lanes.items():
        for a, d, n in affine_runs(lane):
            same[(t, d, n)].append(a)
    return [(t, (a, ra, c, d, n)) for (t, d, n), starts in same.items()
            for a, ra, c in affine_runs(starts)]


def decide(runs: list, rlimit: int | None) -> tuple[str, str]:
    """``("proved", "")``, ``("failed", the violated fact)`` or ``("unknown", reason)``."""
    for first in range(0, max(len(runs), 1), CHUNK):
        chunk = runs[first:first + CHUNK]
        solver = new_solver(rlimit)
        solver.from_string(QUERY_DECLS + f"(assert {violation_formula(chunk)})")
        answer = solver.check()
        if answer == z3.unknown:
            return "unknown", _why_unknown(solver, rlimit)
        if answer == z3.sat:
            model = solver.model()
            i, j = (model.eval(z3.Int(v), model_completion=True).as_long() for v in "ij")
            return "failed", next(
                (f"{t}{x}" for t, (a, ra, c, d, n) in chunk if 0 <= i < c and 0 <= j < n
                 for x in [tuple(a_ + r_ * i + d_ * j for a_, r_, d_ in zip(a, ra, d))]
                 if not holds(t, x)), f"a fact at i={i}, j={j}")
    return "proved", ""


# Z3 resource units per query when the caller gives no ``rlimit``: a deterministic cap
# (the count does not depend on the machine's speed or load), 400x the costliest query
# measured (about 250,000 units: a 64-microbatch transpose example; a query holds at most
# ``CHUNK`` runs). The wall-clock limit is only an outer guard against a check that never
# returns, above what this budget takes even on a loaded machine.
QUERY_RLIMIT = 100_000_000
GUARD_MS = 600_000


def new_solver(rlimit: int | None) -> z3.Solver:
    """A fresh solver within ``rlimit`` resource units (``QUERY_RLIMIT`` when None; Z3
    applies it from the count at each check), and no check runs past 10 minutes."""
    solver = z3.Solver()
    solver.set("timeout", GUARD_MS)
    solver.set("rlimit", QUERY_RLIMIT if rlimit is None else rlimit)
    return solver


def _why_unknown(solver: z3.Solver, rlimit: int | None) -> str:
    """Which limit left a query undecided: the resource limit, the wall-clock guard, or
    Z3's own reason."""
    reason = solver.reason_unknown()
    if "timeout" in reason:
        return f"undecided (time: the {GUARD_MS // 1000} s wall-clock guard stopped Z3)"
    if reason in ("canceled", "max. resource limit exceeded"):
        budget = QUERY_RLIMIT if rlimit is None else rlimit
        return f"unknown (resource limit: rlimit {budget} used up)"
    return reason


def word(answer, violated) -> str:
    """``confirm``'s word for Z3's ``answer``: ``violated`` when it is ``violated``."""
    return "violated" if answer == violated else "unknown" if answer == z3.unknown else "rejected"


def ground(facts: list, rlimit) -> str:
    """Z3's word on a claimed violation: some listed ground fact breaks its template."""
    if not facts:
        return "rejected"
    template, values = facts[0]
    solver, real = new_solver(rlimit), template in REAL
    fact = TEMPLATES[template][0].format(*(affine(v, 0, 0, real) for v in values))
    solver.from_string(f"(assert (not {fact}))")
    return word(solver.check(), z3.sat)
