"""Model partitioning and payload shapes.

- ``split_sequential(seq, S)`` cuts an ``nn.Sequential`` into ``S`` contiguous stages
  balanced by parameter count (the largest stage is as small as possible). Each stage is
  a ``StageSequential``: its first layer receives all of the stage's inputs (the first
  stage gets the source segments' outputs, then the batch's own body input, and the
  batch's keyword inputs), the rest are chained. Parameter names keep the original
  indices (``"3.fc.weight"``).
- ``split_layers(layers, S, costs=None, boundaries=None)`` does the same for any list of
  layers (a model that is not an ``nn.Sequential``: ``[model.embed, *model.blocks,
  model.head]``, or ``(name, module)`` pairs): balanced by the ``costs`` given (one number
  per layer; ``measured_costs`` times each layer's forward and backward on an example
  input), by parameter count without them, or cut before the layers named in
  ``boundaries``.
- ``with_payload_shapes(plan, fn)`` writes the layout into every send and receive of a
  plan: ``fn(payload)`` returns ``(shape, dtype)`` (one tensor: ``Payload.shape``/``dtype``)
  or a tuple of ``ir.Leaf`` (a structure: ``Payload.leaves``). Do it *before* verifying:
  the certificate's digest covers layouts, so a receiver can trust the plan's sizes.
- ``infer_payload_shapes(stages, batch, m, segments)`` builds such an ``fn`` by running
  the model's forward once per distinct microbatch shape (``torch.tensor_split`` makes at
  most two), one stage at a time (each stage's graph dropped before the next runs);
  ``meta=True`` runs it on the meta device instead (no memory or compute for big models,
  but the first call imports torch's decompositions, a few seconds). A stage output that
  is one tensor is annotated as one tensor, its gradient alike (an integer or bool tensor
  takes no gradient: its gradient payload is ``leaves=()``); any other output (tuples,
  lists, dicts, None) is annotated leaf by leaf, and its gradient has a leaf for each
  float leaf that requires a gradient where it is produced. That forward leaves no trace
  (``model_state_kept``): every module given (stages and segments, with all their
  submodules) keeps its buffers (BatchNorm statistics, counters), parameters, ``.grad``
  and ``training`` flag, and the random number generators (CPU, and the CUDA devices in
  use) their state, bitwise, whether it ran on real or meta tensors, fell back from meta
  to real, or raised; so it can run in the middle of training (``ShapeCache``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import attrs
import torch
from torch import nn
from torch.func import functional_call

from ..ir import ACT, GRAD, INPUT, RANK_MOVES, Leaf, Payload, Plan, map_payloads
from . import chunks, replicas, tree
from .batch import Batch, to_device
from .comm import dtype_name


class StageSequential(nn.Sequential):
    """A slice of an ``nn.Sequential``: the first layer takes every input, the others the
    previous layer's output."""

    def forward(self, *inputs, **kwargs):
        layers = iter(self)
        x = next(layers)(*inputs, **kwargs)
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


