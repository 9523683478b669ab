"""Exact numbers, one at a time and as integer columns, and keys over columns.

A number the kernel computes with is exact: an int or a Fraction (``exact``). A column
of them is int64 when every value is below ``BOUND`` in magnitude (so no difference of
two of them overflows), else Python's own numbers (``as_column``). ``row_keys`` codes
each row of several columns as one int64 in ``0 .. BOUND - 1``, equal only for equal
rows and ordered as the rows are."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

BOUND = 1 << 62
EXACT = (int, Fraction)


def dense(x: np.ndarray) -> np.ndarray:
    """Each value's rank among the distinct values: int64 from 0, order kept."""
    return np.unique(x, return_inverse=True)[1].reshape(-1)


def distinct(key: np.ndarray) -> np.ndarray:
    """One row of each distinct value of ``key`` (ints >= 0, as ``row_keys`` makes them),
    in the order of the values."""
    span = int(key.max()) + 1
    if span > 4 * len(key):
        return np.unique(key, return_index=True)[1]
    last = np.full(span, -1, np.int64)
    last[key] = np.arange(len(key))
    return last[last >= 0]


def row_keys(*cols) -> np.ndarray:
    """One int64 per row of the columns (any ints: -1, huge, exact), ordered as the rows
    are lexicographically, so two rows share a key only when they are equal. Each column
    is made digits first (``_digits``), so every key is in ``0 .. BOUND - 1``: the keys so
    far and the digits are renumbered densely (order kept) where a product would reach
    ``BOUND``."""
    key = _digits(cols[0])[0]
    for col in cols[1:]:
        col, span = _digits(col)
        if len(key) and (int(key.max()) + 1) * span >= BOUND:
            key, col = dense(key), dense(col)
            span = int(col.max()) + 1
        key = key * span + col
    return key


def _digits(col: np.ndarray) -> tuple:
    """``(digits, span)``: ``col``'s values as int64 ``0 <= digit < span <= BOUND``, in the
    same order: less the least value, or renumbered densely where they span ``BOUND`` or
    more."""
    if not len(col):
        return col.astype(np.int64), 1
    low, high = int(col.min()), int(col.max())
    if high - low >= BOUND:
        col = dense(col)
        return col, int(col.max()) + 1
    return (col - low if low else col).astype(np.int64, copy=False), high - low + 1


def as_column(values, bound: int = BOUND) -> np.ndarray:
    """Exact numbers as an array: int64 when every value is an int of magnitude below
    ``bound`` (so no difference of two of them overflows), else Python's own numbers
    (objects). An int64 array is kept, or made exact where it leaves the bound; an array
    of any other dtype is kept as it is (the kernel's are int64 or already exact
    objects)."""
    if isinstance(values, np.ndarray):
        inside = values.dtype != np.int64 or not len(values) or (
            -bound < values.min() and values.max() < bound)
        return values if inside else values.astype(object)
    values = list(values)
    if set(map(type, values)) <= {int}:
        try:
            x = np.array(values, np.int64)
            if not len(x) or (-bound < x.min() and x.max() < bound):
                return x
        except OverflowError:  # beyond 64 bits
            pass
    return np.array(values, object)


def ints(values) -> np.ndarray:
    return np.fromiter(values, np.int64)


def pick(items: list, rows: np.ndarray) -> list:
    return list(map(items.__getitem__, rows.tolist()))


def exact(x):
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


def exacts(values) -> tuple:
    values = tuple(values)
    return values if set(map(type, values)) <= {int} else tuple(map(exact, values))


def json_number(x):
    """An exact number as JSON: an int as it is, a Fraction as its ``"a/b"`` text."""
    return x if isinstance(x, int) else str(x)
