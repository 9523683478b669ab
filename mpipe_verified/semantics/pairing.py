"""How communication lines up (docs/semantics.md §2.3, §2.4): sends with receives, FIFO
per ordered rank pair, and collective calls into instances (``collective_instances``:
instance k of a rank set is the k-th call over it on each rank), which the run
(``run.execute``) and the data-flow timing (``run.schedule_times``) both use.

The FIFO rule is stated once, over flat arrays: ``channel_keys`` says which channel a
transfer end travels and ``fifo_pairs`` which send meets which receive. Both forms call
it: ``pair_p2p`` op by op, over the ends of any plan (groups and collectives included),
and ``p2p_columns`` over a table's transfers; each only gathers the arrays and reads the
answer back in its own shape.

Endpoints are ``(rank, index, member)``, ``member`` indexing a ``Group``'s ops (0 for a
bare op).
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter

import attrs

from ..ir import (ACT, BODY, GRAD, RANK_MOVES, SINK, SOURCE, Collective, Group, Plan, Recv,
                  Send, p2p_of)
from .rules import payload_token
from .table import OpTable


Endpoint = tuple[int, int, int]  # (rank, index, member)


@attrs.frozen
class P2PPairing:
    """FIFO pairing per ordered pair (§2.3). ``channels[(src, dst)]`` lists the matched
    ``(send_endpoint, recv_endpoint)`` pairs in order; ``partner[e]`` is the matched
    endpoint of ``e``; ``unmatched`` lists endpoints with no partner; ``mismatched`` the
    pairs whose payloads differ; ``counts[(src, dst)]`` is ``(sends, receives)``;
    ``repeated`` the receives of a token their rank received before (``repeated``)."""

    channels: dict[tuple[int, int], list[tuple[Endpoint, Endpoint]]]
    partner: dict[Endpoint, Endpoint]
    unmatched: tuple[Endpoint, ...]
    mismatched: tuple[tuple[Endpoint, Endpoint], ...]
    counts: dict[tuple[int, int], tuple[int, int]]
    repeated: tuple[Endpoint, ...] = ()


def p2p_at(plan: Plan, e: Endpoint):
    return p2p_of(plan.programs[e[0]][e[1]])[e[2]]


def pair_p2p(plan: Plan) -> P2PPairing:
    """Pair the k-th send ``src→dst`` with the k-th receive at ``dst`` from ``src``
    (``fifo_pairs``): each channel's ends listed in program order, a group's members in
    member order; also the channels, counts, unmatched ends and mismatched payloads."""
    import numpy as np
    ends: list[Endpoint] = []  # rank-major, in program order
    ops: list = []  # the Send or Recv at each end
    per_rank: list[int] = []  # ends on the ranks so far
    add_end, add_op = ends.append, ops.append
    for rank, program in enumerate(plan.programs):
        for index, op in enumerate(program):
            kind = type(op)
            if kind is Send or kind is Recv:
                add_end((rank, index, 0))
                add_op(op)
            elif kind is Group:
                for member, c in enumerate(op.ops):
                    add_end((rank, index, member))
                    add_op(c)
        per_rank.append(len(ends))
    here = np.repeat(np.arange(len(per_rank), dtype=np.int64), np.diff(per_rank, prepend=0))
    send = np.fromiter((type(c) is Send for c in ops), dtype=bool, count=len(ops))
    peer = np.fromiter((c.dst if type(c) is Send else c.src for c in ops), dtype=np.int64,
                       count=len(ops))
    channel, src, dst = channel_keys(here, peer, send)
    s_end, r_end = fifo_pairs(channel, send)
    return _pairing(plan, ends, ops, (channel, src, dst), send, s_end.tolist(),
                    r_end.tolist())


def _pairing(plan, ends, ops, channels_of, send, s_end, r_end) -> P2PPairing:
    """The ``P2PPairing`` of ``plan``'s transfer ends ``ends`` (sorted; ``ops`` the Send or Recv
    at each, ``channels_of`` their ``channel_keys``, ``send`` whether each sends) met as
    ``fifo_pairs`` says: ``s_end[k]`` with ``r_end[k]``, in channel order."""
    import numpy as np
    key, src, dst = channels_of
    used, first, count = np.unique(key, return_index=True, return_counts=True)
    sends = np.bincount(np.searchsorted(used, key[send]), minlength=len(used))
    met = np.minimum(sends, count - sends).tolist()
    s_ends, r_ends = list(map(ends.__getitem__, s_end)), list(map(ends.__getitem__, r_end))
    channels: dict[tuple[int, int], list[tuple[Endpoint, Endpoint]]] = {}
    counts: dict[tuple[int, int], tuple[int, int]] = {}
    at = 0
    for channel, n_sends, total, n in zip(zip(src[first].tolist(), dst[first].tolist()),
                                          sends.tolist(), count.tolist(), met):
        channels[channel] = list(zip(s_ends[at:at + n], r_ends[at:at + n]))
        counts[channel] = (n_sends, total - n_sends)
        at += n
    both, other = [None] * (2 * len(s_ends)), [None] * (2 * len(s_ends))
    both[0::2] = other[1::2] = s_ends  # each pair's send, then its receive, in order
    both[1::2] = other[0::2] = r_ends
    partner = dict(zip(both, other))
    payload = attrgetter("payload")
    mismatched = [(s, r) for s, r, sent, received in zip(
        s_ends, r_ends, map(payload, map(ops.__getitem__, s_end)),
        map(payload, map(ops.__getitem__, r_end))) if sent is not received and sent != received]
    lonely = np.ones(len(ends), dtype=bool)
    lonely[s_end] = lonely[r_end] = False
    unmatched = tuple(ends[i] for i in np.flatnonzero(lonely).tolist())
    return P2PPairing(channels, partner, unmatched, tuple(mismatched), counts,
                      repeated(ends, ops, plan))


def repeated(ends, ops, plan: Plan) -> tuple[Endpoint, ...]:
    """The rule that a rank receives each activation, gradient or raw input at most once
    (§2.3), stated once: of the transfer ends ``ends`` (rank-major, in program order;
    ``ops`` the Send or Recv at each), the receives of a token (``payload_token``), for
    the same crossing of the cut (``crossing``), that their rank received before. A
    second receive would hold a second buffer of what the first holds (§2.6). A rank
    move's ends are counted by ``work.move_issues``."""
    sources = {s.name for s in plan.cut.segments if s.side == SOURCE}
    sinks = {s.name for s in plan.cut.segments if s.side == SINK}
    last = plan.placement.num_stages - 1
    seen: set = set()
    out = []
    for end, op in zip(ends, ops):
        if type(op) is Recv and op.payload.kind not in RANK_MOVES:
            key = (end[0], payload_token(op.payload),
                   crossing(op.payload, sources, sinks, last))
            if key in seen:
                out.append(end)
            seen.add(key)
    return tuple(out)


