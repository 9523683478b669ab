"""Errors the executor raises. Each message is one clear line naming the rank, the op (by
position in the rank's program) and what went wrong."""

from __future__ import annotations

from ..verify.report import CertificateError


class PipelineError(RuntimeError):
    """The executor could not run a plan (bad model for the plan, a failed op)."""


class PayloadMismatchError(PipelineError):
    """A tensor about to be sent, or just received, differs from the plan's payload
    (shape, dtype, or which activation/gradient it is)."""


class PeerError(PipelineError):
    """A communication op failed: a peer died, closed its connection or timed out."""


__all__ = ["CertificateError", "PipelineError", "PayloadMismatchError", "PeerError"]
