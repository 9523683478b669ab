"""Values that travel between stages: a tensor, or tuples, lists and dicts (string keys)
of tensors and None, nested.

``flatten(value)`` lists its leaves as ``(path, leaf)`` depth first (dict items in
insertion order), with the paths of ``ir.path_steps``; a bare tensor is the one leaf
``("", tensor)``. ``unflatten`` rebuilds the value from such a list. ``Flat`` is a value
kept flat (a gradient: only the leaves that take one). ``layout`` is what the plan
records for a value (``ir.Leaf`` per leaf), ``detach`` cuts a value from its graph.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs
import torch

from ..ir import Leaf, path_steps, path_text
from . import comm


@attrs.frozen
class Flat:
    """A value given by its leaves ``(path, tensor or None)``, in the plan's order."""

    items: tuple


def flatten(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every tensor or None in ``value``; raises ``TypeError`` naming
    the path of anything else (or of an empty container: it has no leaf to describe it)."""
    if value is None or isinstance(value, torch.Tensor):
        return [(path, value)]
    if type(value) is Flat:
        return list(value.items)
    if type(value) is tuple or type(value) is list:
        mark = "({})" if type(value) is tuple else "[{}]"
        items = [(path + mark.format(i), v) for i, v in enumerate(value)]
    elif type(value) is dict:
        bad = next((k for k in value if type(k) is not str), None)
        if bad is not None:
            raise TypeError(f"dict key {bad!r} at {path or 'the top'}: only string keys "
                            "travel between stages")
        items = [(path + path_text((("dict", k),)), v) for k, v in value.items()]
    else:
        raise TypeError(f"{type(value).__name__} at {path or 'the top'}: only tensors, None "
                        "and tuples, lists and dicts of them travel between stages")
    if not items:
        raise TypeError(f"empty {type(value).__name__} at {path or 'the top'}: an empty "
                        "container cannot travel between stages")
    return [leaf for p, v in items for leaf in flatten(v, p)]


def unflatten(items: Iterable[tuple[str, Any]]) -> Any:
    """The value whose ``flatten`` is ``items``; raises ``ValueError`` when the paths do
    not describe one structure (a tuple or list index out of order, a path used twice,
    a path both a leaf and a container)."""
    items = list(items)
    if len(items) == 1 and items[0][0] == "":
        return items[0][1]
    root = _Node()
    for path, leaf in items:
        steps = path_steps(path)
        if not steps:
            raise ValueError("the top-level leaf \"\" must be the only leaf")
        node = root
        for step in steps[:-1]:
            node = node.child(step, path)
        node.put(steps[-1], leaf, path)
    return root.build()


class _Node:
    __slots__ = ("kind", "items")

    def __init__(self) -> None:
        self.kind, self.items = None, {}

    def _key(self, step, path: str):
        kind, key = step
        if self.kind not in (None, kind):
            raise ValueError(f"leaf path {path!r}: a {kind} step into a {self.kind}")
        self.kind = kind
        if kind != "dict" and key not in self.items and key != len(self.items):
            raise ValueError(f"leaf path {path!r}: {kind} item {key} out of order")
        return key

    def child(self, step, path: str) -> "_Node":
        key = self._key(step, path)
        node = self.items.setdefault(key, _Node())
        if type(node) is not _Node:
            raise ValueError(f"leaf path {path!r} goes inside a leaf")
        return node

    def put(self, step, leaf, path: str) -> None:
        key = self._key(step, path)
        if key in self.items:
            raise ValueError(f"leaf path {path!r} given twice or inside another")
        self.items[key] = _Leaf(leaf)

    def build(self) -> Any:
        values = [v.value if type(v) is _Leaf else v.build() for v in self.items.values()]
        if self.kind == "dict":
            return dict(zip(self.items, values))
        return tuple(values) if self.kind == "tuple" else values


class _Leaf:
    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


def is_float(t: torch.Tensor) -> bool:
    """Does ``t`` take a gradient (floating point or complex)?"""
    return t.is_floating_point() or t.is_complex()


def layout(value: Any) -> tuple[Leaf, ...]:
    """One ``Leaf`` per leaf of ``value`` (dtype names as ``torch.float32`` → ``float32``)."""
    return tuple(Leaf(p, None, None) if x is None else
                 Leaf(p, tuple(int(d) for d in x.shape), comm.dtype_name(x.dtype))
                 for p, x in flatten(value))


def grad_layout(value: Any) -> tuple[Leaf, ...]:
    """The leaves of ``value`` whose gradient travels back: float tensors that require it."""
    return tuple(leaf for leaf, (_, x) in zip(layout(value), flatten(value))
                 if x is not None and is_float(x) and x.requires_grad)


def detach(value: Any, keep_flag: bool = False) -> Any:
    """``value`` with every tensor detached (other objects as they are); ``keep_flag``:
    a float tensor that required grad still does (as a leaf), so a consumer on this rank
    sees which leaves take a gradient."""
    if isinstance(value, torch.Tensor):
        out = value.detach()
        return out.requires_grad_(True) if keep_flag and value.requires_grad else out
    if type(value) is tuple or type(value) is list:
        return type(value)(detach(v, keep_flag) for v in value)
    if type(value) is dict:
        return {k: detach(v, keep_flag) for k, v in value.items()}
    return value
