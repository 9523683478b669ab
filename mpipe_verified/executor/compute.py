"""The computes of one rank (``F``, ``R``, ``B``, ``I``, ``W``) on its stage and segment
modules (docs/executor.md, "What the interpreter does").

- ``F``: the stage (or cut segment) forward; at the body's last stage (or a sink) also the
  loss, weighted so that the sum over microbatches is the whole batch's loss
  (``loss_reduction="mean"``: each microbatch's mean weighted by its share of the rows).
  It builds a graph only when its step holds the stored activation (``Step.holds``).
- ``B``: backward through the stored graph (``torch.autograd.backward`` into the stage's
  parameters and input). ``I``: input gradient only, keeping the gradient that reaches
  each parameter node; ``W``: the weight gradients from those nodes (``split_backward``:
  no second traversal).
- ``R``: re-run a segment's forward from its shipped input, under the RNG state that
  forward ran with (``comm.ShippedInput``), to rebuild the graph a following ``B`` needs.

Cut segments: the body's first stage is called with every source's output (in cut
order), then the batch's body input; its input gradient is one value per source
(``PerSource``). A sink is called with the body's last output, detached, and adds its own
loss. Values: a stage's output is one tensor or a structure (tuples, lists, dicts of
tensors and None; ``tree``). A stage's input takes a gradient in its float leaves only:
one float tensor always, a structure's float leaves where the plan ships a gradient back
(or, from a stage on this rank, where they required one); a backward starts from every
output leaf that received a gradient.

Sequence chunks (``chunks``): a stage is also given ``cache=`` (the ``kv`` of its
sample's previous chunk) and returns ``(output, cache)``; a backward also starts from the
cache it returned (with the next chunk's ``kv_grad``) and leaves its cache input's
gradient as its own ``kv_grad``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Sequence

import attrs
import torch
from torch import nn

from ..ir import (BACKWARD, BODY, FORWARD, GRAD, INPUT_GRAD, RECOMPUTE, SINK, SOURCE,
                  WEIGHT_GRAD, Compute, Recv, Send, p2p_of)
from ..semantics import Chain, produces
from . import buffers, chunks, comm, loss, moves, replicas, split_backward, tree
from .batch import Batch
from .errors import PipelineError
from .stage_setup import StageSetup
from .steps import Step

MISSING = object()


@attrs.frozen
class Saved:
    """What a forward keeps for its backward: the input tensors whose gradient the plan
    ships back (``leaves``), the graph's output (the scaled loss at the last stage or a
    sink; else the stage's output value, a tensor or a structure) and the parameters that
    receive weight gradients. ``parts``: per input that takes a gradient, in order, ``(its
    segment, how many of leaves are its, their paths)`` (paths None: the input is one
    tensor). The backward's input gradient is the first part's, or, at the body's first
    stage under a cut (``per_source``), one value per source (``PerSource``)."""

    leaves: tuple
    output: object
    params: tuple
    parts: tuple = ()
    per_source: bool = False
    moves: object = None  # a ``moves.Activation`` when the plan moves this activation
    cache_paths: tuple = ()  # sequence chunks: the cache input's leaves, last in leaves
    cache: object = None  # sequence chunks: the cache this chunk returned (``chunks``)


class PerSource(dict):
    """The body's first-stage input gradient (one semantics token, ``grad`` of body stage
    0) as a value: source name -> that source's part. Where it is received, each part
    arrives by its own ``RECV`` (possibly still in flight) and is merged in; an op reads
    only its own part."""


@attrs.define(eq=False)
class Pass:
    """One pass over a batch: this replica's microbatches (on the device), their loss
    weights (``row_weights``: by rows, for sinks), whether it evaluates, this replica's
    first microbatch in the whole batch (``base``), the buffer copies that record updates
    (none in eval); and what it collects: the weighted loss, each microbatch's own loss,
    and in eval the outputs (``outputs[segment][mb]``, the body's under ``""``)."""

    mbs: list
    weights: Sequence
    row_weights: Sequence
    evaluating: bool
    base: int
    copies: Mapping
    device: torch.device | None
    loss: object = None
    mb_losses: dict = attrs.field(factory=dict)
    outputs: dict = attrs.field(factory=dict)


class StageCompute:
    """Runs the computes of rank ``rank``'s ``program`` on its ``stages`` and ``segments``.
    ``params[id(module)]``: the trainable parameters (fixed when the executor was built);
    ``direct[id(module)]``: whether ``I`` may use the direct form (``split_backward``)."""

    def __init__(self, rank: int, chain: Chain, program, stages: Mapping[int, nn.Module],
                 segments: Mapping[str, nn.Module], params: Mapping[int, tuple],
                 setup: StageSetup, loss_fn: Callable,
                 segment_loss_fns: Mapping[str, Callable],
                 mover: moves.Mover | None = None) -> None:
        self.rank, self.chain = rank, chain
        self.mover = mover  # activation moves (docs/semantics.md §2.10)
        self.moved = moves.moved_here(chain.offloaded, rank)
        self.chunked = chain.seq_chunks > 1
        # each pipeline's first stage reads the batch, its last computes the loss
        self.firsts, self.lasts = replicas.ends(chain)
        self.at_cut = any(x.side == SOURCE for x in chain.cut.segments)
        self.stages, self.segments, self.params = stages, segments, params
        self.direct = {id(m): split_backward.direct_allowed(m)
                       for m in (*stages.values(), *segments.values())}
        self.setup, self.loss_fn, self.segment_loss_fns = setup, loss_fn, segment_loss_fns
        self.received = frozenset(t for op in program for c in p2p_of(op)
                                  if type(c) is Recv for t in produces(c))
        self.grad_paths = {  # (segment, stage, mb, to_segment) of a sent gradient -> paths
            (c.payload.segment, c.payload.stage, c.payload.mb, c.payload.to_segment):
            frozenset(x.path for x in c.payload.leaves)
            for op in program for c in p2p_of(op)
            if type(c) is Send and c.payload.kind == GRAD and c.payload.leaves is not None}

    def run(self, c: Compute, needs: tuple, step: Step, store: Mapping, p: Pass) -> dict:
        """Run ``c`` (reading its ``needs`` from ``store``); return the tokens it produces."""
        if c.kind == FORWARD:
            return self._forward(c, needs, step, store, p)
        if c.kind == RECOMPUTE:
            return self._recompute(c, _needed(needs, "input", store), p.device)
        if c.kind == WEIGHT_GRAD:
            split_backward.backward_weight(_needed(needs, "wgrad_ready", store))
            return {produces(c)[0]: True}
        saved, g = _needed(needs, "stored", store), _needed(needs, "grad", store)
        if saved.moves is not None:
            saved.moves.ready()  # a reload still copying (CUDA): wait for it
        if c.kind == BACKWARD:
            return self._backward(c, saved, self._part(g, c), needs, store)
        if c.kind == INPUT_GRAD:
            return self._input_grad(c, saved, self._part(g, c), needs, store)
        raise PipelineError(f"rank {self.rank}: unknown compute kind in {c}")

    def module(self, c: Compute) -> nn.Module:
        return self.segments[c.segment] if c.segment else self.stages[c.stage]

    # ------------------------------------------------------------ forwards

    def _forward(self, c: Compute, needs: tuple, step: Step, store: Mapping, p: Pass) -> dict:
        seg, s, mb = c.segment, c.stage, c.mb
        data = p.mbs[mb]
        out_token, stored, *raw_token = produces(c)  # raw input: a cut segment's forward
        graph = stored in step.holds
        module = self.module(c)
        capture = (moves.Capture((module,)) if graph and (seg, s, mb) in self.moved
                   else None)  # the plan moves this activation: its saved tensors

        sink = bool(seg) and self.chain.segment(seg).side == SINK
        leaves, parts, args, kwargs, raw = [], [], [], {}, None
        with torch.set_grad_enabled(graph):
            for t in needs:
                if t[0] != "out":
                    continue
                # a sink is detached: nothing flows back into the body
                wanted = (graph and not sink
                          and self.chain.expected_backward(t[1], t[3])[0])
                x, grad_leaves, paths = self._input(t, c, store[t], wanted,
                                                    capture is not None)
                leaves.extend(grad_leaves)
                parts.append((t[1], len(grad_leaves), paths))
                args.append(x)
            if seg and not sink:
                raw = self._segment_data(c, data)
                args.append(raw)
            elif s in self.firsts and not seg:
                if data.body is not None:
                    args.extend(data.body if isinstance(data.body, tuple) else (data.body,))
                kwargs = dict(data.kwargs)
            if self.chunked:  # the previous chunk's cache (None for a sample's first)
                kwargs[chunks.CACHE], cache_leaves, cache_paths = chunks.cache_input(
                    _needed(needs, chunks.KV, store), graph)
            shipped = [comm.ShippedInput(raw, comm.rng_state(p.device))
                       for t in raw_token if t in step.keep]  # before the forward draws
            with capture.hooks() if capture is not None else contextlib.nullcontext():
                with _recording(p, module, mb):
                    y = module(*args, **kwargs)
                self.setup.check(c, module, y)  # a graph no backward here can run: refused
                if self.chunked:
                    y, cache = chunks.unpack(y, f"rank {self.rank}: {step.where}: stage {s}")
                out = y
                if sink or (not seg and s in self.lasts):
                    out = self._loss_of(c, y, data, p)
        value = (y.detach() if type(y) is torch.Tensor else tree.detach(y, keep_flag=True))
        produced = {out_token: value if capture is None else moves.private(value)}
        if graph:
            moved = None if capture is None else self.mover.activation(
                capture, leaves, _own_outputs(out, leaves, args, kwargs, capture))
            produced[stored] = Saved(tuple(leaves), out, self.params[id(module)],
                                     tuple(parts), not seg and s == 0 and self.at_cut, moved)
        if self.chunked:
            produced[(chunks.KV, seg, s, mb)] = tree.detach(cache, keep_flag=True)
            if graph:
                produced[stored] = attrs.evolve(
                    produced[stored], leaves=tuple(leaves) + tuple(cache_leaves),
                    cache_paths=cache_paths, cache=cache)
        for t, value in zip(raw_token, shipped):
            produced[t] = value
        return produced

    def _segment_data(self, c: Compute, data: Batch):
        """A source segment's input (a sink's target) in the microbatch."""
        raw = data.segments.get(c.segment)
        if raw is None:
            raise PipelineError(f"rank {self.rank}: {c}: the batch has no entry for segment "
                                f"{c.segment!r} (Batch(segments={{{c.segment!r}: ...}}))")
        return raw

    def _loss_of(self, c: Compute, y, data: Batch, p: Pass):
        """At the body's last stage (``loss_fn``) or a sink (its ``segment_loss_fns``):
        record the microbatch's loss and return what its backward starts from (the loss
        weighted by the microbatch's share). In eval: keep ``y``, and compute the body's
        loss only when the batch has a target (a sink's output is kept, no loss)."""
        name = c.segment
        if p.evaluating:
            p.outputs.setdefault(name, {})[c.mb] = y
            if name or data.target is None:
                return y
        target = self._segment_data(c, data) if name else data.target
        fn = self.segment_loss_fns[name] if name else self.loss_fn
        value = loss.checked(fn(y, target), f"segment_loss_fns[{name!r}]" if name
                             else "loss_fn", self.rank)
        weight = (p.row_weights if name else p.weights)[c.mb]
        root, own, share = loss.weighted(value, weight, y)
        p.mb_losses[c.mb] = own + p.mb_losses[c.mb] if c.mb in p.mb_losses else own
        p.loss = share if p.loss is None else p.loss + share
        return root

    def _input(self, t: tuple, c: Compute, x, wanted: bool, own: bool = False) -> tuple:
        """``(value for the forward, its tensors that take a gradient, their paths)``; the
        paths are None for one float tensor (it always takes one when ``wanted``). A
        structure's float leaves take one if the plan ships it back (a received value) or
        they required one where they were produced (a value from this rank). ``own``: the
        leaves are copies (a moved activation owns their memory: ``moves``)."""
        if type(x) is torch.Tensor:
            if not tree.is_float(x):
                return x, [], ()
            if not wanted:
                return x, [], None
            x = (x.detach().clone() if own else x.detach()).requires_grad_(True)
            return x, [x], None
        if not wanted:
            paths = frozenset()
        elif t in self.received:
            key = ((c.segment, c.stage, c.mb, None) if t[1] == c.segment
                   else (BODY, 0, c.mb, t[1]))  # a source's output into the body
            paths = self.grad_paths.get(key, frozenset())
        else:
            paths = frozenset(p for p, v in tree.flatten(x)
                              if v is not None and v.requires_grad)
        items, grads = [], []
        for p, v in tree.flatten(x):
            if v is not None:
                v = v.detach()
                if p in paths and tree.is_float(v):
                    v = v.clone() if own else v
                    v.requires_grad_(True)
                    grads.append((p, v))
            items.append((p, v))
        return tree.unflatten(items), [v for _, v in grads], tuple(p for p, _ in grads)

    def _recompute(self, c: Compute, shipped: comm.ShippedInput, device) -> dict:
        """Re-run the forward from its shipped input, drawing from the RNG state that
        forward ran with (this rank's own generators are left as they were)."""
        module = self.module(c)
        cuda = device is not None and device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else []), \
                torch.enable_grad(), buffers.unchanged(module):  # the forward's update counted
            comm.set_rng_state(shipped.rng, device)
            y = module(shipped.tensor)
            self.setup.check(c, module, y)
        (stored,) = produces(c)
        return {stored: Saved((), y, self.params[id(module)])}

    # ------------------------------------------------------------ backwards

    def _roots(self, c: Compute, saved: Saved, g, needs: tuple, store: Mapping) -> tuple:
        """What a backward starts from: the output (or loss) with ``g``, and under
        sequence chunks the cache this chunk returned with the next chunk's ``kv_grad``
        (none for a sample's last chunk)."""
        roots, grads = _vjp(saved.output, g)
        kv_grad = _needed(needs, chunks.KV_GRAD, store) if self.chunked else None
        if kv_grad is not None:
            more, more_grads = _vjp(saved.cache, kv_grad)
            roots, grads = roots + more, grads + more_grads
        return roots, grads

    def _cache_grad(self, c: Compute, saved: Saved, grads_in: Sequence) -> dict:
        """Under sequence chunks, this chunk's ``kv_grad``: its cache input's gradient."""
        if not self.chunked:
            return {}
        n = len(saved.cache_paths)
        return {(chunks.KV_GRAD, c.segment, c.stage, c.mb): chunks.cache_grad(
            saved.cache_paths, grads_in[len(grads_in) - n:] if n else ())}

    def _backward(self, c: Compute, saved: Saved, g, needs: tuple, store: Mapping) -> dict:
        roots, grads = self._roots(c, saved, g, needs, store)
        targets = saved.leaves + saved.params
        if targets and roots:
            torch.autograd.backward(roots, grads, inputs=list(targets))
        grad, wdone = produces(c)
        grads_in = [x.grad for x in saved.leaves]
        return {grad: _grad_value(saved, grads_in), wdone: True,
                **self._cache_grad(c, saved, grads_in)}

    def _input_grad(self, c: Compute, saved: Saved, g, needs: tuple, store: Mapping) -> dict:
        """The input gradient; ``wgrad_ready`` holds what ``W`` computes the weight
        gradients from (the stored activation itself stays held until ``W`` frees it)."""
        roots, grads = self._roots(c, saved, g, needs, store)
        grads_in, work = [None] * len(saved.leaves), split_backward.WeightWork()
        if roots:
            if len(roots) > 1 or roots[0].grad_fn is None:  # one root: <output, grad> summed
                roots, grads = [sum((r * g).sum() if g is not None else r  # g None: a loss
                                    for r, g in zip(roots, grads))], [None]
            if saved.leaves:
                grads_in, work = split_backward.backward_input(
                    roots[0], grads[0], saved.leaves, saved.params,
                    self.direct[id(self.module(c))])
            else:
                work = split_backward.weight_only(roots[0], grads[0], saved.params)
        grad, wgrad_ready = produces(c)
        return {grad: _grad_value(saved, grads_in), wgrad_ready: work,
                **self._cache_grad(c, saved, grads_in)}

    def _part(self, g, c: Compute):
        """The output gradient ``c`` starts from: a source segment's own part of the
        body's first-stage input gradient, else ``g`` itself."""
        if type(g) is not PerSource:
            return g
        part = g.get(c.segment, MISSING)
        if part is MISSING:
            raise PipelineError(f"rank {self.rank}: {c}: no gradient arrived for segment "
                                f"{c.segment!r} (internal error)")
        return part


