"""Counterexamples confirmed from the plan alone (``confirm``): the kernel recounts a unit
of work, a channel or a required collective, rescans a rank for a missing input,
recomputes a memory level, or checks that a stuck op can never complete, and Z3 agrees
that the fact breaks its template. A claim it does not find is ``rejected``."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import z3

from ..ir import Plan
from .columns import exact
from .inputs import Sizes
from .obligations import instances, moves, obligations, within
from .rules import Rules, rules_of
from .smt import ground, holds, new_solver, word

def confirm(plan: Plan, name: str, claims, comm_model: str = "rendezvous", sizes=None,
            limits=None, rlimit: int | None = None) -> list[str]:
    """For each claimed counterexample of property ``name``: ``violated`` when the kernel
    finds it in the plan and Z3 agrees that the fact breaks its template, ``unknown``
    when Z3 cannot say, else ``rejected``. Claims: ``("unit", segment, stage, mb)``,
    ``("stray"|"input"|"call"|"received"|"stuck", rank, index)``, ``("collective", tag, rank)``,
    ``("channel", src, dst)``, ``("cut",)``, ``("work",)``, ``("peak", rank, index)``,
    ``("cycle", ((rank, index), ...))``; each needs nothing but the plan."""
    def answers(group: list) -> list | None:
        try:
            return _confirm(rules_of(plan), name, group, comm_model, sizes, limits, rlimit)
        except (IndexError, KeyError, TypeError, ValueError):  # a claim names no such place
            return None
    claims = list(claims)
    found = answers(claims)
    return found if found is not None else [(answers([c]) or ["rejected"])[0] for c in claims]


def _confirm(rules: Rules, name: str, claims: list, comm_model, sizes, limits, rlimit) -> list:
    if not rules.cut_ok() and name != "completeness":
        return ["rejected"] * len(claims)
    if name == "deadlock":
        waits = _waits(rules, comm_model == "eager")
        return [_confirm_wait(c, waits, rlimit) for c in claims]
    if name == "dependency":
        bad = [_missing_inputs(rules, c) for c in claims]
    elif name == "memory":
        bad = [_over_limit(rules, c, sizes or Sizes(), limits) for c in claims]
    else:
        facts = obligations(name, rules, None, comm_model, sizes, limits, where=True)
        found = defaultdict(list)
        for at, template, values in facts.where:
            if not holds(template, values):
                found[at].append((template, values))
        bad = [found.get(tuple(c), [])[:1] for c in claims]
    return [ground(b, rlimit) for b in bad]


def _missing_inputs(rules: Rules, claim) -> list:
    """An input of the op at ``(rank, index)`` that no earlier op on the rank produces."""
    rank, index, n = _place(rules, claim)
    if not 0 <= index < n:
        return []
    at = rules.base[rank] + index
    (nrow, need), _, (mrow, made) = rules.tokens
    made = made[(rules.pos[mrow] >= rules.base[rank]) & (rules.pos[mrow] < at)]
    need = need[rules.pos[nrow] == at]
    return [("one", (0,))] if not within(need, made).all() else []


def _over_limit(rules: Rules, claim, sizes: Sizes, limits) -> list:
    """The level at step ``index`` of ``rank`` (``-1``: the static part) over its limit."""
    rank, index, n = _place(rules, claim)
    if limits is None or not (0 <= index < n or index == -1 == n - 1):
        return []  # a step of the program, or -1 for the static part of an empty one
    top = sizes.static[rank] if rank < len(sizes.static) else 0
    if index != -1:
        lo = rules.base[rank]
        alloc, freed = (x[lo:lo + n].tolist() for x in moves(rules, sizes))
        top += sum(alloc[:index]) - sum(freed[:index]) + alloc[index]
    return [("ler", (top, exact(limits[rank])))]


def _place(rules: Rules, claim) -> tuple:
    """A claim ``(_, rank, index)``: its rank, index and the length of the rank's program."""
    _, rank, index = claim
    if type(rank) is not int or not 0 <= rank < rules.p:
        raise IndexError(f"no rank {rank!r}")
    return rank, index, int(rules.base[rank + 1] - rules.base[rank])


def _confirm_wait(claim, waits: dict, rlimit) -> str:
    """A rank stuck on an endpoint with no FIFO partner (or a collective call that a member
    never makes, or that its caller is not a member of), or a wait-for cycle: each op of
    the cycle waits on a partner that its next rank posts only after its own op there;
    Z3 then finds no completion times (each op would complete after the next one, around
    the cycle)."""
    if claim[0] == "stuck":
        return ground([f for _, f in waits.get(tuple(claim[1:]), ()) if not holds(*f)][:1],
                       rlimit)
    cycle = [tuple(at) for at in claim[1]]
    if not cycle or not all(at in waits for at in cycle):  # each a blocking comm step
        return "rejected"
    t, solver = [z3.Int(f"t{k}") for k in range(len(cycle))], new_solver(rlimit)
    for k, at in enumerate(cycle):
        nxt_rank, nxt_index = cycle[(k + 1) % len(cycle)]
        later = [on[1] for on, _ in waits[at] if on and on[0] == nxt_rank]
        if not later:
            return "rejected"  # it waits on nothing of the next rank
        solver.add(z3.Implies(max(later) > nxt_index, t[k] > t[(k + 1) % len(t)]))
    return word(solver.check(), z3.unsat)


def _waits(rules: Rules, eager: bool) -> dict:
    """``(rank, index) -> [(position waited on or None, fact)]`` for every blocking comm
    step: per blocking endpoint, the k-th of its channel, its FIFO partner (None when the
    other side has only ``count <= k`` ends) and the fact ``k < count``; per collective
    call of a member, the other members' calls and the fact "callers = members" of its
    instance; per call of a non-member, nothing and its failing ``member`` flag (it
    never completes)."""
    out: dict = defaultdict(list)
    send, _, _, _, k, partner, count = rules.pairs
    ends = rules.comm.tolist()
    for j in np.flatnonzero(~send | (not eager)).tolist():
        row, z = ends[j], int(partner[j])
        out[(int(rules.rank[row]), rules.index_of(row))].append(
            ((int(rules.rank[ends[z]]), rules.index_of(ends[z])) if z >= 0 else None,
             ("lt", (int(k[j]), int(count[j])))))
    for (group, _), where in instances(rules).items():
        fact = ("eq", (sum(r in where for r in group), len(group)))
        for rank, (index, _) in where.items():
            if rank not in group:  # a non-member's call never completes
                out[(rank, index)].append((None, ("one", (0,))))
                continue
            out[(rank, index)] += [((r, i), fact) for r, (i, _) in where.items()
                                   if r != rank and r in group] or [(None, fact)]
    return out
