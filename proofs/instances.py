"""Bounded family laws over package-derived, lowered instances.

Each instance is a term the package derives for one size, **lowered by the package**
(``lower``), so the lowering step is part of what is checked, never assumed. For one of
the five properties the verification kernel states every obligation of that plan as one
SMT-LIB formula (``kernel.violation``: satisfiable iff some obligation fails, generated
from the plan alone); the untrusted fast passes (``verify.passes``) propose only the
numbers those obligations mention (producer positions, completion times under
rendezvous, memory levels). A law's obligation for one ``p`` is the disjunction over all
its instances, and Z3 refutes it: ``unsat`` proves the property for every instance.
Such a law is exactly as strong as a VERIFIED of each instance, and rests on the same
trusted base (the kernel, which computes each fact from the plan, e.g. a matched pair's
payloads compared, and Z3, which checks the facts against their templates).

Memory: the law states a closed-form peak per rank; the kernel's obligations then check
the level chained step by step, every step within that peak and (``exact``) the peak
reached, so a wrong formula fails the law. With ``exact=False`` the formula is an upper
bound (the kernel's memory-limit obligation).
"""

from __future__ import annotations

from typing import Callable, Iterable

from .core import Obligation

# The kernel, the lowering and the passes are imported where an instance is built: a
# process that proves only all-sizes laws (``covering``) never loads them.
Peak = Callable[[int, int, int], int]  # (p, m, rank) -> the stated peak


def _witness(plan, prop: str, peak: Peak | None, exact: bool):
    """``(witness, limits)`` for ``prop``: the passes' numbers, the stated peak in place
    of the measured one when ``exact`` (else the stated peak as the limit)."""
    from mpipe_verified import kernel
    from mpipe_verified.semantics import RENDEZVOUS, UNIT_MEMORY
    from mpipe_verified.verify import passes
    if prop == "dependency":
        return kernel.Witness(None, passes.dependency(plan)[1], None, None, None), None
    if prop == "deadlock":
        finish = passes.deadlock(plan, RENDEZVOUS)[1]
        return kernel.Witness(finish, None, None, None, None), None
    if prop == "memory":
        stated = tuple(peak(plan.num_ranks, plan.num_microbatches, r)
                       for r in range(plan.num_ranks))
        hint = passes.memory(plan, UNIT_MEMORY, None)[1]
        levels, measured, at = hint
        witness = kernel.Witness(None, None, levels, stated if exact else measured, at)
        return witness, (None if exact else stated)
    return kernel.Witness(None, None, None, None, None), None


def violation(schedule, prop: str, peak: Peak | None = None, exact: bool = True) -> str:
    """The kernel's formula "some ``prop`` obligation of ``lower(schedule)`` fails"."""
    from mpipe_verified.lower import lower
    return plan_violation(lower(schedule), prop, peak, exact)


def plan_violation(plan, prop: str, peak: Peak | None = None, exact: bool = True) -> str:
    """The kernel's formula "some ``prop`` obligation of ``plan`` fails"."""
    from mpipe_verified import kernel
    from mpipe_verified.semantics import RENDEZVOUS, UNIT_MEMORY
    witness, limits = _witness(plan, prop, peak, exact)
    sizes = kernel.Sizes.of(plan, UNIT_MEMORY) if prop == "memory" else None
    return kernel.violation(plan, witness, prop, RENDEZVOUS, sizes, limits)


def obligations(label: str, instances: Callable[[int], Iterable], p_max: int, prop: str,
                peak: Peak | None = None, exact: bool = True):
    """One obligation per ``p <= p_max``: no ``prop`` obligation fails on any schedule of
    ``instances(p)``. Every instance's formula speaks of the same two integers
    (``QUERY_DECLS``) and of nothing else, so the disjunction is satisfiable iff some
    instance's formula is."""
    for pp in range(1, p_max + 1):
        parts = [violation(s, prop, peak, exact) for s in instances(pp)]
        yield Obligation(f"{label} p={pp}: {prop} of every instance", smt=none_of(parts))


def none_of(violations: list[str]) -> tuple[str, str]:
    """The ground obligation "none of ``violations`` (kernel formulas over
    ``QUERY_DECLS``) is satisfiable"."""
    from mpipe_verified import kernel
    return kernel.QUERY_DECLS, "(not (or false " + " ".join(violations) + "))"


STATEMENTS = {
    "completeness": "every F(s, x) and its backward (B, or I and W) exactly once, on the rank "
                    "owning s, and nothing else",
    "dependency": "in the lowered plan every op's inputs are on its rank before it runs",
    "matching": "the lowered plan pairs every send with the receive of the same payload, FIFO "
                "per channel, none left over",
    "deadlock": "the lowered plan runs to completion under rendezvous (a completion-time "
                "witness checked by Z3)",
}


def chunked_family_laws(name: str, title: str, peak, peak_text: str, p_max: int, m_max: int,
                        chunks: tuple[int, ...], weight: int = 3) -> tuple:
    """The five bounded laws of the family ``name`` that takes ``chunks``: every property
    of its package-derived, lowered instances for ``p <= p_max``, ``m <= m_max`` and each
    of ``chunks``, one Z3 query per ``p`` and property; the memory law states the peak
    ``peak(p, m, v, r)`` (``peak_text``) exactly."""
    from .core import bounded, law
    from mpipe_verified.algebra.families import family
    scope = bounded(f"p <= {p_max}, m <= {m_max}, chunks {', '.join(map(str, chunks))}; "
                    f"package-derived and lowered instances, each checked by the "
                    f"verification kernel's obligations")

    def obligations(prop: str):
        for pp in range(1, p_max + 1):
            parts = [violation(family(name, pp, mm, v).derive(), prop,
                               lambda p, m, r, v=v: peak(p, m, v, r))
                     for mm in range(1, m_max + 1) for v in chunks]
            yield Obligation(f"{title} p={pp}: {prop} of every instance with m <= {m_max}",
                             smt=none_of(parts))

    def cell(prop: str, statement: str):
        return law(f"{name.replace('-', '_')}_{prop}", f"{title}: {statement}", scope,
                   weight=weight, family=name, property=prop)(lambda: obligations(prop))
    return tuple(cell(prop, STATEMENTS[prop]) for prop in STATEMENTS) + (
        cell("memory", f"the unit-model peak on rank r is exactly {peak_text}"),)
