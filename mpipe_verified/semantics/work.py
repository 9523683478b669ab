"""Completeness (docs/semantics.md §3): the work a plan must contain and the collectives
its cut requires.

The rule, stated once: a unit's work is counted per kind (``work_table``; by columns,
``work_complete``) and judged by ``unit_ok``; ``required_work`` explains a failing unit.
The two counts are kept apart on purpose: the column count is a ``bincount`` over the
table (the verifier's hot path on 10^5-10^6 ops), the op-by-op count also records where
each op first occurs and what is stray or misplaced, which only a failing plan needs.
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from ..ir import (BACKWARD, BODY, FORWARD, INPUT_GRAD, LEND, RANK_MOVES, RECOMPUTE, WEIGHT_GRAD,
                  Collective, Compute, Offload, Plan, Reload, Send, computes_of, p2p_of)
from .rules import GRADS, PARAMS, REPLICA, Chain, collective_segment
from .table import OpTable


@attrs.frozen
class WorkIssue:
    """A completeness finding: ``op`` at ``where`` (rank, index) or missing (``where`` None)."""

    op: Compute
    problem: str  # "missing" | "duplicate" | "unexpected" | "wrong_rank" | "mixed_backward"
    #               | "short" (fewer ops than the required forwards)
    where: tuple[int, int] | None
    detail: str


WORK_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE)
MISPLACED = len(WORK_KINDS)


@attrs.frozen
class WorkTable:
    """Occurrences of compute work. ``counts[(segment, stage, mb)]`` is
    ``[F, B, I, W, R, misplaced]`` (misplaced: occurrences on a rank other than the one
    the chain expects); ``first[op]`` is where an op first occurs; ``stray`` lists ops
    outside the chain's units or microbatches."""

    counts: dict[tuple[str, int, int], list[int]]
    first: dict[Compute, tuple[int, int]]
    stray: tuple[tuple[Compute, int, int], ...]
    misplaced: dict[tuple[str, int, int], tuple[Compute, int, int]]
    short: bool = False  # fewer compute ops than required forwards: missing units unlisted


def work_table(plan: Plan, chain: Chain | None = None) -> WorkTable:
    chain = chain or Chain.of(plan)
    m = plan.num_microbatches
    counts: dict[tuple[str, int, int], list[int]] = {}
    first: dict[Compute, tuple[int, int]] = {}
    stray = []
    misplaced: dict[tuple[str, int, int], tuple[Compute, int, int]] = {}
    column = {k: i for i, k in enumerate(WORK_KINDS)}
    units = set(chain.units())
    for rank, program in enumerate(plan.programs):
        for index, op in enumerate(program):
            for c in computes_of(op):
                key = (c.segment, c.stage, c.mb)
                if (c.segment, c.stage) not in units or c.mb >= m or (
                        not c.segment and not chain.runs(c.stage, c.mb)):
                    stray.append((c, rank, index))
                    continue
                row = counts.get(key)
                if row is None:
                    row = counts[key] = [0] * (MISPLACED + 1)
                if chain.expected_rank(c) != rank:
                    row[MISPLACED] += 1
                    misplaced.setdefault(key, (c, rank, index))
                else:
                    row[column[c.kind]] += 1
                first.setdefault(c, (rank, index))
    work = sum(map(sum, counts.values())) + len(stray)
    if _due_units(chain, m) > work:  # never enumerate microbatches the plan cannot hold
        return WorkTable(counts, first, tuple(stray), misplaced, short=True)
    for seg, stage in chain.units():
        for mb in (chain.microbatches(stage, m) if not seg else range(m)):
            if (seg, stage, mb) not in counts:
                counts[(seg, stage, mb)] = [0] * (MISPLACED + 1)
    return WorkTable(counts, first, tuple(stray), misplaced)


def _due_units(chain: Chain, m: int) -> int:
    """How many (unit, microbatch) pairs owe work (each pipeline's stages: its own)."""
    return len(chain.units()) * m // max(len(chain.pipelines), 1)


def _first_missing(chain: Chain, table: WorkTable, m: int) -> Compute:
    """A unit with no forward, in time linear in the units present."""
    for seg, stage in chain.units():
        mb = next((mb for mb in (chain.microbatches(stage, m) if not seg else range(m))
                   if (seg, stage, mb) not in table.counts
                   or table.counts[(seg, stage, mb)][0] == 0), None)
        if mb is not None:
            return Compute(FORWARD, stage, mb, seg)
    raise AssertionError("a short table has a missing unit")


