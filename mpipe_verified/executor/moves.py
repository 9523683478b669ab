"""Activation moves (docs/semantics.md §2.10): ``OFFLOAD``/``RELOAD`` of a stored
activation between a rank's device and host memory, and its lending to another rank's
device and return (``SEND``/``RECV`` of payload kinds ``lend``, ``return``).

What moves. A stored activation is everything a forward keeps for its backward. When the
plan moves an activation (``semantics.offloads``: this rank offloads or lends it), its
forward runs under ``torch.autograd.graph.saved_tensors_hooks`` (``capture``), and the
activation is recorded as an ``Activation``:

- its *own* tensors, moved by their storage: the forward's input leaves (cloned for this
  forward, so no other value shares their memory) and its output's tensors (the value
  the rest of the plan reads, sent or consumed on this rank, is a clone: ``compute``).
  Autograd needs these very tensor objects (the leaves the input gradient lands on, the
  root the backward starts from), so they are kept and their storage is emptied
  (``untyped_storage().resize_(0)``) and refilled: the identities stay, the memory goes;
- every other tensor autograd saved, each held by a ``Handle`` that the pack hook
  returns and the unpack hook reads: a move copies it and drops the device tensor. A
  saved tensor that shares storage with an own tensor moves with that storage. The
  stage's parameters and buffers are returned as they are: static memory, never moved.
  A saved tensor some other value also holds (a batch's token ids) keeps its device
  memory through that value; ``census`` reports it as shared.

So nothing is recomputed and autograd's graph is the forward's own. Moves of a cut
segment's activation are refused at construction (``check_plan``).

Places. ``OFFLOAD`` copies to host buffers and releases the device memory; ``RELOAD``
copies back into fresh device memory. On CUDA the host buffers are pinned and both copies
run ``non_blocking`` after the compute stream's pending work, each direction on its own
side stream (a reload's also after its offload's copy, by an event); a reload records an
event the backward waits for (``Activation.ready``) before reading a tensor.
On CPU the same path copies into separate CPU tensors (a real copy: the device-side
storage is freed, which ``census`` and the tests see). A lend sends the activation's
bytes (one uint8 buffer, own storages then handles) to the holder, which keeps that
buffer on its device; the owner keeps the layout and empties its tensors; the return
sends the buffer back and the owner refills them.

Messages (``Mover.transfer``): a lend or return is a fixed-size header (``HEADER``
int64 words: a magic, the kind, stage, microbatch, a hash of the segment and the byte
count), then the bytes followed by the same header as a trailer. The receiver checks the
header against the plan's payload before posting the bytes (it learns their size there),
then the trailer: a mismatch is a ``PayloadMismatchError`` naming both. A rank move is
posted alone (a ``Group`` holding one is refused by ``check_plan``, as is a move between
a split backward's ``I`` and ``W``) and waited for at once.
"""

from __future__ import annotations

import weakref
from typing import Mapping

import torch

from ..ir import (INPUT_GRAD, LEND, RANK_MOVES, WEIGHT_GRAD, Group, Offload, Send,
                  computes_of, p2p_of)
from . import comm
from .errors import PayloadMismatchError, PeerError, PipelineError

DEVICE, HOST = "device", "host"
HEADER = 8  # int64 words of a rank move's header (and trailer)
_MAGIC = 0x6D706970656D7601  # "mpipemv\x01"
_KIND = {"lend": 1, "return": 2}


def check_plan(program, rank: int, moved) -> None:
    """Refuse what this executor does not move: a cut segment's activation, a rank move
    posted in a ``Group``, a move between a split backward's ``I`` and ``W`` (what ``I``
    kept for ``W`` is not part of the moved activation)."""
    for seg, stage, mb in moved:
        if seg:
            raise PipelineError(f"rank {rank}: the plan moves the stored activation of "
                                f"{seg}:{stage} mb {mb}; the executor moves body activations "
                                "only (docs/executor.md, \"Activation moves\")")
    split = set()  # (segment, stage, mb) after its I, before its W
    for index, op in enumerate(program):
        if type(op) is Group and any(c.payload.kind in RANK_MOVES for c in op.ops):
            raise PipelineError(f"rank {rank}: {op} at position {index}: a lend or return "
                                "inside a group; the executor posts rank moves alone")
        for c in computes_of(op):
            if c.kind in (INPUT_GRAD, WEIGHT_GRAD):
                (split.add if c.kind == INPUT_GRAD else split.discard)((c.segment, c.stage, c.mb))
        away = [(op.segment, op.stage, op.mb)] if type(op) is Offload else [
            (c.payload.segment, c.payload.stage, c.payload.mb) for c in p2p_of(op)
            if type(c) is Send and c.payload.kind == LEND]
        if any(key in split for key in away):
            raise PipelineError(f"rank {rank}: {op} at position {index} moves an activation "
                                "between its I and its W; the executor moves an activation "
                                "between its forward and its first backward only")


