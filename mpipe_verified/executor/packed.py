"""Messages of structured payloads (``Payload.leaves``): one message per payload.

Layout: each tensor leaf's bytes in the plan's leaf order, each starting at a multiple of
8 bytes (16 for complex128; a None leaf has none), then a leaf table (``LEAF_WORDS`` int64 words per leaf: a hash of
its path, its dtype code, its number of dimensions, a hash of its shape and its first
six dimensions; -1s for a None leaf), then the usual 128-byte trailer of ``comm`` (its
dtype slot ``STRUCT``, its shape-hash slot a hash of the whole layout, its ``ndim`` slot
the number of leaves). The receiver posts exactly the plan's size and compares table and
trailer with the plan's: a difference is a ``PayloadMismatchError`` naming the first leaf
that differs (a smaller message's trailer is found earlier, as for a single tensor).
Without checks (``check_messages=False``) the message is the leaf bytes alone.

Invariants: a leaf is sent only if its path, shape and dtype are the plan's (checked
first); a received value is the plan's structure (``tree.unflatten`` of its leaves; a
gradient stays a ``tree.Flat``).
"""

from __future__ import annotations

import attrs
import torch

from ..ir import GRAD, INPUT, RANK_MOVES, Payload, p2p_of, path_steps
from . import comm
from .errors import PayloadMismatchError, PipelineError
from .tree import Flat, flatten, unflatten

LEAF_WORDS = 10
STRUCT = comm.STRUCT  # the trailer's dtype slot for a structured payload
_NONE = -2   # a None leaf's dtype code


@attrs.frozen
class Packed:
    """A structured payload's message layout: per leaf its dtype (None for a None leaf),
    byte offset and size; ``data`` the padded leaf bytes, ``tail`` the expected table and
    trailer (uint8)."""

    dtypes: tuple
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: int
    tail: torch.Tensor


def _leaf_text(shape, dtype) -> str:
    return "None" if shape is None else f"{tuple(shape)} {dtype}"


def _record(leaf, dtype) -> list[int]:
    if leaf.shape is None:
        return [comm._small_hash(leaf.path), _NONE, -1, -1] + [-1] * 6
    dims = list(leaf.shape[:6]) + [-1] * (6 - min(len(leaf.shape), 6))
    return [comm._small_hash(leaf.path), comm._DTYPE_CODE.get(dtype, -1), len(leaf.shape),
            comm._small_hash(repr(tuple(leaf.shape)))] + dims


def check_plan(payload: Payload) -> None:
    """Refuse a structured payload the executor cannot run (an ``input`` payload, an
    unknown dtype, paths that describe no structure, a gradient's path given twice)."""
    if payload.kind == INPUT:
        raise PipelineError(f"{comm.describe(payload)}: a shipped raw input is one tensor")
    for leaf in payload.leaves:
        if leaf.dtype is not None:
            comm.torch_dtype(leaf.dtype)
    try:
        paths = [leaf.path for leaf in payload.leaves]
        if payload.kind == GRAD:  # a gradient's leaves: some of its activation's
            for path in paths:
                path_steps(path)
            if len(set(paths)) != len(paths):
                raise ValueError("a leaf path is given twice")
        elif paths:
            unflatten((path, None) for path in paths)
    except ValueError as err:
        raise PipelineError(f"{comm.describe(payload)}: {err}") from None


def check_program(program, rank: int) -> None:
    """Every payload ``program`` sends or receives has a layout messages can carry
    (``comm.expected_layout`` for one tensor, ``check_plan`` for a structure); a lend or
    return carries a stored activation, whose layout its own header gives (``moves``)."""
    for index, op in enumerate(program):
        for c in p2p_of(op):
            if c.payload.kind in RANK_MOVES:
                continue
            try:
                if c.payload.leaves is None:
                    comm.expected_layout(c.payload)
                else:
                    check_plan(c.payload)
            except PipelineError as err:
                raise PipelineError(f"rank {rank}: {op} at position {index}: {err}") from None