def crossing(p, sources, sinks, last: int) -> str | None:
    """The segment a payload crossing the cut is received for: the body's first-stage
    gradient sent to a source segment (each source's part of it is its own tensor), or
    the body's last output sent to a sink (each sink's copy); None for any other payload,
    whatever its ``to_segment`` says."""
    if p.segment != BODY:
        return None
    if p.kind == GRAD and p.stage == 0 and p.to_segment in sources:
        return p.to_segment
    if p.kind == ACT and p.stage == last and p.to_segment in sinks:
        return p.to_segment
    return None


def channel_keys(here, peer, send) -> tuple:
    """The channel each transfer end travels (arrays: each end's rank, its peer, whether
    it is a send): a send's is ``(src, dst) = (its rank, its peer)``, a receive's (its
    peer, its rank). Returns ``(key, src, dst)``, the keys ordered as the pairs are."""
    import numpy as np
    src, dst = np.where(send, here, peer), np.where(send, peer, here)
    width = int(max(src.max(initial=-1), dst.max(initial=-1))) + 1
    if width > 2**31:  # peers too far apart to multiply: number the ranks named
        ranks, code = np.unique(np.concatenate([src, dst]), return_inverse=True)
        return code[:len(src)] * len(ranks) + code[len(src):], src, dst
    return src * width + dst, src, dst


