"""Proof obligations, compressed into affine runs and discharged by Z3 in one query.

A property's certificate is a set of ground facts: integer (or rational) tuples, each of
which must satisfy the property's *template* (a small linear formula, ``TEMPLATES``). A
plan has 10^5–10^6 such facts, too many to hand to Z3 one by one, but schedules are
regular: along a rank, facts of one *class* (same op kinds) change by a constant step, and
across ranks those runs shift by a constant step again. ``Obligations`` stores facts
exactly as runs

    x(i, j) = a + ra·i + d·j      for 0 <= i < R, 0 <= j < L0 + rL·i

(level 1 compresses along a lane, usually a rank; level 2 across lanes, or along the lane
for runs no other lane shares, such as a cooldown's periodic pattern). The encoding is
exact: every fact added lies in exactly one run and every run point is a fact. Z3 then
decides the single query "some run point violates its template"; ``unsat`` proves every
fact, ``sat`` yields a concrete violating fact, ``unknown`` is never success.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from fractions import Fraction
from typing import Callable, Sequence

import attrs
import z3

Number = int | float | Fraction


def _lt(x):
    return x[0] < x[1]


def _le(x):
    return x[0] <= x[1]


def _eq_halves(x):
    half = len(x) // 2
    return z3.And([x[k] == x[half + k] for k in range(half)])


def _rendezvous(x):
    """(ready_a, ready_b, post_a, post_b, meet, finish_a, finish_b): each end posted no
    earlier than its rank was ready, both posted before they meet, and neither finishes
    before the meeting."""
    ready_a, ready_b, post_a, post_b, meet, fin_a, fin_b = x
    return z3.And(ready_a <= post_a, ready_b <= post_b, post_a < meet, post_b < meet,
                  meet <= fin_a, meet <= fin_b)


def _collective(x):
    """(ready, post, meet, finish): posted no earlier than the rank was ready, before the
    meeting, and not finished before it."""
    ready, post, meet, fin = x
    return z3.And(ready <= post, post < meet, meet <= fin)


def _unit(x):
    """(forwards, full backwards, input grads, weight grads, recomputes, misplaced,
    backward needed, recompute needed): one forward; the needed backward (one B, or one
    I and one W) or none; the needed recomputes; nothing on a foreign rank."""
    f, b, i, w, r, wrong, need_back, need_r = x
    split_or_full = z3.Or(z3.And(b == 1, i == 0, w == 0), z3.And(b == 0, i == 1, w == 1))
    none = z3.And(b == 0, i == 0, w == 0)
    return z3.And(f == 1, wrong == 0, r == need_r,
                  z3.If(need_back == 1, split_or_full, none))


def _memory(x):
    """(before, allocated, freed, after, bound): the step's peak stays within the bound
    and the level after it is the level before plus allocations minus frees."""
    before, alloc, free, after, bound = x
    return z3.And(before + alloc <= bound, after == before + alloc - free)


TEMPLATES: dict[str, Callable] = {
    "lt": _lt, "le": _le, "eq": _eq_halves, "rendezvous": _rendezvous,
    "collective": _collective, "unit": _unit, "memory": _memory,
}
REAL_TEMPLATES = frozenset({"memory"})


@attrs.define
class Run:
    """Facts ``a + ra*i + d*j`` for ``i < count``, ``j < length + rlength*i``."""

    a: tuple
    d: tuple
    length: int
    ra: tuple = ()
    rlength: int = 0
    count: int = 1

    def point(self, i: int, j: int) -> tuple:
        ra = self.ra or (0,) * len(self.a)
        return tuple(a + r * i + d * j for a, r, d in zip(self.a, ra, self.d))


def _sub(x, y):
    return tuple(map(operator.sub, x, y))


class Obligations:
    """Facts grouped by ``(template, class, lane)`` in the order they were added."""

    def __init__(self) -> None:
        self._lanes: dict[tuple, list[tuple]] = defaultdict(list)

    def add(self, template: str, cls, lane: int, values: tuple) -> None:
        self._lanes[(template, cls, lane)].append(values)

    def lane(self, template: str, cls, lane: int) -> list[tuple]:
        """The fact list of one lane, for callers that append in a tight loop."""
        return self._lanes[(template, cls, lane)]

    @property
    def facts(self) -> int:
        return sum(len(v) for v in self._lanes.values())

    def runs(self) -> list[tuple[str, Run]]:
        """Level-2 runs: the k-th level-1 run of each lane of a ``(template, class)``,
        taken over consecutive lanes, merged while start and length move by constant
        steps; a level-1 run left alone there is merged along its own lane instead (the
        k-th, (k+1)-th, ... runs of one lane: periodic patterns, like a cooldown's)."""
        ordinal: dict[tuple, list[tuple[int, tuple]]] = defaultdict(list)
        for (template, cls, lane), facts in self._lanes.items():
            for k, run in enumerate(_runs_along(facts)):
                ordinal[(template, cls, k)].append((lane, run))
        out: list[tuple[str, Run]] = []
        alone: dict[tuple, list[tuple]] = defaultdict(list)  # (template, cls, lane) -> runs
        for (template, cls, _), lanes in sorted(ordinal.items(), key=lambda item: item[0][2]):
            lanes.sort(key=lambda item: item[0])
            for lane, run in _merge_lanes(lanes):
                if run.count == 1:
                    alone[(template, cls, lane)].append((run.a, run.d, run.length))
                else:
                    out.append((template, run))
        for (template, _, _), runs in alone.items():
            by_step: dict[tuple, list] = defaultdict(list)  # interleaved patterns, too
            for k, run in enumerate(runs):
                by_step[run[1]].append((k, run))
            for same_step in by_step.values():
                out.extend((template, run) for _, run in _merge_lanes(same_step))
        return out


def _runs_along(facts: list[tuple]) -> list[tuple[tuple, tuple, int]]:
    """Level 1: maximal arithmetic progressions ``(start, step, length)``."""
    runs = []
    n, i = len(facts), 0
    while i < n:
        a = facts[i]
        if i + 1 == n:
            runs.append((a, (0,) * len(a), 1))
            break
        d = _sub(facts[i + 1], a)
        j = i + 1
        if len(d) == 2:  # most facts are pairs: compare without building tuples
            d0, d1 = d
            while j + 1 < n and (facts[j + 1][0] - facts[j][0] == d0
                                 and facts[j + 1][1] - facts[j][1] == d1):
                j += 1
        else:
            while j + 1 < n and _sub(facts[j + 1], facts[j]) == d:
                j += 1
        runs.append((a, d, j - i + 1))
        i = j + 1
    return runs


def _merge_lanes(runs: list[tuple[int, tuple]]) -> list[tuple[int, Run]]:
    """Merge consecutive level-1 runs ``(key, (a, d, length))`` with equal ``d`` while
    ``a`` and ``length`` grow by constant steps: the i-th merged run is exactly
    ``(a0 + ra*i, d, length0 + rlength*i)``. Each merged run comes with its first key."""
    merged: list[tuple[int, Run]] = []
    for key, (a, d, length) in runs:
        cur = merged[-1][1] if merged else None
        if cur is not None and cur.d == d:
            if cur.count == 1:
                cur.ra, cur.rlength, cur.count = _sub(a, cur.a), length - cur.length, 2
                continue
            expected_a = tuple(x + r * cur.count for x, r in zip(cur.a, cur.ra))
            if a == expected_a and length == cur.length + cur.rlength * cur.count:
                cur.count += 1
                continue
        merged.append((key, Run(a, d, length)))
    for _, run in merged:
        if run.count == 1:
            run.ra, run.rlength = (0,) * len(run.a), 0
    return merged


@attrs.frozen
class Outcome:
    """``status``: ``proved`` (unsat), ``violated`` (sat, with ``witness`` = (template,
    fact)), or ``unknown`` (with Z3's reason)."""

    status: str
    witness: tuple[str, tuple] | None = None
    reason: str = ""
    runs: int = 0
    facts: int = 0


def _value(v, real: bool):
    """``v`` as a Z3 constant; for a real template, a float is the rational it denotes
    exactly (rounding it would confirm or prove a different fact)."""
    if real:
        q = Fraction(v)
        return z3.Q(q.numerator, q.denominator)
    return z3.IntVal(v)


# SMT-LIB text of each template over x0..x(k-1); must say the same as TEMPLATES.
SMT_TEMPLATES: dict[str, Callable[[list[str]], str]] = {
    "lt": lambda x: f"(< {x[0]} {x[1]})",
    "le": lambda x: f"(<= {x[0]} {x[1]})",
    "eq": lambda x: "(and " + " ".join(f"(= {x[k]} {x[len(x) // 2 + k]})"
                                       for k in range(len(x) // 2)) + ")",
    "rendezvous": lambda x: f"(and (<= {x[0]} {x[2]}) (<= {x[1]} {x[3]}) (< {x[2]} {x[4]}) "
                            f"(< {x[3]} {x[4]}) (<= {x[4]} {x[5]}) (<= {x[4]} {x[6]}))",
    "collective": lambda x: f"(and (<= {x[0]} {x[1]}) (< {x[1]} {x[2]}) (<= {x[2]} {x[3]}))",
    "unit": lambda x: f"(and (= {x[0]} 1) (= {x[5]} 0) (= {x[4]} {x[7]}) (ite (= {x[6]} 1) "
                      f"(or (and (= {x[1]} 1) (= {x[2]} 0) (= {x[3]} 0)) (and (= {x[1]} 0) "
                      f"(= {x[2]} 1) (= {x[3]} 1))) (and (= {x[1]} 0) (= {x[2]} 0) (= {x[3]} 0))))",
    "memory": lambda x: f"(and (<= (+ {x[0]} {x[1]}) {x[4]}) (= {x[3]} (- (+ {x[0]} {x[1]}) {x[2]})))",
}


def _num(v, real: bool) -> str:
    if real:
        q = Fraction(v)  # exact: a float is the rational it denotes
        text = f"(/ {abs(q.numerator)}.0 {q.denominator}.0)"
        return f"(- {text})" if q < 0 else text
    v = int(v)
    return f"(- {-v})" if v < 0 else str(v)


def _affine(a, ra, d, i: str, j: str, real: bool) -> str:
    terms = [_num(a, real)]
    if ra:
        terms.append(f"(* {_num(ra, real)} {i})")
    if d:
        terms.append(f"(* {_num(d, real)} {j})")
    return terms[0] if len(terms) == 1 else "(+ " + " ".join(terms) + ")"


def _smt_query(runs: list[tuple[str, Run]]) -> str:
    """One assertion: some run has a point ``(i, j)`` in range violating its template
    (over no runs, the empty disjunction: ``false``)."""
    decls, disjuncts = [], []
    for k, (template, run) in enumerate(runs):
        real = template in REAL_TEMPLATES
        i, j = f"i{k}", f"j{k}"
        decls.append(f"(declare-const {i} Int)(declare-const {j} Int)")
        x = [_affine(a, r, d, i, j, real) for a, r, d in zip(run.a, run.ra, run.d)]
        bound = str(run.length) if not run.rlength else f"(+ {run.length} (* {run.rlength} {i}))"
        disjuncts.append(f"(and (<= 0 {i}) (< {i} {run.count}) (<= 0 {j}) (< {j} {bound}) "
                         f"(not {SMT_TEMPLATES[template](x)}))")
    if not disjuncts:
        return "(assert false)"
    return "".join(decls) + "(assert (or " + " ".join(disjuncts) + "))"


CHUNK = 256  # runs per Z3 query: runs share no variables, and small queries stay linear


def prove(obligations: Obligations, rlimit: int | None = None) -> Outcome:
    """Ask Z3 whether any fact violates its template (see module docstring). The runs
    are independent, so they are decided in chunks of ``CHUNK``; every chunk must be
    unsat for the facts to be proven. Without facts Z3 is still asked (the empty
    disjunction), so even that verdict is Z3's."""
    runs = obligations.runs()
    facts = obligations.facts
    for first in range(0, max(len(runs), 1), CHUNK):
        chunk = runs[first:first + CHUNK]
        solver = _solver(rlimit)
        solver.from_string(_smt_query(chunk))
        result = solver.check()
        if result == z3.unknown:
            return Outcome("unknown", reason=solver.reason_unknown(), runs=len(runs), facts=facts)
        if result == z3.sat:
            return _violated(solver.model(), chunk, len(runs), facts)
    return Outcome("proved", runs=len(runs), facts=facts)


def _violated(model, runs, total, facts) -> Outcome:
    for k, (template, run) in enumerate(runs):
        i = model.eval(z3.Int(f"i{k}"), model_completion=True).as_long()
        j = model.eval(z3.Int(f"j{k}"), model_completion=True).as_long()
        if 0 <= i < run.count and 0 <= j < run.length + run.rlength * i:
            fact = run.point(i, j)
            if confirm(template, fact) == "violated":
                return Outcome("violated", (template, fact), runs=total, facts=facts)
    return Outcome("unknown", reason="sat without a violating run", runs=total, facts=facts)


def confirm(template: str, fact: Sequence[Number], rlimit: int | None = None) -> str:
    """Ask Z3 whether one ground ``fact`` violates ``template``: ``violated``,
    ``holds`` or ``unknown``."""
    real = template in REAL_TEMPLATES
    return check_unsat(z3.Not(TEMPLATES[template]([_value(v, real) for v in fact])), rlimit,
                       sat="violated", unsat="holds")


def check_unsat(formula, rlimit: int | None = None, *, sat: str = "sat",
                unsat: str = "unsat") -> str:
    """Ask Z3 whether ``formula`` (a Z3 Boolean) is satisfiable, within ``rlimit``; the
    answer is named ``sat`` or ``unsat`` as the caller says, anything else ``unknown``."""
    solver = _solver(rlimit)
    solver.add(formula)
    result = solver.check()
    if result == z3.sat:
        return sat
    if result == z3.unsat:
        return unsat
    return "unknown"


def _solver(rlimit: int | None) -> z3.Solver:
    """A fresh solver, capped at ``rlimit`` resource units when given."""
    solver = z3.Solver()
    if rlimit is not None:
        solver.set("rlimit", rlimit)
    return solver