def moved_here(offloaded, rank: int) -> frozenset:
    """``(segment, stage, mb)`` of every activation ``rank`` offloads or lends."""
    return frozenset((seg, s, mb) for r, seg, s, mb, _ in offloaded if r == rank)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Handle:
    """A saved tensor as autograd holds it while its activation may move: ``tensor`` on
    the device (None while moved away), ``gone`` a weak reference to the device tensor
    last dropped (alive: something else holds it)."""

    __slots__ = ("tensor", "size", "dtype", "owner", "gone")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.size, self.dtype = tensor, tensor.size(), tensor.dtype
        self.owner: Activation | None = None
        self.gone = None

    def get(self) -> torch.Tensor:
        if self.owner is not None:
            self.owner.ready()
        if self.tensor is None:
            raise PipelineError("a moved activation was read before its reload or return "
                                "(the executor disagrees with the certified plan: internal "
                                "error)")
        return self.tensor

    def nbytes(self) -> int:
        return self.size.numel() * self.dtype.itemsize


class Capture:
    """The saved tensors of one forward (``capture``): handles, and the storages of the
    module's parameters and buffers (returned as they are)."""

    def __init__(self, modules) -> None:
        self.static = {_storage_key(t) for m in modules
                       for t in (*m.parameters(), *m.buffers())}
        self.handles: list[Handle] = []
        self._by_id: dict[int, Handle] = {}

    def pack(self, t: torch.Tensor):
        if t.device.type == "meta" or _storage_key(t) in self.static:
            return t
        handle = self._by_id.get(id(t))
        if handle is None:
            handle = self._by_id[id(t)] = Handle(t)
            self.handles.append(handle)
        return handle

    @staticmethod
    def unpack(x):
        return x.get() if type(x) is Handle else x

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class Activation:
    """A stored activation its rank moves (module docstring): ``own`` tensors (one per
    storage, moved by storage), ``handles`` (the other saved tensors), ``place``."""

    def __init__(self, mover: "Mover", own: list, handles: list) -> None:
        self.mover, self.place = mover, DEVICE
        keys = {}
        for t in own:
            keys.setdefault(_storage_key(t), t)
        self.own = [t for t in keys.values() if t.untyped_storage().resizable()]
        kept = {_storage_key(t) for t in self.own}
        for h in handles:  # each read waits for a pending reload (CUDA)
            h.owner = self
        self.handles = [h for h in handles if _storage_key(h.tensor) not in kept]
        self.sizes = [t.untyped_storage().nbytes() for t in self.own]
        self.host: list = []
        self.event = None

    # ---- bytes of each piece: own storages (as uint8), then handles' tensors
    def _pieces(self) -> list[torch.Tensor]:
        return ([_bytes_of(t) for t in self.own]
                + [h.tensor.contiguous().reshape(-1).view(torch.uint8) for h in self.handles])

    def nbytes(self) -> int:
        return sum(self.sizes) + sum(h.nbytes() for h in self.handles)

    def _release(self) -> None:
        for t in self.own:
            t.untyped_storage().resize_(0)
        for h in self.handles:
            h.gone, h.tensor = weakref.ref(h.tensor), None

    def _allocate(self) -> None:
        """Device memory again (on the compute stream), not yet filled."""
        for t, size in zip(self.own, self.sizes):
            t.untyped_storage().resize_(size)
        for h in self.handles:
            h.tensor = torch.empty(h.size, dtype=h.dtype, device=self.mover.device)

    def _fill(self, pieces, non_blocking: bool) -> None:
        """Copy ``pieces`` (uint8, in ``_pieces`` order) into the device memory."""
        for dst, src in zip(self._pieces(), pieces):
            dst.copy_(src, non_blocking=non_blocking)

    def offload(self) -> None:
        """To host memory (pinned, on the side stream, on CUDA); the device memory is
        released."""
        self.ready()  # (a certified plan never offloads a reloaded activation; cheap)
        side = self.mover.to_host
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.mover.device))
        with _on(side):
            pin = side is not None
            self.host = [torch.empty(p.numel(), dtype=torch.uint8, pin_memory=pin)
                         .copy_(p, non_blocking=pin) for p in self._pieces()]
            if side is not None:
                for t in (*self.own, *(h.tensor for h in self.handles)):
                    t.record_stream(side)  # not reused before the copy has read it
                self.event = side.record_event()  # the host copy is whole after this
        self._release()
        self.place = HOST
        self.mover.held_on_host(+1)

    def reload(self) -> None:
        """Back to device memory (allocated on the compute stream); on CUDA the copy runs
        on the side stream and ``ready`` makes the compute stream wait for it."""
        side = self.mover.to_device
        self._allocate()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.mover.device))
            if self.event is not None:  # the offload's copy to host memory is done
                side.wait_event(self.event)
        with _on(side):
            self._fill(self.host, non_blocking=side is not None)
            if side is not None:
                self.event = side.record_event()
        self.host, self.place = [], DEVICE
        self.mover.held_on_host(-1)

    def ready(self) -> None:
        """Make the compute stream wait for a pending reload (CUDA; a no-op elsewhere)."""
        if self.event is not None:
            torch.cuda.current_stream(self.mover.device).wait_event(self.event)
            self.event = None

    def lend(self) -> torch.Tensor:
        """The bytes to send to the holder (one buffer); the device memory is released."""
        self.ready()  # a reload's copy still in flight (CUDA) is waited for first
        pieces = self._pieces()
        blob = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8,
                                                            device=self.mover.device)
        self._release()
        self.place = LEND
        return blob

    def take_back(self, blob: torch.Tensor) -> None:
        """Refill the device memory from the returned bytes."""
        at, pieces = 0, []
        for n in [*self.sizes, *(h.nbytes() for h in self.handles)]:
            pieces.append(blob[at:at + n])
            at += n
        self._allocate()
        self._fill(pieces, non_blocking=False)
        self.place = DEVICE

    def census(self) -> dict:
        """Bytes of this activation by place: ``device`` (own storages and handles on
        the device), ``host`` (host copies), ``shared`` (dropped device tensors that
        something else still holds, so their memory stayed)."""
        device = sum(t.untyped_storage().nbytes() for t in self.own) + sum(
            h.nbytes() for h in self.handles if h.tensor is not None)
        shared = sum(h.nbytes() for h in self.handles
                     if h.tensor is None and h.gone is not None and h.gone() is not None)
        return {DEVICE: device, HOST: sum(b.numel() for b in self.host), "shared": shared}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (a view)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _on:
    """``torch.cuda.stream(stream)``, or nothing without a stream."""

    def __init__(self, stream) -> None:
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx is not None else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx is not None else None


