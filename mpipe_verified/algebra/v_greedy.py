"""V-Half and V-Min: zero-bubble's greedy V schedules (Qi et al., "Pipeline Parallelism
with Controllable Memory", arXiv 2405.15362), as the reference generator builds them
(sail-sg/zero-bubble-pipeline-parallelism, ``megatron/core/pipeline_parallel/zerobubble/
scheduler/zbv_greedy.py`` at 064369d6a5c670cc20480a201363e3c0a4ec0246), re-stated here
from reading it.

Each rank ``i`` of ``p`` holds the V's chunks 0 (stage ``i``) and 1 (stage ``2p-1-i``)
and has four op lists, each a list of integer time slots, one per microbatch: ``F`` of
chunk 0, ``F`` of chunk 1, the input gradient ``I`` of chunk 1 and ``I`` of chunk 0. The
*stable pattern* gives microbatch 0's slots (microbatch ``k``: ``+6k``):

- V-Min (``gap = 2`` when ``3 | p``, else 0): ``i, 2p-1-i, 2p+gap+i, 4p+gap-1-i``;
- V-Half (``gap = 3`` when ``2 | p``, else 0): ``2i, 3p-2-i, 3p+gap+2i-1, 6p+gap-2-i``.

Then, as the reference does: (1) ``fill_w`` puts one weight-gradient list (``W`` of
either chunk) into the free slots; (2) ``squeeze`` moves each op, in slot order, to the
earliest free slot after what it waits for that keeps every rank's peak within the
pattern's, except from the first chunk-0 ``I`` of rank 0 to the first chunk-0 ``F`` of
the last microbatch (the steady phase, kept); (3) ``eager`` re-times everything with
unit costs; (1-3) again without the ``W`` list, with the warmup kept as well; then the
two ``W`` lists (chunk 1's first where both wait) go into the free slots. A rank's order
is its ops by slot; it does not depend on the costs. Each peak is recounted over the
rank's slots for every slot tried: about a second at p = 16, m = 64.
"""

from __future__ import annotations

import heapq

from ..ir import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Compute

F0, F1, I1, I0, W_ANY = 0, 1, 2, 3, 4  # list indices; with two W lists: 4 = chunk 1, 5 = chunk 0
KEPT_MEMORY = (1, 1, 0, 0, -1)  # stored activations per list (one W list)


def stable_pattern(kind: str, p: int) -> list[list[int]]:
    """Microbatch 0's slots per rank: ``[F0, F1, I1, I0]``."""
    if kind == "min":
        gap = 2 if p % 3 == 0 else 0
        return [[i, 2 * p - i - 1, 2 * p + gap + i, 4 * p + gap - i - 1] for i in range(p)]
    gap = 3 if p % 2 == 0 else 0
    return [[2 * i, 3 * p - i - 2, 3 * p + gap + 2 * i - 1, 6 * p + gap - i - 2]
            for i in range(p)]


def _next(lists, heads, kinds) -> tuple[int, int]:
    """``(slot, list)`` of the earliest head among ``kinds`` (ties: the lower list)."""
    best = None
    for t in kinds:
        slot = lists[t][heads[t]] if heads[t] < len(lists[t]) else None
        if slot is not None and (best is None or (slot, t) < best):
            best = (slot, t)
    return best if best is not None else (None, -1)


def fill_w(lists: list[list[int]], split: bool) -> list[list[int]]:
    """``lists`` (F0, F1, I1, I0) with ``W`` lists: sweeping slots ``0..last``, a slot
    whose turn holds no op takes a waiting ``W`` (``split``: chunk 1's first, each chunk
    its own list); the rest follow the last slot."""
    out = [list(x) for x in lists] + [[] for _ in range(2 if split else 1)]
    last = max(x[-1] for x in lists)
    waiting, heads = [0, 0], [0] * 4
    slot = 0
    for slot in range(last + 1):
        at, t = _next(out, heads, range(4))
        if at == slot:
            heads[t] += 1
            if t in (I1, I0):
                waiting[t - I1 if split else 0] += 1
            continue
        for w in (0, 1):
            if waiting[w]:
                out[4 + w].append(slot)
                waiting[w] -= 1
                break
    for w in (0, 1):
        while waiting[w]:
            slot += 1
            out[4 + w].append(slot)
            waiting[w] -= 1
    return out


def peak(lists: list[list[int]]) -> int:
    """A rank's peak stored activations over its slots (without ``W`` lists, a waiting
    ``W`` frees one at each slot whose turn holds no op)."""
    has_w = len(lists) > 4
    last = max(x[-1] for x in lists)
    heads = [0] * len(lists)
    level = top = waiting = 0
    for slot in range(last + 1):
        at, t = _next(lists, heads, range(len(lists)))
        if at == slot:
            heads[t] += 1
            level += KEPT_MEMORY[t]
            waiting += t in (I1, I0)
        elif not has_w and waiting:
            level -= 1
            waiting -= 1
        top = max(top, level)
    return top


