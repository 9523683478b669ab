"""The loss contract: how each microbatch's loss is weighted so that a pipelined step equals
one process running the whole batch.

``loss_fn(output, target)`` returns one floating-point scalar tensor per microbatch: the
microbatch's mean loss (``loss_reduction="mean"``) or its sum (``"sum"``). With
``"mean"`` each microbatch's loss is weighted by its share of what the whole batch's mean
averages over, so the weighted sum over microbatches (and replicas) is the whole batch's
mean loss and its gradient:

- rows (the default): the microbatch's rows over the batch's rows;
- valid targets (``ignore_index=N``): the target elements that are not ``N`` in the
  microbatch over those of the whole batch (what ``cross_entropy(..., ignore_index=N)``
  averages over);
- any count (``loss_weight=fn``): ``fn(target)`` of the microbatch over the sum of ``fn``
  over every microbatch of the whole batch (e.g. the tokens a loss mask keeps).

With ``"sum"`` every weight is 1. A microbatch of weight 0 (all padding) adds nothing:
not its loss (a mean over no target is NaN), and no gradient (its backward starts from a
zero that does not pass through the loss). Weights are computed on every rank from the
whole batch, which every rank holds: no communication.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import tree
from .batch import Batch
from .errors import PipelineError

REDUCTIONS = ("mean", "sum")


def check_options(reduction: str, ignore_index: int | None, loss_weight: Callable | None
                  ) -> None:
    """Refuse option combinations that have no meaning (a ``PipelineError``)."""
    if reduction not in REDUCTIONS:
        raise PipelineError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")
    if ignore_index is not None and loss_weight is not None:
        raise PipelineError("give ignore_index= or loss_weight=, not both")
    if reduction == "sum" and (ignore_index is not None or loss_weight is not None):
        raise PipelineError("ignore_index= and loss_weight= weight a mean loss; with "
                            "loss_reduction='sum' every microbatch has weight 1")
    if ignore_index is not None and type(ignore_index) is not int:
        raise PipelineError(f"ignore_index must be an int, got {ignore_index!r}")


def count_of(mb: Batch, ignore_index: int | None, loss_weight: Callable | None) -> float:
    """What microbatch ``mb``'s mean loss averages over: its rows, its valid targets, or
    ``loss_weight(target)`` (rows when the batch has no target: an evaluation without a
    loss)."""
    if mb.target is None:
        ignore_index = loss_weight = None
    if loss_weight is not None:
        value = loss_weight(mb.target)
        value = float(value.sum()) if isinstance(value, torch.Tensor) else float(value)
        if not value >= 0:  # also NaN
            raise PipelineError(f"loss_weight returned {value} for a microbatch; it must "
                                "be a count >= 0")
        return value
    if ignore_index is not None:
        if not isinstance(mb.target, torch.Tensor):
            raise PipelineError("ignore_index= needs the batch's target to be one tensor "
                                f"(it is a {type(mb.target).__name__}); use loss_weight=fn "
                                "to count a structured target")
        return float((mb.target != ignore_index).sum())
    try:
        return float(mb.rows())
    except ValueError:
        return 1.0


def microbatch_weights(blocks: Sequence[Sequence[Batch]], mine: int, reduction: str,
                       ignore_index: int | None = None,
                       loss_weight: Callable | None = None) -> list[float]:
    """The weights of replica ``mine``'s microbatches: ``blocks[i]`` are replica ``i``'s
    microbatches; the weights of all of them sum to 1 (``"mean"``; 0 if nothing counts)."""
    if reduction == "sum":
        return [1.0] * len(blocks[mine])
    counts = [[count_of(mb, ignore_index, loss_weight) for mb in block] for block in blocks]
    total = sum(sum(c) for c in counts)
    return [c / total if total else 0.0 for c in counts[mine]]


def checked(loss, who: str, rank: int):
    """``loss`` if it keeps the contract (one floating-point scalar tensor), else a
    one-line ``PipelineError`` naming ``who`` (``loss_fn`` or a sink's loss)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.reshape(())
    if isinstance(loss, torch.Tensor):
        what = f"a {tuple(loss.shape)} {str(loss.dtype).removeprefix('torch.')} tensor"
    else:
        what = f"a {type(loss).__name__}"
    raise PipelineError(
        f"rank {rank}: {who} returned {what}; it must return one floating-point scalar "
        "tensor: the microbatch's mean loss (loss_reduction='mean'; reduce per-token "
        "losses in the loss function, and weight microbatches by valid targets with "
        "ignore_index= or loss_weight=) or its sum (loss_reduction='sum')")


def zero_root(output, loss: torch.Tensor):
    """A zero that depends on ``output`` (every float leaf that requires a gradient): a
    backward from it gives every parameter and input exactly zero gradient without
    passing through the loss (whose own backward may be NaN, e.g. a mean over no
    target). An output that is no tree of tensors (a last stage may return any object)
    falls back to the loss times zero."""
    try:
        leaves = [v for _, v in tree.flatten(output)
                  if v is not None and v.is_floating_point() and v.requires_grad]
    except TypeError:
        return loss.nan_to_num(0.0, 0.0, 0.0) * 0.0
    if not leaves:
        return loss.detach() * 0.0
    return sum((v * 0).sum() for v in leaves)


def weighted(loss: torch.Tensor, weight: float, output) -> tuple:
    """``(what the backward starts from, the loss in float64, its weighted share of the
    step's loss in float64)``: the step's loss is accumulated in float64 whatever the
    loss's dtype (a bf16 loss summed in bf16 loses the third digit)."""
    own = loss.detach().double()
    if weight == 0:
        return zero_root(output, loss), own, torch.zeros_like(own)
    return loss * weight, own, own * weight
