"""Communication for the executor: process-group set-up, point-to-point messages that
carry their own description, and a watchdog (``transport`` posts and completes them, and
runs the transpose collectives).

Messages. Gloo (and NCCL) check neither the dtype nor, when the sender sends *fewer*
bytes than the receiver posted, the size of a message: a wrong tensor would be read as
garbage. So every point-to-point message is the tensor's bytes followed by a 128-byte
trailer describing what the sender sent (payload kind, segment, stage, microbatch, shape,
dtype). The sender checks its tensor against the plan's payload before sending; the
receiver posts a buffer of exactly the plan's size and checks the trailer: a smaller
message leaves the trailer slot empty (the real trailer is found earlier and decoded for
the message), a larger one makes the backend fail, and a different payload (dtype, shape,
stage, microbatch) shows in the trailer. ``check_messages=False`` sends bare tensors
(sender-side checks only).

A shipped raw input (an ``input`` payload: what a recompute on another rank re-runs the
segment's forward from) travels with the RNG state that forward ran with
(``ShippedInput``): its message is the tensor's bytes, padded to 8, then the RNG state's
bytes (8-byte aligned: the CPU generator's state, then the current CUDA device's when
the rank runs on CUDA), then the trailer (none with ``check_messages=False``).

Fail fast. Two timeouts: start-up (``startup_seconds``: ``MPIPE_STARTUP_TIMEOUT``,
default torch.distributed's own default process-group timeout, 30 min) bounds joining the
process group and the plan handshake; waits (``timeout_seconds``: ``MPIPE_TIMEOUT``,
default 300 s) bound every other wait. ``init_distributed`` gives the default group the
start-up timeout; every wait passes its own timeout, and a ``Watchdog`` thread ends the
process (exit code 124) if a communication op is still in flight ``grace`` seconds after
its timeout (backends that ignore timeouts, collectives stuck on a hung peer).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import re
import sys
import threading
import time
from typing import Sequence

import attrs
import torch
import torch.distributed as dist

from ..ir import INPUT, Payload
from .errors import PayloadMismatchError, PeerError, PipelineError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = dist.constants.default_pg_timeout.total_seconds()
WATCHDOG_EXIT = 124

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_KIND_CODE = {"act": 1, "grad": 2, "input": 3}
_MAGIC = 0x6D70697065763101  # "mpipev1\x01"
_SLOTS = 16
TRAILER_BYTES = 8 * _SLOTS
_MAX_DIMS = 6
STRUCT = -3  # the dtype slot of a structured payload's trailer (``packed``)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (the form ``Payload.dtype`` holds)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise PipelineError(f"unknown dtype {name!r} in the plan")
    return value


def describe(payload: Payload) -> str:
    """``act of vision:0 mb 2`` / ``grad of stage 3 mb 1``."""
    where = f"{payload.segment}:{payload.stage}" if payload.segment else f"stage {payload.stage}"
    to = f" (to {payload.to_segment or 'body'})" if payload.to_segment is not None else ""
    return f"{payload.kind} of {where} mb {payload.mb}{to}"


def _shape_text(shape, dtype) -> str:
    return f"{tuple(shape)} {dtype}"


def _small_hash(text: str | None) -> int:
    if text is None:
        return -1
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def expected_layout(payload: Payload) -> tuple[tuple[int, ...], torch.dtype, int]:
    """``(shape, dtype, nbytes)`` the plan promises for ``payload``."""
    if payload.shape is None or payload.dtype is None:
        raise PipelineError(f"the plan gives no shape/dtype for {describe(payload)}; annotate "
                            "it with executor.with_payload_shapes before verifying")
    dtype = torch_dtype(payload.dtype)
    numel = 1
    for d in payload.shape:
        numel *= int(d)
    return tuple(int(d) for d in payload.shape), dtype, numel * dtype.itemsize


def _trailer(payload: Payload, shape, dtype: torch.dtype, nbytes: int) -> list[int]:
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    return [_MAGIC, nbytes, _DTYPE_CODE.get(dtype, -1), _KIND_CODE[payload.kind], payload.stage,
            payload.mb, _small_hash(payload.segment), _small_hash(payload.to_segment),
            _small_hash(repr(tuple(shape))), len(shape), *dims]


def _trailer_text(t: list[int]) -> str:
    kind = {v: k for k, v in _KIND_CODE.items()}.get(t[3], "?")
    ndim = t[9]
    if t[2] == STRUCT:
        return f"{kind} of stage {t[4]} mb {t[5]}, a structure of {ndim} leaves"
    dims = t[10:10 + min(ndim, _MAX_DIMS)]
    shape = "(" + ", ".join(map(str, dims)) + (", …" if ndim > _MAX_DIMS else "") + \
        ("," if ndim == 1 else "") + ")"
    dtype = dtype_name(_DTYPES[t[2]]) if 0 <= t[2] < len(_DTYPES) else "?"
    return f"{kind} of stage {t[4]} mb {t[5]}, shape {shape} {dtype}"


@attrs.frozen
class ShippedInput:
    """A cut segment's raw input and the RNG state its forward ran with, so that a
    recompute (on this rank or, shipped, on another) draws the same random numbers
    (dropout masks) as the forward whose output the body consumed."""

    tensor: torch.Tensor
    rng: tuple[torch.Tensor, ...]


def rng_state(device: torch.device | None) -> tuple[torch.Tensor, ...]:
    """The RNG state a forward on ``device`` draws from: the CPU generator's, and the
    current CUDA device's when ``device`` is CUDA (what ``torch.utils.checkpoint`` keeps)."""
    if device is not None and device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def set_rng_state(state: tuple[torch.Tensor, ...], device: torch.device | None) -> None:
    """Make the generators draw from ``state`` (as ``rng_state`` returned it)."""
    torch.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state(state[1], device)


