"""Random valid algebra terms, lowered plans, and one-edit mutations of plans.

Everything is written once against a tiny *chooser* interface (``int(lo, hi)`` inclusive,
``pick(seq)``) so the same generators serve Hypothesis (``DrawChooser``: every choice is
a ``draw``, so failures shrink) and the seeded soundness benchmark (``RandomChooser``
over ``random.Random``; ``benchmarks/soundness.py``).

Valid terms (``random_term`` / ``terms()``), on ``p`` in 1..6 ranks and at most 12
microbatches in all:

- bases: every family of ``algebra.families`` with valid parameters (``dualpipev`` needs
  ``m >= 2p``; the ``CHUNKED`` families take 2..3 chunks, ``hanayo`` 1..2 waves) and the
  hand ``Weave`` patterns of ``HAND_WEAVES`` (each checked to run for every p <= 6,
  m <= 12), each in a stream order of ``orders_for`` (``order`` dfs or bfs; ``backward``
  desc too for the all-forwards-first patterns);
- shapes (placements): ``SHAPES`` (looped, V, Hanayo's zigzag) and random explicit
  stage-to-rank maps (``random_map``: every rank 1..v stages, in any order), which carry
  the ``ANY_MAP_WEAVES`` (forwards, then backwards: they run on any map in any order);
- ``SplitBW``, ``MergeBW``, ``DeferW`` (lags ``LAGS``) and ``Relabel`` (a random
  permutation) of a valid term;
- ``Seq(a, b)`` of two valid terms on the same placement;
- ``Par`` of ``Restrict``s over a random partition of the ranks, each block running a
  *local variant* of one valid term (itself, its ``SplitBW``, its ``MergeBW``, a
  ``DeferW`` of its split): those change only the rank's own backward/weight steps, never
  the order in which it sends or needs remote data, so the union still runs.

Transposes (``random_transpose_term``): ``transpose_family`` over a body of
``TRANSPOSE_BODIES`` (1f1b, interleaved-1f1b with 2..3 chunks, zb-h1), p 1..6, m 1..10
(2..10 under a segment mutation, which needs work moved off the home rank),
a source or sink segment, every mode valid for the side (recompute, owner, frozen, none;
a sink is never recompute), every ownership (inline, full, min, cost), default or random
per-microbatch segment costs: lowered plans with a cut.

Plans: ``lower(term.derive())``, optionally decorated with valid ``Group``s (runs of
adjacent comm ops posted together) or with ``Collective``s (the same list, in the same
order, at the start and end of every member rank; ``with_collectives``).

Any plan (``any_plans``): well-typed plans that need not run, every op kind and field,
texts full of the separators the canonical text and the file formats write.

Mutations (``MUTATIONS``; ``mutate(plan, kind, chooser)``), each one edit of a plan:

=====================  ================================================================
``drop``               delete one op (any kind, a group or a collective included)
``duplicate``          insert a copy of one op somewhere on its rank
``swap_adjacent``      exchange two neighbouring (different) ops
``move``               move one op elsewhere on its rank
``swap_sends``         exchange two bare SENDs of one rank that go to different peers
``payload``            change the mb (to another in 0..m, m being one past the end) or
                       the stage of one SEND/RECV payload (group members included)
``reorder_collectives`` exchange two different collectives on one rank
``drop_group``         dissolve a ``Group`` into its members, posted one by one in
                       listed or reversed order
``insert_group``       post a bare comm op together with up to 3 of the next comm ops of
                       its rank (within 4 positions) as one ``Group``, at its position
``drop_all_reduce``    delete a ``grads:NAME`` all-reduce on one rank or on all ranks
``narrow_all_reduce``  take a member q out of a ``grads:NAME`` all-reduce: on every call
                       (q's own call deleted), or on one other rank's call only
``broadcast_root``     give a ``params:NAME`` broadcast another member as root, on every
                       call or on one
``drop_recompute``     delete one ``R``
``move_segment_forward`` move a segment's ``F`` to a random position of another rank
``drop_cut_transfer``  delete one endpoint that crosses the cut (``to_segment`` set, or a
                       recompute's ``input``), or it and its FIFO partner
``edit_cut``           the programs stay, the cut changes: one microbatch's forward or
                       backward rank, or the home, becomes another rank, or the
                       ``recompute`` flag flips (the cut stays well formed)
=====================  ================================================================

The last seven (``SEGMENT_MUTATIONS``) always edit a transpose.

``edit_collective_members`` makes one plain breakage of a collective call
(``COLLECTIVE_EDITS``, kept out of ``MUTATIONS`` so the seeded corpora stay as they are):
one rank's call lists a member twice, or leaves another member out, or a rank outside
the call's set makes the same call too.

A mutant comes with a memory limit (``memory_limit_for``: none, the base plan's highest
unit-model peak, or its per-rank peaks), so edits that raise a peak violate ``memory``.
Comparison helpers (``verifier_verdict``, ``reference_verdict``, ``classify``) are shared
by ``test_verify_fuzz.py`` and the benchmark.
"""

from __future__ import annotations

import random
from typing import Sequence

import attrs
from hypothesis import strategies as st

from mpipe_verified.algebra.families import CHUNKED, FAMILIES, WAVED, family
from mpipe_verified.algebra.terms import (DeferW, MergeBW, Par, Relabel, Restrict, Seq,
                                          SplitBW, Weave)
from mpipe_verified.algebra.transpose import MODES, OWNERSHIPS, transpose_family
from mpipe_verified.ir import (ACT, COLLECTIVE_KINDS, COMPUTE_KINDS, GRAD, INPUT, MARKER_ACTIONS,
                               SINK, SOURCE, Collective, Compute, Cut, Group, Idle, Leaf, Marker,
                               Overlap, Payload, Placement, Plan, Recv, SegmentWork, Send,
                               p2p_of, path_text)
from mpipe_verified.lower import lower
from mpipe_verified.semantics import UNIT_MEMORY, MemoryModel, peak_memory