def fifo_pairs(channel, send) -> tuple:
    """The FIFO rule of §2.3, stated once, over transfer ends listed rank-major in
    program order (arrays: each end's channel key, ``channel_keys``, whether it is a
    send): the k-th send of a channel meets its k-th receive. A channel's sends are its
    source rank's, in program order, likewise its receives, so numbering each channel
    side's ends in order (a stable sort) and meeting equal numbers is that rule; an end
    past the other side's count meets none. Returns the met ``(sends, receives)`` as two
    aligned arrays of end places, in channel order, then program order."""
    import numpy as np
    ends = [np.flatnonzero(send), np.flatnonzero(~send)]  # sends, receives
    width = int(channel.max(initial=-1)) + 1
    if width > 4 * len(channel):  # few transfers between many ranks: number the channels used
        used, code = np.unique(channel, return_inverse=True)
        channel, width = code.reshape(-1), len(used)
    channel = [channel[ends[0]], channel[ends[1]]]
    order = [np.argsort(c, kind="stable") for c in channel]
    count = [np.bincount(c, minlength=width) for c in channel]
    start = [np.cumsum(c) - c for c in count]
    sent = channel[0][order[0]]  # each send's channel, sends in channel order
    nth = np.arange(len(sent), dtype=np.int64) - start[0][sent]
    meets = nth < count[1][sent]
    return ends[0][order[0][meets]], ends[1][order[1][start[1][sent[meets]] + nth[meets]]]


def _positions(program, kind: type) -> list[int]:
    """The positions of the steps of type ``kind`` in ``program`` (found by
    ``list.index``, which compares types by identity)."""
    types, out = list(map(type, program)), []
    try:
        while True:
            out.append(types.index(kind, out[-1] + 1 if out else 0))
    except ValueError:  # no more of them
        return out


@attrs.frozen
class CollectivePairing:
    """Instance k of a rank set is the k-th call over that set (the distinct ranks a call
    lists, sorted) on each rank that makes one (docs/semantics.md §2.4).
    ``members[(ranks, k)]`` maps each calling rank to its op index, a caller outside the
    set included; ``instance_of`` holds the calls of members only (a non-member's call
    never completes); ``problems`` lists disagreements (a member missing, kind/tag/root
    differing from the lowest caller's) as ``(positions, message)`` where ``positions``
    are the ``(rank, index)`` of every op involved."""

    instance_of: dict[tuple[int, int], tuple[tuple[int, ...], int]]
    members: dict[tuple[tuple[int, ...], int], dict[int, int]]
    problems: tuple[tuple[tuple[tuple[int, int], ...], str], ...]


def pair_collectives(plan: Plan, calls=None) -> CollectivePairing:
    """The collective instances of ``plan`` (``collective_instances``; ``calls``: its
    collective steps, when the caller has them)."""
    return collective_instances(plan.programs, plan.num_ranks, calls)


def collective_instances(programs, num_ranks: int, calls=None) -> CollectivePairing:
    """The one statement of how collective calls line up (``CollectivePairing``), over
    per-rank programs (a plan's, or a compute-only schedule's). ``calls``: their
    collective steps as ``(rank, index, op)``, rank-major in program order, when the
    caller has them (``OpTable.calls``; default: found in ``programs``)."""
    instance_of: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
    members: dict[tuple[tuple[int, ...], int], dict[int, int]] = defaultdict(dict)
    count: dict[tuple[tuple[int, ...], int], int] = defaultdict(int)
    problems: list[tuple[tuple[int, int], str]] = []
    if calls is None:
        calls = [(rank, index, program[index]) for rank, program in enumerate(programs)
                 for index in _positions(program, Collective)]
    for rank, index, op in calls:
        group = tuple(sorted(set(op.ranks)))
        malformed = _malformed(op, rank, index, num_ranks)
        if malformed:
            problems.append((((rank, index),), malformed))
        k = count[(group, rank)]
        count[(group, rank)] += 1
        members[(group, k)][rank] = index
        if rank in group:
            instance_of[(rank, index)] = (group, k)
    for (group, k), where in members.items():
        ops = {r: programs[r][i] for r, i in where.items()}
        first_rank = min(ops)
        ref = ops[first_rank]
        for r in group:
            if r not in ops:
                problems.append((((first_rank, where[first_rank]),),
                                 f"collective #{k} over ranks {list(group)} ({ref}) is never "
                                 f"called on rank {r}"))
            elif (ops[r].kind, ops[r].tag, ops[r].root) != (ref.kind, ref.tag, ref.root):
                outside = "" if first_rank in group else " (not a member)"
                problems.append((((first_rank, where[first_rank]), (r, where[r])),
                                 f"collective #{k} over ranks {list(group)}: rank {r} calls "
                                 f"{ops[r]} but rank {first_rank}{outside} calls {ref}"))
    return CollectivePairing(instance_of, dict(members), tuple(problems))


