"""Immutable IR: ops, placement, schedule and plan (docs/semantics.md §1).

Every value is a frozen, slotted attrs class: hashable, comparable, and with a stable
text form (``str(op)``) that uses PyTorch's pipelining action strings (``2F0``, ``0I3``,
``0W3``, ``1SEND_F3``, ``2RECV_B0``, ``(0F7;7B3)OVERLAP_F_B``).

Invariants:
- A ``Schedule`` holds compute work (``Compute``, ``Overlap``, ``Idle``, ``Marker``) and
  the collectives a term asks for (``transpose``'s broadcast and all-reduce).
- A ``Plan`` may also hold ``Send``, ``Recv``, ``Group`` and ``Collective``.
- A ``forward_only`` schedule or plan (an evaluation run) declares that it holds no
  backward work: no ``B``/``I``/``W``/``R`` is required of it, and none may occur.
- ``Offload``/``Reload`` move a stored activation from its rank's device memory to host
  memory and back (PipeOffload); they compute nothing and send nothing.
- ``Idle`` is an empty step (an empty CSV cell) and ``Marker`` an FSDP bookkeeping action
  (``UNSHARD``/``RESHARD``/``REDUCE_GRAD``); both are kept only so a file reads back
  unchanged, and the semantics ignore them.
"""

from __future__ import annotations

import collections
import itertools
import json
import operator
import re
import types
import weakref
from typing import Callable, Sequence, Union

import attrs

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE = "F", "B", "I", "W", "R"
COMPUTE_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE)
ACT, GRAD, INPUT = "act", "grad", "input"
LEND, RETURN = "lend", "return"  # a stored activation lent to a peer rank, and given back
RANK_MOVES = (LEND, RETURN)
PAYLOAD_KINDS = (ACT, GRAD, INPUT) + RANK_MOVES
BODY = ""  # the pipelined body's segment name
MARKER_ACTIONS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
COLLECTIVE_KINDS = ("broadcast", "all_reduce", "gather")
# What a VERIFIED establishes of a plan, in report order (docs/semantics.md §3).
PROPERTIES = ("completeness", "dependency", "matching", "deadlock", "memory")


def _seg(segment: str) -> str:
    return f"{segment}:" if segment else ""


def _nonneg(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative int, got {value!r}")


@attrs.frozen(order=True)
class Compute:
    """``F``/``B``/``I``/``W`` of ``(segment, stage, mb)``; ``R`` re-runs a forward from
    its shipped input to rebuild what a backward needs (central recompute)."""

    kind: str = attrs.field(validator=attrs.validators.in_(COMPUTE_KINDS))
    stage: int = attrs.field(validator=_nonneg)
    mb: int = attrs.field(validator=_nonneg)
    segment: str = ""

    def __str__(self) -> str:
        return f"{_seg(self.segment)}{self.stage}{self.kind}{self.mb}"


@attrs.frozen(order=True)
class Overlap:
    """Several compute ops in one step (DualPipeV's ``OVERLAP_F_B``); all read their
    inputs before the step and publish their outputs after it."""

    ops: tuple[Compute, ...] = attrs.field(validator=lambda _, __, ops: _members_are(
        ops, (Compute,), "an overlapped step holds compute ops"))

    def __str__(self) -> str:
        return "(" + ";".join(map(str, self.ops)) + ")OVERLAP_F_B"


def _members_are(ops, kinds: tuple, what: str) -> None:
    if type(ops) is not tuple or not ops or not all(map(kinds.__contains__, map(type, ops))):
        raise ValueError(f"{what} (one or more), got {ops!r}")


_LETTERS = {ACT: "F", GRAD: "B", INPUT: "IN", LEND: "LEND", RETURN: "RETURN"}
_STEP = re.compile(r'\((\d+)\)|\[(\d+)\]|\[("(?:[^"\\]|\\.)*")\]')


def path_steps(path: str) -> tuple[tuple[str, int | str], ...]:
    """The steps of a leaf path: ``(i)`` the i-th item of a tuple, ``[i]`` of a list,
    ``["key"]`` (a JSON string) a dict's item, concatenated; ``""`` is the value itself.
    Raises ``ValueError`` on any other text."""
    steps, at = [], 0
    while at < len(path):
        m = _STEP.match(path, at)
        if m is None:
            raise ValueError(f"bad leaf path {path!r} at character {at}")
        tup, lst, key = m.groups()
        steps.append(("tuple", int(tup)) if tup is not None else ("list", int(lst))
                     if lst is not None else ("dict", json.loads(key)))
        at = m.end()
    return tuple(steps)


def path_text(steps) -> str:
    """The path of ``steps`` (inverse of ``path_steps``)."""
    return "".join(f"({k})" if kind == "tuple" else f"[{k}]" if kind == "list"
                   else f"[{json.dumps(k)}]" for kind, k in steps)


@attrs.frozen(order=True)
class Leaf:
    """One leaf of a structured payload: where it sits in the value (``path``, see
    ``path_steps``) and the tensor's ``shape``/``dtype``; both None for a None leaf."""

    path: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.shape is None) != (self.dtype is None):
            raise ValueError(f"leaf {self.path!r}: a shape and a dtype, or neither (None)")


