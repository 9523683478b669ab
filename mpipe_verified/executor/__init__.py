"""Run certified plans on ``torch.distributed`` (docs/executor.md).

    plan = lower(term.derive())
    plan = with_payload_shapes(plan, infer_payload_shapes(stages, batch, m, segments))
    certificate = certify(plan)                 # verify(plan); refuses unless verified
    ex = PipelineExecutor(plan, certificate, stages=stages, segments=segments,
                          loss_fn=loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    loss = ex.step(batch)                       # once per training step
    # evaluation: a forward-only plan (family(..., forward_only=True), ForwardOnly(term))
    result = PipelineExecutor(eval_plan, certify(eval_plan), ...).eval(batch)

Batches whose shapes change between steps: ``ShapeCache(plan, stages=..., loss_fn=...,
optimizer=...).step(batch)`` (one certified plan per shape signature).

Launch with ``mpipe-run --nproc N script.py`` or ``torchrun``. Modules: ``pipeline``
(``PipelineExecutor``), ``steps`` (a rank's program compiled: reads, keeps, and the stored
activations held and freed by the semantics' memory rule), ``interpreter`` (the walker
over those steps), ``compute`` (``F``/``R``/``B``/``I``/``W``), ``chunks`` (sequence
chunks: the batch cut along its sequence, the stages' cache contract), ``transport`` (posting
and completing sends, receives and plan collectives), ``handshake`` (the start-up checks
between ranks), ``reductions`` (the sums outside the plan), ``partition`` (stages and
payload layouts), ``tree`` (structured values: leaves and paths), ``comm`` (process
group, checked messages, watchdog), ``packed`` (messages of structured payloads),
``shapes`` (``ShapeCache``), ``topology`` (pipeline and data-parallel groups),
``replicas`` (several pipelines over one model: model stages, start-up, replica sums),
``model_checks`` (models refused before any traffic), ``moves`` (activation moves:
offload/reload to host memory, lend/return to another rank), ``launch`` (``mpipe-run``).
"""

from __future__ import annotations

import importlib

# Names are imported on first use, so that ``mpipe-run`` (``executor.launch``) starts
# without importing torch or Z3.
_EXPORTS = {
    "PipelineExecutor": ".pipeline", "Evaluation": ".pipeline",
    "Batch": ".batch",
    "init_distributed": ".comm",
    "PipelineError": ".errors", "BatchError": ".errors", "PayloadMismatchError": ".errors", "PeerError": ".errors",
    "CertificateError": ".errors",
    "StageSequential": ".partition", "balanced_cuts": ".partition",
    "infer_payload_shapes": ".partition", "split_sequential": ".partition",
    "split_layers": ".partition", "measured_costs": ".partition",
    "with_payload_shapes": ".partition", "signature": ".partition",
    "ShapeCache": ".shapes",
    "certify": ".certification", "NotVerifiedError": ".certification",
    "group_adjacent_comms": ".grouping",
    "pipeline_mesh": ".topology",
    "Certificate": "..verify.report", "check_certificate": ".errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
