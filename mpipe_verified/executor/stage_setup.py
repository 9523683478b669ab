"""What the executor sets up around the stage modules it is given: ``torch.compile`` for
the split-backward families, and a refusal of reentrant activation checkpointing
(docs/executor.md, "Compiled and checkpointed stages").

Compiled stages. A split backward runs a parameter node that has no direct form twice:
``I`` back-propagates into the stage's inputs with ``retain_graph=True`` and ``W`` runs
the node again into the weights (``split_backward``). Under ``torch.compile`` the whole
compiled region is one such node, so ``I`` keeps the graph and ``W`` runs it again.
AOTAutograd (behind the ``inductor`` and ``aot_eager`` backends) by default lets its
compiled backward reuse the memory of the tensors the forward saved ("donated buffers")
and then refuses a backward that retains the graph ("This backward function was
compiled with non-empty donated buffers which requires create_graph=False and
retain_graph=False"): at once when the backward is compiled with the forward (shapes
compiled as dynamic, e.g. after a recompilation), else once a backward without
``retain_graph`` compiled it first. ``StageSetup`` turns donated buffers off
(``torch._functorch.config.donated_buffer = False``, process-wide) when the rank's
program has ``I``/``W`` ops, in the executor's constructor, so before the compiled
stages' first call, where ``torch.compile`` compiles them. It must be off when a graph is
compiled (so that no buffer is donated) and also when its backward runs (torch checks
the flag then, and a graph compiled without donation still fails the check while the
flag is on), so a ``config.patch`` around the forwards alone does not do it. Plans
without ``I``/``W`` (``B`` only: no retained graph) leave the flag as it is.

Reentrant checkpointing. ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``
leaves a ``CheckpointFunction`` node in the graph whose backward runs a nested
``backward`` of its own; torch refuses it under ``torch.autograd.grad`` and under
``backward(inputs=...)``, which ``B``, ``I`` and ``W`` all use (a stage's backward must
reach only that stage's inputs and parameters). ``check`` looks for such a node in the
graph of each module's first forward that builds one and refuses it with a
``PipelineError``; non-reentrant checkpointing (``use_reentrant=False``) runs as it is.
Under ``torch.compile`` the checkpointed region is traced into the compiled graph and no
such node is left, so nothing is refused.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.utils.checkpoint import CheckpointFunction

from ..ir import INPUT_GRAD, WEIGHT_GRAD, Compute, computes_of
from .errors import PipelineError

_SPLIT = (INPUT_GRAD, WEIGHT_GRAD)


def has_split_backward(program: Iterable) -> bool:
    """Whether ``program`` (a rank's ops) runs a split backward (an ``I`` or ``W`` op)."""
    return any(c.kind in _SPLIT for op in program for c in computes_of(op))


def allow_retained_backward() -> None:
    """Turn AOTAutograd's donated buffers off for the rest of the process
    (``torch._functorch.config.donated_buffer = False``). Guarantees: every graph
    ``torch.compile`` compiles from now on keeps the tensors its forward saved intact
    through its backward, and its backward may run with ``retain_graph=True`` and then
    run again (what ``I`` then ``W`` do); gradients are unchanged (only the compiled
    backward's reuse of that memory is given up). A graph compiled before, with donated
    buffers, is not changed (``StageSetup.check`` refuses it once its backward has been
    compiled)."""
    from torch._functorch import config

    if config.donated_buffer:
        config.donated_buffer = False


class StageSetup:
    """One executor's set-up of its rank's stage modules (``rank``, ``program``: the
    rank's ops). Constructing it turns donated buffers off when ``program`` has a split
    backward (``allow_retained_backward``); ``check`` is called with each forward's
    output."""

    def __init__(self, rank: int, program: Iterable) -> None:
        self.rank = rank
        self.split = has_split_backward(program)
        self._checked: set[int] = set()  # id of each module whose graph was looked at
        if self.split:
            allow_retained_backward()

    def check(self, c: Compute, module: torch.nn.Module, output) -> None:
        """Look, once per module, at the graph of its first forward that builds one
        (``output``: the module's output; a forward without a graph is skipped) and raise
        a one-line ``PipelineError`` naming the rank, the op and the stage or segment
        when it holds a node that this executor's backward cannot run: a reentrant
        checkpoint, or (with a split backward) a region compiled with donated buffers
        (before the set-up, or with the flag turned on again since) whose backward is
        already compiled. A module that does neither on its first such forward is not
        looked at again."""
        if id(module) in self._checked:
            return
        roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        if not roots:
            return
        self._checked.add(id(module))
        what = f"segment {c.segment!r}" if c.segment else f"stage {c.stage}"
        for node in _nodes(roots):
            cls = getattr(node, "_forward_cls", None)
            if cls is CheckpointFunction:
                raise PipelineError(
                    f"rank {self.rank}: {c}: {what} uses reentrant activation checkpointing "
                    "(torch.utils.checkpoint with use_reentrant=True), which torch cannot "
                    "run under the executor's backward (autograd.grad, backward(inputs=...)"
                    "): pass use_reentrant=False")
            if self.split and _donated_and_compiled(cls):
                raise PipelineError(
                    f"rank {self.rank}: {c}: {what} was compiled by torch.compile with "
                    "donated buffers (torch._functorch.config.donated_buffer on, as before "
                    "the executor is built) and its backward is compiled, which cannot run "
                    "I then W (they retain the graph): build the executor before the "
                    "compiled module's first call, or set "
                    "torch._functorch.config.donated_buffer = False before it (or call "
                    "torch._dynamo.reset())")


def _donated_and_compiled(cls) -> bool:
    """An AOTAutograd compiled region whose backward was compiled with donated buffers
    (its ``metadata.bw_donated_idxs`` non-empty and ``compiled_bw`` set). One whose
    backward is still to be compiled is fine: compiled by a retaining backward (``I``),
    it donates nothing."""
    donated = getattr(getattr(cls, "metadata", None), "bw_donated_idxs", None)
    return bool(donated) and getattr(cls, "compiled_bw", None) is not None


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a stage's output: a tensor, or tuples, lists and dicts of them
    (anything else is skipped; the executor checks the output's structure itself)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nodes(roots: list):
    """Every node of the graph reachable from ``roots``, once each."""
    seen, stack = set(roots), list(roots)
    while stack:
        node = stack.pop()
        yield node
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)


__all__ = ["StageSetup", "allow_retained_backward", "has_split_backward"]
