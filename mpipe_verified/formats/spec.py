"""Spec files: a schedule described in TOML, read into a ``spec.Spec``.

A spec has one required table and optional ones::

    [schedule]
    family = "zb-h1"          # one of algebra.families.FAMILY_NAMES, or "transpose"
    pp = 4
    microbatches = 8
    # chunks = 2              # interleaved-1f1b, looped-bfs, interleaved-zb (transpose: body)
    # waves = 2               # hanayo only
    # seq_chunks = 2          # seq1f1b only: sequence chunks per sample
    # or, instead of family/pp/chunks:
    # expression = "defer_w(split_bw(one_f_one_b(pp=4, microbatches=8)), lag='r')"
    # stages = 4              # optional declared sizes (declared.declare): work the
    # ranks = 4               # term leaves out is a completeness violation; beside an
                              # expression, microbatches = M declares that count too

    [transpose]               # family = "transpose" only (see algebra.transpose)
    body = "interleaved-1f1b" # the body's family (default "1f1b")
    segment = "vision"        # the cut segment's name
    side = "source"           # "source" (an encoder) or "sink" (a generator)
    mode = "owner"            # "recompute" | "owner" | "frozen" | "none"
    ownership = "cost"        # "inline" | "full" | "min" | "cost" | "given"
    # owners = [0, 3, 1]      # ownership "given" only: each microbatch's owner rank
    costs = [1.2, 0.4, 2.4]   # the segment's forward cost: one number or one per microbatch

    [cost]                    # optional; defaults F=1, B=2, I=1, W=1, R=1, activation=1
    F = 1.0                   # durations: positive numbers, or one per stage
    B = 2.0
    I = 1.0
    W = 1.0
    activation = 1.0          # stored per F: a number, or a list with one entry per stage
    attention = 0.0           # the share of causal attention in F/B/I/R (sequence chunks:
                              # a later chunk costs more; docs/schedules.md)

    [cost.segments.vision]    # optional, one per cut segment (cost.SegmentCost)
    F = 1.2                   # forward: a number or one per microbatch (or [transpose] costs)
    B = 3.6                   # backward (default 2 x F), a number or one per microbatch
    R = 1.2                   # central recompute (default F)
    activation = 0.35         # stored per forward; output/input: receive buffers of a
    output = 0.015            # shipped output / raw input; static: one replicated copy
    input = 0.008
    static = 5.5              # ... on the home rank and backward ranks; replica: a
    replica = 0.6             # forward-only copy on the other owners (default: static)

    [comm]                    # optional (cost.CommModel); all default 0, bandwidth inf
    latency = 0.03            # per message, time units
    bandwidth = 1e8           # bytes per time unit
    activation_bytes = 3.4e7  # body activations and gradients
    segment_output_bytes = 1.5e7
    segment_input_bytes = 8.4e6
    parameter_bytes = 6e8     # a segment's parameters (broadcast) and gradients (all-reduce)
    collective_latency = 0.05
    stage_parameter_bytes = 0 # one model stage's gradients (a replica:J all-reduce)
    stored_bytes = 0          # one stored activation (offload/reload, lend/return)
    host_bandwidth = 5e7      # the host link (offload/reload), bytes per time unit; inf
    host_latency = 0          # ... by default, and its latency per move

    [memory]                  # optional
    limit = 8                 # peak bound: a number, or a list with one entry per rank
    static = 0                # fixed memory per rank: a number, or one per rank
    weights = 0               # one model stage's parameter state per copy (or one per
                              # model stage): static memory on every rank holding a copy

An ``expression`` is read by ``spec.parse_expression`` (the algebra's expression
language), with its errors placed where the expression starts in the file.

Invariants: every problem with a spec (unreadable file, malformed TOML, unknown key, wrong
type, bad parameter, a term that does not derive) raises ``InputError`` naming the file, the
1-based line (and column where known) and what was expected. A ``Spec`` that loads has
already derived its schedule, and its per-stage/per-rank/per-microbatch lists match that
schedule. One cost model serves everything: a transpose family's ``costs`` and its body
estimates (``body_forward``/``body_backward``: the mean ``[cost]`` F and B) come from the
same tables the simulator reads.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import tomllib

from ..algebra import families
from ..algebra.transpose import (GIVEN, MODES, OWNERSHIPS, SIDES, TRANSPOSE, Transpose,
                                 transpose_family)
from ..cost import CommModel, CostModel, SegmentCost
from ..declared import declare
from ..errors import InputError, ParameterError
from ..ir import BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD, Schedule
from ..spec import Spec, Term, default_cost, describe, parse_expression
from . import files

TABLES: dict[str, tuple[str, ...]] = {
    "schedule": ("family", "pp", "microbatches", "chunks", "waves", "seq_chunks",
                 "expression", "stages",
                 "ranks"),
    "cost": ("F", "B", "I", "W", "activation", "R", "segments", "attention"),
    "memory": ("limit", "static", "weights"),
    "transpose": ("body", "segment", "side", "mode", "ownership", "costs", "owners"),
    "comm": ("latency", "bandwidth", "activation_bytes", "segment_output_bytes",
             "segment_input_bytes", "parameter_bytes", "collective_latency",
             "stored_bytes", "host_bandwidth", "host_latency", "stage_parameter_bytes"),
}
SEGMENT_KEYS = ("F", "B", "R", "activation", "output", "input", "static", "replica")
BODY_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE)
FAMILY_NAMES = (*families.FAMILY_NAMES, TRANSPOSE)
_TOML_POS = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)\s*$")


def read_text(path: str | os.PathLike[str], expected: str = "a TOML spec file") -> str:
    """A file's text (``files.read_text``, at most ``files.MAX_BYTES``)."""
    return files.read_text(path, expected)


