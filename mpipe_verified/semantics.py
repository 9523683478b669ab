"""The execution semantics of docs/semantics.md §2, shared by lowering, verifier, simulator
and executor.

This module is the single place that says
- what each op needs and produces on its rank (§2.5: ``needs``/``produces``),
- which work a plan must contain (``required_work``),
- how sends pair with receives (§2.3: FIFO per ordered rank pair, ``pair_p2p``) and how
  collectives line up (§2.4, ``pair_collectives``),
- how a plan runs (§2.1–2.4, ``execute``: rendezvous or eager, optional durations), and
- what each op allocates and frees (§2.6, ``MemoryModel`` and ``memory_trace``);

and, for plans read as integer columns (``op_table``), the same rules over the columns,
each beside the op-by-op form it must agree with: completeness (``work_complete``), FIFO
pairing (``p2p_columns``, ``p2p_clean``), the deadlock run (``comm_ticks``) and memory
moves (``memory_moves``).

Positions are ``(rank, index)`` into ``plan.programs``; a point-to-point endpoint is
``(rank, index, member)`` where ``member`` indexes a ``Group``'s ops (0 for a bare op).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, NamedTuple

import attrs

from .ir import (ACT, BACKWARD, BODY, FORWARD, GRAD, INPUT, INPUT_GRAD, NO_CUT, RECOMPUTE,
                 SINK, SOURCE, WEIGHT_GRAD, Collective, Compute, Cut, Group, Idle, Marker, Op,
                 Overlap, Payload, Plan, Placement, Recv, Send, computes_of, known_op_cells,
                 p2p_of)

RENDEZVOUS, EAGER = "rendezvous", "eager"
COMM_MODELS = (RENDEZVOUS, EAGER)


class Token(NamedTuple):
    """A value that lives on a rank: ``out`` (a stage's output activation), ``stored``
    (the activation kept for backward), ``grad`` (the input gradient a backward produced),
    ``wgrad_ready`` (an ``I`` ran, so ``W`` may run). ``needs``/``produces`` return plain
    ``(kind, segment, stage, mb)`` tuples, equal to the ``Token`` of the same fields (they
    run once per op on 10^5-op plans); wrap one in ``Token(*t)`` to read it by name."""

    kind: str
    segment: str
    stage: int
    mb: int


_TOKEN_OF_PAYLOAD = {ACT: "out", GRAD: "grad", INPUT: "input"}


def payload_token(p: Payload) -> tuple:
    """The token a transfer of ``p`` carries: what its ``SEND`` needs and its ``RECV``
    produces (``out``, ``grad`` or ``input``)."""
    return (_TOKEN_OF_PAYLOAD[p.kind], p.segment, p.stage, p.mb)


TRANSFER_TOKENS = frozenset(_TOKEN_OF_PAYLOAD.values())  # token kinds a transfer carries

PARAMS, GRADS = "params", "grads"  # collective tag roles: a segment's parameters, gradients


def collective_tag(role: str, name: str) -> str:
    """The tag of a collective over segment ``name``: ``params:NAME`` (its parameters,
    broadcast) or ``grads:NAME`` (its weight gradients, all-reduced)."""
    return f"{role}:{name}"


def collective_segment(op: Collective) -> tuple[str, str] | None:
    """``(role, segment name)`` of a collective tagged ``ROLE:NAME`` (see
    ``collective_tag``), or None when its tag names no segment."""
    role, sep, name = op.tag.partition(":")
    return (role, name) if sep else None


def needs(op: Op, num_stages: int) -> tuple[tuple, ...]:
    """Tokens that must already be on the rank before ``op`` runs (§2.5)."""
    kind = type(op)
    if kind is Compute:
        seg, s, mb = op.segment, op.stage, op.mb
        if op.kind == FORWARD:
            return (("out", seg, s - 1, mb),) if s > 0 else ()
        if op.kind == WEIGHT_GRAD:
            return (("wgrad_ready", seg, s, mb),)
        if op.kind == RECOMPUTE:
            return (("input", seg, s, mb),)
        if s < num_stages - 1:
            return (("stored", seg, s, mb), ("grad", seg, s + 1, mb))
        return (("stored", seg, s, mb),)
    if kind is Send:
        return (payload_token(op.payload),)
    if kind is Overlap or kind is Group:
        return tuple(t for c in op.ops for t in needs(c, num_stages))
    return ()


def produces(op: Op) -> tuple[tuple, ...]:
    """Tokens ``op`` leaves on its rank when it finishes. Besides the body's tokens, a
    cut segment's ``F`` also leaves its raw ``input`` with the RNG state it ran with (what
    a recompute needs: it replays those random draws; see ``MemoryModel.rng_state``), a backward
    or ``W`` leaves ``wdone`` (its weight gradient is ready for an all-reduce), and a
    ``broadcast`` tagged ``params:NAME`` leaves ``params`` of segment NAME."""
    kind = type(op)
    if kind is Compute:
        seg, s, mb = op.segment, op.stage, op.mb
        if op.kind == FORWARD:
            if seg:
                return (("out", seg, s, mb), ("stored", seg, s, mb), ("input", seg, s, mb))
            return (("out", seg, s, mb), ("stored", seg, s, mb))
        if op.kind == BACKWARD:
            return (("grad", seg, s, mb), ("wdone", seg, s, mb))
        if op.kind == INPUT_GRAD:
            return (("grad", seg, s, mb), ("wgrad_ready", seg, s, mb))
        if op.kind == WEIGHT_GRAD:
            return (("wdone", seg, s, mb),)
        return (("stored", seg, s, mb),)  # RECOMPUTE
    if kind is Recv:
        return (payload_token(op.payload),)
    if kind is Overlap or kind is Group:
        return tuple(t for c in op.ops for t in produces(c))
    if kind is Collective and op.kind == "broadcast":
        tagged = collective_segment(op)
        if tagged is not None and tagged[0] == PARAMS:
            return (("params", tagged[1], 0, 0),)
    return ()


def consumers_of_output(c: Compute, placement: Placement) -> tuple[tuple[int, Payload], ...]:
    """Remote ranks that need what ``c`` produces, with the payload to send them.
    Stages on the same rank exchange nothing (the lowering rule)."""
    to_rank, s = placement.stage_to_rank, c.stage
    if c.kind == FORWARD and s + 1 < len(to_rank):
        if to_rank[s + 1] != to_rank[s]:
            return ((to_rank[s + 1], Payload(ACT, s, c.mb, c.segment)),)
    elif (c.kind == BACKWARD or c.kind == INPUT_GRAD) and s > 0:
        if to_rank[s - 1] != to_rank[s]:
            return ((to_rank[s - 1], Payload(GRAD, s, c.mb, c.segment)),)
    return ()


class Chain:
    """The data-flow chain of a plan: the body's stages (placed by ``placement``) plus the
    segments of its ``cut``. It extends the body rules of ``needs`` and
    ``consumers_of_output`` across the cut and says where each op belongs.

    Rules at the cut (docs/semantics.md §2.5 "segment boundaries follow the same rule"): the body's
    first forward needs every source's output; a source's backward needs the gradient of
    the body's first stage; a sink's forward needs the body's last output (a sink is
    detached: nothing flows back). A forward (or recompute) of a trainable segment off
    its home rank needs the parameters broadcast from home; an all-reduce tagged
    ``grads:NAME`` needs every local weight gradient of NAME (``required_collectives``
    says which collectives the cut needs).

    A ``forward_only`` chain (an evaluation plan, declared) requires no backward and no
    recompute of any unit, stores no activation (nothing will read it back), ships no raw
    input and needs no gradient all-reduce; a segment run off its home still needs its
    parameters broadcast."""

    def __init__(self, placement: Placement, cut: Cut = NO_CUT,
                 forward_only: bool = False) -> None:
        self.placement = placement
        self.cut = cut
        self.forward_only = forward_only
        self.num_stages = placement.num_stages
        self._segments = {seg.name: seg for seg in cut.segments}
        self._sources = tuple(seg for seg in cut.segments if seg.side == SOURCE)
        self._sinks = tuple(seg for seg in cut.segments if seg.side == SINK)
        self._backward_mbs: dict | None = None
        self._destinations: dict[tuple[Compute, int], tuple] = {}

    @classmethod
    def of(cls, plan) -> "Chain":
        return cls(plan.placement, plan.cut, plan.forward_only)

    def segment(self, name: str):
        return self._segments.get(name)

    def units(self) -> list[tuple[str, int]]:
        """Every ``(segment, stage)`` whose work is required."""
        return [(BODY, s) for s in range(self.num_stages)] + [(seg.name, 0)
                                                              for seg in self.cut.segments]

    def expected_rank(self, c: Compute) -> int | None:
        """The rank that must run ``c`` (None: ``c`` is not part of this chain)."""
        if not c.segment:
            return self.placement.stage_to_rank[c.stage] if c.stage < self.num_stages else None
        seg = self._segments.get(c.segment)
        if seg is None or c.stage != 0 or c.mb >= len(seg.forward_rank):
            return None
        if c.kind == FORWARD:
            return seg.forward_rank[c.mb]
        return None if seg.backward_rank is None else seg.backward_rank[c.mb]

    def expected_backward(self, segment: str, mb: int) -> tuple[bool, bool]:
        """``(a backward is required, a recompute is required)`` for ``(segment, mb)``."""
        if self.forward_only:
            return False, False
        seg = self._segments.get(segment)
        if seg is None:
            return True, False
        return seg.trainable, seg.needs_recompute(mb)

    def needs(self, op: Op, rank: int) -> tuple[tuple, ...]:
        """``needs`` extended across the cut (see the class docstring)."""
        kind = type(op)
        if kind is Overlap or kind is Group:
            return tuple(t for c in op.ops for t in self.needs(c, rank))
        if kind is Collective:
            return self._collective_needs(op, rank)
        base = needs(op, self.num_stages)
        if kind is not Compute or not self.cut.segments:
            return base
        seg = self._segments.get(op.segment)
        if seg is None:  # a body op
            if op.kind == FORWARD and op.stage == 0:
                return base + tuple(("out", src.name, 0, op.mb) for src in self._sources)
            return base
        extra: tuple = ()
        if op.kind in (FORWARD, RECOMPUTE) and seg.trainable and rank != seg.home:
            extra = (("params", seg.name, 0, 0),)
        if op.kind == FORWARD:
            body_out = ("out", BODY, self.num_stages - 1, op.mb)
            return extra + ((body_out,) if seg.side == SINK else ())
        if op.kind in (BACKWARD, INPUT_GRAD):
            stored = ("stored", seg.name, 0, op.mb)
            return (stored, ("grad", BODY, 0, op.mb)) if seg.side == SOURCE else (stored,)
        return extra + base

    def _collective_needs(self, op: Collective, rank: int) -> tuple[tuple, ...]:
        tagged = collective_segment(op)
        if op.kind != "all_reduce" or tagged is None or tagged[0] != GRADS:
            return ()
        seg = self._segments.get(tagged[1])
        if seg is None or seg.backward_rank is None or self.forward_only:
            return ()
        if self._backward_mbs is None:  # (segment, rank) -> its backward microbatches
            self._backward_mbs = defaultdict(list)
            for s in self.cut.segments:
                for mb, r in enumerate(s.backward_rank or ()):
                    self._backward_mbs[(s.name, r)].append(mb)
        return tuple(("wdone", seg.name, 0, mb) for mb in self._backward_mbs.get((seg.name, rank),
                                                                                 ()))

    def required_collectives(self) -> dict[str, tuple[str, int | None, frozenset]]:
        """``tag -> (kind, root, ranks that must call it)``: a trainable segment whose
        forward or recompute runs off its home rank needs ``params:NAME`` broadcast from
        home to those ranks; one whose backward runs off home needs ``grads:NAME``
        all-reduced over home and every rank that runs it."""
        out = {}
        for seg in self.cut.segments:
            if seg.backward_rank is None:
                continue
            m = len(seg.forward_rank)
            uses = set(seg.forward_rank) | {seg.backward_rank[mb] for mb in range(m)
                                            if self.expected_backward(seg.name, mb)[1]}
            if uses - {seg.home}:
                out[collective_tag(PARAMS, seg.name)] = ("broadcast", seg.home,
                                                         frozenset(uses | {seg.home}))
            back = set() if self.forward_only else set(seg.backward_rank)
            if back - {seg.home}:
                out[collective_tag(GRADS, seg.name)] = ("all_reduce", None,
                                                        frozenset(back | {seg.home}))
        return out

    def destinations(self, c: Compute, here: int) -> tuple[tuple[int, Payload], ...]:
        """Remote ranks that need what ``c`` (running on ``here``) produces, with the
        payload each one receives; same-rank consumers get nothing. Computed once per
        ``(c, here)`` (timing and lowering both ask)."""
        key = (c, here)
        found = self._destinations.get(key)
        if found is None:
            found = self._destinations[key] = self._destinations_of(c, here)
        return found

    def _destinations_of(self, c: Compute, here: int) -> tuple[tuple[int, Payload], ...]:
        seg = self._segments.get(c.segment) if c.segment else None
        out: list[tuple[int, Payload]] = []
        if seg is None:
            out.extend(consumers_of_output(c, self.placement))
            if c.kind == FORWARD and c.stage == self.num_stages - 1:
                for sink in self._sinks:
                    out.append((sink.forward_rank[c.mb],
                                Payload(ACT, c.stage, c.mb, BODY, to_segment=sink.name)))
            if c.kind in (BACKWARD, INPUT_GRAD) and c.stage == 0:
                for src in self._sources:
                    if src.backward_rank is not None:
                        out.append((src.backward_rank[c.mb],
                                    Payload(GRAD, 0, c.mb, BODY, to_segment=src.name)))
        elif seg.side == SOURCE and c.kind == FORWARD:
            out.append((self.placement.stage_to_rank[0],
                        Payload(ACT, 0, c.mb, seg.name, to_segment=BODY)))
            if self.expected_backward(seg.name, c.mb)[1]:
                out.append((seg.backward_rank[c.mb], Payload(INPUT, 0, c.mb, seg.name)))
        return tuple((r, p) for r, p in out if r != here)

    def stores(self, c: Compute, rank: int) -> bool:
        """Does this forward (or recompute) keep its activation for a backward here?"""
        if self.forward_only:
            return False
        if c.kind == RECOMPUTE or not c.segment:
            return True
        seg = self._segments.get(c.segment)
        return seg is None or (seg.backward_rank is not None and c.mb < len(seg.backward_rank)
                               and seg.backward_rank[c.mb] == rank)


# ---------------------------------------------------------------- completeness


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
                if (c.segment, c.stage) not in units or c.mb >= m:
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
    if len(units) * m > work:  # never enumerate microbatches the plan cannot hold
        return WorkTable(counts, first, tuple(stray), misplaced, short=True)
    for seg, stage in chain.units():
        for mb in range(m):
            if (seg, stage, mb) not in counts:
                counts[(seg, stage, mb)] = [0] * (MISPLACED + 1)
    return WorkTable(counts, first, tuple(stray), misplaced)


def _first_missing(chain: Chain, table: WorkTable, m: int) -> Compute:
    """A unit with no forward, in time linear in the units present."""
    for seg, stage in chain.units():
        mb = next(mb for mb in range(m + 1) if (seg, stage, mb) not in table.counts
                  or table.counts[(seg, stage, mb)][0] == 0)
        if mb < m:
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
                                            f"at least {units * m} forwards; {f} (forward) "
                                            "never runs")]
    issues = [WorkIssue(c, "unexpected", (rank, index),
                        f"{c} is not part of this plan (stages, segments and microbatches "
                        f"0..{plan.num_microbatches - 1})") for c, rank, index in table.stray]
    for (seg, s, mb), row in sorted(table.counts.items()):
        if limit is not None and len(issues) >= limit:
            break
        need_back, need_r = chain.expected_backward(seg, mb)
        if not unit_ok(row, need_back, need_r):
            issues.extend(_unit_issues(chain, table, seg, s, mb, row, need_back, need_r))
    return issues[:limit] if limit is not None else issues


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
    distinct count row). False when anything is missing, repeated, misplaced or stray, or
    the cut requires a collective (a table's plan has none): op by op then says what."""
    import numpy as np
    plan = table.plan
    s, m = chain.num_stages, plan.num_microbatches
    units = set(chain.units())
    kinds = np.full(len(table.classes), -1, dtype=np.int64)  # work kind column, or -1
    stages = np.zeros(len(table.classes), dtype=np.int64)
    for c, (rank, op, _) in enumerate(table.classes):
        for one in computes_of(op):  # a table's compute steps are single ops
            if (one.segment, one.stage) not in units or \
                    chain.expected_rank(one) != rank:
                return False  # stray or misplaced: op by op says which
            kinds[c], stages[c] = WORK_KINDS.index(one.kind), one.stage
    if chain.required_collectives():
        return False
    work = kinds[table.cls] >= 0
    mb, kind, stage = table.mb[work], kinds[table.cls][work], stages[table.cls][work]
    if s * m > len(mb) or (len(mb) and int(mb.max()) >= m):
        return False  # a unit without work (never enumerated: m may be huge), or stray
    width = len(WORK_KINDS)
    present, at = np.unique(stage * m + mb, return_inverse=True)
    if len(present) != s * m:
        return False
    rows = np.zeros((s * m, width), dtype=np.int64)
    np.add.at(rows, (at.reshape(-1), kind), 1)
    due = np.array([chain.expected_backward(BODY, mb) for mb in range(m)],
                   dtype=np.int64).reshape(m, 2)
    cases = np.concatenate([rows, np.tile(due, (s, 1))], axis=1)
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