def _leaves(instance, attribute, value) -> None:
    if value is not None and (type(value) is not tuple
                              or not all(type(x) is Leaf for x in value)):
        raise ValueError(f"leaves must be None or a tuple of Leaf, got {value!r}")
    if value is not None and (instance.shape is not None or instance.dtype is not None):
        raise ValueError("a payload with leaves has no shape or dtype of its own")


@attrs.frozen(order=True)
class Payload:
    """What travels: the activation (``act``, to ``stage + 1``), the gradient (``grad``, to
    ``stage - 1``) or the raw input (``input``, for a recompute) of ``(segment, stage,
    mb)``. ``to_segment`` names the consumer's segment when the transfer crosses the cut
    (the consumer is then that segment's first stage, or the body's first/last stage).
    BPipe-style rank moves (docs/semantics.md §2.10): ``lend`` carries the stored
    activation of ``(segment, stage, mb)`` from the rank that computed it to a peer that
    holds it in device memory, ``return`` gives it back (text ``1SEND_LEND0``,
    ``1RECV_LEND0``, ``1SEND_RETURN0``, ``1RECV_RETURN0``: both ends name the activation's
    stage).

    Layout: ``shape``/``dtype`` describe one tensor (``leaves`` None); or ``leaves``
    describes a structure (tuples, lists, dicts of tensors and None), one ``Leaf`` per
    tensor or None in flattening order (depth first, dict items in insertion order), and
    ``shape``/``dtype`` are None. ``leaves == ()``: nothing travels (the gradient of an
    activation that needs none)."""

    kind: str = attrs.field(validator=attrs.validators.in_(PAYLOAD_KINDS))
    stage: int = attrs.field(validator=_nonneg)
    mb: int = attrs.field(validator=_nonneg)
    segment: str = ""
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    to_segment: str | None = None
    leaves: tuple[Leaf, ...] | None = attrs.field(default=None, validator=_leaves)

    @property
    def consumer_stage(self) -> int:
        if self.kind == INPUT or self.kind == LEND or self.kind == RETURN:
            return self.stage
        if self.to_segment is not None:
            return 0
        return self.stage + 1 if self.kind == ACT else self.stage - 1

    @property
    def consumer_segment(self) -> str:
        return self.segment if self.to_segment is None else self.to_segment

    @property
    def letter(self) -> str:
        return _LETTERS[self.kind]


@attrs.frozen(order=True)
class Send:
    """Send ``payload`` to rank ``dst``. Text: the producing stage, ``SEND_F``/``SEND_B``."""

    dst: int = attrs.field(validator=_nonneg)
    payload: Payload

    @property
    def peer(self) -> int:
        return self.dst

    def __str__(self) -> str:
        p = self.payload
        return f"{_seg(p.segment)}{p.stage}SEND_{p.letter}{p.mb}"


@attrs.frozen(order=True)
class Recv:
    """Receive ``payload`` from rank ``src``. Text: the consuming stage, ``RECV_F``/``RECV_B``."""

    src: int = attrs.field(validator=_nonneg)
    payload: Payload

    @property
    def peer(self) -> int:
        return self.src

    def __str__(self) -> str:
        p = self.payload
        return f"{_seg(p.consumer_segment)}{p.consumer_stage}RECV_{p.letter}{p.mb}"


