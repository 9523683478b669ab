"""The start-up checks between ranks, before the first op of a plan runs (docs/executor.md,
"Pipeline groups and data parallelism").

- One plan: the ranks of the pipeline all-gather their plan digest (and plan rank) and
  refuse together unless every rank runs the same certified plan; a rank's replicas must
  also hold the same plan rank.
- One parameter layout per sum: the ranks all-gather a fingerprint of the trainable
  parameters (names, shapes, dtypes, in order) of each segment, and the replicas of all
  of theirs; the members of a ``grads:NAME`` all-reduce, and a rank's replicas, must
  agree, or the sum would silently add one parameter's gradient to another's. Every rank
  of the group sees every fingerprint and decides alike, so all of them refuse together
  (none is left waiting for the others).

Both run under the start-up timeout.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist

from ..ir import Collective
from ..semantics import GRADS, collective_segment
from .errors import CertificateError, PipelineError


@attrs.frozen
class Handshake:
    """The handshakes of plan rank ``rank``: tensors on ``device``, each all-gather
    waited for with ``wait(works, where, peers, timeout_s)`` under ``timeout_s``."""

    rank: int
    device: object
    wait: Callable
    timeout_s: float

    def same_plan(self, group, size: int, digest: str, what: str,
                  same_rank: bool = False) -> None:
        """All-gather ``(digest, plan rank)`` over ``group`` (of ``size`` ranks): its ranks
        must run one plan, and with ``same_rank`` (replicas) as the same plan rank."""
        every = self._gather(group, size, [*bytes.fromhex(digest), self.rank], what)
        digests = [bytes(row[:-1]).hex() for row in every]
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        odd = [r for r, d in enumerate(digests) if d != digests[me]]
        if odd:
            raise CertificateError(
                f"rank {self.rank} runs plan {digests[me][:16]}… but rank(s) "
                f"{odd} of its group run {digests[odd[0]][:16]}…: every rank must run the "
                "same certified plan")
        ranks = [row[-1] for row in every]
        if same_rank and len(set(ranks)) != 1:
            raise PipelineError(f"rank {self.rank}: {what}: the data-parallel group's "
                                f"ranks hold plan ranks {ranks}; each replica's copy of a "
                                "rank must be the same plan rank")

    def same_layouts(self, group, size: int, labels: Sequence[str], layouts: Sequence[list],
                     members: Callable[[str], list] | None = None,
                     replicas: Sequence[int] = ()) -> None:
        """All-gather a fingerprint of each of ``layouts`` (``named``; ``labels[k]``
        names the k-th) over ``group``: the ranks ``members(label)`` (plan ranks) must
        hold the same one; with ``replicas`` (the group's global ranks, in its order)
        every rank of the group must."""
        prints = b"".join(_fingerprint(layout) for layout in layouts)
        every = self._gather(group, size, [*self.rank.to_bytes(4, "little"), *prints],
                             "the parameter layout handshake")
        rows = [bytes(row) for row in every]
        if replicas:  # by the replicas' global ranks (one plan rank)
            who = dict(zip(replicas, rows))
        else:  # by plan rank
            who = {int.from_bytes(row[:4], "little"): row for row in rows}
        for k, label in enumerate(labels):
            ranks = sorted(who) if replicas else members(label)
            seen = {r: who[r][4 + 16 * k:20 + 16 * k] for r in ranks if r in who}
            if len(set(seen.values())) > 1:
                groups: dict = {}
                for r, fingerprint in seen.items():
                    groups.setdefault(fingerprint, []).append(r)
                split = " against ".join(str(g) for g in sorted(groups.values()))
                raise PipelineError(
                    f"rank {self.rank}: {'the replicas' if replicas else f'segment {label!r}'}"
                    f": ranks {split} hold different trainable parameters (names, shapes, "
                    "dtypes or requires_grad), so their gradients cannot be summed")

    def _gather(self, group, size: int, row: list, what: str) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in range(size)]
        self.wait([dist.all_gather(every, mine, group=group, async_op=True)], what,
                  "its group", self.timeout_s)
        return [t.tolist() for t in every]


def check_peers(shake: Handshake, plan, topo, digest: str, segments: Mapping,
                params: Mapping, replica_layout: list) -> None:
    """Every start-up check of a rank (``shake``) running ``plan`` (certified as
    ``digest``) where ``topo`` says: one plan over the pipeline, and one layout per
    segment's gradient sum (``segments``: the modules it holds, ``params``: their
    trainable parameters by module); with replicas, one plan rank and one layout of all
    its parameters (``replica_layout``) over the replicas."""
    shake.same_plan(topo.pp_group, len(topo.pp_ranks), digest, "the plan digest handshake")
    names = sorted(seg.name for seg in plan.cut.segments)
    layouts = []
    for name in names:
        module = segments.get(name)
        layouts.append([] if module is None else named(params[id(module)],
                                                       [("", module)]))
    shake.same_layouts(topo.pp_group, len(topo.pp_ranks), names, layouts,
                       members=lambda name: summing_members(plan, name))
    if topo.replicas > 1:
        shake.same_plan(topo.dp_group, topo.replicas, digest,
                        "the replicas' plan handshake", same_rank=True)
        shake.same_layouts(topo.dp_group, topo.replicas, ["all parameters"],
                           [replica_layout], replicas=topo.dp_ranks)


def named(params: Sequence, labelled) -> list:
    """The layout of ``params``: ``(name, shape, dtype)`` of each, named after the first
    of the ``(label, module)`` of ``labelled`` that holds it (``label.name``; the bare
    name for an empty label)."""
    names: dict = {}
    for label, module in labelled:
        for n, p in module.named_parameters():
            names.setdefault(id(p), f"{label}.{n}" if label else n)
    return [(names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in params]


def summing_members(plan, name: str) -> list:
    """The plan ranks of the ``grads:NAME`` all-reduce, read from any rank's program (so
    every rank finds the same; none when there is none)."""
    for program in plan.programs:
        for op in program:
            if (isinstance(op, Collective) and op.kind == "all_reduce"
                    and collective_segment(op) == (GRADS, name)):
                return sorted(op.ranks)
    return []


def _fingerprint(layout: list) -> bytes:
    """16 bytes that differ, but for a hash collision, between two different layouts."""
    return hashlib.sha256(repr(layout).encode()).digest()[:16]
