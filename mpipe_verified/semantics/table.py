"""The flat-array form of a plan (``OpTable``): its ops as integer columns, with the ops
that differ only in their microbatch grouped in classes, so that a rule of ``rules`` is
evaluated once per class (``OpTable.rule_columns``) and applied to every op by columns.
The column forms of the other modules (``work_complete``, ``p2p_columns``, the column run
of ``comm_ticks``, ``memory_moves``) read a plan through it.
"""

from __future__ import annotations

from typing import Callable

import attrs

from ..ir import (RANK_MOVES, Collective, Compute, Idle, Marker, Op, Overlap, Plan, Recv, Send,
                  known_op_cells)


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
    get a table (``op_table``): no cut, and only compute, overlapped, send, receive,
    collective, idle and marker steps; with sequence chunks a class also keeps to one
    place in the sample (first chunk, last chunk or neither), and no step overlaps. An
    overlapped step's microbatch is its first op's, and its class fixes how far each of
    its ops' microbatches lies from that one; a collective's is 0, its class the whole
    call."""

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
        flat = np.array([t for rel in per_class for t in rel], dtype=np.int64).reshape(-1, 2)
        per_op = n[self.cls]
        row = np.repeat(np.arange(len(self.cls), dtype=np.int64), per_op)
        slot = np.arange(len(row), dtype=np.int64) - np.repeat(np.cumsum(per_op) - per_op,
                                                               per_op)
        at = (np.cumsum(n) - n)[self.cls[row]] + slot  # the class's token in ``flat``
        return row, flat[at, 0], flat[at, 1], tuple(tokens)

    def call_rows(self):
        """The rows of the collective steps (numpy, rank-major in program order)."""
        import numpy as np
        coll = np.array([type(op) is Collective for _, op, _ in self.classes] + [False], bool)
        return np.flatnonzero(coll[self.cls])

    def calls(self) -> list:
        """``(rank, index, op)`` of every collective step, rank-major in program order."""
        rows = self.call_rows()
        programs = self.plan.programs
        return [(r, i, programs[r][i]) for r, i in zip(self.rank[rows].tolist(),
                                                        self.index[rows].tolist())]


def _mb_of(op: Op) -> int:
    """The microbatch ``op_table`` records for ``op`` (0 for idle and marker steps)."""
    kind = type(op)
    if kind is Compute:
        return op.mb
    if kind is Overlap:
        return op.ops[0].mb if op.ops else 0
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


def op_table(plan: Plan, overlapped: bool = False) -> OpTable | None:
    """The plan's ``OpTable``, or None for a plan with a cut, groups or activation moves
    (their rules depend on more than an op's class), or with overlapped steps unless
    ``overlapped`` (the verifier's passes read them; no bulk reader records them) and
    never in a plan of sequence chunks. A plan that a bulk reader built is classed by
    what it recorded (``ir.known_op_cells``), any other op by op."""
    import numpy as np
    if plan.cut.segments:
        return None
    cells = known_op_cells(plan)
    if cells is not None:
        return _table_of(plan, *_by_chunk(plan, *_classes_of_cells(plan, *cells)))
    keys: dict[tuple, int] = {}
    cls: list[int] = []
    mbs: list[int] = []
    add_cls, add_mb, number = cls.append, mbs.append, keys.setdefault
    # an overlap's ops may sit at different places in their samples: not by class
    overlaps = overlapped and plan.seq_chunks == 1
    for rank, program in enumerate(plan.programs):
        for op in program:
            kind = type(op)
            if kind is Compute:
                key = (rank, op.kind, op.stage, op.segment)
                add_mb(op.mb)
            elif kind is Send or kind is Recv:  # the peer read as a field (a property)
                p = op.payload
                if p.kind in RANK_MOVES:
                    return None  # a lent activation's backward needs more than its class
                key = (rank, kind, op.dst if kind is Send else op.src, p.kind, p.stage,
                       p.segment, p.to_segment, p.shape, p.dtype, p.leaves)
                add_mb(p.mb)
            elif kind is Idle or kind is Marker:
                key = (rank, kind)
                add_mb(0)
            elif kind is Overlap and overlaps:  # each op's fields, its mb as a shift
                key = _overlap_key(rank, op.ops)
                add_mb(op.ops[0].mb if op.ops else 0)
            elif kind is Collective:
                key = (rank, kind, op.kind, op.tag, op.root, tuple(op.ranks))
                add_mb(0)
            else:
                return None
            add_cls(number(key, len(keys)))
    return _table_of(plan, *_by_chunk(plan, np.array(cls, dtype=np.int64),
                                      np.array(mbs, dtype=np.int64)))


def _overlap_key(rank: int, ops: tuple) -> tuple:
    """The class key of an overlapped step of ``ops``: each op's kind, stage, segment and
    microbatch less the first op's, flat (the common pair spelled out)."""
    if len(ops) == 2:
        a, b = ops
        return (rank, Overlap, a.kind, a.stage, a.segment, 0, b.kind, b.stage, b.segment,
                b.mb - a.mb)
    first = ops[0].mb if ops else 0
    return (rank, Overlap, *[x for c in ops for x in (c.kind, c.stage, c.segment,
                                                       c.mb - first)])


def _by_chunk(plan: Plan, cls, mb) -> tuple:
    """``(cls, mb)`` with each class split by where its microbatch sits in its sample
    (first chunk, last chunk, or neither) when the plan has sequence chunks, since the
    chunk rule (``Chain.needs``) differs there; renumbered in order of first appearance."""
    import numpy as np
    chunks = plan.seq_chunks
    if chunks == 1 or not len(cls):
        return cls, mb
    j = mb % chunks
    key = cls * 3 + (j == 0) + 2 * (j == chunks - 1)
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    renumber = np.empty(len(first), np.int64)
    renumber[np.argsort(first, kind="stable")] = np.arange(len(first))
    return renumber[which.reshape(-1)], mb


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