P2P = Union[Send, Recv]


@attrs.frozen(order=True)
class Group:
    """Comm ops posted together (NCCL group / ``batch_isend_irecv``): the group completes
    when every member has matched; members never block each other."""

    ops: tuple[P2P, ...] = attrs.field(validator=lambda _, __, ops: _members_are(
        ops, (Send, Recv), "a group holds sends and receives"))

    def __str__(self) -> str:
        return "[" + ";".join(map(str, self.ops)) + "]GROUP"


@attrs.frozen(order=True)
class Collective:
    """A collective over ``ranks``; completes when every member reaches it. Members must
    call their group's collectives in the same order. ``tag`` names what it carries."""

    kind: str = attrs.field(validator=attrs.validators.in_(COLLECTIVE_KINDS))
    ranks: tuple[int, ...]
    tag: str = ""
    root: int | None = None

    def __str__(self) -> str:
        root = "" if self.root is None else f"@{self.root}"
        return f"{self.kind.upper()}({self.tag}{root}|{','.join(map(str, self.ranks))})"


@attrs.frozen(order=True)
class _Move:
    """An activation move of ``(segment, stage, mb)`` on its rank (``WORD``: its text)."""

    stage: int = attrs.field(validator=_nonneg)
    mb: int = attrs.field(validator=_nonneg)
    segment: str = ""
    WORD = ""

    def __str__(self) -> str:
        return f"{_seg(self.segment)}{self.stage}{self.WORD}{self.mb}"


@attrs.frozen(order=True)
class Offload(_Move):
    """Move the stored activation from this rank's device memory to host memory (it must
    be resident: after its ``F``, before its backward). Text: ``2OFFLOAD0``."""

    WORD = "OFFLOAD"


@attrs.frozen(order=True)
class Reload(_Move):
    """Move the stored activation this rank offloaded back to device memory (before its
    backward). Text: ``2RELOAD0``."""

    WORD = "RELOAD"


MOVES = (Offload, Reload)  # activation moves between a rank's device and host memory


@attrs.frozen(order=True)
class Idle:
    """An empty step (an empty CSV cell)."""

    def __str__(self) -> str:
        return ""


@attrs.frozen(order=True)
class Marker:
    """FSDP bookkeeping (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``): read, kept, ignored."""

    stage: int = attrs.field(validator=_nonneg)
    action: str = attrs.field(validator=attrs.validators.in_(MARKER_ACTIONS))
    mb: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.action}{'' if self.mb is None else self.mb}"


def build_many(cls: type, n: int, columns: dict[str, Sequence]) -> list:
    """``[cls(**row) for row in rows]`` for ``n`` rows given as one column per field (a
    missing field takes its default), built field by field in bulk, several times faster
    than calling ``cls``. For readers that have checked every value themselves: nothing is
    validated. ``cls`` is a value class without a post-init check (``Compute``,
    ``Payload``, ``Send``, ``Recv``, ``Marker``); every slot of every object is set, so
    the result equals (and hashes as) what ``cls`` builds from the same values."""
    if cls not in _BULK:
        raise TypeError(f"build_many builds {', '.join(c.__name__ for c in _BULK)}, "
                        f"not {cls.__name__}")
    objs = list(map(object.__new__, itertools.repeat(cls, n)))
    for field in attrs.fields(cls):
        values = columns.get(field.name)
        if values is None:
            if field.default is attrs.NOTHING:
                raise ValueError(f"build_many: no column for {cls.__name__}.{field.name}")
            values = itertools.repeat(field.default, n)
        elif len(values) != n:
            raise ValueError(f"build_many: {len(values)} values of {field.name} for {n} rows")
        slot = cls.__dict__[field.name]
        assert isinstance(slot, types.MemberDescriptorType)
        collections.deque(map(slot.__set__, objs, values), maxlen=0)
    return objs


_KNOWN_CELLS: list = [lambda: None, None]  # the plan a bulk reader built last (not kept
# alive), and what it knew of its ops (dropped with the plan)