def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and parse a spec file (see ``parse_spec``)."""
    return parse_spec(read_text(path), os.fspath(path))


def parse_spec(text: str, file: str) -> Spec:
    """Parse spec TOML text, build its term and derive it (see the module docstring)."""
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise InputError("binary data (NUL byte); expected a TOML spec file", file, line)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _TOML_POS.search(msg)
        line, col = (int(m.group(1)), int(m.group(2))) if m and m.group(1) else (
            text.count("\n") + 1 if m else None, None)
        raise InputError(f"malformed TOML: {msg[:m.start()] if m else msg}", file, line,
                         col) from None
    return _Builder(text, file).build(data)


class _Builder:
    """Validates parsed TOML against ``TABLES``, locating each complaint in the text."""

    def __init__(self, text: str, file: str) -> None:
        self.text, self.file = text, file
        self._lines = text.split("\n")

    def error(self, msg: str, table: str | None = None, key: str | None = None) -> InputError:
        line, col = self.locate(table, key)
        return InputError(msg, self.file, line, col)

    def locate(self, table: str | None, key: str | None) -> tuple[int | None, int | None]:
        """Line and column of ``[table] key`` (or of the table header; or of a top-level
        ``key``), found by scanning the text; ``(None, None)`` if not found. ``table`` may
        be dotted (``cost.segments.vision``)."""
        header: tuple[int, int] | None = None
        current: tuple[str, ...] = ()
        tpath = _dotted(table) if table is not None else ()
        want = tpath + ((key,) if key is not None else ())
        head = tpath if table is not None else want[:1]
        for n, raw in enumerate(self._lines, 1):
            m = re.match(r"\s*\[\[?\s*([^\]]*?)\s*\]", raw)
            if m:
                current = _dotted(m.group(1))
                if key is not None and current[:len(want)] == want:  # ``key`` is a table
                    return n, m.start(1) + 1
                if current == head and header is None:
                    header = (n, m.start(1) + 1)
                continue
            m = re.match(r"\s*([A-Za-z0-9_\-.\"' ]+?)\s*=", raw)
            if m:
                path = current + _dotted(m.group(1))
                if path == want or (key is None and path[:len(head)] == head
                                    and header is None):
                    return n, m.start(1) + 1
        return header or (None, None)

    def build(self, data: dict) -> Spec:
        for name, value in data.items():
            if name not in TABLES:
                raise self.error(f"unknown key {name!r}; allowed tables: "
                                 f"{', '.join(f'[{t}]' for t in TABLES)}", None, name)
            if not isinstance(value, dict):
                raise self.error(f"{name} must be a table ([{name}])", None, name)
            for key in value:
                if key not in TABLES[name]:
                    raise self.error(f"unknown key {key!r} in [{name}]; allowed keys: "
                                     f"{', '.join(TABLES[name])}", name, key)
        segments = data.get("cost", {}).get("segments", {})
        if not isinstance(segments, dict):
            raise self.error("cost.segments must hold one table per segment "
                             "([cost.segments.NAME])", "cost", "segments")
        for name, table in segments.items():
            where = f"cost.segments.{name}"
            if not isinstance(table, dict):
                raise self.error(f"{where} must be a table ([{where}])", "cost.segments", name)
            for key in table:
                if key not in SEGMENT_KEYS:
                    raise self.error(f"unknown key {key!r} in [{where}]; allowed keys: "
                                     f"{', '.join(SEGMENT_KEYS)}", where, key)
        if "schedule" not in data:
            raise InputError("missing [schedule] table (with family, pp, microbatches or "
                             "expression)", self.file, 1)
        schedule_table = data["schedule"]
        if "transpose" in data and schedule_table.get("family") != TRANSPOSE:
            raise self.error('[transpose] goes with [schedule] family = "transpose" (in an '
                             "expression, give transpose(...) its arguments)", "transpose")
        term = self.term(schedule_table, data)
        try:
            schedule = term.derive()
        except ParameterError as e:
            key = "expression" if "expression" in schedule_table else "family"
            raise self.error(f"schedule does not derive: {e}", "schedule", key) from None
        derived = schedule
        sizes = self.declared_sizes(schedule_table)
        schedule = self.declared(schedule_table, schedule, sizes)
        cost = self.cost(data, schedule, term)
        limit = self.limit(data["memory"], schedule) if "memory" in data else None
        asked = dict(sizes)
        if "family" in schedule_table:  # pp and microbatches are sizes the file asks for
            asked.setdefault("ranks", schedule_table.get("pp"))
            m = schedule_table.get("microbatches")  # samples, of S sequence chunks each
            asked.setdefault("microbatches", None if m is None else m * derived.seq_chunks)
        return Spec(term, schedule, cost, limit, self.file,
                    tuple(asked.get(k) for k in ("stages", "microbatches", "ranks")), derived,
                    self.memory_numbers(data, schedule))

    def declared_sizes(self, table: dict) -> dict:
        """``stages``/``ranks`` (and, beside an expression, ``microbatches``) as the file
        declares them."""
        keys = ("stages", "ranks") + (("microbatches",) if "expression" in table else ())
        sizes = {}
        for key in keys:
            if key in table:
                v = table[key]
                if type(v) is not int or v < 1:
                    raise self.error(f"schedule.{key} must be an integer >= 1, got "
                                     f"{describe(v)}", "schedule", key)
                sizes[key] = v
        return sizes

    def declared(self, table: dict, schedule: Schedule, sizes: dict) -> Schedule:
        """The derived schedule with the ``sizes`` declared (``declared.declare``), so
        work a term leaves out is a completeness violation."""
        try:
            return declare(schedule, **sizes)
        except ParameterError as e:
            key = next((k for k in ("stages", "ranks") if k in str(e)), "stages")
            raise self.error(f"the schedule does not fit the declared sizes: {e}", "schedule",
                             key if key in table else next(iter(sizes))) from None

    def term(self, table: dict, data: dict | None = None) -> Term:
        if "expression" in table:
            if "family" in table or any(k in table for k in ("pp", "chunks", "seq_chunks")):
                other = next(k for k in ("family", "pp", "chunks", "seq_chunks") if k in table)
                raise self.error(f"give either expression or family/pp/chunks, not both "
                                 f"({other!r} is set too)", "schedule", other)
            expr = table["expression"]
            if not isinstance(expr, str):
                raise self.error(f"schedule.expression must be a string, got "
                                 f"{describe(expr)}", "schedule", "expression")
            line, col = self.locate("schedule", "expression")
            if line is not None:  # point at the expression's first character
                raw = self._lines[line - 1]
                q = re.search(r"=\s*(\"\"\"|'''|\"|')", raw[col - 1:])
                col = col + q.end() if q else None
                if col is not None and not raw[col - 1:].strip():  # """ then a newline
                    line, col = line + 1, 1
            return parse_expression(expr, self.file, line or 1, col or 1)
        if "family" not in table:
            raise self.error("[schedule] needs either family (with pp and microbatches) or "
                             "expression", "schedule")
        name = table["family"]
        if not isinstance(name, str) or name not in FAMILY_NAMES:
            raise self.error(f"unknown family {name!r}; expected one of "
                             f"{', '.join(FAMILY_NAMES)}", "schedule", "family")
        args = {}
        for key in ("pp", "microbatches", "chunks", "waves", "seq_chunks"):
            if key not in table:
                if key not in ("chunks", "waves", "seq_chunks"):
                    raise self.error(f"schedule.{key} is required with family (an integer "
                                     ">= 1)", "schedule")
                continue
            v = table[key]
            if type(v) is not int or v < 1:
                raise self.error(f"schedule.{key} must be an integer >= 1, got "
                                 f"{describe(v)}", "schedule", key)
            args[key] = v
        if name == TRANSPOSE:
            return self.transpose_term(args, data or {})
        try:
            return families.family(name, **args)
        except ParameterError as e:
            key = next((k for k in ("seq_chunks", "chunks", "waves", "microbatches", "pp")
                        if k in str(e) and k in table),
                       "family")
            raise self.error(str(e), "schedule", key) from None

    def transpose_term(self, args: dict, data: dict) -> Transpose:
        """``family = "transpose"``: the ``[transpose]`` options, with the segment's costs
        from ``[transpose] costs`` or ``[cost.segments.NAME] F`` and the body estimates
        from ``[cost]`` (see the module docstring)."""
        table = data.get("transpose", {})
        m = args["microbatches"]
        opts: dict[str, Any] = {}
        choices = {"body": tuple(families.FAMILIES), "side": SIDES, "mode": MODES,
                   "ownership": OWNERSHIPS + (GIVEN,)}
        for key in ("body", "segment", "side", "mode", "ownership"):
            if key not in table:
                continue
            v = table[key]
            if not isinstance(v, str) or (key in choices and v not in choices[key]):
                expected = (f"one of {', '.join(choices[key])}" if key in choices
                            else "a string")
                raise self.error(f"transpose.{key} must be {expected}, got {describe(v)}",
                                 "transpose", key)
            opts[key] = v
        segment = opts.get("segment", "vision")
        seg_table = data.get("cost", {}).get("segments", {}).get(segment, {})
        if "costs" in table and "F" in seg_table:
            raise self.error(f"give the segment's forward cost once: [transpose] costs or "
                             f"[cost.segments.{segment}] F", "transpose", "costs")
        if "costs" in table:
            opts["costs"] = self.numbers("transpose", "costs", table["costs"], m,
                                         "microbatch", False)
        elif "F" in seg_table:
            opts["costs"] = self.numbers(f"cost.segments.{segment}", "F", seg_table["F"], m,
                                         "microbatch", False)
        if "owners" in table:
            v = table["owners"]
            if type(v) is not list or not all(type(x) is int for x in v):
                raise self.error(f"transpose.owners must be a list of ranks (one per "
                                 f"microbatch), got {describe(v)}", "transpose", "owners")
            opts["owners"] = tuple(v)
        cost_table = data.get("cost", {})
        for key, name in ((FORWARD, "body_forward"), (BACKWARD, "body_backward")):
            if key in cost_table:
                v = self.numbers("cost", key, cost_table[key], None, "stage", True)
                opts[name] = sum(v) / len(v) if isinstance(v, tuple) else v
        try:
            return transpose_family(args["pp"], m, args.get("chunks"), **opts)
        except ParameterError as e:
            key = next((k for k in ("body", "mode", "side", "owners", "ownership", "costs",
                                    "segment")
                        if k in str(e) and k in table), None)
            if key is not None:
                raise self.error(str(e), "transpose", key) from None
            key = next((k for k in ("chunks", "microbatches", "pp") if k in str(e)), "family")
            raise self.error(str(e), "schedule", key) from None

    def numbers(self, table: str, key: str, value: Any, count: int | None, what: str,
                positive: bool) -> float | tuple[float, ...]:
        """A number, or a list of ``count`` numbers (one per ``what``; ``count`` None:
        any non-empty list, checked later)."""
        bound = "a positive number" if positive else "a number >= 0"

        def ok(x: Any) -> bool:
            return (type(x) in (int, float) and math.isfinite(x)
                    and (x > 0 if positive else x >= 0))
        if isinstance(value, list) and what:
            if (len(value) != count if count is not None else not value) or not all(
                    ok(x) for x in value):
                many = f"a list of {count}" if count is not None else "a list of"
                raise self.error(f"{table}.{key} must be {bound} or {many} such "
                                 f"numbers (one per {what}), got {value!r}", table, key)
            return tuple(float(x) for x in value)
        if not ok(value):
            many = f"a list of {count}" if count is not None else "a list"
            raise self.error(f"{table}.{key} must be {bound}, got {describe(value)}"
                             + (f" (or {many} such numbers, one per {what})" if what else ""),
                             table, key)
        return float(value)

    def cost(self, data: dict, schedule: Schedule, term: Term) -> CostModel | None:
        """The cost model of ``[cost]``, ``[cost.segments.*]``, ``[comm]`` and ``[memory]
        static`` (None when the spec has none of them and its term implies no costs)."""
        table = data.get("cost", {})
        memory = data.get("memory", {})
        base = default_cost(term)
        if not table and "comm" not in data and "static" not in memory \
                and "weights" not in memory:
            return base
        stages, m = schedule.placement.num_stages, schedule.num_microbatches
        kw: dict[str, Any] = {}
        if base is not None:
            kw.update(F=base.F, B=base.B, I=base.I, W=base.W)
        for k in BODY_KINDS:
            if k in table:
                kw[k] = self.numbers("cost", k, table[k], stages, "stage", True)
        if "activation" in table:
            kw["activation"] = self.numbers("cost", "activation", table["activation"],
                                            stages, "stage", False)
        if "attention" in table:
            kw["attention"] = self.share("cost", "attention", table["attention"])
        kw["seq_chunks"] = schedule.seq_chunks
        segments = []
        names = {seg.name for seg in schedule.cut.segments}
        given = table.get("segments", {})
        for name in given:
            if name not in names:
                known = ", ".join(sorted(names)) or "none"
                raise self.error(f"[cost.segments.{name}]: this schedule has no segment "
                                 f"{name!r} (its segments: {known})", f"cost.segments.{name}")
        for name in sorted(names):
            seg = given.get(name, {})
            where = f"cost.segments.{name}"
            fields: dict[str, Any] = {}
            for k in ("F", "B", "R"):
                if k in seg:
                    fields[k] = self.numbers(where, k, seg[k], m, "microbatch", False)
            if "F" not in fields and base is not None:  # a transpose's own costs
                fields["F"] = base.segment(name).F
            for k in ("activation", "output", "input", "static", "replica"):
                if k in seg:
                    fields[k] = self.numbers(where, k, seg[k], 0, "", False)
            segments.append((name, SegmentCost(**fields)))
        kw["segments"] = tuple(segments)
        if "comm" in data:
            comm = {}
            for k, v in data["comm"].items():
                if k in ("bandwidth", "host_bandwidth"):
                    comm[k] = self.numbers("comm", k, v, 0, "", True)
                else:
                    comm[k] = self.numbers("comm", k, v, 0, "", False)
            kw["comm"] = CommModel(**comm)
        if "static" in memory:
            kw["static"] = self.numbers("memory", "static", memory["static"],
                                        schedule.num_ranks, "rank", False)
        if "weights" in memory:
            kw["weights"] = self.weights(memory, schedule)
            kw["static"] = _with_weights(kw.get("static", 0.0), CostModel(
                weights=kw["weights"]), schedule)
        return CostModel(**kw)

    def weights(self, memory: dict, schedule: Schedule):
        """``[memory] weights``: one number, or one per model stage."""
        stages = schedule.placement.num_stages // max(1, len(schedule.pipelines))
        return self.numbers("memory", "weights", memory["weights"], stages, "model stage",
                            False)

    def share(self, table: str, key: str, value) -> float:
        """A share between 0 and 1."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value <= 1:
            raise self.error(f"{key} must be a number from 0 to 1, got {value!r}", table, key)
        return float(value)

    def memory_numbers(self, data: dict, schedule: Schedule) -> dict:
        """The memory numbers exactly as the file writes them, only those it writes:
        ``activation`` (``[cost]``), ``static`` (``[memory]``) and, under ``segments``,
        each segment's ``activation``, ``output``, ``input``, ``static``, ``replica``. What
        a spec means about memory is these numbers and nothing else: the sizes it leaves
        out are the trusted shell's defaults (``question._SpecSizes``), never a cost
        model's."""
        table, memory, out = data.get("cost", {}), data.get("memory", {}), {}
        if "activation" in table:
            out["activation"] = self.numbers("cost", "activation", table["activation"],
                                             schedule.placement.num_stages, "stage", False)
        if "static" in memory:
            out["static"] = self.numbers("memory", "static", memory["static"],
                                         schedule.num_ranks, "rank", False)
        if "weights" in memory:  # the weight copies the schedule places: static memory
            out["static"] = _with_weights(out.get("static", 0.0), CostModel(
                weights=self.weights(memory, schedule)), schedule)
        segments = {}
        for name, seg in table.get("segments", {}).items():
            given = {k: self.numbers(f"cost.segments.{name}", k, seg[k], 0, "", False)
                     for k in ("activation", "output", "input", "static", "replica")
                     if k in seg}
            if given:
                segments[name] = given
        if segments:
            out["segments"] = segments
        return out

    def limit(self, table: dict, schedule: Schedule) -> float | tuple[float, ...] | None:
        if "limit" not in table:
            return None
        return self.numbers("memory", "limit", table["limit"], schedule.num_ranks, "rank", False)


def _with_weights(static, cost: CostModel, schedule: Schedule) -> tuple[float, ...]:
    """Per rank: ``static`` plus the weight copies ``schedule`` places on it."""
    placed = cost.placed_weights(schedule.placement, len(schedule.pipelines))
    return tuple((static[r] if isinstance(static, tuple) else float(static)) + w
                 for r, w in enumerate(placed))


def _dotted(key: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in key.split("."))
