"""Instance checks answered by a family's proven laws (``proofs/``, the family invariants).

A family instance ``(family, params)`` is *covered* when, for each of the five properties,
the registry has a law about that family whose scope is all sizes and holds ``params``
(``Law.proves``), and the memory law states its per-rank peak (``Law.peak``). Then
``prove`` proves those laws (their distinct obligations, in freshly started
interpreters, or from a cached proof of the same laws by this very package: ``Cache``)
and compares the memory limit with the proven peak at ``params``: the answer costs the
laws' time, whatever the instance's size.
Anything else (a bounded cell, a law that is not proved, a peak over the limit, the eager
model) is left to the ordinary instance check, which also finds the counterexamples.

``answer`` picks the faster road for an instance (``road``): op by op for a small plan
(``estimated_ops`` below ``EXPAND_BELOW``: building, lowering and checking it costs less
than loading the laws), the laws from a cached proof when one is there, op by op again up
to ``PROVE_ABOVE`` (cheaper than proving the laws now), and the laws proven now beyond.
Either road's VERIFIED comes from the kernel or from proven laws.

The cache (``Cache``) lives in the user's cache directory (``$XDG_CACHE_HOME``, else
``~/.cache``, then ``mpipe-verify/laws``). An entry records that the laws ``L`` of a
family were proved, with ``n`` distinct obligations, by this package: it is keyed by the
SHA-256 of every file of the package's source (``package_digest``: ``mpipe_verified`` and
its ``proofs``), Z3's version and Python's, and the family and law names; any change to
the code is another key. An entry that cannot be read, does not parse, names another key
or fails its own checksum is ignored (and overwritten by the next proof), never trusted.

``params`` is the family's parameters as a mapping: ``pp``, ``microbatches``, ``chunks``
(None where the family fixes them) and, for ``transpose``, ``body``, ``mode``,
``ownership`` and ``side``; for ``seq1f1b``, ``seq_chunks`` S (``microbatches`` then counts
samples: the plan has ``microbatches * S``).

A parametric certificate names the family, the parameters and the laws (``Parametric``,
in ``verify.report`` beside the certificate); its digest is the SHA-256 of that claim. It
certifies exactly the plan those parameters derive (``derived_plan``): ``mismatch`` says
why a plan is not that one, and ``check_certificate`` accepts a certificate of either
kind for a plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Callable, Mapping, Sequence

import attrs

from ..errors import ParameterError
from ..ir import Plan, map_payloads
from ..semantics import COMM_MODELS, RENDEZVOUS
from ..verify import verify_split
from ..verify.report import (PROPERTIES, VERIFIER_VERSION, Certificate, CertificateError,
                             Parametric, Report, counted, plan_digest)

PARAMETRIC, INSTANCE = "parametric", "instance"
FORMAT = "mpipe-parametric-certificate"


# Roads (``road``), by the plan's estimated size in ops (``estimated_ops``). The two
# thresholds come from a one-off measurement on the 2-core development machine (no
# shipped command reproduces it; the road changes speed, never a verdict): building,
# lowering and checking a plan op by op cost about 40 us an op on top of starting the
# command, loading the laws about 0.2 s, proving a family's laws now 1.8 to 3.9 s.
EXPAND_BELOW = 5_000  # op by op, always: cheaper than even loading the laws
PROVE_ABOVE = 60_000  # the laws proven now beat the op-by-op check beyond this
INSTANCE_ROAD, CACHED_ROAD, PROVE_ROAD = "instance", "cached", "prove"
AUTO, LAWS = "auto", "laws"


def estimated_ops(family: str, params: Mapping[str, object]) -> int:
    """About how many ops the instance's lowered plan has (an upper estimate, from the
    parameters alone): a forward and a backward (or ``I`` and ``W``) per stage and
    microbatch, four transfers per stage boundary and microbatch, and for ``transpose``
    the segment's work and transfers per microbatch and its collectives."""
    from ..algebra.families import CHUNKED
    from ..algebra.transpose import TRANSPOSE
    p, m = int(params["pp"]), int(params["microbatches"]) * int(params.get("seq_chunks") or 1)
    body = params.get("body", family) if family == TRANSPOSE else family
    chunks = (int(params.get("chunks") or 2) if body in CHUNKED
              else 2 if body in ("zbv", "dualpipev", "dualpipe", "chimera") else 1)
    stages = p * chunks
    ops = 3 * stages * m + 4 * max(stages - 1, 0) * m
    if family == TRANSPOSE:
        ops += 8 * m + 4 * p
    return ops