def layout(payload: Payload, device: torch.device) -> Packed:
    dtypes = tuple(None if x.dtype is None else comm.torch_dtype(x.dtype)
                   for x in payload.leaves)
    offsets, sizes, at = [], [], 0
    for leaf, dtype in zip(payload.leaves, dtypes):
        numel = 1
        for d in leaf.shape or ():
            numel *= int(d)
        size = 0 if dtype is None else numel * dtype.itemsize
        align = 16 if dtype is not None and dtype.itemsize > 8 else 8  # complex128
        at = (at + align - 1) // align * align
        offsets.append(at)
        sizes.append(size)
        at += comm._pad8(size)
    words = [w for leaf, dtype in zip(payload.leaves, dtypes) for w in _record(leaf, dtype)]
    head = at + 8 * len(words)
    text = repr([(x.path, x.shape, x.dtype) for x in payload.leaves])
    trailer = [comm._MAGIC, head, STRUCT, comm._KIND_CODE[payload.kind], payload.stage,
               payload.mb, comm._small_hash(payload.segment),
               comm._small_hash(payload.to_segment), comm._small_hash(text),
               len(payload.leaves)] + [-1] * 6
    tail = torch.tensor(words + trailer, dtype=torch.int64).view(torch.uint8).to(device)
    return Packed(dtypes, tuple(offsets), tuple(sizes), at, tail)


def check_outgoing(value, payload: Payload, rank: int, where: str) -> list:
    """The leaves of ``value`` to send, checked against the plan's (raises
    ``PayloadMismatchError`` naming the first leaf that differs)."""
    what = f"rank {rank}: {where}: refusing to send {comm.describe(payload)}"
    try:
        got = flatten(value)
    except TypeError as err:
        raise PayloadMismatchError(f"{what}: {err}") from None
    plan = payload.leaves
    if [p for p, _ in got] != [x.path for x in plan]:
        extra = [p for p, _ in got if p not in {x.path for x in plan}]
        lost = [x.path for x in plan if x.path not in {p for p, _ in got}]
        raise PayloadMismatchError(
            f"{what}: its leaves are {[p for p, _ in got]} but the plan's are "
            f"{[x.path for x in plan]}" + (f" (leaf {extra[0]} is not in the plan)" if extra
                                           else f" (leaf {lost[0]} is missing)" if lost else ""))
    for (path, x), leaf in zip(got, plan):
        shape = None if x is None else tuple(x.shape)
        dtype = None if x is None else comm.dtype_name(x.dtype)
        if shape != leaf.shape or dtype != leaf.dtype:
            raise PayloadMismatchError(
                f"{what}: leaf {path} is {_leaf_text(shape, dtype)} but the plan's is "
                f"{_leaf_text(leaf.shape, leaf.dtype)}")
    return [x for _, x in got]


def outgoing(leaves: list, packed: Packed, check: bool, device) -> torch.Tensor:
    size = packed.data + packed.tail.numel() if check else max(packed.data, 8)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for x, at, n in zip(leaves, packed.offsets, packed.sizes):
        if n:
            buf[at:at + n].copy_(x.detach().contiguous().reshape(-1).view(torch.uint8))
    if check:
        buf[packed.data:].copy_(packed.tail)
    return buf


def incoming(packed: Packed, check: bool, device) -> torch.Tensor:
    if not check:
        return torch.empty(max(packed.data, 8), dtype=torch.uint8, device=device)
    buf = torch.empty(packed.data + packed.tail.numel(), dtype=torch.uint8, device=device)
    buf[packed.data:].zero_()
    return buf


def decode(buf: torch.Tensor, payload: Payload, packed: Packed, messages, src: int,
           where: str):
    """The received value (a ``Flat`` for a gradient), after checking table and trailer."""
    if messages.check and not torch.equal(buf[packed.data:], packed.tail):
        raise PayloadMismatchError(f"rank {messages.rank}: {where}: received from rank {src} "
                                   f"{_difference(buf, payload, packed)}")
    items = []
    for leaf, dtype, at, n in zip(payload.leaves, packed.dtypes, packed.offsets, packed.sizes):
        if dtype is None:
            items.append((leaf.path, None))
            continue
        shape = tuple(leaf.shape)
        items.append((leaf.path, buf[at:at + n].view(dtype).view(shape) if n else
                      torch.empty(shape, dtype=dtype, device=buf.device)))
    return Flat(tuple(items)) if payload.kind == GRAD else unflatten(items)


