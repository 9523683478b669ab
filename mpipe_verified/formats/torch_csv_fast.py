"""The one-pass reader of torch CSV files in torch's plain form (``parse_plain``): what every
dump without overlaps is. The file is read as integer columns (``_lex``, a chunk of rows
at a time) and its ops built in bulk (``ir.build_many``). It builds the plan the general
path of ``torch_csv`` builds for the same text, or returns ``None`` (never an error) for
anything else, which the general path then reads and reports.
"""

from __future__ import annotations

import itertools

from ..declared import MAX_IDLE_RANKS
from ..ir import (ACT, GRAD, MARKER_ACTIONS, Compute, Idle, Marker, Payload, Placement, Plan,
                  Recv, Send, build_many, remember_op_cells)
from .torch_actions import COMMS, MAX_INDEX, PEER

_IDLE_OP = Idle()
_PLAIN_KINDS = ("F", "B", "I", "W", *COMMS, *MARKER_ACTIONS)  # a cell's kind code: its index
_CHUNK = 1 << 17  # the lexer reads about this many bytes (whole rows) at a time: its
# arrays then stay in the CPU's cache (1 << 20: 1.4x the time)
_GROUPS = (-1, _PLAIN_KINDS.index("W"), _PLAIN_KINDS.index(COMMS[1]),
           _PLAIN_KINDS.index(COMMS[3]))  # kind codes: the last of each group (idle,
# compute, send, receive; then markers)


def parse_plain(text: str) -> Plan | None:
    """The plan of a file in torch's plain form, read as integer columns (``_lex``) and
    built in bulk (``ir.build_many``); ``None`` for anything else, which the general path
    then reads (and reports). Equal to what ``torch_csv``'s general path builds for the
    same text.

    Plain: ASCII, no quotes, one kind of line end, and every cell empty or a plain
    action: a stage index, a kind (``_PLAIN_KINDS``) and a microbatch index, which only
    a marker may leave out; indices ``0|[1-9][0-9]{0,5}`` (no blanks, overlaps, leading
    zeros or 7-digit indices: the general path reads those)."""
    body = _plain_body(text)
    if body is None:
        return None
    import numpy as np  # loaded only to read a file

    rows, busy_rows, cells, at_row_start = 0, 0, [], True
    for chunk in _chunks(body):
        lexed = _lex(np, chunk, at_row_start)
        if lexed is None:
            return None
        num_rows, (row, *rest) = lexed
        cells.append((row + rows, *rest))
        rows += num_rows
        busy_rows += _distinct_rows(np, row[rest[0] >= 0])  # a row split over two
        if rows - busy_rows > MAX_IDLE_RANKS:  # chunks may count twice: never too few
            return None  # too many rows without an action: the general path stops there
        at_row_start = chunk.endswith("\n")
    return _build_plain(np, rows, *map(np.concatenate, zip(*cells)))


def _distinct_rows(np, row) -> int:
    """How many rows the non-decreasing ``row`` numbers name."""
    return int(len(row) > 0) + int(np.count_nonzero(row[1:] != row[:-1]))


def _plain_body(text: str) -> str | None:
    """``text``'s rows as ``csv.reader`` sees them, each ended by ``\\n``, if it is ASCII,
    no cell is quoted and all line ends are ``\\r\\n`` or all are ``\\n``; else ``None``.
    A last line end is optional (no empty row follows it)."""
    if '"' in text or not text.isascii():
        return None
    crlf = text.count("\r\n")
    if text.count("\r") != crlf or (crlf and text.count("\n") != crlf):
        return None
    if crlf:
        text = text.replace("\r\n", "\n")
    return text if text.endswith("\n") else text + "\n"


def _chunks(body: str):
    """``body`` in pieces of about ``_CHUNK`` bytes, each ended by a line end or, inside
    a row longer than that, by a comma (so no cell is cut and the lexer's arrays stay
    that small)."""
    at = 0
    while at < len(body):
        end = body.find("\n", at + _CHUNK - 1) + 1 or len(body)
        if end - at > 2 * _CHUNK:  # a long row: end at a comma instead
            end = body.find(",", at + _CHUNK - 1, end) + 1 or end
        yield body[at:end]
        at = end


