"""``ShapeCache``: training on batches whose shapes change between steps (a sequence
length, an image-token count) with one set of stages and one optimizer.

A plan's payload layouts are part of what is certified, so each distinct layout needs
its own certified plan. ``ShapeCache`` keys them by the batch's shape signature
(``partition.signature``: every tensor's shape and dtype, the target's left out): the
first batch of a signature has its layouts inferred (``infer_payload_shapes``), the plan
annotated and certified (``certify``, once per signature) and a ``PipelineExecutor``
built for it; later batches of that signature reuse it. All executors share the stage
modules and one optimizer (built once, over the parameters every plan's executor
trains: the plans differ only in layouts, so in nothing that places parameters).

Every rank of the pipeline must pass batches of the same shapes at the same step: each
derives its plans itself, deterministically. A new plan's first run compares the plan
digests of all ranks (the executor's handshake): ranks that all meet a new signature but
derive different plans are refused (``CertificateError``); a rank that reuses a plan
while another builds a new one is not in that handshake, and both fail when their waits
time out (``PeerError``).
"""

from __future__ import annotations

import collections
from typing import Callable, Mapping, Sequence

import attrs
from torch import nn

from ..ir import Plan
from .certification import certify as certify_plan
from .batch import Batch
from .errors import PipelineError
from .pipeline import PipelineExecutor
from .partition import infer_payload_shapes, signature, with_payload_shapes


class ShapeCache:
    """Certified plans of ``plan`` by the shape signature of the batch, run over one set of
    ``stages`` (all of the body's stage modules, in stage order: every rank infers the
    layouts from the whole model) and one optimizer.

    ``certify(plan) -> Certificate`` verifies a newly annotated plan (default
    ``executor.certify``); ``meta``: infer layouts on the meta device; ``max_plans``: the
    most executors kept (least recently used dropped first); ``options``: passed to every
    ``PipelineExecutor`` (``check_messages``, ``timeout``, ...)."""

    def __init__(self, plan: Plan, *, stages: Sequence[nn.Module], loss_fn: Callable,
                 segments: Mapping[str, nn.Module] | None = None,
                 optimizer: Callable | None = None, certify: Callable = certify_plan,
                 meta: bool = False, max_plans: int = 32, **options) -> None:
        if max_plans < 1:
            raise PipelineError(f"max_plans must be at least 1, got {max_plans}")
        self.plan, self.stages = plan, list(stages)
        self.segments = dict(segments or {})
        self.loss_fn, self.certify, self.meta = loss_fn, certify, meta
        self.max_plans, self.options = max_plans, options
        self._make_optimizer = optimizer
        self.optimizer = None
        self._executors: collections.OrderedDict = collections.OrderedDict()
        self.certified = 0  # plans certified so far (one per signature seen)

    def _shared_optimizer(self, params):
        if self.optimizer is None:
            self.optimizer = self._make_optimizer(params)
        return self.optimizer

    def executor(self, batch: Batch) -> PipelineExecutor:
        """The executor of ``batch``'s signature (annotated, certified and built on first
        use)."""
        key = signature(attrs.evolve(batch, target=None))
        ex = self._executors.get(key)
        if ex is not None:
            self._executors.move_to_end(key)
            return ex
        m = self.plan.num_microbatches
        plan = with_payload_shapes(self.plan, infer_payload_shapes(
            self.stages, batch, m, self.segments, self.meta, self.plan.seq_chunks))
        certificate = self.certify(plan)
        self.certified += 1
        ex = PipelineExecutor(
            plan, certificate, stages=self.stages, segments=self.segments,
            loss_fn=self.loss_fn, **self.options,
            optimizer=None if self._make_optimizer is None else self._shared_optimizer)
        self._executors[key] = ex
        while len(self._executors) > self.max_plans:
            self._executors.popitem(last=False)
        return ex

    def step(self, batch: Batch, broadcast_loss: bool = True) -> float | None:
        """``PipelineExecutor.step`` with the executor of ``batch``'s signature."""
        return self.executor(batch).step(batch, broadcast_loss)

    def run(self, batch: Batch, broadcast_loss: bool = True) -> float | None:
        """``PipelineExecutor.run`` with the executor of ``batch``'s signature."""
        return self.executor(batch).run(batch, broadcast_loss)

    def close(self) -> None:
        """Leave the process group (``PipelineExecutor.close``; once is enough)."""
        for ex in self._executors.values():
            ex.close()