def road(family: str, params: Mapping[str, object], mode: str = AUTO,
         cached: Callable[[], bool] = lambda: False) -> str:
    """How ``answer`` decides an instance the laws cover: ``instance`` (op by op),
    ``cached`` (the laws, from a cached proof) or ``prove`` (the laws, proven now).
    ``mode`` ``laws`` takes the laws whatever the size; ``cached()`` says whether a
    cached proof is there (asked only where it matters)."""
    if mode == LAWS:
        return CACHED_ROAD if cached() else PROVE_ROAD
    ops = estimated_ops(family, params)
    if ops < EXPAND_BELOW:
        return INSTANCE_ROAD
    if cached():
        return CACHED_ROAD
    return INSTANCE_ROAD if ops <= PROVE_ABOVE else PROVE_ROAD


def answer(family: str, params: Mapping[str, object], limit=None,
           comm_model: str = RENDEZVOUS, mode: str = AUTO, cache: bool = True,
           proving: Callable[[], None] = lambda: None):
    """The verified ``Report`` of the road ``road`` picks, or None for the op-by-op
    check (the instance is small, the laws do not cover it, or they were not proved).
    ``cache``: use and fill the cache; ``proving()`` is called before the laws are
    proven now."""
    if comm_model != RENDEZVOUS:
        return None
    if mode != LAWS and estimated_ops(family, params) < EXPAND_BELOW:
        return None  # before the laws are even loaded
    from ..proofs.covering import needed_laws
    laws = needed_laws(family, params)
    if laws is None:
        return None
    names = [law.name for law in laws]
    store = Cache() if cache else None
    count = None

    def cached() -> bool:
        nonlocal count
        count = store.proved(family, names) if store is not None else None
        return count is not None
    way = road(family, params, mode, cached)
    if way == INSTANCE_ROAD:
        return None
    if way == PROVE_ROAD:
        proving()
    return prove(family, params, limit, comm_model, cache=store, proved=count)


def prove(family: str, params: Mapping[str, object], limit=None,
          comm_model: str = RENDEZVOUS, cache: "Cache | None" = None,
          proved: int | None = None):
    """A verified ``Report`` from the family's laws, or None (see the module docstring
    for when). ``proved``: the obligations of a cached proof of those laws (``Cache``),
    else they are proven now and, with ``cache``, the proof is stored."""
    from ..proofs.covering import memory_law, needed_laws
    from ..question import Question, Verdict
    laws = needed_laws(family, params) if comm_model == RENDEZVOUS else None
    if laws is None:
        return None
    started = time.perf_counter()
    ranks = int(params["pp"])
    peaks = tuple(memory_law(laws).peak(params))
    try:
        limits = Question(comm_model, limit).limits(ranks)
    except ValueError:
        return None  # the instance check refuses the limit with its own message
    if _over_limit(peaks, limits):
        return None  # the instance check finds and reports the overrun
    names = [law.name for law in laws]
    count = proved
    if count is None:
        before = _digest_or_none() if cache is not None else None
        ok, count = prove_laws(family, params)
        if not ok:
            return None
        if before is not None and _digest_or_none() == before:  # unchanged while proving
            cache.store(family, names, count, before)
    claim = Parametric.of(family, params, names)
    stats = {"ranks": ranks, "comm_model": comm_model,
             "properties": {law.property: {"status": "proved", "law": law.name,
                                           "scope": law.scope} for law in laws},
             "obligations": count, "seconds": round(time.perf_counter() - started, 4)}
    certificate = Certificate(claim.digest(), PROPERTIES,
                              None if limits is None else tuple(map(float, limits)),
                              comm_model, parametric=claim)
    verdict = Verdict("verified", {}, claim.digest(), peaks, limits)  # the laws' verdict
    return Report(verdict, (), dict(enumerate(peaks)), stats, certificate,
                  cached=proved is not None)


