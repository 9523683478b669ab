"""Random valid algebra terms, lowered plans, and one-edit mutations of plans.

Everything is written once against a tiny *chooser* interface (``int(lo, hi)`` inclusive,
``pick(seq)``) so the same generators serve Hypothesis (``DrawChooser``: every choice is
a ``draw``, so failures shrink) and the seeded soundness benchmark (``RandomChooser``
over ``random.Random``; ``benchmarks/soundness.py``).

Valid terms (``random_term`` / ``terms()``), on ``p`` in 1..6 ranks and at most 12
microbatches in all:

- bases: every family of ``algebra.families`` with valid parameters (``dualpipev`` needs
  ``m >= 2p``; ``interleaved-1f1b`` takes 2..3 chunks) and the hand ``Weave`` patterns of
  ``HAND_WEAVES`` (each checked to run for every p <= 6, m <= 12);
- ``SplitBW``, ``MergeBW``, ``DeferW`` (lags ``LAGS``) and ``Relabel`` (a random
  permutation) of a valid term;
- ``Seq(a, b)`` of two valid terms on the same placement;
- ``Par`` of ``Restrict``s over a random partition of the ranks, each block running a
  *local variant* of one valid term (itself, its ``SplitBW``, its ``MergeBW``, a
  ``DeferW`` of its split): those change only the rank's own backward/weight steps, never
  the order in which it sends or needs remote data, so the union still runs.

Plans: ``lower(term.derive())``, optionally decorated with valid ``Group``s (runs of
adjacent comm ops posted together) or with ``Collective``s (the same list, in the same
order, at the start and end of every member rank; ``with_collectives``).

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
=====================  ================================================================

A mutant comes with a memory limit (``memory_limit_for``: none, the base plan's highest
unit-model peak, or its per-rank peaks), so edits that raise a peak violate ``memory``.
Comparison helpers (``verifier_verdict``, ``reference_verdict``, ``classify``) are shared
by ``test_fuzz.py`` and the benchmark.
"""

from __future__ import annotations

import random
from typing import Sequence

import attrs
from hypothesis import strategies as st

from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.algebra.terms import (DeferW, MergeBW, Par, Relabel, Restrict, Seq,
                                          SplitBW, Weave)
from mpipe_verified.ir import (ACT, Collective, Group, Plan, Recv, Send, p2p_of)
from mpipe_verified.lower import lower
from mpipe_verified.semantics import peak_memory

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
LAGS = ("0", "1", "2", "r", "p-1-r", "m")
UNARY = ("split", "merge", "defer", "relabel")
MUTATIONS = ("drop", "duplicate", "swap_adjacent", "move", "swap_sends", "payload",
             "reorder_collectives", "drop_group", "insert_group")


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
    """``(chunks, placement)`` of a family's derived schedule."""
    if name == "interleaved-1f1b":
        return (chunks or 2, "looped")
    if name in ("zbv", "dualpipev"):
        return (2, "v")
    return (1, "looped")


def _split_free_pattern(pattern: str) -> bool:
    return "I" not in pattern and "W" not in pattern


SPLIT_FREE_FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b")


def _bases_for(p: int, shape: tuple[int, str], m_max: int, split_free: bool = False
               ) -> list[tuple]:
    """Base term descriptions with this placement shape and room for >= 1 microbatch."""
    v, placement = shape
    out = []
    for name in FAMILY_NAMES:
        chunks = v if name == "interleaved-1f1b" else None
        if family_shape(name, chunks) != shape or (name == "dualpipev" and m_max < 2 * p):
            continue
        if (split_free and name not in SPLIT_FREE_FAMILIES) or chunks == 1:
            continue
        out.append(("family", name, chunks))
    out += [("weave", pat, c, pl) for pat, c, pl in HAND_WEAVES
            if (c, pl) == shape and (not split_free or _split_free_pattern(pat))]
    return out


SHAPES = ((1, "looped"), (2, "looped"), (3, "looped"), (2, "v"))


def random_base(ch, p: int, shape: tuple[int, str], m_max: int, split_free: bool = False):
    base = ch.pick(_bases_for(p, shape, m_max, split_free))
    if base[0] == "family":
        _, name, chunks = base
        m = ch.int(2 * p if name == "dualpipev" else 1, m_max)
        return family(name, p, m, chunks)
    _, pattern, chunks, placement = base
    return Weave(p, ch.int(1, m_max), pattern, chunks=chunks, placement=placement)


