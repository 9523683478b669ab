"""``certify``: verify a plan and return its certificate, or refuse."""

from __future__ import annotations

from ..verify import verify
from ..verify.report import Certificate
from .errors import PipelineError


class NotVerifiedError(PipelineError):
    """``certify`` was given a plan the verifier did not prove; ``report`` says why."""

    def __init__(self, report) -> None:
        lines = [f"{v.property}: {v.message}" for v in report.violations]
        lines += list(report.undecided)
        super().__init__(f"the plan is {report.status}; refusing to run it"
                         + "".join(f"\n  {line}" for line in lines[:10]))
        self.report = report


def certify(plan, **verify_options) -> Certificate:
    """``verify(plan)``'s certificate; raises ``NotVerifiedError`` unless all five
    properties are proven (under rendezvous, the model the executor runs)."""
    report = verify(plan, **verify_options)
    if not report.verified or report.certificate is None:
        raise NotVerifiedError(report)
    return report.certificate