def collective_issues(plan: Plan, limit: int | None = None) -> list[CollectiveIssue]:
    """The collectives of ``Chain.required_collectives``: every call tagged
    ``params:NAME``/``grads:NAME`` is one the cut requires, of its kind and root, over
    members that include every rank that must call it; each such rank calls it exactly
    once, any other member at most once. At most ``limit`` issues."""
    required = Chain.of(plan).required_collectives()
    calls: dict[tuple[str, int], list[int]] = defaultdict(list)
    issues = []
    for rank, program in enumerate(plan.programs):
        for index, op in enumerate(program):
            tagged = collective_segment(op) if type(op) is Collective else None
            if tagged is None or tagged[0] not in (PARAMS, GRADS):
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
    if role == GRADS:
        return (f"rank {rank} never all-reduces the gradients of segment {name!r} ({kind} "
                f"{tag}): every rank that runs its backward and its home rank must take part")
    return (f"rank {rank} never receives the parameters of segment {name!r} ({kind} {tag} "
            f"from rank {root}) but runs it")


# ---------------------------------------------------------------- matching


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
    """Pair the k-th send ``src→dst`` with the k-th receive at ``dst`` from ``src``."""
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
    instance_of: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
    members: dict[tuple[tuple[int, ...], int], dict[int, int]] = defaultdict(dict)
    count: dict[tuple[tuple[int, ...], int], int] = defaultdict(int)
    problems: list[tuple[tuple[int, int], str]] = []
    for rank, program in enumerate(plan.programs):
        for index, op in enumerate(program):
            if not isinstance(op, Collective):
                continue
            group = tuple(sorted(set(op.ranks)))
            malformed = _malformed(op, rank, index, plan.num_ranks)
            if malformed:
                problems.append((((rank, index),), malformed))
            k = count[(group, rank)]
            count[(group, rank)] += 1
            members[(group, k)][rank] = index
            if rank in group:
                instance_of[(rank, index)] = (group, k)
    for (group, k), where in members.items():
        ops = {r: plan.programs[r][i] for r, i in where.items()}
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


