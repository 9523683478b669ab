"""The question a verdict answers, and the verdict: the trusted shell around the kernel.

The kernel proves five properties of one plan under given memory limits and sizes. This
module says *which* plan, limits and sizes, from the user's own words, and turns the
kernel's answers into the verdict that is printed. Together with ``kernel/`` and the
reader of the user's file it is what a VERIFIED rests on; it imports only the IR and the
kernel.

- ``Question``: the comm model; the memory limit as written (none, one number, or one
  per rank); the memory sizes by name (``"unit"``: every stored activation 1, buffers
  and static memory free), as a spec's own numbers as it writes them (its ``[cost]``
  activation, ``[memory]`` static and segment sizes, turned into sizes here with this
  module's defaults for what it leaves out, ``_SpecSizes``), or as a Python caller's
  own memory model; the stage, microbatch and rank counts declared; and the input as
  read when the plan judged was built from it (lowered, or given declared sizes).
  ``Question.of_spec`` forms it for a command; ``Question.answered`` accepts only a
  report whose verdict answers this very question.
- ``Question.refusal(plan)``: why ``plan`` is not the plan the question is about: a size
  other than the declared one, sequence chunks other than those named, or steps other
  than the input's. For an input without
  comm ops this is the translation validation of the lowering: on every rank the plan's
  steps, without its sends and receives, are the input's steps, in order (idle steps
  aside), with the same placement, microbatches, cut, forward-only declaration and
  sequence chunks.
- ``Asked``: the question about one plan, with its exact limits and sizes.
  ``Asked.decide``: one property's answer from the kernel: ``violated`` only when the
  kernel confirms every claimed counterexample, ``proved`` only when it proves the
  property from the witness, else ``unknown``. ``Asked.verdict``: ``verified`` only
  when the plan is the question's and all five properties are proved; ``violated`` when
  the plan is the question's and some property has confirmed counterexamples; else
  ``undecided``. The verdict carries the plan's digest and, when memory is proved, each
  rank's exact peak.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import numbers
import os
from fractions import Fraction
from functools import cached_property

import attrs

from . import kernel
from .ir import PROPERTIES, Collective, Idle, Plan, Recv, Schedule, Send

COMM_MODELS = ("rendezvous", "eager")


class QuestionError(ValueError):
    """The question does not fit the plan (a limit or a spec's list of numbers of another
    length than the plan's ranks or stages): bad input, exit 2."""
STATUS_EXIT = {"verified": 0, "violated": 1, "undecided": 3}


@attrs.frozen
class Question:
    """What the user asks about a plan (see the module docstring). ``memory``: ``"unit"``,
    a spec's memory numbers as written (``Spec.memory_written``), cost tables (read for
    ``activation``, ``static`` and ``segments`` only), or an object with
    ``stored``/``buffer``/``rng_state``/``static_of`` (a caller's own model). ``declared``: ``(stages, microbatches, ranks)``, None where not declared.
    ``source``: the input as read, when the plan judged was built from it.
    ``seq_chunks``: the sequence chunks per sample the user named (``--seq-chunks``),
    None where not named."""

    comm_model: str = "rendezvous"
    memory_limit: object = None
    memory: object = "unit"
    declared: tuple = (None, None, None)
    source: Plan | Schedule | None = None
    seq_chunks: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.comm_model not in COMM_MODELS:
            raise ValueError(f"comm model must be one of {COMM_MODELS}, got "
                             f"{self.comm_model!r}")

    @classmethod
    def of_spec(cls, spec, limit=None, comm_model: str = "rendezvous",
                declared: tuple = (None, None, None), source=None,
                seq_chunks: int | None = None) -> "Question":
        """The question a command asks of a spec's plan (``spec`` None: a file or
        family without one): the memory ``limit`` of the command line, else the one
        the spec writes; the memory numbers the spec writes (``spec.memory_written``;
        none: the unit model by name), or for a spec that code built (no numbers
        recorded, e.g. another family's, rescaled) its cost tables; the ``declared``
        sizes; the ``source`` the plan was built from; the ``seq_chunks`` named."""
        if spec is None:
            return cls(comm_model, limit, "unit", declared, source, seq_chunks)
        if limit is None:
            limit = spec.memory_limit
        written = getattr(spec, "memory_written", None)
        memory = (written or "unit") if written is not None else (spec.cost or "unit")
        return cls(comm_model, limit, memory, declared, source, seq_chunks)

    def answered(self, report, plan: Plan):
        """``report`` if its verdict answers this question about ``plan``
        (``Verdict.question``, ``Verdict.plan``), else the same report made undecided: a
        verdict on another question, or on another plan, says nothing of this one."""
        if report.verdict.question is self and report.verdict.plan is plan:
            return report
        verdict = attrs.evolve(report.verdict, status="undecided",
                               refusal="the verdict answers another question")
        return attrs.evolve(report, verdict=verdict, certificate=None, witness=None,
                            violations=(), undecided=report.undecided + (
                                "the verdict answers another question (internal error)",))

    def limits(self, ranks: int) -> tuple | None:
        """The limit as one exact bound per rank (None: no limit). A sequence of another
        length, or a bound that is not a finite number, is a ``ValueError``."""
        limit = self.memory_limit
        if limit is None:
            return None
        bounds = (limit,) * ranks if isinstance(limit, numbers.Real) else tuple(limit)
        if len(bounds) != ranks:
            raise QuestionError(f"memory limit lists {len(bounds)} per-rank values but the "
                             f"plan has {ranks} ranks: give one value per rank, or a number")
        for x in bounds:
            if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
                raise QuestionError(f"memory limit must be a finite number per rank, got "
                                    f"{x!r}")
        return tuple(map(kernel.exact, bounds))

    def sizes(self, plan: Plan) -> kernel.Sizes:
        """The memory sizes of ``plan``'s stored activations, receive buffers and static
        parts, exact."""
        if self.memory == "unit":
            model = _UNIT
        elif hasattr(self.memory, "static_of"):
            model = self.memory  # a caller's own model (``static_of`` and all), asked as it is
        else:
            model = _SpecSizes(self.memory, plan)
        return kernel.Sizes.of(plan, model)

    def refusal(self, plan: Plan) -> str | None:
        """Why ``plan`` is not the plan asked about, or None."""
        stages, microbatches, ranks = self.declared
        for name, want, got in (("stages", stages, plan.placement.num_stages),
                                ("microbatches", microbatches, plan.num_microbatches),
                                ("ranks", ranks, plan.num_ranks)):
            if want is not None and want != got:
                return f"{got} {name} judged, {want} declared"
        if self.seq_chunks is not None and plan.seq_chunks != self.seq_chunks:
            return f"{plan.seq_chunks} sequence chunks per sample judged, {self.seq_chunks} asked"
        return None if self.source is None else _not_built_from(plan, self.source,
                                                                self.declared)


def _not_built_from(plan: Plan, source: Plan | Schedule, declared: tuple) -> str | None:
    """Why ``plan`` is not ``source`` (lowered when it is a compute-only schedule, and
    given the ``declared`` sizes), or None. Declaring adds ranks with empty programs and
    stages placed after the input's, and may set the microbatch count; lowering adds
    sends and receives and drops idle steps."""
    if plan is source:
        return None
    stages, microbatches, ranks = declared
    have = source.placement.stage_to_rank
    if plan.placement.stage_to_rank[:len(have)] != have:
        return "the placement of the input's stages differs"
    for name, want, got, own in (
            ("stage", stages, plan.placement.num_stages, len(have)),
            ("rank", ranks, plan.num_ranks, source.placement.num_ranks),
            ("microbatch", microbatches, plan.num_microbatches, source.num_microbatches)):
        if got != (own if want is None else want):
            return f"the {name} count differs from the input's"
    if plan.cut != source.cut or plan.forward_only != source.forward_only:
        return "the cut or the forward-only declaration differs from the input's"
    if plan.seq_chunks != source.seq_chunks:
        return "the sequence chunks per sample differ from the input's"
    if plan.pipelines != source.pipelines:
        return "the pipelines differ from the input's"
    if plan.num_ranks < len(source.programs):
        return "the plan has fewer ranks than the input"
    added = (Send, Recv, Idle) if isinstance(source, Schedule) else (Idle,)
    summed = isinstance(source, Schedule) and bool(source.pipelines)  # lowering adds the
    for rank, program in enumerate(plan.programs):  # replica all-reduces (replica:J)
        given = source.programs[rank] if rank < len(source.programs) else ()
        if [op for op in program if type(op) not in added and not (
                summed and _replica_sum(op))] != \
                [op for op in given if type(op) is not Idle and not (
                    summed and _replica_sum(op))]:
            return f"rank {rank}'s steps differ from the input's"
    return None


def _replica_sum(op) -> bool:
    return type(op) is Collective and op.tag.startswith("replica:")


class _Unit:
    """The unit sizes: every stored activation 1, buffers, RNG states and static parts 0."""

    rng_state = 0

    @staticmethod
    def stored(stage: int, segment: str) -> int:
        return 1

    @staticmethod
    def buffer(payload) -> int:
        return 0

    @staticmethod
    def static_of(rank: int) -> int:
        return 0


_UNIT = _Unit()
_SEGMENT_DEFAULTS = {"activation": 1, "output": 0, "input": 0, "static": 0, "replica": None}


class _SpecSizes:
    """A spec's memory numbers as sizes, exact (docs/specs.md, ``[cost]``): a body
    forward keeps ``activation`` (one number or one per stage; default 1), a segment's
    forward its segment's ``activation`` (default 1); a receive buffer holds a segment's
    ``output`` (a source's output, the body's last output to a sink, the gradient sent
    back to a source) or a shipped raw ``input`` (default 0), the body's own transfers
    nothing; a rank's static part is ``static`` (one number or one per rank; default 0)
    plus, per segment, its ``static`` (default 0) on home and every rank that runs its
    backward and its ``replica`` (default: its ``static``) on every other rank that runs
    its forward. ``numbers``: the numbers as written (``Spec.memory_written``), or cost
    tables, read for those fields."""

    rng_state = 0

    def __init__(self, numbers, plan: Plan) -> None:
        if not isinstance(numbers, dict):  # cost tables: every field, defaults included
            numbers = {"activation": numbers.activation, "static": numbers.static,
                       "segments": {name: {k: getattr(cost, k) for k in _SEGMENT_DEFAULTS}
                                    for name, cost in numbers.segments}}
        self.activation = numbers.get("activation", 1)
        self.segments = numbers.get("segments", {})
        self.sinks = {seg.name for seg in plan.cut.segments if seg.side == "sink"}
        static = numbers.get("static", 0)
        _fits(static, plan.num_ranks, "static memory", "rank")
        _fits(self.activation, plan.placement.num_stages, "activation", "stage")
        self.static = [_at(static, r) for r in range(plan.num_ranks)]
        for seg in plan.cut.segments:
            own = self._segment(seg.name, "static")
            replica = self._segment(seg.name, "replica")
            full = {seg.home, *(seg.backward_rank or ())}
            for r in range(plan.num_ranks):
                if r in full:
                    self.static[r] += own
                elif r in seg.forward_rank:
                    self.static[r] += own if replica is None else _exact(replica)

    def _segment(self, name: str, field: str):
        value = self.segments.get(name, {}).get(field, _SEGMENT_DEFAULTS[field])
        return value if value is None else _exact(value)

    def stored(self, stage: int, segment: str):
        return self._segment(segment, "activation") if segment else _at(self.activation,
                                                                         stage)

    def buffer(self, p):
        if p.kind == "input":
            return self._segment(p.segment, "input")
        if p.kind == "act" and p.segment:
            return self._segment(p.segment, "output")
        if p.kind == "act" and p.to_segment in self.sinks:
            return self._segment(p.to_segment, "output")
        if p.kind == "grad" and p.to_segment:
            return self._segment(p.to_segment, "output")
        return 0

    def static_of(self, rank: int):
        return self.static[rank]


def _fits(value, count: int, what: str, per: str) -> None:
    if isinstance(value, tuple) and len(value) != count:
        raise QuestionError(f"the spec's {what} lists {len(value)} numbers, one per {per}, "
                            f"but the plan has {count} {per}s")


def _exact(x):
    return kernel.exact(x)


def _at(value, index: int):
    return _exact(value[index] if isinstance(value, tuple) else value)


# ---------------------------------------------------------------- answers and the verdict


@attrs.frozen
class Answer:
    """The kernel's answer for one property: ``proved``, ``violated`` (``confirmed``
    counterexamples) or ``unknown`` (``reason``); ``facts``/``runs`` count what Z3 was
    asked to prove."""

    status: str
    reason: str = ""
    confirmed: int = 0
    facts: int | None = None  # None: no proof was asked (counterexamples were claimed)
    runs: int | None = None
    peaks: tuple | None = None  # memory proved: the peaks it was proved with
    seal: bytes = attrs.field(default=b"", repr=False)  # ``Asked``'s mark: it gave this


class Asked:
    """The question about one plan, with the exact limits and sizes it means for that
    plan (computed once, here). Each ``Answer`` that ``decide`` gives is sealed with a
    key of this object's own (a forked child inherits it), and ``verdict`` counts only
    answers with a valid seal for their property: code outside this module cannot hand
    the verdict an answer the kernel did not give."""

    def __init__(self, plan: Plan, question: Question) -> None:
        self.plan, self.question = plan, question
        self.limits = question.limits(plan.num_ranks)
        self._key = os.urandom(32)
        self._digest: str | None = None

    @cached_property
    def sizes(self) -> kernel.Sizes:
        """``question.sizes(plan)``, computed at first use (in a forked child too, so the
        halves of ``verify_split`` each compute it while the other works)."""
        return self.question.sizes(self.plan)

    def digest(self) -> str:
        """``kernel.digest(plan)``, computed once."""
        if self._digest is None:
            self._digest = kernel.digest(self.plan)
        return self._digest

    def _seal(self, name: str, answer: Answer) -> bytes:
        fields = (name, answer.status, answer.confirmed, answer.facts, answer.runs,
                  answer.peaks)
        return hmac.new(self._key, repr(fields).encode(), hashlib.sha256).digest()

    def _sealed(self, name: str, answer: Answer) -> Answer:
        return attrs.evolve(answer, seal=self._seal(name, answer))

    def _genuine(self, name: str, answer) -> bool:
        return isinstance(answer, Answer) and hmac.compare_digest(answer.seal,
                                                                  self._seal(name, answer))

    def decide(self, name: str, claims: list, witness, rlimit: int | None = None) -> Answer:
        """Property ``name``: the ``claims`` (counterexamples, ``kernel.confirm``'s forms)
        confirmed by the kernel, or, with none, the property proven from ``witness``
        (``kernel.Witness``) under the question's comm model, limits and sizes. Sealed."""
        return self._sealed(name, self._decide(name, claims, witness, rlimit))

    def _decide(self, name: str, claims: list, witness, rlimit: int | None) -> Answer:
        plan, comm_model = self.plan, self.question.comm_model
        if claims:
            answers = kernel.confirm(plan, name, claims, comm_model, self.sizes, self.limits,
                                     rlimit)
            if all(a == "violated" for a in answers):
                return Answer("violated", confirmed=len(answers))
            if "unknown" in answers:
                return Answer("unknown", "Z3 could not confirm a counterexample")
            return Answer("unknown", "the kernel did not confirm a claimed counterexample "
                                     "(internal error)")
        found = kernel.prove(plan, witness, comm_model, self.sizes, self.limits, rlimit,
                             properties=(name,))[name]
        count = {"facts": found.facts, "runs": found.runs}
        if found.status == "proved":
            return Answer("proved", **count, peaks=witness.peaks if name == "memory" else None)
        if found.status == "failed":
            return Answer("unknown", f"the kernel refuted the passes' witness at "
                                     f"{found.detail} (internal error)", **count)
        return Answer("unknown", found.detail or "unknown", **count)

    def verdict(self, answers: dict) -> "Verdict":
        """The verdict from each property's ``Answer`` (see the module docstring); an
        answer this object did not give (``decide``'s seal) counts as unknown."""
        refusal = self.question.refusal(self.plan)
        answers = {name: answers[name] for name in PROPERTIES if name in answers}
        forged = [name for name, answer in answers.items() if not self._genuine(name, answer)]
        if forged:
            refusal = refusal or f"an answer the kernel did not give ({', '.join(forged)})"
        statuses = [answers[name].status if name in answers else "unknown"
                    for name in PROPERTIES]
        if refusal is not None:
            status = "undecided"
        elif "violated" in statuses:
            status = "violated"
        elif all(s == "proved" for s in statuses):
            status = "verified"
        else:
            status = "undecided"
        memory = answers.get("memory")
        peaks = memory.peaks if memory is not None and memory.status == "proved" else None
        return Verdict(status, answers, self.digest(), peaks, self.limits, refusal,
                       self.question, self.plan)


@attrs.frozen
class Verdict:
    """What is printed: ``status`` (``verified``, ``violated``, ``undecided``), each
    property's ``Answer``, the plan's ``digest``, the exact per-rank ``peaks`` when
    memory was proved (else None), the ``limits`` proved, ``refusal`` when the plan is
    not the question's, and the ``question`` and ``plan`` it answers
    (``Question.answered``)."""

    status: str
    answers: dict
    digest: str
    peaks: tuple | None = None
    limits: tuple | None = None
    refusal: str | None = None
    question: Question | None = attrs.field(default=None, eq=False, repr=False)
    plan: Plan | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def exit_code(self) -> int:
        return STATUS_EXIT[self.status]


def exact_text(x) -> str:
    """An exact number as text: an int as it is, a fraction as ``a/b``."""
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"
