"""PyTorch's pipelining CSV (``PipelineScheduleMulti._dump_csv`` / ``_load_csv``).

One row per rank, one cell per step: ``2F0``, ``1B3``, ``0I2``, ``0W2``, ``3SEND_F1``,
``2RECV_B0``, ``1UNSHARD``, ``1RESHARD``, ``1REDUCE_GRAD``, ``(0F7;7B3)OVERLAP_F_B``; an
empty cell is an idle step. A ``SEND`` cell names the producing stage, a ``RECV`` cell the
consuming one, so every cell's stage lives on its row's rank.

A file in torch's plain form (what every dump without overlaps is) is read as integer
columns and its ops built in bulk (``torch_csv_fast.parse_plain``); anything else takes
the general path's two passes: parse every cell (syntax, index limits), then infer the
stage → rank placement from the rows and build the ops (peers need the placement). Both
build the same plan for the same text. Bad input raises ``InputError`` with the file, the 1-based row as
``line`` and the 1-based cell index as ``column``.

Activation moves (``2OFFLOAD0``, ``2RELOAD0``, docs/semantics.md §2.10) are this package's
extension, not torch's: the reader takes such cells where a file holds them (a move of a
stage no row places, or a reload of an activation its row never offloads, is bad input:
``ranges``), and the
writer writes them only when asked (``moves=True``, ``export --csv-moves``), else refuses
a plan that holds them (torch's runtime has no such action).

Writing uses ``csv.writer``'s default dialect (``\\r\\n``, minimal quoting: ``;`` and
parentheses are not quoted), as torch does, so the bytes match torch's own dump. A file in
that form (which every torch dump is) reads and writes back byte for byte, idle cells,
markers, overlaps and empty rows included; other accepted spellings (``\\n`` line ends,
quoted cells, blanks around a cell) are written back in that canonical form.
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import IO, NamedTuple

import attrs

from ..declared import IDLE_RANKS, MAX_IDLE_RANKS
from ..errors import InputError
from ..ir import (MARKER_ACTIONS, Collective, Compute, Idle, Marker, Offload, Op, Overlap,
                  Payload, Placement, Plan, Recv, Reload, Schedule, Send, computes_of)
from .files import MAX_BYTES, read_text
from .output import write_output
from .ranges import Named, beyond, of_nothing
from .torch_actions import COMMS, MAX_INDEX, PEER
from .torch_csv_fast import parse_plain

EXPECTED = "expected an action like 2F0, 1SEND_F3 or (0F7;7B3)OVERLAP_F_B"
_MARKERS = MARKER_ACTIONS
_MOVES = {"OFFLOAD": Offload, "RELOAD": Reload}  # this package's extension (§2.10)
_STEPS = "|".join(("F", "B", "I", "W") + COMMS + tuple(_MOVES))  # actions naming a microbatch
_INDEX = "(0|[1-9][0-9]{0,5})"  # canonical: no leading zeros, at most 6 digits
_ACTION = re.compile(  # ASCII digits only: \d would also take other scripts' digits
    rf"([0-9]+)({_STEPS}|{'|'.join(_MARKERS)})([0-9]*)")
_PLAIN = re.compile(rf"{_INDEX}({_STEPS}){_INDEX}")  # the common, well-formed case
_OVERLAP = re.compile(r"\(([^()]*)\)OVERLAP_F_B")
_VERB = {"SEND_F": "send its activation to", "SEND_B": "send its gradient to",
         "RECV_F": "receive an activation from", "RECV_B": "receive a gradient from"}


class _Cell(NamedTuple):
    """A parsed cell before placement is known; ``kind`` is ``""`` (idle), ``OVERLAP`` or
    a torch action name."""

    kind: str
    stage: int = 0
    mb: int | None = None
    subs: tuple["_Cell", ...] = ()


_IDLE = _Cell("")


def read_torch_csv(path: str | os.PathLike[str]) -> Plan:
    """Read a torch pipelining CSV file (see ``parse_torch_csv``)."""
    name = os.fspath(path)
    text = read_text(name, "a torch CSV file", MAX_BYTES)
    return parse_torch_csv(text, name)


def parse_torch_csv(text: str, file: str) -> Plan:
    """Parse torch CSV text into a ``Plan`` (``plan.has_comms()`` tells whether it lowered).

    Placement is inferred: ranks = rows, each stage on the row where it appears; stages
    must be exactly ``0..S-1``; ``num_microbatches`` is the largest microbatch index + 1.
    """
    plan = parse_plain(text)
    return plan if plan is not None else _parse_general(text, file)


def _parse_general(text: str, file: str) -> Plan:
    """Any accepted spelling, in two passes (cells, then placement and ops); bad input
    raises ``InputError`` at its row and column."""
    rows = _parse_cells(text, file)
    placement = _infer_placement(rows, file)
    payloads: dict[tuple, Payload] = {}  # one object per payload, shared by both ends
    # Every field was checked by the cell grammar above; skip the IR's re-validation.
    with attrs.validators.disabled():
        programs = tuple(
            tuple(_build(cell, placement, file, r + 1, c + 1, payloads)
                  for c, cell in enumerate(row))
            for r, row in enumerate(rows))
    mbs = [cell[2] for row in rows for cell in row if cell[2] is not None]
    mbs += [mb for row in rows for cell in row if cell[0] == "OVERLAP" for mb in _mbs(cell)]
    plan = Plan(placement, max(mbs) + 1 if mbs else 0, programs)
    if any(cell[0] in _MOVES for row in rows for cell in row):  # a move places nothing
        found = beyond(plan) or of_nothing(plan)
        if found is not None:
            raise named_error(found, file)
    return plan


def named_error(found: Named, file: str) -> InputError:
    """The bad-input error of an op that names what its plan lacks (``ranges``), at its
    row and cell."""
    return InputError(found.message, file, found.rank + 1, found.index + 1)


def holds_actions(text: str) -> bool:
    """Whether any cell of ``text`` (CSV) is a pipelining action (``2F0``, ``1SEND_F3``,
    ``0UNSHARD``, ``(0F7;7B3)OVERLAP_F_B``, loosely spelled: blanks around it, leading
    zeros): a file with none is some other CSV (a data or metrics table), not a schedule.
    A file that is not CSV at all counts as holding actions, so ``check`` names what is
    wrong with it."""
    try:
        for row in csv.reader(io.StringIO(text, newline=""), strict=True):
            for cell in row:
                s = cell.strip()
                if _ACTION.fullmatch(s) or _OVERLAP.fullmatch(s):
                    return True
    except csv.Error:
        return True
    return False


def format_torch_csv(plan: Plan | Schedule) -> str:
    """The torch CSV text of a plan or schedule: one row per rank, ``str(op)`` per cell.

    Raises ``ValueError`` for what the format cannot say: groups, collectives, segments,
    and a send/receive whose peer is not the rank its placement implies (the format has no
    peer field). Payload shapes and dtypes are dropped.
    """
    return torch_csv_rows(plan, range(plan.num_ranks))


def torch_csv_rows(plan: Plan | Schedule, ranks: range, markers: bool = False,
                   moves: bool = False) -> str:
    """The rows of ``ranks`` of ``format_torch_csv(plan)`` (of ``with_torch_markers(plan)``
    if ``markers``); the rows of consecutive ranges concatenate to the whole text. With
    ``moves``, activation moves are written as this package's ``OFFLOAD``/``RELOAD`` cells
    (else they are refused, like any op the format cannot say)."""
    programs = plan.programs[ranks.start:ranks.stop]
    if plan.pipelines:
        programs = _two_chain_rows(plan, programs)
    if markers and not has_markers(plan):
        programs = tuple(_with_markers(prog, plan.num_microbatches) for prog in programs)
    _check_writable(plan.placement, programs, ranks.start, moves)
    buf = io.StringIO(newline="")
    csv.writer(buf).writerows(programs)  # each op written as str(op)
    return buf.getvalue()


# ------------------------------------------------------------------- two chains

def two_chains(m: int) -> tuple[tuple[int, ...], ...]:
    """The pipelines of the two-chain encoding (``--bidirectional``): microbatches
    ``0..m/2-1`` run down stages ``0..S/2-1``, ``m/2..m-1`` through stages ``S/2..S-1``
    (with ``S = 2p``, DualPipe's reverse pipeline: its k-th stage is ``p + k``, on rank
    ``p-1-k``, as the file's rows place it)."""
    return (tuple(range(m // 2)), tuple(range(m // 2, m)))


def as_two_chains(plan: Plan) -> Plan:
    """``plan`` read in the two-chain encoding: its pipelines set (``ValueError`` when its
    stage or microbatch count is odd)."""
    s, m = plan.placement.num_stages, plan.num_microbatches
    if s % 2 or m % 2 or not m:
        raise ValueError(f"the two-chain encoding needs an even number of stages and of "
                         f"microbatches, and this file has {s} stages and {m} microbatches")
    return attrs.evolve(plan, pipelines=two_chains(m))


def _two_chain_rows(plan: Plan | Schedule, programs):
    """The rows of a plan of several pipelines: only the two-chain encoding can say it;
    its replica all-reduces (``replica:J``) are implied by the encoding, so left out."""
    if plan.pipelines != two_chains(plan.num_microbatches):
        raise ValueError(f"the torch CSV format holds several pipelines only in the "
                         f"two-chain encoding (--bidirectional: microbatches 0..m/2-1 and "
                         f"m/2..m-1), not pipelines {plan.pipelines}; export it to plan-json")
    return tuple(tuple(op for op in prog if not (type(op) is Collective
                                                 and op.tag.startswith("replica:")))
                 for prog in programs)


# ------------------------------------------------------------------- torch's markers

PREFETCH_STAGES = 3  # torch's _add_unshard_reshard(max_active_stages=3)


def with_torch_markers(plan: Plan) -> Plan:
    """``plan`` with the bookkeeping cells torch's own lowering adds, so that torch's
    runtime (``_PipelineScheduleRuntime._load_csv(..., format="compute_comms")``) runs the
    file as written: ``REDUCE_GRAD`` of a stage after its last ``B``/``W`` (and the sends
    that follow it; there torch scales the summed microbatch gradients), and FSDP's
    ``UNSHARD``/``RESHARD`` where torch's ``_add_unshard_reshard`` puts them (before a
    compute step, the next three stages to compute kept unsharded). A plan that already
    has markers is returned as it is. Markers move no data: the plan's semantics, and so
    what was verified, are unchanged."""
    if has_markers(plan):
        return plan
    programs = tuple(_with_markers(prog, plan.num_microbatches) for prog in plan.programs)
    return attrs.evolve(plan, programs=programs)


def has_markers(plan: Plan | Schedule) -> bool:
    """Whether any rank of ``plan`` holds a marker cell."""
    return any(Marker in map(type, prog) for prog in plan.programs)


def without_markers(plan: Plan | Schedule) -> Plan | Schedule:
    """``plan`` without its marker cells."""
    return attrs.evolve(plan, programs=tuple(tuple(op for op in prog if type(op) is not Marker)
                                             for prog in plan.programs))


def _with_markers(program: tuple[Op, ...], m: int) -> tuple[Op, ...]:
    """``program`` with torch's markers (``with_torch_markers``), in time linear in it.

    Before each step that computes, the stages not among its upcoming ones
    (``_upcoming``) are resharded, in stage order (torch walks a set), and its upcoming
    stages not yet unsharded are unsharded, in their order; after a stage's last backward
    step and the sends right after it comes its ``REDUCE_GRAD`` (``_reduce_after``),
    before any marker of the next step; at the end every stage still unsharded is
    resharded, in stage order.

    Invariant of the walk over the computing steps: ``active`` holds the stages unsharded
    and not resharded since, in the order they were unsharded, and after a step it holds
    exactly that step's upcoming stages; so a step whose upcoming list is the previous
    one's (the same object, ``_upcoming``) adds no marker. Markers go into ``inserts``
    as ``(position, 0 for REDUCE_GRAD else 1, markers)``; the program is then copied in
    slices between those positions."""
    computing = [(index, stages) for index, op in enumerate(program)
                 if type(op) not in _COMPUTES_NOTHING  # the common ops inline
                 and (stages := (op.stage,) if type(op) is Compute else _compute_stages(op))]
    inserts: list[tuple[int, int, list[Op]]] = [
        (index + 1, 0, [Marker(stage, "REDUCE_GRAD") for stage in stages])
        for index, stages in _reduce_after(program, computing, m).items()]
    active: list[int] = []
    current: list[int] | None = None
    for (index, _), upcoming in zip(computing, _upcoming(computing)):
        if upcoming is current:
            continue
        current = upcoming
        wanted = set(upcoming)
        markers: list[Op] = [Marker(stage, "RESHARD")
                             for stage in sorted(s for s in active if s not in wanted)]
        active = [s for s in active if s in wanted]
        kept = set(active)
        fresh = [s for s in upcoming if s not in kept]
        active += fresh
        markers += [Marker(stage, "UNSHARD") for stage in fresh]
        if markers:
            inserts.append((index, 1, markers))
    out: list[Op] = []
    at = 0
    for position, _, markers in sorted(inserts, key=lambda insert: insert[:2]):
        out += program[at:position]
        out += markers
        at = position
    out += program[at:]
    out += [Marker(stage, "RESHARD") for stage in sorted(active)]
    return tuple(out)


_COMPUTES_NOTHING = frozenset((Send, Recv, Idle, Marker))  # op types: computes_of is ()


def _compute_stages(op: Op) -> tuple[int, ...]:
    """The distinct stages ``op`` computes, in its order (empty: it computes nothing)."""
    return tuple(dict.fromkeys(c.stage for c in computes_of(op)))


def _reduce_after(program: tuple[Op, ...], computing: list[tuple[int, tuple[int, ...]]],
                  m: int) -> dict[int, list[int]]:
    """Step index -> the stages whose ``REDUCE_GRAD`` follows that step: for each stage,
    the step doing its ``m``-th ``B``/``W``, moved past the ``Send`` steps right after it
    (torch emits the step's sends before its ``REDUCE_GRAD``); ``computing``: the
    ``(index, stages)`` of the steps that compute. Stages in the order their ``m``-th
    backward comes; a stage with fewer has none."""
    backwards: dict[int, int] = {}
    last: dict[int, int] = {}  # stage -> index of the step doing its m-th B/W
    for index, _ in computing:
        for c in computes_of(program[index]):
            if c.kind in ("B", "W"):
                backwards[c.stage] = backwards.get(c.stage, 0) + 1
                if backwards[c.stage] == m:
                    last[c.stage] = index
    reduce_after: dict[int, list[int]] = {}
    for stage, index in last.items():
        while index + 1 < len(program) and type(program[index + 1]) is Send:
            index += 1
        reduce_after.setdefault(index, []).append(stage)
    return reduce_after


def _upcoming(computing: list[tuple[int, tuple[int, ...]]]) -> list[list[int]]:
    """For each step that computes (``computing``: ``(index, stages)`` in program order,
    ``stages`` not empty), the stages torch's ``_add_unshard_reshard`` keeps unsharded
    before it: the distinct stages computed by that step and the ones after it, in the
    order they are first computed (an overlapped step's in its own order), taken step by
    step until there are ``PREFETCH_STAGES`` or more (an overlapped step may bring
    several at once) or the steps run out. Consecutive equal answers are one list object.

    One backward pass; a step costs its own stages plus at most ``PREFETCH_STAGES - 1``
    and the widest step's stages, so the pass is linear in the steps. Invariant: entering
    a step with stages ``T``, ``ahead`` is the answer of the next computing step as
    ``(stage, index of the step first computing it)`` pairs, ordered by that index (so
    one step's pairs are adjacent). In first-computation order from this step, the
    stages are ``T``, then those after it that are not in ``T``, in their order; ``ahead``
    is a prefix of the latter's, whole steps of ``PREFETCH_STAGES`` or more stages (or
    all there are), so ``T + (ahead - T)`` holds at least as many stages, whole steps
    again, and cutting it (``_cut``) gives this step's answer exactly."""
    answers: list[list[int]] = [[]] * len(computing)
    ahead: list[tuple[int, int]] = []
    later: list[int] = []  # the answer of the next computing step
    for k in range(len(computing) - 1, -1, -1):
        index, stages = computing[k]
        if len(stages) == 1:  # the common step: one stage
            s = stages[0]
            ahead = _cut([(s, index)] + [p for p in ahead if p[0] != s])
        else:
            mine = set(stages)
            ahead = _cut([(s, index) for s in stages] + [p for p in ahead if p[0] not in mine])
        answer = [s for s, _ in ahead]
        answers[k] = later = later if answer == later else answer
    return answers


def _cut(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The shortest prefix of ``pairs`` (``(stage, step)``, adjacent by step) made of
    whole steps holding ``PREFETCH_STAGES`` or more stages; all of ``pairs`` if there is
    none."""
    for k in range(PREFETCH_STAGES, len(pairs)):
        if pairs[k][1] != pairs[k - 1][1]:
            return pairs[:k]
    return pairs


def write_torch_csv(plan: Plan | Schedule, out: str | os.PathLike[str] | IO[str]) -> None:
    """Write ``format_torch_csv(plan)`` to a text stream (open it with ``newline=""``) or,
    atomically, to a path: a temp file in the same directory, then ``os.replace``."""
    text = format_torch_csv(plan)
    if not isinstance(out, (str, os.PathLike)):
        out.write(text)
        return
    write_output(out, text, newline="")  # csv.writer's own \r\n line ends


# ---------------------------------------------------------------- pass 1: cells

def _show(raw: str) -> str:
    return repr(raw) if len(raw) <= 40 else repr(raw[:40]) + "..."


def _parse_cells(text: str, file: str) -> list[list[_Cell]]:
    rows: list[list[_Cell]] = []
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    idle = 0  # rows without an action so far
    try:
        plain, make = _PLAIN.fullmatch, tuple.__new__
        for r, raw in enumerate(reader, start=1):
            row: list[_Cell] = []
            for c, cell in enumerate(raw, start=1):
                m = plain(cell)  # fast path: the well-formed common case, parsed once
                if m is None:
                    row.append(_parse_cell(cell, file, r, c))
                else:
                    stage, kind, mb = m.groups()
                    row.append(make(_Cell, (kind, int(stage), int(mb), None)))
            rows.append(row)
            if not any(cell.kind for cell in row):
                idle += 1
                if idle > MAX_IDLE_RANKS:
                    raise InputError(f"the {idle}th row without an action (only idle cells, "
                                     f"or none): {IDLE_RANKS}", file, r)
    except csv.Error as e:
        raise InputError(f"malformed CSV ({e}); expected comma-separated action cells",
                         file, len(rows) + 1) from None
    if not rows:
        raise InputError("empty file; expected one row of actions per rank", file)
    if not any(cell.kind for row in rows for cell in row):
        raise InputError("no actions in any row; expected one row of actions per rank", file)
    return rows


def _parse_cell(raw: str, file: str, r: int, c: int) -> _Cell:
    s = raw.strip()
    if not s:
        return _IDLE
    if m := _OVERLAP.fullmatch(s):
        parts = [p.strip() for p in m.group(1).split(";")]
        subs = tuple(_parse_action(p, raw, file, r, c) for p in parts)
        bad = [p for p, sub in zip(parts, subs) if sub.kind in _MARKERS + COMMS + tuple(_MOVES)]
        if bad:
            raise InputError(f"OVERLAP_F_B may only combine compute actions (F, B, I, W), "
                             f"got {_show(bad[0])} in {_show(raw)}", file, r, c)
        return _Cell("OVERLAP", subs=subs)
    return _parse_action(s, raw, file, r, c)


def _parse_action(s: str, raw: str, file: str, r: int, c: int) -> _Cell:
    m = _PLAIN.fullmatch(s)
    if m:
        stage_s, kind, mb_s = m.groups()
        return _Cell(kind, int(stage_s), int(mb_s))
    m = _ACTION.fullmatch(s)
    if not m:
        raise InputError(f"{EXPECTED}, got {_show(raw)}", file, r, c)
    stage_s, kind, mb_s = m.groups()
    for what, digits in (("stage", stage_s), ("microbatch", mb_s)):
        if len(digits) > 1 and digits[0] == "0":
            raise InputError(f"{EXPECTED} (indices without leading zeros), got {_show(raw)}",
                             file, r, c)
        if len(digits) > 7 or (len(digits) == 7 and int(digits) > MAX_INDEX):
            shown = digits if len(digits) <= 20 else digits[:20] + "..."
            raise InputError(f"{what} index {shown} in {_show(raw)} is too large (at most "
                             f"{MAX_INDEX})", file, r, c)
    if kind not in _MARKERS and not mb_s:
        raise InputError(f"expected a microbatch index after {stage_s}{kind} (like "
                         f"{stage_s}{kind}0), got {_show(raw)}", file, r, c)
    return _Cell(kind, int(stage_s), int(mb_s) if mb_s else None)


# ------------------------------------------------------- pass 2: placement, ops

def _stages(cell: _Cell) -> tuple[int, ...]:
    if cell.kind == "OVERLAP":
        return tuple(sub.stage for sub in cell.subs)
    return (cell.stage,) if cell.kind else ()


def _mbs(cell: _Cell) -> tuple[int, ...]:
    cells = cell.subs if cell.kind == "OVERLAP" else (cell,)
    return tuple(x.mb for x in cells if x.mb is not None)


def _infer_placement(rows: list[list[_Cell]], file: str) -> Placement:
    where: dict[int, int] = {}
    for r, row in enumerate(rows):
        stages = {cell[1] for cell in row  # a move places nothing: the verifier judges it
                  if cell[0] and cell[0] != "OVERLAP" and cell[0] not in _MOVES}
        stages.update(stage for cell in row if cell[0] == "OVERLAP" for stage in _stages(cell))
        for stage in stages:
            first = where.setdefault(stage, r)
            if first != r:
                c = next(c for c, cell in enumerate(row) if stage in _stages(cell))
                raise InputError(f"stage {stage} appears on rows {first + 1} and {r + 1}; "
                                 "expected each stage on one rank (row)", file, r + 1, c + 1)
    missing = _missing_stage(where)
    if missing is not None:
        raise InputError(f"stage {missing} appears on no row; expected stages 0.."
                         f"{max(where)} with no gap", file)
    return _placement(where, len(rows))


def _missing_stage(where: dict[int, int]) -> int | None:
    """The first stage below the largest one that no row holds, if any."""
    missing = next(s for s in range(len(where) + 1) if s not in where)
    return missing if missing < len(where) else None


def _placement(where: dict[int, int], num_rows: int) -> Placement:
    """Stage -> row, for stages ``0..len(where)-1`` without a gap."""
    return Placement(tuple(where[s] for s in range(len(where))), num_rows)


_COMPUTE_KINDS = frozenset("FBIW")


def _build(cell: _Cell, placement: Placement, file: str, r: int, c: int,
           payloads: dict[tuple, Payload]) -> Op:
    kind, stage, mb, subs = cell
    if kind in _COMPUTE_KINDS:
        return Compute(kind, stage, mb)
    if kind in PEER:
        op = _p2p(_route(kind, stage, placement), mb, payloads)
        if op is None:
            side, other = ("last", "next") if PEER[kind][0] > 0 else ("first", "previous")
            raise InputError(f"{stage}{kind}{mb}: stage {stage} is the {side} of stages 0.."
                             f"{placement.num_stages - 1}, so there is no {other} stage to "
                             f"{_VERB[kind]}", file, r, c)
        return op
    if not kind:
        return Idle()
    if kind in _MOVES:
        return _MOVES[kind](stage, mb)
    if kind == "OVERLAP":
        return Overlap(tuple(Compute(sub.kind, sub.stage, sub.mb) for sub in subs))
    return Marker(stage, kind, mb)


def _route(kind: str, stage: int, placement: Placement) -> tuple | None:
    """Where a ``SEND_*``/``RECV_*`` cell on ``stage``'s rank goes: ``(Send or Recv, peer
    rank, payload kind, payload stage)``; ``None`` if the peer stage does not exist."""
    offset, payload_kind, is_send = PEER[kind]
    peer = stage + offset
    if not 0 <= peer < placement.num_stages:
        return None
    return (Send if is_send else Recv, placement.stage_to_rank[peer], payload_kind,
            stage if is_send else peer)


def _p2p(route: tuple | None, mb: int, payloads: dict[tuple, Payload]) -> Send | Recv | None:
    """The op of a cell with ``route`` (``_route``) and microbatch ``mb`` (``None`` for no
    route); both ends of a transfer share one ``Payload`` in ``payloads``."""
    if route is None:
        return None
    make, rank, payload_kind, payload_stage = route
    key = (payload_kind, payload_stage, mb)
    payload = payloads.get(key)
    if payload is None:
        payload = payloads[key] = Payload(*key)
    return make(rank, payload)


# ------------------------------------------------------------------- writing

def _check_writable(place: Placement, programs, first_rank: int, moves: bool = False) -> None:
    """Raise ``ValueError`` for the first op, rank by rank, of ``programs`` (ranks from
    ``first_rank``, placed by ``place``) that the torch CSV format cannot say
    (``format_torch_csv``). Constant time per op: the common ops (a ``Compute``
    without segment, a ``Send``/``Recv`` of the body to its stage's rank, ``Idle``,
    ``Marker``) pass a quick test; any other op is judged by ``_unwritable``, which also
    words the error."""
    to_rank = place.stage_to_rank
    stages = len(to_rank)
    for rank, program in enumerate(programs, first_rank):
        for i, op in enumerate(program):
            t = type(op)
            if t is Compute:
                if not op.segment:
                    continue
            elif t is Send:
                p = op.payload
                if not p.segment and 0 <= (s := p.consumer_stage) < stages \
                        and to_rank[s] == op.dst:
                    continue
            elif t is Recv:
                p = op.payload
                if not p.segment and 0 <= p.stage < stages and to_rank[p.stage] == op.src:
                    continue
            elif t is Idle or t is Marker:
                continue
            elif (t is Offload or t is Reload) and moves and not op.segment:
                continue
            problem = _unwritable(op, place)
            if problem is not None:
                raise ValueError(f"rank {rank}, op {i} ({op}): {problem}")


def _unwritable(op: Op, place: Placement) -> str | None:
    """Why the torch CSV format cannot say ``op`` (on a plan placed by ``place``), or
    ``None`` if it can."""
    if isinstance(op, (Offload, Reload)) and not op.segment:
        return ("the torch CSV format has no activation moves (OFFLOAD/RELOAD); write "
                "plan-json, or --csv-moves for this package's CSV extension")
    if not isinstance(op, (Compute, Overlap, Send, Recv, Idle, Marker, Offload, Reload)):
        return f"the torch CSV format has no {type(op).__name__} action"
    subs = op.ops if isinstance(op, Overlap) else (op,)
    if any(getattr(getattr(x, "payload", x), "segment", "") for x in subs):
        return "the torch CSV format has no segments"
    if isinstance(op, (Send, Recv)):
        p = op.payload
        peer_stage = p.consumer_stage if isinstance(op, Send) else p.stage
        if not (0 <= peer_stage < place.num_stages and place.rank_of(peer_stage) == op.peer):
            return (f"peer rank {op.peer} is not the rank of stage {peer_stage}; the torch "
                    "CSV format cannot express it")
    return None
