"""The sums over ranks outside the plan, after its last op (docs/executor.md, "The loss
contract" and "Pipeline groups and data parallelism").

- The step's loss: the body's from the last stage's rank, a sink's from the rank that ran
  it, each microbatch's own loss beside it; summed over the pipeline (float64).
- The replicas: this rank's gradients and the loss summed over its data-parallel group
  (every p2p of the plan has completed, so this cannot interleave with the pipeline's).
- Gradients of earlier passes: set aside before a pass and added back after it, so that a
  plan's ``grads:NAME`` all-reduce (and the replicas' sum) adds only this pass's own
  contributions.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from ..ir import SINK, Collective
from ..semantics import GRADS, REPLICA, collective_segment
from . import replicas, topology
from .compute import Pass


@attrs.frozen
class Reducer:
    """The sums of plan rank ``rank`` of ``plan`` over its ``links`` (``topo``: where it
    runs), each waited for with ``wait(works, where, peers)``; tensors on ``device``."""

    plan: object
    rank: int
    topo: topology.Topology
    links: topology.Links
    wait: Callable
    device: object

    def losses(self, done: Pass, params: Sequence, broadcast_loss: bool,
               return_losses: bool):
        """The batch loss (and the per-microbatch losses): summed over the pipeline when
        ``broadcast_loss`` (or onto the last stage's rank when a sink is elsewhere); with
        replicas, the gradients of ``params`` and the loss are then summed over the
        data-parallel group (the per-microbatch losses stay this replica's). Several
        pipelines: each pipeline's last stage holds its microbatches' losses, reduced
        like a sink's onto pipeline 0's last stage's rank."""
        m = len(done.mbs)
        # several pipelines: each last stage's loss, gathered on pipeline 0's
        holder = self.plan.placement.rank_of(replicas.model_stages(self.plan) - 1)
        sinks = (any(s.side == SINK for s in self.plan.cut.segments)
                 or len(replicas.ends(self.plan)[1]) > 1)
        t = torch.zeros(m + 1, dtype=torch.float64, device=self.device)
        if done.loss is not None:
            t[0] = done.loss.double()
        for mb, value in done.mb_losses.items():
            t[mb + 1] = value.double()
        if broadcast_loss or sinks:
            if broadcast_loss:
                work = dist.all_reduce(t, group=self.links.pp, async_op=True)
            else:
                work = dist.reduce(t, self.topo.pp_ranks[holder], group=self.links.pp,
                                   async_op=True)
            self.wait([work], "the loss reduction", "its pipeline")
            has = broadcast_loss or self.rank == holder
        else:
            has = done.loss is not None
        if self.links.dp is not None:
            t[0] = self._replicas(params, float(t[0]) if has else 0.0)
        if not has:
            return (None, None) if return_losses else None
        values = t.tolist()
        return (values[0], tuple(values[1:])) if return_losses else values[0]

    def _replicas(self, params: Sequence, value: float) -> float:
        """Sum the gradients of ``params`` and ``value`` over the replicas."""
        flat = topology.flatten_grads(params).to(self.device)
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.wait([dist.all_reduce(flat, group=self.links.dp, async_op=True),
                   dist.all_reduce(total, group=self.links.dp, async_op=True)],
                  "the data-parallel all-reduce", "its replicas")
        topology.unflatten_grads(params, flat)
        return float(total.item())

    def summed(self, program, segments: dict, params: dict,
               replicated: dict | None = None) -> list:
        """The parameters whose gradients a pass sums over ranks: those of each segment
        ``program`` all-reduces (``grads:NAME``) and of each model stage it sums over its
        replicas (``replica:J``; ``replicated``: J -> module), and every one (``params``:
        by module) when there are data-parallel replicas."""
        if self.topo.replicas > 1:
            return [p for ps in params.values() for p in ps]
        tags = (collective_segment(op) for op in program
                if isinstance(op, Collective) and op.kind == "all_reduce")
        named = {(role, name) for role, name in filter(None, tags)}
        modules = [segments[name] for role, name in named if role == GRADS and name in segments]
        modules += [module for role, name in named
                    if role == REPLICA and (module := (replicated or {}).get(name)) is not None]
        return [p for module in modules for p in params[id(module)]]


def set_aside(params: Sequence) -> dict:
    """Take the gradients of ``params`` (the summed ones) out of ``.grad``, to be added back
    after the pass (``add_back``)."""
    kept = {}
    for p in params:
        if p.grad is not None and id(p) not in kept:
            kept[id(p)] = (p, p.grad)
            p.grad = None
    return kept


def add_back(kept: dict) -> None:
    """Each set-aside gradient plus what the pass summed into ``.grad``."""
    for p, grad in kept.values():
        p.grad = grad if p.grad is None else grad + p.grad
