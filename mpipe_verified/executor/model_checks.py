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
- With several pipelines (``replicas.check_model``): a forward-only plan, and a
  parameter tied across model stages.

And what one rank is given (``local_stages``, ``local_segments``, ``sink_losses``): a
module for every stage and segment its program runs, a loss for every sink it trains;
and, at every step, that what trains is what trained when the executor was built
(``check_trainable``).
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping

from torch import nn

from ..ir import SINK, Plan
from . import replicas
from .errors import PipelineError
from .topology import segments_touched


def check_model(plan: Plan, stages, segments: Mapping[str, nn.Module]) -> None:
    """Raise ``PipelineError`` (naming the segment, or the parameter and both places) for
    any of the models above."""
    if plan.pipelines and plan.seq_chunks > 1:
        raise PipelineError(f"the plan runs {len(plan.pipelines)} pipelines of sequence chunks "
                            f"({plan.seq_chunks} per sample): the executor runs either "
                            "dimension, not both together (no family makes such a plan)")
    if plan.pipelines:  # several pipelines over one model (executor/replicas.py)
        replicas.check_model(plan, stages)
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


def local_stages(plan: Plan, rank: int, stages) -> dict[int, nn.Module]:
    """``stage -> module`` of the stages placed on ``rank``, from ``stages`` (a mapping,
    or a sequence of every stage's module; with several pipelines, of the model's
    stages: ``replicas.local_stages``)."""
    if plan.pipelines:
        return replicas.local_stages(plan, rank, stages)
    mine, num_stages = plan.placement.stages_of(rank), plan.placement.num_stages
    if isinstance(stages, Mapping):
        table = dict(stages)
    else:
        stages = list(stages)
        if len(stages) != num_stages:
            raise PipelineError(f"rank {rank}: {len(stages)} stage modules for a plan "
                                f"with {num_stages} stages")
        table = dict(enumerate(stages))
    missing = [s for s in mine if s not in table]
    if missing:
        raise PipelineError(f"rank {rank}: no module for stage(s) {missing} "
                            f"(placed on this rank)")
    return {s: table[s] for s in mine}


def local_segments(plan: Plan, rank: int, segments: Mapping[str, nn.Module]
                   ) -> dict[str, nn.Module]:
    """``name -> module`` of the segments ``rank``'s program runs or exchanges."""
    used = segments_touched(plan.programs[rank])
    missing = sorted(used - set(segments))
    if missing:
        raise PipelineError(f"rank {rank}: the plan runs segment(s) "
                            f"{', '.join(missing)} here but no module was given "
                            "(segments={name: module})")
    return {name: segments[name] for name in sorted(used)}


def sink_losses(plan: Plan, rank: int, fns: dict, held: Mapping) -> dict[str, Callable]:
    """``fns`` (``segment_loss_fns``), checked: every one names a sink, and every sink
    among the ``held`` segments that trains here has one."""
    sinks = {s.name for s in plan.cut.segments if s.side == SINK}
    unknown = sorted(set(fns) - sinks)
    if unknown:
        raise PipelineError(f"segment_loss_fns names {', '.join(unknown)}, which the plan "
                            f"has no sink segment of (sinks: {sorted(sinks) or 'none'})")
    missing = sorted(name for name in sinks & set(held)
                     if name not in fns and not plan.forward_only)
    if missing:
        raise PipelineError(f"rank {rank}: the plan runs sink segment(s) "
                            f"{', '.join(missing)} here but no loss was given "
                            "(segment_loss_fns={name: fn})")
    return fns


def check_trainable(rank: int, labelled, params: Mapping[int, tuple],
                    built: Mapping[int, frozenset]) -> None:
    """What trains is fixed when the executor is built (each op's gradient targets and
    the optimizer's parameters come from it): for each ``(label, module)`` of
    ``labelled``, ``params[id(module)]`` (its trainable parameters then) and
    ``built[id(module)]`` (the ids of all its parameters then). A parameter whose
    ``requires_grad`` changed since, or one added, removed or replaced since, is refused
    before any communication, rather than left without a gradient (or given one no
    optimizer applies)."""
    for label, module in labelled:
        trained = tuple(map(id, params[id(module)]))
        named = list(module.named_parameters())
        if tuple(id(p) for _, p in named if p.requires_grad) == trained:
            continue
        changed = next(((n, p) for n, p in named if id(p) in built[id(module)]
                        and p.requires_grad != (id(p) in trained)), None)
        if changed is not None:
            name, p = changed
            what = (f"parameter {name!r} of {label} has requires_grad={p.requires_grad} "
                    f"but had {not p.requires_grad} when the executor was built")
        else:
            what = (f"the trainable parameters of {label} were added, removed or "
                    "replaced since the executor was built")
        raise PipelineError(
            f"rank {rank}: {what}: the executor trains the parameters that required "
            "a gradient then; build a new PipelineExecutor (and optimizer) after changing "
            "a module's parameters or their requires_grad")
