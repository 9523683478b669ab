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
                                 if not (k == "bandwidth" and math.isinf(v)))


def spec_text(term, cost: CostModel | None, limit, header: str = "") -> str:
    """The TOML text of a spec with ``term``, ``cost`` and the memory ``limit``."""
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    out += ["[schedule]", f"expression = {json.dumps(str(term))}"]
    if cost is not None:
        out += ["\n[cost]"] + _lines((k, getattr(cost, k)) for k in _BODY)
        for name, seg in cost.segments:
            out += _segment(name, seg)
        out += _comm(cost.comm)
    memory = ([f"static = {_value(cost.static)}"] if cost is not None else []) + (
        [f"limit = {_value(limit)}"] if limit is not None else [])
    if memory:
        out += ["\n[memory]"] + memory
    return "\n".join(out) + "\n"
