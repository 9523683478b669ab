"""What the checker is given besides the plan: the witness's untrusted numbers
(``Witness``, refused unless each field holds tuples of the right exact types) and the
memory sizes the obligations sum (``Sizes``, exact and >= 0)."""

from __future__ import annotations

import operator
from itertools import chain, repeat
from operator import attrgetter

import attrs
import numpy as np

from ..ir import Plan
from .columns import EXACT, exact, ints, pick
from .rules import RECV, rules_of


@attrs.frozen
class Witness:
    """Untrusted numbers for the obligations. ``finish[r][k]``: completion time of the
    k-th comm step of rank r; ``producers[r]``: for each op in order and each of its
    inputs in sorted token order, the position that produced it; ``levels[r]``: the
    memory level before each step that allocates or frees something, then after the
    last; ``peaks[r]``: the claimed peak and ``peak_at[r]`` the position of the step that
    reaches it (-1: the static part, for an empty program)."""

    finish: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 2, (int,)))
    producers: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 2, (int,)))
    levels: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 2, EXACT))
    peaks: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 1, EXACT))
    peak_at: tuple = attrs.field(validator=lambda _, a, v: _numbers(a.name, v, 1, (int,)))


@attrs.frozen
class Sizes:
    """Memory sizes, exact and >= 0: ``stored[(segment, stage)]`` (default 1),
    ``buffer[payload]`` the receive buffer of a payload (default 0), ``static[rank]``
    (default 0)."""

    stored: dict = attrs.field(factory=dict)
    buffer: dict = attrs.field(factory=dict)
    static: tuple = ()

    def __attrs_post_init__(self) -> None:
        values = (*self.stored.values(), *self.buffer.values(), *self.static)
        if not all(type(v) in EXACT and v >= 0 for v in values):
            raise ValueError("memory sizes must be exact numbers >= 0")

    @classmethod
    def of(cls, plan: Plan, model) -> Sizes:
        """Sizes from a memory model with ``stored(stage, segment)``, ``buffer(payload)``,
        ``rng_state`` and ``static_of(rank)``, for every key the plan mentions: a receive
        buffer holds its payload, and a shipped raw input also the RNG state it ran with.
        The model is asked once per receive (it is a function of the payload)."""
        rules = rules_of(plan)
        stored = {(seg, s): exact(model.stored(s, seg)) for seg, s in rules.units}
        got = list(map(attrgetter("payload"), pick(rules.ops, np.flatnonzero(rules.kind == RECV))))
        rng = map({"input": model.rng_state}.get, map(attrgetter("kind"), got), repeat(0))
        size = list(map(operator.add, map(model.buffer, got), rng))
        if set(map(type, size)) - {int, float}:  # else 0 and 0.0 are the only zeros
            size = list(map(exact, size))
        keep = np.flatnonzero(ints(map(bool, size)))
        got, size = pick(got, keep), pick(size, keep)
        typed = list(zip(map(type, size), size))
        once = {x: exact(x[1]) for x in dict.fromkeys(typed)}  # once per distinct number
        return cls(stored, dict(zip(got, map(once.__getitem__, typed))),
                   tuple(exact(model.static_of(r)) for r in range(plan.num_ranks)))


def _numbers(name: str, value, depth: int, kinds: tuple) -> None:
    """``value`` is None, or tuples nested ``depth`` deep holding only ``kinds``."""
    if value is None:
        return
    rows = (value,) if depth == 1 else value
    if type(value) is not tuple or set(map(type, rows)) - {tuple} or set(
            map(type, chain.from_iterable(rows))) - set(kinds):
        raise ValueError(f"witness {name} must be tuples of {' or '.join(k.__name__ for k in kinds)}")
