"""A connected rank's plan communication: posting and completing its sends, receives and
collectives (docs/executor.md, "What the interpreter does").

- ``SEND``/``RECV``: ``isend``/``irecv``; a ``Group``: ``batch_isend_irecv`` of its
  members. Every comm op is *posted* at its place in the plan, in plan order. With
  ``overlap`` off the rank then waits for it at once (the rendezvous program of
  docs/semantics.md §2, literally). With it on (the default) it waits for each comm op
  just before the next comm op is posted (the compute ops between them overlap its
  transfer), or earlier, just before the first op that reads a value it receives
  (``Pending``); the last one before the step ends (gloo reports a transfer complete
  only once it is waited for, so waiting at the step's end would keep every buffer of
  the step in flight). With ``defer`` off (over gloo: its event-loop thread spins while a
  receive is pending, on the cores the compute needs, benchmarks/executor.md) an op that
  receives is waited for at once. This is safe for every certified plan: each comm op is
  still waited for before the next one is posted (a collective excepted: gloo progresses
  a pending transfer without a wait), so transfers are posted and completed in the
  rendezvous order with only computes moved ahead; a plan that completes under
  rendezvous completes here, and a value is read only after its transfer completed.
  Messages are checked against the plan's payloads (``comm``, ``packed``).
- ``Collective``: ``broadcast`` tagged ``params:NAME`` sends segment NAME's parameters
  from the root; ``all_reduce`` tagged ``grads:NAME`` sums its weight gradients, tagged
  ``replica:J`` those of model stage J's replicas (several pipelines: ``replicas``).

Every wait is bounded (``Waiter``: the wait timeout, or the start-up one for the
handshakes) and watched by the process's one ``comm.Watchdog``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs
import torch
import torch.distributed as dist

from ..ir import GRAD, Collective
from ..semantics import GRADS, PARAMS, REPLICA, collective_segment, produces
from . import comm, topology
from .compute import PerSource
from .errors import PeerError, PipelineError
from .steps import Step

_WATCHDOG: comm.Watchdog | None = None


def watchdog(rank: int) -> comm.Watchdog:
    """The process's one watchdog (started on first use)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = comm.Watchdog(rank)
    return _WATCHDOG


