"""A training batch and its split into microbatches.

Every rank holds the whole batch (it is cheap to load or synthesise) and each op reads
only its microbatch's part: a source segment's ``F`` reads ``segments[name]``, the body's
first stage reads ``body`` (after the source outputs), the last stage's loss reads
``target``. Tensors are split along dimension 0 with ``torch.tensor_split`` (as equal as
possible; the first chunks are one larger when the size does not divide).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch


def _split(value, m: int) -> list:
    if value is None:
        return [None] * m
    if isinstance(value, torch.Tensor):
        if value.shape[0] < m:
            raise ValueError(f"cannot split a batch of {value.shape[0]} into {m} microbatches")
        return list(torch.tensor_split(value, m))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, m) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    raise TypeError(f"batch fields must be tensors (or tuples of tensors), got "
                    f"{type(value).__name__}")


def _rows(value) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    if isinstance(value, (tuple, list)) and value:
        return _rows(value[0])
    return 0


@attrs.frozen
class Batch:
    """``body``: the first body stage's own input (e.g. token ids), or None;
    ``target``: what the loss compares the last stage's output with; ``segments``: each
    source segment's input (e.g. ``{"vision": images}``)."""

    body: Any = None
    target: Any = None
    segments: Mapping[str, Any] = attrs.field(factory=dict)

    def rows(self) -> int:
        for value in (self.target, self.body, *self.segments.values()):
            n = _rows(value)
            if n:
                return n
        raise ValueError("the batch has no tensors")

    def split(self, m: int) -> list["Batch"]:
        bodies, targets = _split(self.body, m), _split(self.target, m)
        segs = {name: _split(v, m) for name, v in self.segments.items()}
        return [Batch(bodies[i], targets[i], {name: s[i] for name, s in segs.items()})
                for i in range(m)]

    def to(self, device) -> "Batch":
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device)
            if isinstance(v, (tuple, list)):
                return type(v)(move(x) for x in v)
            return v
        return Batch(move(self.body), move(self.target),
                     {k: move(v) for k, v in self.segments.items()})
