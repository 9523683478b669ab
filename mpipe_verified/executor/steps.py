"""A rank's program as the interpreter's steps: what each op reads, which values it leaves
for later ops, and which stored activations it holds and frees.

Values (``out``, ``grad``, ``input``, ``params``, ``wgrad_ready``, ``wdone``) are the
shared semantics' tokens (``Chain.needs``/``produces``): a produced value is kept only if
a later op of the rank reads it, and dropped after its last reader.

Stored activations (``stored`` tokens: the graph a forward keeps for its backward) are
counted by the memory rule the verifier counts with, ``semantics.step_effects``: held from
the step that allocates one (a forward or recompute where the chain stores it) until the
step that frees it (``B``, or ``W`` after a split backward), so the count at each step is
the unit memory model's, and a forward that allocates none runs without building a graph.
The saved value itself, like any value, is dropped after its last reader: after a split
backward's ``I``, ``W`` needs only the weight work ``I`` left (``wgrad_ready``), so the
stage output and inputs ``I`` read are not kept for it.
"""

from __future__ import annotations

import attrs

from ..ir import Overlap, Send, computes_of, p2p_of
from ..semantics import UNIT_MEMORY, Chain, produces, step_effects

STORED = "stored"  # the token kind (and memory key) of a stored activation


@attrs.frozen
class Step:
    """One op of the rank's program, compiled. ``needs``: tokens read (checked present
    first); ``keep``: produced values some later op reads; ``drop``: values whose last
    reader this is; ``holds``/``frees``: stored activations this step allocates / frees
    (``step_effects``); ``members``: an ``Overlap``'s per-member needs; ``segments``: the
    segments its computes run (a source reads its own part of a per-source gradient);
    ``p2p``: per send/receive ``(is_send, payload, peer, token)``; ``where``/``peers``:
    for messages."""

    index: int
    op: object
    needs: tuple
    keep: frozenset
    drop: tuple
    holds: tuple
    frees: tuple
    members: tuple = ()
    segments: tuple = ()
    p2p: tuple = ()
    where: str = ""
    peers: str = ""


def compile_steps(program, rank: int, chain: Chain) -> tuple[Step, ...]:
    """The steps of ``program`` (rank ``rank``'s) under ``chain``."""
    needs = [chain.needs(op, rank) for op in program]
    last: dict = {}
    for index, tokens in enumerate(needs):
        for t in tokens:
            last[t] = index
    return tuple(_step(index, op, needs[index], last, rank, chain)
                 for index, op in enumerate(program))


def _step(index: int, op, needs: tuple, last: dict, rank: int, chain: Chain) -> Step:
    allocs, frees = step_effects(op, rank, chain, UNIT_MEMORY.stored, UNIT_MEMORY.received)
    p2p = p2p_of(op)
    return Step(
        index, op, needs,
        keep=frozenset(t for t in chain.produces(op)  # with sequence chunks' kv, kv_grad
                     if t[0] != STORED and last.get(t, -1) > index),
        drop=tuple(dict.fromkeys(t for t in needs if last[t] == index)),
        holds=tuple(key for key, _ in allocs if key[0] == STORED),
        frees=tuple(key for key in frees if key[0] == STORED),
        members=(tuple(chain.needs(c, rank) for c in op.ops) if isinstance(op, Overlap)
                 else ()),
        segments=tuple(c.segment for c in computes_of(op) if c.segment),
        p2p=tuple((type(c) is Send, c.payload, c.peer,
                   chain.needs(c, rank)[0] if type(c) is Send else produces(c)[0])
                  for c in p2p),
        where=f"{op} at position {index}",
        peers=", ".join(f"rank {r}" for r in sorted({c.peer for c in p2p})))
