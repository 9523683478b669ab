"""The public face of the executor: ``PipelineExecutor``, one per process, runs rank
``rank``'s program of a certified plan over ``torch.distributed`` (docs/executor.md).

Its life: construction checks the plan's certificate (before anything else: no process
group is touched when it refuses) and what this rank was given (``model_checks``), and
compiles the program (``steps``); ``connect`` joins the process group, runs the start-up
checks between ranks (``handshake``) and makes the groups the run posts on
(``topology``); each ``run``/``step``/``eval`` cuts the batch into this replica's
microbatches, checks that it fits the plan (``batch_fit``), walks the steps
(``interpreter``: computes in ``compute``, communication in ``transport``), makes module
buffers' copies agree (``buffers``) and sums what is summed outside the plan
(``reductions``).

Plan rank ``r`` is rank ``r`` of the pipeline group (the world by default). Replicas each
run the plan on their own pipeline group and block of the batch's rows (the microbatch
weights scaled by that block's share); their gradients and loss are summed after it.
``eval`` runs a forward-only plan under ``no_grad``, keeping the last stage's (and each
sink's) outputs; ``step``/``run`` refuse such a plan and ``eval`` a training one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import types
from typing import Callable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..ir import SOURCE, Plan
from ..semantics import RENDEZVOUS, Chain
from ..verify.report import Certificate
from . import (batch_fit, buffers, chunks, clipping, comm, handshake, loss, model_checks,
               moves, packed, partition, reductions, replicas, topology, transport)
from .batch import Batch
from .compute import Pass, StageCompute
from .errors import BatchError, PeerError, PipelineError, check_certificate
from .interpreter import Interpreter
from .stage_setup import StageSetup  # torch.compile and checkpointing (docs/executor.md)
from .steps import compile_steps


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


class PipelineExecutor:
    """Run a certified ``plan`` on this rank.

    ``stages``: the body's stage modules (a mapping ``stage -> module`` or a sequence
    indexed by stage; only this rank's stages are used; with several pipelines, the
    model's stages, each run for every replica of it here: ``replicas``). ``segments``:
    cut segments' modules by name (e.g. ``{"vision": encoder}``), needed on every rank
    whose program touches the segment. ``loss_fn(output, target)``: the loss at the
    body's last stage (a mean over the microbatch's rows when ``loss_reduction="mean"``).
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
        chunks.check_plan(plan)  # sequence chunks: the stages' cache contract (chunks)
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
        self.stages = model_checks.local_stages(plan, self.rank, stages)
        self.segments = model_checks.local_segments(plan, self.rank, dict(segments or {}))
        model_checks.check_model(plan, stages, dict(segments or {}))
        self.segment_loss_fns = model_checks.sink_losses(
            plan, self.rank, dict(segment_loss_fns or {}), self.segments)
        self._params = {id(m): tuple(p for p in m.parameters() if p.requires_grad)
                        for m in (*self.stages.values(), *self.segments.values())}
        self._built = {id(m): frozenset(map(id, m.parameters()))  # trainable or not
                       for m in (*self.stages.values(), *self.segments.values())}
        setup = StageSetup(self.rank, self.program)  # before any forward compiles
        packed.check_program(self.program, self.rank)
        moves.check_plan(self.program, self.rank, moves.moved_here(self.chain.offloaded,
                                                                   self.rank))
        self._mover = moves.Mover(self.rank, self.device)
        self._interpreter = Interpreter(
            self.rank, compile_steps(self.program, self.rank, self.chain),
            StageCompute(self.rank, self.chain, self.program, self.stages, self.segments,
                         self._params, setup, loss_fn, self.segment_loss_fns, self._mover),
            self._mover)
        self.optimizer = optimizer(self.parameters()) if optimizer is not None else None
        self.steps = 0  # optimizer steps taken by step() (state_dict keeps it)
        self._connected = self._failed = False
        self._broadcast_replicas = True  # off only in tests (the handshake must then refuse)
        self._fitting = None  # the signature of the last batch found to fit the plan
        self._firsts = replicas.ends(plan)[0]  # each pipeline's first stage
        self._first_sends = batch_fit.first_sends(self.program, plan.cut, self._firsts)
        self._replicated = replicas.replicated(plan, self.rank, self.stages)  # "J" -> module

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

    @property
    def stored_peak(self) -> int:
        """The most stored activations held at once in the last run (``interpreter``)."""
        return self._interpreter.stored_peak

    @property
    def host_peak(self) -> int:
        """The most stored activations held in host memory at once in the last run
        (offloaded, docs/semantics.md §2.10): the verifier's host peak."""
        return self._interpreter.host_peak

    @property
    def moves_log(self) -> list:
        """Per activation move of the last run, ``(op, census)``: the bytes the moved
        activation then had on the device, in host memory, and shared (``moves``)."""
        return list(self._mover.log)

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
        self._mover.use(self.device)
        self.topology = topo = topology.resolve(self.plan.num_ranks, self._pp_group,
                                                self._dp_group)
        if topo.plan_rank != self.rank:
            raise PipelineError(f"executor built for rank {self.rank} runs as rank "
                                f"{topo.plan_rank} of its pipeline group")
        self._wait = wait = transport.Waiter(self.rank, self.timeout_s,
                                             transport.watchdog(self.rank))
        handshake.check_peers(
            handshake.Handshake(self.rank, self.device, wait, self.startup_s), self.plan,
            topo, self.certificate.digest, self.segments, self._params,
            handshake.named(self.parameters(), self._labelled_modules()))
        self._links = links = topology.run_links(topo, self.plan, self.program,
                                                 self.segments, self.timeout_s)
        replicas.StartUp(self.rank, links, wait, self.device).run(
            self.plan, self.stages, self._broadcast_replicas)  # replicas start equal
        held = [(None, m) for m in self.stages.values()] + list(self.segments.items())
        self._copies = buffers.copies_of(held, self.plan, self.rank, topo, links, wait,
                                         self.device, replicas.copies(self.plan, self.stages))
        for copies, _, broadcasts, _ in self._copies.values():
            copies.start_up(broadcasts)
        if self._defer_receives is None:  # see transport's docstring (comm modes)
            self._defer_receives = dist.get_backend(links.pp) != "gloo"
        self.messages = packed.Messages(self.rank, self.device, self.check_messages)
        self._transport = transport.Transport(
            self.rank, self.messages, wait, links, self.segments, self._params, self.device,
            self.overlap_comms, self._defer_receives, self._replicated)
        self._reducer = reductions.Reducer(self.plan, self.rank, topo, links, wait,
                                           self.device)
        self._connected = True

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
            for group, who in ((self._links.pp, "its pipeline"),
                               (self._links.dp, "its replicas")):
                if group is not None:
                    self._wait([dist.barrier(group=group, async_op=True)],
                               "the closing barrier", who)
            if self._pp_group is None and self._dp_group is None:
                topology.forget_run_groups()
                dist.destroy_process_group()

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
            self._wait([dist.all_reduce(t, op=op, group=self._links.pp, async_op=True)],
                       "the gradient-norm all-reduce", "its pipeline")

        counted = replicas.counted(self.plan, self.rank, self.stages) | {
            id(p) for m in self.segments.values() for p in m.parameters()}
        try:
            return clipping.clip_grad_norm(self.parameters(), max_norm, norm_type, reduce,
                                           self.device, error_if_nonfinite, counted)
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
            model_checks.check_trainable(self.rank, self._labelled_modules(), self._params,
                                         self._built)
        except PipelineError:
            self._failed = True  # its peers wait in vain: close() then skips its barrier
            raise
        self._check_batch(batch)
        self.connect()
        # each all-reduce must sum only this pass's own contributions
        kept = reductions.set_aside(self._reducer.summed(self.program, self.segments,
                                                         self._params, self._replicated))
        try:
            done = self._pass(batch, evaluating=False)
            return self._reducer.losses(done, self.parameters(), broadcast_loss,
                                        return_losses)
        except BatchError:  # refused by every rank before the plan began: still usable
            raise
        except PipelineError:
            self._failed = True  # close() then skips its barrier
            raise
        finally:
            reductions.add_back(kept)

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
        self.connect()
        with _eval_mode([*self.stages.values(), *self.segments.values()]):
            done = self._pass(batch, evaluating=True)
        sinks = {name: dict(sorted(outs.items())) for name, outs in done.outputs.items()
                 if name}
        body = done.outputs.get("")
        if body is None and not sinks:
            return None
        m = len(done.mbs)
        targets = done.mbs[0].target is not None
        return Evaluation(
            None if body is None else tuple(body[mb] for mb in range(m)),
            None if body is None or not targets else float(done.loss),
            None if body is None or not targets else tuple(float(done.mb_losses[mb])
                                                           for mb in range(m)),
            sinks)

    def _check_batch(self, batch: Batch) -> None:
        """Refuse, before any communication, a batch the plan's microbatches cannot be cut
        from (the executor stays usable: the next batch may be fine)."""
        if not isinstance(batch, Batch):
            raise BatchError(f"rank {self.rank}: step/run/eval take a Batch, got "
                             f"{type(batch).__name__}")
        try:
            self._microbatches(batch)
        except BatchError as err:
            raise BatchError(f"rank {self.rank}: the batch: {err}") from None

    def _check_fit(self, batch: Batch, mbs: list) -> None:
        """Refuse, on every rank and before the plan's first op, a batch whose first sends
        would not match the plan's payloads (``batch_fit``): checked once per batch
        signature, every rank of the pipeline and its replicas agreeing (one all-reduce
        of a flag per rank), so all of them raise ``BatchError`` together."""
        key = partition.signature(attrs.evolve(batch, target=None))
        if key == self._fitting:
            return
        sources = [s.name for s in self.plan.cut.segments if s.side == SOURCE]
        stage0 = next((self.stages[s] for s in sorted(self._firsts) if s in self.stages),
                      None)  # a first stage here (several pipelines: any pipeline's)
        if stage0 is not None and self.plan.seq_chunks > 1:
            stage0 = chunks.OutputOnly(stage0)
        detail = batch_fit.first_mismatch(
            mbs, self._first_sends, stage0,
            {n: m for n, m in self.segments.items() if n in sources}, sources,
            self.messages.check_outgoing)
        flags = torch.zeros(len(self.topology.pp_ranks), device=self.device)
        flags[self.rank] = detail is not None
        for group, who in ((self._links.pp, "its pipeline"), (self._links.dp, "its replicas")):
            if group is not None:
                self._wait([dist.all_reduce(flags, group=group, async_op=True)],
                           "the batch check", who)
        if detail is not None:
            raise BatchError(batch_fit.refusal(self.rank, detail))
        refusing = [r for r, f in enumerate(flags.tolist()) if f]
        if refusing:
            raise BatchError(f"rank {self.rank}: the batch does not fit the plan: plan "
                             f"rank(s) {refusing} refused it before any communication (their "
                             "message says why)")
        self._fitting = key

    def _microbatches(self, batch: Batch) -> list:
        """``batch`` cut into the plan's microbatches (with sequence chunks: samples, each
        cut along its sequence, ``chunks.split``)."""
        m, s = self.plan.num_microbatches, self.plan.seq_chunks
        return batch.split(m) if s == 1 else chunks.split(batch, m, s)

    def _labelled_modules(self):
        yield from ((f"stage {s}", m) for s, m in self.stages.items())
        yield from ((f"segment {name!r}", m) for name, m in self.segments.items())

    # ------------------------------------------------------------ a pass

    def _pass(self, batch: Batch, evaluating: bool) -> Pass:
        """Run the plan's steps once on ``batch`` (training or eval), once connected;
        returns the pass with what it collected."""
        done = self._start_pass(batch, evaluating)
        try:
            with contextlib.ExitStack() as recording:
                for c, *_ in done.copies.values():
                    recording.enter_context(c.begin())
                self._interpreter.run(done, self._transport, self._resolve)
            for c, reduces, broadcasts, first in done.copies.values():
                c.agree(reduces, broadcasts, first)
        except PipelineError:
            self._failed = True  # close() then skips its barrier
            raise
        return done

    def _start_pass(self, batch: Batch, evaluating: bool) -> Pass:
        """This replica's microbatches of ``batch`` and their loss weights, checked to fit
        the plan on every rank (a ``BatchError`` on all of them otherwise)."""
        m, replicas = self.plan.num_microbatches, self.topology.replicas
        mine = 0 if replicas == 1 else self.topology.dp_rank
        try:
            blocks = [batch] if replicas == 1 else batch.split(replicas)  # row blocks
            if evaluating:  # eval: this replica's outputs and loss, over its rows
                blocks, mine = [blocks[mine]], 0
            every = [self._microbatches(block) for block in blocks]
        except BatchError as err:  # every rank holds the same batch: all refuse alike
            raise BatchError(f"rank {self.rank}: the batch over {replicas} replicas of "
                             f"{m} microbatches: {err}") from None
        mbs = [mb.to(self.device) for mb in every[mine]]
        self._check_fit(batch, mbs)
        by = self.loss_weight  # sequence chunks: by tokens unless told otherwise (chunks)
        if by is None and self.ignore_index is None and self.plan.seq_chunks > 1:
            by = chunks.tokens
        try:
            weights = loss.microbatch_weights(every, mine, self.loss_reduction,
                                              self.ignore_index, by)
        except PipelineError as err:  # the same on every rank: all refuse alike
            raise BatchError(f"rank {self.rank}: {err}") from None
        except Exception as err:  # the user's loss_weight
            raise BatchError(f"rank {self.rank}: loss_weight failed: "
                             f"{type(err).__name__}: {err}") from None
        rows = (weights if self.ignore_index is None and self.loss_weight is None
                else loss.microbatch_weights(every, mine, self.loss_reduction))
        return Pass(mbs, weights, rows, evaluating, mine * m,
                    {} if evaluating else self._copies, self.device)

    def _resolve(self, pending: transport.Pending):
        """Wait for a received value and check it (``transport.Transport.resolve``)."""
        return self._transport.resolve(pending)


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


__all__ = ["Evaluation", "PipelineExecutor"]