def _lex_tables(np):
    """What a byte is worth in its run, by ``(class, e, byte & 31)``: a digit ``d`` (class
    1) ``d * 10**e``, a letter (class 2; its value ``byte & 31``) ``value * 32**e``, ``e``
    its distance to the run's end (capped at 11: longer runs are refused anyway); the
    kinds' base-32 codes, sorted, and their kind codes."""
    low = np.arange(32)
    worth = np.zeros((3, 12, 32), np.int64)
    worth[1] = 10 ** np.arange(12)[:, None] * np.where((low >= 16) & (low < 26), low - 16, 0)
    worth[2] = 32 ** np.arange(12)[:, None] * low
    codes = [sum((ord(ch) & 31) << 5 * e for e, ch in enumerate(reversed(k)))
             for k in _PLAIN_KINDS]
    order = np.argsort(codes)
    return worth.ravel(), np.array(codes, np.int64)[order], order


_TABLES: list = []


def _lex(np, chunk: str, at_row_start: bool = True):
    """The cells of ``chunk`` (ended by ``\\n`` or, mid-row, by a comma; ``at_row_start``:
    it begins a row) as columns ``(row, kind code or -1 for idle, stage, microbatch or
    -1)`` with its number of line ends, or ``None`` unless every cell is empty or a plain
    action (``parse_plain``). A row is split at commas; an empty row has no cell. Each
    run of digits or letters is valued at once (``np.add.reduceat``)."""
    if not _TABLES:
        _TABLES.extend(_lex_tables(np))
    worth, kind_codes, kind_of = _TABLES
    b = np.frombuffer(chunk.encode("ascii"), np.uint8)
    digit = (b - np.uint8(48)) < 10
    letter = ((b - np.uint8(65)) < 26) | (b == 95)
    if not (digit | letter | (b == 44) | (b == 10)).all():
        return None
    cls = digit.view(np.uint8) | (letter.view(np.uint8) << 1)  # 0 separator, 1, 2
    first = np.empty(len(b), bool)  # runs: bytes of one class in a row (separators too)
    first[0] = True
    np.not_equal(cls[1:], cls[:-1], out=first[1:])
    run_at = np.flatnonzero(first)
    run_len = np.diff(run_at, append=len(b))
    to_end = np.repeat(run_at + (run_len - 1), run_len)
    to_end -= np.arange(len(b))
    np.minimum(to_end, 11, out=to_end)
    to_end += cls * np.int64(12)
    to_end <<= 5
    to_end |= b & np.uint8(31)
    run_value = np.add.reduceat(worth.take(to_end), run_at)  # a separator run's: unused
    run_cls = cls.take(run_at)
    seps = np.flatnonzero(cls == 0)  # each ends a cell, or an empty row
    newline = b.take(seps) == 10
    sep_len = np.where(run_cls == 0, run_len, 0)
    words = np.flatnonzero(run_cls)  # the runs of digits or letters
    runs = np.bincount((np.cumsum(sep_len) - sep_len).take(words), minlength=len(seps))
    prev_newline = np.empty(len(seps), bool)
    prev_newline[0] = at_row_start
    prev_newline[1:] = newline[:-1]
    keep = (runs > 0) | ~(newline & prev_newline)  # all but empty rows
    full = np.flatnonzero(runs > 0)
    n = runs.take(full)
    i0 = words.take((np.cumsum(runs) - runs).take(full))  # a full cell's first run
    if ((n < 2) | (n > 3)).any() or (run_cls.take(i0) != 1).any():
        return None
    has_mb = n == 3
    i2 = np.where(has_mb, i0 + 2, i0)
    for i, optional in ((i0, None), (i2, has_mb)):  # the indices: 1-6 digits, no leading 0
        ok = (run_len.take(i) <= 6) & ((run_len.take(i) == 1) | (b.take(run_at.take(i)) != 48))
        if not (ok if optional is None else ok | ~optional).all():
            return None
    code = run_value.take(i0 + 1)
    at = np.minimum(np.searchsorted(kind_codes, code), len(kind_codes) - 1)
    if ((run_len.take(i0 + 1) > 11) | (kind_codes.take(at) != code)).any():
        return None
    kind_full = kind_of.take(at)
    if (~has_mb & (kind_full < len(_PLAIN_KINDS) - len(MARKER_ACTIONS))).any():
        return None  # a step without its microbatch
    kind = np.full(len(seps), -1, np.int8)  # compact columns: a file of mostly empty
    stage = np.zeros(len(seps), np.int32)    # cells has about one cell per byte
    mb = np.full(len(seps), -1, np.int32)
    kind[full], stage[full] = kind_full, run_value.take(i0)
    mb[full] = np.where(has_mb, run_value.take(i2), -1)
    row = (np.cumsum(newline) - newline).astype(np.int32)
    return int(newline.sum()), (row[keep], kind[keep], stage[keep], mb[keep])


