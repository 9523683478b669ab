"""Gradient-norm clipping over a whole pipeline: the norm ``torch.nn.utils.clip_grad_norm_``
would compute in one process holding the whole model.

Each trained parameter lives on exactly one rank of a pipeline (a cut segment's on its home
rank: ``PipelineExecutor.parameters``; a model stage replicated by several pipelines is
counted on one of its holders: ``counted``), and data-parallel replicas hold equal
gradients once they are summed, so the global norm is the combination of the pipeline ranks' local
ones: the sum of ``|g|_p ** p`` (the maximum for the infinity norm) over the pipeline
group. Every rank then scales its own gradients by the same factor.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .errors import PipelineError


def local_part(grads: Sequence[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """This rank's part of the global norm, a float64 scalar: ``sum |g|_p ** p`` (the
    largest ``|g|`` for ``p = inf``). Each gradient's norm is taken in its own dtype, as
    torch's clipping does."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).double()
                         for g in grads])
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float, norm_type: float,
                   reduce: Callable[[torch.Tensor, bool], None], device,
                   error_if_nonfinite: bool = False, counted: set | None = None
                   ) -> torch.Tensor:
    """Clip ``params``' gradients in place so that the norm over every rank is at most
    ``max_norm``; returns that norm (before clipping) as torch does. ``reduce(t, is_max)``
    sums (or maxes) the float64 scalar ``t`` over the pipeline in place; every rank must
    call this at the same point, after its step's gradients are complete. ``counted``:
    the ids of the parameters this rank counts in the norm (default all; a replicated
    model stage's copies are counted on one rank: ``replicas.counted``)."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise PipelineError(f"norm_type must be > 0 (or inf), got {norm_type}")
    grads = [p.grad for p in params if p.grad is not None]
    part = local_part([p.grad for p in params if p.grad is not None
                       and (counted is None or id(p) in counted)], norm_type, device)
    reduce(part, math.isinf(norm_type))
    total = part if math.isinf(norm_type) else part.pow(1.0 / norm_type)
    value = float(total)
    if error_if_nonfinite and not math.isfinite(value):
        raise PipelineError(f"the total norm of order {norm_type} of the gradients is "
                            f"{value}: clip_grad_norm_(error_if_nonfinite=True) refuses it")
    dtype = grads[0].dtype if grads else torch.float32
    coef = float(max_norm) / (value + 1e-6)  # as torch: a NaN norm makes every gradient NaN
    if not coef < 1.0 and not math.isnan(coef):
        return torch.tensor(value, dtype=dtype, device=device)
    for g in grads:
        g.mul_(coef)
    return torch.tensor(value, dtype=dtype, device=device)
