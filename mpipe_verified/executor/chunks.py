"""Sequence chunks (a plan's ``seq_chunks`` S > 1, docs/semantics.md §2.5): each sample is
cut along its sequence into S chunks, microbatch ``u = sample * S + j`` is chunk ``j`` of
sample ``sample`` (docs/executor.md, "Sequence chunks").

- **The batch** (``split``): rows into the plan's samples (``Batch.split``), then each
  sample's ``body``, ``target`` and ``kwargs`` tensors along dimension 1, the sequence,
  with ``torch.tensor_split`` (as equal as possible, the first chunks one longer).
- **The cache contract** (``cache_input``, ``unpack``): a stage is called once per chunk
  with the keyword ``cache``, what the sample's earlier chunks left on that stage (None
  for chunk 0), and returns ``(output, cache)``: its output and the cache extended by
  this chunk (attention's keys and values). The cache is a tensor or a tuple, list or
  dict of tensors (and None), like a stage's output; a stage that returns anything else
  is refused with one line.
- **Gradients**: chunk j's graph takes the cache it was given as leaves (its float
  tensors that required a gradient) and keeps the cache it returned as a second root.
  Its backward runs after chunk j + 1's (the semantics' ``kv_grad``), starts from the
  output's gradient and from chunk j + 1's gradient with respect to the cache it read
  (summed by autograd over every later chunk, which all read it through that chunk), and
  leaves its own cache leaves' gradient for chunk j - 1's backward.
- **The loss contract**: the default microbatch weight counts a chunk's target elements
  (its tokens) instead of its rows (``tokens``), so the weighted sum of chunk means is the
  per-token mean over whole samples, whatever the chunks' lengths; ``ignore_index=`` and
  ``loss_weight=`` weigh chunks as they weigh microbatches.

Nothing here counts memory: a chunk's cache is held by its stored activation (its graph),
which the semantics' memory rule holds until the chunk's own backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import tree
from .batch import Batch, split_tree
from .errors import BatchError, PipelineError

CACHE = "cache"  # the keyword a stage's cache is passed by
KV, KV_GRAD = "kv", "kv_grad"  # the semantics' tokens (``Chain.produces``)


def check_plan(plan) -> None:
    """Refuse, at construction, what this executor does not run with sequence chunks."""
    if plan.seq_chunks > 1 and plan.cut.segments:
        raise PipelineError(f"the plan cuts each sample into {plan.seq_chunks} sequence "
                            "chunks and also cuts segments (an encoder or a sink): the "
                            "executor runs sequence chunks of the body only")


# ------------------------------------------------------------------ the batch


def split(batch: Batch, m: int, chunks: int) -> list[Batch]:
    """``batch`` as the plan's ``m`` microbatches: ``m / chunks`` samples (row blocks),
    each cut into ``chunks`` chunks along dimension 1 (sample-major: ``u = sample *
    chunks + j``). A ``BatchError`` for what cannot be cut."""
    if batch.segments:
        raise BatchError("a batch of sequence chunks has no segment inputs (the plan cuts "
                         "no segment)")
    out = []
    for sample in batch.split(m // chunks):
        bodies, targets = _cut(sample.body, chunks), _cut(sample.target, chunks)
        kwargs = _cut(dict(sample.kwargs), chunks)
        out += [Batch(bodies[j], targets[j], {}, kwargs[j]) for j in range(chunks)]
    return out


def _cut(value, chunks: int) -> list:
    return split_tree(value, chunks, _positions)


def _positions(value: torch.Tensor, chunks: int) -> list:
    if value.dim() < 2 or value.shape[1] < chunks:
        raise BatchError(f"cannot cut a {tuple(value.shape)} tensor into {chunks} "
                         "sequence chunks along dimension 1 (each chunk needs at least "
                         "one position)")
    return list(torch.tensor_split(value, chunks, dim=1))


def tokens(target) -> float:
    """A chunk's default loss weight: its target's elements (``loss_weight`` form)."""
    leaves = [v for _, v in tree.flatten(target) if v is not None]
    return float(sum(v.numel() for v in leaves))


# ------------------------------------------------------------------ the cache contract


def unpack(y, where: str) -> tuple[Any, Any]:
    """``(output, cache)`` of what a stage returned, or a one-line ``PipelineError``."""
    if type(y) not in (tuple, list) or len(y) != 2:
        what = (f"a {type(y).__name__} of {len(y)}" if type(y) in (tuple, list)
                else f"a {type(y).__name__}")
        raise PipelineError(f"{where} returned {what}; under sequence chunks a stage is "
                            f"called with {CACHE}= (what its sample's earlier chunks left "
                            "on it, None for the first) and returns (output, cache), the "
                            "cache extended by this chunk (docs/executor.md, \"Sequence "
                            "chunks\")")
    output, cache = y
    try:
        leaves = [v for _, v in tree.flatten(cache) if v is not None]
    except TypeError as err:
        raise PipelineError(f"{where} returned a cache that cannot be kept: {err}") from None
    if not leaves:
        raise PipelineError(f"{where} returned no cache (None): under sequence chunks a "
                            "stage returns (output, cache), the keys and values later "
                            "chunks of its sample read (docs/executor.md, \"Sequence "
                            "chunks\")")
    return output, cache


def cache_input(kept, graph: bool) -> tuple[Any, list, tuple]:
    """``(the cache a chunk's forward is called with, its tensors that take a gradient,
    their paths)`` from the previous chunk's kept cache (None for a sample's first
    chunk): a float tensor that required a gradient becomes a leaf that does, when the
    forward builds a graph."""
    if kept is None:
        return None, [], ()
    items, leaves, paths = [], [], []
    for p, v in tree.flatten(kept):
        if v is not None:
            wanted = graph and tree.is_float(v) and v.requires_grad
            v = v.detach()
            if wanted:
                v.requires_grad_(True)
                leaves.append(v)
                paths.append(p)
        items.append((p, v))
    return tree.unflatten(items), leaves, tuple(paths)


def cache_grad(paths: tuple, grads) -> tree.Flat:
    """The gradient with respect to a chunk's cache input (its ``kv_grad``), by path."""
    return tree.Flat(tuple(zip(paths, grads)))


class OutputOnly(nn.Module):
    """A first stage as the batch check calls it (``batch_fit``): with ``cache=None`` (a
    chunk's output has its shape whatever came before it), returning its output only."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        return unpack(self.stage(*args, **kwargs, **{CACHE: None}), "stage 0")[0]


__all__ = ["CACHE", "OutputOnly", "cache_grad", "cache_input", "check_plan", "split",
           "tokens", "unpack"]