def remember_op_cells(plan: "Plan", cells) -> None:
    """Record what a bulk reader knew of ``plan``'s ops while building them: ``cells`` is
    ``(kind, stage, mb)``, integer arrays over the ops in rank-major program order, where
    two ops of one rank with equal ``kind`` and ``stage`` differ only in their microbatch
    ``mb`` (``kind`` -1: an idle step, -2: a marker). Only the last plan is kept, weakly,
    and its arrays are made read-only; a hint for ``semantics.op_table``, never read by
    the kernel."""
    for column in cells:
        column.flags.writeable = False

    def forget(ref) -> None:
        if _KNOWN_CELLS[0] is ref:
            _KNOWN_CELLS[:] = [lambda: None, None]
    _KNOWN_CELLS[:] = [weakref.ref(plan, forget), tuple(cells)]


def known_op_cells(plan: "Plan"):
    """``remember_op_cells``'s columns if ``plan`` is the plan they were recorded for,
    else None."""
    return _KNOWN_CELLS[1] if _KNOWN_CELLS[0]() is plan else None


Op = Union[Compute, Overlap, Send, Recv, Group, Collective, Idle, Marker, Offload, Reload]
COMM_STEP = (Send, Recv, Group, Collective)
_BULK = (Compute, Payload, Send, Recv, Marker)  # no __attrs_post_init__, defaults plain


def computes_of(op: Op) -> tuple[Compute, ...]:
    """The compute ops a step performs (an ``Overlap`` performs several)."""
    if isinstance(op, Compute):
        return (op,)
    if isinstance(op, Overlap):
        return op.ops
    return ()


def p2p_of(op: Op) -> tuple[P2P, ...]:
    """The point-to-point comm ops a step posts."""
    if isinstance(op, (Send, Recv)):
        return (op,)
    if isinstance(op, Group):
        return op.ops
    return ()


def map_payloads(plan: "Plan", fn: Callable[[Payload], Payload]) -> "Plan":
    """A copy of ``plan`` whose every ``SEND``/``RECV`` payload (in groups too) is
    ``fn(payload)``; every other op is kept as it is."""

    def one(op):
        if isinstance(op, Send):
            return Send(op.dst, fn(op.payload))
        if isinstance(op, Recv):
            return Recv(op.src, fn(op.payload))
        if isinstance(op, Group):
            return Group(tuple(one(c) for c in op.ops))
        return op

    return attrs.evolve(plan, programs=tuple(tuple(one(op) for op in prog)
                                             for prog in plan.programs))


@attrs.frozen
class Placement:
    """Stage → rank map. ``stage_to_rank[s]`` is the rank holding stage ``s``."""

    stage_to_rank: tuple[int, ...]
    num_ranks: int

    def __attrs_post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError("a placement needs at least one rank")
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(f"stage placed on rank {bad[0]} outside 0..{self.num_ranks - 1}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @classmethod
    def looped(cls, ranks: int, chunks: int = 1) -> "Placement":
        """Stage ``s`` on rank ``s % ranks``."""
        return cls(tuple(s % ranks for s in range(ranks * chunks)), ranks)

    @classmethod
    def vshape(cls, ranks: int) -> "Placement":
        """Two chunks per rank: stage ``s`` on ``s`` for ``s < p``, else ``2p-1-s``."""
        return cls(tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)), ranks)


SOURCE, SINK = "source", "sink"


@attrs.frozen
class SegmentWork:
    """A one-stage segment cut off the body (the algebra's ``cut``): a ``source`` (an encoder
    feeding the body's first stage) or a ``sink`` (a generator fed by the body's last
    stage; detached: its loss does not flow back into the body).

    ``forward_rank[mb]`` runs ``F(name, 0, mb)``; ``backward_rank[mb]`` runs its backward
    (None: frozen or parameter-free, no backward). With ``recompute``, a backward rank that
    did not run the forward first re-runs it (``R``) from the shipped input. ``home`` holds
    the parameters before the step; ``broadcast`` sends them to every rank first;
    ``all_reduce`` sums the weight gradients of all ranks at the end."""

    name: str
    side: str = attrs.field(validator=attrs.validators.in_((SOURCE, SINK)))
    forward_rank: tuple[int, ...] = ()
    backward_rank: tuple[int, ...] | None = None
    recompute: bool = False
    home: int = 0
    broadcast: bool = False
    all_reduce: bool = False

    @property
    def trainable(self) -> bool:
        return self.backward_rank is not None

    def needs_recompute(self, mb: int) -> bool:
        return (self.recompute and self.backward_rank is not None
                and self.backward_rank[mb] != self.forward_rank[mb])


