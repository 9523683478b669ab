"""The laws that cover a family instance, and proving their obligations in a fresh
interpreter.

``needed_laws(family, params)`` picks, for each of the five properties, the registry's
all-sizes law about ``family`` whose scope holds ``params``. ``distinct_obligations``
lists their obligations, each stated alike once (the five share their stream, shape and
lowering lemmas). ``python -P -m mpipe_verified.proofs.covering FAMILY PARAMS INDEX
JOBS`` proves every ``JOBS``-th of them from ``INDEX`` (``PARAMS`` a JSON object) and
prints ``{"proved": bool, "obligations": n, "package": the mpipe_verified it ran}``: a
fresh interpreter that imports the laws, the algebra they are compared with and Z3 (not
the kernel, the passes or numpy), so a verdict never depends on what Z3 did before in
the caller's process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Mapping

from . import registry
from .core import ALL_SIZES, PROPERTIES, PROVED, Law, LawResult, check


def needed_laws(family: str, params: Mapping[str, object]) -> list[Law] | None:
    """The family's laws that cover ``params``, one per property in the verifier's order,
    or None when some property has no all-sizes law holding ``params`` or the memory law
    states no peak."""
    chosen = []
    for prop in PROPERTIES:
        found = [law for law in registry.LAWS if law.family == family
                 and law.property == prop and law.for_all_sizes() and law.proves(params)]
        if not found:
            return None
        chosen.append(found[0])
    if memory_law(chosen).peak is None:
        return None
    return chosen


def memory_law(laws: list[Law]) -> Law:
    return next(law for law in laws if law.property == "memory")


def _key(ob) -> tuple:
    """Equal for obligations stated alike (Z3 shares structurally equal terms)."""
    ids = lambda terms: tuple(t.get_id() for t in terms)
    return (ob.name, None if ob.goal is None else ob.goal.get_id(), ids(ob.hypotheses),
            ids(ob.lemmas), ob.smt)


def distinct_obligations(family: str, params: Mapping[str, object]) -> list:
    """The obligations of ``needed_laws`` (none when they do not cover ``params``), in
    order, each stated alike once."""
    unique: dict = {}
    for law in needed_laws(family, params) or ():
        for ob in law.obligations():
            unique.setdefault(_key(ob), ob)
    return list(unique.values())


def prove_part(family: str, params: Mapping[str, object], index: int,
               jobs: int) -> tuple[bool, int]:
    """Prove every ``jobs``-th distinct obligation from ``index`` within the laws' default
    budget (``core.DEFAULT_BUDGET``: Z3's resource limit, as ``mpipe-verify laws``):
    ``(all proved, with their hypotheses shown satisfiable, and there is at least one
    obligation, how many distinct obligations there are)``."""
    return _prove_part(family, params, index, jobs)[:2]


def _prove_part(family: str, params: Mapping[str, object], index: int,
                jobs: int) -> tuple[bool, int, LawResult]:
    obligations = distinct_obligations(family, params)
    part = obligations[index::jobs]
    result = check(Law(f"{family} part {index}", "", ALL_SIZES, lambda: part))
    settled = result.status == PROVED and not result.detail  # no vacuity left unchecked
    return settled and bool(obligations), len(obligations), result


def main(argv: list[str]) -> None:
    import mpipe_verified
    family, params, index, jobs = argv[0], json.loads(argv[1]), int(argv[2]), int(argv[3])
    proved, count, result = _prove_part(family, params, index, jobs)
    print(json.dumps({"proved": proved, "obligations": count,
                      "package": os.path.abspath(mpipe_verified.__file__),
                      "rlimit_used": result.rlimit_used,
                      "vacuity_rlimit_used": result.vacuity_rlimit_used,
                      "undecided_by": result.undecided_by}))


if __name__ == "__main__":
    main(sys.argv[1:])
