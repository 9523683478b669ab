"""Instance checks answered by a family's proven laws (``proofs/``, the family invariants).

A family instance ``(family, params)`` is *covered* when, for each of the five properties,
the registry has a law about that family whose scope is all sizes and holds ``params``
(``Law.proves``), and the memory law states its per-rank peak (``Law.peak``). Then
``prove`` proves those laws now (their distinct obligations, in freshly started
interpreters; nothing is cached, so a law that no longer holds never yields VERIFIED) and
compares the memory limit with the proven peak at ``params``: the answer costs the laws'
time, whatever the instance's size.
Anything else (a bounded cell, a law that is not proved, a peak over the limit, the eager
model) is left to the ordinary instance check, which also finds the counterexamples.

``params`` is the family's parameters as a mapping: ``pp``, ``microbatches``, ``chunks``
(None where the family fixes them) and, for ``transpose``, ``body``, ``mode``,
``ownership`` and ``side``.

A parametric certificate names the family, the parameters and the laws; its digest is
the SHA-256 of that claim. It certifies exactly the plan those parameters derive
(``derived_plan``): ``mismatch`` says why a plan is not that one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Mapping, Sequence

import attrs

from ..ir import Plan, map_payloads
from ..semantics import RENDEZVOUS

PARAMETRIC, INSTANCE = "parametric", "instance"
FORMAT = "mpipe-parametric-certificate"


@attrs.frozen
class Parametric:
    """The claim of a parametric proof: ``laws`` prove the five properties of ``family``
    at ``params`` (sorted ``(key, value)`` pairs)."""

    family: str
    params: tuple[tuple[str, object], ...]
    laws: tuple[str, ...]

    @classmethod
    def of(cls, family: str, params: Mapping[str, object], laws: Sequence[str]) -> "Parametric":
        return cls(family, tuple(sorted(params.items())), tuple(laws))

    @property
    def mapping(self) -> dict[str, object]:
        return dict(self.params)

    def digest(self) -> str:
        text = json.dumps({"family": self.family, "params": self.mapping,
                           "laws": list(self.laws)}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> dict:
        return {"family": self.family, "params": self.mapping, "laws": list(self.laws)}

    @classmethod
    def from_json(cls, data: Mapping) -> "Parametric":
        params = data["params"]
        if not isinstance(params, dict) or not isinstance(data["laws"], list):
            raise ValueError("params must be an object and laws a list")
        if not all(v is None or type(v) in (int, str) for v in params.values()):
            raise ValueError("each parameter must be an integer, a text or null")
        return cls.of(str(data["family"]), params, [str(x) for x in data["laws"]])


def prove(family: str, params: Mapping[str, object], limit=None,
          comm_model: str = RENDEZVOUS):
    """A verified ``Report`` from the family's laws, proven now, or None (see the module
    docstring for when)."""
    from ..proofs.covering import memory_law, needed_laws
    from .properties import memory_limits
    from .report import PROPERTIES, Certificate, Report
    laws = needed_laws(family, params) if comm_model == RENDEZVOUS else None
    if laws is None:
        return None
    started = time.perf_counter()
    ranks = int(params["pp"])
    peaks = tuple(memory_law(laws).peak(params))
    try:
        limits = memory_limits(limit, ranks)
    except ValueError:
        return None  # the instance check refuses the limit with its own message
    if _over_limit(peaks, limits):
        return None  # the instance check finds and reports the overrun
    proved, count = prove_laws(family, params)
    if not proved:
        return None
    claim = Parametric.of(family, params, [law.name for law in laws])
    stats = {"ranks": ranks, "comm_model": comm_model,
             "properties": {law.property: {"status": "proved", "law": law.name,
                                           "scope": law.scope} for law in laws},
             "obligations": count, "seconds": round(time.perf_counter() - started, 4)}
    certificate = Certificate(claim.digest(), PROPERTIES, limits, comm_model,
                              parametric=claim)
    return Report("verified", (), dict(enumerate(peaks)), stats, certificate)


def _over_limit(peaks: tuple, limits) -> bool:
    """Some rank's proven peak is above its limit (``limits``: None, or one per rank; a
    count other than the ranks' is over, too)."""
    return limits is not None and (len(limits) != len(peaks)
                                   or any(pk > lim for pk, lim in zip(peaks, limits)))


