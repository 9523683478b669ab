"""Encoder placement as an optimisation problem of its own: which rank owns each
microbatch's segment work, chosen by Z3's ``Optimize`` over the body's idle time.

A ``Problem`` is what the choice depends on, nothing more (it is the cache key): the rank
count, the home rank, each rank's idle intervals in the body's estimated timeline (up to
its horizon ``H``) and the segment ``Work``. Each item is one microbatch's work with its
cost and its time window: ``due`` items must finish by ``time`` (a source forward, before
the body's first forward of that microbatch starts; a central recompute, before the
body's first-stage backward of it), the others may start from ``time`` on (an owner-mode
backward, after the body's first-stage backward; a sink's work, after the body's last
forward). ``where`` says whose work it is: ``owner`` (the microbatch's owner), ``moved``
(the home rank's, only when the owner is another rank: a recompute) or ``home`` (the
home rank's whatever the owner: a central backward).

The model (``_chains``, one statement for the solver and for ``overflow``): per rank ``r``,

- for every due time ``D``: the due work on ``r`` with ``time <= D`` fits in ``r``'s idle
  time in ``[0, D]`` plus ``over[r]``;
- for every release ``R``: the released work on ``r`` with ``time >= R`` fits in its idle
  time in ``[R, H]`` plus ``over[r]``;
- all the work on ``r`` fits in its idle time in ``[0, H]`` plus ``over[r]``.

Windows are ``[0, D]`` or ``[R, H]``, so these are all of the intervals that hold whole
windows: the conditions are necessary for the work to fit the idle time (Hall's condition
for one machine); they ignore that an op cannot be split across two gaps and that delays
propagate to other ranks. ``over[r] >= 0`` is the work that does not fit: what ``r`` is
delayed by. Objectives, lexicographic: the largest ``over[r]`` (the delay the placement
adds to the step), their sum, then the number of microbatches moved off the home rank
(each move costs a transfer). The solution is a plain owner list: the transpose operator
derives it like any other ownership (``ownership="given"``), so a spec that lists it
reproduces the schedule without solving again.

``optimize`` bounds every Optimize call by Z3's ``rlimit`` (a deterministic count of
solver steps, so a budget-free search gives the same answer on every run) and, when
given, a wall-clock ``timeout``. A call stopped by either leaves the assignment Z3 had
(``bounded``, never reported as optimal) or none (``none``: the caller keeps its own
placement). ``solve`` runs it in a process of its own that is stopped after the
timeout (at most ``HARD_SECONDS``), since Z3 does not check its limits in every phase.
"""

from __future__ import annotations

import multiprocessing
import time
from fractions import Fraction
from typing import Callable, Iterator

import attrs

OWNER, MOVED, HOME = "owner", "moved", "home"
RLIMIT = 2_000_000  # Z3 resource units per Optimize call (about a second at 8 ranks)
HARD_SECONDS = 60.0  # wall-clock cap on one solve, whatever Z3's own limits do
_START = 5.0  # allowance for starting the solver's process
_now: Callable[[], float] = time.monotonic  # the clock of ``timeout`` and ``seconds``
# (a test replaces it with a fake clock; the process waits in ``solve`` stay real)


@attrs.frozen
class Work:
    """One microbatch's segment work: ``cost`` on the rank ``where`` names, due by
    ``time`` (``due``) or released at ``time``."""

    mb: int
    cost: float
    due: bool
    time: float
    where: str = OWNER


@attrs.frozen
class Problem:
    """Owners for ``microbatches`` microbatches on ``ranks`` ranks. ``idle[r]``: rank
    ``r``'s idle intervals ``(start, end)``, in time order, within ``[0, horizon]``."""

    ranks: int
    microbatches: int
    home: int
    idle: tuple[tuple[tuple[float, float], ...], ...]
    horizon: float
    work: tuple[Work, ...]


OPTIMAL, BOUNDED, NONE = "optimal", "bounded", "none"


