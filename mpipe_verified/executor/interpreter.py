"""Per-rank interpreter of a certified plan over ``torch.distributed`` (docs/executor.md).

One ``PipelineExecutor`` per process runs ``plan.programs[rank]`` op by op, in order:

- ``F``: the stage (or cut segment) forward; at the body's last stage also the loss, scaled
  so that the sum over microbatches is the full batch's loss (``loss_reduction="mean"``:
  each microbatch's mean loss weighted by its share of the rows). ``B``: backward through
  the stored graph (``torch.autograd.backward`` into the stage's parameters and input).
  ``I``: input gradient only, keeping the gradient that reaches each parameter node;
  ``W``: the weight gradients from those nodes (``split_backward``: no second
  traversal). ``R``: re-run a segment's forward from its shipped input, under the RNG
  state that forward ran with (shipped along: ``comm.ShippedInput``), to rebuild the
  graph a following ``B`` needs. ``Overlap`` steps run their members one after the
  other, all reading their inputs first and publishing after.
- ``SEND``/``RECV``: ``isend``/``irecv``; a ``Group``: ``batch_isend_irecv`` of its
  members. Every comm op is *posted* at its place in the plan, in plan order. With
  ``overlap_comms=False`` the rank then waits for it at once (the rendezvous program of
  docs/semantics.md §2, literally). By default (``overlap_comms=True``) it waits for each
  comm op just before the next comm op is posted (the compute ops between them overlap
  its transfer), or earlier, just before the first op that reads a value it receives;
  the last one before the step ends (gloo reports a transfer complete only once it is
  waited for, so waiting at the step's end would keep every buffer of the step in
  flight). Over gloo an op that receives is waited for at once: gloo's event-loop thread
  spins while a receive is pending, on the cores the compute needs
  (benchmarks/executor.md); over other backends its wait is deferred as above. This is safe for every certified plan: each comm op is still waited for
  before the next one is posted (a collective excepted: gloo progresses a pending
  transfer without a wait), so transfers are posted and completed in the rendezvous
  order with only computes moved ahead; a plan that completes under rendezvous completes
  here, and a value is still read only after its transfer completed. Messages are
  checked against the plan's payloads (``comm``).
- ``Collective``: ``broadcast`` tagged ``params:NAME`` sends segment NAME's parameters
  from the root; ``all_reduce`` tagged ``grads:NAME`` sums its weight gradients.

Cut segments: the body's first stage is called with every source's output (in cut
order), then the batch's body input; its input gradient is one value per source
(``_PerSource``), each part sent to (or read by) that source's backward. A sink is called
with the body's last output, detached, and adds its own loss (``segment_loss_fns``).
``eval`` runs a forward-only plan under ``no_grad`` and keeps the last stage's (and each
sink's) outputs; ``step``/``run`` refuse such a plan and ``eval`` a training one.
Values: a stage's output is one tensor or a structure (tuples, lists, dicts of tensors
and None; ``tree``), sent as the plan's payload layout says (``packed``). A stage's
input takes a gradient in its float leaves only: one float tensor always, a
structure's float leaves where the plan ships a gradient back (or, from a stage on this
rank, where they required one); a backward starts from every output leaf that received a
gradient.
Groups (``topology``): plan rank ``r`` is rank ``r`` of the pipeline group (the world by
default). With data-parallel replicas, each runs the plan on its own pipeline group on
its block of the batch's rows, and after the plan, outside it, this rank's gradients (and
the loss) are summed over its data-parallel group (``_reduce_replicas``), each replica's
microbatch weights already scaled by its share of the whole batch's rows.

Dependencies are not re-derived here: the rank keeps a store keyed by the shared
semantics' tokens ``(kind, segment, stage, mb)``. ``Chain.needs(op, rank)`` says which
tokens an op reads (checked present before it runs) and ``produces(op)`` which it leaves
(a ``RECV`` fills its payload's token, a ``SEND`` sends its payload's token). A token is
kept only if a later op of this rank needs it and dropped after its last use, so stored
activations are freed exactly where the semantics' memory model frees them; a forward
whose stored activation no later op needs runs without building a graph.
``stored_peak`` counts them: the most stored activations (``stored`` values and the
``wgrad_ready`` values that keep the same graph for ``W``, one graph counted once) held
at once in the last run, allocations of a step counted before its frees.

Certified plans only: the constructor calls ``check_certificate`` before anything else
(no process group is touched when it refuses), and ``connect`` compares every rank's plan
digest before the first op runs.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import types
from typing import Callable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..ir import (BACKWARD, BODY, FORWARD, GRAD, INPUT_GRAD, RECOMPUTE, SINK, SOURCE,
                  WEIGHT_GRAD, Collective, Compute, Group, Idle, Marker, Overlap, Plan, Recv, Send)
from ..ir import computes_of, p2p_of
from ..semantics import (GRADS, PARAMS, RENDEZVOUS, Chain, Token, collective_segment,
                         produces)
from ..verify.report import Certificate
from . import (batch_fit, buffers, clipping, comm, loss, model_checks, packed, partition,
               split_backward, topology, tree)
from .batch import Batch
from .errors import BatchError, CertificateError, PeerError, PipelineError, check_certificate
from .stage_setup import StageSetup  # torch.compile and checkpointing (docs/executor.md)

_WATCHDOG: comm.Watchdog | None = None
_MISSING = object()


@attrs.frozen
class _Saved:
    """What a forward keeps for its backward: the input tensors whose gradient the plan
    ships back (``leaves``), the graph's output (the scaled loss at the last stage or a
    sink; else the stage's output value, a tensor or a structure) and the parameters that
    receive weight gradients. ``parts``: per input that takes a gradient, in order, ``(its
    segment, how many of leaves are its, their paths)`` (paths None: the input is one
    tensor). The backward's input gradient is the first part's, or, at the body's first
    stage under a cut (``per_source``), one value per source (``_PerSource``)."""

    leaves: tuple
    output: object
    params: tuple
    parts: tuple = ()
    per_source: bool = False


class _PerSource(dict):
    """The body's first-stage input gradient (one semantics token, ``grad`` of body stage
    0) as a value: source name -> that source's part. Where it is received, each part
    arrives by its own ``RECV`` (possibly still in flight, ``_Pending``) and is merged
    in; an op reads only its own part (``_part``)."""


@attrs.frozen
class Evaluation:
    """What ``eval`` returns on a rank that holds results: ``outputs[mb]``, the body's
    last-stage output per microbatch (None off that stage's rank); ``losses[mb]`` and
    ``loss`` (the microbatches' losses weighted as in training) when the batch has a
    target; ``segment_outputs[name][mb]``, a sink segment's output per microbatch run
    here."""

    outputs: tuple | None = None
    loss: float | None = None
    losses: tuple | None = None
    segment_outputs: Mapping[str, Mapping[int, object]] = attrs.field(
        factory=dict, converter=lambda d: types.MappingProxyType(
            {k: types.MappingProxyType(dict(v)) for k, v in d.items()}))


class _Transfer:
    """Posted point-to-point works of one plan step (``overlap_comms``): waited for when
    the next comm op is posted, or before, when a received value is first used."""

    __slots__ = ("works", "buffers", "where", "peers", "done")

    def __init__(self, works: list, buffers: list, where: str, peers: str) -> None:
        self.works, self.where, self.peers, self.done = works, where, peers, False
        self.buffers = buffers  # kept alive until the works complete


class _Pending:
    """A received value whose transfer may still be in flight (``buf`` None once read)."""

    __slots__ = ("transfer", "buf", "payload", "src")

    def __init__(self, transfer: _Transfer, buf, payload, src: int) -> None:
        self.transfer, self.buf, self.payload, self.src = transfer, buf, payload, src


@attrs.frozen
class _Instr:
    index: int
    op: object
    needs: tuple            # tokens read (checked present first)
    keep: frozenset         # produced tokens some later op needs
    drop: tuple             # tokens whose last use is this op
    members: tuple = ()     # per compute member of an Overlap: its own needs
    where: str = ""         # "OP at position I", for messages
    peers: str = ""         # the ranks a comm step talks to, for messages
    p2p: tuple = ()         # per send/receive: (is_send, payload, peer, token)


class PipelineExecutor:
    """Run a certified ``plan`` on this rank.

    ``stages``: the body's stage modules (a mapping ``stage -> module`` or a sequence
    indexed by stage; only this rank's stages are used). ``segments``: cut segments'
    modules by name (e.g. ``{"vision": encoder}``), needed on every rank whose program
    touches the segment. ``loss_fn(output, target)``: the loss at the body's last stage
    (a mean over the microbatch's rows when ``loss_reduction="mean"``).
    ``segment_loss_fns``: each sink segment's loss, ``fn(sink_output, target)`` with the
    target ``batch.segments[name]`` (a sink is detached: its loss trains the sink only;
    weighted like the body's). ``optimizer``: a callable ``params ->
    torch.optim.Optimizer`` over ``self.parameters()`` (used by ``step``).
    ``check_messages``: send a self-describing trailer with every message (see ``comm``).
    ``timeout``: seconds every wait may take (default ``MPIPE_TIMEOUT`` or 300);
    ``startup_timeout``: joining the process group and the handshake (default
    ``MPIPE_STARTUP_TIMEOUT`` or torch.distributed's 30 min). ``group``, or ``mesh`` and
    ``pp_dim``: the pipeline's process group (default: the world, which must then have
    the plan's ranks); ``dp_group`` or ``dp_dim``: its data-parallel group.

    Calling order: construct (refuses uncertified plans), ``connect()`` (process group
    and digest handshake; ``step``/``run`` call it if needed), then ``step(batch)`` per
    training step.
    """

    def __init__(self, plan: Plan, certificate: Certificate | None, *,
                 stages: Mapping[int, nn.Module] | Sequence[nn.Module],
                 loss_fn: Callable, segments: Mapping[str, nn.Module] | None = None,
                 segment_loss_fns: Mapping[str, Callable] | None = None,
                 optimizer: Callable | None = None, rank: int | None = None,
                 device: torch.device | str | None = None, check_messages: bool = True,
                 timeout: float | datetime.timedelta | None = None,
                 loss_reduction: str = "mean", overlap_comms: bool = True,
                 group=None, mesh=None, pp_dim: str = "pp", dp_group=None,
                 dp_dim: str | None = None,
                 startup_timeout: float | datetime.timedelta | None = None,
                 ignore_index: int | None = None, loss_weight: Callable | None = None) -> None:
        # Refuse before anything else: no process group, no traffic.
        check_certificate(plan, certificate, RENDEZVOUS)
        self.plan, self.certificate = plan, certificate
        self.chain = Chain.of(plan)
        self._pp_group, self._dp_group = topology.groups_of(group, mesh, pp_dim, dp_group,
                                                            dp_dim)
        self.rank = self._rank(rank)
        self.num_stages = plan.placement.num_stages
        self.last_stage = self.num_stages - 1
        self.device = torch.device(device) if device is not None else None
        self.check_messages = check_messages
        self.overlap_comms = overlap_comms
        self._defer_receives: bool | None = None  # None: decided by the backend (connect)
        self.timeout_s = comm.timeout_seconds(timeout)
        self.startup_s = comm.startup_seconds(startup_timeout)
        loss.check_options(loss_reduction, ignore_index, loss_weight)
        self.loss_reduction = loss_reduction
        self.ignore_index, self.loss_weight = ignore_index, loss_weight
        self.loss_fn = loss_fn
        self.program = plan.programs[self.rank]
        self.stages = self._local_stages(stages)
        self.segments = self._local_segments(dict(segments or {}))
        model_checks.check_model(plan, stages, dict(segments or {}))
        self.segment_loss_fns = self._sink_losses(dict(segment_loss_fns or {}))
        self._params = {id(m): tuple(p for p in m.parameters() if p.requires_grad)
                        for m in (*self.stages.values(), *self.segments.values())}
        self._built = {id(m): frozenset(map(id, m.parameters()))  # trainable or not
                       for m in (*self.stages.values(), *self.segments.values())}
        self._direct = {id(m): split_backward.direct_allowed(m)
                        for m in (*self.stages.values(), *self.segments.values())}
        self._setup = StageSetup(self.rank, self.program)  # before any forward compiles
        self._check_payloads()
        self._instrs = self._compile()
        self._received = frozenset(t for op in self.program for c in p2p_of(op)
                                   if type(c) is Recv for t in produces(c))
        self._grad_paths = {  # (segment, stage, mb, to_segment) of a sent gradient -> paths
            (c.payload.segment, c.payload.stage, c.payload.mb, c.payload.to_segment):
            frozenset(x.path for x in c.payload.leaves)
            for op in self.program for c in p2p_of(op)
            if type(c) is Send and c.payload.kind == GRAD and c.payload.leaves is not None}
        self.optimizer = optimizer(self.parameters()) if optimizer is not None else None
        self.steps = 0  # optimizer steps taken by step() (state_dict keeps it)
        self._connected = self._failed = False
        self._groups: dict[tuple[int, ...], object] = {}
        self.store: dict = {}
        self.stored_peak = 0  # most stored activations held at once in the last run
        self._evaluating = False
        self._fitting = None  # the signature of the last batch found to fit the plan
        self._first_sends = batch_fit.first_sends(self.program, plan.cut)

    # ------------------------------------------------------------ set-up checks

    def _rank(self, rank: int | None) -> int:
        if rank is None and self._pp_group is not None:
            rank = dist.get_rank(self._pp_group)
        world = None
        if rank is None:
            if dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
            elif "RANK" in os.environ:
                rank, world = int(os.environ["RANK"]), os.environ.get("WORLD_SIZE")
            else:
                raise PipelineError("no rank given and RANK is not set")
        if not 0 <= rank < self.plan.num_ranks:
            whole = (f" (the world has {world} processes)" if world is not None else "")
            raise PipelineError(
                f"rank {rank} is outside the plan's ranks 0..{self.plan.num_ranks - 1}"
                f"{whole}: to run the pipeline on a part of the world (with data-parallel "
                "replicas), pass group= or mesh= (e.g. executor.pipeline_mesh), or launch "
                "as many processes as the plan has ranks")
        return rank

    def _local_stages(self, stages) -> dict[int, nn.Module]:
        mine = self.plan.placement.stages_of(self.rank)
        if isinstance(stages, Mapping):
            table = dict(stages)
        else:
            stages = list(stages)
            if len(stages) != self.num_stages:
                raise PipelineError(f"rank {self.rank}: {len(stages)} stage modules for a plan "
                                    f"with {self.num_stages} stages")
            table = dict(enumerate(stages))
        missing = [s for s in mine if s not in table]
        if missing:
            raise PipelineError(f"rank {self.rank}: no module for stage(s) {missing} "
                                f"(placed on this rank)")
        return {s: table[s] for s in mine}

    def _local_segments(self, segments: dict) -> dict[str, nn.Module]:
        used = _segments_touched(self.program)
        missing = sorted(used - set(segments))
        if missing:
            raise PipelineError(f"rank {self.rank}: the plan runs segment(s) "
                                f"{', '.join(missing)} here but no module was given "
                                "(segments={name: module})")
        return {name: segments[name] for name in sorted(used)}

    def _sink_losses(self, fns: dict) -> dict[str, Callable]:
        """Every sink segment that may train here has its loss (``segment_loss_fns``)."""
        sinks = {s.name for s in self.plan.cut.segments if s.side == SINK}
        unknown = sorted(set(fns) - sinks)
        if unknown:
            raise PipelineError(f"segment_loss_fns names {', '.join(unknown)}, which the plan "
                                f"has no sink segment of (sinks: {sorted(sinks) or 'none'})")
        missing = sorted(name for name in sinks & set(self.segments)
                         if name not in fns and not self.plan.forward_only)
        if missing:
            raise PipelineError(f"rank {self.rank}: the plan runs sink segment(s) "
                                f"{', '.join(missing)} here but no loss was given "
                                "(segment_loss_fns={name: fn})")
        return fns

    def _check_payloads(self) -> None:
        for index, op in enumerate(self.program):
            for c in p2p_of(op):
                try:
                    if c.payload.leaves is None:
                        comm.expected_layout(c.payload)
                    else:
                        packed.check_plan(c.payload)
                except PipelineError as err:
                    raise PipelineError(f"rank {self.rank}: {op} at position {index}: "
                                        f"{err}") from None

    def _compile(self) -> tuple[_Instr, ...]:
        """Precompute each op's needs, which produced tokens to keep and what to drop,
        from ``Chain.needs``/``produces`` (the shared semantics)."""
        needs = [self.chain.needs(op, self.rank) for op in self.program]
        last: dict = {}
        for index, tokens in enumerate(needs):
            for t in tokens:
                last[t] = index
        out = []
        for index, op in enumerate(self.program):
            keep = frozenset(t for t in produces(op) if last.get(t, -1) > index)
            drop = tuple(dict.fromkeys(t for t in needs[index] if last[t] == index))
            members = (tuple(self.chain.needs(c, self.rank) for c in op.ops)
                       if isinstance(op, Overlap) else ())
            peers = ", ".join(f"rank {r}" for r in sorted({c.peer for c in p2p_of(op)}))
            p2p = tuple((type(c) is Send, c.payload, c.peer,
                         self.chain.needs(c, self.rank)[0] if type(c) is Send
                         else produces(c)[0]) for c in p2p_of(op))
            out.append(_Instr(index, op, needs[index], keep, drop, members,
                              f"{op} at position {index}", peers, p2p))
        return tuple(out)

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters this rank updates: its stages', plus each cut segment's on
        the segment's home rank (other copies are refreshed by the plan's broadcast)."""
        out, seen = [], set()
        modules = list(self.stages.values())
        for name, module in self.segments.items():
            seg = self.plan.cut.get(name)
            if seg is not None and seg.home == self.rank:
                modules.append(module)
        for module in modules:
            for p in self._params[id(module)]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def zero_grad(self) -> None:
        for module in (*self.stages.values(), *self.segments.values()):
            for p in module.parameters():
                p.grad = None

    # ------------------------------------------------------------ process group

    def connect(self) -> None:
        """Join (or start) the process group, check that every rank runs this very plan
        (digest handshake), and create the sub-groups the plan's collectives use."""
        if self._connected:
            return
        check_certificate(self.plan, self.certificate, RENDEZVOUS)
        _, _, device = comm.init_distributed(self.startup_s)
        self.device = self.device or device
        self.topology = topo = topology.resolve(self.plan.num_ranks, self._pp_group,
                                                self._dp_group)
        if topo.plan_rank != self.rank:
            raise PipelineError(f"executor built for rank {self.rank} runs as rank "
                                f"{topo.plan_rank} of its pipeline group")
        global _WATCHDOG
        if _WATCHDOG is None:
            _WATCHDOG = comm.Watchdog(self.rank)
        self._watchdog = _WATCHDOG
        self._handshake(topo.pp_group, len(topo.pp_ranks), "the plan digest handshake")
        names = sorted(seg.name for seg in self.plan.cut.segments)
        self._same_layouts(topo.pp_group, len(topo.pp_ranks), names,
                           [self.segments.get(name) for name in names])
        if topo.replicas > 1:
            self._handshake(topo.dp_group, topo.replicas, "the replicas' plan handshake",
                            same_rank=True)
            self._same_layouts(topo.dp_group, topo.replicas, ["all parameters"],
                               [self.parameters()], replicas=True)
        self._run_groups(topo)
        self._copies = self._buffer_copies(topo)
        for copies, _, broadcasts, _ in self._copies.values():
            copies.start_up(broadcasts)
        if self._defer_receives is None:  # see the module docstring (comm modes)
            self._defer_receives = dist.get_backend(self._pp) != "gloo"
        self.messages = packed.Messages(self.rank, self.device, self.check_messages)
        self._connected = True

    def _run_groups(self, topo: topology.Topology) -> None:
        """The groups posted on after start-up, all with the wait timeout: the pipeline's
        (p2p, loss), each plan collective's members', the replicas'."""
        self._pp = topology.run_group(topo.pp_ranks, self.timeout_s)
        self._peer = [dist.get_group_rank(self._pp, g) for g in topo.pp_ranks]
        wanted = sorted({tuple(sorted(op.ranks)) for op in self.program
                         if isinstance(op, Collective)}
                        | {holders for name in self.segments
                           if len(holders := self._holders(name)) > 1})
        for ranks in wanted:
            members = tuple(topo.pp_ranks[r] for r in ranks)
            self._groups[ranks] = (self._pp if len(ranks) == len(topo.pp_ranks)
                                   else topology.run_group(members, self.timeout_s))
        self._dp = (topology.run_group(topo.dp_ranks, self.timeout_s)
                    if topo.replicas > 1 else None)

    def _holders(self, name: str) -> tuple[int, ...]:
        """The plan ranks that hold a copy of segment ``name``: every rank whose program
        runs or exchanges it (those given its module; the same on every rank)."""
        return tuple(r for r, program in enumerate(self.plan.programs)
                     if name in _segments_touched(program))

    def _buffer_copies(self, topo: topology.Topology) -> dict:
        """``id(module) -> (Copies, reduces, broadcasts, first)`` for each module of this
        rank that has buffers and other copies (``buffers``): a segment held by several
        ranks (summed over its holders, broadcast from its home, or its lowest holder when
        home holds none), any module when there are replicas (over the data-parallel
        group, from replica 0); ``first``: this rank holds the copy broadcast from."""
        out = {}
        held = [(None, m) for m in self.stages.values()] + list(self.segments.items())
        for name, module in held:
            if next(module.buffers(), None) is None:
                continue
            reduces, broadcasts, first = [], [], True
            if name is not None:  # a segment
                holders = self._holders(name)
                if len(holders) > 1:
                    group = self._groups[holders]
                    home = self.plan.cut.get(name).home
                    root = home if home in holders else holders[0]
                    reduces.append(self._summing(group, f"ranks {list(holders)}"))
                    broadcasts.append(self._broadcasting(group, topo.pp_ranks[root],
                                                         f"rank {root}"))
                    first = self.rank == root
            if self._dp is not None:
                reduces.append(self._summing(self._dp, "its replicas"))
                broadcasts.append(self._broadcasting(self._dp, topo.dp_ranks[0], "replica 0"))
                first = first and topo.dp_rank == 0
            if reduces:
                m = self.plan.num_microbatches * topo.replicas
                out[id(module)] = (buffers.Copies(module, m), reduces, broadcasts, first)
        return out

    def _summing(self, group, peers: str):
        def reduce(t: torch.Tensor) -> None:
            d = t.to(self.device)
            self._wait([dist.all_reduce(d, group=group, async_op=True)],
                       "the buffer statistics all-reduce", peers)
            t.copy_(d)
        return reduce

    def _broadcasting(self, group, root: int, peers: str):
        def broadcast(t: torch.Tensor) -> None:  # as bytes: gloo has no int16 or float8
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device,
                                                                            copy=True)
            self._wait([dist.broadcast(raw, root, group=group, async_op=True)],
                       "the buffer broadcast", peers)
            with torch.no_grad():
                t.copy_(raw.to(t.device).view(t.dtype).view(t.shape))
        return broadcast

    def close(self) -> None:
        """Leave the process group cleanly: wait until every rank is done (so no rank tears
        down a connection a peer still uses), then, when the pipeline is the whole world
        (no ``group=``/``mesh=``), destroy the process group. Without this, gloo's threads
        may be torn down while still running at interpreter exit (SIGABRT). After a
        ``PipelineError`` it does nothing: the process can exit as it is."""
        if not self._connected:
            return
        self._connected = False
        if self._failed:  # a peer may be gone: no barrier; the process can simply exit
            return
        if dist.is_initialized():
            for group, who in ((self._pp, "its pipeline"), (self._dp, "its replicas")):
                if group is not None:
                    self._wait([dist.barrier(group=group, async_op=True)],
                               "the closing barrier", who)
            if self._pp_group is None and self._dp_group is None:
                topology.forget_run_groups()
                dist.destroy_process_group()

    def _handshake(self, group, size: int, what: str, same_rank: bool = False) -> None:
        """All-gather ``(digest, plan rank)`` over ``group`` (start-up timeout): its ranks
        must run one plan, and with ``same_rank`` (replicas) as the same plan rank."""
        mine = torch.tensor([*bytes.fromhex(self.certificate.digest), self.rank],
                            dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in range(size)]
        self._wait([dist.all_gather(every, mine, group=group, async_op=True)], what,
                   "its group", self.startup_s)
        digests = [bytes(t[:-1].tolist()).hex() for t in every]
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        odd = [r for r, d in enumerate(digests) if d != digests[me]]
        if odd:
            raise CertificateError(
                f"rank {self.rank} runs plan {digests[me][:16]}… but rank(s) "
                f"{odd} of its group run {digests[odd[0]][:16]}…: every rank must run the "
                "same certified plan")
        ranks = [int(t[-1]) for t in every]
        if same_rank and len(set(ranks)) != 1:
            raise PipelineError(f"rank {self.rank}: {what}: the data-parallel group's "
                                f"ranks hold plan ranks {ranks}; each replica's copy of a "
                                "rank must be the same plan rank")

    def _same_layouts(self, group, size: int, labels: list, holders: list,
                      replicas: bool = False) -> None:
        """All-gather a fingerprint of each holder's trainable parameters (names, shapes,
        dtypes, in order; a module, a list of parameters, or None) over ``group``: the
        members of one segment's ``grads:NAME`` all-reduce, or one rank's replicas, must
        pack the same layout, else the sum would add different parameters' gradients
        together, silently. Every rank of ``group`` sees every fingerprint and decides
        alike, so all of them refuse together (no rank is left waiting for the others)."""
        prints = [_layout_print(self._trainable_named(h)) for h in holders]
        mine = torch.tensor([*self.rank.to_bytes(4, "little"), *b"".join(prints)],
                            dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in range(size)]
        self._wait([dist.all_gather(every, mine, group=group, async_op=True)],
                   "the parameter layout handshake", "its group", self.startup_s)
        rows = [bytes(t.tolist()) for t in every]
        if replicas:  # by the replicas' global ranks (one plan rank)
            who = dict(zip(self.topology.dp_ranks, rows))
        else:  # by plan rank
            who = {int.from_bytes(row[:4], "little"): row for row in rows}
        for k, label in enumerate(labels):
            members = sorted(who) if replicas else self._summing_members(label)
            seen = {r: who[r][4 + 16 * k:20 + 16 * k] for r in members if r in who}
            if len(set(seen.values())) > 1:
                groups: dict = {}
                for r, fingerprint in seen.items():
                    groups.setdefault(fingerprint, []).append(r)
                split = " against ".join(str(g) for g in sorted(groups.values()))
                raise PipelineError(
                    f"rank {self.rank}: {'the replicas' if replicas else f'segment {label!r}'}"
                    f": ranks {split} hold different trainable parameters (names, shapes, "
                    "dtypes or requires_grad), so their gradients cannot be summed")

    def _trainable_named(self, holder) -> list:
        """``(name, shape, dtype)`` of each trainable parameter of ``holder`` (a module:
        names from it; a list of this rank's parameters: names from the module that holds
        each first)."""
        if holder is None:
            return []
        if not isinstance(holder, list):
            names = {id(p): n for n, p in holder.named_parameters()}
            return [(names[id(p)], tuple(p.shape), str(p.dtype))
                    for p in self._params[id(holder)]]
        names: dict = {}
        for label, module in self._labelled_modules():
            for n, p in module.named_parameters():
                names.setdefault(id(p), f"{label}.{n}")
        return [(names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in holder]

    def _summing_members(self, name: str) -> list:
        """The plan ranks of the ``grads:NAME`` all-reduce, read from any rank's program
        (so every rank finds the same; none when there is none)."""
        for program in self.plan.programs:
            for op in program:
                if (isinstance(op, Collective) and op.kind == "all_reduce"
                        and collective_segment(op) == (GRADS, name)):
                    return sorted(op.ranks)
        return []

    # ------------------------------------------------------------ a training step

    def step(self, batch: Batch, broadcast_loss: bool = True, return_losses: bool = False,
             max_grad_norm: float | None = None):
        """``zero_grad``, ``run``, with ``max_grad_norm`` ``clip_grad_norm_``, then the
        optimizer step. Returns the batch loss (on every rank when ``broadcast_loss``,
        else on the last stage's rank, None elsewhere); with ``return_losses``, ``(loss,
        losses)`` where ``losses[mb]`` is microbatch ``mb``'s own loss (unweighted; a
        sink's loss added in)."""
        self._check_batch(batch)  # a refused batch leaves the gradients as they were
        self.zero_grad()
        result = self.run(batch, broadcast_loss, return_losses)
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm)
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps += 1
        return result

    def state_dict(self) -> dict:
        """What this rank needs to resume training exactly: its stage modules' and
        segment modules' state (every copy it holds), the optimizer's, the steps taken
        (``step`` calls), the random generators' states (CPU, and this rank's CUDA
        device), and the plan's digest and rank (a state loads only into an executor of
        the same plan, as the same rank). Every rank saves its own."""
        cuda = self.device is not None and self.device.type == "cuda"
        return {"plan": self.certificate.digest, "rank": self.rank, "steps": self.steps,
                "stages": {s: m.state_dict() for s, m in self.stages.items()},
                "segments": {n: m.state_dict() for n, m in self.segments.items()},
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self.device) if cuda else None}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore what ``state_dict`` saved (on this rank, of this plan; the modules'
        keys strictly)."""
        if state.get("plan") != self.certificate.digest or state.get("rank") != self.rank:
            raise PipelineError(
                f"rank {self.rank}: the state is of plan {str(state.get('plan'))[:16]}… rank "
                f"{state.get('rank')}, not of this executor's plan "
                f"{self.certificate.digest[:16]}… rank {self.rank}: load each rank's own state "
                "into an executor of the plan it was saved from")
        if set(state["stages"]) != set(self.stages) or set(state["segments"]) != set(
                self.segments):
            raise PipelineError(f"rank {self.rank}: the state holds stages "
                                f"{sorted(state['stages'])} and segments "
                                f"{sorted(state['segments'])}, this rank "
                                f"{sorted(self.stages)} and {sorted(self.segments)}")
        for s, m in self.stages.items():
            m.load_state_dict(state["stages"][s])
        for n, m in self.segments.items():
            m.load_state_dict(state["segments"][n])
        if (state["optimizer"] is None) != (self.optimizer is None):
            raise PipelineError(f"rank {self.rank}: the state was saved "
                                f"{'without' if state['optimizer'] is None else 'with'} an "
                                "optimizer, this executor has "
                                f"{'one' if self.optimizer is not None else 'none'}")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and self.device is not None \
                and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every
        gradient of the pipeline (each parameter counted once: a cut segment's on its
        home rank; replicas, equal after their sum, once) is computed with one all-reduce
        over the pipeline, every rank scales its own gradients alike, and every rank gets
        the norm (before clipping). A collective: call it on every rank of the pipeline,
        after ``run`` and before the optimizer step."""
        if not self._connected:
            raise PipelineError(f"rank {self.rank}: clip_grad_norm_ needs the gradients of "
                                "a run first")

        def reduce(t: torch.Tensor, is_max: bool) -> None:
            op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
            self._wait([dist.all_reduce(t, op=op, group=self._pp, async_op=True)],
                       "the gradient-norm all-reduce", "its pipeline")

        try:
            return clipping.clip_grad_norm(self.parameters(), max_norm, norm_type, reduce,
                                           self.device, error_if_nonfinite)
        except PeerError:
            self._failed = True
            raise

    def run(self, batch: Batch, broadcast_loss: bool = True, return_losses: bool = False):
        """Run the plan once on ``batch``: forward, backward and the plan's collectives;
        gradients accumulate into ``.grad``. Returns what ``step`` does."""
        if self.plan.forward_only:
            raise PipelineError(f"rank {self.rank}: this plan is forward-only (an evaluation "
                                "run): call eval(batch); step and run need a training plan")
        try:
            self._check_trainable()
        except PipelineError:
            self._failed = True  # its peers wait in vain: close() then skips its barrier
            raise
        self._check_batch(batch)
        self._evaluating = False
        self.connect()
        kept = self._set_aside_summed_grads()
        try:
            self._pass(batch)
            return self._losses_out(broadcast_loss, return_losses)
        except BatchError:  # refused by every rank before the plan began: still usable
            raise
        except PipelineError:
            self._failed = True  # close() then skips its barrier
            raise
        finally:
            _add_back(kept)

    def _summed_params(self) -> list[nn.Parameter]:
        """The parameters whose gradients a pass sums over ranks: those of each segment
        this rank all-reduces (``grads:NAME``), and every one when there are replicas."""
        if self.topology.replicas > 1:
            return [p for ps in self._params.values() for p in ps]
        tags = (collective_segment(op) for op in self.program
                if isinstance(op, Collective) and op.kind == "all_reduce")
        names = {name for role, name in filter(None, tags) if role == GRADS}
        return [p for name in names if name in self.segments
                for p in self._params[id(self.segments[name])]]

    def _set_aside_summed_grads(self) -> dict:
        """Take the summed parameters' gradients of earlier passes out of ``.grad`` (to be
        added back after this pass): each all-reduce must sum only this pass's own
        contributions, or a second ``run`` without ``zero_grad`` would add the earlier
        sum once per member again."""
        kept = {}
        for p in self._summed_params():
            if p.grad is not None and id(p) not in kept:
                kept[id(p)] = (p, p.grad)
                p.grad = None
        return kept

    @torch.no_grad()
    def eval(self, batch: Batch) -> Evaluation | None:
        """Run a forward-only plan on ``batch`` under ``torch.no_grad`` with every module
        in eval mode (dropout off, BatchNorm on its running statistics; each module's
        own mode is restored afterwards): an ``Evaluation`` on a rank that holds the last
        stage or runs a sink, None elsewhere. No gradient, buffer or optimizer state
        changes."""
        if not self.plan.forward_only:
            raise PipelineError(f"rank {self.rank}: eval needs a forward-only plan (this one "
                                "trains): derive it from forward_only(term), or "
                                "family(..., forward_only=True)")
        self._check_batch(batch)
        self._evaluating = True
        self._outputs: dict = {}
        self.connect()
        with _eval_mode([*self.stages.values(), *self.segments.values()]):
            self._pass(batch)
        losses = self._mb_losses
        sinks = {name: dict(sorted(outs.items())) for name, outs in self._outputs.items()
                 if name}
        body = self._outputs.get("")
        if body is None and not sinks:
            return None
        targets = self._mbs[0].target is not None
        return Evaluation(
            None if body is None else tuple(body[mb] for mb in range(len(self._mbs))),
            None if body is None or not targets else float(self._loss),
            None if body is None or not targets else tuple(float(losses[mb]) for mb in
                                                           range(len(self._mbs))),
            sinks)

    def _check_trainable(self) -> None:
        """What trains is fixed when the executor is built (each op's gradient targets and
        the optimizer's parameters come from it): a parameter whose ``requires_grad``
        changed since, or one added, removed or replaced since, is refused before any
        communication, rather than left without a gradient (or given one no optimizer
        applies)."""
        for label, module in self._labelled_modules():
            built = tuple(map(id, self._params[id(module)]))
            named = list(module.named_parameters())
            if tuple(id(p) for _, p in named if p.requires_grad) == built:
                continue
            changed = next(((n, p) for n, p in named if id(p) in self._built[id(module)]
                            and p.requires_grad != (id(p) in built)), None)
            if changed is not None:
                name, p = changed
                what = (f"parameter {name!r} of {label} has requires_grad={p.requires_grad} "
                        f"but had {not p.requires_grad} when the executor was built")
            else:
                what = (f"the trainable parameters of {label} were added, removed or "
                        "replaced since the executor was built")
            raise PipelineError(
                f"rank {self.rank}: {what}: the executor trains the parameters that required "
                "a gradient then; build a new PipelineExecutor (and optimizer) after changing "
                "a module's parameters or their requires_grad")

    def _check_batch(self, batch: Batch) -> None:
        """Refuse, before any communication, a batch the plan's microbatches cannot be cut
        from (the executor stays usable: the next batch may be fine)."""
        if not isinstance(batch, Batch):
            raise BatchError(f"rank {self.rank}: step/run/eval take a Batch, got "
                             f"{type(batch).__name__}")
        try:
            batch.split(self.plan.num_microbatches)
        except BatchError as err:
            raise BatchError(f"rank {self.rank}: the batch: {err}") from None

    def _check_fit(self, batch: Batch) -> None:
        """Refuse, on every rank and before the plan's first op, a batch whose first sends
        would not match the plan's payloads (``batch_fit``): checked once per batch
        signature, every rank of the pipeline and its replicas agreeing (one all-reduce
        of a flag per rank), so all of them raise ``BatchError`` together."""
        key = partition.signature(attrs.evolve(batch, target=None))
        if key == self._fitting:
            return
        sources = [s.name for s in self.plan.cut.segments if s.side == SOURCE]
        detail = batch_fit.first_mismatch(
            self._mbs, self._first_sends, self.stages.get(0),
            {n: m for n, m in self.segments.items() if n in sources}, sources,
            self.messages.check_outgoing)
        flags = torch.zeros(len(self.topology.pp_ranks), device=self.device)
        flags[self.rank] = detail is not None
        self._wait([dist.all_reduce(flags, group=self._pp, async_op=True)],
                   "the batch check", "its pipeline")
        if self._dp is not None:
            self._wait([dist.all_reduce(flags, group=self._dp, async_op=True)],
                       "the batch check", "its replicas")
        if detail is not None:
            raise BatchError(batch_fit.refusal(self.rank, detail))
        refusing = [r for r, f in enumerate(flags.tolist()) if f]
        if refusing:
            raise BatchError(f"rank {self.rank}: the batch does not fit the plan: plan "
                             f"rank(s) {refusing} refused it before any communication (their "
                             "message says why)")
        self._fitting = key

    def _labelled_modules(self):
        yield from ((f"stage {s}", m) for s, m in self.stages.items())
        yield from ((f"segment {name!r}", m) for name, m in self.segments.items())

    def _losses_out(self, broadcast_loss: bool, return_losses: bool):
        """The batch loss (and the per-microbatch losses): the body's from the last
        stage's rank, a sink's from the rank that ran it; summed over the pipeline when
        ``broadcast_loss`` (or onto the last stage's rank when a sink is elsewhere). With
        replicas, the gradients and the loss are then summed over the data-parallel group
        (the per-microbatch losses stay this replica's)."""
        m = len(self._mbs)
        holder = self.plan.placement.rank_of(self.last_stage)
        sinks = any(s.side == SINK for s in self.plan.cut.segments)
        t = torch.zeros(m + 1, dtype=torch.float64, device=self.device)
        if self._loss is not None:
            t[0] = self._loss.double()
        for mb, value in self._mb_losses.items():
            t[mb + 1] = value.double()
        if broadcast_loss or sinks:
            if broadcast_loss:
                work = dist.all_reduce(t, group=self._pp, async_op=True)
            else:
                work = dist.reduce(t, self.topology.pp_ranks[holder], group=self._pp,
                                   async_op=True)
            self._wait([work], "the loss reduction", "its pipeline")
            has = broadcast_loss or self.rank == holder
        else:
            has = self._loss is not None
        if self._dp is not None:
            t[0] = self._reduce_replicas(float(t[0]) if has else 0.0)
        if not has:
            return (None, None) if return_losses else None
        values = t.tolist()
        return (values[0], tuple(values[1:])) if return_losses else values[0]

    def _pass(self, batch: Batch) -> None:
        """Run the plan's ops once on ``batch`` (training or, ``_evaluating``, eval), once
        connected."""
        m, replicas = self.plan.num_microbatches, self.topology.replicas
        mine = 0 if replicas == 1 else self.topology.dp_rank
        try:
            blocks = [batch] if replicas == 1 else batch.split(replicas)  # row blocks
            if self._evaluating:  # eval: this replica's outputs and loss, over its rows
                blocks, mine = [blocks[mine]], 0
            every = [block.split(m) for block in blocks]
        except BatchError as err:  # every rank holds the same batch: all refuse alike
            raise BatchError(f"rank {self.rank}: the batch over {replicas} replicas of "
                             f"{m} microbatches: {err}") from None
        self._mbs = [mb.to(self.device) for mb in every[mine]]
        self._check_fit(batch)
        try:
            self._weights = loss.microbatch_weights(every, mine, self.loss_reduction,
                                                    self.ignore_index, self.loss_weight)
        except PipelineError as err:  # the same on every rank: all refuse alike
            raise BatchError(f"rank {self.rank}: {err}") from None
        except Exception as err:  # the user's loss_weight
            raise BatchError(f"rank {self.rank}: loss_weight failed: "
                             f"{type(err).__name__}: {err}") from None
        self._row_weights = (self._weights if self.ignore_index is None
                             and self.loss_weight is None
                             else loss.microbatch_weights(every, mine, self.loss_reduction))
        self._loss = None
        self._mb_losses: dict = {}  # mb -> its own loss (a sink's added in)
        self.store = {}
        self._posted: _Transfer | None = None  # the last comm op, posted, not waited for
        self._unread: list[_Pending] = []
        self._stored_refs: dict[int, int] = {}
        self._stored_live = self.stored_peak = 0
        self._mb_base = mine * m  # this replica's first microbatch in the whole batch
        copies = {} if self._evaluating else self._copies
        try:
            with contextlib.ExitStack() as recording:
                for c, *_ in copies.values():
                    recording.enter_context(c.begin())
                self._run_plan()
            for c, reduces, broadcasts, first in copies.values():
                c.agree(reduces, broadcasts, first)
        except PipelineError:
            self._failed = True  # close() then skips its barrier
            raise

    def _run_plan(self) -> None:
        for instr in self._instrs:
            self._execute(instr)
        for pending in self._unread:  # received but never read: still check them
            self._resolve(pending)
        if self._posted is not None:
            self._finish(self._posted)
        self._posted, self._unread = None, []
        self.store = {}

    def _reduce_replicas(self, value: float) -> float:
        """Sum this rank's gradients and loss over its replicas (after the plan: every
        p2p of it has completed, so this cannot interleave with the pipeline's)."""
        params = self.parameters()
        flat = topology.flatten_grads(params).to(self.device)
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        self._wait([dist.all_reduce(flat, group=self._dp, async_op=True),
                    dist.all_reduce(total, group=self._dp, async_op=True)],
                   "the data-parallel all-reduce", "its replicas")
        topology.unflatten_grads(params, flat)
        return float(total.item())

    def _execute(self, instr: _Instr) -> None:
        store, op = self.store, instr.op
        for t in instr.needs:
            value = store.get(t, _MISSING)
            if value is _MISSING:
                raise PipelineError(f"rank {self.rank}: {op} at position {instr.index} needs "
                                    f"{Token(*t)}, which is not on this rank (the executor "
                                    "disagrees with the certified semantics: internal error)")
            if type(value) is _Pending:
                store[t] = self._resolve(value)
        kind = type(op)
        try:
            if kind is Compute:
                produced = self._compute(op, instr.needs, instr.keep)
            elif kind is Overlap:
                produced = {}
                for c, needs in zip(op.ops, instr.members):
                    produced.update(self._compute(c, needs, instr.keep))
            elif kind is Send or kind is Recv or kind is Group:
                produced = self._p2p(instr)
            elif kind is Collective:
                produced = self._collective(instr)
            elif kind is Idle or kind is Marker:
                produced = {}
            else:
                raise PipelineError(f"rank {self.rank}: cannot run {op!r}")
        except PipelineError:
            raise
        except Exception as err:
            raise PipelineError(f"rank {self.rank}: {op} at position {instr.index} failed: "
                                f"{type(err).__name__}: {err}") from err
        for t, value in produced.items():
            if t in instr.keep:
                if type(value) is _PerSource and type(store.get(t)) is _PerSource:
                    value = _PerSource({**store[t], **value})  # another source's part
                store[t] = value
                if t[0] in _HOLDS_ACTIVATION:
                    self._hold(value)
        if self._stored_live > self.stored_peak:  # allocations count before frees
            self.stored_peak = self._stored_live
        for t in instr.drop:
            value = store.pop(t, None)
            if t[0] in _HOLDS_ACTIVATION and value is not None:
                self._release(value)

    def _hold(self, value) -> None:
        """Count a stored activation (a ``stored`` token's graph, or the one a ``wgrad_ready``
        token keeps for ``W``: the same activation, counted once)."""
        key = id(_activation(value))
        refs = self._stored_refs.get(key, 0)
        if not refs:
            self._stored_live += 1
        self._stored_refs[key] = refs + 1

    def _release(self, value) -> None:
        key = id(_activation(value))
        refs = self._stored_refs.pop(key) - 1
        if refs:
            self._stored_refs[key] = refs
        else:
            self._stored_live -= 1

    # ------------------------------------------------------------ compute

    def _module(self, c: Compute) -> nn.Module:
        return self.segments[c.segment] if c.segment else self.stages[c.stage]

    def _compute(self, c: Compute, needs: tuple, keep: frozenset) -> dict:
        if c.kind == FORWARD:
            return self._forward(c, needs, keep)
        if c.kind == RECOMPUTE:
            return self._recompute(c, needs)
        if c.kind == BACKWARD:
            return self._backward(c, needs)
        if c.kind == INPUT_GRAD:
            return self._input_grad(c, needs)
        if c.kind == WEIGHT_GRAD:
            return self._weight_grad(c, needs)
        raise PipelineError(f"rank {self.rank}: unknown compute kind in {c}")

    def _needed(self, needs: tuple, kind: str):
        """The value of the token of ``kind`` among an op's ``needs`` (None if absent)."""
        for t in needs:
            if t[0] == kind:
                return self.store[t]
        return None

    def _forward(self, c: Compute, needs: tuple, keep: frozenset) -> dict:
        seg, s, mb = c.segment, c.stage, c.mb
        data = self._mbs[mb]
        out_token, stored, *raw_token = produces(c)  # raw input: a cut segment's forward
        graph = stored in keep
        module = self._module(c)
        sink = bool(seg) and self.chain.segment(seg).side == SINK
        leaves, parts, args, kwargs, raw = [], [], [], {}, None
        with torch.set_grad_enabled(graph):
            for t in needs:
                if t[0] != "out":
                    continue
                # a sink is detached: nothing flows back into the body
                wanted = (graph and not sink
                          and self.chain.expected_backward(t[1], t[3])[0])
                x, grad_leaves, paths = self._input(t, c, self.store[t], wanted)
                leaves.extend(grad_leaves)
                parts.append((t[1], len(grad_leaves), paths))
                args.append(x)
            if seg and not sink:
                raw = self._segment_data(c, data)
                args.append(raw)
            elif s == 0 and not seg:
                if data.body is not None:
                    args.extend(data.body if isinstance(data.body, tuple) else (data.body,))
                kwargs = dict(data.kwargs)
            shipped = [comm.ShippedInput(raw, comm.rng_state(self.device))
                       for t in raw_token if t in keep]  # before the forward draws
            with self._recording(module, mb):
                y = module(*args, **kwargs)
            self._setup.check(c, module, y)  # a graph no backward here can run: refused
            out = y
            if sink or (not seg and s == self.last_stage):
                out = self._loss_of(c, y, data)
        produced = {out_token: y.detach() if type(y) is torch.Tensor
                    else tree.detach(y, keep_flag=True)}
        if graph:
            at_cut = not seg and s == 0 and any(x.side == SOURCE for x in self.chain.cut.segments)
            produced[stored] = _Saved(tuple(leaves), out, self._params[id(module)],
                                      tuple(parts), at_cut)
        for t, value in zip(raw_token, shipped):
            produced[t] = value
        return produced

    def _recording(self, module: nn.Module, mb: int):
        """Around a forward: record its buffer updates when ``module`` has other copies."""
        held = None if self._evaluating else self._copies.get(id(module))
        return contextlib.nullcontext() if held is None else held[0].recording(
            self._mb_base + mb)

    def _segment_data(self, c: Compute, data: Batch):
        """A source segment's input (a sink's target) in the microbatch."""
        raw = data.segments.get(c.segment)
        if raw is None:
            raise PipelineError(f"rank {self.rank}: {c}: the batch has no entry for segment "
                                f"{c.segment!r} (Batch(segments={{{c.segment!r}: ...}}))")
        return raw

    def _loss_of(self, c: Compute, y, data: Batch):
        """At the body's last stage (``loss_fn``) or a sink (its ``segment_loss_fns``):
        record the microbatch's loss and return what its backward starts from (the loss
        weighted by the microbatch's share). In eval: keep ``y``, and compute the body's
        loss only when the batch has a target (a sink's output is kept, no loss)."""
        name = c.segment
        if self._evaluating:
            self._outputs.setdefault(name, {})[c.mb] = y
            if name or data.target is None:
                return y
        target = self._segment_data(c, data) if name else data.target
        fn = self.segment_loss_fns[name] if name else self.loss_fn
        value = loss.checked(fn(y, target), f"segment_loss_fns[{name!r}]" if name
                             else "loss_fn", self.rank)
        weight = (self._row_weights if name else self._weights)[c.mb]
        root, own, share = loss.weighted(value, weight, y)
        self._mb_losses[c.mb] = own + self._mb_losses[c.mb] if c.mb in self._mb_losses else own
        self._loss = share if self._loss is None else self._loss + share
        return root

    def _input(self, t: tuple, c: Compute, x, wanted: bool) -> tuple:
        """``(value for the forward, its tensors that take a gradient, their paths)``; the
        paths are None for one float tensor (it always takes one when ``wanted``). A
        structure's float leaves take one if the plan ships it back (a received value) or
        they required one where they were produced (a value from this rank)."""
        if type(x) is torch.Tensor:
            if not tree.is_float(x):
                return x, [], ()
            if not wanted:
                return x, [], None
            x = x.detach().requires_grad_(True)
            return x, [x], None
        if not wanted:
            paths = frozenset()
        elif t in self._received:
            key = ((c.segment, c.stage, c.mb, None) if t[1] == c.segment
                   else (BODY, 0, c.mb, t[1]))  # a source's output into the body
            paths = self._grad_paths.get(key, frozenset())
        else:
            paths = frozenset(p for p, v in tree.flatten(x)
                              if v is not None and v.requires_grad)
        items, grads = [], []
        for p, v in tree.flatten(x):
            if v is not None:
                v = v.detach()
                if p in paths and tree.is_float(v):
                    v.requires_grad_(True)
                    grads.append((p, v))
            items.append((p, v))
        return tree.unflatten(items), [v for _, v in grads], tuple(p for p, _ in grads)

    def _grad_value(self, saved: _Saved, grads: Sequence):
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
            return _PerSource(values)
        return values[0][1] if values else None

    def _recompute(self, c: Compute, needs: tuple) -> dict:
        """Re-run the forward from its shipped input, drawing from the RNG state that
        forward ran with (this rank's own generators are left as they were)."""
        module = self._module(c)
        shipped: comm.ShippedInput = self._needed(needs, "input")
        cuda = self.device is not None and self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []), \
                torch.enable_grad(), buffers.unchanged(module):  # the forward's update counted
            comm.set_rng_state(shipped.rng, self.device)
            y = module(shipped.tensor)
            self._setup.check(c, module, y)
        (stored,) = produces(c)
        return {stored: _Saved((), y, self._params[id(module)])}

    def _backward(self, c: Compute, needs: tuple) -> dict:
        saved: _Saved = self._needed(needs, "stored")
        roots, grads = _vjp(saved.output, self._part(self._needed(needs, "grad"), c))
        targets = saved.leaves + saved.params
        if targets and roots:
            torch.autograd.backward(roots, grads, inputs=list(targets))
        grad, wdone = produces(c)
        return {grad: self._grad_value(saved, [x.grad for x in saved.leaves]), wdone: True}

    def _input_grad(self, c: Compute, needs: tuple) -> dict:
        saved: _Saved = self._needed(needs, "stored")
        roots, grads = _vjp(saved.output, self._part(self._needed(needs, "grad"), c))
        grads_in, work = [None] * len(saved.leaves), split_backward.WeightWork()
        if roots:
            if len(roots) > 1 or roots[0].grad_fn is None:  # one root: <output, grad> summed
                roots, grads = [sum((r * g).sum() for r, g in zip(roots, grads))], [None]
            if saved.leaves:
                grads_in, work = split_backward.backward_input(
                    roots[0], grads[0], saved.leaves, saved.params,
                    self._direct[id(self._module(c))])
            else:
                work = split_backward.weight_only(roots[0], grads[0], saved.params)
        grad, wgrad_ready = produces(c)
        return {grad: self._grad_value(saved, grads_in), wgrad_ready: (saved, work)}

    def _part(self, g, c: Compute):
        """The output gradient ``c`` starts from: a source segment's own part of the
        body's first-stage input gradient (waited for only now), else ``g`` itself."""
        if type(g) is not _PerSource:
            return g
        part = g.get(c.segment, _MISSING)
        if part is _MISSING:
            raise PipelineError(f"rank {self.rank}: {c}: no gradient arrived for segment "
                                f"{c.segment!r} (internal error)")
        if type(part) is _Pending:
            part = g[c.segment] = self._resolve(part)
        return part

    def _weight_grad(self, c: Compute, needs: tuple) -> dict:
        _, work = self._needed(needs, "wgrad_ready")
        split_backward.backward_weight(work)
        (wdone,) = produces(c)
        return {wdone: True}

    # ------------------------------------------------------------ communication

    def _wait(self, works: list, where: str, peers: str, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.timeout_s
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.arm(f"{where} with {peers}", timeout_s)
        try:
            comm.wait_all(works, timeout_s, self.rank, where, peers)
        finally:
            if watchdog is not None:
                watchdog.disarm()

    def _p2p(self, instr: _Instr) -> dict:
        where, peers = instr.where, instr.peers
        messages = self.messages
        items, recvs = [], []
        for is_send, payload, peer, token in instr.p2p:
            if is_send:
                value = self.store[token]
                if type(value) is _PerSource:  # this source's part
                    value = value.get(payload.to_segment)
                if value is None:
                    raise PipelineError(f"rank {self.rank}: {where}: the plan sends "
                                        f"{comm.describe(payload)} but the model produced "
                                        "no gradient there (does that input require grad?)")
                messages.check_outgoing(value.tensor if type(value) is comm.ShippedInput
                                        else value, payload, where)
                items.append((True, messages.outgoing(value, payload), peer))
            else:
                buf = messages.incoming(payload)
                items.append((False, buf, peer))
                recvs.append((token, buf, payload, peer))
        if self.overlap_comms and self._posted is not None:
            self._finish(self._posted)  # the previous comm op completes before this one posts
        try:
            works = comm.post_p2p([(s, buf, self._peer[peer]) for s, buf, peer in items],
                                  self._pp)
        except Exception as err:
            raise PeerError(f"rank {self.rank}: {where}: posting to {peers} failed: "
                            f"{comm.backend_reason(err, self.timeout_s)}") from err
        transfer = _Transfer(works, [buf for _, buf, _ in items], where, peers)
        if not self.overlap_comms or (recvs and not self._defer_receives):
            self._finish(transfer)
            self._posted = None  # nothing of this rank's is in flight
            return {token: _received(messages.decode(buf, payload, src, where), payload)
                    for token, buf, payload, src in recvs}
        self._posted = transfer
        out = {}
        for token, buf, payload, src in recvs:
            pending = _Pending(transfer, buf, payload, src)
            out[token] = _received(pending)
            self._unread.append(pending)
        return out

    def _finish(self, transfer: _Transfer) -> None:
        if not transfer.done:
            self._wait(transfer.works, transfer.where, transfer.peers)
            transfer.done = True
        transfer.buffers = []

    def _resolve(self, pending: _Pending):
        """Wait for a received value (if still in flight) and check it against the plan;
        called once per pending value (the store then holds the value itself)."""
        if pending.buf is None:
            return None
        self._finish(pending.transfer)
        value = self.messages.decode(pending.buf, pending.payload, pending.src,
                                     pending.transfer.where)
        pending.buf = None
        return value

    def _collective(self, instr: _Instr) -> dict:
        op: Collective = instr.op
        where = instr.where
        group = self._groups.get(tuple(sorted(op.ranks)))
        role, name = collective_segment(op) or ("", "")
        module = self.segments.get(name)
        if module is None or (op.kind, role) not in (("broadcast", PARAMS),
                                                     ("all_reduce", GRADS)):
            raise PipelineError(f"rank {self.rank}: {where}: the executor runs broadcast of "
                                "params:NAME and all_reduce of grads:NAME only")
        params = [p for p in module.parameters()]
        peers = f"ranks {','.join(map(str, op.ranks))}"
        if op.kind == "broadcast":
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else \
                torch.empty(0, device=self.device)
            root = self.topology.pp_ranks[op.root]
            self._wait([dist.broadcast(flat, root, group=group, async_op=True)], where, peers)
            if self.rank != op.root:
                with torch.no_grad():
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
            return {t: True for t in produces(op)}
        trainable = self._params[id(module)]
        flat = topology.flatten_grads(trainable).to(self.device)  # summed in the widest dtype
        self._wait([dist.all_reduce(flat, group=group, async_op=True)], where, peers)
        topology.unflatten_grads(trainable, flat)  # each gradient back in its parameter's dtype
        return {}


def _segments_touched(program) -> set[str]:
    """The segments a rank's ``program`` runs (a compute of it) or exchanges (its
    ``params:``/``grads:`` collective): the ones the rank holds a module of."""
    used = {c.segment for op in program for c in computes_of(op) if c.segment}
    return used | {tagged[1] for op in program
                   if isinstance(op, Collective) and (tagged := collective_segment(op))}


@contextlib.contextmanager
def _eval_mode(modules: list):
    """Every module (and submodule) in eval mode, each one's own mode restored after."""
    modes = [(m, m.training) for top in modules for m in top.modules()]
    try:
        for top in modules:
            top.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def _layout_print(layout: list) -> bytes:
    """16 bytes that differ, but for a hash collision, between two different layouts."""
    return hashlib.sha256(repr(layout).encode()).digest()[:16]


def _add_back(kept: dict) -> None:
    """Each set-aside gradient plus what the pass summed into ``.grad`` (``kept``: from
    ``_set_aside_summed_grads``)."""
    for p, grad in kept.values():
        p.grad = grad if p.grad is None else grad + p.grad


_HOLDS_ACTIVATION = ("stored", "wgrad_ready")  # token kinds whose value keeps a graph


def _vjp(output, grad) -> tuple[list, list]:
    """The outputs to back-propagate from and their gradients: the loss (``grad`` None),
    one tensor, or each leaf of a structure that requires a gradient and received one."""
    if grad is None or type(grad) is torch.Tensor:
        return ([output], [grad]) if output.requires_grad else ([], [])
    outs = dict(tree.flatten(output))
    pairs = [(outs.get(p, _MISSING), g) for p, g in tree.flatten(grad) if g is not None]
    if any(o is _MISSING for o, _ in pairs):
        raise PipelineError("a gradient arrived for a leaf the stage's output does not have")
    pairs = [(o, g) for o, g in pairs if o is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _activation(value) -> _Saved:
    """The stored activation a ``stored`` or ``wgrad_ready`` value keeps alive."""
    return value if type(value) is _Saved else value[0]


def _received(value, payload=None):
    """A received value as the store keeps it: a source's part of the body's first-stage
    input gradient goes into a ``_PerSource``, anything else is kept as it is."""
    p = value.payload if payload is None else payload
    if p.kind == GRAD and p.to_segment is not None:
        return _PerSource({p.to_segment: value})
    return value


__all__ = ["Evaluation", "PipelineExecutor"]
