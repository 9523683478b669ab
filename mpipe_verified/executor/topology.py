"""Where a pipeline runs in the world: its process group and its data-parallel replicas.

Plan rank ``r`` is rank ``r`` of the *pipeline group*. Without a group the pipeline is the
whole world (``world == pp``). With one (``group=`` or a ``DeviceMesh`` dimension) the
world holds several pipelines; a *data-parallel group* joins the ranks that hold the same
plan rank in different replicas (each replica runs the same certified plan on its own
pipeline group) and their gradients are summed over it after the plan.

Groups the executor posts on after start-up are its own (``run_group``), made with the
*wait* timeout: a gloo collective stuck on a hung peer keeps its worker thread, and so
keeps the process from exiting, until its group's own timeout (``abort``/``shutdown``
do not release it in torch 2.13), so no collective the executor posts may outlive the
wait timeout. They are made with local synchronisation: only their members take part.
"""

from __future__ import annotations

import datetime

import attrs
import torch
import torch.distributed as dist

from ..ir import Collective, computes_of
from ..semantics import REPLICA, collective_segment
from . import replicas
from .errors import PipelineError

_RUN_GROUPS: dict[tuple[tuple[int, ...], float], object] = {}


@attrs.frozen(eq=False)
class Topology:
    """``pp_ranks[r]``: the global rank of plan rank ``r`` of this pipeline;
    ``dp_ranks[i]``: the global rank of replica ``i``'s copy of this rank (``(me,)``
    without data parallelism). ``pp_group``/``dp_group``: the caller's groups (None: the
    default group / no data parallelism), used for the start-up handshake."""

    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    pp_group: object = None
    dp_group: object = None

    @property
    def plan_rank(self) -> int:
        return self.pp_ranks.index(dist.get_rank())

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(dist.get_rank())

    @property
    def replicas(self) -> int:
        return len(self.dp_ranks)


def groups_of(group=None, mesh=None, pp_dim: str = "pp", dp_group=None,
              dp_dim: str | None = None) -> tuple[object, object]:
    """``(pipeline group, data-parallel group)`` from the executor's arguments."""
    if mesh is not None:
        if group is not None or dp_group is not None:
            raise PipelineError("give either mesh= (with pp_dim=, dp_dim=) or group= "
                                "(with dp_group=), not both")
        names = mesh.mesh_dim_names or ()
        for dim in (pp_dim, dp_dim):
            if dim is not None and dim not in names:
                raise PipelineError(f"the mesh has no dimension {dim!r} (it has {names})")
        return mesh.get_group(pp_dim), (mesh.get_group(dp_dim) if dp_dim else None)
    if dp_dim is not None:
        raise PipelineError("dp_dim= names a dimension of mesh=, but no mesh was given")
    return group, dp_group


