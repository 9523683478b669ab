"""A training batch and its split into microbatches.

Every rank holds the whole batch (it is cheap to load or synthesise) and each op reads
only its microbatch's part: a source segment's ``F`` reads ``segments[name]``, the body's
first stage reads ``body`` (after the source outputs) and ``kwargs`` (as keyword
arguments), the last stage's loss reads ``target``. Tensors are split along dimension 0
with ``torch.tensor_split`` (as equal as possible; the first chunks are one larger when
the size does not divide); tuples, lists and dicts are split item by item; None and
plain Python values (``bool``, ``int``, ``float``, ``str``) go to every microbatch as
they are.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from .errors import BatchError


def _split(value, m: int) -> list:
    if value is None:
        return [None] * m
    if isinstance(value, torch.Tensor):
        if value.shape[0] < m:
            raise BatchError(f"cannot split a batch of {value.shape[0]} rows into {m} "
                             "microbatches (each needs at least one row)")
        return list(torch.tensor_split(value, m))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, m) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    if isinstance(value, Mapping):
        parts = {k: _split(v, m) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    if isinstance(value, _CONSTANTS):
        return [value] * m
    raise BatchError(f"batch fields must be tensors, tuples, lists or dicts of them (or "
                    f"plain values), got {type(value).__name__}")


_CONSTANTS = (bool, int, float, str)


def _rows(value) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    if isinstance(value, (tuple, list, Mapping)):
        for v in (value.values() if isinstance(value, Mapping) else value):
            n = _rows(v)
            if n:
                return n
    return 0


def to_device(value, device):
    """``value`` with every tensor in it (tuples, lists, mappings) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(x, device) for x in value)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


@attrs.frozen
class Batch:
    """``body``: the first body stage's own input (e.g. token ids), or None;
    ``target``: what the loss compares the last stage's output with; ``segments``: each
    source segment's input (e.g. ``{"vision": images}``); ``kwargs``: keyword inputs of
    the body's first stage (e.g. ``{"attention_mask": mask}``), split like the rest."""

    body: Any = None
    target: Any = None
    segments: Mapping[str, Any] = attrs.field(factory=dict)
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)

    def rows(self) -> int:
        for value in (self.target, self.body, *self.segments.values(), self.kwargs):
            n = _rows(value)
            if n:
                return n
        raise BatchError("the batch has no tensors")

    def split(self, m: int) -> list["Batch"]:
        bodies, targets = _split(self.body, m), _split(self.target, m)
        segs = {name: _split(v, m) for name, v in self.segments.items()}
        kwargs = _split(dict(self.kwargs), m)
        return [Batch(bodies[i], targets[i], {name: s[i] for name, s in segs.items()},
                      kwargs[i]) for i in range(m)]

    def to(self, device) -> "Batch":
        return Batch(to_device(self.body, device), to_device(self.target, device),
                     {k: to_device(v, device) for k, v in self.segments.items()},
                     to_device(dict(self.kwargs), device))
