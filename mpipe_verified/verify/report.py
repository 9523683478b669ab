"""Verdicts, counterexamples and certificates (docs/semantics.md §3, §6), and the claim
a parametric certificate makes (``Parametric``: data only; ``check.parametric`` proves
and accepts it, so this module reads only the IR, the question and the kernel)."""

from __future__ import annotations

import bisect
import decimal
import hashlib
import json
import numbers
import re
from fractions import Fraction
from typing import Callable, Mapping, Sequence

import attrs

from .. import kernel
from ..ir import PROPERTIES, Plan  # the five, in report order
from ..question import Verdict

VERIFIER_VERSION = "mpipe-verify/3"  # /3: an injective canonical text (digests of plans
# that send across the cut changed), the question and verdict from question.py


@attrs.frozen
class Violation:
    """One counterexample: the property, a one-line ``message``, the ranks and ops
    (``(rank, position, op text)``) involved, and ``trace``: extra lines (the per-rank
    wait-for cycle, both ends of a mismatch, the live tensors at a memory peak)."""

    property: str
    message: str
    ranks: tuple[int, ...] = ()
    ops: tuple[tuple[int, int, str], ...] = ()
    trace: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"property": self.property, "message": self.message, "ranks": list(self.ranks),
                "ops": [{"rank": r, "position": i, "op": op} for r, i, op in self.ops],
                "trace": list(self.trace)}


def plan_digest(plan: Plan) -> str:
    """SHA-256 of the plan's canonical text (``kernel.digest``)."""
    return kernel.digest(plan)