def resolve(num_ranks: int, group=None, dp_group=None) -> Topology:
    """The topology of this process (the process group must be up). Refuses a pipeline
    group whose size is not the plan's, a world that is not a multiple of it, and a
    data-parallel group that shares another rank with the pipeline group."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world % num_ranks:
        raise PipelineError(f"the world has {world} processes, not a multiple of the plan's "
                            f"{num_ranks} pipeline ranks")
    if group is None and world != num_ranks:
        raise PipelineError(f"the plan has {num_ranks} ranks but the world has {world}: pass "
                            "group= or mesh= to run the pipeline on a part of the world "
                            "(e.g. executor.pipeline_mesh)")
    pp = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
    if len(pp) != num_ranks:
        raise PipelineError(f"the plan has {num_ranks} ranks but the pipeline group has "
                            f"{len(pp)}")
    dp = tuple(dist.get_process_group_ranks(dp_group)) if dp_group is not None else (me,)
    if me not in pp or me not in dp or set(pp) & set(dp) != {me}:
        raise PipelineError(f"global rank {me}: the pipeline group {list(pp)} and the "
                            f"data-parallel group {list(dp)} must meet in this rank only")
    return Topology(pp, dp, group, dp_group)


def pipeline_mesh(pp: int, device_type: str | None = None):
    """A ``DeviceMesh`` of the world as ``(dp, pp)`` (dimension names ``"dp"``, ``"pp"``):
    pipeline ``i`` is global ranks ``i*pp .. i*pp+pp-1``, its replicas the same column.
    The process group must be up; a world that is not a multiple of ``pp`` is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if pp < 1 or world % pp:
        raise PipelineError(f"the world has {world} processes, not a multiple of the plan's "
                            f"{pp} pipeline ranks")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (world // pp, pp), mesh_dim_names=("dp", "pp"))


def run_group(ranks: tuple[int, ...], timeout_s: float):
    """The executor's own group over global ``ranks`` with the wait timeout (made once per
    process, by its members only; every member asks for the same groups in the same
    order, because each derives them from the same certified plan)."""
    key = (tuple(sorted(ranks)), timeout_s)
    if key not in _RUN_GROUPS:
        _RUN_GROUPS[key] = dist.new_group(list(key[0]), use_local_synchronization=True,
                                          timeout=datetime.timedelta(seconds=timeout_s))
    return _RUN_GROUPS[key]


@attrs.frozen(eq=False)
class Links:
    """The groups a connected rank posts on, all with the wait timeout: the pipeline's
    (``pp``; ``peer[r]``: plan rank ``r``'s rank in it), each plan collective's, each
    shared segment's holders' and each replicated model stage's holders' (several
    pipelines) by their sorted plan ranks (``groups``), the replicas' (``dp``, None
    without replicas); ``pp_ranks[r]``: plan rank ``r``'s global rank."""

    pp: object
    peer: tuple
    groups: dict
    dp: object
    pp_ranks: tuple


def run_links(topo: Topology, plan, program, segments, timeout_s: float) -> Links:
    """The ``Links`` of a rank running ``program`` of ``plan`` and holding ``segments``
    (names), made with ``run_group``."""
    pp = run_group(topo.pp_ranks, timeout_s)
    wanted = sorted({tuple(sorted(op.ranks)) for op in program if isinstance(op, Collective)}
                    | {ranks for name in segments if len(ranks := holders(plan, name)) > 1}
                    | replicas.holder_groups(plan, topo.plan_rank))
    groups = {ranks: (pp if len(ranks) == len(topo.pp_ranks)
                      else run_group(tuple(topo.pp_ranks[r] for r in ranks), timeout_s))
              for ranks in wanted}
    return Links(pp, tuple(dist.get_group_rank(pp, g) for g in topo.pp_ranks), groups,
                 run_group(topo.dp_ranks, timeout_s) if topo.replicas > 1 else None,
                 topo.pp_ranks)


def segments_touched(program) -> set[str]:
    """The segments a rank's ``program`` runs (a compute of it) or exchanges (its
    ``params:``/``grads:`` collective; a ``replica:J`` sum is a model stage's): the ones
    the rank holds a module of."""
    used = {c.segment for op in program for c in computes_of(op) if c.segment}
    return used | {tagged[1] for op in program
                   if isinstance(op, Collective) and (tagged := collective_segment(op))
                   and tagged[0] != REPLICA}


def holders(plan, name: str) -> tuple[int, ...]:
    """The plan ranks that hold a copy of segment ``name``: every rank whose program
    runs or exchanges it (those given its module; the same on every rank)."""
    return tuple(r for r, program in enumerate(plan.programs)
                 if name in segments_touched(program))


def forget_run_groups() -> None:
    """Drop the cached groups (the process group they belong to was destroyed)."""
    _RUN_GROUPS.clear()


def flatten_grads(params) -> torch.Tensor:
    """Every parameter's gradient (zeros where none) in one tensor (``torch.cat``
    promotes mixed dtypes), then one flag per parameter (1 where it has a gradient): the
    layout ``unflatten_grads`` reads back. Summed over ranks, a flag says how many had a
    gradient."""
    if not params:
        return torch.zeros(0)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
             for p in params]
    flags = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype,
                         device=grads[0].device)
    return torch.cat([*grads, flags])


def unflatten_grads(params, flat: torch.Tensor) -> None:
    """Write ``flat``'s gradients back to ``params`` (each in its own dtype); a
    parameter that no rank of the sum had a gradient for keeps None, as autograd leaves
    an unused parameter (so an optimizer's weight decay and momentum skip it)."""
    offset, flags = 0, flat[flat.numel() - len(params):].tolist()
    for p, flag in zip(params, flags):
        p.grad = (flat[offset:offset + p.numel()].view_as(p).to(p.dtype, copy=True)
                  if flag else None)
        offset += p.numel()
