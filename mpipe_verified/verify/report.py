"""Verdicts, counterexamples and certificates (docs/semantics.md §3, §6)."""

from __future__ import annotations

import json

import attrs

from .. import kernel
from ..ir import Plan
from .parametric import Parametric, mismatch

PROPERTIES = kernel.PROPERTIES  # the five, in report order
VERIFIER_VERSION = "mpipe-verify/2"  # /2: verdicts from the kernel, required collectives


@attrs.frozen
class Violation:
    """One counterexample: the property, a one-line ``message``, the ranks and ops
    (``(rank, position, op text)``) involved, and ``trace``: extra lines (the per-rank
    wait-for cycle, both ends of a mismatch, the live tensors at a memory peak)."""

    property: str
    message: str
    ranks: tuple[int, ...] = ()
    ops: tuple[tuple[int, int, str], ...] = ()
    trace: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"property": self.property, "message": self.message, "ranks": list(self.ranks),
                "ops": [{"rank": r, "position": i, "op": op} for r, i, op in self.ops],
                "trace": list(self.trace)}


def plan_digest(plan: Plan) -> str:
    """SHA-256 of the plan's canonical text (``kernel.digest``)."""
    return kernel.digest(plan)


@attrs.frozen
class Certificate:
    """What was proven about which plan: recheckable in linear time by recomputing the
    plan's digest (``check_certificate``). A certificate from a parametric proof
    (``parametric``: family, parameters, laws; ``verify.parametric``) has the claim's
    digest instead, and certifies the one plan those parameters derive."""

    digest: str
    properties: tuple[str, ...]
    memory_limit: tuple[float, ...] | None
    comm_model: str
    version: str = VERIFIER_VERSION
    parametric: "Parametric | None" = None

    def to_json(self) -> dict:
        out = {"digest": self.digest, "properties": list(self.properties),
               "memory_limit": None if self.memory_limit is None else list(self.memory_limit),
               "comm_model": self.comm_model, "version": self.version}
        if self.parametric is not None:
            out["parametric"] = self.parametric.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Certificate":
        limit = data.get("memory_limit")
        claim = data.get("parametric")
        if not all(type(x) is str for x in data["properties"]):
            raise ValueError("properties must be names")
        return cls(str(data["digest"]), tuple(data["properties"]),
                   None if limit is None else tuple(float(x) for x in limit),
                   str(data["comm_model"]), str(data.get("version", "")),
                   None if claim is None else Parametric.from_json(claim))


class CertificateError(Exception):
    """A plan was refused: no certificate, or one that does not match the plan."""


def check_certificate(plan: Plan, certificate: Certificate | None,
                      comm_model: str = "rendezvous") -> None:
    """Raise ``CertificateError`` unless ``certificate`` proves all five properties of
    exactly this plan under ``comm_model`` with the current verifier version."""
    if certificate is None:
        raise CertificateError("the plan has no certificate; run the verifier first")
    if certificate.version != VERIFIER_VERSION:
        raise CertificateError(f"certificate from {certificate.version!r}, expected {VERIFIER_VERSION!r}")
    if set(certificate.properties) != set(PROPERTIES):
        missing = sorted(set(PROPERTIES) - set(certificate.properties))
        raise CertificateError(f"certificate does not prove {', '.join(missing)}")
    if certificate.comm_model != comm_model:
        raise CertificateError(f"certificate is for the {certificate.comm_model} model, "
                               f"not {comm_model}")
    if certificate.parametric is not None:
        claim = certificate.parametric
        why = None if certificate.digest == claim.digest() else "its digest is not its claim's"
        why = why or mismatch(plan, claim)
        if why is not None:
            raise CertificateError(f"parametric certificate refused: {why}")
        return
    digest = plan_digest(plan)
    if digest != certificate.digest:
        raise CertificateError(f"plan digest {digest[:16]}… does not match the certificate's "
                               f"{certificate.digest[:16]}…: the plan was altered")


@attrs.frozen
class Report:
    """``status``: ``verified`` (all five proven), ``violated`` (at least one confirmed
    violation) or ``undecided`` (Z3 answered unknown / ran out of resources somewhere and
    nothing was violated). ``exit_code`` follows docs/semantics.md §6: 0, 1, 3."""

    status: str
    violations: tuple[Violation, ...]
    peak_memory: dict[int, float]
    stats: dict
    certificate: Certificate | None = None
    undecided: tuple[str, ...] = ()
    witness: kernel.Witness | None = None  # what the kernel proved the plan from
    sizes: kernel.Sizes | None = None
    limits: tuple | None = None  # the per-rank limits exactly as the kernel proved them

    def portable_certificate(self, plan: Plan) -> dict:
        """The certificate with its witness, as ``mpipe-verify recheck`` reads it
        (``kernel.certificate``); only for a verified report of ``plan``."""
        if self.certificate is None or self.witness is None:
            raise ValueError("only a verified report has a certificate")
        return kernel.certificate(plan, self.witness, self.certificate.comm_model,
                                  self.sizes, self.limits)

    @property
    def verified(self) -> bool:
        return self.status == "verified"

    @property
    def exit_code(self) -> int:
        return {"verified": 0, "violated": 1}.get(self.status, 3)

    def to_json(self) -> dict:
        out = {"verified": self.verified, "status": self.status,
               "violations": [v.to_json() for v in self.violations],
               "peak_memory": {str(r): v for r, v in sorted(self.peak_memory.items())},
               "stats": self.stats}
        if self.undecided:
            out["undecided"] = list(self.undecided)
        if self.certificate is not None:
            out["certificate"] = self.certificate.to_json()
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)