def local_variants(t) -> list:
    """Terms on ``t``'s placement that differ from ``t`` only in each rank's own
    backward/weight-gradient steps."""
    return [t, SplitBW(t), MergeBW(t), DeferW(SplitBW(t), "1"), DeferW(SplitBW(t), "r")]


def random_term(ch, depth: int = 2, p: int | None = None, shape=None, m_max: int = MAX_M,
                split_free: bool = False):
    """A valid term (see the module docstring). ``split_free``: no ``I``/``W`` anywhere
    (B-only bases under ``Seq``, ``Relabel``, ``MergeBW`` and ``Par`` of ``Restrict``s)."""
    p = ch.int(1, MAX_P) if p is None else p
    shape = ch.pick(SHAPES) if shape is None else shape
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


@st.composite
def terms(draw, depth: int = 2):
    return random_term(DrawChooser(draw), depth)


@st.composite
def family_terms(draw, names: Sequence[str] = FAMILY_NAMES):
    name = draw(st.sampled_from(list(names)))
    p = draw(st.integers(1, MAX_P))
    m = draw(st.integers(2 * p if name == "dualpipev" else 1, MAX_M))
    v = draw(st.integers(2, 3)) if name == "interleaved-1f1b" else None
    return family(name, p, m, v)


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


# ---------------------------------------------------------------- mutations


def _replace(plan: Plan, rank: int, program) -> Plan:
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
    return out


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
    raise ValueError(f"unknown mutation {kind!r}")


# ---------------------------------------------------------------- mutant strategy

# fewest ranks that give every base an op the mutation can edit (comm needs 2 ranks, two
# send peers need 3), so the simplest draw is already usable
MIN_RANKS = {"swap_sends": 3, "payload": 2, "insert_group": 2, "drop_group": 2}


def memory_limit_for(plan: Plan, ch):
    """None, the base plan's highest peak, or its per-rank peaks (unit model): a mutant
    that raises some rank's peak then violates ``memory``."""
    peaks = [peak_memory(plan)[r][0] for r in range(plan.num_ranks)]
    how = ch.pick(["none", "max", "per_rank"])
    if how == "none":
        return None
    if how == "max":
        return max(peaks, default=0.0)
    return tuple(peaks)


def random_family_term(ch, p: int | None = None):
    """A family term with valid parameters, uniformly over the families."""
    name = ch.pick(FAMILY_NAMES)
    p = ch.int(1, MAX_P) if p is None else p
    m = ch.int(2 * p if name == "dualpipev" else 1, max(MAX_M, 2 * p))
    v = ch.int(2, 3) if name == "interleaved-1f1b" else None
    return family(name, p, m, v)


def random_mutant(ch, kind: str | None = None, depth: int = 1, families: bool = False):
    """``(base, kind, description, mutant, memory_limit)``: a valid (possibly decorated)
    lowered plan and one ``kind`` edit of it. The base term is a family
    (``families=True``) or ``random_term(depth)``."""
    kind = ch.pick(MUTATIONS) if kind is None else kind
    how = {"reorder_collectives": "collectives", "drop_group": "groups"}.get(kind)
    if how is None:
        how = ch.pick(["plain", "plain", "groups", "collectives"])
    low = MIN_RANKS.get(kind)
    p = None if low is None else ch.int(low, MAX_P)
    while True:
        term = random_family_term(ch, p) if families else random_term(ch, depth, p=p)
        base = decorate(lowered(term), ch, how)
        if kind in applicable(base):
            break
    mutant, description = mutate(base, kind, ch)
    return base, kind, description, mutant, memory_limit_for(base, ch)


# ---------------------------------------------------------------- comparison


def verifier_verdict(plan: Plan, memory_limit=None) -> tuple[str, set[str]]:
    """``(status, violated properties)`` of ``verify`` under rendezvous."""
    from mpipe_verified.verify import verify
    report = verify(plan, memory_limit=memory_limit)
    return report.status, {v.property for v in report.violations}


def reference_verdict(plan: Plan, memory_limit=None) -> set[str]:
    """The properties ``reference.judge`` finds violated (all five are computed)."""
    import reference
    return reference.judge_plan(plan, memory_limit).violated


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