@attrs.frozen
class Cut:
    """The segments cut off the body, in data-flow order (sources first)."""

    segments: tuple[SegmentWork, ...] = ()

    def get(self, name: str) -> SegmentWork | None:
        return next((s for s in self.segments if s.name == name), None)


NO_CUT = Cut()


def _check_cut(cut: Cut, num_ranks: int, num_microbatches: int) -> None:
    """A cut fits its plan: distinct non-empty names, one forward (and backward) rank per
    microbatch, every rank (and the home) an existing one."""
    names = [seg.name for seg in cut.segments]
    if len(set(names)) != len(names) or not all(type(x) is str and x for x in names):
        raise ValueError(f"segment names must be distinct non-empty texts, got {names}")
    for seg in cut.segments:
        for what, ranks in (("forward_rank", seg.forward_rank),
                            ("backward_rank", seg.backward_rank)):
            if ranks is None:
                continue
            if len(ranks) != num_microbatches:
                raise ValueError(f"segment {seg.name!r}: {what} lists {len(ranks)} ranks for "
                                 f"{num_microbatches} microbatches")
            bad = [r for r in ranks if not (type(r) is int and 0 <= r < num_ranks)]
            if bad:
                raise ValueError(f"segment {seg.name!r}: {what} names rank {bad[0]!r} outside "
                                 f"0..{num_ranks - 1}")
        if not (type(seg.home) is int and 0 <= seg.home < num_ranks):
            raise ValueError(f"segment {seg.name!r}: home rank {seg.home!r} outside "
                             f"0..{num_ranks - 1}")


