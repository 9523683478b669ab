"""Schedule algebra terms (README, Concepts). A term is an immutable description; ``derive()``
turns it into a compute-only ``Schedule``. ``str(term)`` is the term's expression text,
which ``mpipe_verified.spec.parse_expression`` reads back.

Operators and their meaning on per-rank sequences:

- ``Weave(p, m, pattern, chunks, placement, group, pipelines, order, backward)``: rank
  ``r`` reads ``pattern`` (with ``r`` bound) against its own streams of forwards and
  backwards (``pattern`` module); ``placement`` is a named style or any stage-to-rank map,
  ``order`` and ``backward`` set the streams' order (``Weave``). With ``pipelines=K`` the
  model runs in K pipelines over the ranks (``pipeline_streams``).
  With ``seq_chunks`` S each of the ``m`` samples is S microbatches (its sequence chunks,
  ``sample * S + j``), forwarded in chunk order and backwarded in reverse.
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
  §2.10). On each rank, a body forward ``F(s, mb)`` (a step of its own) whose first
  backward (``B`` or ``I`` of ``(s, mb)``) on that rank comes at least ``gap + 1`` steps
  later (``gap`` >= 1 steps between them) gets ``OFFLOAD(s, mb)`` right after it and
  ``RELOAD(s, mb)`` ``prefetch`` steps before that backward (not before the step after
  the forward); steps are counted in ``t``'s programs. Every other op stays in order.
"""

from __future__ import annotations

import re

import attrs

from ..errors import ParameterError
from ..ir import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Collective, Compute, Offload, Op,
                  Overlap, Placement, Reload, Schedule, computes_of)
from ..semantics import GRADS, collective_segment
from .pattern import RankStreams, check_count, evaluate_count, parse_pattern, weave_rank

PLACEMENTS = ("looped", "v", "zigzag")
ORDERS = ("dfs", "bfs")  # forwards (and backwards) in rounds of g, or one round of all m
BACKWARDS = ("asc", "desc")  # microbatches of a round in the backward stream


def make_placement(style: str, ranks: int, chunks: int) -> Placement:
    """``looped`` (stage ``s`` on rank ``s % p``), ``v`` (two chunks, down then up),
    ``zigzag`` (``chunks`` waves of ``p`` stages, down, up, down, ...: Hanayo's) or an
    explicit map ``"0,0,1,1,0"`` (stage ``s`` on the ``s``-th rank named; every rank
    holds 1 to ``chunks`` stages)."""
    if style == "v":
        if chunks != 2:
            raise ParameterError(f"V placement needs chunks == 2, got chunks={chunks}")
        return Placement.vshape(ranks)
    if style == "looped":
        return Placement.looped(ranks, chunks)
    if style == "zigzag":
        return Placement(tuple(s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks
                               for s in range(ranks * chunks)), ranks)
    if style[:1].isdigit():
        return Placement(stage_map(style, ranks, chunks), ranks)
    raise ParameterError(f"placement must be one of {PLACEMENTS} or a stage-to-rank map like "
                         f"'0,0,1,1,0', got {style!r}")


def stage_map(text: str, ranks: int, chunks: int) -> tuple[int, ...]:
    """The ranks of an explicit map ``"r0,r1,..."``; a ``ParameterError`` names the entry
    (1-based) that is not a rank of ``0..ranks-1``, a rank holding no stage or more
    than ``chunks``, or a length outside ``ranks..ranks*chunks``."""
    items = text.split(",")
    out = []
    for i, item in enumerate(items, 1):
        if not re.fullmatch(r"\s*\d+\s*", item) or int(item) >= ranks:
            raise ParameterError(f"placement {text!r}: entry {i} ({item.strip()!r}) is not a "
                                 f"rank of 0..{ranks - 1}")
        out.append(int(item))
    if not ranks <= len(out) <= ranks * chunks:
        raise ParameterError(f"placement {text!r}: {len(out)} entries; pp={ranks}, "
                             f"chunks={chunks} needs {ranks} to {ranks * chunks}")
    for r in range(ranks):
        held = [i for i, x in enumerate(out, 1) if x == r]
        if not held:
            raise ParameterError(f"placement {text!r}: rank {r} holds no stage")
        if len(held) > chunks:
            raise ParameterError(f"placement {text!r}: entry {held[chunks]} puts stage "
                                 f"{chunks + 1} on rank {r}, beyond chunks={chunks}")
    return tuple(out)


