"""The data-flow rules of docs/semantics.md §2.5: the tokens an op needs and produces on its
rank (``needs``, ``produces``), what a transfer carries (``payload_token``), the tags of
the collectives a cut requires (``collective_tag``), and the chain of body and cut
(``Chain``) that extends them across the cut and says where each op belongs.

Every other module of the semantics reads these rules; none restates them. Tokens are
plain ``(kind, segment, stage, mb)`` tuples (``Token`` names the fields).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import NamedTuple

from ..ir import (ACT, BACKWARD, BODY, FORWARD, GRAD, INPUT, INPUT_GRAD, LEND, NO_CUT, RECOMPUTE,
                  RETURN, SINK, SOURCE, WEIGHT_GRAD, Collective, Compute, Cut, Group, Offload, Op,
                  Overlap, Payload, Placement, Recv, Reload, Send, computes_of, known_op_cells,
                  p2p_of)


class Token(NamedTuple):
    """A value that lives on a rank: ``out`` (a stage's output activation), ``stored``
    (the activation kept for backward), ``grad`` (the input gradient a backward produced),
    ``wgrad_ready`` (an ``I`` ran, so ``W`` may run), ``offloaded``/``reloaded`` (an
    ``OFFLOAD``/``RELOAD`` of the stored activation ran), ``held``/``returned`` (a lent
    activation arrived at its holder / back at its owner; §2.10); in a plan of sequence
    chunks also ``kv`` (a chunk's forward ran here: the keys and values later chunks
    attend to) and ``kv_grad`` (a chunk's backward ran here: the gradient of what earlier
    chunks produced), which only ``Chain.produces`` makes. ``needs``/``produces`` return
    plain ``(kind, segment, stage, mb)`` tuples, equal to the ``Token`` of the same fields
    (they run once per op on 10^5-op plans); wrap one in ``Token(*t)`` to read it by
    name."""

    kind: str
    segment: str
    stage: int
    mb: int


_TOKEN_OF_PAYLOAD = {ACT: "out", GRAD: "grad", INPUT: "input"}


def payload_token(p: Payload) -> tuple:
    """The token a transfer of ``p`` carries: what its ``SEND`` needs and its ``RECV``
    produces (``out``, ``grad`` or ``input``)."""
    return (_TOKEN_OF_PAYLOAD[p.kind], p.segment, p.stage, p.mb)


TRANSFER_TOKENS = frozenset(_TOKEN_OF_PAYLOAD.values())  # token kinds a transfer carries
# a rank move (§2.10): what its SEND needs and its RECV leaves, per payload kind
_SENT, _RECEIVED = {LEND: "stored", RETURN: "held"}, {LEND: "held", RETURN: "returned"}


def sent_token(p: Payload) -> tuple:
    """What a ``SEND`` of ``p`` needs: what it carries, or for a rank move (§2.10) the
    stored activation (``lend``) or the activation held for its owner (``return``)."""
    kind = _SENT.get(p.kind)
    return payload_token(p) if kind is None else (kind, p.segment, p.stage, p.mb)


def received_token(p: Payload) -> tuple:
    """What a ``RECV`` of ``p`` leaves: what it carries, or for a rank move (§2.10) the
    activation held for its owner (``lend``) or given back to it (``returned``)."""
    kind = _RECEIVED.get(p.kind)
    return payload_token(p) if kind is None else (kind, p.segment, p.stage, p.mb)


PARAMS, GRADS = "params", "grads"  # collective tag roles: a segment's parameters, gradients
REPLICA = "replica"  # the role of ``replica:J``: the summed weight gradients of model stage J


def collective_tag(role: str, name: str) -> str:
    """The tag of a collective over segment ``name``: ``params:NAME`` (its parameters,
    broadcast) or ``grads:NAME`` (its weight gradients, all-reduced)."""
    return f"{role}:{name}"


def collective_segment(op: Collective) -> tuple[str, str] | None:
    """``(role, segment name)`` of a collective tagged ``ROLE:NAME`` (see
    ``collective_tag``), or None when its tag names no segment."""
    role, sep, name = op.tag.partition(":")
    return (role, name) if sep else None


def needs(op: Op, num_stages: int) -> tuple[tuple, ...]:
    """Tokens that must already be on the rank before ``op`` runs (§2.5)."""
    kind = type(op)
    if kind is Compute:
        seg, s, mb = op.segment, op.stage, op.mb
        if op.kind == FORWARD:
            return (("out", seg, s - 1, mb),) if s > 0 else ()
        if op.kind == WEIGHT_GRAD:
            return (("wgrad_ready", seg, s, mb),)
        if op.kind == RECOMPUTE:
            return (("input", seg, s, mb),)
        if s < num_stages - 1:
            return (("stored", seg, s, mb), ("grad", seg, s + 1, mb))
        return (("stored", seg, s, mb),)
    if kind is Send:
        return (sent_token(op.payload),)
    if kind is Overlap or kind is Group:
        return tuple(t for c in op.ops for t in needs(c, num_stages))
    if kind is Offload:  # the activation is resident on the device
        return (("stored", op.segment, op.stage, op.mb),)
    if kind is Reload:
        return (("offloaded", op.segment, op.stage, op.mb),)
    return ()


def produces(op: Op) -> tuple[tuple, ...]:
    """Tokens ``op`` leaves on its rank when it finishes. Besides the body's tokens, a
    cut segment's ``F`` also leaves its raw ``input`` with the RNG state it ran with (what
    a recompute needs: it replays those random draws; see ``MemoryModel.rng_state``), a backward
    or ``W`` leaves ``wdone`` (its weight gradient is ready for an all-reduce), and a
    ``broadcast`` tagged ``params:NAME`` leaves ``params`` of segment NAME."""
    kind = type(op)
    if kind is Compute:
        seg, s, mb = op.segment, op.stage, op.mb
        if op.kind == FORWARD:
            if seg:
                return (("out", seg, s, mb), ("stored", seg, s, mb), ("input", seg, s, mb))
            return (("out", seg, s, mb), ("stored", seg, s, mb))
        if op.kind == BACKWARD:
            return (("grad", seg, s, mb), ("wdone", seg, s, mb))
        if op.kind == INPUT_GRAD:
            return (("grad", seg, s, mb), ("wgrad_ready", seg, s, mb))
        if op.kind == WEIGHT_GRAD:
            return (("wdone", seg, s, mb),)
        return (("stored", seg, s, mb),)  # RECOMPUTE
    if kind is Recv:
        return (received_token(op.payload),)
    if kind is Overlap or kind is Group:
        ops = op.ops
        return (produces(ops[0]) + produces(ops[1]) if len(ops) == 2
                else sum([produces(c) for c in ops], ()))
    if kind is Offload or kind is Reload:
        return (("offloaded" if kind is Offload else "reloaded", op.segment, op.stage, op.mb),)
    if kind is Collective and op.kind == "broadcast":
        tagged = collective_segment(op)
        if tagged is not None and tagged[0] == PARAMS:
            return (("params", tagged[1], 0, 0),)
    return ()


def offloads(programs) -> frozenset:
    """``(rank, segment, stage, mb, token)`` of every activation a rank moves away (§2.10):
    ``reloaded`` for an ``OFFLOAD``, ``returned`` for a ``SEND`` that lends it; a backward
    of it on that rank needs that token first."""
    found = set()
    for rank, program in enumerate(programs):
        types = set(map(type, program))
        if Offload not in types and Group not in types and (Send not in types or LEND not in {
                op.payload.kind for op in program if type(op) is Send}):
            continue  # nothing moved away on this rank (the common case, read quickly)
        for op in program:
            if type(op) is Offload:
                found.add((rank, op.segment, op.stage, op.mb, "reloaded"))
            for t in p2p_of(op):
                if type(t) is Send and t.payload.kind == LEND:
                    p = t.payload
                    found.add((rank, p.segment, p.stage, p.mb, "returned"))
    return frozenset(found)


_OFFLOADS: list = [lambda: None, frozenset()]  # the plan asked last (weakly), its offloads


def plan_offloads(plan) -> frozenset:
    """``offloads(plan.programs)``, remembered for the last plan asked (weakly), so the
    many readers of one plan scan it once."""
    if _OFFLOADS[0]() is not plan:  # a plan the torch CSV's bulk reader built (its cells
        moved = frozenset() if known_op_cells(plan) is not None else offloads(plan.programs)
        _OFFLOADS[:] = [weakref.ref(plan), moved]  # known) holds torch's actions only
    return _OFFLOADS[1]


def consumers_of_output(c: Compute, placement: Placement) -> tuple[tuple[int, Payload], ...]:
    """Remote ranks that need what ``c`` produces, with the payload to send them.
    Stages on the same rank exchange nothing (the lowering rule)."""
    to_rank, s = placement.stage_to_rank, c.stage
    if c.kind == FORWARD and s + 1 < len(to_rank):
        if to_rank[s + 1] != to_rank[s]:
            return ((to_rank[s + 1], Payload(ACT, s, c.mb, c.segment)),)
    elif (c.kind == BACKWARD or c.kind == INPUT_GRAD) and s > 0:
        if to_rank[s - 1] != to_rank[s]:
            return ((to_rank[s - 1], Payload(GRAD, s, c.mb, c.segment)),)
    return ()


class Chain:
    """The data-flow chain of a plan: the body's stages (placed by ``placement``) plus the
    segments of its ``cut``. It extends the body rules of ``needs`` and
    ``consumers_of_output`` across the cut and says where each op belongs.

    Rules at the cut (docs/semantics.md §2.5 "segment boundaries follow the same rule"): the body's
    first forward needs every source's output; a source's backward needs the gradient of
    the body's first stage; a sink's forward needs the body's last output (a sink is
    detached: nothing flows back). A forward (or recompute) of a trainable segment off
    its home rank needs the parameters broadcast from home; an all-reduce tagged
    ``grads:NAME`` needs every local weight gradient of NAME (``required_collectives``
    says which collectives the cut needs).

    A backward (``B`` or ``I``) of an activation its rank offloaded or lent (``offloaded``)
    also needs that activation's ``RELOAD`` or return (§2.10).

    Several ``pipelines`` (§2.9): pipeline i runs stages ``[i*n, (i+1)*n)`` for its own
    microbatches only (other work of those stages is stray); data flows only inside a
    pipeline (its first stage's forward needs nothing, its last stage's backward only the
    loss); a model stage J whose replicas ``i*n + J`` sit on several ranks needs the
    all-reduce ``replica:J`` over those ranks, after every local backward or ``W`` of
    those replicas.

    A ``forward_only`` chain (an evaluation plan, declared) requires no backward and no
    recompute of any unit, stores no activation (nothing will read it back), ships no raw
    input and needs no gradient all-reduce; a segment run off its home still needs its
    parameters broadcast.

    Sequence chunks (``seq_chunks`` S > 1, docs/semantics.md §2.5): microbatch ``u`` is
    chunk ``u % S`` of its sample. A forward of a chunk other than the first needs the
    ``kv`` of the previous chunk ``(stage, u - 1)`` on its rank (that chunk's forward ran
    there); a backward (``B`` or ``I``) of a chunk other than the last needs the
    ``kv_grad`` of the next chunk ``(stage, u + 1)`` (that chunk's backward ran there).
    ``produces`` adds the tokens that state it; with S = 1 both are the module's own."""

    def __init__(self, placement: Placement, cut: Cut = NO_CUT,
                 forward_only: bool = False, pipelines: tuple = (),
                 offloaded: frozenset = frozenset(), seq_chunks: int = 1) -> None:
        self.placement = placement
        self.offloaded = offloaded  # activations moved away: ``offloads`` (§2.10)
        self.pipelines = pipelines
        self.per_pipeline = placement.num_stages // max(len(pipelines), 1)
        self._pipe_of_mb = {mb: i for i, p in enumerate(pipelines) for mb in p}
        self.cut = cut
        self.forward_only = forward_only
        self.seq_chunks = seq_chunks
        self._chunked = seq_chunks > 1
        self.num_stages = placement.num_stages
        self._segments = {seg.name: seg for seg in cut.segments}
        self._sources = tuple(seg for seg in cut.segments if seg.side == SOURCE)
        self._sinks = tuple(seg for seg in cut.segments if seg.side == SINK)
        self._backward_mbs: dict | None = None
        self._destinations: dict[tuple[Compute, int], tuple] = {}

    @classmethod
    def of(cls, plan) -> "Chain":
        return cls(plan.placement, plan.cut, plan.forward_only, plan.pipelines,
                   plan_offloads(plan), plan.seq_chunks)

    def runs(self, stage: int, mb: int) -> bool:
        """Is ``mb`` a microbatch of the pipeline that ``stage`` (of the body) belongs to?"""
        return not self.pipelines or (self._pipe_of_mb.get(mb, -1)
                                      == stage // self.per_pipeline)

    def microbatches(self, stage: int, m: int):
        """The microbatches whose work of body stage ``stage`` is required, in order."""
        if not self.pipelines:
            return range(m)
        return sorted(self.pipelines[stage // self.per_pipeline])

    def crosses(self, p: Payload) -> bool:
        """Several pipelines: does a transfer of ``p`` leave its pipeline (the activation
        of a pipeline's last stage, the gradient of its first)? No such data flows."""
        if not self.pipelines or p.segment or p.kind == INPUT:
            return False
        at = p.stage % self.per_pipeline
        return at == self.per_pipeline - 1 if p.kind == ACT else at == 0

    def replica_ranks(self) -> dict[int, frozenset]:
        """``J -> ranks`` holding a replica of model stage J, where those are several."""
        n, where = self.per_pipeline, self.placement.stage_to_rank
        if not self.pipelines or self.forward_only:
            return {}
        ranks = {j: frozenset(where[j::n]) for j in range(n)}
        return {j: r for j, r in ranks.items() if len(r) > 1}

    def segment(self, name: str):
        return self._segments.get(name)

    def units(self) -> list[tuple[str, int]]:
        """Every ``(segment, stage)`` whose work is required."""
        return [(BODY, s) for s in range(self.num_stages)] + [(seg.name, 0)
                                                              for seg in self.cut.segments]

    def expected_rank(self, c: Compute) -> int | None:
        """The rank that must run ``c`` (None: ``c`` is not part of this chain)."""
        if not c.segment:
            return (self.placement.stage_to_rank[c.stage] if c.stage < self.num_stages
                    and self.runs(c.stage, c.mb) else None)
        seg = self._segments.get(c.segment)
        if seg is None or c.stage != 0 or c.mb >= len(seg.forward_rank):
            return None
        if c.kind == FORWARD:
            return seg.forward_rank[c.mb]
        return None if seg.backward_rank is None else seg.backward_rank[c.mb]

    def expected_backward(self, segment: str, mb: int) -> tuple[bool, bool]:
        """``(a backward is required, a recompute is required)`` for ``(segment, mb)``."""
        if self.forward_only:
            return False, False
        seg = self._segments.get(segment)
        if seg is None:
            return True, False
        return seg.trainable, seg.needs_recompute(mb)

    def needs(self, op: Op, rank: int) -> tuple[tuple, ...]:
        """``needs`` extended across the cut (see the class docstring)."""
        kind = type(op)
        if kind is Overlap or kind is Group:
            ops = op.ops
            if len(ops) == 2:  # the common overlapped pair
                return self.needs(ops[0], rank) + self.needs(ops[1], rank)
            return sum([self.needs(c, rank) for c in ops], ())
        if kind is Collective:
            return self._collective_needs(op, rank)
        base = needs(op, self.num_stages)
        if kind is not Compute:
            return base
        if self.pipelines and not op.segment:
            at = op.stage % self.per_pipeline  # a pipeline's ends: no flow across
            if op.kind == FORWARD and at == 0:
                base = ()
            elif op.kind in (BACKWARD, INPUT_GRAD) and at == self.per_pipeline - 1:
                base = base[:1]
        added: tuple = ()  # a moved activation back (§2.10), earlier chunks' keys (§2.5)
        if self.offloaded and op.kind in (BACKWARD, INPUT_GRAD):
            added = tuple((t, op.segment, op.stage, op.mb) for t in ("reloaded", "returned")
                          if (rank, op.segment, op.stage, op.mb, t) in self.offloaded)
        if self._chunked:
            added += self._chunk_needs(op)
        if not self.cut.segments:
            return base + added
        seg = self._segments.get(op.segment)
        if seg is None:  # a body op
            if op.kind == FORWARD and op.stage == 0:
                base += tuple(("out", src.name, 0, op.mb) for src in self._sources)
            return base + added
        extra: tuple = ()
        if op.kind in (FORWARD, RECOMPUTE) and seg.trainable and rank != seg.home:
            extra = (("params", seg.name, 0, 0),)
        if op.kind == FORWARD:
            body_out = ("out", BODY, self.num_stages - 1, op.mb)
            return extra + ((body_out,) if seg.side == SINK else ()) + added
        if op.kind in (BACKWARD, INPUT_GRAD):
            stored = ("stored", seg.name, 0, op.mb)
            return ((stored, ("grad", BODY, 0, op.mb)) if seg.side == SOURCE
                    else (stored,)) + added
        return extra + base + added

    def _chunk_needs(self, c: Compute) -> tuple[tuple, ...]:
        """The sequence-chunk rule (see the class docstring) for one compute op."""
        j, last = c.mb % self.seq_chunks, self.seq_chunks - 1
        if c.kind == FORWARD and j > 0:
            return (("kv", c.segment, c.stage, c.mb - 1),)
        if (c.kind == BACKWARD or c.kind == INPUT_GRAD) and j < last:
            return (("kv_grad", c.segment, c.stage, c.mb + 1),)
        return ()

    def produces(self, op: Op) -> tuple[tuple, ...]:
        """``produces(op)``, plus in a plan of sequence chunks each forward's ``kv`` and
        each backward's (``B`` or ``I``) ``kv_grad``."""
        base = produces(op)
        if self.seq_chunks == 1:
            return base
        for c in computes_of(op):
            if c.kind == FORWARD:
                base += (("kv", c.segment, c.stage, c.mb),)
            elif c.kind == BACKWARD or c.kind == INPUT_GRAD:
                base += (("kv_grad", c.segment, c.stage, c.mb),)
        return base

    def _collective_needs(self, op: Collective, rank: int) -> tuple[tuple, ...]:
        tagged = collective_segment(op)
        if op.kind == "all_reduce" and tagged is not None and tagged[0] == REPLICA:
            return self._replica_needs(tagged[1], rank)
        if op.kind != "all_reduce" or tagged is None or tagged[0] != GRADS:
            return ()
        seg = self._segments.get(tagged[1])
        if seg is None or seg.backward_rank is None or self.forward_only:
            return ()
        if self._backward_mbs is None:  # (segment, rank) -> its backward microbatches
            self._backward_mbs = defaultdict(list)
            for s in self.cut.segments:
                for mb, r in enumerate(s.backward_rank or ()):
                    self._backward_mbs[(s.name, r)].append(mb)
        return tuple(("wdone", seg.name, 0, mb) for mb in self._backward_mbs.get((seg.name, rank),
                                                                                 ()))

    def _replica_needs(self, name: str, rank: int) -> tuple[tuple, ...]:
        """Every local weight gradient of the replicas of model stage ``name``."""
        n = self.per_pipeline
        if not name.isdigit() or int(name) not in self.replica_ranks():
            return ()
        return tuple(("wdone", BODY, s, mb) for s in range(int(name), self.num_stages, n)
                     if self.placement.stage_to_rank[s] == rank
                     for mb in self.microbatches(s, 0))

    def required_collectives(self) -> dict[str, tuple[str, int | None, frozenset]]:
        """``tag -> (kind, root, ranks that must call it)``: a trainable segment whose
        forward or recompute runs off its home rank needs ``params:NAME`` broadcast from
        home to those ranks; one whose backward runs off home needs ``grads:NAME``
        all-reduced over home and every rank that runs it."""
        out = {}
        for seg in self.cut.segments:
            if seg.backward_rank is None:
                continue
            m = len(seg.forward_rank)
            uses = set(seg.forward_rank) | {seg.backward_rank[mb] for mb in range(m)
                                            if self.expected_backward(seg.name, mb)[1]}
            if uses - {seg.home}:
                out[collective_tag(PARAMS, seg.name)] = ("broadcast", seg.home,
                                                         frozenset(uses | {seg.home}))
            back = set() if self.forward_only else set(seg.backward_rank)
            if back - {seg.home}:
                out[collective_tag(GRADS, seg.name)] = ("all_reduce", None,
                                                        frozenset(back | {seg.home}))
        for j, ranks in self.replica_ranks().items():
            out[collective_tag(REPLICA, str(j))] = ("all_reduce", None, ranks)
        return out

    def destinations(self, c: Compute, here: int) -> tuple[tuple[int, Payload], ...]:
        """Remote ranks that need what ``c`` (running on ``here``) produces, with the
        payload each one receives; same-rank consumers get nothing. Computed once per
        ``(c, here)`` (timing and lowering both ask)."""
        key = (c, here)
        found = self._destinations.get(key)
        if found is None:
            found = self._destinations[key] = self._destinations_of(c, here)
        return found

    def _destinations_of(self, c: Compute, here: int) -> tuple[tuple[int, Payload], ...]:
        seg = self._segments.get(c.segment) if c.segment else None
        out: list[tuple[int, Payload]] = []
        if seg is None:
            at = c.stage % self.per_pipeline
            if not self.pipelines or (at < self.per_pipeline - 1 if c.kind == FORWARD
                                      else at > 0):
                out.extend(consumers_of_output(c, self.placement))
            if c.kind == FORWARD and c.stage == self.num_stages - 1:
                for sink in self._sinks:
                    out.append((sink.forward_rank[c.mb],
                                Payload(ACT, c.stage, c.mb, BODY, to_segment=sink.name)))
            if c.kind in (BACKWARD, INPUT_GRAD) and c.stage == 0:
                for src in self._sources:
                    if src.backward_rank is not None:
                        out.append((src.backward_rank[c.mb],
                                    Payload(GRAD, 0, c.mb, BODY, to_segment=src.name)))
        elif seg.side == SOURCE and c.kind == FORWARD:
            out.append((self.placement.stage_to_rank[0],
                        Payload(ACT, 0, c.mb, seg.name, to_segment=BODY)))
            if self.expected_backward(seg.name, c.mb)[1]:
                out.append((seg.backward_rank[c.mb], Payload(INPUT, 0, c.mb, seg.name)))
        return tuple((r, p) for r, p in out if r != here)

    def stores(self, c: Compute, rank: int) -> bool:
        """Does this forward (or recompute) keep its activation for a backward here?"""
        if self.forward_only:
            return False
        if c.kind == RECOMPUTE or not c.segment:
            return True
        seg = self._segments.get(c.segment)
        return seg is None or (seg.backward_rank is not None and c.mb < len(seg.backward_rank)
                               and seg.backward_rank[c.mb] == rank)