def unit_ok(row: list[int], need_backward: bool, need_recompute: bool) -> bool:
    """One forward, the backward the unit needs (``B``, or ``I`` and ``W``; none when
    frozen), the recompute it needs, nothing misplaced."""
    f, b, i, w, r, wrong = row
    back = (b, i, w) in ((1, 0, 0), (0, 1, 1)) if need_backward else (b, i, w) == (0, 0, 0)
    return f == 1 and back and r == int(need_recompute) and wrong == 0


def required_work(plan: Plan, table: WorkTable | None = None,
                  limit: int | None = None) -> list[WorkIssue]:
    """Check §3 completeness over the chain (body and cut): at most ``limit`` issues."""
    chain = Chain.of(plan)
    table = table or work_table(plan, chain)
    m = plan.num_microbatches
    if table.short:
        units = len(chain.units())
        f = _first_missing(chain, table, m)
        ops = sum(map(sum, table.counts.values())) + len(table.stray)
        return [WorkIssue(f, "short", None, f"the plan has {ops} compute ops but its {units} "
                                            f"stages and segments times {m} microbatches need "
                                            f"at least {_due_units(chain, m)} forwards; {f} "
                                            "(forward) never runs")]
    issues = [WorkIssue(c, "unexpected", (rank, index), _stray_detail(chain, c, m))
              for c, rank, index in table.stray]
    for (seg, s, mb), row in sorted(table.counts.items()):
        if limit is not None and len(issues) >= limit:
            break
        need_back, need_r = chain.expected_backward(seg, mb)
        if not unit_ok(row, need_back, need_r):
            issues.extend(_unit_issues(chain, table, seg, s, mb, row, need_back, need_r))
    return issues[:limit] if limit is not None else issues


def _stray_detail(chain: Chain, c: Compute, m: int) -> str:
    if chain.pipelines and not c.segment and c.stage < chain.num_stages and c.mb < m:
        return (f"{c} is not part of this plan (microbatch {c.mb} does not run in the "
                f"pipeline of stage {c.stage})")
    return (f"{c} is not part of this plan (stages, segments and microbatches "
            f"0..{m - 1})")


def _unit_issues(chain, table, seg, s, mb, row, need_back, need_r) -> list[WorkIssue]:
    f, b, i, w, r = (Compute(k, s, mb, seg) for k in WORK_KINDS)
    owner = chain.expected_rank(f)
    out = []
    for c, count in zip((f, b, i, w, r), row):
        if count > 1:
            out.append(WorkIssue(c, "duplicate", table.first.get(c),
                                 f"{c} occurs {count} times on rank {chain.expected_rank(c)}"))
    if row[MISPLACED]:
        c, rank, index = table.misplaced[(seg, s, mb)]
        out.append(WorkIssue(c, "wrong_rank", (rank, index),
                             f"{c} runs on rank {rank} but belongs on rank "
                             f"{chain.expected_rank(c)}"))
    if row[0] == 0:
        out.append(WorkIssue(f, "missing", None, f"{f} (forward) never runs on rank {owner}"))
    back_rank = chain.expected_rank(b)
    if not need_back and (row[1] or row[2] or row[3]):
        c = b if row[1] else i if row[2] else w
        why = ("the plan is declared forward-only" if chain.forward_only
               else f"segment {seg!r} is frozen")
        out.append(WorkIssue(c, "unexpected", table.first.get(c),
                             f"{c} runs but {why} (no backward)"))
    elif need_back and row[1] and (row[2] or row[3]):
        out.append(WorkIssue(b, "mixed_backward", table.first.get(b),
                             f"{b} and its split form {i}/{w} both occur"))
    elif need_back and not row[1] and not (row[2] and row[3]):
        missing = b if not (row[2] or row[3]) else (w if row[2] else i)
        out.append(WorkIssue(missing, "missing", None,
                             f"{missing} never runs on rank {back_rank} (backward of "
                             f"{'stage ' if not seg else seg + ':'}{s} microbatch {mb} needs "
                             f"B, or I then W)"))
    if need_r and row[4] == 0:
        out.append(WorkIssue(r, "missing", None, f"{r} (recompute before the central "
                                                 f"backward) never runs on rank {back_rank}"))
    elif not need_r and row[4]:
        out.append(WorkIssue(r, "unexpected", table.first.get(r), f"{r} runs but no recompute "
                                                                   "is needed here"))
    return out


