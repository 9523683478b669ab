"""Errors the executor raises. Each message is one clear line naming the rank, the op (by
position in the rank's program) and what went wrong."""

from __future__ import annotations

from ..check import parametric
from ..verify import report


class PipelineError(RuntimeError):
    """The executor could not run a plan (bad model for the plan, a failed op). Every
    error the executor raises is one, so ``except PipelineError`` catches them all."""


class CertificateError(report.CertificateError, PipelineError):
    """The executor refused a plan: no certificate, one that does not match the plan, or
    ranks that run different plans (also a ``verify.report.CertificateError``)."""


def check_certificate(plan, certificate, comm_model: str = "rendezvous") -> None:
    """``check.parametric.check_certificate``, its refusal raised as the executor's
    ``CertificateError`` (a ``PipelineError``, and still a ``verify.report``
    ``CertificateError``)."""
    try:
        parametric.check_certificate(plan, certificate, comm_model)
    except report.CertificateError as err:
        raise CertificateError(str(err)) from None


class PayloadMismatchError(PipelineError):
    """A tensor about to be sent, or just received, differs from the plan's payload
    (shape, dtype, or which activation/gradient it is)."""


class BatchError(PipelineError, ValueError):
    """A batch that cannot be split as the plan needs (fewer rows than microbatches, no
    tensors, a field of another type); raised before any communication of the step."""


class PeerError(PipelineError):
    """A communication op failed: a peer died, closed its connection or timed out."""


__all__ = ["BatchError", "CertificateError", "PipelineError", "PayloadMismatchError",
           "PeerError"]