# ---------------------------------------------------------------- cached law proofs

CACHE_FORMAT = "mpipe-verify-law-proof/1"
CACHE_MAX_BYTES = 1 << 16  # an entry is a few hundred bytes; anything bigger is not one


def package_digest() -> str:
    """SHA-256 over every file of this package's source: ``mpipe_verified`` and its
    ``proofs`` (wherever they are installed), each by its path under its root and its
    bytes; compiled bytecode (``__pycache__``) left out. Any edit changes it."""
    import mpipe_verified
    from .. import proofs
    roots = [("mpipe_verified", os.path.dirname(os.path.abspath(mpipe_verified.__file__)))]
    here = os.path.dirname(os.path.abspath(proofs.__file__))
    if not here.startswith(roots[0][1] + os.sep):  # an editable install keeps it apart
        roots.append(("proofs", here))
    return tree_digest(roots)


def _digest_or_none() -> str | None:
    """``package_digest()``, or None when the package cannot be read as a whole (a file
    removed while it is read): then no proof is cached."""
    try:
        return package_digest()
    except OSError:
        return None


def tree_digest(roots: Sequence[tuple[str, str]]) -> str:
    """SHA-256 over the files under each ``(label, directory)`` of ``roots``, each by
    ``label/relative path``, length and bytes, in sorted order (``__pycache__`` and
    compiled bytecode left out): ``package_digest`` of any tree."""
    h = hashlib.sha256()
    for label, root in roots:
        found = []

        def unreadable(err: OSError) -> None:  # a directory skipped would hide its edits
            raise err

        for parent, dirs, files in os.walk(root, onerror=unreadable):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.join(parent, f) for f in files if not f.endswith((".pyc", ".pyo"))]
        if not any(f.endswith(".py") for f in found):  # e.g. a package imported from a zip
            raise OSError(f"no Python source under {root}: the package cannot be digested")
        for path in sorted(found):
            with open(path, "rb") as f:
                data = f.read()
            name = f"{label}/{os.path.relpath(path, root)}".encode()
            h.update(b"%d:%s%d:" % (len(name), name, len(data)))
            h.update(data)
    return h.hexdigest()


def cache_dir() -> str | None:
    """``$XDG_CACHE_HOME/mpipe-verify/laws`` (an absolute ``XDG_CACHE_HOME`` only, as the
    XDG spec says), else ``~/.cache/mpipe-verify/laws``; None without a home."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "mpipe-verify", "laws")


class Cache:
    """Cached proofs of a family's laws by this package (see the module docstring):
    ``proved(family, laws)`` gives the obligations of a valid entry or None, ``store``
    writes one (atomically; a cache that cannot be written is left alone)."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory if directory is not None else cache_dir()
        self._digest: str | None = None

    def key(self, family: str, laws: Sequence[str], digest: str | None = None) -> dict:
        import z3
        if digest is None:
            self._digest = self._digest or package_digest()
            digest = self._digest
        return {"format": CACHE_FORMAT, "package": digest, "z3": z3.get_full_version(),
                "python": sys.version, "family": family, "laws": list(laws)}

    def path(self, key: dict) -> str | None:
        if self.directory is None:
            return None
        name = hashlib.sha256(_canonical(key).encode()).hexdigest()
        return os.path.join(self.directory, f"{name}.json")

    def proved(self, family: str, laws: Sequence[str]) -> int | None:
        """The obligations of a valid entry for these laws of ``family``, else None."""
        try:
            key = self.key(family, laws)
            path = self.path(key)
            if path is None:
                return None
            with open(path, "rb") as f:
                raw = f.read(CACHE_MAX_BYTES + 1)
            if len(raw) > CACHE_MAX_BYTES:
                return None
            entry = json.loads(raw.decode("utf-8"))
            if (type(entry) is not dict or set(entry) != {"key", "proved", "obligations",
                                                           "check"}
                    or entry["key"] != key or entry["proved"] is not True
                    or type(entry["obligations"]) is not int or entry["obligations"] < 1
                    or entry["check"] != _checksum(entry)):
                return None
            return entry["obligations"]
        except (OSError, ValueError, TypeError, RecursionError):
            return None  # unreadable or malformed: ignored, never trusted

    def store(self, family: str, laws: Sequence[str], obligations: int,
              digest: str | None = None) -> None:
        from ..formats.output import write_output
        try:
            key = self.key(family, laws, digest)
            path = self.path(key)
            if path is None:
                return
            entry = {"key": key, "proved": True, "obligations": int(obligations)}
            entry["check"] = _checksum(entry)
            write_output(path, json.dumps(entry, indent=1, sort_keys=True) + "\n")
        except OSError:
            pass  # a read-only or full cache: the proof just is not kept


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _checksum(entry: dict) -> str:
    """SHA-256 of the entry without its ``check``: a damaged entry does not match."""
    return hashlib.sha256(_canonical({k: v for k, v in entry.items()
                                      if k != "check"}).encode()).hexdigest()


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
    from ..algebra.families import SEQ_FAMILIES, family
    from ..algebra.transpose import TRANSPOSE, transpose_family
    p = claim.mapping
    if claim.family == TRANSPOSE:
        return transpose_family(p["pp"], p["microbatches"], p.get("chunks"), body=p["body"],
                                side=p["side"], mode=p["mode"], ownership=p["ownership"])
    if claim.family in SEQ_FAMILIES:
        return family(claim.family, p["pp"], p["microbatches"], p.get("chunks"),
                      seq_chunks=p["seq_chunks"])
    return family(claim.family, p["pp"], p["microbatches"], p.get("chunks"))


