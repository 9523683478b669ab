"""Writing a spec: a term and its cost model as TOML that ``load_spec`` reads back.

``spec_text(term, cost, limit, header)`` writes ``[schedule] expression = str(term)`` and
every field of the cost model that the spec format can hold: ``[cost]`` (body durations
and activations, one number or one per stage), one ``[cost.segments.NAME]`` table per
segment, ``[comm]`` and ``[memory]`` (``static`` and ``limit``). Invariant: loading the
text gives an equal term (``str(term)`` reads back to an equal term) and an equal cost
model (every float is written with ``repr``, which reads back to the same float), so
the loaded spec times and verifies exactly as the one written. A field at its default
(a segment's ``B``/``R``/``replica`` of None, an infinite bandwidth) is left out: the
reader's default is that value.
"""

from __future__ import annotations

import json
import math

import attrs

from ..cost import CommModel, CostModel, SegmentCost

_BODY = ("F", "B", "I", "W", "R", "activation")
# [comm] fields written only when set (the specs written before them stay as they were)
_COMM_ADDED = ("stored_bytes", "host_bandwidth", "host_latency", "stage_parameter_bytes")


def _value(x) -> str:
    """A number or a tuple of numbers as TOML (``repr``: exact round trip)."""
    if isinstance(x, tuple):
        return "[" + ", ".join(_value(v) for v in x) + "]"
    return repr(float(x))


def _lines(fields) -> list[str]:
    return [f"{k} = {_value(v)}" for k, v in fields]


def _segment(name: str, seg: SegmentCost) -> list[str]:
    fields = [(k, getattr(seg, k)) for k in (f.name for f in attrs.fields(SegmentCost))]
    return [f"\n[cost.segments.{name}]"] + _lines((k, v) for k, v in fields if v is not None)


def _comm(comm: CommModel) -> list[str]:
    fields = [(f.name, getattr(comm, f.name)) for f in attrs.fields(CommModel)]
    return ["\n[comm]"] + _lines((k, v) for k, v in fields
                                 if not (k in ("bandwidth", "host_bandwidth") and math.isinf(v))
                                 and not (k in _COMM_ADDED and not v))


def _static(term, cost: CostModel) -> list[str]:
    """``[memory] static`` (and ``weights``: the static part without the weight copies
    the term's schedule places, which loading adds back)."""
    if not any(cost.weights if isinstance(cost.weights, tuple) else (cost.weights,)):
        return [f"static = {_value(cost.static)}"]
    schedule = term.derive()
    placed = cost.placed_weights(schedule.placement, len(schedule.pipelines))
    static = tuple((cost.static[r] if isinstance(cost.static, tuple) else cost.static) - w
                   for r, w in enumerate(placed))
    return [f"static = {_value(static)}", f"weights = {_value(cost.weights)}"]


def spec_text(term, cost: CostModel | None, limit, header: str = "") -> str:
    """The TOML text of a spec with ``term``, ``cost`` and the memory ``limit``."""
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    out += ["[schedule]", f"expression = {json.dumps(str(term))}"]
    if cost is not None:
        out += ["\n[cost]"] + _lines((k, getattr(cost, k)) for k in _BODY)
        if cost.attention:
            out += _lines([("attention", cost.attention)])
        for name, seg in cost.segments:
            out += _segment(name, seg)
        out += _comm(cost.comm)
    memory = (_static(term, cost) if cost is not None else []) + (
        [f"limit = {_value(limit)}"] if limit is not None else [])
    if memory:
        out += ["\n[memory]"] + memory
    return "\n".join(out) + "\n"
