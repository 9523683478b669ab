"""Literal terms: a schedule given rank by rank (``program(...)``), as short as its order
allows. ``import`` writes one for a schedule read from a file; the greedy V families
(``v_greedy``) are one.

``Program(ranks, microbatches, words, placement, chunks)`` holds one *word* per rank:

- a weave pattern (``pattern`` grammar) read against the rank's own streams, each local
  chunk's forwards and backwards in microbatch order (a letter without a chunk index
  takes the next microbatch, chunks ascending for forwards and descending for
  backwards); counts are plain integers (the word is this rank's own);
- or, after ``=``, the rank's actions listed (``= 2F0..3 2B0 <0F7 7B3>``): ``SKM`` is
  kind ``K`` of stage ``S`` on microbatch ``M``, ``SKa..b`` the same op on microbatches
  ``a`` to ``b`` in turn (rising or falling), ``<...>`` one overlapped step. For an
  order no stream reading gives (microbatches out of order, work missing, ops on a rank
  that does not hold their stage).

``placement`` is ``'looped'`` (stage ``s`` on rank ``s % ranks``, ``chunks`` stages per
rank), ``'v'`` or the stage map as a list of ranks. Invariant: ``str(term)`` reads back
(``spec.parse_expression``) to an equal term, and ``literal(schedule).derive() ==
schedule`` for every schedule without a cut.
"""

from __future__ import annotations

import re

import attrs

from ..errors import ParameterError
from ..ir import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Compute, Idle,
                  Marker, Op, Overlap, Placement, Schedule)
from . import terms as _terms
from .pattern import check_count, parse_pattern, weave_rank

LISTED = "="  # a word starting with this lists the rank's actions
STARRED = 4  # how many of a word's last repeats are tried as ``*``
MAX_RANGE = 1_000_000  # the most ops one listed range may stand for
_ACTION = re.compile(r"(\d+)([FBIWR])(\d+)(?:\.\.(\d+))?")
_ITEM = re.compile(r"\s*(?:<([^<>]*)>|(\S+))")


def _placement(style: str | tuple[int, ...], ranks: int, chunks: int) -> Placement:
    if isinstance(style, str):
        return _terms.make_placement(style, ranks, chunks)
    try:
        return Placement(tuple(style), ranks)
    except ValueError as e:
        raise ParameterError(f"placement: {e}") from None


@attrs.frozen
class Program:
    """``program(pp, microbatches, ranks=[word, ...], placement, chunks)``: rank ``r``
    runs what its word reads (module docstring); validated when made."""

    ranks: int
    microbatches: int
    words: tuple[str, ...]
    placement: str | tuple[int, ...] = "looped"
    chunks: int = 1

    def __attrs_post_init__(self) -> None:
        for name in ("ranks", "microbatches", "chunks"):
            if getattr(self, name) < 1:
                raise ParameterError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.words) != self.ranks:
            raise ParameterError(f"ranks: {len(self.words)} words for pp={self.ranks}")
        if not isinstance(self.placement, str) and self.chunks != 1:
            raise ParameterError("chunks goes with placement='looped' (a stage map says "
                                 "where every stage is)")
        _placement(self.placement, self.ranks, self.chunks)
        for r, word in enumerate(self.words):
            _parse_word(word, r)

    def derive(self) -> Schedule:
        placement = _placement(self.placement, self.ranks, self.chunks)
        programs = tuple(tuple(_read_word(w, placement, r, self.microbatches))
                         for r, w in enumerate(self.words))
        return Schedule(placement, self.microbatches, programs)

    def __str__(self) -> str:
        extra = "" if self.chunks == 1 else f", chunks={self.chunks}"
        if self.placement != "looped":
            shown = self.placement if isinstance(self.placement, str) else list(self.placement)
            extra += f", placement={shown!r}"
        words = "[" + ", ".join(repr(w) for w in self.words) + "]"
        return f"program(pp={self.ranks}, microbatches={self.microbatches}{extra}, ranks={words})"


def _parse_word(word: str, rank: int):
    """The word's syntax tree (a pattern node, or the listed ops); ``ParameterError``
    names the rank."""
    try:
        if word.lstrip().startswith(LISTED):
            return _listed(word.lstrip()[1:])
        node = parse_pattern(word)
        for count in re.findall(r"\{([^{}]*)\}", word):
            check_count(count, f"rank {rank}", variables=())
        return node
    except ParameterError as e:
        raise ParameterError(f"rank {rank}: {e}") from None


