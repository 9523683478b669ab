"""Schedule algebra terms (README, Concepts). A term is an immutable description; ``derive()``
turns it into a compute-only ``Schedule``. ``str(term)`` is the term's expression text,
which ``mpipe_verified.spec.parse_expression`` reads back.

Operators and their meaning on per-rank sequences:

- ``Weave(p, m, pattern, chunks, placement, group, seq_chunks)``: rank ``r`` reads
  ``pattern`` (with ``r`` bound) against its own streams of forwards and backwards
  (``pattern`` module); with ``seq_chunks`` S each of the ``m`` samples is S microbatches
  (its sequence chunks, ``sample * S + j``), forwarded in chunk order and backwarded in
  reverse.
- ``Seq(a, b)``: per-rank concatenation ``a_r ++ b_r``; ``b``'s microbatches are renumbered
  after ``a``'s. Precondition: equal placements.
- ``Par(a, b)``: per-rank union where at most one side has work on each rank.
  Preconditions: equal placements and microbatch counts, disjoint busy ranks.
- ``SplitBW(t)``: every ``B(s, mb)`` becomes ``I(s, mb)`` immediately followed by ``W(s, mb)``.
- ``MergeBW(t)``: every ``I(s, mb)`` immediately followed by its ``W(s, mb)`` becomes
  ``B(s, mb)`` (so ``MergeBW(SplitBW(t)) == t`` for a term without split backwards).
- ``DeferW(t, lag)``: on each rank, the ``W`` of the k-th ``I`` moves to just after the
  (k+lag)-th ``I`` (after the last ``I`` when there is none); ``lag`` is an arithmetic count
  in ``p r m`` evaluated per rank. The zero-bubble lever.
- ``Relabel(t, perm)``: microbatch ``mb`` becomes ``perm[mb]`` everywhere.
- ``ForwardOnly(t)``: an evaluation run of ``t``: every ``B``/``I``/``W``/``R`` and every
  gradient all-reduce (``grads:NAME``) is dropped, every forward (and parameter
  broadcast) stays where it was, and the schedule is declared ``forward_only``.
  Precondition: ``t`` is a training term (not already forward-only).
- ``Offloaded(t, gap, prefetch)``: PipeOffload-style activation offload (docs/semantics.md
  §2.9). On each rank, a body forward ``F(s, mb)`` (a step of its own) whose first
  backward (``B`` or ``I`` of ``(s, mb)``) on that rank comes at least ``gap + 1`` steps
  later (``gap`` >= 1 steps between them) gets ``OFFLOAD(s, mb)`` right after it and
  ``RELOAD(s, mb)`` ``prefetch`` steps before that backward (not before the step after
  the forward); steps are counted in ``t``'s programs. Every other op stays in order.
"""

from __future__ import annotations

import attrs

from ..errors import ParameterError
from ..ir import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Collective, Compute, Offload, Op,
                  Overlap, Placement, Reload, Schedule, computes_of)
from ..semantics import GRADS, collective_segment
from .pattern import RankStreams, check_count, evaluate_count, parse_pattern, weave_rank

PLACEMENTS = ("looped", "v")


def make_placement(style: str, ranks: int, chunks: int) -> Placement:
    if style == "v":
        if chunks != 2:
            raise ParameterError(f"V placement needs chunks == 2, got chunks={chunks}")
        return Placement.vshape(ranks)
    if style == "looped":
        return Placement.looped(ranks, chunks)
    raise ParameterError(f"placement must be one of {PLACEMENTS}, got {style!r}")


def _rank_streams(placement: Placement, rank: int, m: int, group: int) -> RankStreams:
    """Forwards in (round, chunk ascending, mb) order; backwards in (round, chunk
    descending, mb) order; a round is ``group`` consecutive microbatches."""
    stages = placement.stages_of(rank)
    rounds = [range(k, min(m, k + group)) for k in range(0, m, group)]
    fwd = [(c, s, mb) for mbs in rounds for c, s in enumerate(stages) for mb in mbs]
    bwd = [(c, s, mb) for mbs in rounds for c, s in reversed(list(enumerate(stages))) for mb in mbs]
    return RankStreams(fwd, bwd)