# ---------------------------------------------------------------- execution


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


@attrs.frozen
class Wait:
    """Rank ``rank`` is stuck at ``index`` waiting for ``on`` (a position on another rank,
    or None when nothing can ever arrive)."""

    rank: int
    index: int
    on: tuple[int, int] | None
    reason: str


@attrs.frozen
class Execution:
    """Result of running a plan. ``start``/``finish`` give each executed op's times
    (per rank, aligned with the program); a stuck rank's list stops at its blocked op.
    ``waits`` holds one entry per rank that did not finish."""

    start: tuple[tuple[float, ...], ...]
    finish: tuple[tuple[float, ...], ...]
    waits: tuple[Wait, ...]

    @property
    def completed(self) -> bool:
        return not self.waits

    @property
    def makespan(self) -> float:
        return max((f[-1] for f in self.finish if f), default=0.0)


def unit_duration(op: Op) -> float:
    """One step for a compute op, zero for comm and bookkeeping."""
    return float(len(computes_of(op)) > 0)


def execute(plan: Plan, comm_model: str = RENDEZVOUS,
            duration: Callable[[Op], float] = unit_duration,
            comm_time: Callable[[Op], float] = lambda op: 0.0,
            p2p: P2PPairing | None = None,
            collectives: CollectivePairing | None = None) -> Execution:
    """Run ``plan`` under §2.1–2.4 and return every op's start/finish time.

    Each rank runs its ops in order. A compute op takes ``duration(op)``. Under
    ``rendezvous`` a send or receive completes when both ends are posted, at the later
    post time plus ``comm_time``; a ``Group`` posts all members at once and completes
    when all have matched; a collective completes when every member has reached it.
    Under ``eager`` a send completes at once and a receive when its send has been posted.
    Ops with no partner block forever. Runs in time linear in the plan size.
    """
    p2p = p2p or pair_p2p(plan)
    collectives = collectives or pair_collectives(plan)
    n = plan.num_ranks
    programs = plan.programs
    start: list[list[float]] = [[] for _ in range(n)]
    finish: list[list[float]] = [[] for _ in range(n)]
    posted = [[None] * len(prog) for prog in programs]  # post time of each comm step
    peer = [[None] * len(prog) for prog in programs]  # a bare send/recv's partner position
    for (r, i, member), other in p2p.partner.items():
        if member == 0 and type(programs[r][i]) is not Group:
            peer[r][i] = other[:2]
    ready = [0.0] * n  # time each rank becomes free
    blocked: dict[int, tuple[int, int] | None] = {}
    waiters: list[dict[int, list[int]]] = [{} for _ in range(n)]  # rank -> pos -> ranks
    todo = list(range(n))

    eager = comm_model == EAGER
    while todo:
        rank = todo.pop()
        blocked.pop(rank, None)
        program, st, fi = programs[rank], start[rank], finish[rank]
        posts, peers, mine = posted[rank], peer[rank], waiters[rank]
        t0, index, end = ready[rank], len(st), len(program)
        while index < end:
            op = program[index]
            kind = type(op)
            if kind is Send or kind is Recv:  # the common case, inlined
                posts[index] = t0
                if mine:
                    todo.extend(mine.pop(index, ()))
                other = peers[index]
                if eager and kind is Send:  # buffered: never blocks, partner or not
                    done = t0
                elif other is None:
                    blocked[rank] = None
                    break
                else:
                    done = posted[other[0]][other[1]]
                    if done is None:
                        blocked[rank] = other
                        waiters[other[0]].setdefault(other[1], []).append(rank)
                        break
                t1 = (t0 if t0 > done else done) + comm_time(op)
            elif kind is Group or kind is Collective:
                posts[index] = t0
                if mine:
                    todo.extend(mine.pop(index, ()))
                done = _comm_completion(rank, index, op, comm_model, posted, p2p, collectives)
                if isinstance(done, tuple):  # waiting on that position
                    blocked[rank] = done if done[0] >= 0 else None
                    if done[0] >= 0:
                        waiters[done[0]].setdefault(done[1], []).append(rank)
                    break
                t1 = max(t0, done) + comm_time(op)
            else:
                t1 = t0 + duration(op)
            st.append(t0)
            fi.append(t1)
            t0 = t1
            index += 1
        ready[rank] = t0
    waits = tuple(_describe_wait(plan, r, len(start[r]), blocked.get(r), collectives)
                  for r in range(n) if len(start[r]) < len(programs[r]))
    return Execution(tuple(map(tuple, start)), tuple(map(tuple, finish)), waits)