def prove_laws(family: str, params: Mapping[str, object], jobs: int = 2) -> tuple[bool, int]:
    """Prove every obligation of the family's laws at ``params``
    (``proofs.covering.needed_laws``) now, each distinct one once, split over ``jobs``
    freshly started interpreters (``python -P -m mpipe_verified.proofs.covering``, which
    imports the laws, the algebra they are compared with and Z3, not the kernel, the
    passes or numpy), so no verdict depends on what Z3 did before in this process:
    ``(all proved, obligations)``. Each interpreter runs this process's own copy of the
    package (its directory first on the path, the working directory not on it) and must
    say so; one that fails, answers nonsense or runs another copy proves nothing. A law
    is proved when all of its obligations are, and each is among these."""
    import subprocess
    import sys
    import mpipe_verified
    package = os.path.abspath(mpipe_verified.__file__)
    here = os.path.dirname(os.path.dirname(package))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-P", "-m", "mpipe_verified.proofs.covering", family,
               json.dumps(dict(params))]
    procs: list = []
    try:
        for i in range(jobs):
            procs.append(subprocess.Popen([*command, str(i), str(jobs)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL))
        answers = [_answer(proc.communicate()[0], proc.returncode, package)
                   for proc in procs]
    except OSError:  # an interpreter that cannot start proves nothing
        return False, 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    counts = {a[1] for a in answers}
    proved = all(a[0] for a in answers) and len(counts) == 1
    return proved, min(counts)


def _answer(out: bytes, returncode: int, package: str) -> tuple[bool, int]:
    """A prover's ``(proved, obligations)`` from its output; ``(False, 0)`` unless it
    exited 0 with exactly the JSON object ``covering.main`` prints, from ``package``."""
    try:
        data = json.loads(out)
    except ValueError:
        return False, 0
    if (returncode != 0 or not isinstance(data, dict) or data.get("proved") is not True
            or not isinstance(data.get("obligations"), int)
            or data.get("package") != package):
        return False, 0
    return True, data["obligations"]


def derived_plan(claim: Parametric) -> Plan:
    """The lowered plan the claim's parameters derive (``lower`` of the family's term)."""
    from ..lower import lower
    return lower(_term(claim).derive())


def _term(claim: Parametric):
    """The family's term at the claim's parameters (built, not derived: cheap)."""
    from ..algebra.families import family
    from ..algebra.transpose import TRANSPOSE, transpose_family
    p = claim.mapping
    if claim.family == TRANSPOSE:
        return transpose_family(p["pp"], p["microbatches"], p.get("chunks"), body=p["body"],
                                side=p["side"], mode=p["mode"], ownership=p["ownership"])
    return family(claim.family, p["pp"], p["microbatches"], p.get("chunks"))


def mismatch(plan: Plan, claim: Parametric) -> str | None:
    """Why ``claim`` does not certify ``plan`` (None when it does): its laws must be the
    ones that cover its parameters now, and ``plan`` the plan they derive."""
    from ..errors import ParameterError
    from ..proofs.covering import needed_laws
    from .report import plan_digest
    from ..algebra.transpose import TRANSPOSE
    p = claim.mapping
    keys = {"pp", "microbatches", "chunks"} | (
        {"body", "side", "mode", "ownership"} if claim.family == TRANSPOSE else set())
    if set(p) != keys:
        return f"its parameters are {sorted(p)}, the family's {sorted(keys)}"
    if (p.get("pp"), p.get("microbatches")) != (plan.num_ranks, plan.num_microbatches):
        return (f"the plan has {plan.num_ranks} ranks and {plan.num_microbatches} "
                f"microbatches, the certificate's parameters pp={p.get('pp')} and "
                f"microbatches={p.get('microbatches')}")
    if p["chunks"] is not None and (type(p["chunks"]) is not int or p["chunks"] < 1):
        return f"chunks={p['chunks']!r} is not a number of chunks"
    # a forward per rank, chunk and mb at least, each in a step of its own or beside a
    forwards = plan.num_ranks * (p["chunks"] or 1) * plan.num_microbatches  # backward:
    if forwards > plan.num_ops:  # checked before the term (its placement) is even built
        return (f"its parameters derive at least {forwards} forwards, the plan has "
                f"{plan.num_ops} steps")
    try:  # the laws' names before the plan: deriving it costs far more
        term = _term(claim)
        laws = needed_laws(claim.family, claim.mapping)
        if laws is None or tuple(law.name for law in laws) != claim.laws:
            return (f"the laws {', '.join(claim.laws)} are not the ones that prove "
                    f"{claim.family} at these parameters")
        from ..lower import lower
        derived = lower(term.derive())
    except (KeyError, TypeError, ValueError, ParameterError) as e:
        return f"the parametric certificate's parameters do not derive a plan: {e}"
    bare, why = _without_annotations(plan)
    if why is not None:
        return why
    if plan_digest(derived) != plan_digest(bare):
        return (f"the plan is not the one {claim.family} derives at "
                + ", ".join(f"{k}={v}" for k, v in claim.params if v is not None))
    return None


def _without_annotations(plan: Plan) -> tuple[Plan, str | None]:
    """``plan`` with its payloads' shapes, dtypes and leaves (the executor's annotations)
    removed, and why not when a payload is annotated two ways (its two ends must
    agree)."""
    seen: dict = {}
    conflict: list = []

    def bare(payload):
        key = attrs.evolve(payload, shape=None, dtype=None, leaves=None)
        layout = (payload.shape, payload.dtype, payload.leaves)
        if seen.setdefault(key, layout) != layout:
            conflict.append(key)
        return key

    bare_plan = map_payloads(plan, bare)
    if conflict:
        return plan, f"payload {conflict[0]} carries two different shapes or dtypes"
    return bare_plan, None


def witness_certificate(plan: Plan, data: Mapping, rlimit: int | None = None
                        ) -> tuple[dict | None, list[str]]:
    """For ``mpipe-verify recheck`` of a parametric certificate, which holds no witness:
    ``(certificate, [])`` with a witness certificate of ``plan`` (``kernel.certificate``'s
    JSON) for the kernel to recheck, or ``(None, reasons)``. The parametric certificate
    must be well formed and name ``plan`` (``check_certificate``: its parameters derive
    ``plan``); the witness is then made now by ``verify_split`` in the unit model (the
    only one a parametric proof is made in) under its comm model and memory limit.
    Untrusted, like everything here: only the kernel's recheck of the result decides."""
    from . import verify_split
    from ..semantics import COMM_MODELS
    from .report import Certificate, CertificateError, check_certificate
    limit, claimed = data.get("memory_limit"), data.get("properties")
    if type(claimed) is not list or not all(type(x) is str for x in claimed):
        return None, ["malformed parametric certificate: its properties must be a list of "
                      "names"]
    if data.get("comm_model") not in COMM_MODELS or not (limit is None or (
            type(limit) is list and len(limit) == plan.num_ranks
            and all(type(x) in (int, float) and 0 <= x < float("inf") for x in limit))):
        return None, ["malformed parametric certificate: its comm model must be one of "
                      f"{', '.join(COMM_MODELS)} and its memory limit null or one finite "
                      f"number >= 0 per rank ({plan.num_ranks})"]
    try:
        certificate = Certificate.from_json(dict(data))
    except (KeyError, OverflowError, TypeError, ValueError) as e:
        return None, [f"malformed parametric certificate: {e!r}"]
    if certificate.parametric is None:
        return None, ["the certificate names no parametric claim"]
    try:
        check_certificate(plan, certificate, certificate.comm_model)
    except CertificateError as e:
        return None, [str(e)]
    report = verify_split(plan, certificate.memory_limit, certificate.comm_model,
                          rlimit=rlimit)
    if not report.verified:
        return None, [f"no witness for the plan ({report.status})",
                      *(v.message for v in report.violations[:5]), *report.undecided[:5]]
    return report.portable_certificate(plan), []
