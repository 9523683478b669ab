"""The checker: each property of a plan proved from a witness (``prove``), the same query
as one formula (``violation``), and a certificate's claim, as its reader reads it,
proved again (``recheck``)."""

from __future__ import annotations

import attrs

from ..ir import PROPERTIES, Plan
from .certificates import Refused, digest, read_claim
from .inputs import Sizes, Witness
from .obligations import obligations
from .rules import rules_of
from .smt import compress, decide, violation_formula


@attrs.frozen
class Verdict:
    """A property's verdict: ``proved``, ``failed`` (``detail``: the violated fact) or
    ``unknown`` (``detail``: Z3's reason); ``facts`` and ``runs`` count the obligations."""

    status: str
    detail: str = ""
    facts: int = 0
    runs: int = 0


def prove(plan: Plan, witness: Witness, comm_model: str = "rendezvous", sizes=None,
          limits=None, rlimit: int | None = None, properties=PROPERTIES) -> dict:
    """Each property's ``Verdict`` for ``plan`` under ``comm_model`` (``rendezvous`` or
    ``eager``), ``sizes`` (default: the unit model) and ``limits`` (one bound per rank,
    or None)."""
    if comm_model not in ("rendezvous", "eager"):
        raise ValueError(f"unknown comm model {comm_model!r}")
    if limits is not None and len(limits) != plan.num_ranks:
        raise ValueError(f"{len(limits)} memory limits for {plan.num_ranks} ranks")
    rules, out = rules_of(plan), {}
    if not rules.cut_ok():  # every rule below reads the cut
        return {name: Verdict("failed", "the cut does not fit the plan") for name in properties}
    for name in properties:
        facts = obligations(name, rules, witness, comm_model, sizes, limits)
        runs = compress(facts)
        out[name] = Verdict(*decide(runs, rlimit), facts.count, len(runs))
    return out


def violation(plan: Plan, witness: Witness, name: str, comm_model: str = "rendezvous",
              sizes=None, limits=None) -> str:
    """The whole query ``prove`` decides for property ``name``, as one SMT-LIB formula over
    the integers declared by ``QUERY_DECLS``: satisfiable iff some obligation fails (a cut
    that does not fit the plan: ``true``). For callers that combine many plans' queries
    into one Z3 call (the bounded family laws)."""
    rules = rules_of(plan)
    if not rules.cut_ok():
        return "true"
    return violation_formula(compress(obligations(name, rules, witness, comm_model, sizes,
                                                  limits)))


def recheck(plan: Plan, data, rlimit: int | None = None, comm_model: str | None = None,
            limits=None, sizes: Sizes | None = None) -> tuple[bool, list[str]]:
    """Re-prove all five properties of ``plan`` from a certificate (``certificate``'s
    JSON): ``(True, [])``, or ``(False, reasons)`` when it does not establish them. What
    is proved is under the certificate's comm model, memory limits and sizes;
    ``comm_model``, ``limits`` (one per rank) and ``sizes``, when given, must be the
    certificate's (``certificates.read_claim``)."""
    try:
        claim = read_claim(data, digest(plan), comm_model, limits, sizes)
        verdicts = prove(plan, claim.witness, claim.comm_model, claim.sizes, claim.limits,
                         rlimit)
    except Refused as refusal:
        return False, [str(refusal)]
    except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError,
            ZeroDivisionError) as error:
        return False, [f"malformed certificate: {type(error).__name__}: {error}"]
    reasons = [f"{name}: {v.status} {v.detail}".strip() for name, v in verdicts.items()
               if v.status != "proved"]
    return not reasons, reasons
