"""How communication lines up (docs/semantics.md §2.3, §2.4): sends with receives, FIFO
per ordered rank pair (``pair_p2p``; over flat arrays, ``fifo_partners``, which
``p2p_columns`` reads), and collective calls into instances (``collective_instances``:
instance k of a rank set is the k-th call over it on each rank), which the run
(``run.execute``) and the data-flow timing (``run.schedule_times``) both use.

The FIFO rule has two forms on purpose: ``pair_p2p`` zips each channel's endpoint lists
and also lists channels, counts, unmatched ends and mismatches; built from
``fifo_partners`` it took 1.4 times as long on a plan of 780,000 ops, and plans with
groups or collectives (no table) are paired by it.

Endpoints are ``(rank, index, member)``, ``member`` indexing a ``Group``'s ops (0 for a
bare op).
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from ..ir import Collective, Group, Plan, Recv, Send, p2p_of
from .table import OpTable


Endpoint = tuple[int, int, int]  # (rank, index, member)


@attrs.frozen
class P2PPairing:
    """FIFO pairing per ordered pair (§2.3). ``channels[(src, dst)]`` lists the matched
    ``(send_endpoint, recv_endpoint)`` pairs in order; ``partner[e]`` is the matched
    endpoint of ``e``; ``unmatched`` lists endpoints with no partner; ``mismatched`` the
    pairs whose payloads differ; ``counts[(src, dst)]`` is ``(sends, receives)``."""

    channels: dict[tuple[int, int], list[tuple[Endpoint, Endpoint]]]
    partner: dict[Endpoint, Endpoint]
    unmatched: tuple[Endpoint, ...]
    mismatched: tuple[tuple[Endpoint, Endpoint], ...]
    counts: dict[tuple[int, int], tuple[int, int]]


def p2p_at(plan: Plan, e: Endpoint):
    return p2p_of(plan.programs[e[0]][e[1]])[e[2]]


def pair_p2p(plan: Plan) -> P2PPairing:
    """Pair the k-th send ``src→dst`` with the k-th receive at ``dst`` from ``src``: each
    channel's ends listed in program order, a group's members in member order, and the
    two lists zipped. ``fifo_partners`` states the same rule over flat arrays for the
    column form; this form stays apart because it also lists the channels, counts,
    unmatched ends and mismatches, which built from the flat arrays took 1.4 times as
    long on a plan of 780,000 ops (plans with groups or collectives come here)."""
    sends: dict[tuple[int, int], list[Endpoint]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Endpoint]] = defaultdict(list)
    programs = plan.programs
    for rank, program in enumerate(programs):
        for index, op in enumerate(program):
            kind = type(op)
            if kind is Send:
                sends[(rank, op.dst)].append((rank, index, 0))
            elif kind is Recv:
                recvs[(op.src, rank)].append((rank, index, 0))
            elif kind is Group:
                for member, c in enumerate(op.ops):
                    if isinstance(c, Send):
                        sends[(rank, c.dst)].append((rank, index, member))
                    else:
                        recvs[(c.src, rank)].append((rank, index, member))
    channels: dict[tuple[int, int], list[tuple[Endpoint, Endpoint]]] = {}
    partner: dict[Endpoint, Endpoint] = {}
    unmatched: list[Endpoint] = []
    mismatched: list[tuple[Endpoint, Endpoint]] = []
    counts: dict[tuple[int, int], tuple[int, int]] = {}
    for channel in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get(channel, []), recvs.get(channel, [])
        pairs = list(zip(s_list, r_list))
        channels[channel] = pairs
        counts[channel] = (len(s_list), len(r_list))
        for s_end, r_end in pairs:
            partner[s_end] = r_end
            partner[r_end] = s_end
            sent = programs[s_end[0]][s_end[1]]  # p2p_at, inlined (once per transfer)
            received = programs[r_end[0]][r_end[1]]
            sent = (sent.ops[s_end[2]] if type(sent) is Group else sent).payload
            received = (received.ops[r_end[2]] if type(received) is Group else received).payload
            if sent is not received and sent != received:
                mismatched.append((s_end, r_end))
        n = len(pairs)
        unmatched.extend(s_list[n:])
        unmatched.extend(r_list[n:])
    return P2PPairing(channels, partner, tuple(sorted(unmatched)), tuple(mismatched), counts)


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


def pair_collectives(plan: Plan) -> CollectivePairing:
    """The collective instances of ``plan`` (``collective_instances``)."""
    return collective_instances(plan.programs, plan.num_ranks)


def collective_instances(programs, num_ranks: int) -> CollectivePairing:
    """The one statement of how collective calls line up (``CollectivePairing``), over
    per-rank programs (a plan's, or a compute-only schedule's)."""
    instance_of: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
    members: dict[tuple[tuple[int, ...], int], dict[int, int]] = defaultdict(dict)
    count: dict[tuple[tuple[int, ...], int], int] = defaultdict(int)
    problems: list[tuple[tuple[int, int], str]] = []
    for rank, program in enumerate(programs):
        for index, op in enumerate(program):
            if not isinstance(op, Collective):
                continue
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
    """``pair_p2p`` by counting, over a table's transfers. ``rows`` are the table rows of
    its sends and receives (rank-major, program order), ``send`` says which are sends, and
    ``partner[k]`` is the place in ``rows`` of the end that ``rows[k]`` pairs with, or -1
    (the FIFO rule: the k-th send of a channel meets its k-th receive; an end past the
    other side's count, or whose peer is no rank, has none). The pairing is symmetric."""

    rows: object  # numpy int64 arrays
    send: object
    partner: object


def p2p_columns(table: OpTable) -> P2PColumns:
    """The FIFO pairing of ``table``'s transfers. A channel's sends in program order are
    its source rank's (rows are rank-major), likewise its receives: numbering each
    channel side's ends in row order (a stable sort) and meeting equal numbers is
    ``pair_p2p``'s zip of the two lists."""
    import numpy as np
    n = table.plan.num_ranks
    kinds = [type(op) for _, op, _ in table.classes]
    comm = np.array([k is Send or k is Recv for k in kinds] + [False], dtype=bool)
    sends = np.array([k is Send for k in kinds] + [False], dtype=bool)
    peers = np.array([op.peer if k is Send or k is Recv else -1
                      for k, (_, op, _) in zip(kinds, table.classes)] + [-1], dtype=np.int64)
    rows = np.flatnonzero(comm[table.cls])
    cls = table.cls[rows]
    send, peer, here = sends[cls], peers[cls], table.rank[rows]
    return P2PColumns(rows, send, fifo_partners(here, peer, send, n))


def fifo_partners(here, peer, send, n: int):
    """The FIFO rule of §2.3, stated once: over transfer ends in rank-major program order
    (arrays: each end's rank, its peer, whether it is a send), the place of the end each
    one meets, or -1. A channel's sends in program order are its source rank's, likewise
    its receives: numbering each channel side's ends in order (a stable sort) and meeting
    equal numbers is the k-th send meeting the k-th receive; an end past the other side's
    count, or whose peer is no rank, meets none. The pairing is symmetric."""
    import numpy as np
    partner = np.full(len(here), -1, dtype=np.int64)
    ok = peer < n  # a peer that is no rank never meets anything
    ends = [np.flatnonzero(ok & send), np.flatnonzero(ok & ~send)]  # sends, receives
    channel = [here[ends[0]] * n + peer[ends[0]], peer[ends[1]] * n + here[ends[1]]]
    width = n * n
    if width > 4 * len(here):  # few transfers between many ranks: number the channels used
        used, code = np.unique(np.concatenate(channel), return_inverse=True)
        code, width = code.reshape(-1), len(used)
        channel = [code[:len(ends[0])], code[len(ends[0]):]]
    order = [np.argsort(c, kind="stable") for c in channel]
    count = [np.bincount(c, minlength=width) for c in channel]
    start = [np.cumsum(c) - c for c in count]
    sent = channel[0][order[0]]  # each send's channel, sends in channel order
    nth = np.arange(len(sent), dtype=np.int64) - start[0][sent]
    meets = nth < count[1][sent]
    s_end = ends[0][order[0][meets]]
    r_end = ends[1][order[1][start[1][sent[meets]] + nth[meets]]]
    partner[s_end], partner[r_end] = r_end, s_end
    return partner


def p2p_clean(table: OpTable, pairs: P2PColumns | None = None) -> bool:
    """True when ``pair_p2p`` of the table's plan finds nothing unmatched or mismatched:
    every end has a partner (``p2p_columns``) and each pair's payloads are equal."""
    import numpy as np
    pairs = pairs or p2p_columns(table)
    if pairs.partner.min(initial=0) < 0:
        return False
    payloads: dict = {}
    sig = np.array([payloads.setdefault(attrs.evolve(op.payload, mb=0), len(payloads))
                    if type(op) is Send or type(op) is Recv else -1
                    for _, op, _ in table.classes] or [-1], dtype=np.int64)  # all but the mb
    s_rows, r_rows = pairs.rows[pairs.send], pairs.rows[pairs.partner[pairs.send]]
    return bool(np.array_equal(sig[table.cls[s_rows]], sig[table.cls[r_rows]])
                and np.array_equal(table.mb[s_rows], table.mb[r_rows]))