_NEVER = (-1, -1)


def _comm_completion(rank, index, op, comm_model, posted, p2p, collectives):
    """The time ``op`` (posted at ``(rank, index)``) can complete, or the position it waits
    on (``_NEVER`` when no partner exists)."""
    if isinstance(op, Collective):
        key = collectives.instance_of.get((rank, index))
        if key is None:
            return _NEVER
        group, _ = key
        where = collectives.members[key]
        times = []
        for r in group:
            if r not in where:
                return _NEVER
            t = posted[r][where[r]]
            if t is None:
                return (r, where[r])
            times.append(t)
        return max(times)
    times = [posted[rank][index]]
    for member, c in enumerate(p2p_of(op)):
        if comm_model == EAGER and isinstance(c, Send):
            continue  # buffered: never blocks, partner or not
        other = p2p.partner.get((rank, index, member))
        if other is None:
            return _NEVER
        t = posted[other[0]][other[1]]
        if t is None:
            return other[:2]
        times.append(t)
    return max(times)


def _describe_wait(plan, rank, index, on, collectives: CollectivePairing) -> Wait:
    op = plan.programs[rank][index]
    if on is None and type(op) is Collective:
        return Wait(rank, index, None, _collective_never(op, rank, index, collectives))
    if on is None:
        return Wait(rank, index, None, f"{op} has no matching partner: it waits forever")
    return Wait(rank, index, on, f"{op} waits for rank {on[0]} to reach position {on[1]} "
                                 f"({plan.programs[on[0]][on[1]]})")


