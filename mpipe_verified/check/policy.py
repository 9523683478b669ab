"""What a command decides around the spine: whether an input is a standard family
instance the laws may answer (``family_params``, ``spec_family``), and how a checked
input is written down: its JSON object (``document``), its portable certificate
(``certificate_document``) and the properties a refused plan leaves unproven
(``unproved``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..algebra.families import CHUNKED, FAMILIES, LITERAL_FAMILIES, SEQ_FAMILIES, WAVED, family
from ..algebra.transpose import TRANSPOSE
from ..errors import ParameterError
from ..ir import Plan, Schedule
from ..figures import figures
from ..verify import Report
from . import parametric

if TYPE_CHECKING:
    from ..spec import Spec


def family_params(name: str, pp: int, microbatches: int, chunks: int | None,
                  body: str | None = None, term=None) -> dict:
    """A family instance's parameters as the laws read them (``check.parametric``):
    ``chunks`` only for a ``CHUNKED`` body (2 unless given); for ``transpose``, its
    ``body`` (default 1f1b) and ``term``'s side, mode and ownership; for a family of
    sequence chunks (``seq1f1b``), ``term``'s ``seq_chunks`` (``microbatches``: samples)."""
    inner = name if name != TRANSPOSE else (body or "1f1b")
    chunks = (chunks or 2) if inner in CHUNKED else None
    params = {"pp": pp, "microbatches": microbatches, "chunks": chunks}
    if name in SEQ_FAMILIES:
        params["seq_chunks"] = term.seq_chunks
    if name == TRANSPOSE:
        params.update(body=inner, side=term.side, mode=term.mode, ownership=term.ownership)
    return params


def spec_family(spec: Spec | None, target) -> tuple[str, dict] | None:
    """``(family, params)`` when ``target`` is exactly the plain standard family term
    ``spec`` names (no cost model, no sizes declared beside it: the laws' schedule is the
    term's own derivation and nothing else); else None."""
    if (spec is None or spec.cost is not None or spec.declares
            or not isinstance(target, Schedule)):
        return None
    term = spec.term
    for fam in (f for f in FAMILIES if f not in LITERAL_FAMILIES):  # no laws; built, not named
        chunks = getattr(term, "chunks", None) if fam in CHUNKED else None
        waves = getattr(term, "chunks", 0) // 2 if fam in WAVED else None
        try:
            same = family(fam, getattr(term, "ranks", 0), getattr(term, "microbatches", 0),
                          chunks, waves=waves) == term
        except (ParameterError, TypeError):
            same = False
        if same:
            return fam, {"pp": term.ranks, "microbatches": term.microbatches,
                         "chunks": chunks}
    for fam in SEQ_FAMILIES:  # m samples of S sequence chunks each
        s = getattr(term, "seq_chunks", None)
        try:
            same = family(fam, getattr(term, "ranks", 0), getattr(term, "microbatches", 0),
                          seq_chunks=s) == term
        except (ParameterError, TypeError):
            same = False
        if same:
            return fam, {"pp": term.ranks, "microbatches": term.microbatches,
                         "chunks": None, "seq_chunks": s}
    return None


def document(report: Report, name: str, lowered: bool) -> dict:
    """The JSON object of one checked input (docs/semantics.md §6): the report's, its
    peaks as figures, the input's ``name``, whether it was ``lowered``, and the
    ``proof``: op by op (``instance``), or the family's laws (``parametric``)."""
    doc = report.to_json()
    doc["peak_memory"] = figures(report.peak_memory)
    doc["source"] = name
    doc["lowered"] = lowered
    claim = report.certificate.parametric if report.certificate is not None else None
    doc["proof"] = ({"kind": parametric.INSTANCE} if claim is None else
                    {"kind": parametric.PARAMETRIC, "laws": list(claim.laws),
                     "family": claim.family, "params": claim.mapping})
    return doc


def certificate_document(report: Report, plan: Plan | None) -> dict:
    """What ``check --certificate-out`` writes of a verified report: a parametric
    certificate (its claim; ``recheck`` makes a witness for the plan) or the portable
    certificate of ``plan`` with its witness."""
    if report.certificate is not None and report.certificate.parametric is not None:
        return {"format": parametric.FORMAT, **report.certificate.to_json()}
    return report.portable_certificate(plan)


def unproved(report: Report) -> list[str]:
    """The properties ``report`` does not prove, in report order: the violated ones, or
    else the undecided ones."""
    props = report.stats.get("properties", {})
    violated = {v.property for v in report.violations}
    names = [p for p in props if p in violated] or [
        p for p, info in props.items() if info.get("status") != "proved"]
    return names or sorted(violated) or ["undecided"]