def _build_plain(np, num_rows: int, row, kind, stage, mb) -> Plan | None:
    """The plan of lexed cells (``_lex``), or ``None`` if a stage is on two rows, a stage
    below the largest is on none, no cell names a stage, more than ``MAX_IDLE_RANKS``
    rows hold no action, or a SEND/RECV has no peer. Each
    class of op is built in bulk, in cell order; then every cell takes the next op of its
    class."""
    busy = kind >= 0
    if not busy.any():
        return None
    if num_rows - _distinct_rows(np, row[busy]) > MAX_IDLE_RANKS:  # cells in file order
        return None  # too many rows without an action: the general path says where
    stages = stage[busy]
    rank_of = np.full(int(stages.max()) + 1, -1, np.int64)
    rank_of[stages] = row[busy]
    if (rank_of[stages] != row[busy]).any() or (rank_of < 0).any():
        return None
    group = np.searchsorted(_GROUPS, kind).astype(np.int8)  # idle, compute, send, receive, marker
    compute, send, recv, marker = (np.flatnonzero(group == g) for g in range(1, 5))
    p2p = _p2p_ops(np, kind, stage, mb, rank_of, send, recv)
    if p2p is None:
        return None
    computes = build_many(Compute, len(compute), {
        "kind": list(map(_PLAIN_KINDS.__getitem__, kind[compute].tolist())),
        "stage": stage[compute].tolist(), "mb": mb[compute].tolist()})
    markers = build_many(Marker, len(marker), {
        "stage": stage[marker].tolist(),
        "action": list(map(_PLAIN_KINDS.__getitem__, kind[marker].tolist())),
        "mb": [None if x < 0 else x for x in mb[marker].tolist()]})
    pools = [itertools.repeat(_IDLE_OP), iter(computes), *map(iter, p2p), iter(markers)]
    flat = list(map(next, map(pools.__getitem__, group.tolist())))
    ends = np.cumsum(np.bincount(row, minlength=num_rows)).tolist()
    programs = tuple(tuple(flat[a:b]) for a, b in zip([0] + ends[:-1], ends))
    plan = Plan(Placement(tuple(rank_of.tolist()), num_rows), int(mb.max()) + 1, programs)
    busy = (group >= 1) & (group <= 3)  # compute, send, receive: kind and stage say all
    remember_op_cells(plan, (np.where(busy, kind, np.where(group == 4, -2, -1)).astype(
        np.int8), stage, np.where(busy, mb, 0).astype(mb.dtype)))
    return plan


def _p2p_ops(np, kind, stage, mb, rank_of, send, recv) -> tuple[list, list] | None:
    """The ops of the SEND cells ``send`` and the RECV cells ``recv``, in order, both ends
    of a transfer sharing one ``Payload``; ``None`` if a cell's peer stage does not
    exist."""
    cells = np.concatenate([send, recv])
    k = kind[cells].astype(np.int64) - _PLAIN_KINDS.index(COMMS[0])  # index in COMMS
    s, mb = stage[cells].astype(np.int64), mb[cells].astype(np.int64)
    offset, is_grad, is_send = (np.array(column).take(k) for column in zip(*(
        (PEER[c][0], PEER[c][1] == GRAD, PEER[c][2]) for c in COMMS)))
    peer = s + offset
    if ((peer < 0) | (peer >= len(rank_of))).any():
        return None
    unit = np.where(is_send, s, peer) * 2 + is_grad  # the payload's stage, and its kind
    keys, which = np.unique(unit * (MAX_INDEX + 1) + mb, return_inverse=True)
    unit = keys // (MAX_INDEX + 1)
    payloads = build_many(Payload, len(keys), {
        "kind": list(map((ACT, GRAD).__getitem__, (unit % 2).tolist())),
        "stage": (unit // 2).tolist(), "mb": (keys % (MAX_INDEX + 1)).tolist()})
    peers = rank_of[peer].tolist()
    ends = list(map(payloads.__getitem__, which.tolist()))
    n = len(send)
    return (build_many(Send, n, {"dst": peers[:n], "payload": ends[:n]}),
            build_many(Recv, len(recv), {"src": peers[n:], "payload": ends[n:]}))
