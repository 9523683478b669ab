"""Several pipelines over one model (DualPipe, Chimera, BitPipe: docs/semantics.md §2.9;
docs/executor.md, "Several pipelines over one model").

A plan of K ``pipelines`` over a model of n stages has K*n stages: plan stage ``i*n + j``
is pipeline i's replica of model stage j, run for pipeline i's microbatches only. The
user gives the *model's* n stage modules (as for one pipeline); a rank runs each plan
stage it holds on model stage ``s % n``'s module, so a rank holding two replicas of one
model stage runs both on one module, whose gradient then sums them. Each pipeline's
first stage reads its microbatches from the whole batch (every rank holds it) and its
last stage computes their loss, weighted as for one pipeline ("The loss contract"), so
the pipelines' losses sum to the whole batch's.

- Start-up (``StartUp``): for each replicated model stage j (in ascending j) its
  holders compare a fingerprint of its parameters' and buffers' shapes and dtypes (so
  the broadcast cannot mismatch), then the holder of pipeline 0's replica (``root``)
  broadcasts their values, and every holder compares a digest of what it holds; one
  flag all-reduce over the pipeline then makes every rank refuse together (a
  ``PipelineError`` before any step) when any holder saw a mismatch.
- The plan's ``replica:J`` all-reduce sums model stage J's weight gradients over its
  holders (``Transport.collective``); every holder then steps its own copy (and its
  optimizer state) with the same summed gradient, so the copies stay equal.
- Clipping counts each model stage's gradient once (at ``root``); buffers (BatchNorm
  statistics) of a replicated stage are replayed over its holders like a segment's
  copies (``buffers.copies_of``), broadcast from ``root``.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..ir import Payload, Plan
from ..semantics import Chain
from .errors import PipelineError


def _pipelines(plan) -> Chain:
    """The semantics' reading of ``plan``'s pipelines (its stage map and microbatch sets
    only: what the helpers below ask)."""
    return Chain(plan.placement, pipelines=plan.pipelines)


def model_stages(plan: Plan) -> int:
    """n: the stages of one pipeline (the model's stages); every stage with one."""
    return _pipelines(plan).per_pipeline


def ends(plan: Plan) -> tuple[frozenset, frozenset]:
    """``(first stages, last stages)`` of the plan's pipelines (``plan``: a plan or its
    ``semantics.Chain``): where the batch's input is read, and where the loss is
    computed."""
    n, k = model_stages(plan), max(len(plan.pipelines), 1)
    return frozenset(i * n for i in range(k)), frozenset(i * n + n - 1 for i in range(k))


def holders(plan: Plan) -> dict[int, tuple[int, ...]]:
    """``j -> the plan ranks holding a replica of model stage j`` (sorted), where those
    are several: the members of its ``replica:J`` all-reduce (``Chain.replica_ranks``)."""
    return {j: tuple(sorted(r)) for j, r in _pipelines(plan).replica_ranks().items()}


def root(plan: Plan, j: int) -> int:
    """The plan rank whose copy of model stage ``j`` the others start from: the holder of
    pipeline 0's replica."""
    return plan.placement.rank_of(j)


def holder_groups(plan: Plan, rank: int) -> set[tuple[int, ...]]:
    """The holder sets (plan ranks) ``rank`` belongs to: the groups it needs."""
    return {r for r in holders(plan).values() if rank in r}


def payload_key(plan: Plan) -> Callable[[Payload], Payload]:
    """What a payload's layout is inferred from: with several pipelines, the payload of
    the model stage it replicates (``infer_payload_shapes`` sees the model's n stages)."""
    n = model_stages(plan)
    if not plan.pipelines:
        return lambda p: p
    return lambda p: attrs.evolve(p, stage=p.stage % n)


def local_stages(plan: Plan, rank: int, stages) -> dict[int, nn.Module]:
    """``plan stage -> module`` of the stages placed on ``rank``: model stage ``s % n``'s
    module from ``stages`` (the model's n stages: a sequence, or a mapping by model
    stage)."""
    n, k = model_stages(plan), len(plan.pipelines)
    if isinstance(stages, Mapping):
        table = dict(stages)
        odd = sorted(s for s in table if not 0 <= s < n)
        if odd:
            raise PipelineError(f"rank {rank}: stages has key(s) {odd}, but the plan runs "
                                f"{k} pipelines over a model of {n} stages: key the "
                                f"modules by model stage (0..{n - 1})")
    else:
        table = dict(enumerate(stages))
        if len(table) != n:
            raise PipelineError(f"rank {rank}: {len(table)} stage modules, but the plan "
                                f"runs {k} pipelines over a model of {n} stages: pass the "
                                f"model's {n} stage modules (plan stage i*{n}+j runs model "
                                "stage j)")
    mine = plan.placement.stages_of(rank)
    missing = sorted({s % n for s in mine} - set(table))
    if missing:
        raise PipelineError(f"rank {rank}: no module for model stage(s) {missing} (their "
                            "replicas are placed on this rank)")
    return {s: table[s % n] for s in mine}


def check_model(plan: Plan, stages) -> None:
    """Refuse what several pipelines cannot run: an evaluation plan (each pipeline's
    outputs and loss are on another rank), and a parameter shared by two model stages
    (each model stage's replicas are summed apart, so a tie would be summed twice)."""
    if plan.forward_only:
        raise PipelineError("a forward-only plan of several pipelines is not run by the "
                            "executor (each pipeline's outputs and loss are on its own "
                            "last stage's rank); evaluate with a plan of one pipeline")
    table = stages.items() if isinstance(stages, Mapping) else enumerate(stages)
    seen: dict[int, tuple[int, str]] = {}
    for j, module in table:
        for name, p in module.named_parameters(remove_duplicate=False):
            first = seen.setdefault(id(p), (j, name))
            if first[0] != j:
                raise PipelineError(
                    f"parameter {first[1]!r} of model stage {first[0]} is also {name!r} of "
                    f"model stage {j}: with several pipelines each model stage's replicas "
                    "are summed apart, so parameters tied across model stages are not run; "
                    "untie them or keep them in one model stage")


def replicated(plan: Plan, rank: int, local: Mapping[int, nn.Module]) -> dict[str, nn.Module]:
    """``"J" -> module`` of each replicated model stage J held on ``rank``: what its
    ``replica:J`` all-reduce sums."""
    n = model_stages(plan)
    return {str(j): local[next(s for s in local if s % n == j)]
            for j, ranks in holders(plan).items() if rank in ranks}


def counted(plan: Plan, rank: int, local: Mapping[int, nn.Module]) -> set[int]:
    """Ids of the parameters ``rank`` counts in the global gradient norm: a replicated
    model stage's only at its ``root`` (its copies hold the same summed gradient)."""
    n, shared = model_stages(plan), holders(plan)
    return {id(p) for s, module in local.items()
            if s % n not in shared or root(plan, s % n) == rank
            for p in module.parameters()}


def copies(plan: Plan, local: Mapping[int, nn.Module]) -> dict[int, tuple]:
    """``id(module) -> (holder ranks, root)`` of each replicated model stage's module on
    this rank: its buffers' copies (``buffers.copies_of``)."""
    n, shared = model_stages(plan), holders(plan)
    return {id(module): (shared[s % n], root(plan, s % n)) for s, module in local.items()
            if s % n in shared}


@attrs.frozen
class StartUp:
    """The start-up of one rank's replicated stages: ``links.groups[ranks]`` the process
    group of those plan ranks, ``links.pp`` the pipeline's (``links.pp_ranks[r]``: plan
    rank r's global rank), each collective waited for with ``wait(works, where,
    peers)``; tensors on ``device``."""

    rank: int
    links: object
    wait: Callable
    device: object

    def run(self, plan: Plan, local: Mapping[int, nn.Module], broadcast: bool = True) -> None:
        """For each replicated model stage held here, in ascending order: the layout
        check, the broadcast from ``root`` (when the layouts agree; ``broadcast`` off:
        tests only), and the digest check. Then every rank of the pipeline agrees (one
        all-reduce of a flag per rank), so all of them refuse together, each holder
        naming the first mismatch it saw."""
        shared = holders(plan)
        if not shared:
            return
        mine, failure = replicated(plan, self.rank, local), None
        for j, ranks in sorted(shared.items()):
            if self.rank not in ranks:
                continue
            tensors = _state(mine[str(j)])
            group, peers = self.links.groups[ranks], f"ranks {list(ranks)}"
            odd = self._differ(j, ranks, group, _layout(tensors), peers)
            if odd is None and broadcast:
                self._broadcast(tensors, self.links.pp_ranks[root(plan, j)], group, peers)
            failure = failure or (odd and self._refusal(j, odd, "parameters and buffers "
                                                        "(shapes, dtypes)"))
            odd = self._differ(j, ranks, group, _digest(tensors), peers)
            failure = failure or (odd and self._refusal(j, odd, "weights (their digests "
                                                        "differ after the start-up "
                                                        "broadcast)"))
        flags = torch.zeros(plan.num_ranks, device=self.device)
        flags[self.rank] = failure is not None
        self.wait([dist.all_reduce(flags, group=self.links.pp, async_op=True)],
                  "the replica handshake", "its pipeline")
        if failure is not None:
            raise PipelineError(failure)
        refusing = [r for r, f in enumerate(flags.tolist()) if f]
        if refusing:
            raise PipelineError(f"rank {self.rank}: plan rank(s) {refusing} refused the "
                                "replicas' start-up weights (their message says why)")

    def _differ(self, j: int, ranks: tuple, group, fingerprint: bytes, peers: str):
        """All-gather ``fingerprint`` over model stage ``j``'s holders: None if they
        agree, else the ranks grouped by what they hold."""
        mine = torch.tensor(list(fingerprint), dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in ranks]
        self.wait([dist.all_gather(every, mine, group=group, async_op=True)],
                  f"the replica handshake of model stage {j}", peers)
        split: dict = {}
        for r, row in zip(ranks, every):
            split.setdefault(bytes(row.tolist()), []).append(r)
        return sorted(split.values()) if len(split) > 1 else None

    def _refusal(self, j: int, odd: list, what: str) -> str:
        against = " against ".join(str(g) for g in odd)
        return (f"rank {self.rank}: the replicas of model stage {j}: ranks {against} hold "
                f"different {what}; the replicas of a stage must start equal (the executor "
                "broadcasts them from pipeline 0's holder at start-up)")

    def _broadcast(self, tensors: list, src: int, group, peers: str) -> None:
        """Every tensor from global rank ``src``, as bytes (any dtype), in one message."""
        if not tensors:
            return
        raw = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8)
                         for t in tensors]).to(self.device)
        self.wait([dist.broadcast(raw, src, group=group, async_op=True)],
                  "the replicas' start-up broadcast", peers)
        at = 0
        with torch.no_grad():
            for t in tensors:
                size = t.numel() * t.element_size()
                t.copy_(raw[at:at + size].to(t.device).view(t.dtype).view(t.shape))
                at += size


def _state(module: nn.Module) -> list[torch.Tensor]:
    """The parameters, then the buffers, of ``module`` (each once, in order)."""
    return [*module.parameters(), *module.buffers()]


def _layout(tensors: list) -> bytes:
    return hashlib.sha256(repr([(tuple(t.shape), str(t.dtype)) for t in tensors])
                          .encode()).digest()[:16]


def _digest(tensors: list) -> bytes:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                 .tobytes())
    return h.digest()[:16]