def _rounds(m: int, group: int, even: bool = False) -> list[range]:
    """Rounds of ``group`` consecutive microbatches, the last possibly shorter; ``even``:
    as many rounds, ``R = ceil(m / group)``, evened out (``ceil(m / R)`` first, then
    ``floor(m / R)``)."""
    if not even:
        return [range(k, min(m, k + group)) for k in range(0, m, group)]
    count = -(-m // group)
    sizes = [m // count + (q < m % count) for q in range(count)]
    return [range(sum(sizes[:q]), sum(sizes[:q + 1])) for q in range(count)]


def _rank_streams(placement: Placement, rank: int, m: int, group: int,
                  even: bool = False) -> RankStreams:
    """Forwards in (round, chunk ascending, mb) order; backwards in (round, chunk
    descending, mb) order; rounds as ``_rounds``."""
    stages = placement.stages_of(rank)
    rounds = _rounds(m, group, even)
    fwd = [(c, s, mb) for mbs in rounds for c, s in enumerate(stages) for mb in mbs]
    bwd = [(c, s, mb) for mbs in rounds for c, s in reversed(list(enumerate(stages))) for mb in mbs]
    return RankStreams(fwd, bwd)


def pipeline_placement(style: str, ranks: int, chunks: int, k: int) -> Placement:
    """K pipelines: pipeline 0 placed by ``style``; pipeline i > 0 mirrored (its stage
    ``i*n + j`` on rank ``p-1-r`` where pipeline 0's stage j is on rank ``r``)."""
    first = make_placement(style, ranks, chunks).stage_to_rank
    return Placement(first + tuple(ranks - 1 - r for _ in range(1, k) for r in first), ranks)


def pipeline_streams(placement: Placement, rank: int, m: int, k: int,
                     group: int) -> RankStreams:
    """K pipelines of ``m / k`` consecutive microbatches each: the rank's chunks are its
    stages by depth in their pipeline (then pipeline), so chunk 0 is the one nearest its
    pipeline's start; each chunk streams its own pipeline's microbatches, in rounds of
    ``group`` (forwards chunk ascending, backwards chunk descending within a round)."""
    n, per = placement.num_stages // k, m // k
    stages = sorted(placement.stages_of(rank), key=lambda s: (s % n, s // n))
    rounds = [range(a, min(per, a + group)) for a in range(0, per, group)]
    fwd = [(c, s, s // n * per + j) for js in rounds for c, s in enumerate(stages) for j in js]
    bwd = [(c, s, s // n * per + j) for js in rounds for c, s in reversed(list(enumerate(stages)))
           for j in js]
    return RankStreams(fwd, bwd)


def _descending(streams: RankStreams, chunks: int, m: int, group: int,
                even: bool = False) -> RankStreams:
    """``streams`` with each (round, chunk) block of the backward stream reversed (by
    position, so it commutes with relabelling the microbatches)."""
    bwd, out = list(streams.backwards), []
    for mbs in _rounds(m, group, even):
        for _ in range(chunks):
            out += bwd[len(out):len(out) + len(mbs)][::-1]
    return RankStreams(streams.forwards, out)


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
    """``placement``: see ``make_placement``. ``order``: ``dfs`` (rounds of ``group``
    microbatches, depth first) or ``bfs`` (one round of all microbatches: every
    microbatch of chunk 0, then of chunk 1, ...). ``backward``: ``asc`` or ``desc``, the
    microbatch order inside a round of the backward stream (torch's LoopedBFS: ``desc``)."""

    ranks: int
    microbatches: int
    pattern: str
    chunks: int = 1
    placement: str = "looped"
    group: int | None = None  # microbatches per round; default: ranks
    pipelines: int = 1  # K pipelines over the ranks, m / K microbatches each
    order: str = "dfs"
    backward: str = "asc"
    seq_chunks: int = 1  # sequence chunks per sample (microbatches then count samples)
    even: bool = False  # rounds evened out (``_rounds``); one pipeline, no seq_chunks

    def __attrs_post_init__(self) -> None:
        for name in ("ranks", "microbatches", "chunks", "seq_chunks"):
            if getattr(self, name) < 1:
                raise ParameterError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group is not None and self.group < 1:
            raise ParameterError(f"group must be >= 1, got {self.group}")
        if self.order not in ORDERS:
            raise ParameterError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.order == "bfs" and self.group is not None:
            raise ParameterError("order='bfs' is one round of all microbatches: give no group")
        if self.backward not in BACKWARDS:
            raise ParameterError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")
        parse_pattern(self.pattern)
        make_placement(self.placement, self.ranks, self.chunks)
        if self.seq_chunks != 1 and (self.pipelines, self.order, self.backward) != (1, "dfs",
                                                                                    "asc"):
            raise ParameterError("seq_chunks goes with one pipeline, order 'dfs' and backward "
                                 "'asc'")
        if self.even and (self.pipelines, self.seq_chunks) != (1, 1):
            raise ParameterError("even rounds go with one pipeline and seq_chunks=1")
        k = self.pipelines
        if type(k) is not int or k < 1 or self.microbatches % k:
            raise ParameterError(f"pipelines must be an integer >= 1 dividing microbatches "
                                 f"({self.microbatches}), got {k!r}")

    def derive(self) -> Schedule:
        p, m, v, k = self.ranks, self.microbatches, self.chunks, self.pipelines
        sc = self.seq_chunks
        g = m if self.order == "bfs" else self.group or p
        node = parse_pattern(self.pattern)
        if k == 1:
            placement = make_placement(self.placement, p, v)
            even = {"even": True} if self.even else {}
            streams = ((lambda r: _rank_streams(placement, r, m, g, **even)) if sc == 1  # noqa: E731
                       else (lambda r: _chunk_streams(placement, r, m, g, sc)))
        else:
            placement = pipeline_placement(self.placement, p, v, k)
            streams = lambda r: pipeline_streams(placement, r, m, k, g)  # noqa: E731
        programs = []
        for r in range(p):
            env = {"p": p, "r": r, "m": m, "v": v, "g": g, "n": m * v * sc, "s": sc}
            mine = streams(r)
            if self.backward == "desc":
                mine = _descending(mine, len(placement.stages_of(r)), m // k, g, self.even)
            programs.append(tuple(weave_rank(node, mine, env)))
        pipelines = () if k == 1 else tuple(tuple(range(i * m // k, (i + 1) * m // k))
                                            for i in range(k))
        return Schedule(placement, m * sc, tuple(programs), pipelines=pipelines, seq_chunks=sc)

    def __str__(self) -> str:
        extra = "" if self.chunks == 1 else f", chunks={self.chunks}"
        extra += "" if self.placement == "looped" else f", placement={self.placement!r}"
        extra += "" if self.group is None else f", group={self.group}"
        extra += "" if self.pipelines == 1 else f", pipelines={self.pipelines}"
        extra += "" if self.order == "dfs" else f", order={self.order!r}"
        extra += "" if self.backward == "asc" else f", backward={self.backward!r}"
        extra += "" if self.seq_chunks == 1 else f", seq_chunks={self.seq_chunks}"
        extra += ", even=True" if self.even else ""
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
        pipelines = tuple(x + tuple(mb + shift for mb in y)  # pipeline i runs both parts
                          for x, y in zip(a.pipelines, b.pipelines))
        return Schedule(a.placement, a.num_microbatches + b.num_microbatches, programs,
                        forward_only=a.forward_only, pipelines=pipelines,
                        seq_chunks=a.seq_chunks)

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
        if a.pipelines != b.pipelines:
            raise ParameterError("par needs both terms over the same pipelines")
        return Schedule(a.placement, a.num_microbatches, programs, forward_only=a.forward_only,
                        pipelines=a.pipelines,
                        seq_chunks=a.seq_chunks)

    def __str__(self) -> str:
        return f"par({self.left}, {self.right})"


def _same_kind(a: Schedule, b: Schedule, name: str) -> None:
    if a.forward_only != b.forward_only:
        raise ParameterError(f"{name} needs two training terms or two forward-only terms")
    if len(a.pipelines) != len(b.pipelines):
        raise ParameterError(f"{name} needs both terms in as many pipelines")
    if a.seq_chunks != b.seq_chunks:
        raise ParameterError(f"{name} needs terms with equal seq_chunks, got {a.seq_chunks} "
                             f"and {b.seq_chunks}")


@attrs.frozen
class Restrict:
    """Keep only the programs of ``ranks`` (the others become empty); each a rank of the
    term."""

    term: object
    ranks: tuple[int, ...]

    def derive(self) -> Schedule:
        s = self.term.derive()
        outside = [r for r in self.ranks if not 0 <= r < s.num_ranks]
        if outside:
            raise ParameterError(f"restrict names rank {outside[0]}, outside the term's "
                                 f"ranks 0..{s.num_ranks - 1}")
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
        s = attrs.evolve(s, pipelines=tuple(tuple(sorted(self.perm[mb] for mb in p))
                                            for p in s.pipelines))  # renamed everywhere
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
        if s.seq_chunks > 1:
            raise ParameterError("forward_only of sequence chunks is not supported: a chunk "
                                 "keeps the keys and values later chunks read, which an "
                                 "evaluation run's memory rule does not count")
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
        if s.seq_chunks > 1:
            raise ParameterError("offload of sequence chunks is not supported: a chunk's "
                                 "activation holds the keys and values later chunks read")
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