def _collective_never(op: Collective, rank: int, index: int,
                      collectives: CollectivePairing) -> str:
    """Why a collective call can never complete: its caller is not a member, or some
    member never makes the same call (its instance, ``pair_collectives``)."""
    if (rank, index) not in collectives.instance_of:
        return f"{op} never completes: rank {rank} is not one of its members"
    group, k = collectives.instance_of[(rank, index)]
    absent = [r for r in group if r not in collectives.members[(group, k)]]
    who = f"rank {absent[0]} never makes" if len(absent) == 1 else f"ranks {absent} never make"
    return f"{op} waits forever: {who} call #{k} over ranks {list(group)}"


def wait_cycle(execution: Execution) -> list[Wait]:
    """The wait-for cycle among stuck ranks (each stuck rank waits on exactly one
    position; following those edges from any rank that waits on a stuck rank ends in a
    cycle). Empty when the stuck ranks only wait on missing partners."""
    by_rank = {w.rank: w for w in execution.waits}
    for w in execution.waits:
        path: list[Wait] = []
        seen: dict[int, int] = {}
        cur = w
        while cur is not None and cur.rank not in seen:
            seen[cur.rank] = len(path)
            path.append(cur)
            cur = by_rank.get(cur.on[0]) if cur.on is not None else None
        if cur is not None:
            return path[seen[cur.rank]:]
    return []


# ---------------------------------------------------------------- memory


def _no_buffer(payload: Payload) -> float:
    return 0.0


@attrs.frozen
class MemoryModel:
    """§2.6. ``stored(stage, segment)`` is what an ``F`` keeps for its backward (freed by
    ``B``, or by ``W`` when split); ``buffer(payload)`` is a receive buffer, freed when the
    consuming op finishes; ``static[rank]`` is the fixed part. ``rng_state`` is the RNG
    state a shipped raw input carries (its recompute replays the forward's random draws):
    an ``input`` payload's receive buffer is ``buffer(payload) + rng_state``. Default: the
    unit model (buffers and RNG states free)."""

    stored: Callable[[int, str], float] = lambda stage, segment: 1.0
    buffer: Callable[[Payload], float] = _no_buffer
    static: tuple[float, ...] = ()
    rng_state: float = 0.0

    @property
    def buffers_free(self) -> bool:
        """Whether ``buffer`` is the default, which makes every receive buffer free (a
        function of its own is not inspected, even one that always returns 0)."""
        return self.buffer is _no_buffer

    def static_of(self, rank: int) -> float:
        return self.static[rank] if rank < len(self.static) else 0.0

    def received(self, payload: Payload) -> float:
        """The receive buffer of ``payload``: ``buffer(payload)``, plus ``rng_state`` for a
        shipped raw input."""
        return self.buffer(payload) + (self.rng_state if payload.kind == INPUT else 0.0)


UNIT_MEMORY = MemoryModel()


def memory_steps(plan: Plan, rank: int, model: MemoryModel = UNIT_MEMORY,
                 live_at: int | None = None, exact: Callable | None = None
                 ) -> tuple[list[tuple[float, float]], list]:
    """Per op of ``rank``: ``(allocated, freed)``. A step's allocations count before its
    frees, so its peak is ``before + allocated``. With ``live_at``, also the tensors live
    at that step's peak as ``(description, size)``. With ``exact``, every size is
    ``exact(size)`` before it is summed (exact rationals, not float sums)."""
    live: dict[object, tuple[str, float]] = {}
    steps: list[tuple[float, float]] = []
    snapshot: list = []
    chain = Chain.of(plan)
    stored, buffer = model.stored, model.received
    if exact is not None:
        stored, buffer = (lambda s, seg: exact(model.stored(s, seg))), (
            lambda p: exact(model.received(p)))
    for index, op in enumerate(plan.programs[rank]):
        kind = type(op)
        if kind is Send or kind is Idle or kind is Marker or kind is Collective:
            steps.append((0.0, 0.0))  # allocates and frees nothing
            if index == live_at:
                snapshot = [(f"{what} {x}", size) for what, x, size in live.values()]
            continue
        allocs, frees = step_effects(op, rank, chain, stored, buffer)
        alloc = 0.0 if exact is None else 0
        for key, entry in allocs:
            live[key] = entry
            alloc += entry[2]
        if index == live_at:  # described only when asked: formatting every op is costly
            snapshot = [(f"{what} {op}", size) for what, op, size in live.values()]
        freed = sum(live.pop(key)[2] for key in frees if key in live)
        steps.append((alloc, freed))
    return steps, snapshot


def step_effects(op: Op, rank: int, chain: Chain, stored: Callable, buffer: Callable
                 ) -> tuple[list, list]:
    """What one step of ``rank`` allocates and frees (§2.6): ``(allocs, frees)``, each
    alloc ``(key, (what, item, size))`` (it becomes what is live under that key; the
    allocations count before the frees), each free a key (it frees what is live under
    that key, if anything). ``stored(stage, segment)`` and ``buffer(payload)`` give the
    sizes. A forward (or recompute) keeps its activation where the chain says so; ``B`` or
    ``W`` frees it; a receive allocates its buffer (none of size 0), which the op
    consuming its token frees."""
    allocs, frees = [], []
    for c in computes_of(op):
        if c.kind in (FORWARD, RECOMPUTE):
            if chain.stores(c, rank):
                size = stored(c.stage, c.segment)
                allocs.append((("stored", c.segment, c.stage, c.mb), ("activation of", c, size)))
        elif c.kind in (BACKWARD, WEIGHT_GRAD):
            frees.append(("stored", c.segment, c.stage, c.mb))
        # a receive buffer is freed by the op that consumes its token (§2.6)
        frees.extend(("buffer", t) for t in chain.needs(c, rank) if t[0] in TRANSFER_TOKENS)
    for r in p2p_of(op):
        if isinstance(r, Recv):
            size = buffer(r.payload)
            if size:
                allocs.append((("buffer", payload_token(r.payload)), ("receive buffer of", r, size)))
    return allocs, frees


BIG = 2**52  # integer sizes summed below this are exact as floats too