def _listed(text: str) -> tuple[Op, ...]:
    out: list[Op] = []
    for m in _ITEM.finditer(text):
        if m.group(1) is not None:
            parts = [_one(t) for t in m.group(1).split()]
            if len(parts) < 2 or any(len(p) != 1 for p in parts):
                raise ParameterError(f"overlap <{m.group(1)}> needs two or more single ops")
            out.append(Overlap(tuple(p[0] for p in parts)))
        else:
            out.extend(_one(m.group(2)))
    return tuple(out)


def _one(token: str) -> list[Compute]:
    m = _ACTION.fullmatch(token)
    if not m:
        raise ParameterError(f"cannot read action {token!r} (expected like 2F0 or 2F0..5)")
    stage, kind, first = int(m.group(1)), m.group(2), int(m.group(3))
    last = first if m.group(4) is None else int(m.group(4))
    if abs(last - first) >= MAX_RANGE:
        raise ParameterError(f"action range {token!r} is longer than {MAX_RANGE:,} ops")
    step = 1 if last >= first else -1
    return [Compute(kind, stage, mb) for mb in range(first, last + step, step)]


def _streams(placement: Placement, rank: int, m: int):
    """The rank's streams: rounds of one microbatch (each chunk's microbatches in order)."""
    return _terms._rank_streams(placement, rank, m, 1)


def _read_word(word: str, placement: Placement, rank: int, m: int) -> list[Op]:
    tree = _parse_word(word, rank)
    if isinstance(tree, tuple):
        for c in (c for op in tree for c in (op.ops if isinstance(op, Overlap) else (op,))):
            if c.stage >= placement.num_stages or c.mb >= m:
                raise ParameterError(f"rank {rank}: {c} is outside {placement.num_stages} "
                                     f"stages and {m} microbatches")
        return list(tree)
    env = {"p": placement.num_ranks, "r": rank, "m": m, "v": 1, "g": 1, "n": m}
    return weave_rank(tree, _streams(placement, rank, m), env)


# ---------------------------------------------------------------- writing a literal


def literal(schedule: Schedule) -> Program:
    """The literal term of ``schedule`` (no cut): each rank's shortest word found
    (``word_of``). ``ParameterError`` for what a literal cannot hold."""
    if schedule.cut.segments:
        raise ParameterError("a schedule with a cut (segments besides the body) has no "
                             "literal term")
    if schedule.seq_chunks != 1 or schedule.pipelines:
        raise ParameterError("a schedule of sequence chunks or of several pipelines has no "
                             "literal term")
    placement, p = schedule.placement, schedule.num_ranks
    style, chunks = _style(placement)
    words = tuple(word_of(_work(prog, r), placement, r, schedule.num_microbatches)
                  for r, prog in enumerate(schedule.programs))
    return Program(p, schedule.num_microbatches, words, style, chunks)


