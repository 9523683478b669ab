"""The walker over a rank's plan: runs its compiled steps (``steps``) in order over a store
of values, dispatching each to the rank's computes (``compute``) or its communication
(``transport``).

Dependencies are not re-derived here: the store is keyed by the shared semantics' tokens
``(kind, segment, stage, mb)``. Before a step runs, each token it needs is checked
present, and a value still in flight (``transport.Pending``, or a source's part of a
per-source gradient) is waited for: this step is its first reader. After it, the values
some later op reads are kept, the stored activations it allocates held, then the values
it read last dropped and the activations it frees released. An ``Overlap`` runs its
members one after the other, all reading their inputs first and publishing after.

``stored_peak``: the most stored activations held at once in the last run, a step's
allocations counted before its frees. What is held follows ``semantics.step_effects``
(``Step.holds``/``frees``), so this is the peak the verifier reports under the unit
memory model. Activation moves (``moves``, docs/semantics.md §2.10): an ``OFFLOAD``
passes its stored activation on as its ``offloaded`` token, now in host memory, and a
``RELOAD`` brings it back as the ``stored`` token; ``host_peak`` is the mover's measure
of the activations whose copies sat in host memory at once (``Mover.held_on_host``). A lend or return is posted by the
rank's ``moves.Mover``.
"""

from __future__ import annotations

from typing import Callable

from ..ir import Collective, Compute, Group, Idle, Marker, Offload, Overlap, Recv, Reload, Send
from ..semantics import Token
from .compute import MISSING, Pass, PerSource, StageCompute
from .errors import PipelineError
from .moves import Mover, rank_move_step
from .steps import Step
from .transport import Pending, Transport


class Interpreter:
    """Runs ``steps`` (rank ``rank``'s program, compiled) with ``compute``."""

    def __init__(self, rank: int, steps: tuple[Step, ...], compute: StageCompute,
                 mover: Mover | None = None) -> None:
        self.rank, self.steps, self.compute = rank, steps, compute
        self.mover = mover or Mover(rank, None)
        self.store: dict = {}
        self.stored_peak = 0

    @property
    def host_peak(self) -> int:
        """The most activations held in host memory at once in the last pass (measured
        by the moves: ``Mover.held_on_host``)."""
        return self.mover.host_peak
        self._held: set = set()  # the stored activations the memory rule counts live

    def run(self, done: Pass, transport: Transport, resolve: Callable) -> None:
        """One pass: every step on ``done``'s microbatches, posting on ``transport``;
        ``resolve(pending)`` waits for a received value and checks it."""
        self.store = {}
        self._held, self.stored_peak = set(), 0
        self.mover.begin()
        transport.begin()
        for step in self.steps:
            self._execute(step, done, transport, resolve)
        transport.end(resolve)  # received but never read: still checked
        self.store = {}

    def _execute(self, step: Step, done: Pass, transport: Transport,
                 resolve: Callable) -> None:
        self._read(step, resolve)
        self._publish(step, self._dispatch(step, done, transport))

    def _read(self, step: Step, resolve: Callable) -> None:
        """Check that ``step``'s needs are present; wait for those still in flight."""
        store = self.store
        for t in step.needs:
            value = store.get(t, MISSING)
            if value is MISSING:
                raise PipelineError(f"rank {self.rank}: {step.where} needs {Token(*t)}, "
                                    "which is not on this rank (the executor disagrees "
                                    "with the certified semantics: internal error)")
            if type(value) is Pending:
                store[t] = resolve(value)
            elif type(value) is PerSource:  # a source reads its own part
                for name in step.segments:
                    if type(value.get(name)) is Pending:
                        value[name] = resolve(value[name])

    def _publish(self, step: Step, produced: dict) -> None:
        """Keep what later ops read, hold the stored activations ``step`` allocates (the
        peak counted here, before frees), drop what it read last, free what it frees (a
        freed activation's value may already be gone: it is dropped after its last
        reader, it is counted until it is freed)."""
        store = self.store
        for t, value in produced.items():
            if t in step.keep:
                if type(value) is PerSource and type(store.get(t)) is PerSource:
                    value = PerSource({**store[t], **value})  # another source's part
                store[t] = value
        for t in step.holds:
            value = produced.get(t, MISSING)
            if value is MISSING:
                raise PipelineError(f"rank {self.rank}: {step.where} kept no {Token(*t)} "
                                    "(internal error)")
            store[t] = value
            self._held.add(t)
        if len(self._held) > self.stored_peak:
            self.stored_peak = len(self._held)
        for t in step.drop:
            store.pop(t, None)
        for t in step.frees:
            store.pop(t, None)
            self._held.discard(t)

    def _move(self, step: Step, store: dict) -> dict:
        """``OFFLOAD`` (the stored activation to host memory, passed on as its
        ``offloaded`` token) or ``RELOAD`` (back, as the ``stored`` token)."""
        op = step.op
        key = ("stored", op.segment, op.stage, op.mb)
        (token,) = step.needs
        saved = store[token]
        if type(op) is Offload:
            self.mover.offload(op, saved)
            return {("offloaded", *key[1:]): saved}
        self.mover.reload(op, saved)
        return {key: saved, ("reloaded", *key[1:]): True}

    def _dispatch(self, step: Step, done: Pass, transport: Transport) -> dict:
        """Run ``step``'s op; return the tokens it produced."""
        op, store = step.op, self.store
        kind = type(op)
        try:
            if kind is Compute:
                return self.compute.run(op, step.needs, step, store, done)
            if kind is Overlap:
                produced = {}
                for c, needs in zip(op.ops, step.members):
                    produced.update(self.compute.run(c, needs, step, store, done))
                return produced
            if kind is Send or kind is Recv or kind is Group:
                if rank_move_step(step):
                    return self.mover.transfer(transport, step, store)
                return transport.p2p(step, store)
            if kind is Offload or kind is Reload:
                return self._move(step, store)
            if kind is Collective:
                return transport.collective(step)
            if kind is Idle or kind is Marker:
                return {}
            raise PipelineError(f"rank {self.rank}: cannot run {op!r}")
        except PipelineError:
            raise
        except Exception as err:
            raise PipelineError(f"rank {self.rank}: {op} at position {step.index} failed: "
                                f"{type(err).__name__}: {err}") from err