def memory_moves(table: OpTable, model: MemoryModel, extra=()) -> tuple | None:
    """``memory_steps`` of every rank by columns: per op of the table, what it allocates
    and what it frees, as integer arrays. ``step_effects`` is evaluated per op class
    (``rule_columns``); allocations count before frees, and a free releases what the
    latest allocation under its key left live, as ``memory_steps`` keeps ``live``. None
    when receive buffers are not free (their size may depend on more than an op's
    class), a size or a number of ``extra`` (the static parts and limits the sums will
    meet) is not an integer, they could sum beyond ``BIG`` (where float sums stop being
    exact), or the table cannot state the rules."""
    if not model.buffers_free:
        return None
    chain = Chain.of(table.plan)

    def effects(rank, op):
        return step_effects(op, rank, chain, model.stored, model.received)
    allocs = table.rule_columns(lambda rank, op: [(entry[2],) + _flat(key) for key, entry
                                                  in effects(rank, op)[0]])
    frees = table.rule_columns(lambda rank, op: [_flat(key) for key in effects(rank, op)[1]])
    if allocs is None or frees is None:
        return None
    sizes = [name[0] for name in allocs[3]] + list(extra)
    if not all(integral(x) for x in sizes) or \
            sum(abs(int(x)) for x in sizes) * (table.plan.num_ops + 1) >= BIG:
        return None
    return _released(table, allocs, frees)


def _flat(key: tuple) -> tuple:
    """A memory key with its microbatch last: ``("stored", seg, stage, mb)`` as it is,
    ``("buffer", token)`` as ``("buffer", *token)``."""
    return key if key[0] != "buffer" else ("buffer",) + key[1]


def integral(x) -> bool:
    """An int, or a finite float with an integer value."""
    return isinstance(x, (int, float)) and math.isfinite(x) and float(x).is_integer()


def _released(table: OpTable, allocs, frees) -> tuple:
    """Per op: what it allocates and what it frees (integers), from ``rule_columns`` of
    the allocations (size first) and the frees."""
    import numpy as np
    a_row, a_tok, a_shift, a_names = allocs
    f_row, f_tok, f_shift, f_names = frees
    names: dict = {}
    for name in a_names:
        names.setdefault(name[1:], len(names))
    a_name = np.array([names[name[1:]] for name in a_names] or [0], dtype=np.int64)
    f_name = np.array([names.get(name, -1) for name in f_names] or [0], dtype=np.int64)
    a_size = np.array([int(name[0]) for name in a_names] or [0], dtype=np.int64)
    # the events of each step, allocations (phase 0) before frees (phase 1), ordered by
    # rank, key and microbatch: a free releases the size of the event just before it on
    # its key if that is an allocation (what it left live), else nothing
    rows = np.concatenate([a_row, f_row])
    name = np.concatenate([a_name[a_tok], f_name[f_tok]])
    mb = table.mb[rows] + np.concatenate([a_shift, f_shift])
    phase = np.concatenate([np.zeros(len(a_row), np.int64), np.ones(len(f_row), np.int64)])
    size = np.concatenate([a_size[a_tok], np.zeros(len(f_row), np.int64)])
    rank = table.rank[rows]
    order = np.lexsort((phase, rows, mb, name, rank))
    rows, name, mb, phase, size, rank = (x[order] for x in (rows, name, mb, phase, size, rank))
    hit = np.zeros(len(rows), dtype=bool)
    hit[1:] = (phase[1:] == 1) & (name[1:] >= 0) & (phase[:-1] == 0) & (
        name[1:] == name[:-1]) & (mb[1:] == mb[:-1]) & (rank[1:] == rank[:-1])
    released = np.zeros(len(rows), dtype=np.int64)
    released[1:] = np.where(hit[1:], size[:-1], 0)
    n = len(table.cls)
    alloc = np.bincount(rows, weights=size, minlength=n).astype(np.int64) if len(rows) \
        else np.zeros(n, np.int64)
    freed = np.bincount(rows, weights=released, minlength=n).astype(np.int64) if len(rows) \
        else np.zeros(n, np.int64)
    return alloc, freed


def memory_levels(plan: Plan, rank: int, model: MemoryModel = UNIT_MEMORY):
    """Per step of ``rank``: ``(before, allocated, freed, after)``, starting from the
    static part; the step's peak is ``before + allocated`` (allocations count before
    frees). Numbers are summed as the model gives them (a step that moves nothing keeps
    ``before`` as it is)."""
    level = model.static_of(rank)
    for alloc, freed in memory_steps(plan, rank, model)[0]:
        after = level + (alloc - freed) if alloc or freed else level
        yield level, alloc, freed, after
        level = after


def memory_trace(plan: Plan, rank: int, model: MemoryModel = UNIT_MEMORY) -> list[float]:
    """Each step's peak level on ``rank`` (static part included)."""
    return [before + alloc for before, alloc, _, _ in memory_levels(plan, rank, model)]


def live_tensors(plan: Plan, rank: int, index: int, model: MemoryModel = UNIT_MEMORY
                 ) -> list[tuple[str, float]]:
    """The tensors live on ``rank`` at the peak of step ``index``."""
    return memory_steps(plan, rank, model, live_at=index)[1]


def peak_memory(plan: Plan, model: MemoryModel = UNIT_MEMORY) -> dict[int, tuple[float, int]]:
    """Per rank: ``(peak, index of the step where it is first reached)`` (-1 if empty)."""
    out = {}
    for rank in range(plan.num_ranks):
        levels = memory_trace(plan, rank, model)
        if not levels:
            out[rank] = (model.static_of(rank), -1)
            continue
        peak = max(levels)
        out[rank] = (peak, levels.index(peak))
    return out


# ---------------------------------------------------------------- compute-only timing


STANDARD_DURATIONS = {FORWARD: 1.0, BACKWARD: 2.0, INPUT_GRAD: 1.0, WEIGHT_GRAD: 1.0,
                      RECOMPUTE: 1.0}


def standard_duration(op: Op) -> float:
    """Unit cost model: ``F`` 1, ``B`` 2, ``I`` 1, ``W`` 1, ``R`` 1; an overlapped step
    costs the sum of its ops; everything else is free."""
    return sum(STANDARD_DURATIONS[c.kind] for c in computes_of(op))


@attrs.frozen
class ScheduleTiming:
    """Times of a compute-only schedule whose transfers are implicit: an op starts when
    its rank is free and its inputs have arrived (``delay`` after they were produced).
    ``start[r]`` covers the ops that could run; ``stuck`` names each rank that could not
    finish, its op index and the token it waits for."""

    start: tuple[tuple[float, ...], ...]
    finish: tuple[tuple[float, ...], ...]
    stuck: tuple[tuple[int, int, Token], ...]

    @property
    def makespan(self) -> float:
        return max((f[-1] for f in self.finish if f), default=0.0)