def _named_layers(layers) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` per layer: pairs as given, a module's children by name, else
    each module by its index."""
    if isinstance(layers, nn.Module):
        return list(layers.named_children())
    items = list(layers)
    if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], nn.Module)
           for x in items):
        return [(str(n), m) for n, m in items]
    if not all(isinstance(x, nn.Module) for x in items):
        raise TypeError("layers must be modules, (name, module) pairs, or a module whose "
                        "children are the layers")
    return [(str(i), m) for i, m in enumerate(items)]


def split_layers(layers, num_stages: int, costs: Sequence[float] | None = None,
                 boundaries: Sequence[str] | None = None) -> list[StageSequential]:
    """``layers`` (modules in model order, ``(name, module)`` pairs, or a module whose
    children they are) cut into ``num_stages`` contiguous stages, each a
    ``StageSequential`` sharing the layers: before each layer named in ``boundaries``
    (``num_stages - 1`` names, in order), else balanced so that the largest stage's sum
    of ``costs`` (one per layer; parameter count without them) is as small as possible.
    Each stage's first layer takes every input of the stage, the others chain."""
    named = _named_layers(layers)
    if boundaries is not None:
        names = [n for n, _ in named]
        if len(boundaries) != num_stages - 1 or any(b not in names for b in boundaries):
            raise ValueError(f"boundaries must name {num_stages - 1} of the layers "
                             f"{names}, in order; got {list(boundaries)}")
        starts = [0, *(names.index(b) for b in boundaries)]
        if starts != sorted(set(starts)):
            raise ValueError(f"boundaries {list(boundaries)} are not in layer order, or "
                             "one names the first layer")
    else:
        weights = ([float(parameter_count(m)) for _, m in named] if costs is None
                   else [float(c) for c in costs])
        if len(weights) != len(named):
            raise ValueError(f"{len(weights)} costs for {len(named)} layers")
        starts = balanced_cuts(weights, num_stages)
    starts.append(len(named))
    return [StageSequential(OrderedDict(named[a:b])) for a, b in zip(starts, starts[1:])]


def measured_costs(layers, *inputs, repeats: int = 3, **kwargs) -> list[float]:
    """Seconds each layer takes for a forward and a backward on ``inputs`` (the first
    layer's; each later layer gets the one before's output), the median of ``repeats``
    runs after one warm-up; the layers, their buffers and the random generators are left
    as they were. For ``split_layers(..., costs=...)``."""
    import time

    named = _named_layers(layers)
    modules = [m for _, m in named]
    runs: list[list[float]] = [[] for _ in modules]
    with model_state_kept(modules, inputs, kwargs):
        for attempt in range(repeats + 1):
            args, kw = inputs, kwargs
            for k, module in enumerate(modules):
                start = time.perf_counter()
                with torch.enable_grad():
                    y = module(*args, **kw)
                    outs = [v for _, v in tree.flatten(y)
                            if v is not None and v.is_floating_point() and v.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(v) for v in outs])
                if attempt:
                    runs[k].append(time.perf_counter() - start)
                args, kw = (tree.detach(y, keep_flag=True),), {}
    return [sorted(r)[len(r) // 2] for r in runs]


def with_payload_shapes(plan: Plan, fn: Callable[[Payload], tuple | None]) -> Plan:
    """A copy of ``plan`` whose every ``SEND``/``RECV`` payload carries ``fn(payload)``:
    ``(shape, dtype)`` (``dtype`` a ``torch.dtype`` or its name) for one tensor, a tuple
    of ``ir.Leaf`` for a structure (``()``: nothing travels), None to leave the payload as
    it is. Both ends of a transfer get the same annotation because ``fn`` sees the
    payload without its layout. With several pipelines ``fn`` sees the payload of the
    model stage a plan stage replicates (``replicas.payload_key``): ``fn`` is inferred
    from the model's stages."""
    cache: dict[Payload, Payload] = {}
    model = replicas.payload_key(plan)

    def annotate(p: Payload) -> Payload:
        key = attrs.evolve(p, shape=None, dtype=None, leaves=None)
        if key not in cache:
            got = fn(model(key))
            if got is None:
                cache[key] = p
            elif all(type(x) is Leaf for x in got):
                cache[key] = attrs.evolve(key, leaves=tuple(got))
            else:
                shape, dtype = got
                name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
                cache[key] = attrs.evolve(key, shape=tuple(int(d) for d in shape), dtype=name)
        return cache[key]

    return map_payloads(plan, annotate)


def _cuda_devices(*values) -> list[int]:
    """Indices of the CUDA devices holding a tensor of ``values`` (tensors, batches, and
    tuples, lists and mappings of them), in order."""
    found: set[int] = set()

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            if v.is_cuda:
                found.add(v.device.index)
        elif isinstance(v, Batch):
            walk((v.body, v.target, dict(v.segments), dict(v.kwargs)))
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x)
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x)

    walk(values)
    return sorted(found)


@contextlib.contextmanager
def model_state_kept(modules: Iterable[nn.Module], *values) -> Iterator[None]:
    """Whatever the body does to ``modules`` (each with all its submodules) and to the
    random number generators, they are bitwise as before when it ends, by return or by
    exception: every buffer slot holds its original object (one the body replaced, set to
    None, or filled from None is put back; one it added is removed) with its original
    value (copied before, copied back); every parameter slot its original parameter, with
    its original ``.grad`` object (None stays None); every module its ``training`` flag;
    the CPU generator and the CUDA generators of the devices that hold the modules' tensors
    or ``values``' (``torch.random.fork_rng``) their state. Parameter and ``.grad``
    values are not copied: a forward does not write them in place."""
    mods = list({id(m): m for top in modules for m in top.modules()}.values())
    buffers = [(m, dict(m._buffers), set(m._non_persistent_buffers_set)) for m in mods]
    params = [(m, dict(m._parameters)) for m in mods]
    grads = {id(p): (p, p.grad) for m in mods for p in m._parameters.values()
             if p is not None}
    training = [(m, m.training) for m in mods]
    copies = {id(b): (b, b.detach().clone()) for m in mods for b in m._buffers.values()
              if b is not None}
    try:
        devices = _cuda_devices([p for p, _ in grads.values()],
                                [b for b, _ in copies.values()], values)
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, slots, non_persistent in buffers:
            m._buffers.clear()
            m._buffers.update(slots)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)
        for m, slots in params:
            m._parameters.clear()
            m._parameters.update(slots)
        for p, grad in grads.values():
            if p.grad is not grad:
                p.grad = grad
        for m, flag in training:
            m.training = flag
        with torch.no_grad():
            for b, copy in copies.values():
                b.copy_(copy)


def _call(module: nn.Module, args: tuple, kwargs: dict, meta: bool):
    """``module(*args, **kwargs)`` with gradients on (to see which outputs require one),
    the result detached (its graph dropped, the flags kept)."""
    with torch.enable_grad():
        if not meta:
            return tree.detach(module(*args, **kwargs), keep_flag=True)
        state = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                 for name, t in module.named_parameters()}
        state.update({name: torch.empty_like(t, device="meta")
                      for name, t in module.named_buffers()})
        return tree.detach(functional_call(module, state, to_device(tuple(args), "meta"),
                                           to_device(dict(kwargs), "meta")), keep_flag=True)


def infer_payload_shapes(stages: Sequence[nn.Module], batch: Batch, num_microbatches: int,
                         segments: Mapping[str, nn.Module] | None = None, meta: bool = False,
                         seq_chunks: int = 1) -> Callable[[Payload], tuple]:
    """``fn(payload) -> (shape, dtype)`` or ``Leaf`` tuple for ``with_payload_shapes``,
    from a forward pass of the whole model (every stage module and every source segment)
    over ``batch`` split into ``num_microbatches``, once per distinct microbatch shape.
    ``meta=True`` runs it on the meta device (if an op has no meta kernel, real tensors
    are used). The modules and the random number generators are left bitwise as they were
    (buffers, parameters, ``.grad``, ``training`` flags, CPU and CUDA generator states;
    see ``model_state_kept``), also when the forward raises. ``seq_chunks`` S > 1: the
    microbatches are sequence chunks (``chunks.split``), each stage called with the cache
    its sample's previous chunk left (``chunks``: a stage that breaks that contract is a
    ``PipelineError``)."""
    segments = dict(segments or {})
    modules = [*stages, *segments.values()]
    try:
        with model_state_kept(modules, batch):
            return _infer(stages, batch, num_microbatches, segments, meta, seq_chunks)
    except (NotImplementedError, RuntimeError):
        if not meta:
            raise
        with model_state_kept(modules, batch):
            return _infer(stages, batch, num_microbatches, segments, False, seq_chunks)


def signature(value) -> tuple:
    """The shapes and dtypes of every tensor in ``value`` (a batch, or any nest of
    tuples, lists, dicts; other leaves by value): equal signatures, equal layouts."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, Batch):
        return ("batch", signature(value.body), signature(value.target),
                signature(dict(value.segments)), signature(dict(value.kwargs)))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(signature(x) for x in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, signature(v)) for k, v in value.items()))
    return ("value", repr(value))


@attrs.frozen
class _Annotation:
    """A value's payload layouts: its own (``act``) and its gradient's (``grad``); or
    ``error``, raised when a payload of it is asked for (a last stage's output may be
    anything: it is never sent)."""

    act: tuple = ()
    grad: tuple = ()
    error: str | None = None


def _annotate(y) -> _Annotation:
    if isinstance(y, torch.Tensor):
        grad = (tuple(y.shape), y.dtype) if tree.is_float(y) else ()
        return _Annotation((tuple(y.shape), y.dtype), grad)
    try:
        return _Annotation(tree.layout(y), tree.grad_layout(y))
    except TypeError as err:
        return _Annotation(error=str(err))


def _infer(stages, batch, m, segments, meta, seq_chunks=1) -> Callable[[Payload], tuple]:
    out: dict[tuple[str, int, int], _Annotation] = {}
    raw: dict[tuple[str, int], tuple] = {}
    seen: dict[tuple, int] = {}
    caches: dict[int, object] = {}  # sequence chunks: stage -> its sample's cache so far
    mbs = batch.split(m) if seq_chunks == 1 else chunks.split(batch, m, seq_chunks)
    for mb, data in enumerate(mbs):
        sig = signature(attrs.evolve(data, target=None))
        if seq_chunks == 1 and sig in seen:  # same input shapes: same payload shapes
            first = seen[sig]
            for (name, k), v in list(raw.items()):
                if k == first:
                    raw[(name, mb)] = v
            for (seg, s, k), v in list(out.items()):
                if k == first:
                    out[(seg, s, mb)] = v
            continue
        seen[sig] = mb
        firsts = []
        for name, module in segments.items():
            x = data.segments[name]
            raw[(name, mb)] = (tuple(x.shape), x.dtype)
            y = _call(module, (x,), {}, meta)
            out[(name, 0, mb)] = _annotate(y)
            firsts.append(y)
        body = data.body if isinstance(data.body, tuple) else (
            () if data.body is None else (data.body,))
        args, kwargs = (*firsts, *body), dict(data.kwargs)
        for s, module in enumerate(stages):
            if seq_chunks > 1:
                kwargs = {**kwargs, chunks.CACHE: caches.get(s) if mb % seq_chunks else None}
                y, caches[s] = chunks.unpack(_call(module, args, kwargs, meta), f"stage {s}")
            else:
                y = _call(module, args, kwargs, meta)
            out[("", s, mb)] = _annotate(y)
            args, kwargs = (y,), {}

    def pick(key: tuple, field: str, p: Payload) -> tuple:
        got = out[key]
        if got.error is not None:
            raise TypeError(f"{p.kind} of {p.segment or 'stage'} {p.stage} mb {p.mb}: "
                            f"{got.error}")
        return getattr(got, field)

    def fn(p: Payload) -> tuple:
        if p.kind == ACT:
            return pick((p.segment, p.stage, p.mb), "act", p)
        if p.kind == GRAD:
            if p.to_segment is not None:  # body stage 0 → a source: its output's shape
                return pick((p.to_segment, 0, p.mb), "grad", p)
            return pick((p.segment, p.stage - 1, p.mb), "grad", p)
        if p.kind == INPUT:
            return raw[(p.segment, p.mb)]
        if p.kind in RANK_MOVES:  # a stored activation: its layout travels with it (moves)
            return None
        raise ValueError(f"unknown payload kind {p.kind!r}")

    return fn