def _style(placement: Placement) -> tuple[str | tuple[int, ...], int]:
    p, s = placement.num_ranks, placement.num_stages
    if s % p == 0 and placement == Placement.looped(p, s // p):
        return "looped", s // p
    if s == 2 * p and placement == Placement.vshape(p):
        return "v", 2
    return placement.stage_to_rank, 1


def _work(program, rank: int) -> tuple[Op, ...]:
    """The rank's compute steps (idle cells and bookkeeping markers carry no work)."""
    out = []
    for op in program:
        if isinstance(op, (Idle, Marker)):
            continue
        if not isinstance(op, (Compute, Overlap)) or any(
                c.segment for c in (op.ops if isinstance(op, Overlap) else (op,))):
            raise ParameterError(f"rank {rank}: {op} is not body compute work (a literal "
                                 "holds F, B, I, W and R steps)")
        out.append(op)
    return tuple(out)


def word_of(program: tuple[Op, ...], placement: Placement, rank: int, m: int) -> str:
    """The shortest word found that reads back to ``program`` on ``rank``: the stream
    letters, repeats folded (``compress``) and the last item or one of the last
    ``STARRED`` repeats read as ``*`` (what follows it dropped) where that reads the same,
    else the listed actions."""
    letters = _letters(program, placement.stages_of(rank))
    if letters is not None and _reads(" ".join(letters), program, placement, rank, m):
        items = compress(letters)
        repeats = [i for i, (_, count) in enumerate(items) if count > 1][-STARRED:]
        tried = set(repeats) | ({len(items) - 1} if items else set())
        starred = sorted({_text(_starred(items, i)) for i in tried}, key=len)
        plain = _text(items)
        for word in (w for w in starred if len(w) < len(plain)):
            if _reads(word, program, placement, rank, m):
                return word
        if _reads(plain, program, placement, rank, m):
            return plain
        return " ".join(letters)
    return (LISTED + " " + listed_text(program)).rstrip()


def _reads(word: str, program, placement: Placement, rank: int, m: int) -> bool:
    try:
        return tuple(_read_word(word, placement, rank, m)) == tuple(program)
    except ParameterError:
        return False


def _letters(program, stages: tuple[int, ...]) -> list[str] | None:
    """One stream letter per step (``<..>`` for an overlap); None where an op is not
    stream work of this rank."""
    chunked = len(stages) > 1

    def letter(c: Compute) -> str | None:
        if c.stage not in stages or c.kind not in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD):
            return None
        return c.kind + (str(stages.index(c.stage)) if chunked else "")
    out = []
    for op in program:
        ls = [letter(c) for c in (op.ops if isinstance(op, Overlap) else (op,))]
        if None in ls:
            return None
        out.append(ls[0] if isinstance(op, Compute) else "<" + " ".join(ls) + ">")
    return out


def compress(symbols: list[str], longest: int = 8) -> list[tuple[tuple[str, ...], int]]:
    """The shortest text folding ``symbols`` into ``(body, count)`` items, each body a run
    of at most ``longest`` symbols repeated ``count`` times in a row (one level: bodies
    hold no repeats); by dynamic programming over the positions, from the end."""
    n = len(symbols)
    cost = [0] * (n + 1)
    choice: list[tuple[int, int]] = [(1, 1)] * (n + 1)
    for i in range(n - 1, -1, -1):
        cost[i], choice[i] = len(symbols[i]) + 1 + cost[i + 1], (1, 1)
        for period in range(1, min(longest, (n - i) // 2) + 1):
            body = symbols[i:i + period]
            atom = sum(len(x) + 1 for x in body) + (1 if period > 1 else -1)
            count = 1
            while symbols[i + count * period:i + (count + 1) * period] == body:
                count += 1
                total = atom + 2 + len(str(count)) + cost[i + count * period]
                if total < cost[i]:
                    cost[i], choice[i] = total, (period, count)
    items, i = [], 0
    while i < n:
        period, count = choice[i]
        items.append((tuple(symbols[i:i + period]), count))
        i += period * count
    return items


def _starred(items, i: int) -> list[tuple[tuple[str, ...], int | None]]:
    """``items`` with item ``i`` read as ``*`` and everything after it dropped (``*``
    repeats while anything pops)."""
    return list(items[:i]) + [(items[i][0], None)]


def _text(items) -> str:
    out = []
    for body, count in items:
        atom = body[0] if len(body) == 1 else "(" + " ".join(body) + ")"
        if count is None:
            out.append(atom + "*")
        elif count == 1:
            out.append(" ".join(body))
        else:
            out.append(f"{atom}^{count}")
    return " ".join(out)


def listed_text(program) -> str:
    """The listed form: consecutive ops of one kind and stage on microbatches one apart,
    all rising or all falling, as one range (``2F0..5``, ``2B5..3``)."""
    out: list[str] = []
    run: list[Compute] = []

    def flush() -> None:
        if run:
            out.append(str(run[0]) + (f"..{run[-1].mb}" if len(run) > 1 else ""))
            run.clear()
    for op in program:
        if isinstance(op, Overlap):
            flush()
            out.append("<" + " ".join(map(str, op.ops)) + ">")
            continue
        step = run[1].mb - run[0].mb if len(run) > 1 else None
        if run and (op.kind, op.stage) == (run[-1].kind, run[-1].stage) and (
                op.mb - run[-1].mb == step if step else abs(op.mb - run[-1].mb) == 1):
            run.append(op)
            continue
        flush()
        run.append(op)
    flush()
    return " ".join(out)