def _chunk_streams(placement: Placement, rank: int, m: int, group: int,
                   seq_chunks: int) -> RankStreams:
    """``_rank_streams`` of ``m`` samples, each sample's place taken by its
    ``seq_chunks`` S sequence chunks (microbatch ``sample * S + j``): forwards
    chunk-ascending, backwards chunk-descending."""
    stages = placement.stages_of(rank)
    rounds = [range(k, min(m, k + group)) for k in range(0, m, group)]
    up, down = range(seq_chunks), range(seq_chunks - 1, -1, -1)
    fwd = [(c, s, mb * seq_chunks + j) for mbs in rounds for c, s in enumerate(stages)
           for mb in mbs for j in up]
    bwd = [(c, s, mb * seq_chunks + j) for mbs in rounds
           for c, s in reversed(list(enumerate(stages))) for mb in mbs for j in down]
    return RankStreams(fwd, bwd)


@attrs.frozen
class Weave:
    ranks: int
    microbatches: int
    pattern: str
    chunks: int = 1
    placement: str = "looped"
    group: int | None = None  # microbatches per round; default: ranks
    seq_chunks: int = 1  # sequence chunks per sample (microbatches then count samples)

    def __attrs_post_init__(self) -> None:
        for name in ("ranks", "microbatches", "chunks", "seq_chunks"):
            if getattr(self, name) < 1:
                raise ParameterError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group is not None and self.group < 1:
            raise ParameterError(f"group must be >= 1, got {self.group}")
        parse_pattern(self.pattern)
        make_placement(self.placement, self.ranks, self.chunks)

    def derive(self) -> Schedule:
        p, m, v = self.ranks, self.microbatches, self.chunks
        placement = make_placement(self.placement, p, v)
        g, sc = self.group or p, self.seq_chunks
        node = parse_pattern(self.pattern)
        programs = []
        for r in range(p):
            env = {"p": p, "r": r, "m": m, "v": v, "g": g, "n": m * v * sc, "s": sc}
            streams = (_rank_streams(placement, r, m, g) if sc == 1
                       else _chunk_streams(placement, r, m, g, sc))
            programs.append(tuple(weave_rank(node, streams, env)))
        return Schedule(placement, m * sc, tuple(programs), seq_chunks=sc)

    def __str__(self) -> str:
        extra = "" if self.chunks == 1 else f", chunks={self.chunks}"
        extra += "" if self.placement == "looped" else f", placement={self.placement!r}"
        extra += "" if self.group is None else f", group={self.group}"
        extra += "" if self.seq_chunks == 1 else f", seq_chunks={self.seq_chunks}"
        return f"weave(pp={self.ranks}, microbatches={self.microbatches}, pattern={self.pattern!r}{extra})"


def _map_computes(schedule: Schedule, fn) -> Schedule:
    """Apply ``fn: Compute -> Compute`` to every compute op (inside overlaps too), and
    to the activation a move names (read as its forward)."""
    def one(op: Op) -> Op:
        if isinstance(op, Compute):
            return fn(op)
        if isinstance(op, Overlap):
            return Overlap(tuple(fn(c) for c in op.ops))
        if isinstance(op, (Offload, Reload)):
            c = fn(Compute(FORWARD, op.stage, op.mb, op.segment))
            return attrs.evolve(op, stage=c.stage, mb=c.mb)
        return op
    programs = tuple(tuple(one(op) for op in prog) for prog in schedule.programs)
    return attrs.evolve(schedule, programs=programs)


@attrs.frozen
class Seq:
    first: object
    second: object

    def derive(self) -> Schedule:
        a, b = self.first.derive(), self.second.derive()
        if a.placement != b.placement:
            raise ParameterError("seq needs both terms on the same placement")
        shift = a.num_microbatches
        _same_kind(a, b, "seq")
        b = _map_computes(b, lambda c: attrs.evolve(c, mb=c.mb + shift))
        programs = tuple(x + y for x, y in zip(a.programs, b.programs))
        return Schedule(a.placement, a.num_microbatches + b.num_microbatches, programs,
                        forward_only=a.forward_only, seq_chunks=a.seq_chunks)

    def __str__(self) -> str:
        return f"seq({self.first}, {self.second})"