def _slot_order(ranks: list[list[list[int]]]):
    """Every op ``(slot, rank, list, mb)`` in slot order (ties: rank, list, mb), read
    lazily: a list's next op joins when its previous one is taken."""
    heap = [(ops[0], r, t, 0) for r, lists in enumerate(ranks) for t, ops in enumerate(lists)
            if ops]
    heapq.heapify(heap)
    while heap:
        slot, r, t, mb = heapq.heappop(heap)
        yield slot, r, t, mb
        if mb + 1 < len(ranks[r][t]):
            heapq.heappush(heap, (ranks[r][t][mb + 1], r, t, mb + 1))


def _sources(p: int, r: int, t: int, mb: int) -> list[tuple[int, int, int]]:
    """The ops ``(rank, list, mb)`` that op ``(r, t, mb)`` waits for: the neighbour's
    same op (chunk-0 F and chunk-1 I come from rank r-1; chunk-1 F and chunk-0 I from
    r+1), the same rank's previous list (F0 -> F1 -> I1 -> I0) and the previous
    microbatch of its own list."""
    out = []
    if t in (F0, I1) and r > 0:
        out.append((r - 1, t, mb))
    if t in (F1, I0) and r + 1 < p:
        out.append((r + 1, t, mb))
    if 0 < t < 4:
        out.append((r, t - 1, mb))
    if mb > 0:
        out.append((r, t, mb - 1))
    return out


def _needs(ranks, r: int, t: int, mb: int) -> list[int]:
    """Slots of what ``(r, t, mb)`` waits for (``_sources``; a ``W`` also waits for its
    rank's ``mb``-th input gradient in slot order)."""
    out = [ranks[q][u][k] for q, u, k in _sources(len(ranks), r, t, mb)]
    if t == W_ANY:
        out.append(sorted(ranks[r][I1] + ranks[r][I0])[mb])
    return out


def eager(ranks) -> list[list[list[int]]]:
    """Unit-cost start times: each op in slot order starts when what it waits for
    (``_sources``, not a ``W``'s input gradient) and its rank's previous op have ended."""
    end: dict = {}
    busy: list = [None] * len(ranks)
    for _, r, t, mb in _slot_order(ranks):
        deps = _sources(len(ranks), r, t, mb) + ([busy[r]] if busy[r] is not None else [])
        end[(r, t, mb)] = max((end[d] for d in deps), default=0) + 1
        busy[r] = (r, t, mb)
    return [[[end[(r, t, mb)] - 1 for mb in range(len(ops))] for t, ops in enumerate(lists)]
            for r, lists in enumerate(ranks)]


def squeeze(ranks, with_w: bool) -> list[list[list[int]]]:
    """One reordering pass (see the module docstring); returns the eager times."""
    ranks = [fill_w(lists, False) if with_w else [list(x) for x in lists] for lists in ranks]
    bound = max(peak(lists) for lists in ranks)
    taken = [set() for _ in ranks]
    m = len(ranks[0][F0])
    phase = 0
    for slot, r, t, mb in _slot_order(ranks):
        if t == I0 and r == 0 and phase == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not with_w):
            if phase == 1 and t == F0 and mb == m - 1:
                phase = 2
            taken[r].add(slot)
            continue
        earliest = max([-1] + _needs(ranks, r, t, mb)) + 1
        assert earliest <= slot
        for free in range(earliest, slot):
            if free not in taken[r]:
                ranks[r][t][mb] = free
                if peak(ranks[r]) <= bound:
                    break
        else:
            ranks[r][t][mb] = slot
        taken[r].add(ranks[r][t][mb])
    if not with_w:
        ranks = [fill_w(lists, False) for lists in ranks]
    return eager(ranks)


def orders(kind: str, p: int, m: int) -> list[list[Compute]]:
    """Each rank's compute order of V-``kind`` (``half`` or ``min``) on ``p`` ranks and
    ``m`` microbatches; stage ``i`` and ``2p-1-i`` on rank ``i``."""
    start = [[list(range(x, x + 6 * m, 6)) for x in rank] for rank in stable_pattern(kind, p)]
    first = [lists[:4] for lists in squeeze(start, with_w=True)]
    second = [fill_w(lists[:4], True) for lists in squeeze(first, with_w=False)]
    out = []
    for i, lists in enumerate(second):
        stage = (i, 2 * p - 1 - i, 2 * p - 1 - i, i, 2 * p - 1 - i, i)
        kinds = (FORWARD, FORWARD, INPUT_GRAD, INPUT_GRAD, WEIGHT_GRAD, WEIGHT_GRAD)
        steps = sorted((slot, t, mb) for t, ops in enumerate(lists) for mb, slot in enumerate(ops))
        out.append([Compute(kinds[t], stage[t], mb) for _, t, mb in steps])
    return out
