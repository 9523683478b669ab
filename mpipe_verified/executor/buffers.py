"""Module buffers (BatchNorm's running statistics, a counter a forward keeps) when a
module has several copies: a cut segment run on several ranks (its owners, its home), a
model stage replicated by several pipelines (``replicas``), a stage or segment held by
every data-parallel replica.

The reference is one process running the step's microbatches one after another, in row
order (replica 0's microbatches first): a BatchNorm then updates its running statistics
once per microbatch, in that order. Each copy here sees only the microbatches it ran, so
after the plan its copies are brought to that one state:

- **Statistics** (the ``running_mean``/``running_var``/``num_batches_tracked`` of a
  ``BatchNorm`` that tracks them) are *replayed*. While the plan runs, each update of a
  copy is recorded as the batch statistic it used (the update is ``r' = (1 - a) r + a s``,
  so ``s = (r' - (1 - a) r) / a``), keyed by the microbatch's place in the whole batch.
  After the plan the copies sum these records (each microbatch's are on exactly one copy)
  and every copy applies them to the statistics it held when the step started, in row
  order, with BatchNorm's own rule (``momentum``, or the cumulative average when it is
  None). A recompute (``R``) changes no buffer: it re-runs a forward whose update was
  already recorded.
- **Other buffers** that any copy changed during the step are broadcast from one copy, as
  DistributedDataParallel broadcasts buffers: the segment's home rank, then replica 0.
  Nothing is known of how such a buffer combines, so the first copy's value is the one
  kept (a buffer no forward changes costs one flag).

Copies start equal: ``start_up`` broadcasts every buffer the same way when the executor
connects. The collectives run after the plan, outside it, like the replicas' gradient sum:
every copy has finished its own plan by then and meets them in the same order.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import topology

Reduce = Callable[[torch.Tensor], None]  # sums a tensor in place over a group of copies
Broadcast = Callable[[torch.Tensor], None]  # replaces a tensor in place by the root's


def statistics_of(module: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of ``module`` whose running statistics a forward updates."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm)
            and m.track_running_stats and m.running_mean is not None]


def other_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s buffers that are not such statistics, by name."""
    stats = {id(b) for m in statistics_of(module) for b in m.buffers(recurse=False)}
    return [(n, b) for n, b in module.named_buffers() if id(b) not in stats]


@contextlib.contextmanager
def unchanged(module: nn.Module):
    """Run a block that must leave every buffer of ``module`` as it was (a recompute): it
    runs on scratch copies, and the original tensors are put back untouched (copying the
    old values back in place would bump versions a saved graph still checks)."""
    saved = [(m, dict(m._buffers)) for m in module.modules()]
    for m, slots in saved:
        for name, b in slots.items():
            if b is not None:
                m._buffers[name] = b.clone()
    try:
        yield
    finally:
        for m, slots in saved:
            m._buffers.clear()
            m._buffers.update(slots)


