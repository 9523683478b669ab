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


def split_tree(value, parts: int, tensor) -> list:
    """``value`` cut into ``parts``: each tensor by ``tensor(t, parts)`` (a list), tuples,
    lists and dicts item by item, None and plain values repeated."""
    if value is None or isinstance(value, _CONSTANTS):
        return [value] * parts
    if isinstance(value, torch.Tensor):
        return tensor(value, parts)
    if isinstance(value, (tuple, list)):
        cut = [split_tree(v, parts, tensor) for v in value]
        return [type(value)(p[i] for p in cut) for i in range(parts)]
    if isinstance(value, Mapping):
        cut = {k: split_tree(v, parts, tensor) for k, v in value.items()}
        return [{k: p[i] for k, p in cut.items()} for i in range(parts)]
    raise BatchError(f"batch fields must be tensors, tuples, lists or dicts of them (or "
                     f"plain values), got {type(value).__name__}")


def _by_rows(value: torch.Tensor, m: int) -> list:
    if value.shape[0] < m:
        raise BatchError(f"cannot split a batch of {value.shape[0]} rows into {m} "
                         "microbatches (each needs at least one row)")
    return list(torch.tensor_split(value, m))


def _split(value, m: int) -> list:
    return split_tree(value, m, _by_rows)


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