class Mover:
    """One rank's moves: the side stream (CUDA), the activations it has lent (owner) or
    holds (holder), what each ``OFFLOAD`` left where (``log``: per move, the op and the
    activation's ``census`` after it), and the activations held in host memory (measured)."""

    def __init__(self, rank: int, device) -> None:
        self.rank = rank
        self.lent: dict = {}
        self.on_host = self.host_peak = 0
        self.log: list = []
        self.use(device)

    def use(self, device) -> None:
        """Move to and from ``device`` (on CUDA a side stream for each direction, so an
        offload and a reload copy at once, as the simulator's two copy streams do)."""
        self.device = device
        cuda = device is not None and torch.device(device).type == "cuda"
        self.to_host = torch.cuda.Stream(device) if cuda else None
        self.to_device = torch.cuda.Stream(device) if cuda else None

    def begin(self) -> None:
        self.lent, self.log = {}, []
        self.on_host = self.host_peak = 0

    def held_on_host(self, change: int) -> None:
        """An activation's host buffers were filled (+1) or dropped (-1): ``host_peak`` is
        the most activations whose copies sat in host memory at once in this pass, as
        measured by the moves themselves (the verifier's host peak is the semantics')."""
        self.on_host += change
        self.host_peak = max(self.host_peak, self.on_host)

    def activation(self, capture: Capture, leaves, output_tensors) -> Activation:
        return Activation(self, [*leaves, *output_tensors], capture.handles)

    def offload(self, op, saved) -> None:
        saved.moves.offload()
        self.log.append((str(op), saved.moves.census()))

    def reload(self, op, saved) -> None:
        saved.moves.reload()
        self.log.append((str(op), saved.moves.census()))

    # ---- rank moves
    def transfer(self, transport, step, store: Mapping) -> dict:
        """Run a lone lend or return ``SEND``/``RECV`` (module docstring)."""
        ((is_send, payload, peer, token),) = step.p2p
        if transport.posted is not None:
            transport.finish(transport.posted)
            transport.posted = None
        key = (payload.segment, payload.stage, payload.mb)
        where, peers = step.where, step.peers
        if is_send:
            value = store[token]
            if payload.kind == LEND:
                activation = value.moves
                blob = activation.lend()
                self.lent[key] = value
            else:
                blob = value
            head = self._header(payload, blob.numel())
            message = torch.cat([blob, head])
            self._post(transport, [(True, head, peer), (True, message, peer)], where, peers)
            self.log.append((str(step.op), {DEVICE: 0, HOST: 0, "sent": blob.numel()}))
            return {}
        head = torch.empty(HEADER * 8, dtype=torch.uint8, device=self.device)
        self._post(transport, [(False, head, peer)], where, peers)
        nbytes = self._check(head, payload, peer, where, "header")
        message = torch.empty(nbytes + HEADER * 8, dtype=torch.uint8, device=self.device)
        self._post(transport, [(False, message, peer)], where, peers)
        if not torch.equal(message[nbytes:], head):
            self._check(message[nbytes:], payload, peer, where, "trailer")
            raise PayloadMismatchError(f"rank {self.rank}: {where}: the trailer from rank "
                                       f"{peer} differs from its header")
        blob = message[:nbytes]
        if payload.kind == LEND:  # the holder keeps the bytes on its device
            return {token: blob, ("stored", *key): blob}
        saved = self.lent.pop(key)
        saved.moves.take_back(blob)
        return {token: True, ("stored", *key): saved}

    def _post(self, transport, items, where: str, peers: str) -> None:
        links = transport.links
        try:
            works = [w for s, buf, peer in items
                     for w in comm.post_p2p([(s, buf, links.peer[peer])], links.pp)]
        except Exception as err:
            raise PeerError(f"rank {self.rank}: {where}: posting to {peers} failed: "
                                 f"{comm.backend_reason(err, transport.wait.timeout_s)}") from err
        transport.wait(works, where, peers)

    def _header(self, payload, nbytes: int) -> torch.Tensor:
        words = [_MAGIC, _KIND[payload.kind], payload.stage, payload.mb,
                 comm._small_hash(payload.segment), nbytes, 0, 0]
        return torch.tensor(words, dtype=torch.int64).view(torch.uint8).to(self.device)

    def _check(self, head: torch.Tensor, payload, peer: int, where: str, what: str) -> int:
        got = head.view(torch.int64).tolist()
        want = [_MAGIC, _KIND[payload.kind], payload.stage, payload.mb,
                comm._small_hash(payload.segment)]
        if got[:5] != want or got[5] < 0:
            kinds = {v: k for k, v in _KIND.items()}
            sent = (f"{kinds.get(got[1], '?')} of stage {got[2]} mb {got[3]}"
                    if got[0] == _MAGIC else "a message that is no rank move")
            raise PayloadMismatchError(
                f"rank {self.rank}: {where}: received {sent} ({what}) from rank {peer}, but "
                f"the plan expects {comm.describe(payload)}")
        return got[5]


def rank_move_step(step) -> bool:
    """Is ``step`` a lend or return (posted by ``Mover.transfer``)?"""
    return bool(step.p2p) and step.p2p[0][1].kind in RANK_MOVES


def private(value):
    """``value`` (a detached tensor or structure) with every tensor copied: the value the
    rest of the plan reads from a moved activation's forward shares no memory with it."""
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        return out.requires_grad_(True) if value.requires_grad else out
    if type(value) is tuple or type(value) is list:
        return type(value)(private(v) for v in value)
    if type(value) is dict:
        return {k: private(v) for k, v in value.items()}
    return value


def tensors_of(value) -> list:
    """Every tensor in ``value`` (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) is tuple or type(value) is list:
        return [t for v in value for t in tensors_of(v)]
    if type(value) is dict:
        return [t for v in value.values() for t in tensors_of(v)]
    return []