@attrs.frozen
class Solution:
    """``owners`` and their objective values (``top``: the largest overflow, ``total``:
    their sum, exact). ``status``: ``optimal`` (Z3 proved no assignment does better),
    ``bounded`` (the limit stopped Z3; the best assignment it had, not proven optimal,
    with its values by ``overflow``) or ``none`` (stopped before any assignment: ``owners`` is None)."""

    owners: tuple[int, ...] | None
    top: Fraction | None
    total: Fraction | None
    status: str
    seconds: float


def _idle(intervals, lo: float, hi: float) -> Fraction:
    return sum((Fraction(min(b, hi)) - Fraction(max(a, lo))
                for a, b in intervals if min(b, hi) > max(a, lo)), Fraction(0))


Share = Callable[[Work, int], object]


def _chains(problem: Problem, on: Share
            ) -> Iterator[tuple[int, list[tuple[list[tuple[Fraction, object]], Fraction]]]]:
    """``(rank, steps)``: each step adds ``(cost, share)`` pairs (``on(work, r)``: a truth
    value, whether the work runs on ``r``) to a running load that must fit in the
    step's capacity plus the rank's overflow. Per rank: the due work by due time, the
    released work by release (latest first), and all of it."""
    horizon = problem.horizon
    for r in range(problem.ranks):
        mine = [w for w in problem.work if w.where == OWNER or r == problem.home]
        idle = problem.idle[r]

        def pair(w: Work):
            return Fraction(w.cost), on(w, r)
        due = sorted((w for w in mine if w.due), key=lambda w: w.time)
        after = sorted((w for w in mine if not w.due), key=lambda w: -w.time)
        yield r, _steps(due, pair, lambda t: _idle(idle, 0.0, t))
        yield r, _steps(after, pair, lambda t: _idle(idle, t, horizon))
        yield r, [([pair(w) for w in mine], _idle(idle, 0.0, horizon))]


def _steps(ordered: list[Work], pair, capacity) -> list:
    """Group ``ordered`` by equal times: one step per time, with that time's capacity."""
    steps: list = []
    for w in ordered:
        if steps and steps[-1][2] == w.time:
            steps[-1][0].append(pair(w))
        else:
            steps.append(([pair(w)], None, w.time))
    return [(added, capacity(t)) for added, _, t in steps]


def overflow(problem: Problem, owners) -> tuple[Fraction, Fraction]:
    """The model's objective for ``owners`` (exact): the largest overflow and the sum of
    every rank's overflow."""
    on = _share(lambda mb, r: owners[mb] == r, lambda v: not v)
    over = [Fraction(0)] * problem.ranks
    for r, steps in _chains(problem, on):
        load = Fraction(0)
        for added, capacity in steps:
            load += sum((c for c, share in added if share), Fraction(0))
            over[r] = max(over[r], load - capacity)
    return max(over, default=Fraction(0)), sum(over, Fraction(0))


def _share(owner_is: Callable[[int, int], object], negate: Callable) -> Share:
    """``on(work, r)`` from ``owner_is(mb, r)`` (a truth value of the model)."""
    def on(w: Work, r: int):
        if w.where == OWNER:
            return owner_is(w.mb, r)
        if w.where == HOME:
            return True
        return negate(owner_is(w.mb, r))  # MOVED: on home when home does not own it
    return on