def work_complete(table: OpTable, chain: Chain) -> bool:
    """``required_work`` and ``collective_issues`` find nothing, read by columns: every
    unit's work counted as ``work_table`` counts it and judged by ``unit_ok`` (once per
    distinct count row), and the collectives a table's plan calls
    (``OpTable.calls``) judged as ``collective_issues`` judges them. False when anything
    is missing, repeated, misplaced or stray: op by op then says what."""
    import numpy as np
    plan = table.plan
    s, m = chain.num_stages, plan.num_microbatches
    units = set(chain.units())
    where = chain.placement.stage_to_rank
    items = ([], [], [], [])  # per compute of a class: class, work kind, stage, mb shift
    for c, (rank, op, _) in enumerate(table.classes):
        ops = computes_of(op)  # a class's computes: its first op's, each at a fixed shift
        for one in ops:
            if (one.segment, one.stage) not in units or where[one.stage] != rank:
                return False  # stray or misplaced: op by op says which
            for out, x in zip(items, (c, WORK_KINDS.index(one.kind), one.stage,
                                      one.mb - ops[0].mb)):
                out.append(x)
    if collective_issues(plan, 1, table.calls()):
        return False
    cls, kind, stage, shift = (np.array(x, dtype=np.int64) for x in items)
    per = np.bincount(cls, minlength=len(table.classes))[table.cls]  # computes per op
    rows = np.repeat(np.arange(len(table.cls), dtype=np.int64), per)
    at = np.searchsorted(cls, table.cls[rows]) + (  # each op's computes, in class order
        np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per))
    mb, kind, stage = table.mb[rows] + shift[at], kind[at], stage[at]
    due = sum(len(chain.microbatches(x, m)) for x in range(s)) if chain.pipelines else s * m
    if due > len(mb) or (len(mb) and int(mb.max()) >= m):
        return False  # a unit without work (never enumerated: m may be huge), or stray
    if chain.pipelines:  # a stage's work of another pipeline's microbatch is stray
        pipe = np.zeros(m, dtype=np.int64)
        for i, mbs in enumerate(chain.pipelines):
            pipe[list(mbs)] = i
        if not np.array_equal(pipe[mb], stage // chain.per_pipeline):
            return False
    width = len(WORK_KINDS)
    present, at = np.unique(stage * m + mb, return_inverse=True)
    if len(present) != due:
        return False
    rows = np.zeros((len(present), width), dtype=np.int64)
    np.add.at(rows, (at.reshape(-1), kind), 1)
    needed = np.array([chain.expected_backward(BODY, x) for x in range(m)],
                      dtype=np.int64).reshape(m, 2)[present % m]
    cases = np.concatenate([rows, needed], axis=1)
    return all(unit_ok(row[:width] + [0], bool(row[width]), bool(row[width + 1]))
               for row in _distinct_rows(cases))


def _distinct_rows(rows) -> list[list[int]]:
    """The distinct rows of a non-negative integer matrix (as one number each when they
    fit in 63 bits, which sorts faster than rows)."""
    import numpy as np
    base = int(rows.max(initial=0)) + 1
    if base ** rows.shape[1] >= 2**63:
        return np.unique(rows, axis=0).tolist()
    weights = base ** np.arange(rows.shape[1], dtype=np.int64)
    codes = np.unique(rows @ weights)
    return [[int(c) // base ** k % base for k in range(rows.shape[1])] for c in codes.tolist()]


@attrs.frozen
class CollectiveIssue:
    """A completeness finding about a collective the cut requires (``tag``) on ``rank``:
    at ``where`` (rank, index), or missing there (``where`` None)."""

    tag: str
    rank: int
    where: tuple[int, int] | None
    detail: str


def collective_issues(plan: Plan, limit: int | None = None,
                      steps=None) -> list[CollectiveIssue]:
    """The collectives of ``Chain.required_collectives``: every call tagged
    ``params:NAME``/``grads:NAME`` is one the cut requires, of its kind and root, over
    members that include every rank that must call it; each such rank calls it exactly
    once, any other member at most once. At most ``limit`` issues. ``steps``: the
    plan's ``(rank, index, op)`` to read, when the caller knows which are collectives
    (default: every step)."""
    required = Chain.of(plan).required_collectives()
    calls: dict[tuple[str, int], list[int]] = defaultdict(list)
    issues = []
    if steps is None:
        steps = ((rank, index, op) for rank, program in enumerate(plan.programs)
                 for index, op in enumerate(program))
    for rank, index, op in steps:
        tagged = collective_segment(op) if type(op) is Collective else None
        if tagged is None or tagged[0] not in (PARAMS, GRADS, REPLICA):
            continue
        calls[(op.tag, rank)].append(index)
        problem = _tagged_problem(op, required.get(op.tag))
        if problem:
            issues.append(CollectiveIssue(op.tag, rank, (rank, index),
                                          f"rank {rank} position {index}: {op} {problem}"))
    for tag, (kind, root, ranks) in sorted(required.items()):
        for rank in range(plan.num_ranks):
            where = calls[(tag, rank)]
            if rank in ranks and not where:
                issues.append(CollectiveIssue(tag, rank, None, _never_called(tag, kind, root,
                                                                             rank)))
            elif len(where) > 1:
                issues.append(CollectiveIssue(tag, rank, (rank, where[1]),
                                              f"rank {rank} calls {kind} {tag} {len(where)} "
                                              f"times (positions {where}); the cut needs it once"))
    return issues[:limit]


def _tagged_problem(op: Collective, need) -> str:
    if need is None:
        if collective_segment(op)[0] == REPLICA:
            return "is not required (no model stage of that number has replicas on " \
                   "several ranks)"
        return "is not required by the cut (no trainable segment of that name moves work " \
               "off its home rank)"
    kind, root, ranks = need
    if op.kind != kind or op.root != root:
        want = f"{kind}" + (f" rooted at rank {root}" if root is not None else "")
        return f"should be {'an' if kind[0] in 'aeiou' else 'a'} {want}"
    left_out = sorted(ranks - set(op.ranks))
    if left_out:
        return f"leaves out rank(s) {left_out}, which must take part"
    return ""


def _never_called(tag: str, kind: str, root, rank: int) -> str:
    role, name = tag.split(":", 1)
    if role == REPLICA:
        return (f"rank {rank} never all-reduces the weight gradients of the replicas of "
                f"model stage {name} ({kind} {tag}): every rank that holds one must take part")
    if role == GRADS:
        return (f"rank {rank} never all-reduces the gradients of segment {name!r} ({kind} "
                f"{tag}): every rank that runs its backward and its home rank must take part")
    return (f"rank {rank} never receives the parameters of segment {name!r} ({kind} {tag} "
            f"from rank {root}) but runs it")



@attrs.frozen
class MoveIssue:
    """A completeness finding about the activation moves (§2.10) of ``key`` = ``(rank,
    segment, stage, mb)``: at ``where`` (rank, index), or about the key as a whole."""

    key: tuple
    where: tuple[int, int] | None
    detail: str


def move_issues(plan: Plan, limit: int | None = None) -> list[MoveIssue]:
    """§2.10 completeness of the activation moves: each ``OFFLOAD``/``RELOAD`` and each
    lend or return names a unit and microbatch of the plan (and none occurs in a
    forward-only plan); per rank and activation at most one ``OFFLOAD``, exactly as many
    ``RELOAD`` as ``OFFLOAD``, at most one lend sent, as many returns received as lends
    sent and as many returns sent as lends received. At most ``limit`` issues."""
    units, m = set(Chain.of(plan).units()), plan.num_microbatches
    counts: dict[tuple, list[int]] = {}  # offloads, reloads, lends sent, returns received,
    first: dict[tuple, tuple[int, int]] = {}  # lends received, returns sent
    issues = []
    for rank, program in enumerate(plan.programs):
        for index, op in enumerate(program):
            for what, move in _moves_of(op):
                key = (rank, move.segment, move.stage, move.mb)
                if ((move.segment, move.stage) not in units or move.mb >= m or plan.forward_only
                        or plan.seq_chunks > 1):
                    why = ("the plan is declared forward-only (nothing is stored)"
                           if plan.forward_only else "a chunk's activation holds the keys and "
                           "values later chunks read: a plan of sequence chunks moves none"
                           if plan.seq_chunks > 1 else "it is not an activation of this plan")
                    issues.append(MoveIssue(key, (rank, index), f"{op} on rank {rank}: {why}"))
                    continue
                counts.setdefault(key, [0] * 6)[what] += 1
                first.setdefault(key, (rank, index))
    for key, (off, rel, lent, back, held, gave) in counts.items():
        rank, seg, stage, mb = key
        name = f"{seg + ':' if seg else ''}{stage} microbatch {mb}"
        if off > 1 or rel != off:
            issues.append(MoveIssue(key, first[key], f"rank {rank} offloads the activation of "
                                    f"{name} {off} times and reloads it {rel} times (each "
                                    "offload needs exactly one reload, at most one offload)"))
        if lent > 1 or back != lent or gave != held:
            issues.append(MoveIssue(key, first[key], f"rank {rank} lends the activation of "
                                    f"{name} {lent} times and gets it back {back} times, and "
                                    f"holds it for a peer {held} times and gives it back "
                                    f"{gave} times (each lend needs exactly one return, at "
                                    "most one lend)"))
    return issues[:limit]


def _moves_of(op) -> list:
    """``(column, move)`` of the activation moves of one step: an ``OFFLOAD`` (0), a
    ``RELOAD`` (1), a lend sent (2) or a return received (3), a lend received (4) or a
    return sent (5) (its payload)."""
    kind = type(op)
    if kind is Offload or kind is Reload:
        return [(int(kind is Reload), op)]
    return [((2 if t.payload.kind == LEND else 5) if type(t) is Send else
             (4 if t.payload.kind == LEND else 3), t.payload)
            for t in p2p_of(op) if t.payload.kind in RANK_MOVES]