class Copies:
    """The buffers of one module with several copies: records updates while the plan runs
    (``recording``) and makes the copies agree after it (``agree``)."""

    def __init__(self, module: nn.Module, microbatches: int) -> None:
        self.module, self.microbatches = module, microbatches
        self.norms = statistics_of(module)
        self.others = other_buffers(module)
        self._start: list = []
        self._records: dict[int, list] = {}
        self._before: dict[int, tuple] = {}
        self._mb: int | None = None

    # -------------------------------------------------------------- during the plan

    def begin(self) -> contextlib.ExitStack:
        """At the start of a step: remember the buffers as they are, and record every
        statistics update until the returned stack is closed."""
        self._start = [(m.running_mean.clone(), m.running_var.clone(),
                        int(m.num_batches_tracked)) for m in self.norms]
        self._others_start = [b.clone() for _, b in self.others]
        self._records = {id(m): [] for m in self.norms}
        stack = contextlib.ExitStack()
        for m in self.norms:
            stack.callback(m.register_forward_pre_hook(self._pre).remove)
            stack.callback(m.register_forward_hook(self._post).remove)
        return stack

    @contextlib.contextmanager
    def recording(self, mb: int):
        """Around a forward of global microbatch ``mb`` (its place in the whole batch)."""
        self._mb = mb
        try:
            yield
        finally:
            self._mb = None

    def _pre(self, norm: _BatchNorm, _args) -> None:
        if self._mb is not None and norm.training:
            self._before[id(norm)] = (norm.running_mean.clone(), norm.running_var.clone(),
                                      int(norm.num_batches_tracked))

    def _post(self, norm: _BatchNorm, _args, _out) -> None:
        before = self._before.pop(id(norm), None)
        if before is None or int(norm.num_batches_tracked) == before[2]:
            return
        a = _factor(norm, int(norm.num_batches_tracked))
        if a == 0:  # momentum 0: the statistics stay; the update only counts
            mean, var = torch.zeros_like(before[0]), torch.zeros_like(before[1])
        else:  # in float64: a bf16 statistic rounds less on the way back
            mean, var = ((now.detach().double() - (1 - a) * was.double()) / a
                         for now, was in ((norm.running_mean, before[0]),
                                          (norm.running_var, before[1])))
        self._records[id(norm)].append((self._mb, mean, var))

    # -------------------------------------------------------------- after the plan

    def agree(self, reduces: list[Reduce], broadcasts: list[Broadcast],
              first: bool) -> None:
        """Make every copy hold the one-process state: ``reduces`` sum over the copies
        (the pipeline's, then the replicas'), ``broadcasts`` take the first copy's value
        (home, then replica 0); ``first``: this is that copy, whose starting statistics
        every copy replays from (so copies that drifted apart outside a step, e.g. a
        forward of the caller's own, agree again). Every copy calls this at the same
        point of its step."""
        m = self.microbatches
        counts = torch.zeros(len(self.norms) * m + len(self.others), dtype=torch.float64)
        for k, norm in enumerate(self.norms):
            for mb, _, _ in self._records[id(norm)]:
                counts[k * m + mb] += 1
        for j, (_, b) in enumerate(self.others):
            counts[len(self.norms) * m + j] = float(not torch.equal(b, self._others_start[j]))
        counts = _reduced(counts, reduces)
        if self.norms:
            self._replay(counts[:len(self.norms) * m].view(len(self.norms), m), reduces,
                         first)
        changed = counts[len(self.norms) * m:]
        for (_, b), flag in zip(self.others, changed.tolist()):
            if flag:
                for broadcast in broadcasts:
                    broadcast(b)

    def _replay(self, counts: torch.Tensor, reduces: list[Reduce], first: bool) -> None:
        """Sum every copy's recorded statistics, then apply them to the step's starting
        statistics in microbatch order."""
        calls = counts.long()
        widest = max(int(calls.max()) if calls.numel() else 0, 1)
        slots = []
        for k, norm in enumerate(self.norms):
            c = norm.running_mean.numel()
            stats = torch.zeros(self.microbatches, widest, 2, c, dtype=torch.float64)
            seen = [0] * self.microbatches
            for mb, mean, var in self._records[id(norm)]:
                stats[mb, seen[mb], 0] = mean.double().cpu()
                stats[mb, seen[mb], 1] = var.double().cpu()
                seen[mb] += 1
            slots.append(stats)
        starts = torch.zeros(sum(2 * n.running_mean.numel() + 1 for n in self.norms),
                             dtype=torch.float64)
        if first:  # the first copy's starting statistics, for every copy
            starts.copy_(torch.cat([torch.cat([m.double().reshape(-1).cpu(),
                                               v.double().reshape(-1).cpu(),
                                               torch.tensor([float(t)], dtype=torch.float64)])
                                    for m, v, t in self._start]))
        flat = _reduced(torch.cat([*(s.reshape(-1) for s in slots), starts]), reduces)
        at, begin = 0, flat.numel() - starts.numel()
        for k, (norm, stats) in enumerate(zip(self.norms, slots)):
            summed = flat[at:at + stats.numel()].view_as(stats)
            at += stats.numel()
            c = norm.running_mean.numel()
            start = flat[begin:begin + 2 * c + 1]
            begin += 2 * c + 1
            mean, var, tracked = start[:c], start[c:2 * c], int(start[-1])
            for mb in range(self.microbatches):
                for j in range(int(calls[k, mb])):
                    tracked += 1
                    a = _factor(norm, tracked)
                    s = summed[mb, j]  # in float64, stored as the buffer's dtype stores it
                    mean = _stored(a * s[0] + (1 - a) * mean, norm.running_mean.dtype)
                    var = _stored(a * s[1] + (1 - a) * var, norm.running_var.dtype)
            with torch.no_grad():
                norm.running_mean.copy_(mean.view_as(norm.running_mean))
                norm.running_var.copy_(var.view_as(norm.running_var))
                norm.num_batches_tracked.fill_(tracked)

    def start_up(self, broadcasts: list[Broadcast]) -> None:
        """Make the copies start equal: every buffer from the first copy."""
        for b in self.module.buffers():
            for broadcast in broadcasts:
                broadcast(b)


