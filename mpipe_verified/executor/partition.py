"""Model partitioning and payload shapes.

- ``split_sequential(seq, S)`` cuts an ``nn.Sequential`` into ``S`` contiguous stages
  balanced by parameter count (the largest stage is as small as possible). Each stage is
  a ``StageSequential``: its first layer receives all of the stage's inputs (the first
  stage gets the source segments' outputs, then the batch's own body input), the rest
  are chained. Parameter names keep the original indices (``"3.fc.weight"``).
- ``with_payload_shapes(plan, fn)`` writes ``Payload.shape``/``dtype`` into every send and
  receive of a plan (``fn(payload) -> (shape, dtype)``). Do it *before* verifying: the
  certificate's digest covers shapes, so a receiver can trust the plan's sizes.
- ``infer_payload_shapes(stages, batch, m, segments)`` builds such an ``fn`` by running
  the model's forward once per distinct microbatch shape (``torch.tensor_split`` makes at
  most two), under ``no_grad``; ``meta=True`` runs it on the meta device instead (no
  memory or compute for big models, but the first call imports torch's decompositions,
  a few seconds).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import attrs
import torch
from torch import nn
from torch.func import functional_call

from ..ir import ACT, GRAD, INPUT, Group, Payload, Plan, Recv, Send
from .batch import Batch
from .comm import dtype_name


class StageSequential(nn.Sequential):
    """A slice of an ``nn.Sequential``: the first layer takes every input, the others the
    previous layer's output."""

    def forward(self, *inputs):
        layers = iter(self)
        x = next(layers)(*inputs)
        for layer in layers:
            x = layer(x)
        return x


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balanced_cuts(weights: Sequence[float], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous, non-empty groups of ``weights`` whose
    largest sum is as small as possible (ties: earlier cuts)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max over the first i layers in k groups; cut[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_sequential(seq: nn.Sequential, num_stages: int,
                     weight: Callable[[nn.Module], float] = parameter_count
                     ) -> list[StageSequential]:
    """``seq`` cut into ``num_stages`` stages balanced by ``weight`` (parameter count by
    default). The stages share the layers (no copies)."""
    named = list(seq.named_children())
    starts = balanced_cuts([float(weight(m)) for _, m in named], num_stages) + [len(named)]
    return [StageSequential(OrderedDict(named[a:b])) for a, b in zip(starts, starts[1:])]


def with_payload_shapes(plan: Plan, fn: Callable[[Payload], tuple | None]) -> Plan:
    """A copy of ``plan`` whose every ``SEND``/``RECV`` payload carries
    ``fn(payload) = (shape, dtype)`` (``dtype`` a ``torch.dtype`` or its name; None leaves
    the payload as it is). Both ends of a transfer get the same annotation because ``fn``
    sees the payload without its shape."""
    cache: dict[Payload, Payload] = {}

    def annotate(p: Payload) -> Payload:
        key = attrs.evolve(p, shape=None, dtype=None)
        if key not in cache:
            got = fn(key)
            if got is None:
                cache[key] = p
            else:
                shape, dtype = got
                name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
                cache[key] = attrs.evolve(p, shape=tuple(int(d) for d in shape), dtype=name)
        return cache[key]

    def one(op):
        if isinstance(op, Send):
            return Send(op.dst, annotate(op.payload))
        if isinstance(op, Recv):
            return Recv(op.src, annotate(op.payload))
        if isinstance(op, Group):
            return Group(tuple(one(c) for c in op.ops))
        return op

    programs = tuple(tuple(one(op) for op in prog) for prog in plan.programs)
    return attrs.evolve(plan, programs=programs)


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _call(module: nn.Module, args: tuple, meta: bool):
    if not meta:
        with torch.no_grad():
            return module(*args)
    state = {name: torch.empty_like(t, device="meta")
             for name, t in (*module.named_parameters(), *module.named_buffers())}
    return functional_call(module, state, tuple(_to_meta(a) for a in args))


def infer_payload_shapes(stages: Sequence[nn.Module], batch: Batch, num_microbatches: int,
                         segments: Mapping[str, nn.Module] | None = None, meta: bool = False
                         ) -> Callable[[Payload], tuple]:
    """``fn(payload) -> (shape, dtype)`` for ``with_payload_shapes``, from a forward pass
    of the whole model (every stage module and every source segment) over ``batch``
    split into ``num_microbatches``, once per distinct microbatch shape. ``meta=True``
    runs it on the meta device (if an op has no meta kernel, real tensors are used)."""
    try:
        return _infer(stages, batch, num_microbatches, dict(segments or {}), meta)
    except (NotImplementedError, RuntimeError):
        if not meta:
            raise
        return _infer(stages, batch, num_microbatches, dict(segments or {}), False)


def _signature(data: Batch) -> tuple:
    def sig(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype)
        if isinstance(v, (tuple, list)):
            return tuple(sig(x) for x in v)
        return None
    return (sig(data.body), tuple(sorted((k, sig(v)) for k, v in data.segments.items())))


def _infer(stages, batch, m, segments, meta) -> Callable[[Payload], tuple]:
    out: dict[tuple[str, int, int], tuple] = {}
    raw: dict[tuple[str, int], tuple] = {}
    seen: dict[tuple, int] = {}
    for mb, data in enumerate(batch.split(m)):
        signature = _signature(data)
        if signature in seen:  # same input shapes: same payload shapes
            first = seen[signature]
            for (name, k), v in list(raw.items()):
                if k == first:
                    raw[(name, mb)] = v
            for (seg, s, k), v in list(out.items()):
                if k == first:
                    out[(seg, s, mb)] = v
            continue
        seen[signature] = mb
        firsts = []
        for name, module in segments.items():
            x = data.segments[name]
            raw[(name, mb)] = (tuple(x.shape), x.dtype)
            y = _call(module, (x,), meta)
            out[(name, 0, mb)] = (tuple(y.shape), y.dtype)
            firsts.append(y)
        body = data.body if isinstance(data.body, tuple) else (
            () if data.body is None else (data.body,))
        args = (*firsts, *body)
        for s, module in enumerate(stages):
            y = _call(module, args, meta)
            out[("", s, mb)] = (tuple(y.shape), y.dtype)
            args = (y,)

    def fn(p: Payload) -> tuple:
        if p.kind == ACT:
            return out[(p.segment, p.stage, p.mb)]
        if p.kind == GRAD:
            if p.to_segment is not None:  # body stage 0 → a source: its output's shape
                return out[(p.to_segment, 0, p.mb)]
            return out[(p.segment, p.stage - 1, p.mb)]
        if p.kind == INPUT:
            return raw[(p.segment, p.mb)]
        raise ValueError(f"unknown payload kind {p.kind!r}")

    return fn