@attrs.frozen
class Parametric:
    """The claim of a parametric proof: ``laws`` prove the five properties of ``family``
    at ``params`` (sorted ``(key, value)`` pairs)."""

    family: str
    params: tuple[tuple[str, object], ...]
    laws: tuple[str, ...]

    @classmethod
    def of(cls, family: str, params: Mapping[str, object], laws: Sequence[str]) -> "Parametric":
        return cls(family, tuple(sorted(params.items())), tuple(laws))

    @property
    def mapping(self) -> dict[str, object]:
        return dict(self.params)

    def digest(self) -> str:
        text = json.dumps({"family": self.family, "params": self.mapping,
                           "laws": list(self.laws)}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> dict:
        return {"family": self.family, "params": self.mapping, "laws": list(self.laws)}

    @classmethod
    def from_json(cls, data: Mapping) -> "Parametric":
        params = data["params"]
        if not isinstance(params, dict) or not isinstance(data["laws"], list):
            raise ValueError("params must be an object and laws a list")
        if not all(v is None or type(v) in (int, str) for v in params.values()):
            raise ValueError("each parameter must be an integer, a text or null")
        return cls.of(str(data["family"]), params, [str(x) for x in data["laws"]])


@attrs.frozen
class Certificate:
    """What was proven about which plan: recheckable in linear time by recomputing the
    plan's digest (``check_certificate``). A certificate from a parametric proof
    (``parametric``: family, parameters, laws; ``check.parametric``) has the claim's
    digest instead, and certifies the one plan those parameters derive."""

    digest: str
    properties: tuple[str, ...]
    memory_limit: tuple[float, ...] | None
    comm_model: str
    version: str = VERIFIER_VERSION
    parametric: "Parametric | None" = None

    def to_json(self) -> dict:
        out = {"digest": self.digest, "properties": list(self.properties),
               "memory_limit": None if self.memory_limit is None else list(self.memory_limit),
               "comm_model": self.comm_model, "version": self.version}
        if self.parametric is not None:
            out["parametric"] = self.parametric.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Certificate":
        limit = data.get("memory_limit")
        claim = data.get("parametric")
        if not all(type(x) is str for x in data["properties"]):
            raise ValueError("properties must be names")
        return cls(str(data["digest"]), tuple(data["properties"]),
                   None if limit is None else tuple(float(x) for x in limit),
                   str(data["comm_model"]), str(data.get("version", "")),
                   None if claim is None else Parametric.from_json(claim))


class CertificateError(Exception):
    """A plan was refused: no certificate, or one that does not match the plan."""


@attrs.frozen
class Report:
    """A verdict with its explanations. ``verdict``: the trusted shell's
    (``question.Verdict``: ``verified`` when all five are proven, ``violated`` with at
    least one confirmed violation, else ``undecided``; the plan's digest; the peaks it
    proved), or, for a parametric report, the family's laws'. Everything else explains
    it: the confirmed violations' messages, the peaks as the passes summed them, the
    timings. ``exit_code`` follows docs/semantics.md §6: 0, 1, 3."""

    verdict: Verdict
    violations: tuple[Violation, ...]
    peak_memory: dict[int, float]
    stats: dict
    certificate: Certificate | None = None
    undecided: tuple[str, ...] = ()
    witness: kernel.Witness | None = None  # what the kernel proved the plan from
    sizes: kernel.Sizes | None = None
    limits: tuple | None = None  # the per-rank limits exactly as the kernel proved them
    cached: bool = False  # a parametric report from a cached proof of its laws
    highest_peak: object = None  # the highest peak, exactly (int or Fraction), where summed

    @property
    def status(self) -> str:
        return self.verdict.status

    def portable_certificate(self, plan: Plan) -> dict:
        """The certificate with its witness, as ``mpipe-verify recheck`` reads it
        (``kernel.certificate``); only for a verified report of ``plan``."""
        if self.certificate is None or self.witness is None:
            raise ValueError("only a verified report has a certificate")
        return kernel.certificate(plan, self.witness, self.certificate.comm_model,
                                  self.sizes, self.limits)

    @property
    def verified(self) -> bool:
        return self.status == "verified"

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def to_json(self) -> dict:
        out = {"verified": self.verified, "status": self.status, "digest": self.verdict.digest,
               "violations": [v.to_json() for v in self.violations],
               "peak_memory": {str(r): v for r, v in sorted(self.peak_memory.items())},
               "stats": self.stats}
        if self.undecided:
            out["undecided"] = list(self.undecided)
        if self.certificate is not None:
            out["certificate"] = self.certificate.to_json()
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# ---------------------------------------------------------------- the text report
#
# ``check``'s text output (docs/semantics.md §6, "Text report"): by default one line per
# input, ``NAME: STATUS (summary)``, a second line for a VERIFIED input only when its
# ranks' peaks differ, then for a violation one ``NAME:LINE:COL: PROPERTY: message`` line
# each with its short story; ``verbose`` adds the per-property proof lines (facts and Z3
# runs, or the law and its scope), every op's position, the whole trace, the peaks of
# every rank and the certificate.

STORY_LINES = 4  # trace lines shown under a violation by default (all with --verbose)
PEAKS_SHOWN = 8  # ranks whose peaks a default report lists one by one

EAGER_NOTE = ("note: this deadlock needs rendezvous: with buffered sends (the eager model, "
              "as on gloo or with messages smaller than NCCL's buffers) no rank blocks "
              "here, which is how such a plan passes a small test; on NCCL at scale it "
              "hangs, because PyTorch posts every SEND/RECV with batch_isend_irecv and a "
              "large send completes only once its receive runs")

_PLURALS = {"microbatch": "microbatches"}


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` in agreement: ``1 rank``, ``2 ranks``, ``1 microbatch``."""
    return f"{n} {noun if n == 1 else _PLURALS.get(noun, noun + 's')}"


# nouns the passes' messages count (``properties``, ``semantics``): their text agrees
_SINGULAR = {"live tensors": "live tensor", "sends": "send", "receives": "receive",
             "counterexamples": "counterexample", "facts": "fact", "ranks": "rank",
             "ops": "op", "steps": "step", "forwards": "forward",
             "microbatches": "microbatch", "times": "time"}
_COUNTED = re.compile(r"\b1 (" + "|".join(_SINGULAR) + r")\b")


def agreeing(text: str) -> str:
    """``text`` with a count of one in agreement with its noun (``1 live tensors`` ->
    ``1 live tensor``, ``1 sends`` -> ``1 send``)."""
    return _COUNTED.sub(lambda m: "1 " + _SINGULAR[m.group(1)], text)


def num(x) -> str:
    """A figure as the text report prints it: ``4``, ``2.5`` (never ``4.0`` or
    ``1e+06``)."""
    value = round(float(x), 6)
    return str(int(value)) if value.is_integer() else repr(value)


MAX_DIGITS = 40  # significant digits ``apart`` tries before it prints exact fractions


def apart(*values) -> list[str]:
    """``values`` (ints, Fractions or floats, each the exact number it denotes) as ``num``
    prints them, unless two different numbers would print alike: then all of them
    rounded to the fewest significant digits that tell every two different ones apart
    (rounding is monotone, so the order shows as well), and beyond ``MAX_DIGITS`` as
    exact fractions. Equal numbers always print alike."""
    exact = [Fraction(int(v.numerator), int(v.denominator)) if isinstance(v, numbers.Rational)
             else Fraction(float(v)) for v in values]
    texts = [num(v) for v in values]
    distinct = len(set(exact))
    digits = 7
    while len(set(map(decimal.Decimal, texts))) < distinct and digits <= MAX_DIGITS:
        texts = [_rounded(x, digits) for x in exact]
        digits += 1
    return texts if len(set(map(decimal.Decimal, texts))) == distinct else list(map(str, exact))


def _rounded(x: Fraction, digits: int) -> str:
    """``x`` correctly rounded to ``digits`` significant digits, in positional notation
    without trailing zeros."""
    with decimal.localcontext() as context:
        context.prec = digits
        value = decimal.Decimal(x.numerator) / decimal.Decimal(x.denominator)
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


@attrs.frozen
class Shown:
    """What the text report says of one input beside its ``Report``: its ``name``, its
    ``microbatches``, the wall ``seconds`` its check took, ``lowered_file`` (a
    compute-only file that mpipe lowered before checking), ``passes_under`` (the weaker
    comm models a rendezvous deadlock passes under), ``locate`` (rank, position) ->
    ``(line, column)`` in the input file or None (``Locator``), and ``json_paths`` (a
    plan-json file checked as written: positions are also shown as JSON paths)."""

    name: str
    microbatches: int | None = None
    seconds: float | None = None
    lowered_file: bool = False
    passes_under: tuple[str, ...] | None = None
    locate: Callable[[int | None, int | None], tuple[int, int] | None] = lambda r, i: None
    json_paths: bool = False
    as_written: bool = True


def render(report: Report, shown: Shown, verbose: bool = False) -> str:
    """The text report of one input (see the comment above)."""
    lines = [f"{shown.name}: {report.status.upper()} ({_summary(report, shown)})"]
    claim = report.certificate.parametric if report.certificate is not None else None
    if verbose:
        lines += (_law_lines(report, claim) if claim is not None
                  else _property_lines(report))
    elif report.verified:
        peaks = _peak_line(report)
        if peaks is not None and len(set(report.peak_memory.values())) > 1:
            lines.append(peaks)
    violated = {v.property for v in report.violations}
    note = (shown.passes_under is not None and "eager" in shown.passes_under
            and violated == {"deadlock"})  # nothing else wrong: only then a note
    for v in report.violations:
        lines += _violation(v, shown, verbose, note)
    for prop, info in report.stats.get("properties", {}).items():
        if info.get("unlisted"):
            lines.append(f"{shown.name}: {prop}: {info['unlisted']} more "
                         f"{'counterexample' if info['unlisted'] == 1 else 'counterexamples'}"
                         f" found, not listed")
    lines += [f"{shown.name}: undecided: {reason}" for reason in report.undecided]
    if verbose:
        peaks = _peak_line(report, every=True)
        if peaks is not None:
            lines.append(peaks + (" (the memory law's formula)" if claim is not None else ""))
        if report.certificate is not None:
            kind = "parametric sha256" if claim is not None else "sha256"
            lines.append(f"  certificate: {kind} {report.certificate.digest}")
    return "\n".join(lines)


def _summary(report: Report, shown: Shown) -> str:
    stats, parts = report.stats, []
    if report.violations:
        counts: dict[str, int] = {}
        for v in report.violations:
            counts[v.property] = counts.get(v.property, 0) + 1
        total = len(report.violations)
        if len(counts) == 1:
            prop = next(iter(counts))
            parts.append(f"{total} {prop} {'counterexample' if total == 1 else 'counterexamples'}")
        else:
            parts.append(counted(total, "counterexample") + ": " + ", ".join(
                f"{n} {p}" for p, n in counts.items()))
    elif report.undecided:
        n = len(report.undecided)
        parts.append(f"{n} {'property' if n == 1 else 'properties'} not decided")
    facts = [counted(stats["ranks"], "rank")]
    if shown.microbatches is not None:
        facts.append(counted(shown.microbatches, "microbatch"))
    claim = report.certificate.parametric if report.certificate is not None else None
    if claim is not None:
        facts.append(f"by the {claim.family} laws for all sizes"
                     + (" (cached proof)" if report.cached else ""))
    elif "ops" in stats:
        facts.append(counted(stats["ops"], "op"))
    if shown.lowered_file:
        facts.append("compute-only, lowered by mpipe")
    if stats.get("comm_model", "rendezvous") != "rendezvous":
        facts.append(f"{stats['comm_model']} model")
    if report.peak_memory and not report.undecided:
        limits = set(report.limits or ())
        if not limits and report.certificate is not None:
            limits = set(report.certificate.memory_limit or ())
        if len(limits) == 1:
            peak, limit = apart(_highest_peak(report), next(iter(limits)))
            facts.append(f"peak memory {peak}, limit {limit}")
        else:
            facts.append(f"peak memory {num(_highest_peak(report))}"
                         + (", per-rank limits" if limits else ""))
        host = stats.get("host_peak_memory")
        if host:  # offloaded activations (docs/semantics.md §2.10): reported, not limited
            facts.append(f"host peak {num(max(host.values()))}")
    if shown.seconds is not None:
        facts.append(f"{shown.seconds:.2f} s")
    return "; ".join([*parts, ", ".join(facts)]) if parts else ", ".join(facts)


def _highest_peak(report: Report):
    """The highest peak: exact where the passes summed it so, else as reported."""
    if report.highest_peak is not None:
        return report.highest_peak
    return max(report.peak_memory.values())


def _peak_line(report: Report, every: bool = False) -> str | None:
    """``  peak memory per rank: 0: 4, 1: 3, ...`` (by default at most ``PEAKS_SHOWN``
    ranks, then the last one and the highest); different peaks print apart."""
    peaks = sorted(report.peak_memory.items())
    if not peaks:
        return None
    if every or len(peaks) <= PEAKS_SHOWN:
        texts = apart(*(p for _, p in peaks))
        return "  peak memory per rank: " + ", ".join(
            f"{r}: {text}" for (r, _), text in zip(peaks, texts))
    top = max(peaks, key=lambda rp: (rp[1], -rp[0]))
    *first, last, highest = apart(*(p for _, p in peaks[:PEAKS_SHOWN - 2]), peaks[-1][1],
                                  top[1])
    shown = [f"{r}: {text}" for (r, _), text in zip(peaks, first)]
    return (f"  peak memory per rank: {', '.join(shown)}, ..., {peaks[-1][0]}: "
            f"{last} (highest {highest}, on rank {top[0]})")


def _property_lines(report: Report) -> list[str]:
    lines = []
    for prop, info in report.stats["properties"].items():
        facts = (f"{counted(info['facts'], 'fact')} in {counted(info['runs'], 'Z3 run')}"
                 if "facts" in info else "")
        if info["status"] == "violated":
            n = info.get("confirmed", 0)
            extra = (f"{counted(n, 'counterexample')} confirmed by Z3"
                     + (f" (+{info['unlisted']} more found, not listed)"
                        if info.get("unlisted") else ""))
        elif info["status"] == "proved":
            extra = facts
        else:
            extra = "; ".join(filter(None, [info.get("reason", ""), facts]))
        lines.append(f"  {prop:<13} {info['status']:<9} {extra}".rstrip())
    return lines


def _law_lines(report: Report, claim) -> list[str]:
    stats = report.stats
    shown = ", ".join(f"{k}={v}" for k, v in claim.params if v is not None)
    lines = [f"  proven for every size by the {claim.family} laws, at {shown}"]
    for prop, info in stats["properties"].items():
        lines.append(f"  {prop:<13} {info['status']:<9} law {info['law']} ({info['scope']})")
    when = ("earlier by this same package (cached proof)" if report.cached
            else f"now in {stats['seconds']:.2f} s")
    lines.append(f"  {counted(stats['obligations'], 'obligation')} proven by Z3 {when}")
    return lines


def _violation(v: Violation, shown: Shown, verbose: bool, note: bool) -> list[str]:
    first = v.ops[0] if v.ops else None
    rank = first[0] if first else (v.ranks[0] if v.ranks else None)
    where = shown.locate(rank, first[1] if first else None)
    head = shown.name + (f":{where[0]}:{where[1]}" if where else "")
    lines = [f"{head}: {v.property}: {agreeing(v.message)}"]
    story = list(v.trace)
    if verbose:
        for r, i, op in v.ops:
            at = shown.locate(r, i)
            path = f"$.programs[{r}][{i}], " if shown.json_paths else ""
            file_at = (f"{path}{at[0]}:{at[1]}" if at else
                       "lowered plan" if not shown.as_written else path.rstrip(", "))
            lines.append(f"    at rank {r}, position {i}" + (f" ({file_at})" if file_at else "")
                         + f": {op}")
    elif len(story) > STORY_LINES:
        more = len(story) - STORY_LINES + 1
        story = story[:STORY_LINES - 1] + [f"... {counted(more, 'more line')} (--verbose)"]
    lines += [f"    {agreeing(t)}" for t in story]
    if note and v.property == "deadlock":
        lines.append(f"    {EAGER_NOTE}")
    return lines


# ---------------------------------------------------------------- positions in the input


class Locator:
    """``(line, column)`` in the input file of an op of the checked plan, by its rank and
    position (``None`` for a position: the rank itself; ``None`` for both: the input):

    - ``torch-csv`` checked as written: the op's cell, row ``rank + 1`` (its line) and
      cell ``position + 1`` (its column, counted in cells);
    - ``torch-csv-lowered`` (compute-only, lowered by mpipe): the rank's row and the cell
      of the op, or, for a send or receive the lowering inserted, of the compute op it
      serves (a send: the compute before it on its rank; a receive: the one after it);
      column 1 when there is none;
    - ``plan-json`` (and ``plan-json-lowered``, the same way as a lowered CSV): the line
      and character column where the op's object ``$.programs[rank][position]`` starts,
      else where the rank's list starts, else where ``programs`` is named;
    - ``spec``: the line and column of the ``expression`` (or ``family``) key of its
      ``[schedule]`` table, else of the table's header: a spec has no op positions;
    - ``family``: no file, None.

    A rank the file has no row or list for (declared with ``--ranks``) is placed where
    its row would be: line ``rank + 1`` of a CSV."""

    def __init__(self, kind: str, text: "str | Callable[[], str] | None" = None,
                 plan: Plan | None = None, schedule=None) -> None:
        """``text``: the file's text, or a function that reads it (only a spec and a
        plan-json file need it, and only when an op is located)."""
        self.kind, self._source, self.plan, self.schedule = kind, text, plan, schedule
        self._json = None
        self._indices: dict[int, dict] = {}  # rank -> op -> its first index in the file

    @property
    def text(self) -> str:
        if callable(self._source):
            self._source = self._source()
        return self._source or ""

    def __call__(self, rank: int | None, position: int | None) -> tuple[int, int] | None:
        kind = self.kind
        if kind == "family":
            return None
        if kind == "spec":
            return _spec_position(self.text)
        if rank is None:
            return (1, 1)
        index = position
        if position is not None and kind.endswith("-lowered"):
            index = self._in_file(rank, position)
        if kind.startswith("torch-csv"):
            return (rank + 1, 1 if index is None else index + 1)
        return self._json_position(rank, index)

    def _in_file(self, rank: int, position: int) -> int | None:
        """The index in the file's program of the op at ``position`` of the lowered plan
        (or of the compute op a transfer inserted by the lowering serves)."""
        from ..ir import Recv, computes_of
        plan, schedule = self.plan, self.schedule
        if plan is None or schedule is None or rank >= min(plan.num_ranks,
                                                          len(schedule.programs)):
            return None
        program, written = plan.programs[rank], schedule.programs[rank]
        if not 0 <= position < len(program):
            return None
        if rank not in self._indices:  # once per rank: each lookup is then one get
            index: dict = {}
            for i, w in enumerate(written):
                index.setdefault(w, i)
            self._indices[rank] = index
        at = self._indices[rank]
        op = program[position]
        if not computes_of(op):
            step = 1 if isinstance(op, Recv) else -1
            if op in at:  # a collective the file holds itself
                return at[op]
            j = position + step
            while 0 <= j < len(program) and not computes_of(program[j]):
                j += step
            if not 0 <= j < len(program):
                return None
            op = program[j]
        return at.get(op)

    def _json_position(self, rank: int, index: int | None) -> tuple[int, int] | None:
        if self._json is None:
            self._json = _json_programs(self.text)
        named, ranks, ops = self._json
        if rank < len(ranks):
            if index is not None and index < len(ops[rank]):
                return ops[rank][index]
            return ranks[rank]
        return named or (1, 1)


def _spec_position(text: str) -> tuple[int, int]:
    """The ``expression``/``family`` key of the ``[schedule]`` table, else its header."""
    table, header = None, None
    for n, line in enumerate(text.split("\n"), 1):  # TOML's lines (not U+2028's)
        if m := re.match(r"\s*\[\s*([^\]]*?)\s*\]", line):
            table = m.group(1)
            if table == "schedule":
                header = (n, line.index("[") + 1)
        elif table == "schedule" and (m := re.match(r"(\s*)(expression|family)\s*=", line)):
            return (n, len(m.group(1)) + 1)
    return header or (1, 1)


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')


def _json_programs(text: str):
    """``(where "programs" is named, where each rank's list starts, where each op object
    starts)`` in a plan-json text, as ``(line, column)`` pairs (a light scan of its
    strings and brackets; the reader has already checked the text)."""
    stack: list[str] = []
    named, ranks, ops = None, [], []
    key, prev = None, None
    for m in _JSON_TOKEN.finditer(text):
        t, at = m.group(), m.start()
        if t[0] == '"':
            if stack == ["obj"] and prev in ("{", ","):
                try:
                    key = (json.loads(t), at)
                except ValueError:
                    key = None
        elif t == "[":
            if stack == ["obj"] and key is not None and key[0] == "programs" and prev == ":":
                named = key[1]
                stack.append("programs")
            elif stack and stack[-1] == "programs":
                ranks.append(at)
                ops.append([])
                stack.append("rank")
            else:
                stack.append("arr")
        elif t == "{":
            if stack and stack[-1] == "rank":
                ops[-1].append(at)
            stack.append("obj")
        elif t in "]}":
            if stack:
                stack.pop()
        prev = t if t[0] != '"' else '"'
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]

    def where(offset: int) -> tuple[int, int]:
        line = bisect.bisect_right(starts, offset)
        return (line, offset - starts[line - 1] + 1)
    return (None if named is None else where(named), [where(a) for a in ranks],
            [[where(a) for a in row] for row in ops])