@attrs.frozen
class Waiter:
    """Waits for posted works: each wait bounded by ``timeout_s`` (or its own) and armed
    on the ``watchdog`` meanwhile; a failure is a ``PeerError`` naming ``where`` and the
    ``peers``."""

    rank: int
    timeout_s: float
    watchdog: comm.Watchdog | None = None

    def __call__(self, works: list, where: str, peers: str,
                 timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.timeout_s
        if self.watchdog is not None:
            self.watchdog.arm(f"{where} with {peers}", timeout_s)
        try:
            comm.wait_all(works, timeout_s, self.rank, where, peers)
        finally:
            if self.watchdog is not None:
                self.watchdog.disarm()


class Transfer:
    """Posted point-to-point works of one plan step: waited for when the next comm op is
    posted, or before, when a received value is first read."""

    __slots__ = ("works", "buffers", "where", "peers", "done")

    def __init__(self, works: list, buffers: list, where: str, peers: str) -> None:
        self.works, self.where, self.peers, self.done = works, where, peers, False
        self.buffers = buffers  # kept alive until the works complete


class Pending:
    """A received value whose transfer may still be in flight (``buf`` None once read)."""

    __slots__ = ("transfer", "buf", "payload", "src")

    def __init__(self, transfer: Transfer, buf, payload, src: int) -> None:
        self.transfer, self.buf, self.payload, self.src = transfer, buf, payload, src


class Transport:
    """Posts and completes the plan's comm steps of rank ``rank`` (see the module
    docstring): ``messages`` encodes and checks them, ``wait`` bounds each wait;
    ``segments``/``params`` are the modules (and their trainable parameters) the plan's
    collectives move, over ``links``. ``begin`` starts a pass, ``end`` completes it."""

    def __init__(self, rank: int, messages, wait: Waiter, links: topology.Links,
                 segments: Mapping, params: Mapping, device, overlap: bool,
                 defer: bool, replicated: Mapping | None = None) -> None:
        self.rank, self.messages, self.wait, self.links = rank, messages, wait, links
        self.segments, self.params, self.device = segments, params, device
        self.overlap, self.defer = overlap, defer
        self.replicated = replicated or {}  # "J" -> model stage J's module (replica:J)
        self.posted: Transfer | None = None  # the last comm op, posted, not waited for
        self.unread: list[Pending] = []

    def begin(self) -> None:
        self.posted, self.unread = None, []

    def end(self, resolve: Callable) -> None:
        """After the plan's last op: check each value received but never read
        (``resolve``), and complete the last transfer."""
        for pending in self.unread:
            resolve(pending)
        if self.posted is not None:
            self.finish(self.posted)
        self.begin()

    def p2p(self, step: Step, store: Mapping) -> dict:
        """Post ``step``'s sends (of values in ``store``) and receives; return the
        received tokens, as values or ``Pending``."""
        where, peers, messages = step.where, step.peers, self.messages
        items, recvs = [], []
        for is_send, payload, peer, token in step.p2p:
            if is_send:
                value = store[token]
                if type(value) is PerSource:  # this source's part
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
        if self.overlap and self.posted is not None:
            self.finish(self.posted)  # the previous comm op completes before this one posts
        try:
            works = comm.post_p2p([(s, buf, self.links.peer[peer]) for s, buf, peer in items],
                                  self.links.pp)
        except Exception as err:
            raise PeerError(f"rank {self.rank}: {where}: posting to {peers} failed: "
                            f"{comm.backend_reason(err, self.wait.timeout_s)}") from err
        transfer = Transfer(works, [buf for _, buf, _ in items], where, peers)
        if not self.overlap or (recvs and not self.defer):
            self.finish(transfer)
            self.posted = None  # nothing of this rank's is in flight
            return {token: received(messages.decode(buf, payload, src, where), payload)
                    for token, buf, payload, src in recvs}
        self.posted = transfer
        out = {}
        for token, buf, payload, src in recvs:
            pending = Pending(transfer, buf, payload, src)
            out[token] = received(pending)
            self.unread.append(pending)
        return out

    def finish(self, transfer: Transfer) -> None:
        if not transfer.done:
            self.wait(transfer.works, transfer.where, transfer.peers)
            transfer.done = True
        transfer.buffers = []

    def resolve(self, pending: Pending):
        """Wait for a received value (if still in flight) and check it against the plan;
        called once per pending value (the store then holds the value itself)."""
        if pending.buf is None:
            return None
        self.finish(pending.transfer)
        value = self.messages.decode(pending.buf, pending.payload, pending.src,
                                     pending.transfer.where)
        pending.buf = None
        return value

    def collective(self, step: Step) -> dict:
        """Run a plan collective: ``broadcast`` of ``params:NAME``, ``all_reduce`` of
        ``grads:NAME`` or of ``replica:J`` (model stage J's weight gradients, summed over
        its replicas' holders: ``replicas``)."""
        op: Collective = step.op
        where = step.where
        group = self.links.groups.get(tuple(sorted(op.ranks)))
        role, name = collective_segment(op) or ("", "")
        module = (self.replicated if role == REPLICA else self.segments).get(name)
        if module is None or (op.kind, role) not in (("broadcast", PARAMS),
                                                     ("all_reduce", GRADS),
                                                     ("all_reduce", REPLICA)):
            raise PipelineError(f"rank {self.rank}: {where}: the executor runs broadcast of "
                                "params:NAME and all_reduce of grads:NAME or replica:J only")
        peers = f"ranks {','.join(map(str, op.ranks))}"
        if op.kind == "broadcast":
            self._broadcast(list(module.parameters()), op.root, group, where, peers)
            return {t: True for t in produces(op)}
        trainable = self.params[id(module)]
        flat = topology.flatten_grads(trainable).to(self.device)  # summed in the widest dtype
        self.wait([dist.all_reduce(flat, group=group, async_op=True)], where, peers)
        topology.unflatten_grads(trainable, flat)  # each gradient back in its parameter's dtype
        return {}

    def _broadcast(self, params: list, root: int, group, where: str, peers: str) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else \
            torch.empty(0, device=self.device)
        self.wait([dist.broadcast(flat, self.links.pp_ranks[root], group=group,
                                  async_op=True)], where, peers)
        if self.rank != root:
            with torch.no_grad():
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()


def received(value, payload=None):
    """A received value as the store keeps it: a source's part of the body's first-stage
    input gradient goes into a ``PerSource``, anything else is kept as it is."""
    p = value.payload if payload is None else payload
    if p.kind == GRAD and p.to_segment is not None:
        return PerSource({p.to_segment: value})
    return value
