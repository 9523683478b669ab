"""The verification kernel: the execution semantics read a second time, as rules over one
plan, and the proof obligations those rules generate, discharged by Z3.

Trusted base of a VERIFIED: this file, the reader that built the plan, and Z3. The kernel
imports nothing of the package but the IR's value types (``ir``): no code is shared with
the semantics module, the fast passes or the lowering, so a bug there can make a verdict
undecided but never make a wrong plan verified.

``prove(plan, witness, ...)`` generates, from the plan alone, every obligation of the five
properties; the *witness* (untrusted, proposed by the fast passes) only supplies numbers
the obligations mention:

- completeness: every required unit of work (one ``F``; one ``B`` or one ``I`` and one
  ``W``, none for a frozen segment or in a plan declared ``forward_only``; one ``R`` where
  a recompute is due, never in a forward-only plan) on the rank that
  owns it, no op outside the chain, the cut well formed, and each collective the cut
  requires (a trainable segment run off its home rank needs its parameters broadcast from
  home; one whose backward runs off home needs its gradients all-reduced over home and
  every rank that runs it) exactly once on every rank that needs it;
- dependency: each input of each op (``_needs``) was produced (``_produces``) earlier on
  its rank, at the position the witness names;
- matching: FIFO pairing by counting per ordered rank pair, equal counts, equal payloads;
  every collective call well formed (members distinct existing ranks including the
  caller, a root among them where the kind has one) and agreeing in kind, tag and root
  with the same call of every other member;
- deadlock: the witness gives every op a completion time ``fin``; an op is posted when
  its predecessor completes (``post(i) = fin(i-1)``, 0 for the first). Obligations: times
  never decrease along a rank; every blocking endpoint has a FIFO partner; for each pair
  each blocking end completes after the other end was posted; each collective completes
  after every member posted it. If such times exist the run completes: were it stuck,
  the stuck op with the least ``fin`` would wait on a partner posted after another stuck
  op completed, which completes earlier still;
- memory: the witness gives each rank's level before every step; they start at the static
  part, each is the last plus the step's allocations minus its frees (the kernel's own
  accounting; a forward-only plan's forwards store nothing), every step's peak is within
  the reported peak, the reported peak is reached and is within the limit.

Each obligation is a numeric fact for a linear template. Facts are compressed exactly into
affine runs (consecutive facts of one class with a constant difference) and Z3 is asked
whether some point of some run violates its template: ``unsat`` proves the property,
``sat`` names a violated fact, ``unknown`` is never success. ``confirm`` checks a claimed
counterexample the same way, from the plan alone.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import defaultdict
from fractions import Fraction

import attrs
import numpy as np
import z3

from .ir import (SINK, SOURCE, Collective, Compute, Group, Leaf, Overlap, Payload, Plan, Recv,
                 Send)

PROPERTIES = ("completeness", "dependency", "matching", "deadlock", "memory")
CERTIFICATE_FORMAT = "mpipe-certificate/1"
_CARRIED = {"act": "out", "grad": "grad", "input": "input"}
_TRANSFER = frozenset(_CARRIED.values())

# ---------------------------------------------------------------- the rules


def _members(op) -> tuple:
    return op.ops if type(op) in (Overlap, Group) else (op,)


class _Rules:
    """What each op needs and produces on its rank, who must run it, and what the cut
    requires (see the module docstring). Tokens are ``(kind, segment, stage, mb)``."""

    def __init__(self, plan: Plan) -> None:
        self.p, self.m = plan.num_ranks, plan.num_microbatches
        self.where = plan.placement.stage_to_rank
        self.stages = len(self.where)
        self.cut = plan.cut.segments
        self.forward_only = plan.forward_only  # declared: no backward is required or allowed
        self.segs = {s.name: s for s in self.cut}
        self.sources = [s.name for s in self.cut if s.side == SOURCE]
        self.backward_mbs: dict = defaultdict(list)  # (segment, rank) -> its backward mbs
        for s in self.cut:
            for mb, r in enumerate(s.backward_rank or ()):
                self.backward_mbs[(s.name, r)].append(mb)

    def cut_ok(self) -> bool:
        """Distinct, named segments; one forward (and backward) rank per microbatch, each
        an existing rank; the home an existing rank."""
        ranks = range(self.p)
        return len(self.segs) == len(self.cut) and all(
            s.name and len(s.forward_rank) == self.m and s.home in ranks
            and all(r in ranks for r in s.forward_rank)
            and (s.backward_rank is None or (len(s.backward_rank) == self.m
                                             and all(r in ranks for r in s.backward_rank)))
            for s in self.cut)

    def owner(self, c: Compute):
        """The rank that must run ``c``; None when ``c`` is not work of this plan."""
        if c.mb >= self.m:
            return None
        if not c.segment:
            return self.where[c.stage] if c.stage < self.stages and c.kind != "R" else None
        seg = self.segs.get(c.segment)
        if seg is None or c.stage != 0:
            return None
        if c.kind == "F":
            return seg.forward_rank[c.mb]
        return None if seg.backward_rank is None else seg.backward_rank[c.mb]

    def backward_due(self, seg) -> bool:
        """Does every unit of ``seg`` (None: the body) need one ``B``, or ``I`` and ``W``?"""
        return not self.forward_only and (seg is None or seg.backward_rank is not None)

    def recompute_due(self, seg, mb: int) -> bool:
        return (not self.forward_only and seg is not None and seg.recompute
                and seg.backward_rank is not None
                and seg.backward_rank[mb] != seg.forward_rank[mb])

    def needs(self, op, rank: int) -> list:
        kind = type(op)
        if kind is Send:
            return [_carried(op.payload)]
        if kind is Collective:
            return self._reduce_needs(op, rank)
        if kind is Overlap or kind is Group:
            return [t for c in op.ops for t in self.needs(c, rank)]
        if kind is not Compute:
            return []
        name, s, mb, k = op.segment, op.stage, op.mb, op.kind
        seg = self.segs.get(name) if name else None
        if seg is None:  # the body (an unknown segment reads as body work, and is stray)
            if k == "F":
                return [("out", name, s - 1, mb)] if s else [("out", src, 0, mb)
                                                             for src in self.sources]
            if k == "W":
                return [("wgrad_ready", name, s, mb)]
            if k == "R":
                return [("input", name, s, mb)]
            later = [("grad", name, s + 1, mb)] if s < self.stages - 1 else []
            return [("stored", name, s, mb)] + later
        params = ([("params", name, 0, 0)] if k in ("F", "R") and seg.backward_rank is not None
                  and rank != seg.home else [])
        if k == "F":
            return params + ([("out", "", self.stages - 1, mb)] if seg.side == SINK else [])
        if k == "R":
            return params + [("input", name, s, mb)]
        if k == "W":
            return [("wgrad_ready", name, s, mb)]
        body_grad = [("grad", "", 0, mb)] if seg.side == SOURCE else []
        return [("stored", name, s, mb)] + body_grad

    def _reduce_needs(self, op: Collective, rank: int) -> list:
        role, _, name = op.tag.partition(":")
        seg = self.segs.get(name)
        if op.kind != "all_reduce" or role != "grads" or seg is None or self.forward_only:
            return []
        return [("wdone", name, 0, mb) for mb in self.backward_mbs.get((name, rank), ())]

    def produces(self, op) -> list:
        kind = type(op)
        if kind is Recv:
            return [_carried(op.payload)]
        if kind is Overlap or kind is Group:
            return [t for c in op.ops for t in self.produces(c)]
        if kind is Collective:
            role, _, name = op.tag.partition(":")
            return [("params", name, 0, 0)] if op.kind == "broadcast" and role == "params" else []
        if kind is not Compute:
            return []
        key, k = (op.segment, op.stage, op.mb), op.kind
        if k == "F":
            return [("out",) + key, ("stored",) + key] + ([("input",) + key] if op.segment
                                                          else [])
        if k == "B" or k == "I":
            return [("grad",) + key, ("wdone" if k == "B" else "wgrad_ready",) + key]
        return [("wdone" if k == "W" else "stored",) + key]  # W, or R

    def stores(self, c: Compute, rank: int) -> bool:
        """A forward keeps its activation unless it is a segment's, run where no backward
        of it runs (a frozen segment, or a forward shipped to another rank's backward)."""
        seg = self.segs.get(c.segment) if c.segment else None
        return not self.forward_only and (c.kind == "R" or seg is None
                or (seg.backward_rank is not None and c.mb < self.m
                    and seg.backward_rank[c.mb] == rank))

    def required_collectives(self) -> dict:
        """``tag -> (kind, root, ranks that must call it)`` for every collective the cut
        requires."""
        out = {}
        for seg in self.cut:
            if seg.backward_rank is None:
                continue
            fwd = {seg.forward_rank[mb] for mb in range(self.m)}
            fwd |= {seg.backward_rank[mb] for mb in range(self.m) if self.recompute_due(seg, mb)}
            if fwd - {seg.home}:
                out["params:" + seg.name] = ("broadcast", seg.home, fwd | {seg.home})
            back = set() if self.forward_only else set(seg.backward_rank)
            if back - {seg.home}:
                out["grads:" + seg.name] = ("all_reduce", None, back | {seg.home})
        return out


def _carried(p: Payload) -> tuple:
    return (_CARRIED[p.kind], p.segment, p.stage, p.mb)


# ---------------------------------------------------------------- obligations


class _Facts:
    """Facts grouped by ``(template, class)`` in the order they were added. With
    ``where``, each fact also records the plan location it is about (for ``confirm``)."""

    def __init__(self, where: bool = False) -> None:
        self.lanes: dict = defaultdict(list)
        self.where: list | None = [] if where else None

    def add(self, template: str, cls, *values, at=None) -> None:
        self.lanes[(template, cls)].append(values)
        if self.where is not None:
            self.where.append((at, template, values))

    def extend(self, template: str, cls, columns: list, classes=None, at=None) -> None:
        """One fact per row ``j`` of the equal-length ``columns`` (``_column`` arrays), in
        class ``(cls, classes[j])`` (one int per row), about the place ``at`` (or ``at(j)``)."""
        keys = np.zeros(len(columns[0]), np.int64) if classes is None else classes
        order = np.argsort(keys, kind="stable")
        for part in np.split(order, np.flatnonzero(np.diff(keys[order])) + 1) if len(keys) else ():
            rows = [c[part] for c in columns]
            lane = (np.column_stack(rows) if all(c.dtype == np.int64 for c in rows)
                    else list(zip(*(c.tolist() for c in rows))))
            self.lanes[(template, cls, int(keys[part[0]]), len(self.lanes))] = lane
            if self.where is not None:  # ``at``: a place, or the place of row j
                self.where += [(at(j) if callable(at) else at, template, tuple(x)) for j, x in
                               zip(part.tolist(), np.asarray(lane).tolist())]

    def flag(self, cls, ok: bool, at=None) -> None:
        self.add("one", cls, int(bool(ok)), at=at)

    @property
    def count(self) -> int:
        return sum(map(len, self.lanes.values()))


BOUND = 1 << 62


def _column(values, bound: int = BOUND) -> np.ndarray:
    """Exact numbers as an array: int64 when every value is an int of magnitude below
    ``bound``, else Python's own numbers (objects)."""
    values = list(values)
    if set(map(type, values)) <= {int}:
        try:
            x = np.array(values, np.int64)
            if not len(x) or (-bound < x.min() and x.max() < bound):
                return x
        except OverflowError:  # beyond 64 bits
            pass
    return np.array(values, object)


def _runs(facts) -> list:
    """Exact compression, greedy from the left: a run takes the next fact and every
    following one while the difference stays that of its first two, as ``(first fact,
    difference, length)``; every fact lies in exactly one run. ``facts``: one per row of
    an int64 array (magnitudes below ``BOUND``: no difference overflows), or tuples, read
    as such an array if they allow it, else as Python's exact numbers."""
    if not len(facts):
        return []
    x = facts if isinstance(facts, np.ndarray) else np.array(facts, dtype=object)
    x = _column(x.flat).reshape(x.shape) if x.dtype == object else x
    d = np.diff(x, axis=0)
    starts = np.flatnonzero(np.concatenate(([True], (d[1:] != d[:-1]).any(axis=1))))
    runs, k, n = [], 0, len(facts)
    for end in (np.append(starts[1:], len(d)) - 1).tolist():  # last diff of each block
        if k <= end:  # the run from fact k takes the block's rest and the fact after it
            runs.append((tuple(x[k].tolist()), tuple(d[k].tolist()), end - k + 2))
            k = end + 2
    if k == n - 1:
        runs.append((tuple(x[k].tolist()), (0,) * x.shape[1], 1))
    return runs


def _num(v) -> str:
    """An exact number (an int or a Fraction, nothing else) as SMT-LIB text."""
    if type(v) is int:
        return f"(- {-v})" if v < 0 else str(v)
    if type(v) is not Fraction:
        raise TypeError(f"an obligation holds {v!r}, not an exact number")
    text = f"(/ {abs(v.numerator)}.0 {v.denominator}.0)"
    return f"(- {text})" if v < 0 else text


def _affine(a, ra, d, real: bool) -> str:
    """``a + ra*i + d*j`` as SMT-LIB text."""
    i, j = ("(to_real i)", "(to_real j)") if real else ("i", "j")
    terms = [_num(a)] + [f"(* {_num(c)} {v})" for c, v in ((ra, i), (d, j)) if c]
    return terms[0] if len(terms) == 1 else f"(+ {' '.join(terms)})"


_TEMPLATES = {  # template -> SMT-LIB text of "the fact x holds"
    "one": lambda x: f"(= {x[0]} 1)",                                  # a plan fact holds
    "eq": lambda x: f"(= {x[0]} {x[1]})",
    "le": lambda x: f"(<= {x[0]} {x[1]})",
    "lt": lambda x: f"(< {x[0]} {x[1]})",
    "before": lambda x: f"(and (= {x[0]} 1) (<= 0 {x[1]}) (< {x[1]} {x[2]}))",  # made, q < i
    "level": lambda x: (f"(and (<= (+ {x[0]} {x[1]}) {x[4]}) "            # peak within bound,
                        f"(= {x[3]} (- (+ {x[0]} {x[1]}) {x[2]})))"),  # next level chained
    "eqr": lambda x: f"(= {x[0]} {x[1]})",
    "ler": lambda x: f"(<= {x[0]} {x[1]})",
}
_REAL = frozenset({"level", "eqr", "ler"})


QUERY_DECLS = "(declare-const i Int)(declare-const j Int)"


def _violated(runs) -> str:
    """SMT-LIB formula over ``i``, ``j``: some run has a point ``(i, j)`` in range that
    violates its template."""
    parts = []
    for template, (a, ra, c, d, n) in runs:
        real = template in _REAL
        x = [_affine(*v, real) for v in zip(a, ra, d)]
        parts.append(f"(and (<= 0 i) (< i {c}) (<= 0 j) (< j {n}) "
                     f"(not {_TEMPLATES[template](x)}))")
    return "(or false " + " ".join(parts) + ")"


def _query(runs) -> str:
    """SMT-LIB: some run has a point ``(i, j)`` in range that violates its template."""
    return QUERY_DECLS + f"(assert {_violated(runs)})"


CHUNK = 512


def _discharge(facts: _Facts, rlimit: int | None) -> tuple[str, str, int]:
    """``("proved", "")``, ``("failed", the violated fact)`` or ``("unknown", reason)``,
    and the number of runs Z3 was given."""
    runs = _compress(facts)
    return _decide(runs, rlimit) + (len(runs),)


def _compress(facts: _Facts) -> list:
    """``(template, (a, ra, c, d, n))``: the facts ``a + ra*i + d*j`` for ``i < c``,
    ``j < n``. Level 1: each class's facts as runs; level 2: the runs of one template,
    difference and length, whose first facts again change by a constant step. Exact, as
    each level is: every fact is exactly one point."""
    same: dict = defaultdict(list)
    for (t, *_), lane in facts.lanes.items():
        for a, d, n in _runs(lane):
            same[(t, d, n)].append(a)
    return [(t, (a, ra, c, d, n)) for (t, d, n), starts in same.items()
            for a, ra, c in _runs(starts)]


def _decide(runs: list, rlimit: int | None) -> tuple[str, str]:
    for first in range(0, max(len(runs), 1), CHUNK):
        chunk = runs[first:first + CHUNK]
        solver = z3.Solver()
        solver.set("timeout", 600_000)
        if rlimit is not None:
            solver.set("rlimit", rlimit)
        solver.from_string(_query(chunk))
        answer = solver.check()
        if answer == z3.unknown:
            return "unknown", solver.reason_unknown()
        if answer == z3.sat:
            model = solver.model()
            i, j = (model.eval(z3.Int(v), model_completion=True).as_long() for v in "ij")
            return "failed", next(
                (f"{t}{x}" for t, (a, ra, c, d, n) in chunk if 0 <= i < c and 0 <= j < n
                 for x in [tuple(a_ + r_ * i + d_ * j for a_, r_, d_ in zip(a, ra, d))]
                 if not _holds(t, x)), f"a fact at i={i}, j={j}")
    return "proved", ""


def _holds(template: str, x) -> bool:
    return {"one": lambda: x[0] == 1, "eq": lambda: x[0] == x[1], "le": lambda: x[0] <= x[1],
            "lt": lambda: x[0] < x[1], "before": lambda: x[0] == 1 and 0 <= x[1] < x[2],
            "level": lambda: x[0] + x[1] <= x[4] and x[3] == x[0] + x[1] - x[2],
            "eqr": lambda: x[0] == x[1], "ler": lambda: x[0] <= x[1]}[template]()


# ---------------------------------------------------------------- the witness


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

    def to_json(self) -> dict:
        return {"finish": [list(f) for f in self.finish],
                "producers": [list(p) for p in self.producers],
                "levels": [[_text(x) for x in lv] for lv in self.levels],
                "peaks": [_text(x) for x in self.peaks], "peak_at": list(self.peak_at)}

    @classmethod
    def from_json(cls, data: dict) -> "Witness":
        return cls(tuple(tuple(_int(x) for x in f) for f in data["finish"]),
                   tuple(tuple(_int(x) for x in p) for p in data["producers"]),
                   tuple(tuple(_exact(x) for x in lv) for lv in data["levels"]),
                   tuple(_exact(x) for x in data["peaks"]),
                   tuple(_int(x) for x in data["peak_at"]))


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
    def of(cls, plan: Plan, model) -> "Sizes":
        """Sizes from a memory model with ``stored(stage, segment)``, ``buffer(payload)``,
        ``rng_state`` and ``static_of(rank)``, for every key the plan mentions: a receive
        buffer holds its payload, and a shipped raw input also the RNG state it ran with."""
        stored = {(seg, s): _exact(model.stored(s, seg)) for seg, s in _units(plan)}
        buffer = {}
        for prog in plan.programs:
            for op in prog:
                for c in _members(op):
                    if type(c) is Recv and c.payload not in buffer:
                        rng = model.rng_state if c.payload.kind == "input" else 0
                        buffer[c.payload] = _exact(model.buffer(c.payload) + rng)
        return cls(stored, {p: v for p, v in buffer.items() if v},
                   tuple(_exact(model.static_of(r)) for r in range(plan.num_ranks)))

    def to_json(self) -> dict:
        return {"stored": [[seg, s, _text(v)] for (seg, s), v in sorted(self.stored.items())],
                "buffer": [[_payload_json(p), _text(v)]
                           for p, v in sorted(self.buffer.items(), key=repr)],
                "static": [_text(v) for v in self.static]}

    @classmethod
    def from_json(cls, data: dict) -> "Sizes":
        def payload(d: dict) -> Payload:
            shape, leaves = d["shape"], d.get("leaves")
            return Payload(d["kind"], d["stage"], d["mb"], d["segment"],
                           None if shape is None else tuple(shape), d["dtype"], d["to_segment"],
                           None if leaves is None else tuple(
                               Leaf(x, None if s is None else tuple(s), t) for x, s, t in leaves))
        return cls({(str(seg), _int(s)): _exact(v) for seg, s, v in data["stored"]},
                   {payload(p): _exact(v) for p, v in data["buffer"]},
                   tuple(_exact(v) for v in data["static"]))


def _payload_json(p: Payload) -> dict:
    """A buffer's payload as JSON; ``leaves`` only for a structured payload (``[path,
    shape, dtype]`` each), so certificates of single-tensor plans read as before."""
    out = {"kind": p.kind, "stage": p.stage, "mb": p.mb, "segment": p.segment,
           "dtype": p.dtype, "shape": None if p.shape is None else list(p.shape),
           "to_segment": p.to_segment}
    if p.leaves is not None:
        out["leaves"] = [[x.path, None if x.shape is None else list(x.shape), x.dtype]
                         for x in p.leaves]
    return out


EXACT = (int, Fraction)


def _numbers(name: str, value, depth: int, kinds: tuple) -> None:
    """``value`` is None, or tuples nested ``depth`` deep holding only ``kinds``."""
    if value is None:
        return
    rows = (value,) if depth == 1 else value
    if type(value) is not tuple or not all(
            type(row) is tuple and all(type(x) in kinds for x in row) for row in rows):
        raise ValueError(f"witness {name} must be tuples of {' or '.join(k.__name__ for k in kinds)}")


def _units(plan: Plan) -> list:
    return ([("", s) for s in range(plan.placement.num_stages)]
            + [(seg.name, 0) for seg in plan.cut.segments])


def _exact(x):
    """A number exactly: int, Fraction, an ``"a/b"`` text (short), or a finite float."""
    if isinstance(x, bool):
        raise ValueError("a size must be a number")
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():  # the common case, without a Fraction
        return int(x)
    if isinstance(x, str):
        if len(x) > 64 or "e" in x.lower():
            raise ValueError(f"not a short exact number: {x[:20]!r}")
        x = Fraction(x)
    x = Fraction(x)  # a float converts exactly (non-finite floats raise)
    return x.numerator if x.denominator == 1 else x


def _int(x) -> int:
    if type(x) is not int:
        raise ValueError(f"expected an integer, got {x!r}")
    return x


def _text(x):
    return x if isinstance(x, int) else str(x)


# ---------------------------------------------------------------- the five properties


def _sig(op):
    """A compression class for an op: its compute kind(s), else its type."""
    kind = type(op)
    return op.kind if kind is Compute else "".join(c.kind for c in op.ops) \
        if kind is Overlap else kind


def _computes(op) -> tuple:
    return tuple(c for c in _members(op) if type(c) is Compute) if type(op) in (
        Compute, Overlap) else ()


def _completeness(plan: Plan, rules: _Rules, facts: _Facts, _witness) -> None:
    ok = rules.cut_ok()
    facts.flag("cut", ok, at=("cut",))
    if not ok:
        return
    m, units = rules.m, _units(plan)
    work = sum(len(_computes(op)) for prog in plan.programs for op in prog)
    if len(units) * m > work:  # fewer ops than required forwards: never enumerate m
        facts.add("le", "work", len(units) * m, work, at=("work",))
        return
    unit_of, cells = {u: k for k, u in enumerate(units)}, []
    for rank, prog in enumerate(plan.programs):
        for index, op in enumerate(prog):
            for c in _computes(op):
                u = unit_of.get((c.segment, c.stage))
                if u is None or c.mb >= m:
                    facts.flag("stray", False, at=("stray", rank, index))
                    continue  # else count it: F, B, I, W, R on its owner, or misplaced
                cells.append((u * m + c.mb) * 6 + (
                    "FBIWR".index(c.kind) if rules.owner(c) == rank else 5))
    counts = np.bincount(np.array(cells, np.int64), minlength=len(units) * m * 6)
    one, zero = np.ones(m, np.int64), np.zeros(m, np.int64)
    for (seg, s), per_mb in zip(units, counts.reshape(len(units), m, 6)):
        segw = rules.segs.get(seg) if seg else None
        f, b, i, w, r, wrong = per_mb.T

        due = zero if segw is None else _column(
            int(rules.recompute_due(segw, mb)) for mb in range(m))
        checks = [("F", f, one), ("misplaced", wrong, zero), ("R", r, due)] + (
            [("B|I", b + i, one), ("I=W", i, w)]  # one B, or one I and one W
            if rules.backward_due(segw)
            else [("no backward", b + i + w, zero)])  # frozen, or a forward-only plan
        for name, have, want in checks:
            facts.extend("eq", (seg, s, name), [have, want], at=lambda mb: ("unit", seg, s, mb))
    _required_collectives(plan, rules, facts)


def _required_collectives(plan: Plan, rules: _Rules, facts: _Facts) -> None:
    required = rules.required_collectives()
    calls: dict = defaultdict(int)
    for rank, prog in enumerate(plan.programs):
        for index, op in enumerate(prog):
            if type(op) is not Collective:
                continue
            role, sep, _ = op.tag.partition(":")
            if not sep or role not in ("params", "grads"):
                continue  # a collective of the user's own: only well-formedness applies
            need = required.get(op.tag)
            facts.flag("tagged", need is not None and op.kind == need[0]
                       and op.root == need[1] and need[2] <= set(op.ranks),
                       at=("collective", op.tag, rank))
            calls[(op.tag, rank)] += 1
    for tag, (_, _, ranks) in required.items():
        for r in range(rules.p):
            facts.add("eq" if r in ranks else "le", ("calls", tag, r in ranks),
                      calls[(tag, r)], 1, at=("collective", tag, r))


def _dependency(plan: Plan, rules: _Rules, facts: _Facts, witness: Witness) -> None:
    """Input ``k`` of the rank's inputs (each op's, in sorted order) was made at the
    witness position ``q``: an op there produces it, and ``0 <= q < index``."""
    if witness.producers is None or len(witness.producers) != rules.p:
        facts.flag("witness", False, at=("witness",))
        return
    for rank, prog in enumerate(plan.programs):
        given, n, sigs, made, at, cls = witness.producers[rank], len(prog), {}, [], [], []
        for index, op in enumerate(prog):
            sig = sigs.setdefault(_sig(op), len(sigs)) * 128  # class: op kind, input kind
            for token in sorted(rules.needs(op, rank)):
                q = given[len(at)] if len(at) < len(given) else -1
                made.append(0 <= q < n and token in rules.produces(prog[q]))
                at.append(index)
                cls.append(sig + ord(token[0][0]))
        q = _column(given[:len(at)] + (-1,) * (len(at) - len(given)))
        facts.extend("before", rank, [_column(map(int, made)), q, _column(at)], _column(cls))
        facts.add("eq", "listed", len(at), len(given), at=("witness",))


_READ: list = [lambda: None, None]  # the plan _comms read last (not kept alive), its answer


def _comms(plan: Plan) -> tuple:
    """FIFO pairing by counting: ``(src, dst) -> (sends, receives)``, each ``(rank, index,
    op)`` in program order (the k-th send pairs with the k-th receive); collective
    instances: ``(sorted member set, k) -> {rank: (index, op)}``, the k-th call over that
    member set on each rank. Read once per (immutable) plan; callers never change it."""
    if _READ[0]() is plan:
        return _READ[1]
    channels, calls, seen = defaultdict(lambda: ([], [])), defaultdict(dict), defaultdict(int)
    for rank, prog in enumerate(plan.programs):
        for index, op in enumerate(prog):
            if type(op) is Collective:
                group = tuple(sorted(set(op.ranks)))
                calls[(group, seen[(group, rank)])][rank] = (index, op)
                seen[(group, rank)] += 1
            for c in _members(op):
                if type(c) is Send:
                    channels[(rank, c.dst)][0].append((rank, index, c))
                elif type(c) is Recv:
                    channels[(c.src, rank)][1].append((rank, index, c))
    _READ[:] = [weakref.ref(plan), (channels, calls)]
    return channels, calls


def _matching(plan: Plan, rules: _Rules, facts: _Facts, _witness) -> None:
    for key, (sends, recvs) in sorted(_comms(plan)[0].items()):
        facts.add("eq", "count", len(sends), len(recvs), at=("channel",) + key)
        for s, r in zip(sends, recvs):
            facts.flag("payload", s[2].payload == r[2].payload, at=("channel",) + key)
    for (group, _), where in _comms(plan)[1].items():
        ref = where[min(where)][1]
        for rank, (index, op) in where.items():
            members, at = op.ranks, ("call", rank, index)
            facts.flag("call", len(set(members)) == len(members) and rank in members
                       and all(0 <= r < rules.p for r in members)
                       and (op.root is None if op.kind == "all_reduce" else op.root in members)
                       and (op.kind, op.tag, op.root) == (ref.kind, ref.tag, ref.root), at=at)
        facts.add("eq", "callers", sum(r in where for r in group), len(group),
                  at=("call", min(where), where[min(where)][0]))


_COMM = (Send, Recv, Group, Collective)  # the only ops that can block


def _deadlock(plan: Plan, rules: _Rules, facts: _Facts, witness: Witness,
              eager: bool = False) -> None:
    steps = [[i for i, op in enumerate(prog) if type(op) in _COMM] for prog in plan.programs]
    fins = [_column(t) for t in witness.finish or ()]  # a time beyond BOUND is refused
    if witness.finish is None or [len(f) for f in fins] != [len(s) for s in steps] or any(
            f.dtype != np.int64 for f in fins):
        facts.flag("witness", False, at=("witness",))
        return
    posts = [np.r_[0, f][:len(f)] for f in fins]  # post: the fin of the comm step before
    # the facts hold the gaps fin - post (exact: both below BOUND), far more regular
    fin, post = (np.concatenate([np.zeros(0, np.int64), *x]) for x in (fins, posts))
    base, sigs = np.cumsum([0] + [len(prog) for prog in plan.programs]).tolist(), {}
    nth = np.full(base[-1], -1, np.int64)  # a position of the plan -> its comm step
    nth[_column(base[r] + i for r, s in enumerate(steps) for i in s)] = np.arange(len(fin))
    for rank, positions in enumerate(steps):
        kinds = _column(sigs.setdefault(type(plan.programs[rank][i]), len(sigs))
                        for i in positions)
        facts.extend("le", rank, [0 * fins[rank], fins[rank] - posts[rank]], kinds)
    for key, (sends, recvs) in sorted(_comms(plan)[0].items()):
        for ends, others in [(sends, recvs)] * (not eager) + [(recvs, sends)]:
            k = min(len(ends), len(others))  # the comm steps of the first k pairs:
            other, end = (nth[_column(base[r] + i for r, i, _ in e[:k])] for e in (others, ends))
            facts.extend("lt", ("meet", key, ends is sends), [0 * end, fin[end] - post[other]])
            for j, (rank, index, _) in enumerate(ends[k:], k):  # no partner: waits forever
                facts.add("lt", "partner", j, len(others), at=("stuck", rank, index))
    for (group, _), where in _comms(plan)[1].items():
        facts.add("eq", "callers", sum(r in where for r in group), len(group))
        meet = max(int(post[nth[base[r] + i]]) for r, (i, _) in where.items())
        for r, (i, _) in where.items():
            facts.flag("member", r in group)  # a non-member's call never completes
            facts.add("lt", ("collective", r), meet, int(fin[nth[base[r] + i]]))


def _memory(plan: Plan, rules: _Rules, facts: _Facts, witness: Witness, sizes: "Sizes",
            limits) -> None:
    """The witness lists a level before each step that allocates or frees something, and
    one after the last; a step that moves nothing keeps the level (sizes are >= 0, so its
    peak is within the next step's, or the final level's)."""
    if witness.levels is None or not (len(witness.levels) == len(witness.peaks)
                                      == len(witness.peak_at) == rules.p):
        facts.flag("witness", False, at=("witness",))
        return
    for rank, prog in enumerate(plan.programs):
        levels, peak, at = witness.levels[rank], witness.peaks[rank], witness.peak_at[rank]
        static = sizes.static[rank] if rank < len(sizes.static) else 0
        alloc, freed = _moves(prog, rank, rules, sizes)
        moving = np.flatnonzero((alloc != 0) | (freed != 0))
        if not levels or len(levels) != len(moving) + 1 or not -1 <= at < len(prog):
            facts.flag("witness", False, at=("witness",))
            continue
        level, sigs = _column(levels), {}
        kinds = _column(sigs.setdefault(_sig(prog[i]), len(sigs)) for i in moving.tolist())
        facts.extend("level", rank, [level[:-1], alloc[moving], freed[moving], level[1:],
                                     _column([peak] * len(moving))], kinds)
        top = static if at == -1 else levels[np.searchsorted(moving, at)] + alloc.tolist()[at]
        facts.add("eqr", "static", levels[0], static)
        facts.add("ler", "final", levels[-1], peak)
        facts.add("eqr", "peak", top, peak)
        if limits is not None:
            facts.add("ler", "limit", peak, _exact(limits[rank]), at=("peak", rank))


def _moves(prog, rank: int, rules: _Rules, sizes: "Sizes") -> tuple:
    """Per step, the exact ``(allocated, freed)``: a forward (or recompute) that stores
    allocates its activation, freed by its ``B`` or ``W``; a receive allocates its
    buffer, freed by the compute op that consumes what it carried. Allocations count
    before frees; a free releases its key's latest allocation, unless already freed."""
    ids, events = {}, []  # events: (key, step, 1 for a free, amount)
    for index, op in enumerate(prog):
        for c in _computes(op):
            k = ("stored", c.segment, c.stage, c.mb)
            if c.kind in ("F", "R") and rules.stores(c, rank):
                events.append((k, index, 0, sizes.stored.get((c.segment, c.stage), 1)))
            elif c.kind in ("B", "W"):
                events.append((k, index, 1, 0))
            events += [(("buffer", t), index, 1, 0) for t in rules.needs(c, rank)
                       if t[0] in _TRANSFER]
        for c in _members(op):
            if type(c) is Recv and sizes.buffer.get(c.payload, 0):
                events.append((("buffer", _carried(c.payload)), index, 0,
                               sizes.buffer[c.payload]))
    keys, step, free, amount = zip(*events) if events else ((),) * 4
    k = _column(ids.setdefault(x, len(ids)) for x in keys)
    st, fr, amount = _column(step), _column(free), _column(amount, 1 << 32)
    alloc, freed = (np.zeros(len(prog), amount.dtype) for _ in "af")
    order = np.lexsort((fr, st, k))  # by key, then step, allocations first
    k, st, fr, amount = k[order], st[order], fr[order], amount[order]
    live = np.zeros(len(k), bool)  # a free right after an allocation of its key
    live[1:] = (k[1:] == k[:-1]) & (fr[:-1] == 0) & (fr[1:] == 1)
    np.add.at(alloc, st[fr == 0], amount[fr == 0])
    np.add.at(freed, st[live], amount[np.flatnonzero(live) - 1])
    return alloc, freed


# ---------------------------------------------------------------- verdicts


@attrs.frozen
class Verdict:
    """A property's verdict: ``proved``, ``failed`` (``detail``: the violated fact) or
    ``unknown`` (``detail``: Z3's reason); ``facts`` and ``runs`` count the obligations."""

    status: str
    detail: str = ""
    facts: int = 0
    runs: int = 0


def _generate(name: str, plan: Plan, rules: _Rules, facts: _Facts, witness, comm_model,
              sizes, limits) -> None:
    if name == "deadlock":
        _deadlock(plan, rules, facts, witness, comm_model == "eager")
    elif name == "memory":
        _memory(plan, rules, facts, witness, sizes or Sizes(), limits)
    else:
        {"completeness": _completeness, "dependency": _dependency,
         "matching": _matching}[name](plan, rules, facts, witness)


def prove(plan: Plan, witness: Witness, comm_model: str = "rendezvous", sizes=None,
          limits=None, rlimit: int | None = None, properties=PROPERTIES) -> dict:
    """Each property's ``Verdict`` for ``plan`` under ``comm_model`` (``rendezvous`` or
    ``eager``), ``sizes`` (default: the unit model) and ``limits`` (one bound per rank,
    or None)."""
    if comm_model not in ("rendezvous", "eager"):
        raise ValueError(f"unknown comm model {comm_model!r}")
    if limits is not None and len(limits) != plan.num_ranks:
        raise ValueError(f"{len(limits)} memory limits for {plan.num_ranks} ranks")
    rules, out = _Rules(plan), {}
    if not rules.cut_ok():  # every rule below reads the cut
        return {name: Verdict("failed", "the cut does not fit the plan") for name in properties}
    for name in properties:
        facts = _Facts()
        _generate(name, plan, rules, facts, witness, comm_model, sizes, limits)
        status, detail, runs = _discharge(facts, rlimit)
        out[name] = Verdict(status, detail, facts.count, runs)
    return out


def violation(plan: Plan, witness: Witness, name: str, comm_model: str = "rendezvous",
              sizes=None, limits=None) -> str:
    """The whole query ``prove`` decides for property ``name``, as one SMT-LIB formula over
    the integers declared by ``QUERY_DECLS``: satisfiable iff some obligation fails (a cut
    that does not fit the plan: ``true``). For callers that combine many plans' queries
    into one Z3 call (the bounded family laws)."""
    rules = _Rules(plan)
    if not rules.cut_ok():
        return "true"
    facts = _Facts()
    _generate(name, plan, rules, facts, witness, comm_model, sizes, limits)
    return _violated(_compress(facts))


def confirm(plan: Plan, name: str, claims, comm_model: str = "rendezvous", sizes=None,
            limits=None, rlimit: int | None = None) -> list[str]:
    """For each claimed counterexample of property ``name``: ``violated`` when the kernel
    finds it in the plan and Z3 agrees that the fact breaks its template, ``unknown``
    when Z3 cannot say, else ``rejected``. Claims: ``("unit", segment, stage, mb)``,
    ``("stray"|"input"|"call"|"stuck", rank, index)``, ``("collective", tag, rank)``,
    ``("channel", src, dst)``, ``("cut",)``, ``("work",)``, ``("peak", rank, index)``,
    ``("cycle", ((rank, index), ...))``; each needs nothing but the plan."""
    claims = list(claims)
    try:
        return _confirm(plan, name, claims, comm_model, sizes, limits, rlimit)
    except (IndexError, KeyError, TypeError, ValueError):  # some claim names no such place
        return [_confirm_one(plan, name, c, comm_model, sizes, limits, rlimit) for c in claims]


def _confirm_one(plan, name, claim, comm_model, sizes, limits, rlimit) -> str:
    try:
        return _confirm(plan, name, [claim], comm_model, sizes, limits, rlimit)[0]
    except (IndexError, KeyError, TypeError, ValueError):
        return "rejected"


def _confirm(plan: Plan, name: str, claims: list, comm_model, sizes, limits, rlimit) -> list:
    rules = _Rules(plan)
    if not rules.cut_ok() and name != "completeness":
        return ["rejected"] * len(claims)
    if name == "deadlock":
        waits = _waits(plan, comm_model == "eager")
        return [_confirm_wait(c, waits, rlimit) for c in claims]
    if name == "dependency":
        bad = [_missing_inputs(plan, rules, c) for c in claims]
    elif name == "memory":
        bad = [_over_limit(plan, rules, c, sizes or Sizes(), limits) for c in claims]
    else:
        facts = _Facts(where=True)
        _generate(name, plan, rules, facts, None, comm_model, sizes, limits)
        found = defaultdict(list)
        for at, template, values in facts.where:
            if not _holds(template, values):
                found[at].append((template, values))
        bad = [found.get(tuple(c), [])[:1] for c in claims]
    return [_ground(b, rlimit) for b in bad]


def _ground(facts: list, rlimit) -> str:
    """Z3's word on a claimed violation: some listed ground fact breaks its template."""
    if not facts:
        return "rejected"
    template, values = facts[0]
    solver = z3.Solver()
    if rlimit is not None:
        solver.set("rlimit", rlimit)
    real = template in _REAL
    solver.from_string(
        f"(assert (not {_TEMPLATES[template]([_affine(v, 0, 0, real) for v in values])}))")
    answer = solver.check()
    return "violated" if answer == z3.sat else "unknown" if answer == z3.unknown else "rejected"


def _missing_inputs(plan: Plan, rules: _Rules, claim) -> list:
    """An input of the op at ``(rank, index)`` that no earlier op on the rank produces."""
    _, rank, index = claim
    prog = plan.programs[_place(plan, rank)]
    if not 0 <= index < len(prog):
        return []
    made = {t for op in prog[:index] for t in rules.produces(op)}
    return [("one", (0,)) for t in rules.needs(prog[index], rank) if t not in made][:1]


def _over_limit(plan: Plan, rules: _Rules, claim, sizes: Sizes, limits) -> list:
    """The level at step ``index`` of ``rank`` (``-1``: the static part) over its limit."""
    _, rank, index = claim
    n = len(plan.programs[_place(plan, rank)])
    if limits is None or not (0 <= index < n or index == -1 == n - 1):
        return []  # a step of the program, or -1 for the static part of an empty one
    top = sizes.static[rank] if rank < len(sizes.static) else 0
    if index != -1:
        alloc, freed = (x.tolist() for x in _moves(plan.programs[rank], rank, rules, sizes))
        top += sum(alloc[:index]) - sum(freed[:index]) + alloc[index]
    return [("ler", (top, _exact(limits[rank])))]


def _place(plan: Plan, rank) -> int:
    if type(rank) is not int or not 0 <= rank < plan.num_ranks:
        raise IndexError(f"no rank {rank!r}")
    return rank


def _confirm_wait(claim, waits: dict, rlimit) -> str:
    """A rank stuck on an endpoint with no FIFO partner (or a collective a member never
    calls), or a wait-for cycle: each op of the cycle waits on a partner that its next
    rank posts only after its own op there; Z3 then finds no completion times (each op
    would complete after the next one, around the cycle)."""
    if claim[0] == "stuck":
        return _ground([f for _, f in waits.get(tuple(claim[1:]), ()) if not _holds(*f)][:1],
                       rlimit)
    cycle = [tuple(at) for at in claim[1]]
    if not cycle or not all(at in waits for at in cycle):  # each a blocking comm step
        return "rejected"
    t = [z3.Int(f"t{k}") for k in range(len(cycle))]
    solver = z3.Solver()
    if rlimit is not None:
        solver.set("rlimit", rlimit)
    for k, at in enumerate(cycle):
        nxt_rank, nxt_index = cycle[(k + 1) % len(cycle)]
        later = [on[1] for on, _ in waits[at] if on and on[0] == nxt_rank]
        if not later:
            return "rejected"  # it waits on nothing of the next rank
        solver.add(z3.Implies(max(later) > nxt_index, t[k] > t[(k + 1) % len(t)]))
    answer = solver.check()
    return "violated" if answer == z3.unsat else "unknown" if answer == z3.unknown else "rejected"


def _waits(plan: Plan, eager: bool) -> dict:
    """``(rank, index) -> [(position waited on or None, fact)]`` for every blocking comm
    step: per blocking endpoint, the k-th of its channel, its FIFO partner (None when the
    other side has only ``count <= k`` ends) and the fact ``k < count``; per collective
    call, the other members' calls and the fact "callers = members" of its instance."""
    out: dict = defaultdict(list)
    for sends, recvs in _comms(plan)[0].values():
        for ends, others in [(sends, recvs)] * (not eager) + [(recvs, sends)]:
            for k, (rank, index, _) in enumerate(ends):
                out[(rank, index)].append((others[k][:2] if k < len(others) else None,
                                           ("lt", (k, len(others)))))
    for (group, _), where in _comms(plan)[1].items():
        fact = ("eq", (sum(r in where for r in group), len(group)))
        for rank, (index, _) in where.items():
            out[(rank, index)] += [((r, i), fact) for r, (i, _) in where.items()
                                   if r != rank] or [(None, fact)]
    return out


# ---------------------------------------------------------------- portable certificates


def digest(plan: Plan) -> str:
    """SHA-256 of the plan's canonical text (what a certificate is about)."""
    return hashlib.sha256(plan.canonical_text().encode()).hexdigest()


def certificate(plan: Plan, witness: Witness, comm_model: str, sizes: Sizes, limits) -> dict:
    """The portable certificate: what is claimed about which plan, and the witness."""
    return {"format": CERTIFICATE_FORMAT, "digest": digest(plan), "comm_model": comm_model,
            "properties": list(PROPERTIES),
            "memory_limit": None if limits is None else [_text(_exact(x)) for x in limits],
            "sizes": sizes.to_json(), "witness": witness.to_json()}


def recheck(plan: Plan, data, rlimit: int | None = None, comm_model: str | None = None,
            limits=None) -> tuple[bool, list[str]]:
    """Re-prove all five properties of ``plan`` from a certificate (``certificate``'s
    JSON): ``(True, [])``, or ``(False, reasons)`` when it does not establish them. What
    is proved is under the certificate's comm model and memory limits; ``comm_model`` and
    ``limits`` (one per rank), when given, must be the certificate's."""
    try:
        if comm_model is not None and data.get("comm_model") != comm_model:
            return False, [f"the certificate is for the {data.get('comm_model')} model, not "
                           f"{comm_model}"]
        if limits is not None and (type(data.get("memory_limit")) is not list or [
                _exact(x) for x in data["memory_limit"]] != [_exact(x) for x in limits]):
            return False, [f"the certificate proves the memory limit "
                           f"{data.get('memory_limit')}, not {list(limits)}"]
        if data.get("format") != CERTIFICATE_FORMAT:
            return False, [f"not a {CERTIFICATE_FORMAT} certificate"]
        if data["digest"] != digest(plan):
            return False, ["the certificate is for another plan (digest differs)"]
        if sorted(data["properties"]) != sorted(PROPERTIES):
            return False, ["the certificate does not claim all five properties"]
        limit = data["memory_limit"]
        if limit is not None and type(limit) is not list:
            return False, ["memory_limit must be null or a list of one number per rank"]
        limits = None if limit is None else tuple(_exact(x) for x in limit)
        sizes, witness = Sizes.from_json(data["sizes"]), Witness.from_json(data["witness"])
        verdicts = prove(plan, witness, data["comm_model"], sizes, limits, rlimit)
    except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError,
            ZeroDivisionError) as error:
        return False, [f"malformed certificate: {type(error).__name__}: {error}"]
    reasons = [f"{name}: {v.status} {v.detail}".strip() for name, v in verdicts.items()
               if v.status != "proved"]
    return not reasons, reasons

