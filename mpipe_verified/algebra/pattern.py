"""Weave patterns: the words that say how a rank interleaves its op streams.

A rank owns ordered *streams* of work (see ``RankStreams``): forwards, backwards, and the
weight-gradient queue that split backwards fill. A pattern is a word over stream letters;
reading it left to right pops ops off the streams. Warmup, steady 1F1B and cooldown are
patterns, not loops.

Grammar (whitespace separates items)::

    pattern := item*
    item    := atom ('^' count | '*')?
    atom    := LETTER | '(' pattern ')' | '<' LETTER LETTER+ '>'
    count   := INT | '{' arithmetic over p r m v g n s, min(), max() '}'
    LETTER  := F | B | I | W, optionally followed by a local chunk index (F0, I1, W0)

Letters: ``F`` pops the next forward; ``B`` the next backward as a full backward; ``I`` the
next backward as an input-gradient op, queueing its ``W``; ``W`` pops the oldest queued
weight-gradient op. With a chunk index the letter is restricted to that local chunk.
``<F0 B1>`` runs the popped ops in one overlapped step. ``x^k`` repeats ``x`` k times
(negative counts are 0); ``x*`` repeats ``x`` while it still pops something. A letter whose
stream is exhausted pops nothing, so one pattern serves every microbatch count.
Variables: ``p`` ranks, ``r`` this rank, ``m`` microbatches (samples), ``v`` chunks per
rank, ``g`` microbatches per round, ``s`` sequence chunks per sample (1 unless the weave
cuts samples), ``n = m * v * s`` (ops per stream on this rank).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import deque
from typing import Mapping, Union

import attrs

from ..errors import ParameterError
from ..ir import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Compute, Op, Overlap

# ---------------------------------------------------------------- syntax


@attrs.frozen
class Letter:
    kind: str
    chunk: int | None

    def __str__(self) -> str:
        return self.kind + ("" if self.chunk is None else str(self.chunk))


@attrs.frozen
class Cat:
    items: tuple["Node", ...]

    def __str__(self) -> str:
        return " ".join(str(i) for i in self.items)


@attrs.frozen
class Together:
    letters: tuple[Letter, ...]

    def __str__(self) -> str:
        return "<" + " ".join(map(str, self.letters)) + ">"


@attrs.frozen
class Repeat:
    body: "Node"
    count: str | None  # arithmetic source; None means "while it pops something"

    def __str__(self) -> str:
        body = f"({self.body})" if isinstance(self.body, Cat) else str(self.body)
        return body + ("*" if self.count is None else f"^{{{self.count}}}")


Node = Union[Letter, Cat, Together, Repeat]

_TOKEN = re.compile(r"\s*(?:(?P<letter>[FBIW]\d*)|(?P<int>\d+)|\{(?P<expr>[^{}]*)\}|(?P<sym>[()<>^*]))")


def parse_pattern(text: str) -> Node:
    """Parse a pattern; ``ParameterError`` names the offending column."""
    tokens = _tokenize(text)
    node, pos = _parse_seq(tokens, 0, text)
    if pos != len(tokens):
        raise ParameterError(f"pattern {text!r}: unexpected {tokens[pos][1]!r} at column {tokens[pos][2] + 1}")
    return node


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if not match:
            column = pos + len(text[pos:]) - len(text[pos:].lstrip()) + 1
            raise ParameterError(f"pattern {text!r}: cannot read column {column} "
                                 "(expected F, B, I, W, a group, ^count or *)")
        kind = match.lastgroup
        out.append((kind, match.group(kind), match.start(kind) - (1 if kind == "expr" else 0)))
        pos = match.end()
    return out


def _parse_seq(tokens, pos, text):
    items = []
    while pos < len(tokens) and tokens[pos][1] not in (")", ">"):
        atom, pos = _parse_atom(tokens, pos, text)
        if pos < len(tokens) and tokens[pos][1] == "*":
            atom, pos = Repeat(atom, None), pos + 1
        elif pos < len(tokens) and tokens[pos][1] == "^":
            if pos + 1 >= len(tokens) or tokens[pos + 1][0] not in ("int", "expr"):
                raise ParameterError(f"pattern {text!r}: '^' at column {tokens[pos][2] + 1} "
                                     "needs a count like ^3 or ^{p-1-r}")
            count = tokens[pos + 1][1]
            check_count(count, f"pattern {text!r}", column=tokens[pos + 1][2] + 1)
            atom, pos = Repeat(atom, count), pos + 2
        items.append(atom)
    return (items[0] if len(items) == 1 else Cat(tuple(items))), pos


def _parse_atom(tokens, pos, text):
    kind, value, col = tokens[pos]
    if kind == "letter":
        return _letter(value), pos + 1
    if value == "(":
        node, pos = _parse_seq(tokens, pos + 1, text)
        if pos >= len(tokens) or tokens[pos][1] != ")":
            raise ParameterError(f"pattern {text!r}: '(' at column {col + 1} is never closed")
        return node, pos + 1
    if value == "<":
        letters = []
        pos += 1
        while pos < len(tokens) and tokens[pos][0] == "letter":
            letters.append(_letter(tokens[pos][1]))
            pos += 1
        if pos >= len(tokens) or tokens[pos][1] != ">" or len(letters) < 2:
            raise ParameterError(f"pattern {text!r}: '<' at column {col + 1} needs two or more "
                                 "letters and a closing '>'")
        return Together(tuple(letters)), pos + 1
    raise ParameterError(f"pattern {text!r}: unexpected {value!r} at column {col + 1}")


def _letter(value: str) -> Letter:
    return Letter(value[0], int(value[1:]) if len(value) > 1 else None)


# ---------------------------------------------------------------- counts

_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
            ast.USub, ast.Constant, ast.Name, ast.Load, ast.Call)
VARIABLES = ("p", "r", "m", "v", "g", "n", "s")


def check_count(source: str, context: str, column: int | None = None,
                 variables: tuple[str, ...] = VARIABLES) -> None:
    """Reject anything but integer arithmetic over ``variables``; the message names
    ``context`` and, when given, the column of the count."""
    where = "" if column is None else f" at column {column}"
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ParameterError(f"{context}: count {{{source}}}{where} is not arithmetic") from None
    for node in ast.walk(tree):
        ok = isinstance(node, _ALLOWED)
        if isinstance(node, ast.Name) and node.id not in variables + ("min", "max"):
            ok = False
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name)
                                               and node.func.id in ("min", "max")):
            ok = False
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            ok = False
        if not ok:
            raise ParameterError(f"{context}: count {{{source}}}{where} may use only integers, "
                                 f"+ - * //, min, max and the variables {', '.join(variables)}")


@functools.lru_cache(maxsize=1024)
def _compiled(source: str):
    """A checked count expression compiled once (a weave evaluates each many times)."""
    return compile(ast.parse(source, mode="eval"), "<count>", "eval")


def evaluate_count(source: str, env: Mapping[str, int]) -> int:
    """Evaluate a checked count expression; negative results count as 0."""
    try:
        value = eval(_compiled(source),  # noqa: S307
                     {"__builtins__": {}, "min": min, "max": max}, dict(env))
    except ZeroDivisionError:
        raise ParameterError(f"count {{{source}}} divides by zero for "
                             + ", ".join(f"{k}={v}" for k, v in env.items())) from None
    return max(0, int(value))


# ---------------------------------------------------------------- interpretation


_NONE: deque = deque()  # a chunk without units (never added to)


class RankStreams:
    """One rank's work, in the order the streams hand it out.

    ``forwards``/``backwards`` are ``(chunk, stage, mb)`` lists in weave order. Popping
    any letter marks the unit used, so mixed letters (``F`` and ``F0``) share the work.
    Mutable, but private to one ``weave`` call."""

    def __init__(self, forwards, backwards) -> None:
        self._order = {FORWARD: list(forwards), BACKWARD: list(backwards)}
        self._next = {FORWARD: 0, BACKWARD: 0}
        self._by_chunk = {kind: {} for kind in self._order}
        for kind, units in self._order.items():
            for unit in units:
                self._by_chunk[kind].setdefault(unit[0], deque()).append(unit)
        self._used: set = set()
        self._weights: deque = deque()

    @property
    def forwards(self) -> tuple:
        return tuple(self._order[FORWARD])

    @property
    def backwards(self) -> tuple:
        return tuple(self._order[BACKWARD])

    def pop(self, letter: Letter) -> Compute | None:
        if letter.kind == WEIGHT_GRAD:
            return self._pop_weight(letter.chunk)
        kind = FORWARD if letter.kind == FORWARD else BACKWARD
        unit = self._take(kind, letter.chunk)
        if unit is None:
            return None
        chunk, stage, mb = unit
        if letter.kind == INPUT_GRAD:
            self._weights.append(unit)
        return Compute(letter.kind, stage, mb)

    def _take(self, kind, chunk):
        if chunk is None:
            order, i = self._order[kind], self._next[kind]
            while i < len(order) and (kind, order[i]) in self._used:
                i += 1
            self._next[kind] = i
            unit = order[i] if i < len(order) else None
        else:
            queue = self._by_chunk[kind].get(chunk, _NONE)
            while queue and (kind, queue[0]) in self._used:
                queue.popleft()
            unit = queue[0] if queue else None
        if unit is not None:
            self._used.add((kind, unit))
        return unit

    def _pop_weight(self, chunk):
        for i, unit in enumerate(self._weights):
            if chunk is None or unit[0] == chunk:
                del self._weights[i]
                return Compute(WEIGHT_GRAD, unit[1], unit[2])
        return None

    def leftover(self) -> list[str]:
        left = [f"{s}{'F' if k == FORWARD else 'B'}{mb}" for k, units in self._order.items()
                for (_, s, mb) in units if (k, (_, s, mb)) not in self._used]
        left += [f"{s}W{mb}" for (_, s, mb) in self._weights]
        return left


def weave_rank(node: Node, streams: RankStreams, env: Mapping[str, int]) -> list[Op]:
    """Read ``node`` against ``streams``; return the rank's steps. Raises
    ``ParameterError`` when the pattern leaves work unscheduled."""
    out: list[Op] = []
    _run(node, streams, env, out)
    left = streams.leftover()
    if left:
        raise ParameterError(f"pattern leaves {len(left)} ops unscheduled on rank {env['r']} "
                             f"(first: {left[0]})")
    return out


def _run(node: Node, streams: RankStreams, env, out: list[Op]) -> int:
    if isinstance(node, Letter):
        op = streams.pop(node)
        if op is None:
            return 0
        out.append(op)
        return 1
    if isinstance(node, Together):
        ops = [op for op in (streams.pop(l) for l in node.letters) if op is not None]
        if ops:
            out.append(ops[0] if len(ops) == 1 else Overlap(tuple(ops)))
        return len(ops)
    if isinstance(node, Cat):
        return sum(_run(item, streams, env, out) for item in node.items)
    popped = 0
    if node.count is None:
        while (k := _run(node.body, streams, env, out)) > 0:
            popped += k
        return popped
    for _ in range(evaluate_count(node.count, env)):
        k = _run(node.body, streams, env, out)
        if k == 0:  # streams only shrink: a body that popped nothing never will again
            break
        popped += k
    return popped