MAX_P, MAX_M = 6, 12
FAMILY_NAMES = tuple(sorted(FAMILIES))
# (pattern, chunks, placement); every one runs for all p <= 6, m <= 12 (group = p)
HAND_WEAVES = (
    ("F^{p-r} (F B)*", 1, "looped"),
    ("F^{p-1} (F B)*", 1, "looped"),
    ("F^{2*(p-1-r)} (F B)*", 1, "looped"),
    ("F* I* W*", 1, "looped"),
    ("F^{p-1-r} (F I)* W*", 1, "looped"),
    ("F^{p-1-r} (F I W)* (I W)*", 1, "looped"),
    ("F^{p-r} (<F B>)* B*", 1, "looped"),
    ("F* B*", 2, "looped"),
    ("F* B*", 3, "looped"),
    ("F* B*", 2, "v"),
    ("F* (I W)*", 2, "v"),
    ("F0* F1* B1* B0*", 2, "v"),
    ("F0^{2*(p-r)-1} (F1 F0)^{r} (F1 B1)^{p-r} (F0 B0 F1 B1)* B0* B1*", 2, "v"),
)
# patterns that run on any stage-to-rank map in any stream order: each rank's forwards in
# (round, stage) order, then its backwards in (round, stage descending) order
ANY_MAP_WEAVES = ("F* B*", "F* I* W*", "F* (I W)*")
ORDERS = (("dfs", "asc"), ("bfs", "asc"), ("dfs", "desc"), ("bfs", "desc"))


def orders_for(pattern: str) -> tuple[tuple[str, str], ...]:
    """The stream orders ``(order, backward)`` a hand pattern runs in (checked for every
    p <= 6, m <= 12): all four when every forward comes first, else ascending ones."""
    return ORDERS if pattern in ANY_MAP_WEAVES + ("F0* F1* B1* B0*",) else ORDERS[:2]


LAGS = ("0", "1", "2", "r", "p-1-r", "m")
UNARY = ("split", "merge", "defer", "relabel")
SEGMENT_MUTATIONS = ("drop_all_reduce", "narrow_all_reduce", "broadcast_root",
                     "drop_recompute", "move_segment_forward", "drop_cut_transfer",
                     "edit_cut")
MUTATIONS = ("drop", "duplicate", "swap_adjacent", "move", "swap_sends", "payload",
             "reorder_collectives", "drop_group", "insert_group") + SEGMENT_MUTATIONS
TRANSPOSE_BODIES = ("1f1b", "interleaved-1f1b", "zb-h1")
TRANSPOSE_MAX_M = 10
SEGMENT_COSTS = (0.5, 1.0, 2.0, 3.0)


# ---------------------------------------------------------------- choosers


class RandomChooser:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, seq: Sequence):
        seq = list(seq)
        return seq[self.rng.randrange(len(seq))]


class DrawChooser:
    def __init__(self, draw) -> None:
        self.draw = draw

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def pick(self, seq: Sequence):
        return self.draw(st.sampled_from(list(seq)))


# ---------------------------------------------------------------- terms


def family_shape(name: str, chunks: int | None = None) -> tuple[int, str]:
    """``(chunks, placement)`` of a family's derived schedule (``hanayo``: ``chunks`` is
    twice its waves)."""
    if name in CHUNKED:
        return (chunks or 2, "looped")
    if name in WAVED:
        return (2, "v") if chunks == 2 else (chunks or 4, "zigzag")
    if name in ("zbv", "dualpipev", "v-half", "v-min"):
        return (2, "v")
    return (1, "looped")


def _split_free_pattern(pattern: str) -> bool:
    return "I" not in pattern and "W" not in pattern


SPLIT_FREE_FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "hanayo")


def _bases_for(p: int, shape: tuple[int, str], m_max: int, split_free: bool = False
               ) -> list[tuple]:
    """Base term descriptions with this placement shape and room for >= 1 microbatch."""
    v, placement = shape
    out = []
    for name in FAMILY_NAMES:
        chunks = v if name in CHUNKED + WAVED else None
        if family_shape(name, chunks) != shape or (name == "dualpipev" and m_max < 2 * p):
            continue
        if (split_free and name not in SPLIT_FREE_FAMILIES) or chunks == 1:
            continue
        out.append(("family", name, chunks))
    hand = HAND_WEAVES if placement in ("looped", "v") else [
        (pat, v, placement) for pat in ANY_MAP_WEAVES]  # zigzag or an explicit map
    out += [("weave", pat, c, pl) for pat, c, pl in hand
            if (c, pl) == shape and (not split_free or _split_free_pattern(pat))]
    return out


SHAPES = ((1, "looped"), (2, "looped"), (3, "looped"), (2, "v"), (4, "zigzag"))
MAP = "map"  # a shape drawn as a random explicit stage-to-rank map (``random_shape``)


def random_map(ch, p: int) -> tuple[int, str]:
    """``(v, "r0,r1,...")``: every rank holds 1..v stages (v in 1..3), in a random order."""
    v = ch.int(1, 3)
    pool = [r for r in range(p) for _ in range(ch.int(1, v))]
    out = []
    while pool:
        out.append(pool.pop(ch.int(0, len(pool) - 1)))
    return v, ",".join(map(str, out))


def random_shape(ch, p: int) -> tuple[int, str]:
    shape = ch.pick(SHAPES + (MAP,))
    return random_map(ch, p) if shape == MAP else shape


