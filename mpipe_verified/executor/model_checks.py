"""Models the executor refuses at construction, before any traffic: each would train
silently wrong.

- A segment the plan runs without a backward (``mode="frozen"``) whose module still has
  parameters that require grad: it would stay untrained.
- A parameter shared by modules on different ranks (a tied embedding and head on the
  first and last stage): nothing in the plan sums its two gradients, so the copies would
  diverge. A segment counts as its home rank's (the plan keeps its other copies in step);
  a tie between modules of one rank is fine (the gradients accumulate in one tensor).
  Only the modules passed in are seen: pass every stage (as ``split_sequential`` returns
  them) for the check to cover ties across ranks.
- An FSDP2 (``fully_shard``) module: its all-gathers and reduce-scatters are collectives
  the plan does not contain, and its parameter swapping leaves the executor's backward
  without gradients (docs/executor.md, "FSDP2").
- A sink segment recomputed off its forward's rank (a plan-json file can say so; the
  algebra never derives it): only a source's raw input is shipped for a recompute.
"""

from __future__ import annotations

import sys
from typing import Mapping

from torch import nn

from ..ir import SINK, Plan
from .errors import PipelineError


def check_model(plan: Plan, stages, segments: Mapping[str, nn.Module]) -> None:
    """Raise ``PipelineError`` (naming the segment, or the parameter and both places) for
    any of the models above."""
    for seg in plan.cut.segments:
        _check_frozen(seg, segments.get(seg.name))
        if seg.side == SINK and any(map(seg.needs_recompute, range(plan.num_microbatches))):
            raise PipelineError(f"segment {seg.name!r} is a sink recomputed off its forward's "
                                "rank: the executor ships only a source's raw input; certify "
                                "the sink in owner or frozen mode")
    _check_ties(plan, stages, segments)


def _check_frozen(seg, module: nn.Module | None) -> None:
    """A segment the plan runs without a backward must not have trainable parameters: it
    would silently stay untrained."""
    if seg.trainable or module is None:
        return
    live = [n for n, p in module.named_parameters() if p.requires_grad]
    if live:
        more = f", … ({len(live)} in all)" if len(live) > 3 else ""
        raise PipelineError(
            f"segment {seg.name!r} is frozen in this plan (no backward) but its module has "
            f"parameters that require grad ({', '.join(live[:3])}{more}): freeze them "
            "(module.requires_grad_(False)) or certify a plan that trains the segment")


def _check_ties(plan: Plan, stages, segments: Mapping[str, nn.Module]) -> None:
    """Parameters tied across ranks, and FSDP2 modules, among every module given."""
    table = stages.items() if isinstance(stages, Mapping) else enumerate(stages)
    holders = [(f"stage {s}", plan.placement.rank_of(s), m) for s, m in table
               if 0 <= s < plan.placement.num_stages]
    for name, module in segments.items():
        seg = plan.cut.get(name)
        if seg is not None:
            holders.append((f"segment {name!r}", seg.home, module))
    seen: dict[int, tuple[str, int, str]] = {}
    for where, rank, module in holders:
        if _is_fsdp(module):
            raise PipelineError(f"{where} is an FSDP2 (fully_shard) module: the executor "
                                "does not run them (see docs/executor.md); pass dp_group= "
                                "for data parallelism")
        for pname, p in module.named_parameters(remove_duplicate=False):
            first = seen.setdefault(id(p), (where, rank, pname))
            if first[1] != rank:
                raise PipelineError(
                    f"parameter {first[2]!r} of {first[0]} (rank {first[1]}) is also "
                    f"{pname!r} of {where} (rank {rank}): parameters tied across ranks are "
                    "not synchronised by the plan; untie them or place both on one rank")


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is ``fully_shard``-ed: only if FSDP was imported (importing it
    here would cost every executor about a second)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)