def _needed(needs: tuple, kind: str, store: Mapping):
    """The value of the token of ``kind`` among an op's ``needs`` (None if absent)."""
    for t in needs:
        if t[0] == kind:
            return store[t]
    return None


def _own_outputs(out, leaves, args, kwargs, capture) -> list:
    """The tensors of a moved activation's graph output that hold memory of its own: made
    by the graph (a ``grad_fn``), and not an input's (the batch, a value the forward was
    given) nor a parameter's or buffer's."""
    given = {id(x) for x in leaves}
    external = capture.static | {
        t.untyped_storage().data_ptr() for t in moves.tensors_of((args, kwargs))
        if id(t) not in given}
    return [t for t in moves.tensors_of(out)
            if t.grad_fn is not None and t.untyped_storage().data_ptr() not in external]


def _recording(p: Pass, module: nn.Module, mb: int):
    """Around a forward: record its buffer updates when ``module`` has other copies."""
    held = p.copies.get(id(module))
    return contextlib.nullcontext() if held is None else held[0].recording(p.base + mb)


def _grad_value(saved: Saved, grads: Sequence):
    """The backward's input gradient, as the plan ships it: per input, a tensor for one
    float tensor, else a ``tree.Flat`` of its leaves (zeros where none arrived); the
    first input's, or one per source at the body's first stage under a cut."""
    values, at = [], 0
    for segment, n, paths in saved.parts:
        got, xs = grads[at:at + n], saved.leaves[at:at + n]
        at += n
        if paths is None:
            values.append((segment, got[0] if n else None))
        else:
            values.append((segment, tree.Flat(tuple(
                (p, g if g is not None else torch.zeros_like(x))
                for p, g, x in zip(paths, got, xs)))))
    if saved.per_source:
        return PerSource(values)
    return values[0][1] if values else None


def _vjp(output, grad) -> tuple[list, list]:
    """The outputs to back-propagate from and their gradients: the loss (``grad`` None),
    one tensor, or each leaf of a structure that requires a gradient and received one."""
    if grad is None or type(grad) is torch.Tensor:
        return ([output], [grad]) if output.requires_grad else ([], [])
    outs = dict(tree.flatten(output))
    pairs = [(outs.get(p, MISSING), g) for p, g in tree.flatten(grad) if g is not None]
    if any(o is MISSING for o, _ in pairs):
        raise PipelineError("a gradient arrived for a leaf the stage's output does not have")
    pairs = [(o, g) for o, g in pairs if o is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]