def _difference(buf: torch.Tensor, payload: Payload, packed: Packed) -> str:
    """What the message holds that the plan does not, naming the first leaf that differs."""
    head = buf.numel() - comm.TRAILER_BYTES
    words = buf.view(torch.int64)
    got = words[head // 8:].tolist()
    sent = got if got[0] == comm._MAGIC else comm.Messages._find_trailer(buf, head)
    plan = f"the plan expects {comm.describe(payload)} with leaves " + ", ".join(
        f"{x.path} {_leaf_text(x.shape, x.dtype)}" for x in payload.leaves)
    if sent is None:
        return f"a message without a trailer (not sent by an mpipe executor?), but {plan}"
    if sent[2] != STRUCT:
        return f"{comm._trailer_text(sent)} (one tensor), but {plan}"
    expected = packed.tail[:-comm.TRAILER_BYTES].view(torch.int64).tolist()
    if sent[3:8] != expected_trailer(packed)[3:8]:
        return f"{comm._trailer_text(sent)}, but {plan}"
    start = (comm._pad8(sent[1]) - 8 * LEAF_WORDS * sent[9]) // 8
    table = words[start:start + LEAF_WORDS * sent[9]].tolist() if start >= 0 else []
    for i, leaf in enumerate(payload.leaves):
        mine = expected[i * LEAF_WORDS:(i + 1) * LEAF_WORDS]
        theirs = table[i * LEAF_WORDS:(i + 1) * LEAF_WORDS]
        if mine != theirs:
            return (f"a message whose leaf {leaf.path} is {_record_text(theirs, leaf.path)}, "
                    f"but the plan's leaf {leaf.path} is {_leaf_text(leaf.shape, leaf.dtype)}")
    return f"a message of {sent[9]} leaves, but {plan}"


def expected_trailer(packed: Packed) -> list[int]:
    return packed.tail[-comm.TRAILER_BYTES:].view(torch.int64).tolist()


def _record_text(words: list[int], path: str) -> str:
    if not words:
        return "absent"
    if words[0] != comm._small_hash(path):
        return "at another path (the leaves differ in structure)"
    if words[1] == _NONE:
        return "None"
    dims = words[4:4 + min(words[2], 6)]
    shape = "(" + ", ".join(map(str, dims)) + (", …" if words[2] > 6 else "") + \
        ("," if words[2] == 1 else "") + ")"
    dtype = comm._DTYPES[words[1]] if 0 <= words[1] < len(comm._DTYPES) else "?"
    return f"{shape} {comm.dtype_name(dtype) if dtype != '?' else dtype}"


class Messages(comm.Messages):
    """``comm.Messages`` that also carries structured payloads (``Payload.leaves``)."""

    def __init__(self, rank: int, device: torch.device, check: bool = True) -> None:
        super().__init__(rank, device, check)
        self._packed: dict[Payload, Packed] = {}

    def _pack(self, payload: Payload) -> Packed:
        got = self._packed.get(payload)
        if got is None:
            got = self._packed[payload] = layout(payload, self.device)
        return got

    def check_outgoing(self, value, payload: Payload, where: str) -> None:
        if payload.leaves is None:
            return super().check_outgoing(value, payload, where)
        check_outgoing(value, payload, self.rank, where)

    def outgoing(self, value, payload: Payload) -> torch.Tensor:
        if payload.leaves is None:
            return super().outgoing(value, payload)
        return outgoing([x for _, x in flatten(value)], self._pack(payload), self.check,
                        self.device)

    def incoming(self, payload: Payload) -> torch.Tensor:
        if payload.leaves is None:
            return super().incoming(payload)
        return incoming(self._pack(payload), self.check, self.device)

    def decode(self, buf: torch.Tensor, payload: Payload, src: int, where: str):
        if payload.leaves is None:
            return super().decode(buf, payload, src, where)
        return decode(buf, payload, self._pack(payload), self, src, where)