def _malformed(op: Collective, rank: int, index: int, num_ranks: int) -> str:
    """What is wrong with a collective call on its own: members must be distinct existing
    ranks including the caller, and a broadcast or gather names a root among them."""
    if rank not in op.ranks:
        return f"rank {rank} calls {op} at position {index} but is not a member"
    at = f"rank {rank} position {index}: {op}"
    if len(set(op.ranks)) != len(op.ranks):
        return f"{at} lists a member twice"
    outside = [r for r in op.ranks if not 0 <= r < num_ranks]
    if outside:
        return f"{at} names rank(s) {outside} outside the plan's {num_ranks} ranks"
    if op.kind == "all_reduce" and op.root is not None:
        return f"{at} is an all-reduce with a root"
    if op.kind != "all_reduce" and op.root not in op.ranks:
        return f"{at} has root {op.root}, which is not a member"
    return ""

@attrs.frozen(eq=False)
class P2PColumns:
    """``pair_p2p`` over a table's transfers, as arrays. ``rows`` are the table rows of
    its sends and receives (rank-major, program order), ``send`` says which are sends, and
    ``partner[k]`` is the place in ``rows`` of the end that ``rows[k]`` meets
    (``fifo_pairs``), or -1 for none. The pairing is symmetric."""

    rows: object  # numpy int64 arrays
    send: object
    partner: object


def p2p_columns(table: OpTable) -> P2PColumns:
    """The FIFO pairing of ``table``'s transfers (``fifo_pairs``; rows are rank-major, in
    program order, as it asks)."""
    import numpy as np
    kinds = [type(op) for _, op, _ in table.classes]
    comm = np.array([k is Send or k is Recv for k in kinds] + [False], dtype=bool)
    sends = np.array([k is Send for k in kinds] + [False], dtype=bool)
    peers = np.array([op.peer if k is Send or k is Recv else -1
                      for k, (_, op, _) in zip(kinds, table.classes)] + [-1], dtype=np.int64)
    rows = np.flatnonzero(comm[table.cls])
    cls = table.cls[rows]
    send = sends[cls]
    s_end, r_end = fifo_pairs(channel_keys(table.rank[rows], peers[cls], send)[0], send)
    partner = np.full(len(rows), -1, dtype=np.int64)
    partner[s_end], partner[r_end] = r_end, s_end
    return P2PColumns(rows, send, partner)


def p2p_clean(table: OpTable, pairs: P2PColumns | None = None) -> bool:
    """True when ``pair_p2p`` of the table's plan finds nothing unmatched, mismatched or
    repeated: every end has a partner (``p2p_columns``), each pair's payloads are equal,
    and no rank receives one token twice (``repeated``, by columns: a table's plan has
    no rank moves and no cut, so no payload crosses one)."""
    import numpy as np
    pairs = pairs or p2p_columns(table)
    if pairs.partner.min(initial=0) < 0:
        return False
    payloads: dict = {}
    sig = np.array([payloads.setdefault(attrs.evolve(op.payload, mb=0), len(payloads))
                    if type(op) is Send or type(op) is Recv else -1
                    for _, op, _ in table.classes] or [-1], dtype=np.int64)  # all but the mb
    s_rows, r_rows = pairs.rows[pairs.send], pairs.rows[pairs.partner[pairs.send]]
    if not (np.array_equal(sig[table.cls[s_rows]], sig[table.cls[r_rows]])
            and np.array_equal(table.mb[s_rows], table.mb[r_rows])):
        return False
    tokens: dict = {}  # a receive's token but its microbatch, numbered (no cut: no crossing)
    token = np.array([tokens.setdefault(payload_token(attrs.evolve(op.payload, mb=0)),
                                        len(tokens)) if type(op) is Recv else -1
                      for _, op, _ in table.classes] or [-1], dtype=np.int64)
    got = pairs.rows[~pairs.send]
    rank, tok, mb = table.rank[got], token[table.cls[got]], table.mb[got]
    width = int(mb.max(initial=0)) + 1
    if (int(rank.max(initial=0)) + 1) * len(tokens) * width < 2**62:
        key = np.sort((rank * len(tokens) + tok) * width + mb)  # one int per (rank, token, mb)
        return not (key[1:] == key[:-1]).any()
    return np.unique(np.stack([rank, tok, mb]), axis=1).shape[1] == len(got)