def schedule_times(programs, placement: Placement,
                   duration: Callable[[Op], float] = standard_duration,
                   delay: float = 0.0, cut: Cut = NO_CUT,
                   forward_only: bool = False, chain: "Chain | None" = None) -> ScheduleTiming:
    """Data-flow timing of compute-only programs (§2.5 inputs across the chain, implicit
    transfers). Linear time: each rank advances until an input is missing, then waits.
    Collectives in a compute-only schedule are timed as zero-cost barriers: they finish
    when every member has reached them. ``chain``: the programs' chain when the caller
    has one (its ``destinations`` are then computed once for both)."""
    chain = chain or Chain(placement, cut, forward_only)
    n = placement.num_ranks
    have: list[dict[tuple, float]] = [dict() for _ in range(n)]
    start: list[list[float]] = [[] for _ in range(n)]
    finish: list[list[float]] = [[] for _ in range(n)]
    waiting: dict[tuple[int, tuple], int] = {}
    barriers: dict[tuple, dict[int, float]] = {}
    counts: list[dict] = [dict() for _ in range(n)]
    todo = list(range(n))
    while todo:
        rank = todo.pop()
        program, here, starts, finishes = programs[rank], have[rank], start[rank], finish[rank]
        free = finishes[-1] if finishes else 0.0
        while len(starts) < len(program):
            op = program[len(starts)]
            t0, missing = _ready_at(chain.needs(op, rank), here, free)
            collective = type(op) is Collective
            if collective and missing is None:
                missing = _barrier_wait(op, rank, free, barriers, counts[rank], have)
                if missing is None:
                    t0 = max(t0, here[_barrier_token(op, counts[rank])])
                    counts[rank][_group_key(op)] = counts[rank].get(_group_key(op), 0) + 1
            if missing is not None:
                waiting[(rank, missing)] = rank
                break
            free = t0 + duration(op)
            starts.append(t0)
            finishes.append(free)
            for token in produces(op):
                here.setdefault(token, free)
            for c in computes_of(op):
                for there, payload in chain.destinations(c, rank):
                    token = payload_token(payload)
                    have[there].setdefault(token, free + delay)
                    if waiting.pop((there, token), None) is not None:
                        todo.append(there)
            for member in (op.ranks if collective else ()):
                if waiting.pop((member, _barrier_token(op, counts[member])), None) is not None:
                    todo.append(member)
    stuck = tuple((r, len(start[r]), Token(*tok)) for (r, tok) in waiting
                  if len(start[r]) < len(programs[r]))
    return ScheduleTiming(tuple(map(tuple, start)), tuple(map(tuple, finish)),
                          tuple(sorted(stuck)))


def _ready_at(wanted, have: dict, free: float) -> tuple[float, tuple | None]:
    """``(when every token of wanted is there and the rank is free, None)``, or ``(_, the
    first missing token)``."""
    t0 = free
    for token in wanted:
        at = have.get(token)
        if at is None:
            return t0, token
        if at > t0:
            t0 = at
    return t0, None


def _group_key(op: Collective) -> tuple:
    return tuple(sorted(op.ranks))


def _barrier_token(op: Collective, seen: dict) -> tuple:
    """The token meaning "every member reached this rank's k-th collective on the group"."""
    return ("barrier", ",".join(map(str, _group_key(op))), seen.get(_group_key(op), 0), 0)


def _barrier_wait(op, rank, free, barriers, seen, have) -> tuple | None:
    """Record that ``rank`` reached its next collective on the group; once all members
    have, publish the barrier token to every member. Returns the token still missing
    (None: the barrier is passed)."""
    token = _barrier_token(op, seen)
    arrived = barriers.setdefault(token, {})
    arrived[rank] = free
    if len(arrived) == len(op.ranks):
        at = max(arrived.values())
        for member in op.ranks:
            have[member].setdefault(token, at)
    return None if token in have[rank] else token


# ---------------------------------------------------------------- columns


@attrs.frozen(eq=False)
class OpTable:
    """The ops of a plan as integer columns, for passes that treat all microbatches of
    an op class at once. Op ``j`` is ``plan.programs[rank[j]][index[j]]`` (rank-major,
    in program order); ``cls[j]`` indexes ``classes`` (each class's rank, first and last
    op), and ``mb[j]`` is the op's microbatch (a transfer's: its payload's). The ops of a
    class differ only in their microbatch.

    The rules are not restated here: ``rule_columns`` applies ``Chain.needs``,
    ``produces`` or ``step_effects`` as evaluated on each class's ops, shifted by each
    op's microbatch. Only plans whose rules are the same for every microbatch of a class
    get a table (``op_table``): no cut, and only compute, send, receive, idle and marker
    steps."""

    plan: Plan
    rank: object  # numpy int64 arrays, one entry per op
    index: object
    cls: object
    mb: object
    classes: tuple  # (rank, first op, last op) per class
    counts: tuple[int, ...]  # ops per rank

    def rule_columns(self, rule: Callable[[int, Op], list]):
        """``(row, token, shift, names)`` for ``rule(rank, op)``'s tokens (tuples whose
        last item is a microbatch) of every op, in op order then ``rule``'s order: op
        ``row``'s token is ``names[token]`` followed by microbatch ``mb[row] + shift``.
        None when some class's first and last op disagree once shifted."""
        import numpy as np
        tokens: dict[tuple, int] = {}
        per_class = []
        for rank, first, last in self.classes:
            rel = _relative(rule(rank, first), _mb_of(first), tokens)
            if last is not first and rel != _relative(rule(rank, last), _mb_of(last), tokens):
                return None
            per_class.append(rel)
        n = np.array([len(r) for r in per_class], dtype=np.int64)
        width = max(1, int(n.max(initial=0)))
        tid = np.zeros((len(per_class), width), dtype=np.int64)
        off = np.zeros((len(per_class), width), dtype=np.int64)
        for c, rel in enumerate(per_class):
            for k, (t, d) in enumerate(rel):
                tid[c, k], off[c, k] = t, d
        per_op = n[self.cls]
        row = np.repeat(np.arange(len(self.cls), dtype=np.int64), per_op)
        slot = np.arange(len(row), dtype=np.int64) - np.repeat(np.cumsum(per_op) - per_op,
                                                               per_op)
        c = self.cls[row]
        return row, tid[c, slot], off[c, slot], tuple(tokens)


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
    partner = np.full(len(rows), -1, dtype=np.int64)
    ok = peer < n  # a peer that is no rank never meets anything
    ends = [np.flatnonzero(ok & send), np.flatnonzero(ok & ~send)]  # sends, receives
    channel = [here[ends[0]] * n + peer[ends[0]], peer[ends[1]] * n + here[ends[1]]]
    width = n * n
    if width > 4 * len(rows):  # few transfers between many ranks: number the channels used
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
    return P2PColumns(rows, send, partner)


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


