"""PyTorch's pipelining CSV (``PipelineScheduleMulti._dump_csv`` / ``_load_csv``).

One row per rank, one cell per step: ``2F0``, ``1B3``, ``0I2``, ``0W2``, ``3SEND_F1``,
``2RECV_B0``, ``1UNSHARD``, ``1RESHARD``, ``1REDUCE_GRAD``, ``(0F7;7B3)OVERLAP_F_B``; an
empty cell is an idle step. A ``SEND`` cell names the producing stage, a ``RECV`` cell the
consuming one, so every cell's stage lives on its row's rank.

Reading a file in torch's plain form (what every dump without overlaps is) takes one
pass over the cells (``_parse_plain``); anything else takes the general path's two passes:
parse every cell (syntax, index limits), then infer the stage → rank placement from the
rows and build the ops (peers need the placement). Both build the same plan for the same
text. Bad input raises ``InputError`` with the file, the 1-based row as ``line`` and the
1-based cell index as ``column``.

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

from ..errors import InputError
from ..ir import (ACT, GRAD, MARKER_ACTIONS, Compute, Idle, Marker, Op, Overlap, Payload,
                  Placement, Plan, Recv, Schedule, Send, computes_of)
from .files import MAX_BYTES, read_text
from .output import write_output

MAX_INDEX = 10**6
EXPECTED = "expected an action like 2F0, 1SEND_F3 or (0F7;7B3)OVERLAP_F_B"
_MARKERS = MARKER_ACTIONS
_COMMS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
_STEPS = "|".join(("F", "B", "I", "W") + _COMMS)  # the actions that name a microbatch
_INDEX = "(0|[1-9][0-9]{0,5})"  # canonical: no leading zeros, at most 6 digits
_ACTION = re.compile(  # ASCII digits only: \d would also take other scripts' digits
    rf"([0-9]+)({_STEPS}|{'|'.join(_MARKERS)})([0-9]*)")
_PLAIN = re.compile(rf"{_INDEX}({_STEPS}){_INDEX}")  # the common, well-formed case
_PLAIN_OR_MARKER = re.compile(  # the one-pass reader's cells: _PLAIN, or a marker
    rf"{_INDEX}({_STEPS}|{'|'.join(_MARKERS)}){_INDEX}?")
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
    plan = _parse_plain(text)
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
    return Plan(placement, max(mbs) + 1 if mbs else 0, programs)


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
    _check_writable(plan)
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    for program in plan.programs:
        writer.writerow([str(op) for op in program])
    return buf.getvalue()


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
    if any(type(op) is Marker for prog in plan.programs for op in prog):
        return plan
    programs = tuple(_with_markers(prog, plan.num_microbatches) for prog in plan.programs)
    return attrs.evolve(plan, programs=programs)


def without_markers(plan: Plan | Schedule) -> Plan | Schedule:
    """``plan`` without its marker cells."""
    return attrs.evolve(plan, programs=tuple(tuple(op for op in prog if type(op) is not Marker)
                                             for prog in plan.programs))


def _with_markers(program: tuple[Op, ...], m: int) -> tuple[Op, ...]:
    steps = [_compute_stages(op) for op in program]
    backwards: dict[int, int] = {}
    last: dict[int, int] = {}  # stage -> index of the step doing its m-th B/W
    for index, op in enumerate(program):
        for c in computes_of(op):
            if c.kind in ("B", "W"):
                backwards[c.stage] = backwards.get(c.stage, 0) + 1
                if backwards[c.stage] == m:
                    last[c.stage] = index
    reduce_after: dict[int, list[int]] = {}
    for stage, index in last.items():
        while index + 1 < len(program) and type(program[index + 1]) is Send:
            index += 1  # torch emits the step's sends before its REDUCE_GRAD
        reduce_after.setdefault(index, []).append(stage)
    out: list[Op] = []
    active: list[int] = []
    for index, op in enumerate(program):
        if steps[index]:
            upcoming = _next_stages(steps[index:])
            for stage in sorted(s for s in active if s not in upcoming):  # torch: set order
                active.remove(stage)
                out.append(Marker(stage, "RESHARD"))
            for stage in [s for s in upcoming if s not in active]:
                active.append(stage)
                out.append(Marker(stage, "UNSHARD"))
        out.append(op)
        out.extend(Marker(stage, "REDUCE_GRAD") for stage in reduce_after.get(index, ()))
    out.extend(Marker(stage, "RESHARD") for stage in sorted(active))
    return tuple(out)


def _compute_stages(op: Op) -> tuple[int, ...]:
    return tuple(dict.fromkeys(c.stage for c in computes_of(op)))


def _next_stages(steps: list[tuple[int, ...]]) -> list[int]:
    """The next ``PREFETCH_STAGES`` distinct stages to compute (an overlapped step adds
    all of its stages), in order."""
    seen: list[int] = []
    for stages in steps:
        fresh = [s for s in stages if s not in seen]
        seen.extend(fresh if len(stages) > 1 else fresh[:1])
        if len(seen) >= PREFETCH_STAGES:
            break
    return seen


def write_torch_csv(plan: Plan | Schedule, out: str | os.PathLike[str] | IO[str]) -> None:
    """Write ``format_torch_csv(plan)`` to a text stream (open it with ``newline=""``) or,
    atomically, to a path: a temp file in the same directory, then ``os.replace``."""
    text = format_torch_csv(plan)
    if not isinstance(out, (str, os.PathLike)):
        out.write(text)
        return
    write_output(out, text, newline="")  # csv.writer's own \r\n line ends


# ------------------------------------------------------- fast path: plain files

_IDLE_OP = Idle()


def _parse_plain(text: str) -> Plan | None:
    """The plan of a file in torch's plain form (every cell empty, ``_PLAIN`` or a marker:
    no quotes, overlaps or blanks; one kind of line end), in one pass over the cells;
    ``None`` for anything else, which the general path then reads (and reports). Equal
    to what ``_parse_general`` builds for the same text."""
    lines = _plain_lines(text)
    if lines is None:
        return None
    plain, where, top = _PLAIN_OR_MARKER.fullmatch, {}, -1
    programs, comms = [], []  # comms: per row, (position, kind, stage, mb) to build later
    with attrs.validators.disabled():
        for r, line in enumerate(lines):
            ops, pending = [], []
            for c, cell in enumerate(line.split(",") if line else ()):
                if not cell:
                    ops.append(_IDLE_OP)
                    continue
                m = plain(cell)
                if m is None:
                    return None
                stage_s, kind, mb_s = m.groups()
                stage = int(stage_s)
                if where.setdefault(stage, r) != r:
                    return None
                if mb_s is None:
                    if kind not in _MARKERS:
                        return None
                    ops.append(Marker(stage, kind))
                    continue
                mb = int(mb_s)
                if mb > top:
                    top = mb
                if kind in _COMPUTE_KINDS:
                    ops.append(Compute(kind, stage, mb))
                elif kind in _MARKERS:
                    ops.append(Marker(stage, kind, mb))
                else:
                    ops.append(None)
                    pending.append((c, kind, stage, mb))
            programs.append(ops)
            comms.append(pending)
        if not where or _missing_stage(where) is not None:
            return None
        placement = _placement(where, len(lines))
        if not _fill_comms(programs, comms, placement):
            return None
    return Plan(placement, top + 1, tuple(map(tuple, programs)))


def _plain_lines(text: str) -> list[str] | None:
    """The rows of ``text`` as ``csv.reader`` sees them, if no cell is quoted and all line
    ends are ``\\r\\n`` or all are ``\\n``; else ``None``."""
    if '"' in text:
        return None
    crlf = text.count("\r\n")
    if text.count("\r") != crlf or (crlf and text.count("\n") != crlf):
        return None
    lines = text.split("\r\n" if crlf else "\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


def _fill_comms(programs: list[list], comms: list[list], placement: Placement) -> bool:
    """Build each row's SEND/RECV cells in place, one payload object per transfer (each
    ``(kind, stage)``'s route found once); ``False`` if a cell's peer stage does not
    exist."""
    payloads: dict[tuple, Payload] = {}
    routes: dict[tuple, tuple | None] = {}
    for ops, pending in zip(programs, comms):
        for c, kind, stage, mb in pending:
            if (kind, stage) not in routes:
                routes[(kind, stage)] = _route(kind, stage, placement)
            op = _p2p(routes[(kind, stage)], mb, payloads)
            if op is None:
                return False
            ops[c] = op
    return True


# ---------------------------------------------------------------- pass 1: cells

def _show(raw: str) -> str:
    return repr(raw) if len(raw) <= 40 else repr(raw[:40]) + "..."


def _parse_cells(text: str, file: str) -> list[list[_Cell]]:
    rows: list[list[_Cell]] = []
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
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
        bad = [p for p, sub in zip(parts, subs) if sub.kind in _MARKERS + _COMMS]
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
        stages = {cell[1] for cell in row if cell[0] and cell[0] != "OVERLAP"}
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
_PEER = {"SEND_F": (1, ACT, True), "SEND_B": (-1, GRAD, True),  # peer offset, kind, is send
         "RECV_F": (-1, ACT, False), "RECV_B": (1, GRAD, False)}


def _build(cell: _Cell, placement: Placement, file: str, r: int, c: int,
           payloads: dict[tuple, Payload]) -> Op:
    kind, stage, mb, subs = cell
    if kind in _COMPUTE_KINDS:
        return Compute(kind, stage, mb)
    if kind in _PEER:
        op = _p2p(_route(kind, stage, placement), mb, payloads)
        if op is None:
            side, other = ("last", "next") if _PEER[kind][0] > 0 else ("first", "previous")
            raise InputError(f"{stage}{kind}{mb}: stage {stage} is the {side} of stages 0.."
                             f"{placement.num_stages - 1}, so there is no {other} stage to "
                             f"{_VERB[kind]}", file, r, c)
        return op
    if not kind:
        return Idle()
    if kind == "OVERLAP":
        return Overlap(tuple(Compute(sub.kind, sub.stage, sub.mb) for sub in subs))
    return Marker(stage, kind, mb)


def _route(kind: str, stage: int, placement: Placement) -> tuple | None:
    """Where a ``SEND_*``/``RECV_*`` cell on ``stage``'s rank goes: ``(Send or Recv, peer
    rank, payload kind, payload stage)``; ``None`` if the peer stage does not exist."""
    offset, payload_kind, is_send = _PEER[kind]
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

def _check_writable(plan: Plan | Schedule) -> None:
    place = plan.placement
    for rank, program in enumerate(plan.programs):
        for i, op in enumerate(program):
            where = f"rank {rank}, op {i} ({op})"
            if not isinstance(op, (Compute, Overlap, Send, Recv, Idle, Marker)):
                raise ValueError(f"{where}: the torch CSV format has no "
                                 f"{type(op).__name__} action")
            subs = op.ops if isinstance(op, Overlap) else (op,)
            if any(getattr(getattr(x, "payload", x), "segment", "") for x in subs):
                raise ValueError(f"{where}: the torch CSV format has no segments")
            if isinstance(op, (Send, Recv)):
                p = op.payload
                peer_stage = p.consumer_stage if isinstance(op, Send) else p.stage
                if not (0 <= peer_stage < place.num_stages
                        and place.rank_of(peer_stage) == op.peer):
                    raise ValueError(f"{where}: peer rank {op.peer} is not the rank of stage "
                                     f"{peer_stage}; the torch CSV format cannot express it")
