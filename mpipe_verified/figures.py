"""Numbers as the reports show them: ``figure``/``figures`` for the JSON documents (an
integral value as an ``int``), ``num_text`` for the text grid and diffs (``3``, ``2.5``).
"""

from __future__ import annotations


def figure(x: float | None) -> float | int | None:
    """A figure as the JSON reports carry it: an integral value as an ``int`` (the unit
    model's ``11``, not ``11.0``), any other value (and None) unchanged."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def figures(values: dict) -> dict:
    """``figure`` of every value of a ``{rank: value}`` map, keys as JSON strings."""
    return {str(k): figure(v) for k, v in sorted(values.items())}


def num_text(x: float | None) -> str:
    """A number as the grid and ``diff`` print it: ``3``, ``2.5``; None as ``-``."""
    if x is None:
        return "-"
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
