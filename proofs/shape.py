"""The closed form of the pattern ``F^{w} (F B)*`` read against ``n`` forwards and ``n``
backwards (the shape of GPipe, 1F1B and interleaved 1F1B on one rank), written once for
Z3 terms and for Python integers (``ite``, ``mn``, ``div`` pick the right operation), so
the proofs reason about the same formulas the model test expands.

With ``0 <= w <= n`` warmup forwards, op ``k`` of ``[0, 2n)`` is

    k < w:            F(k)                                   (warmup)
    w <= k < 2n-w:    F(w + (k-w)/2) if k-w even, else B((k-w-1)/2)   (steady)
    2n-w <= k:        B(k - n)                               (cooldown)

(the index is the unit's place in its stream). Its inverse: ``F(u)`` sits at ``u`` when
``u < w``, else at ``2u - w``; ``B(u)`` at ``w + 2u + 1`` when ``u < n - w``, else at
``n + u``. Before position ``k`` there are ``nf(k)`` forwards and ``nb(k)`` backwards.
"""

from __future__ import annotations

import z3

from .model import B, F


def ite(c, a, b):
    """``If`` on a Z3 condition, the plain conditional on a Python one."""
    return (a if c else b) if isinstance(c, bool) else z3.If(c, a, b)


def mn(a, b):
    return ite(a < b, a, b)


def div(a, b):
    """Floor division (Z3's integer ``/`` is floor division for a positive divisor)."""
    return a // b if isinstance(a, int) and isinstance(b, int) else a / b


def op(k, w, n):
    """``(kind, unit)`` at position ``k``."""
    j = k - w
    steady_kind = ite(j % 2 == 0, F, B)
    steady_unit = ite(j % 2 == 0, w + div(j, 2), div(j - 1, 2))
    kind = ite(k < w, F, ite(k < 2 * n - w, steady_kind, B))
    unit = ite(k < w, k, ite(k < 2 * n - w, steady_unit, k - n))
    return kind, unit


def pos_f(u, w, n):
    return ite(u < w, u, 2 * u - w)


def pos_b(u, w, n):
    return ite(u < n - w, w + 2 * u + 1, n + u)


def nf(k, w, n):
    """Forwards before position ``k``."""
    return ite(k <= w, k, ite(k <= 2 * n - w, w + div(k - w + 1, 2), n))


def nb(k, w, n):
    """Backwards before position ``k``."""
    return ite(k <= w, 0, ite(k <= 2 * n - w, div(k - w, 2), k - n))


def peak(w, n):
    """The unit-model peak: the warmup plus one, at most ``n``."""
    return mn(w + 1, n)


def expand(w: int, n: int) -> list[tuple[int, int]]:
    """The ``(kind, unit)`` list of the shape (Python integers)."""
    return [op(k, w, n) for k in range(2 * n)]