def comm_ticks(table: OpTable, comm_model: str = RENDEZVOUS,
               pairs: P2PColumns | None = None) -> tuple | None:
    """``execute(plan, comm_model, duration=0, comm_time=1)`` on the table's plan, by
    columns: per rank, the finish time of each comm step, or None when the run gets stuck
    (``execute`` then says where). Compute, idle and marker steps take no time, so each
    comm step is posted when the one before it on its rank finishes (at 0 first); a
    blocking end (both ends under rendezvous, the receive under eager) finishes a tick
    after the later of its own post and its partner's, an eager send a tick after its
    post, and an end without a partner never. Ranks advance until they block, as in
    ``execute``: linear time, one visit per comm step and per wake-up."""
    import numpy as np
    pairs = pairs or p2p_columns(table)
    n = table.plan.num_ranks
    bounds = np.searchsorted(table.rank[pairs.rows], np.arange(n + 1)).tolist()
    wait = pairs.partner  # the end each end waits for (-1: none, forever; -2: nothing)
    if comm_model == EAGER:
        wait = np.where(pairs.send, -2, wait)
    wait = wait.tolist()
    posted = [-1] * len(wait)  # -1: not posted yet
    waiter = [-1] * len(wait)  # the rank waiting for this end to be posted
    fin = [0] * len(wait)
    at, ready = bounds[:-1], [0] * n
    todo = list(range(n))
    while todo:
        rank = todo.pop()
        k, end, t = at[rank], bounds[rank + 1], ready[rank]
        while k < end:
            posted[k] = t
            if waiter[k] >= 0:
                todo.append(waiter[k])
                waiter[k] = -1
            other = wait[k]
            if other >= 0:
                seen = posted[other]
                if seen < 0:
                    waiter[other] = rank
                    break
                if seen > t:
                    t = seen
            elif other == -1:
                break
            t += 1
            fin[k] = t
            k += 1
        at[rank], ready[rank] = k, t
    if at != bounds[1:]:
        return None
    return tuple(tuple(fin[bounds[r]:bounds[r + 1]]) for r in range(n))


def _mb_of(op: Op) -> int:
    """The microbatch ``op_table`` records for ``op`` (0 for idle and marker steps)."""
    kind = type(op)
    if kind is Compute:
        return op.mb
    return op.payload.mb if kind is Send or kind is Recv else 0


def _relative(tokens, mb: int, ids: dict) -> tuple:
    """``tokens`` (each ending in its microbatch) as ``(id of the rest, microbatch - mb)``."""
    out = []
    for t in tokens:
        key = t[:-1]
        if key not in ids:
            ids[key] = len(ids)
        out.append((ids[key], t[-1] - mb))
    return tuple(out)


def op_table(plan: Plan) -> OpTable | None:
    """The plan's ``OpTable``, or None for a plan with a cut, groups, overlaps or
    collectives (their rules depend on more than an op's class). A plan that a bulk
    reader built is classed by what it recorded (``ir.known_op_cells``), any other op by
    op."""
    import numpy as np
    if plan.cut.segments:
        return None
    cells = known_op_cells(plan)
    if cells is not None:
        return _table_of(plan, *_classes_of_cells(plan, *cells))
    keys: dict[tuple, int] = {}
    cls: list[int] = []
    mbs: list[int] = []
    add_cls, add_mb, number = cls.append, mbs.append, keys.setdefault
    for rank, program in enumerate(plan.programs):
        for op in program:
            kind = type(op)
            if kind is Compute:
                key = (rank, op.kind, op.stage, op.segment)
                add_mb(op.mb)
            elif kind is Send or kind is Recv:  # the peer read as a field (a property)
                p = op.payload
                key = (rank, kind, op.dst if kind is Send else op.src, p.kind, p.stage,
                       p.segment, p.to_segment, p.shape, p.dtype, p.leaves)
                add_mb(p.mb)
            elif kind is Idle or kind is Marker:
                key = (rank, kind)
                add_mb(0)
            else:
                return None
            add_cls(number(key, len(keys)))
    return _table_of(plan, np.array(cls, dtype=np.int64), np.array(mbs, dtype=np.int64))


def _classes_of_cells(plan: Plan, kind, stage, mb) -> tuple:
    """``(cls, mb)`` of ops recorded as ``ir.remember_op_cells`` describes: an op's class
    is its rank, kind and stage (idle steps, and markers, one class per rank), numbered
    in order of first appearance, as the op-by-op path numbers them."""
    import numpy as np
    counts = [len(program) for program in plan.programs]
    rank = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    kind, stage = kind.astype(np.int64), stage.astype(np.int64)
    key = (rank * (int(kind.max(initial=0)) + 3) + kind + 2) * (
        int(stage.max(initial=0)) + 1) + np.where(kind >= 0, stage, 0)
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    renumber = np.empty(len(first), np.int64)
    renumber[np.argsort(first, kind="stable")] = np.arange(len(first))
    return renumber[which.reshape(-1)], mb.astype(np.int64)


def _table_of(plan: Plan, cls_col, mbs) -> OpTable:
    """The ``OpTable`` of ``plan`` whose ops have the classes ``cls_col`` (numbered in
    order of first appearance) and microbatches ``mbs``."""
    import numpy as np
    counts = [len(program) for program in plan.programs]
    ranks = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    index = np.arange(len(cls_col), dtype=np.int64) - np.repeat(
        np.cumsum(counts, dtype=np.int64) - counts, counts)
    n = int(cls_col.max()) + 1 if len(cls_col) else 0
    first, last = np.full(n, len(cls_col), dtype=np.int64), np.zeros(n, dtype=np.int64)
    rows = np.arange(len(cls_col), dtype=np.int64)
    np.minimum.at(first, cls_col, rows)
    np.maximum.at(last, cls_col, rows)
    op = lambda j: plan.programs[int(ranks[j])][int(index[j])]  # noqa: E731
    classes = tuple((int(ranks[a]), op(a), op(b)) for a, b in zip(first.tolist(),
                                                                   last.tolist()))
    return OpTable(plan, ranks, index, cls_col, mbs, classes, tuple(counts))