def check_outgoing(tensor, payload: Payload, rank: int, where: str) -> torch.Tensor:
    """The tensor to send for ``payload``, checked against the plan (raises
    ``PayloadMismatchError`` naming both)."""
    shape, dtype, _ = expected_layout(payload)
    if not isinstance(tensor, torch.Tensor):
        raise PayloadMismatchError(f"rank {rank}: {where}: the plan sends {describe(payload)} "
                                   f"but this rank holds {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise PayloadMismatchError(
            f"rank {rank}: {where}: refusing to send {describe(payload)}: the tensor is "
            f"{_shape_text(tensor.shape, dtype_name(tensor.dtype))} but the plan's payload is "
            f"{_shape_text(shape, payload.dtype)}")
    return tensor


class Messages:
    """Encode/decode point-to-point messages for one rank (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device, check: bool = True) -> None:
        self.rank = rank
        self.device = device
        self.check = check
        self._layouts: dict[Payload, tuple] = {}  # payload -> (shape, dtype, nbytes, head, trailer)
        self._rng_sizes = tuple(t.numel() for t in rng_state(device))

    def _layout(self, payload: Payload) -> tuple:
        """``(shape, dtype, nbytes, head, trailer)``: ``head`` is where the trailer starts
        (after the padded tensor and, for an ``input`` payload, the RNG state)."""
        got = self._layouts.get(payload)
        if got is None:
            shape, dtype, nbytes = expected_layout(payload)
            head = _pad8(nbytes) + (_pad8(sum(self._rng_sizes)) if payload.kind == INPUT else 0)
            trailer = _trailer(payload, shape, dtype, head if payload.kind == INPUT else nbytes)
            got = self._layouts[payload] = (shape, dtype, nbytes, head, torch.tensor(
                trailer, dtype=torch.int64).view(torch.uint8).to(self.device))
        return got

    def check_outgoing(self, tensor, payload: Payload, where: str) -> None:
        """``check_outgoing`` against the cached layout (the same checks and message)."""
        shape, dtype = self._layout(payload)[:2]
        if type(tensor) is not torch.Tensor or tensor.dtype != dtype or tensor.shape != shape:
            check_outgoing(tensor, payload, self.rank, where)

    def outgoing(self, value, payload: Payload) -> torch.Tensor:
        """The buffer to send: a tensor, or a ``ShippedInput`` for an ``input`` payload
        (checks done by ``check_outgoing`` first)."""
        shipped = value if payload.kind == INPUT else None
        tensor = (shipped.tensor if shipped is not None else value).detach()
        if not self.check and shipped is None:
            return tensor.contiguous()
        _, _, nbytes, head, trailer = self._layout(payload)
        buf = torch.empty(head + (TRAILER_BYTES if self.check else 0), dtype=torch.uint8,
                          device=self.device)
        if nbytes:
            buf[:nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        if shipped is not None:
            offset = _pad8(nbytes)
            for state in shipped.rng:
                buf[offset:offset + state.numel()].copy_(state)
                offset += state.numel()
        if self.check:
            buf[head:].copy_(trailer)
        return buf

    def incoming(self, payload: Payload) -> torch.Tensor:
        """An empty receive buffer of exactly the plan's size."""
        shape, dtype, _, head, _ = self._layout(payload)
        if not self.check:
            if payload.kind == INPUT:
                return torch.empty(head, dtype=torch.uint8, device=self.device)
            return torch.empty(shape, dtype=dtype, device=self.device)
        buf = torch.empty(head + TRAILER_BYTES, dtype=torch.uint8, device=self.device)
        buf[head:].zero_()
        return buf

    def decode(self, buf: torch.Tensor, payload: Payload, src: int, where: str):
        """The received tensor (a ``ShippedInput`` for an ``input`` payload), after checking
        the trailer against the plan's payload."""
        if not self.check and payload.kind != INPUT:
            return buf
        shape, dtype, nbytes, head, trailer = self._layout(payload)
        if self.check and not torch.equal(buf[head:], trailer):
            got = buf[head:].view(torch.int64).tolist()
            sent = got if got[0] == _MAGIC else self._find_trailer(buf, head)
            what = ("a message without a trailer (not sent by an mpipe executor?)" if sent is None
                    else _trailer_text(sent))
            raise PayloadMismatchError(
                f"rank {self.rank}: {where}: received {what} from rank {src}, but the plan "
                f"expects {describe(payload)}, shape {_shape_text(shape, payload.dtype)}")
        tensor = buf[:nbytes].view(dtype).view(shape) if nbytes else torch.empty(
            shape, dtype=dtype, device=self.device)
        if payload.kind != INPUT:
            return tensor
        states, offset = [], _pad8(nbytes)
        for size in self._rng_sizes:
            states.append(buf[offset:offset + size].cpu().clone())
            offset += size
        return ShippedInput(tensor, tuple(states))

    @staticmethod
    def _find_trailer(buf: torch.Tensor, head: int) -> list[int] | None:
        """A shorter message puts its trailer earlier: find it (8-byte aligned)."""
        words = buf.view(torch.int64)
        hits = (words[:head // 8] == _MAGIC).nonzero().flatten().tolist()
        for i in reversed(hits):
            trailer = words[i:i + _SLOTS].tolist()
            if _pad8(trailer[1]) == i * 8:  # its size field puts it right there
                return trailer
        return None


class Watchdog:
    """Ends the process if one communication op stays in flight past its deadline."""

    def __init__(self, rank: int, grace_s: float = 10.0) -> None:
        self.rank = rank
        self.grace_s = grace_s
        # (what, since, limit), replaced whole: no lock needed
        self._armed: tuple[str, float, float] | None = None
        self._thread = threading.Thread(target=self._run, name="mpipe-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, timeout_s: float) -> None:
        """Watch one wait: the process ends ``timeout_s`` plus the grace from now."""
        self._armed = (what, time.monotonic(), timeout_s + self.grace_s)

    def disarm(self) -> None:
        self._armed = None

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > armed[2]:
                sys.stderr.write(f"mpipe executor rank {self.rank}: {armed[0]} made no progress "
                                 f"for {armed[2]:.0f} s: a peer is dead or stuck; aborting\n")
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT)


def _seconds(timeout, variable: str, default: float) -> float:
    if timeout is None:
        return float(os.environ.get(variable, default))
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def timeout_seconds(timeout: float | datetime.timedelta | None = None) -> float:
    """The wait timeout: ``timeout``, else ``MPIPE_TIMEOUT``, else 300 s."""
    return _seconds(timeout, "MPIPE_TIMEOUT", DEFAULT_TIMEOUT_S)


def startup_seconds(timeout: float | datetime.timedelta | None = None) -> float:
    """The start-up timeout (process group, handshake): ``timeout``, else
    ``MPIPE_STARTUP_TIMEOUT``, else torch.distributed's default (30 min)."""
    return _seconds(timeout, "MPIPE_STARTUP_TIMEOUT", DEFAULT_STARTUP_TIMEOUT_S)


def pick_backend() -> str:
    """``MPIPE_BACKEND`` if set; NCCL when every local rank has its own GPU; else gloo."""
    chosen = os.environ.get("MPIPE_BACKEND")
    if chosen:
        return chosen
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local:
        return "nccl"
    return "gloo"


def init_distributed(timeout: float | datetime.timedelta | None = None,
                     backend: str | None = None) -> tuple[int, int, torch.device]:
    """Initialise the default process group from the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: set by ``mpipe-run`` or ``torchrun``)
    unless it already is, with the start-up timeout (``timeout``, else ``startup_seconds``);
    returns ``(rank, world_size, device)``."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else pick_backend())
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise PipelineError(f"cannot start the process group: {', '.join(missing)} not set "
                                "(launch with mpipe-run --nproc N or torchrun)")
        limit = startup_seconds(timeout)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=limit))
        except Exception as err:  # the store's or backend's error: one clear line
            raise PeerError(f"rank {os.environ['RANK']}: starting the process group failed "
                            f"(start-up timeout {limit:g} s): "
                            f"{backend_reason(err, limit)}") from err
    return dist.get_rank(), dist.get_world_size(), device


def post_p2p(items: Sequence[tuple[bool, torch.Tensor, int]], group=None) -> list:
    """Post sends/receives ``(is_send, buffer, peer)``, ``peer`` a rank of ``group`` (None:
    the default group): one op alone with ``isend``/``irecv``, several together with
    ``batch_isend_irecv``."""
    if len(items) == 1:
        is_send, buf, peer = items[0]
        return [dist.isend(buf, group=group, group_dst=peer) if is_send
                else dist.irecv(buf, group=group, group_src=peer)]
    return dist.batch_isend_irecv([dist.P2POp(dist.isend if s else dist.irecv, buf,
                                              group=group, group_peer=peer)
                                   for s, buf, peer in items])


def wait_all(works: list, timeout_s: float, rank: int, where: str, peers: str) -> None:
    limit = _limit(timeout_s)
    for work in works:
        try:
            work.wait(limit)
        except Exception as err:  # the backend's own error: make it one clear line
            raise PeerError(f"rank {rank}: {where} with {peers} failed: "
                            f"{backend_reason(err, timeout_s)}") from err


@functools.lru_cache(maxsize=8)
def _limit(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def backend_reason(err: BaseException, timeout_s: float) -> str:
    """One line from a backend error: what happened, then the backend's own words."""
    text = " ".join(str(err).split())
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0] or type(err).__name__
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return f"timed out after {timeout_s:g} s (the peer is stuck or too slow): {detail}"
    if "closed" in low or "reset" in low or "broken pipe" in low or "refused" in low:
        return f"the peer died or closed its connection: {detail}"
    return detail