def copies_of(held: list, plan, rank: int, topo: topology.Topology, links: topology.Links,
              wait: Callable, device, stage_copies: dict | None = None) -> dict:
    """``id(module) -> (Copies, reduces, broadcasts, first)`` for each module of this rank
    (``held``: ``(segment name or None, module)``) that has buffers and other copies: a
    segment held by several ranks (summed over its holders, broadcast from its home, or
    its lowest holder when home holds none), a replicated model stage's module
    (``stage_copies[id(module)]``: its holders and the root they start from: several
    pipelines), any module when there are replicas (over the data-parallel group, from
    replica 0); ``first``: this rank holds the copy broadcast from. ``wait(works, where,
    peers)`` bounds each collective."""
    out = {}
    for name, module in held:
        if next(module.buffers(), None) is None or id(module) in out:
            continue
        reduces, broadcasts, first = [], [], True
        ranks, root = (topology.holders(plan, name), None) if name is not None else \
            (stage_copies or {}).get(id(module), ((), None))
        if len(ranks) > 1:  # a segment's copies, or a model stage's replicas
            if root is None:
                home = plan.cut.get(name).home
                root = home if home in ranks else ranks[0]
            group = links.groups[ranks]
            reduces.append(_summing(group, f"ranks {list(ranks)}", wait, device))
            broadcasts.append(_broadcasting(group, topo.pp_ranks[root], f"rank {root}",
                                            wait, device))
            first = rank == root
        if links.dp is not None:
            reduces.append(_summing(links.dp, "its replicas", wait, device))
            broadcasts.append(_broadcasting(links.dp, topo.dp_ranks[0], "replica 0", wait,
                                            device))
            first = first and topo.dp_rank == 0
        if reduces:
            out[id(module)] = (Copies(module, plan.num_microbatches * topo.replicas),
                               reduces, broadcasts, first)
    return out


def _summing(group, peers: str, wait: Callable, device) -> Reduce:
    def reduce(t: torch.Tensor) -> None:
        d = t.to(device)
        wait([dist.all_reduce(d, group=group, async_op=True)],
             "the buffer statistics all-reduce", peers)
        t.copy_(d)
    return reduce


def _broadcasting(group, root: int, peers: str, wait: Callable, device) -> Broadcast:
    def broadcast(t: torch.Tensor) -> None:  # as bytes: gloo has no int16 or float8
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device, copy=True)
        wait([dist.broadcast(raw, root, group=group, async_op=True)],
             "the buffer broadcast", peers)
        with torch.no_grad():
            t.copy_(raw.to(t.device).view(t.dtype).view(t.shape))
    return broadcast


def _factor(norm: _BatchNorm, tracked: int) -> float:
    """The weight BatchNorm gives a new batch statistic at its ``tracked``-th update."""
    return norm.momentum if norm.momentum is not None else 1.0 / tracked


def _stored(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (float64) rounded as a buffer of ``dtype`` holds it, kept in float64."""
    return value.to(dtype).double()


def _reduced(t: torch.Tensor, reduces: list[Reduce]) -> torch.Tensor:
    for reduce in reduces:
        reduce(t)
    return t