@attrs.frozen
class Par:
    left: object
    right: object

    def derive(self) -> Schedule:
        a, b = self.left.derive(), self.right.derive()
        if a.placement != b.placement or a.num_microbatches != b.num_microbatches:
            raise ParameterError("par needs both terms on the same placement and microbatches")
        busy = [r for r in range(a.num_ranks) if a.programs[r] and b.programs[r]]
        if busy:
            raise ParameterError(f"par needs disjoint ranks, but both terms use rank {busy[0]}")
        _same_kind(a, b, "par")
        programs = tuple(x or y for x, y in zip(a.programs, b.programs))
        return Schedule(a.placement, a.num_microbatches, programs, forward_only=a.forward_only,
                        seq_chunks=a.seq_chunks)

    def __str__(self) -> str:
        return f"par({self.left}, {self.right})"


def _same_kind(a: Schedule, b: Schedule, name: str) -> None:
    if a.forward_only != b.forward_only:
        raise ParameterError(f"{name} needs two training terms or two forward-only terms")
    if a.seq_chunks != b.seq_chunks:
        raise ParameterError(f"{name} needs terms with equal seq_chunks, got {a.seq_chunks} "
                             f"and {b.seq_chunks}")


@attrs.frozen
class Restrict:
    """Keep only the programs of ``ranks`` (the others become empty)."""

    term: object
    ranks: tuple[int, ...]

    def derive(self) -> Schedule:
        s = self.term.derive()
        keep = set(self.ranks)
        programs = tuple(prog if r in keep else () for r, prog in enumerate(s.programs))
        return attrs.evolve(s, programs=programs)

    def __str__(self) -> str:
        return f"restrict({self.term}, ranks={list(self.ranks)})"


@attrs.frozen
class SplitBW:
    term: object

    def derive(self) -> Schedule:
        s = self.term.derive()

        def split(op: Op):
            if isinstance(op, Compute) and op.kind == BACKWARD:
                return (attrs.evolve(op, kind=INPUT_GRAD), attrs.evolve(op, kind=WEIGHT_GRAD))
            return (op,)
        programs = tuple(tuple(x for op in prog for x in split(op)) for prog in s.programs)
        return attrs.evolve(s, programs=programs)

    def __str__(self) -> str:
        return f"split_bw({self.term})"


@attrs.frozen
class MergeBW:
    term: object

    def derive(self) -> Schedule:
        s = self.term.derive()
        return attrs.evolve(s, programs=tuple(_merge(prog) for prog in s.programs))

    def __str__(self) -> str:
        return f"merge_bw({self.term})"


def _merge(program: tuple[Op, ...]) -> tuple[Op, ...]:
    out: list[Op] = []
    for op in program:
        prev = out[-1] if out else None
        if (isinstance(op, Compute) and op.kind == WEIGHT_GRAD and isinstance(prev, Compute)
                and prev == attrs.evolve(op, kind=INPUT_GRAD)):
            out[-1] = attrs.evolve(op, kind=BACKWARD)
        else:
            out.append(op)
    return tuple(out)


@attrs.frozen
class DeferW:
    term: object
    lag: str

    def __attrs_post_init__(self) -> None:
        check_count(self.lag, "defer_w lag", variables=("p", "r", "m"))

    def derive(self) -> Schedule:
        s = self.term.derive()
        programs = []
        for r, prog in enumerate(s.programs):
            lag = evaluate_count(self.lag, {"p": s.num_ranks, "r": r, "m": s.num_microbatches})
            programs.append(_defer(prog, lag))
        return attrs.evolve(s, programs=tuple(programs))

    def __str__(self) -> str:
        return f"defer_w({self.term}, lag={self.lag!r})"


def _defer(program: tuple[Op, ...], lag: int) -> tuple[Op, ...]:
    weights = [op for op in program if isinstance(op, Compute) and op.kind == WEIGHT_GRAD]
    rest = [op for op in program if not (isinstance(op, Compute) and op.kind == WEIGHT_GRAD)]
    by_input = {attrs.evolve(w, kind=INPUT_GRAD): w for w in weights}
    inputs = [c for op in rest for c in computes_of(op) if c.kind == INPUT_GRAD]
    after: dict[int, list[Compute]] = {}
    orphans = [w for w in weights if attrs.evolve(w, kind=INPUT_GRAD) not in set(inputs)]
    for k, i_op in enumerate(inputs):
        if i_op in by_input:
            after.setdefault(min(k + lag, len(inputs) - 1), []).append(by_input[i_op])
    out: list[Op] = []
    seen = 0
    for op in rest:
        out.append(op)
        for c in computes_of(op):
            if c.kind == INPUT_GRAD:
                out.extend(after.get(seen, ()))
                seen += 1
    return tuple(out + orphans)