def mismatch(plan: Plan, claim: Parametric) -> str | None:
    """Why ``claim`` does not certify ``plan`` (None when it does): its laws must be the
    ones that cover its parameters now, and ``plan`` the plan they derive."""
    from ..proofs.covering import needed_laws
    from ..algebra.families import SEQ_FAMILIES
    from ..algebra.transpose import TRANSPOSE
    p = claim.mapping
    keys = {"pp", "microbatches", "chunks"} | (
        {"body", "side", "mode", "ownership"} if claim.family == TRANSPOSE else set()) | (
        {"seq_chunks"} if claim.family in SEQ_FAMILIES else set())
    if set(p) != keys:
        return f"its parameters are {sorted(p)}, the family's {sorted(keys)}"
    seq = p.get("seq_chunks", 1)  # microbatches counts samples of ``seq`` chunks
    if claim.family in SEQ_FAMILIES and (type(seq) is not int or seq != plan.seq_chunks):
        return f"its seq_chunks={seq!r} is not the plan's seq_chunks={plan.seq_chunks}"
    if (p.get("pp"), p.get("microbatches")) != (plan.num_ranks, plan.num_microbatches // seq):
        return (f"the plan has {counted(plan.num_ranks, 'rank')} and "
                f"{counted(plan.num_microbatches, 'microbatch')}, the certificate's "
                f"parameters pp={p.get('pp')} and microbatches={p.get('microbatches')}"
                + ("" if seq == 1 else f" (samples of {seq} chunks)"))
    if p["chunks"] is not None and (type(p["chunks"]) is not int or p["chunks"] < 1):
        return f"chunks={p['chunks']!r} is not a number of chunks"
    # a forward per rank, chunk and mb at least, each in a step of its own or beside a
    forwards = plan.num_ranks * (p["chunks"] or 1) * plan.num_microbatches  # backward:
    if forwards > plan.num_ops:  # checked before the term (its placement) is even built
        return (f"its parameters derive at least {counted(forwards, 'forward')}, the plan "
                f"has {counted(plan.num_ops, 'step')}")
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


def check_certificate(plan: Plan, certificate: Certificate | None,
                      comm_model: str = "rendezvous") -> None:
    """Raise ``CertificateError`` unless ``certificate`` proves all five properties of
    exactly this plan under ``comm_model`` with the current verifier version: a witness
    certificate by the plan's digest, a parametric one by its claim (``mismatch``)."""
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