def _seq_chunks(instance, attribute, value) -> None:
    ok = type(value) is int and value >= 1 and (value == 1 or not (instance.num_microbatches % value or instance.forward_only))
    parts = [{mb // value for mb in p} for p in instance.pipelines] if ok and value > 1 else []
    if not ok or sum(map(len, parts)) != len(set().union(*parts)):  # a sample in 2 pipelines
        raise ValueError(f"seq_chunks must be an int >= 1 dividing the microbatches, a sample in one pipeline, not forward-only, got {value!r}")


def _check_pipelines(pipelines, num_stages: int, num_microbatches: int, cut: Cut) -> None:
    """``()`` (one pipeline of every microbatch), or k >= 1 tuples of microbatches that
    partition ``range(num_microbatches)``, with ``num_stages`` a positive multiple of k; no
    cut besides."""
    if pipelines == ():
        return
    if type(pipelines) is not tuple or not all(
            type(p) is tuple and p and all(type(mb) is int for mb in p) for p in pipelines):
        raise ValueError(f"pipelines must be a tuple of non-empty mb tuples, got {pipelines!r}")
    flat = sorted(mb for p in pipelines for mb in p)
    if flat != list(range(num_microbatches)):
        raise ValueError(f"pipelines {pipelines!r} do not partition microbatches "
                         f"0..{num_microbatches - 1}")
    if num_stages % len(pipelines) or num_stages < len(pipelines):
        raise ValueError(f"{num_stages} stages do not split into {len(pipelines)} pipelines")
    if cut.segments:
        raise ValueError("several pipelines and a cut together are not supported")


def _programs_text(programs: tuple[tuple[Op, ...], ...]) -> str:
    return "\n".join(",".join(map(str, row)) for row in programs)


@attrs.frozen
class Schedule:
    """Placement plus one compute-only op sequence per rank (and the cut, when segments
    besides the body exist). ``forward_only``: an evaluation run, declared (no backward).
    ``pipelines``: several pipelines over one model (docs/semantics.md §2.9): pipeline i
    runs stages ``[i*n, (i+1)*n)`` for its microbatches; ``()`` is one pipeline."""

    placement: Placement
    num_microbatches: int
    programs: tuple[tuple[Op, ...], ...]
    cut: Cut = NO_CUT
    forward_only: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    pipelines: tuple[tuple[int, ...], ...] = ()
    seq_chunks: int = attrs.field(default=1, validator=_seq_chunks)

    def __attrs_post_init__(self) -> None:
        if len(self.programs) != self.placement.num_ranks:
            raise ValueError(f"{len(self.programs)} programs for {self.placement.num_ranks} ranks")
        _check_cut(self.cut, self.placement.num_ranks, self.num_microbatches)
        _check_pipelines(self.pipelines, self.placement.num_stages, self.num_microbatches,
                         self.cut)
        for rank, program in enumerate(self.programs):
            for op in program:
                if isinstance(op, (Send, Recv, Group)):
                    raise ValueError(f"rank {rank}: point-to-point op {op} in a schedule "
                                     "(lowering inserts those)")

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def text(self) -> str:
        return _programs_text(self.programs)


@attrs.frozen
class Plan:
    """A lowered schedule: one op sequence per rank, compute and comm ops in run order.
    ``forward_only``: declared an evaluation run, ``pipelines`` (see ``Schedule``)."""

    placement: Placement
    num_microbatches: int
    programs: tuple[tuple[Op, ...], ...]
    cut: Cut = NO_CUT
    forward_only: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    pipelines: tuple[tuple[int, ...], ...] = ()
    seq_chunks: int = attrs.field(default=1, validator=_seq_chunks)

    def __attrs_post_init__(self) -> None:
        if len(self.programs) != self.placement.num_ranks:
            raise ValueError(f"{len(self.programs)} programs for {self.placement.num_ranks} ranks")
        _check_cut(self.cut, self.placement.num_ranks, self.num_microbatches)
        _check_pipelines(self.pipelines, self.placement.num_stages, self.num_microbatches,
                         self.cut)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_ops(self) -> int:
        return sum(len(p) for p in self.programs)

    def has_comms(self) -> bool:
        return any(isinstance(op, COMM_STEP) for prog in self.programs for op in prog)

    def text(self) -> str:
        return _programs_text(self.programs)

    def canonical_text(self) -> str:
        """The text a digest is taken of: placement, microbatches, the cut's repr, the
        forward-only declaration, pipelines, seq_chunks (each only when not the default), then one line per rank of its ops (``_canonical``; idle
        steps dropped). It says every field of every other op, so two plans that differ
        in anything but idle steps have different texts (``tests/canonical_decoder.py``
        reads plans back from it). A field whose value is not of its declared type raises
        ``TypeError`` (it could spell like one that is). Ops whose first spelling was
        already unambiguous keep it, and so do their plans' digests."""
        head = (f"placement={','.join(map(_int, self.placement.stage_to_rank))};"
                f"m={_int(self.num_microbatches)}")
        if self.cut.segments:
            head += ";cut=" + repr(self.cut)
        if self.forward_only:
            head += ";forward_only"
        if self.pipelines:
            head += ";pipelines=" + "|".join(",".join(map(_int, p)) for p in self.pipelines)
        return "\n".join([head + f";seq_chunks={_int(self.seq_chunks)}" * (self.seq_chunks != 1), *map(_canonical_row, self.programs)])

    @classmethod
    def from_schedule(cls, schedule: Schedule) -> "Plan":
        return cls(schedule.placement, schedule.num_microbatches, schedule.programs,
                   schedule.cut, schedule.forward_only, schedule.pipelines, schedule.seq_chunks)


def _canonical_row(program: tuple[Op, ...]) -> str:
    """``",".join(_canonical(op) for op in program if type(op) is not Idle)``, the body's
    computes (alone or an overlapped pair) and plain act/grad transfers in one frame."""
    out: list[str] = []
    add = out.append
    for op in program:
        kind = type(op)
        if kind is Compute:
            add(f"{op.stage}{op.kind}{op.mb}" if op.segment == "" else _canonical(op))
        elif kind is Send or kind is Recv:
            p = op.payload
            if (p.leaves is not None or p.segment != "" or p.shape is not None
                    or p.dtype is not None or p.to_segment is not None or p.kind == INPUT):
                add(_canonical(op))
            elif kind is Send:  # as _canonical writes them
                add(f"{p.stage}SEND_{_LETTERS[p.kind]}{p.mb}<{op.dst}>")
            else:
                add(f"{p.consumer_stage}RECV_{_LETTERS[p.kind]}{p.mb}<{op.src}>")
        elif kind is Overlap and len(o := op.ops) == 2 and o[0].segment == o[1].segment == "":
            add(f"({o[0].stage}{o[0].kind}{o[0].mb};{o[1].stage}{o[1].kind}{o[1].mb})OVERLAP_F_B")
        elif kind is not Idle:
            add(_canonical(op))
    return ",".join(out)


_PLAIN = re.compile(r"[A-Za-z0-9_.:/+\-]*")  # none of the text's separators or quotes


def _text(value: str) -> str:
    """A name, tag or dtype: as it is when plain (ASCII letters, digits, ``_.:/+-``),
    else as a JSON string (ASCII, in quotes, which no plain text holds)."""
    if type(value) is not str:
        raise TypeError(f"expected a text, got {value!r}")
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


def _int(value: int) -> str:
    """An integer field's digits (``TypeError`` for a text or anything else)."""
    return str(operator.index(value))


def _prefix(segment: str) -> str:
    """``SEGMENT:`` before an op of ``segment``, nothing for the body. An op's own text
    after it holds no ``:``, so a plain segment ends at the run's last ``:``."""
    return "" if segment == "" else _text(segment) + ":"


def _canonical(op: Op) -> str:
    """One op's canonical spelling (see ``_canonical_p2p`` for sends and receives)."""
    kind = type(op)
    if kind is Compute:
        return f"{_prefix(op.segment)}{op.stage}{op.kind}{op.mb}"
    if kind is Send or kind is Recv:
        return _canonical_p2p(op)
    if kind is Overlap:
        return "(" + ";".join(map(_canonical, op.ops)) + ")OVERLAP_F_B"
    if kind is Group:
        return "[" + ";".join(map(_canonical, op.ops)) + "]GROUP"
    if kind is Collective:
        root = "" if op.root is None else "@" + _int(op.root)
        return f"{op.kind.upper()}({_text(op.tag)}{root}|{','.join(map(_int, op.ranks))})"
    if kind is Marker:
        return f"{op.stage}{op.action}{'' if op.mb is None else _int(op.mb)}"
    if kind is Offload or kind is Reload:
        return f"{_prefix(op.segment)}{_int(op.stage)}{op.WORD}{_int(op.mb)}"
    raise TypeError(f"not an op of a plan: {op!r}")


def _canonical_p2p(op: P2P) -> str:
    """``str(op)`` (a receive names its consumer), then in ``<>`` the peer, the layout
    (``|SHAPE|DTYPE``, or ``|leaves=JSON``), and for a transfer across the cut what
    ``str(op)`` leaves out: a send's ``|to=TO_SEGMENT``, a receive's ``|from=[SEG:]STAGE``."""
    p = op.payload
    if type(op) is Send:
        head = f"{_prefix(p.segment)}{p.stage}SEND_{p.letter}{p.mb}<{op.dst}"
    else:
        head = f"{_prefix(p.consumer_segment)}{p.consumer_stage}RECV_{p.letter}{p.mb}<{op.src}"
    fields = [head]
    if p.leaves is not None:
        leaves = [[x.path, None if x.shape is None else list(map(operator.index, x.shape)),
                   x.dtype] for x in p.leaves]
        fields.append(f"leaves={json.dumps(leaves, separators=(',', ':'))}")
    elif p.shape is not None or p.dtype is not None:
        shape = "None" if p.shape is None else str(tuple(map(operator.index, p.shape)))
        dtype = ("None" if p.dtype is None else json.dumps(p.dtype) if p.dtype == "None"
                 else _text(p.dtype))
        fields += [shape, dtype]
    if p.to_segment is not None:
        fields.append(f"to={_text(p.to_segment)}" if type(op) is Send
                      else f"from={_prefix(p.segment)}{p.stage}")
    return "|".join(fields) + ">"