@attrs.frozen
class Relabel:
    term: object
    perm: tuple[int, ...]

    def derive(self) -> Schedule:
        s = self.term.derive()
        if sorted(self.perm) != list(range(s.num_microbatches)):
            raise ParameterError(f"relabel needs a permutation of 0..{s.num_microbatches - 1}")
        return _map_computes(s, lambda c: attrs.evolve(c, mb=self.perm[c.mb]))

    def __str__(self) -> str:
        return f"relabel({self.term}, perm={list(self.perm)})"


@attrs.frozen
class ForwardOnly:
    term: object

    def derive(self) -> Schedule:
        s = self.term.derive()
        if s.forward_only:
            raise ParameterError("forward_only applies to a training term (this one is "
                                 "forward-only already)")
        programs = tuple(tuple(x for op in prog if (x := _forwards_of(op)) is not None)
                         for prog in s.programs)
        return attrs.evolve(s, programs=programs, forward_only=True)

    def __str__(self) -> str:
        return f"forward_only({self.term})"


def _forwards_of(op: Op) -> Op | None:
    """What stays of ``op`` in an evaluation run (None: nothing; no activation is stored,
    so none is moved)."""
    if isinstance(op, (Offload, Reload)):
        return None
    if isinstance(op, Compute):
        return op if op.kind == FORWARD else None
    if isinstance(op, Overlap):
        kept = tuple(c for c in op.ops if c.kind == FORWARD)
        return (kept[0] if len(kept) == 1 else Overlap(kept)) if kept else None
    if isinstance(op, Collective):
        tagged = collective_segment(op)
        return None if tagged is not None and tagged[0] == GRADS else op
    return op


@attrs.frozen
class Offloaded:
    """``offload(t, gap=G, prefetch=P)``: ``t`` with each body activation whose backward
    is at least ``gap + 1`` steps after its forward on its rank offloaded right after the
    forward and reloaded ``prefetch`` steps before the backward (module docstring)."""

    term: object
    gap: int = 2
    prefetch: int = 1

    def __attrs_post_init__(self) -> None:
        for name, low in (("gap", 1), ("prefetch", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ParameterError(f"offload {name} must be an integer >= {low}, got {value!r}")

    def derive(self) -> Schedule:
        s = self.term.derive()
        return attrs.evolve(s, programs=tuple(offload_program(prog, self.gap, self.prefetch)
                                              for prog in s.programs))

    def __str__(self) -> str:
        return f"offload({self.term}, gap={self.gap}, prefetch={self.prefetch})"


def offload_program(program: tuple[Op, ...], gap: int, prefetch: int) -> tuple[Op, ...]:
    """One rank's program with its moves (``Offloaded``): for each body ``F`` step at
    ``f`` whose first backward step is at ``b >= f + gap + 1``, ``OFFLOAD`` after step
    ``f`` and ``RELOAD`` before step ``max(f + 1, b - prefetch)``."""
    first_backward: dict[tuple[int, int], int] = {}
    for index, op in enumerate(program):
        for c in computes_of(op):
            if c.kind in (BACKWARD, INPUT_GRAD) and not c.segment:
                first_backward.setdefault((c.stage, c.mb), index)
    after: dict[int, Op] = {}
    before: dict[int, list[Op]] = {}
    for f, op in enumerate(program):
        if type(op) is not Compute or op.kind != FORWARD or op.segment:
            continue
        b = first_backward.get((op.stage, op.mb))
        if b is not None and b - f - 1 >= gap:
            after[f] = Offload(op.stage, op.mb)
            before.setdefault(max(f + 1, b - prefetch), []).append(Reload(op.stage, op.mb))
    out: list[Op] = []
    for index, op in enumerate(program):
        out.extend(before.get(index, ()))
        out.append(op)
        if index in after:
            out.append(after[index])
    return tuple(out)