def solve(problem: Problem, rlimit: int = RLIMIT, timeout: float | None = None,
          wait: float | None = None) -> Solution:
    """``optimize(problem, rlimit, timeout)`` in a process of its own, stopped after
    ``wait`` seconds (default: ``timeout``, at most ``HARD_SECONDS``, plus a second and
    the process's start-up allowance): Z3 does not check its limits everywhere, and a
    solve must not hang its caller. A stopped solve has no owners."""
    start = _now()
    limit = HARD_SECONDS if timeout is None else min(timeout, HARD_SECONDS)
    context = multiprocessing.get_context(  # fork: no re-import of the caller's script
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker, args=(problem, rlimit, limit, send),
                             daemon=True)
    worker.start()
    send.close()
    try:
        if receive.poll(limit + 1.0 + _START if wait is None else max(0.0, wait)):
            return receive.recv()
        return Solution(None, None, None, NONE, _now() - start)
    except EOFError:  # the worker died (e.g. out of memory)
        return Solution(None, None, None, NONE, _now() - start)
    finally:
        worker.kill()
        worker.join()
        receive.close()


def _worker(problem: Problem, rlimit: int, timeout: float, send) -> None:
    send.send(optimize(problem, rlimit, timeout))


def optimize(problem: Problem, rlimit: int = RLIMIT, timeout: float | None = None
             ) -> Solution:
    """The owners minimising the objectives (see the module docstring) with Z3's
    ``Optimize``, one objective per call (each within ``rlimit`` solver steps and what
    is left of ``timeout`` seconds), the next one with the previous optimum fixed. A
    solution is optimal when every call finished; its values are then Z3's optima."""
    import z3
    start = _now()
    ctx = z3.Context()  # a fresh context: the answer does not depend on earlier Z3 use
    p, m = problem.ranks, problem.microbatches
    x = [[z3.Bool(f"x_{mb}_{r}", ctx) for r in range(p)] for mb in range(m)]
    over = [z3.Real(f"over_{r}", ctx) for r in range(p)]
    top = z3.Real("top", ctx)
    zero = z3.RealVal(0, ctx)
    rules = [z3.PbEq([(v, 1) for v in row], 1) for row in x]
    rules += [o >= 0 for o in over] + [top >= o for o in over]
    on = _share(lambda mb, r: x[mb][r], z3.Not)
    for r, steps in _chains(problem, on):
        load = zero
        for added, capacity in steps:  # a running sum: the terms are shared, O(m) a chain
            load = z3.Sum([load] + [_real(c, ctx) if share is True
                                    else z3.If(share, _real(c, ctx), zero)
                                    for c, share in added])
            rules.append(load <= _real(capacity, ctx) + over[r])
    model, values = None, []
    objectives = (top, z3.Sum(over),
                  z3.Sum([z3.If(x[mb][problem.home], z3.IntVal(0, ctx), z3.IntVal(1, ctx))
                          for mb in range(m)]))
    for objective in objectives:
        opt = z3.Optimize(ctx=ctx)
        opt.set("rlimit", rlimit)
        if timeout is not None:
            left = timeout - (_now() - start)
            if left <= 0:
                break
            opt.set("timeout", max(1, int(left * 1000)))
        opt.add(*rules)
        goal = opt.minimize(objective)
        verdict = opt.check()
        try:
            model = opt.model()
        except z3.Z3Exception:  # stopped before any assignment
            pass
        if verdict != z3.sat:
            break
        values.append(goal.value())
        rules.append(objective <= goal.value())
    seconds = _now() - start
    if model is None:
        return Solution(None, None, None, NONE, seconds)
    owners = tuple(next((r for r in range(p) if z3.is_true(model.eval(x[mb][r]))),
                        problem.home) for mb in range(m))
    if len(values) < len(objectives):  # not proven: the values are the model's
        return Solution(owners, *overflow(problem, owners), BOUNDED, seconds)
    top_value, total_value = (_fraction(v) for v in values[:2])
    return Solution(owners, top_value, total_value, OPTIMAL, seconds)


def _fraction(value) -> Fraction:
    """A Z3 numeral (integer or rational) as an exact fraction."""
    import z3
    if z3.is_int_value(value):
        return Fraction(value.as_long())
    return Fraction(value.numerator_as_long(), value.denominator_as_long())


def _real(value: Fraction, ctx):
    import z3
    return z3.RealVal(f"{value.numerator}/{value.denominator}", ctx)