def random_base(ch, p: int, shape: tuple[int, str], m_max: int, split_free: bool = False):
    base = ch.pick(_bases_for(p, shape, m_max, split_free))
    if base[0] == "family":
        _, name, chunks = base
        m = ch.int(2 * p if name == "dualpipev" else 1, m_max)
        if name in WAVED:
            return family(name, p, m, waves=chunks // 2)
        return family(name, p, m, chunks)
    _, pattern, chunks, placement = base
    order, backward = ch.pick(orders_for(pattern))
    return Weave(p, ch.int(1, m_max), pattern, chunks=chunks, placement=placement,
                 order=order, backward=backward)


def local_variants(t) -> list:
    """Terms on ``t``'s placement that differ from ``t`` only in each rank's own
    backward/weight-gradient steps."""
    return [t, SplitBW(t), MergeBW(t), DeferW(SplitBW(t), "1"), DeferW(SplitBW(t), "r")]


def random_term(ch, depth: int = 2, p: int | None = None, shape=None, m_max: int = MAX_M,
                split_free: bool = False):
    """A valid term (see the module docstring). ``split_free``: no ``I``/``W`` anywhere
    (B-only bases under ``Seq``, ``Relabel``, ``MergeBW`` and ``Par`` of ``Restrict``s)."""
    p = ch.int(1, MAX_P) if p is None else p
    shape = random_shape(ch, p) if shape is None else shape
    unary = ("merge", "relabel") if split_free else UNARY
    ops = ["base"] + ((list(unary) + ["seq", "par"]) if depth > 0 else [])
    if m_max < 2 and "seq" in ops:
        ops.remove("seq")
    op = ch.pick(ops)
    if op == "base":
        return random_base(ch, p, shape, m_max, split_free)
    if op == "seq":
        budget = ch.int(1, m_max - 1)
        a = random_term(ch, depth - 1, p, shape, budget, split_free)
        rest = m_max - a.derive().num_microbatches
        b = random_term(ch, depth - 1, p, shape, rest, split_free)
        return Seq(a, b)
    t = random_term(ch, depth - 1, p, shape, m_max, split_free)
    if op == "split":
        return SplitBW(t)
    if op == "merge":
        return MergeBW(t)
    if op == "defer":
        return DeferW(t, ch.pick(LAGS))
    if op == "relabel":
        return Relabel(t, random_permutation(ch, t.derive().num_microbatches))
    # par of restricts over a partition of the ranks
    variants = [t, MergeBW(t)] if split_free else local_variants(t)
    parts = [Restrict(ch.pick(variants), tuple(block)) for block in partition(ch, p)]
    term = parts[-1]
    for part in reversed(parts[:-1]):
        term = Par(part, term)
    return term


def random_permutation(ch, m: int) -> tuple[int, ...]:
    perm = list(range(m))
    for i in range(m - 1, 0, -1):  # Fisher-Yates; all-zero draws shrink to the identity
        j = i - ch.int(0, i)
        perm[i], perm[j] = perm[j], perm[i]
    return tuple(perm)


def partition(ch, p: int, max_blocks: int = 3) -> list[list[int]]:
    """A partition of ``range(p)`` into at most ``max_blocks`` non-empty blocks."""
    k = ch.int(1, min(p, max_blocks))
    labels = [ch.int(0, k - 1) for _ in range(p)]
    blocks = [[r for r in range(p) if labels[r] == b] for b in range(k)]
    return [b for b in blocks if b]


def transpose_modes(side: str) -> tuple[str, ...]:
    """The modes a side takes (central recompute applies to sources only)."""
    return MODES if side == SOURCE else tuple(m for m in MODES if m != "recompute")


# round-robin first: with p >= 2 and m >= 2 the simplest draw already moves work off home
TRANSPOSE_OWNERSHIPS = ("full",) + tuple(o for o in OWNERSHIPS if o != "full")


def random_transpose_term(ch, p: int | None = None, modes: Sequence[str] = MODES,
                          m_min: int = 1):
    """A ``transpose_family`` term: a body of ``TRANSPOSE_BODIES`` (p 1..6, m
    ``m_min``..10, interleaved-1f1b with 2..3 chunks), either side, a mode of ``modes``
    valid for that side, any ownership, and default or random per-microbatch segment
    costs."""
    side = ch.pick([s for s in (SOURCE, SINK) if set(transpose_modes(s)) & set(modes)])
    mode = ch.pick([m for m in transpose_modes(side) if m in modes])
    body = ch.pick(TRANSPOSE_BODIES)
    p = ch.int(1, MAX_P) if p is None else p
    m = ch.int(m_min, TRANSPOSE_MAX_M)
    v = ch.int(2, 3) if body == "interleaved-1f1b" else None
    costs = () if ch.int(0, 1) == 0 else tuple(ch.pick(SEGMENT_COSTS) for _ in range(m))
    return transpose_family(p, m, v, body=body, side=side, mode=mode,
                            ownership=ch.pick(TRANSPOSE_OWNERSHIPS), costs=costs)


@st.composite
def terms(draw, depth: int = 2):
    return random_term(DrawChooser(draw), depth)


@st.composite
def family_terms(draw, names: Sequence[str] = FAMILY_NAMES):
    name = draw(st.sampled_from(list(names)))
    p = draw(st.integers(1, MAX_P))
    m = draw(st.integers(2 * p if name == "dualpipev" else 1, MAX_M))
    v = draw(st.integers(2, 3)) if name in CHUNKED else None
    waves = draw(st.integers(1, 2)) if name in WAVED else None
    return family(name, p, m, v, waves=waves)


@st.composite
def split_free_terms(draw, depth: int = 2):
    """Valid terms without ``I``/``W`` anywhere."""
    return random_term(DrawChooser(draw), depth, split_free=True)


# ---------------------------------------------------------------- plans


def lowered(term) -> Plan:
    return lower(term.derive())


@st.composite
def plans(draw, depth: int = 2):
    """``(term, lower(term.derive()))`` for a valid term."""
    t = draw(terms(depth))
    return t, lowered(t)


def with_groups(plan: Plan, ch) -> Plan:
    """Post some runs of adjacent bare comm ops as one ``Group`` each (a valid edit: a
    group only posts later ops earlier, and lowered plans never relay received data)."""
    programs = []
    for program in plan.programs:
        out, i = [], 0
        while i < len(program):
            j = i
            while j < len(program) and isinstance(program[j], (Send, Recv)):
                j += 1
            if j - i >= 2 and ch.int(0, 1) == 0:
                out.append(Group(tuple(program[i:j])))
                i = j
            else:
                out.append(program[i])
                i += 1
        programs.append(tuple(out))
    return attrs.evolve(plan, programs=tuple(programs))


def collective_menu(p: int) -> list[tuple[Collective, str]]:
    """Collectives a training step may call, with where they go (``start``/``end``)."""
    everyone = tuple(range(p))
    menu = [(Collective("broadcast", everyone, "params", root=0), "start"),
            (Collective("all_reduce", everyone, "grads"), "end"),
            (Collective("gather", everyone, "loss", root=p - 1), "end")]
    if p >= 2:
        menu += [(Collective("all_reduce", (0, p - 1), "tied"), "end"),
                 (Collective("broadcast", (p - 1, 0), "embed", root=0), "start")]
    if p >= 3:
        menu.append((Collective("all_reduce", tuple(range(1, p)), "norm"), "end"))
    return menu


def with_collectives(plan: Plan, ch) -> Plan:
    """A hand-made plan with collectives: 1-4 collectives of ``collective_menu``, each
    called by every member, in one global order, at the start or the end."""
    menu = collective_menu(plan.num_ranks)
    chosen = []
    for _ in range(ch.int(2, min(4, len(menu)))):  # distinct ones, in a random order
        chosen.append(ch.pick([c for c in menu if c not in chosen]))
    programs = []
    for rank, program in enumerate(plan.programs):
        head = tuple(c for c, where in chosen if where == "start" and rank in c.ranks)
        tail = tuple(c for c, where in chosen if where == "end" and rank in c.ranks)
        programs.append(head + program + tail)
    return attrs.evolve(plan, programs=tuple(programs))


def decorate(plan: Plan, ch, how: str) -> Plan:
    if how == "groups":
        return with_groups(plan, ch)
    if how == "collectives":
        return with_collectives(plan, ch)
    return plan


# ---------------------------------------------------------------- any plan
#
# ``any_plans``: well-typed plans that need not run, every field of every op kind at
# defaults and not (``shape`` ``()`` and ``None``, ``to_segment`` ``""`` and ``None``,
# ``dtype`` ``"None"`` and None), texts of any Unicode character, often the separators
# and quotes the canonical text and the file formats write.

SEPARATORS = tuple(',;:()[]<>|@="\\\n %')
texts = st.text(st.sampled_from(SEPARATORS) | st.characters(codec="utf-8"), max_size=4) \
    | st.sampled_from(["None", "vision", "0F1", "x:0F1", "float32"])
_index = st.integers(0, 40)
_shapes = st.none() | st.tuples() | st.lists(st.integers(0, 2**40), max_size=3).map(tuple)
_steps = st.one_of(st.tuples(st.sampled_from(["tuple", "list"]), st.integers(0, 12)),
                   st.tuples(st.just("dict"), texts))
_leaves = st.builds(Leaf, st.lists(_steps, max_size=3).map(path_text)) | st.builds(
    Leaf, st.lists(_steps, max_size=3).map(path_text),
    st.lists(st.integers(0, 2**40), max_size=3).map(tuple), st.sampled_from(["int64", "bool"]))
_payloads = st.builds(Payload, st.sampled_from([ACT, GRAD, INPUT]), _index, _index, texts,
                      _shapes, st.none() | st.sampled_from(["float32", "bfloat16", ""]) | texts,
                      st.none() | texts) \
    | st.builds(Payload, st.sampled_from([ACT, GRAD]), _index, _index, texts, st.none(),
                st.none(), st.none() | texts, st.lists(_leaves, max_size=3).map(tuple))
_computes = st.builds(Compute, st.sampled_from(COMPUTE_KINDS), _index, _index, texts)
_p2p = st.builds(Send, _index, _payloads) | st.builds(Recv, _index, _payloads)
any_ops = st.one_of(
    _computes, _p2p,
    st.builds(Overlap, st.lists(_computes, min_size=1, max_size=3).map(tuple)),
    st.builds(Group, st.lists(_p2p, min_size=1, max_size=3).map(tuple)),
    st.builds(Collective, st.sampled_from(COLLECTIVE_KINDS),
              st.lists(_index, max_size=4).map(tuple), texts, st.none() | _index),
    st.just(Idle()),
    st.builds(Marker, _index, st.sampled_from(MARKER_ACTIONS), st.none() | _index))


@st.composite
def any_plans(draw):
    """A well-typed plan of 1-3 ranks (see above), with a cut of up to two segments."""
    ranks = draw(st.integers(1, 3))
    m = draw(st.integers(0, 3))
    per_mb = st.lists(st.integers(0, ranks - 1), min_size=m, max_size=m).map(tuple)
    segments = draw(st.lists(st.builds(SegmentWork, texts.filter(bool),
                                       st.sampled_from([SOURCE, SINK]), per_mb,
                                       st.none() | per_mb, st.booleans(),
                                       st.integers(0, ranks - 1), st.booleans(), st.booleans()),
                             max_size=2, unique_by=lambda s: s.name))
    body = st.lists(st.integers(0, ranks - 1), min_size=1 if segments else 0, max_size=4)
    placement = Placement(tuple(draw(body)), ranks)  # a cut has a body to feed
    programs = tuple(tuple(draw(st.lists(any_ops, max_size=6))) for _ in range(ranks))
    return Plan(placement, m, programs, Cut(tuple(segments)), draw(st.booleans()))


# ---------------------------------------------------------------- mutations


def _replace(plan: Plan, rank: int, program) -> Plan:
    """``plan`` (its cut included) with rank ``rank``'s program replaced."""
    programs = list(plan.programs)
    programs[rank] = tuple(program)
    return attrs.evolve(plan, programs=tuple(programs))  # the cut stays


def _positions(plan: Plan, test) -> list[tuple[int, int]]:
    return [(r, i) for r, prog in enumerate(plan.programs) for i, op in enumerate(prog)
            if test(op)]


def _send_pairs(plan: Plan) -> list[tuple[int, int, int]]:
    out = []
    for r, prog in enumerate(plan.programs):
        sends = [(i, op.dst) for i, op in enumerate(prog) if isinstance(op, Send)]
        out += [(r, i, j) for a, (i, d) in enumerate(sends) for j, e in sends[a + 1:] if d != e]
    return out


def _collective_pairs(plan: Plan) -> list[tuple[int, int, int]]:
    out = []
    for r, prog in enumerate(plan.programs):
        coll = [i for i, op in enumerate(prog) if isinstance(op, Collective)]
        out += [(r, i, j) for a, i in enumerate(coll) for j in coll[a + 1:] if prog[i] != prog[j]]
    return out


def _endpoints(plan: Plan) -> list[tuple[int, int, int]]:
    return [(r, i, k) for r, prog in enumerate(plan.programs) for i, op in enumerate(prog)
            for k, _ in enumerate(p2p_of(op))]


def _payload_choices(plan: Plan, op) -> list[tuple[str, int]]:
    p = op.payload
    stages = plan.placement.num_stages
    lo, hi = (0, stages - 2) if p.kind == ACT else (1, stages - 1)
    out = [("mb", mb) for mb in range(plan.num_microbatches + 1) if mb != p.mb]  # m: off by one
    out += [("stage", s) for s in range(lo, hi + 1) if s != p.stage]
    return out


def _tagged(plan: Plan, role: str, kind: str) -> dict[str, list[tuple[int, int]]]:
    """``tag -> [(rank, index)]`` of the ``kind`` collectives tagged ``ROLE:NAME``."""
    out: dict[str, list[tuple[int, int]]] = {}
    for r, i in _positions(plan, lambda op: isinstance(op, Collective) and op.kind == kind
                           and op.tag.startswith(role + ":")):
        out.setdefault(plan.programs[r][i].tag, []).append((r, i))
    return out


def _narrowable(plan: Plan) -> list[tuple[str, int]]:
    """``(grads tag, member)`` pairs: a member of some call of that all-reduce."""
    return sorted({(tag, q) for tag, where in _tagged(plan, "grads", "all_reduce").items()
                   for r, i in where for q in plan.programs[r][i].ranks
                   if len(plan.programs[r][i].ranks) >= 2})


def _rerootable(plan: Plan) -> list[tuple[str, int]]:
    """``(params tag, new root)``: a member of some call that is not that call's root."""
    return sorted({(tag, q) for tag, where in _tagged(plan, "params", "broadcast").items()
                   for r, i in where for q in plan.programs[r][i].ranks
                   if q != plan.programs[r][i].root})


def _cut_endpoints(plan: Plan) -> list[tuple[int, int, int]]:
    """Endpoints that cross the cut (``to_segment`` set) or ship a recompute's input."""
    return [(r, i, k) for r, i, k in _endpoints(plan)
            if p2p_of(plan.programs[r][i])[k].payload.to_segment is not None
            or p2p_of(plan.programs[r][i])[k].payload.kind == INPUT]


def _fifo_partner(plan: Plan, end: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """The endpoint FIFO pairing (k-th send src->dst, k-th receive at dst) gives ``end``."""
    r, i, k = end
    op = p2p_of(plan.programs[r][i])[k]
    src, dst = (r, op.dst) if isinstance(op, Send) else (op.src, r)
    sends, recvs = [], []
    for e in _endpoints(plan):
        x = p2p_of(plan.programs[e[0]][e[1]])[e[2]]
        if isinstance(x, Send) and (e[0], x.dst) == (src, dst):
            sends.append(e)
        elif isinstance(x, Recv) and (x.src, e[0]) == (src, dst):
            recvs.append(e)
    mine, theirs = (sends, recvs) if isinstance(op, Send) else (recvs, sends)
    at = mine.index(end)
    return theirs[at] if at < len(theirs) else None


def _without_endpoints(plan: Plan, ends) -> Plan:
    """``plan`` without these endpoints (a group keeps its other members; an emptied
    group goes)."""
    programs = [list(prog) for prog in plan.programs]
    for r, i, k in sorted(ends, reverse=True):
        op = programs[r][i]
        if isinstance(op, Group):
            rest = op.ops[:k] + op.ops[k + 1:]
            programs[r][i:i + 1] = [Group(rest)] if rest else []
        else:
            del programs[r][i]
    return attrs.evolve(plan, programs=tuple(map(tuple, programs)))


def _edit_calls(plan: Plan, where, edit) -> Plan:
    """``plan`` with the collective at each ``(rank, index)`` replaced by ``edit(rank,
    op)`` (None: deleted)."""
    programs = [list(prog) for prog in plan.programs]
    for r, i in sorted(where, reverse=True):
        new = edit(r, programs[r][i])
        programs[r][i:i + 1] = [] if new is None else [new]
    return attrs.evolve(plan, programs=tuple(map(tuple, programs)))


COLLECTIVE_EDITS = ("member_twice", "member_left_out", "non_member_call")


def edit_collective_members(plan: Plan, ch) -> tuple[Plan, str]:
    """One ``COLLECTIVE_EDITS`` edit of a collective call of ``plan`` (which has one):
    the mutant and a one-line description."""
    r, i = ch.pick(_positions(plan, lambda op: isinstance(op, Collective)))
    op = plan.programs[r][i]
    others = [q for q in op.ranks if q != r]
    outside = [q for q in range(plan.num_ranks) if q not in op.ranks]
    kind = ch.pick(["member_twice"] + (["member_left_out"] if others else [])
                   + (["non_member_call"] if outside else []))
    if kind == "non_member_call":
        q = ch.pick(outside)
        prog = list(plan.programs[q])
        j = ch.int(0, len(prog))
        prog.insert(j, op)
        return _replace(plan, q, prog), f"non-member rank {q} calls {op} at #{j}"
    if kind == "member_twice":
        new = attrs.evolve(op, ranks=op.ranks + (ch.pick(op.ranks),))
    else:
        q = ch.pick(others)
        new = attrs.evolve(op, ranks=tuple(x for x in op.ranks if x != q))
    return _edit_calls(plan, [(r, i)], lambda *_: new), f"rank {r} #{i} {op} -> {new}"


def _edit_cut(plan: Plan, ch) -> tuple[Plan, str]:
    """One field of one segment of the cut changed (see ``edit_cut``)."""
    at = ch.int(0, len(plan.cut.segments) - 1)
    seg = plan.cut.segments[at]
    name = ch.pick(["home", "forward_rank", "recompute"]
                   + (["backward_rank"] if seg.backward_rank is not None else []))
    if name == "home":
        value = ch.pick([r for r in range(plan.num_ranks) if r != seg.home])
    elif name == "recompute":
        value = not seg.recompute
    else:
        ranks = list(getattr(seg, name))
        mb = ch.int(0, len(ranks) - 1)
        ranks[mb] = ch.pick([r for r in range(plan.num_ranks) if r != ranks[mb]])
        value = tuple(ranks)
    segments = list(plan.cut.segments)
    segments[at] = attrs.evolve(seg, **{name: value})
    return (attrs.evolve(plan, cut=attrs.evolve(plan.cut, segments=tuple(segments))),
            f"cut: {seg.name}.{name} = {value}")


def _segment_applicable(plan: Plan) -> list[str]:
    out = []
    if _tagged(plan, "grads", "all_reduce"):
        out.append("drop_all_reduce")
    if _narrowable(plan):
        out.append("narrow_all_reduce")
    if _rerootable(plan):
        out.append("broadcast_root")
    if _positions(plan, lambda op: isinstance(op, Compute) and op.kind == "R"):
        out.append("drop_recompute")
    if plan.num_ranks >= 2 and _positions(plan, lambda op: isinstance(op, Compute)
                                          and op.segment and op.kind == "F"):
        out.append("move_segment_forward")
    if _cut_endpoints(plan):
        out.append("drop_cut_transfer")
    if plan.cut.segments and plan.num_ranks >= 2:
        out.append("edit_cut")
    return out


def applicable(plan: Plan) -> list[str]:
    """The mutation kinds that can edit ``plan``."""
    lengths = [len(prog) for prog in plan.programs]
    out = []
    if max(lengths, default=0) >= 1:
        out += ["drop", "duplicate"]
    if any(any(a != b for a, b in zip(prog, prog[1:])) for prog in plan.programs):
        out += ["swap_adjacent", "move"]
    if _send_pairs(plan):
        out.append("swap_sends")
    if any(_payload_choices(plan, p2p_of(plan.programs[r][i])[k])
           for r, i, k in _endpoints(plan)):
        out.append("payload")
    if _collective_pairs(plan):
        out.append("reorder_collectives")
    if _positions(plan, lambda op: isinstance(op, Group)):
        out.append("drop_group")
    if _positions(plan, lambda op: isinstance(op, (Send, Recv))):
        out.append("insert_group")
    return out + _segment_applicable(plan)


def mutate(plan: Plan, kind: str, ch) -> tuple[Plan, str]:
    """One edit of ``kind`` (which must be in ``applicable(plan)``); returns the mutant
    and a one-line description."""
    progs = plan.programs
    if kind in ("drop", "duplicate"):
        r = ch.pick([r for r, prog in enumerate(progs) if prog])
        prog = list(progs[r])
        i = ch.int(0, len(prog) - 1)
        if kind == "drop":
            op = prog.pop(i)
            return _replace(plan, r, prog), f"drop rank {r} #{i} {op}"
        j = ch.int(0, len(prog))
        prog.insert(j, prog[i])
        return _replace(plan, r, prog), f"duplicate rank {r} #{i} {prog[j]} at #{j}"
    if kind in ("swap_adjacent", "move"):
        choices = [(r, i) for r, prog in enumerate(progs) for i in range(len(prog) - 1)
                   if prog[i] != prog[i + 1]]
        r, i = ch.pick(choices)
        prog = list(progs[r])
        if kind == "swap_adjacent":
            prog[i], prog[i + 1] = prog[i + 1], prog[i]
            return _replace(plan, r, prog), f"swap rank {r} #{i} {prog[i + 1]} <-> {prog[i]}"
        j = ch.pick([j for j in range(len(prog)) if j != i])
        op = prog.pop(i)
        prog.insert(j, op)
        return _replace(plan, r, prog), f"move rank {r} #{i} {op} to #{j}"
    if kind == "swap_sends":
        r, i, j = ch.pick(_send_pairs(plan))
        prog = list(progs[r])
        prog[i], prog[j] = prog[j], prog[i]
        return _replace(plan, r, prog), (f"swap sends rank {r} #{i} {prog[j]}->{prog[j].dst} "
                                         f"<-> #{j} {prog[i]}->{prog[i].dst}")
    if kind == "payload":
        choices = [e for e in _endpoints(plan)
                   if _payload_choices(plan, p2p_of(progs[e[0]][e[1]])[e[2]])]
        r, i, k = ch.pick(choices)
        op = progs[r][i]
        end = p2p_of(op)[k]
        field, value = ch.pick(_payload_choices(plan, end))
        new = attrs.evolve(end, payload=attrs.evolve(end.payload, **{field: value}))
        if isinstance(op, Group):
            members = list(op.ops)
            members[k] = new
            new = Group(tuple(members))
        prog = list(progs[r])
        prog[i] = new
        return _replace(plan, r, prog), f"payload rank {r} #{i}.{k} {end} {field}={value}"
    if kind == "reorder_collectives":
        r, i, j = ch.pick(_collective_pairs(plan))
        prog = list(progs[r])
        prog[i], prog[j] = prog[j], prog[i]
        return _replace(plan, r, prog), f"reorder collectives rank {r} #{i} <-> #{j}"
    if kind == "drop_group":
        r, i = ch.pick(_positions(plan, lambda op: isinstance(op, Group)))
        members = list(progs[r][i].ops)
        order = ch.pick(["listed", "reversed"])
        if order == "reversed":
            members.reverse()
        prog = list(progs[r])
        prog[i:i + 1] = members
        return _replace(plan, r, prog), f"ungroup rank {r} #{i} ({order})"
    if kind == "insert_group":
        r, i = ch.pick(_positions(plan, lambda op: isinstance(op, (Send, Recv))))
        prog = list(progs[r])
        later = [j for j in range(i + 1, min(len(prog), i + 5))
                 if isinstance(prog[j], (Send, Recv))]
        take = later[:ch.int(0, min(3, len(later)))]
        group = Group(tuple([prog[i]] + [prog[j] for j in take]))
        for j in reversed(take):
            del prog[j]
        prog[i] = group
        return _replace(plan, r, prog), f"group rank {r} #{i} with {take}"
    if kind in SEGMENT_MUTATIONS:
        return _mutate_segment(plan, kind, ch)
    raise ValueError(f"unknown mutation {kind!r}")


def _mutate_segment(plan: Plan, kind: str, ch) -> tuple[Plan, str]:
    """The edits of ``SEGMENT_MUTATIONS`` (see the module docstring)."""
    progs = plan.programs
    if kind == "drop_all_reduce":
        tag, where = ch.pick(sorted(_tagged(plan, "grads", "all_reduce").items()))
        scope = ch.pick(["one", "all"])
        where = [ch.pick(where)] if scope == "one" else where
        return _edit_calls(plan, where, lambda r, op: None), f"drop {tag} on {where}"
    if kind == "narrow_all_reduce":
        tag, q = ch.pick(_narrowable(plan))
        where = _tagged(plan, "grads", "all_reduce")[tag]
        scope = ch.pick(["all", "one"]) if any(r != q for r, _ in where) else "all"
        if scope == "one":
            where = [ch.pick([(r, i) for r, i in where if r != q])]

        def narrow(r, op):
            return None if r == q else attrs.evolve(
                op, ranks=tuple(x for x in op.ranks if x != q))
        return _edit_calls(plan, where, narrow), f"narrow {tag} without rank {q} on {where}"
    if kind == "broadcast_root":
        tag, root = ch.pick(_rerootable(plan))
        where = _tagged(plan, "params", "broadcast")[tag]
        where = [ch.pick(where)] if ch.pick(["all", "one"]) == "one" else where
        return (_edit_calls(plan, where, lambda r, op: attrs.evolve(op, root=root)),
                f"root {root} for {tag} on {where}")
    if kind == "drop_recompute":
        r, i = ch.pick(_positions(plan, lambda op: isinstance(op, Compute) and op.kind == "R"))
        prog = list(progs[r])
        op = prog.pop(i)
        return _replace(plan, r, prog), f"drop rank {r} #{i} {op}"
    if kind == "move_segment_forward":
        r, i = ch.pick(_positions(plan, lambda op: isinstance(op, Compute) and op.segment
                                  and op.kind == "F"))
        there = ch.pick([x for x in range(plan.num_ranks) if x != r])
        src = list(progs[r])
        op = src.pop(i)
        dst = list(progs[there])
        j = ch.int(0, len(dst))
        dst.insert(j, op)
        return (_replace(_replace(plan, r, src), there, dst),
                f"move rank {r} #{i} {op} to rank {there} #{j}")
    if kind == "edit_cut":
        return _edit_cut(plan, ch)
    end = ch.pick(_cut_endpoints(plan))
    ends = [end]
    other = _fifo_partner(plan, end)
    if other is not None and ch.pick(["one", "pair"]) == "pair":
        ends.append(other)
    op = p2p_of(progs[end[0]][end[1]])[end[2]]
    return _without_endpoints(plan, ends), f"drop {op} ({op.payload}) at {ends}"


# ---------------------------------------------------------------- mutant strategy

# fewest ranks that give every base an op the mutation can edit (comm needs 2 ranks, two
# send peers need 3), so the simplest draw is already usable
MIN_RANKS = {"swap_sends": 3, "payload": 2, "insert_group": 2, "drop_group": 2,
             **{kind: 2 for kind in SEGMENT_MUTATIONS}}
# the transpose modes whose plans a segment mutation can edit
SEGMENT_MODES = {"drop_all_reduce": ("owner",), "narrow_all_reduce": ("owner",),
                 "broadcast_root": ("recompute", "owner"), "drop_recompute": ("recompute",)}
SOURCES = ("family", "term", "transpose")


def memory_limit_for(plan: Plan, ch, sizes=None):
    """None, the base plan's highest peak, or its per-rank peaks (under ``sizes``, a
    ``reference.Sizes``; default the unit model): a mutant that raises some rank's peak
    then violates ``memory``."""
    peaks = [peak_memory(plan, memory_model(sizes))[r][0] for r in range(plan.num_ranks)]
    how = ch.pick(["none", "max", "per_rank"])
    if how == "none":
        return None
    if how == "max":
        return max(peaks, default=0.0)
    return tuple(peaks)


def random_sizes(ch, plan: Plan):
    """A ``reference.Sizes`` for ``plan``: either each unit stores 0 to 3 (in halves),
    each payload kind's receive buffer 0 to 2, each rank's static part 0 to 3 and the RNG
    state of a raw input 0 or 1; or (the verifier's column passes then apply) whole
    stored sizes and static parts with free buffers."""
    from reference import Sizes
    whole = ch.pick([False, True])
    size = (lambda hi: ch.int(0, hi)) if whole else (lambda hi: ch.int(0, 2 * hi) / 2)
    units = [("", s) for s in range(plan.placement.num_stages)] + [
        (w.name, 0) for w in plan.cut.segments]
    buffers = {} if whole else {kind: size(2) for kind in (ACT, GRAD, INPUT)}
    return Sizes({unit: size(3) for unit in units}, buffers,
                 tuple(size(3) for _ in range(plan.num_ranks)), 0 if whole else ch.int(0, 1))


def memory_model(sizes) -> MemoryModel:
    """The verifier's ``MemoryModel`` of a ``reference.Sizes`` (None: the unit model;
    free buffers as the unit model's own function)."""
    if sizes is None:
        return UNIT_MEMORY
    buffer = ((lambda payload: sizes.buffer.get(payload.kind, 0))
              if any(sizes.buffer.values()) else UNIT_MEMORY.buffer)
    return MemoryModel(lambda stage, segment: sizes.stored.get((segment, stage), 1), buffer,
                       tuple(sizes.static), sizes.rng)


def random_family_term(ch, p: int | None = None):
    """A family term with valid parameters, uniformly over the families."""
    name = ch.pick(FAMILY_NAMES)
    p = ch.int(1, MAX_P) if p is None else p
    m = ch.int(2 * p if name == "dualpipev" else 1, max(MAX_M, 2 * p))
    v = ch.int(2, 3) if name in CHUNKED else None
    waves = ch.int(1, 2) if name in WAVED else None
    return family(name, p, m, v, waves=waves)


def random_base_term(ch, source: str, kind: str, depth: int, p: int | None):
    """A valid term of ``source`` (``SOURCES``): a family, ``random_term(depth)`` or a
    transpose (with a mode ``kind`` can edit)."""
    if source == "family":
        return random_family_term(ch, p)
    if source == "transpose":  # a segment edit needs work moved off home: m >= 2
        return random_transpose_term(ch, p, SEGMENT_MODES.get(kind, MODES),
                                     2 if kind in SEGMENT_MUTATIONS else 1)
    return random_term(ch, depth, p=p)


def random_mutant(ch, kind: str | None = None, depth: int = 1, families: bool = False,
                  source: str | None = None):
    """``(base, kind, description, mutant, memory_limit)``: a valid (possibly decorated)
    lowered plan and one ``kind`` edit of it. The base term comes from ``source``
    (``SOURCES``; default ``family`` with ``families=True``, else ``term``); a segment
    mutation always edits a transpose."""
    kind = ch.pick(MUTATIONS) if kind is None else kind
    source = source or ("family" if families else "term")
    if kind in SEGMENT_MUTATIONS:
        source = "transpose"
    how = {"reorder_collectives": "collectives", "drop_group": "groups"}.get(kind)
    if how is None:
        how = ch.pick(["plain", "plain", "groups", "collectives"])
    low = MIN_RANKS.get(kind)
    p = None if low is None else ch.int(low, MAX_P)
    while True:
        term = random_base_term(ch, source, kind, depth, p)
        base = decorate(lowered(term), ch, how)
        if kind in applicable(base):
            break
    mutant, description = mutate(base, kind, ch)
    return base, kind, description, mutant, memory_limit_for(base, ch)


# ---------------------------------------------------------------- comparison


def verifier_verdict(plan: Plan, memory_limit=None, sizes=None) -> tuple[str, set[str]]:
    """``(status, violated properties)`` of ``verify`` under rendezvous, with the memory
    sizes ``sizes`` (a ``reference.Sizes``; default the unit model)."""
    from mpipe_verified.verify import verify
    report = verify(plan, memory_limit=memory_limit, memory_model=memory_model(sizes))
    return report.status, {v.property for v in report.violations}


def reference_verdict(plan: Plan, memory_limit=None, sizes=None) -> set[str]:
    """The properties ``reference.judge`` finds violated (all five are computed)."""
    import reference
    return reference.judge_plan(plan, memory_limit, sizes or reference.UNIT).violated


def classify(status: str, found: set[str], expected: set[str]) -> str:
    """``agree``; ``false_accept`` (verified, the reference finds a violation);
    ``false_reject`` (violated where the reference accepts, or a property the reference
    does not find); ``missed`` (both reject, but the verifier misses a property the
    reference finds); ``undecided``."""
    if status == "undecided":
        return "undecided"
    if status == "verified":
        return "false_accept" if expected else "agree"
    if not expected or found - expected:
        return "false_reject"
    return "missed" if expected - found else "agree"


@st.composite
def mutants(draw, kinds: Sequence[str] = MUTATIONS, depth: int = 1):
    kind = draw(st.sampled_from(list(kinds)))
    return random_mutant(DrawChooser(draw), kind, depth)


# ---------------------------------------------------------------- sequence chunks
#
# Plans of sequence chunks (``seq_chunks`` S; microbatch ``sample * S + j``): seq1f1b on
# 1..MAX_P ranks, 1..3 samples of 2..3 chunks, as it is, with split backwards, or with its
# ``W``s deferred. Their mutants: any edit of ``MUTATIONS`` that applies (no segment
# edits: these plans have no cut), or one of ``CHUNK_MUTATIONS``:
# ``swap_chunks`` exchanges, on one rank, two computes of one kind and stage whose
# microbatches are neighbouring chunks of one sample; ``read_as_chunks`` reads a valid
# plan of plain microbatches (a family's) as chunks (its ``seq_chunks`` set to an S that
# divides its microbatches), so its own order may break the chunk rules.

CHUNK_MUTATIONS = ("swap_chunks", "read_as_chunks")


def random_seq_term(ch, p: int | None = None):
    """A seq1f1b term (see above), possibly split or with deferred ``W``s."""
    p = ch.int(1, MAX_P) if p is None else p
    term = family("seq1f1b", p, ch.int(1, 3), seq_chunks=ch.int(2, 3))
    return ch.pick([term, SplitBW(term), DeferW(SplitBW(term), ch.pick(LAGS))])


def _chunk_pairs(plan: Plan) -> list[tuple[int, int, int]]:
    """``(rank, i, j)``: two computes of one rank, kind and stage, microbatches ``u`` and
    ``u + 1`` of one sample."""
    s, out = plan.seq_chunks, []
    for r, prog in enumerate(plan.programs):
        at = {(op.kind, op.stage, op.segment, op.mb): i for i, op in enumerate(prog)
              if isinstance(op, Compute)}
        out += [(r, i, at[(k, st_, seg, u + 1)]) for (k, st_, seg, u), i in at.items()
                if u % s < s - 1 and (k, st_, seg, u + 1) in at]
    return out


def random_seq_mutant(ch, kind: str | None = None):
    """``(base, kind, description, mutant, memory_limit)`` as ``random_mutant``, over the
    plans of sequence chunks (see above)."""
    plain = [k for k in MUTATIONS if k not in SEGMENT_MUTATIONS]
    kind = ch.pick(plain + list(CHUNK_MUTATIONS)) if kind is None else kind
    if kind == "read_as_chunks":
        name, p, s = ch.pick(FAMILY_NAMES), ch.int(1, 4), ch.int(2, 3)
        low = -(-2 * p // s) if name == "dualpipev" else 1  # dualpipev: m >= 2p
        m = s * ch.int(low, max(low, 4))
        base = lowered(family(name, p, m, ch.int(2, 3) if name == "interleaved-1f1b" else None))
        return (base, kind, f"{name} p={p} m={m} read as {s} chunks per sample",
                attrs.evolve(base, seq_chunks=s), memory_limit_for(base, ch))
    how = ch.pick(["plain", "plain", "groups"])
    low = MIN_RANKS.get(kind)
    p = None if low is None else ch.int(low, MAX_P)
    while True:
        base = decorate(lowered(random_seq_term(ch, p)), ch, how)
        if kind == "swap_chunks" and _chunk_pairs(base) or kind in applicable(base):
            break
    if kind == "swap_chunks":
        r, i, j = ch.pick(_chunk_pairs(base))
        prog = list(base.programs[r])
        prog[i], prog[j] = prog[j], prog[i]
        return (base, kind, f"swap chunks rank {r} #{i} {prog[j]} <-> #{j} {prog[i]}",
                _replace(base, r, prog), memory_limit_for(base, ch))
    mutant, description = mutate(base, kind, ch)
    return base, kind, description, mutant, memory_limit_for(base, ch)
