"""``certify``: verify a plan and return its certificate, or refuse."""

from __future__ import annotations

from ..check import check
from ..question import Question
from ..semantics import RENDEZVOUS, UNIT_MEMORY, MemoryModel
from ..verify import question_of
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


def certify(plan, memory_limit=None, comm_model: str = RENDEZVOUS,
            memory_model: MemoryModel = UNIT_MEMORY, rlimit: int | None = None,
            question: Question | None = None) -> Certificate:
    """The certificate of ``plan`` checked (``check.check``, on this core: the caller
    may run threads of its own) for ``question``, else for the one ``verify`` asks with
    the other arguments; raises ``NotVerifiedError`` unless all five properties are
    proven (under rendezvous, the model the executor runs)."""
    question = question or question_of(memory_limit, comm_model, memory_model)
    report = check(plan, question, rlimit=rlimit, split=False).report
    if not report.verified or report.certificate is None:
        raise NotVerifiedError(report)
    return report.certificate
