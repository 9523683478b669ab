"""A spec: a schedule term with its cost tables and memory limit (``Spec``), and the
algebra's expression language that names a term in text.

A ``Spec`` holds its term's derivation, computed once when the spec is made, and the sizes
a file declares beside it (``declared.declare``); ``formats.spec`` reads one from a TOML
file. One cost model serves everything: a transpose's own estimates (``default_cost``)
when no cost tables are given, else the tables' ``CostModel``, which the simulator reads.

The expression language (``parse_expression``) is a whitelisted subset of Python call
syntax: only the calls in ``FUNCTIONS``, and int, float, string and list literals.
``str(term)`` of every term prints this language and reads back to an equal term. Every
problem with an expression raises ``InputError`` naming the file, the 1-based line and
column, and what was expected.
"""

from __future__ import annotations

import ast
import math
from typing import Any, Callable

import attrs

from .algebra import families, terms
from .algebra.literal import Program
from .algebra.transpose import Transpose
from .cost import NO_COMM_COST, CommCost, CostModel
from .errors import InputError, ParameterError
from .ir import Op, Schedule
from .semantics import UNIT_MEMORY, MemoryModel, standard_duration

TERM_TYPES = (terms.Weave, terms.Seq, terms.Par, terms.Restrict, terms.SplitBW, terms.MergeBW,
              terms.DeferW, terms.Relabel, terms.ForwardOnly, terms.Offloaded, Transpose,
              Program)
Term = Any  # any of TERM_TYPES: an object with ``derive() -> Schedule``


def default_cost(term: Term) -> CostModel | None:
    """The cost model a term implies by itself: a transpose's own estimates (its body
    costs and per-microbatch segment costs), None for any other term (standard costs)."""
    return term.estimate_cost() if isinstance(term, Transpose) else None


@attrs.frozen
class Spec:
    """A loaded spec. ``schedule`` is ``term.derive()`` (computed once, at load), with
    the sizes the file declares beside it (``stages``, ``ranks``, ``microbatches``:
    ``declares`` is then True and the schedule is no longer the term's own)."""

    term: Term
    schedule: Schedule = attrs.field(eq=False, repr=False)
    cost: CostModel | None = None
    memory_limit: float | tuple[float, ...] | None = None
    file: str = ""
    declared: tuple = (None, None, None)  # (stages, microbatches, ranks) the file asks for
    derived: Schedule | None = attrs.field(default=None, eq=False, repr=False)
    memory_written: dict | None = attrs.field(default=None, eq=False)  # see memory_numbers

    @property
    def declares(self) -> bool:
        """Whether the file declares sizes beside its term (the schedule is then not the
        term's own)."""
        return self.derived is not None and self.schedule is not self.derived

    @property
    def own_schedule(self) -> Schedule:
        """The term's own derivation, before the declared sizes."""
        return self.schedule if self.derived is None else self.derived

    def duration(self, op: Op) -> float:
        """The cost model's duration, or ``standard_duration`` without one."""
        return self.cost.duration(op) if self.cost else standard_duration(op)

    @property
    def memory_model(self) -> MemoryModel:
        """§2.6 with the spec's sizes (static part and segment copies included), or the
        unit model without a cost model."""
        if not self.cost:
            return UNIT_MEMORY
        return self.cost.memory_model_for(self.schedule.cut, self.schedule.num_ranks)

    @property
    def comm_cost(self) -> CommCost:
        return self.cost.comm_cost() if self.cost else NO_COMM_COST

    def limit_of(self, rank: int) -> float | None:
        lim = self.memory_limit
        return lim[rank] if isinstance(lim, tuple) else lim

    @classmethod
    def of_term(cls, term: Term, file: str = "") -> "Spec":
        """A spec without cost tables or limit (``ParameterError`` if it does not derive);
        a transpose keeps its own cost estimates (``default_cost``)."""
        return cls(term, term.derive(), default_cost(term), file=file, memory_written={})


# ---------------------------------------------------------------- expression language

_INT, _STR, _TERM, _INTS = "an integer", "a string", "a schedule term", "a list of integers"
_NUM, _NUMS = "a number", "a list of numbers"
_STRS, _BOOL = "a list of strings", "True or False"
_REQUIRED = object()


def _family(name: str) -> Callable[..., Term]:
    if name in families.SEQ_FAMILIES:
        return lambda pp, microbatches, seq_chunks=None: families.family(
            name, pp, microbatches, seq_chunks=seq_chunks)
    if name in families.WAVED:
        return lambda pp, microbatches, waves=None: families.family(name, pp, microbatches,
                                                                     waves=waves)
    return lambda pp, microbatches, chunks=None: families.family(name, pp, microbatches, chunks)


def _program(pp, microbatches, ranks, placement, chunks):
    return Program(pp, microbatches, tuple(ranks),
                   placement if isinstance(placement, str) else tuple(placement), chunks)


def _defer_w(t, lag):
    return terms.DeferW(t, str(lag))


_PP_M = (("pp", _INT, _REQUIRED), ("microbatches", _INT, _REQUIRED))
# name -> (constructor, ((param, type, default), ...)); defaults equal the term's own.
# The constructor takes the params positionally, in this order.
FUNCTIONS: dict[str, tuple[Callable[..., Term], tuple[tuple[str, Any, Any], ...]]] = {
    "weave": (terms.Weave, (*_PP_M, ("pattern", _STR, _REQUIRED), ("chunks", _INT, 1),
                            ("placement", _STR, "looped"), ("group", _INT, None),
                            ("pipelines", _INT, 1), ("order", _STR, "dfs"),
                            ("backward", _STR, "asc"), ("seq_chunks", _INT, 1),
                            ("even", _BOOL, False))),
    "program": (_program, (*_PP_M, ("ranks", _STRS, _REQUIRED), ("placement", (_STR, _INTS),
                                                                    "looped"),
                            ("chunks", _INT, 1))),
    "family": (lambda name, pp, microbatches, chunks=None, waves=None, seq_chunks=None:
               families.family(name, pp, microbatches, chunks, waves=waves,
                               seq_chunks=seq_chunks),
               (("name", _STR, _REQUIRED), *_PP_M, ("chunks", _INT, None), ("waves", _INT, None),
                ("seq_chunks", _INT, None))),
    **{make.__name__:  # one_f_one_b, zb_h1, ...: the family functions' own names
       (_family(name), _PP_M + ((("chunks", _INT, None),) if name in families.CHUNKED else
                                (("waves", _INT, None),) if name in families.WAVED else
                                (("seq_chunks", _INT, None),) if name in families.SEQ_FAMILIES
                                else ()))
       for name, make in {**families.FAMILIES, **families.BIDIRECTIONAL,
                          **families.SEQ_FAMILIES}.items()},
    "seq": (terms.Seq, (("a", _TERM, _REQUIRED), ("b", _TERM, _REQUIRED))),
    "par": (terms.Par, (("a", _TERM, _REQUIRED), ("b", _TERM, _REQUIRED))),
    "restrict": (lambda t, ranks: terms.Restrict(t, tuple(ranks)),
                 (("t", _TERM, _REQUIRED), ("ranks", _INTS, _REQUIRED))),
    "split_bw": (terms.SplitBW, (("t", _TERM, _REQUIRED),)),
    "merge_bw": (terms.MergeBW, (("t", _TERM, _REQUIRED),)),
    "forward_only": (terms.ForwardOnly, (("t", _TERM, _REQUIRED),)),
    "offload": (terms.Offloaded, (("t", _TERM, _REQUIRED), ("gap", _INT, 2),
                                  ("prefetch", _INT, 1))),
    "defer_w": (_defer_w, (("t", _TERM, _REQUIRED), ("lag", (_STR, _INT), _REQUIRED))),
    "relabel": (lambda t, perm: terms.Relabel(t, tuple(perm)),
                (("t", _TERM, _REQUIRED), ("perm", _INTS, _REQUIRED))),
    "transpose": (Transpose, (("body", _TERM, _REQUIRED), ("segment", _STR, "vision"),
                               ("side", _STR, "source"), ("mode", _STR, "recompute"),
                               ("ownership", _STR, "cost"), ("costs", _NUMS, ()),
                               ("body_forward", _NUM, 1.0), ("body_backward", _NUM, 2.0),
                               ("owners", _INTS, ()))),
}


def parse_expression(text: str, file: str = "<expression>", line: int = 1,
                     column: int = 1) -> Term:
    """Parse an algebra expression into a term (not derived). ``line``/``column`` give
    where ``text`` starts in ``file``, so errors point into the file."""

    def fail(msg: str, node: ast.AST | None = None, lineno: int = 1, col: int = 0) -> InputError:
        if node is not None:
            lineno, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0)
        return InputError(msg, file, line + lineno - 1, (column if lineno == 1 else 1) + col)

    if not text.strip():
        raise fail("empty expression; expected a call like weave(...) or zb_h1(...)")
    lead = text[:len(text) - len(text.lstrip())]  # ast rejects leading blanks: skip them
    if "\n" in lead:
        line, column = line + lead.count("\n"), 1
    column += len(lead) - (lead.rfind("\n") + 1)
    try:
        tree = ast.parse(text.lstrip(), mode="eval")
    except SyntaxError as e:
        raise fail(f"expression syntax error: {e.msg}", lineno=e.lineno or 1,
                   col=max(0, (e.offset or 1) - 1)) from None
    except (ValueError, RecursionError, MemoryError) as e:  # NUL bytes, absurd nesting
        raise fail(f"unreadable expression: {e or type(e).__name__}") from None

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, str, bool):
            return node.value
        if (isinstance(node, ast.Constant) and type(node.value) is float
                and math.isfinite(node.value)):
            return node.value
        if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                and isinstance(node.operand, ast.Constant)
                and type(node.operand.value) in (int, float)
                and math.isfinite(node.operand.value)):
            return -node.operand.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Call):
            return call(node)
        raise fail(f"unsupported syntax {ast.unparse(node)!r}; expected a call, a number, "
                   "a string or a list", node)

    def call(node: ast.Call) -> Term:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise fail(f"unknown function {ast.unparse(node.func)!r}; expected one of "
                       f"{', '.join(FUNCTIONS)}", node)
        name = node.func.id
        ctor, params = FUNCTIONS[name]
        names = [p[0] for p in params]
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords):
            raise fail(f"{name}(): * and ** arguments are not allowed", node)
        if len(node.args) > len(params):
            raise fail(f"{name}() takes at most {len(params)} arguments "
                       f"({', '.join(names)})", node)
        given: dict[str, tuple[Any, ast.AST]] = {
            p[0]: (value(a), a) for p, a in zip(params, node.args)}
        for k in node.keywords:
            if k.arg not in names:
                raise fail(f"{name}() has no argument {k.arg!r}; expected {', '.join(names)}", k)
            if k.arg in given:
                raise fail(f"{name}() got argument {k.arg!r} twice", k)
            given[k.arg] = (value(k.value), k.value)
        args = []
        for pname, ptype, default in params:
            if pname not in given:
                if default is _REQUIRED:
                    raise fail(f"{name}() needs argument {pname!r}", node)
                args.append(default)
                continue
            v, where = given[pname]
            if not _is(v, ptype):
                kinds = " or ".join(ptype) if isinstance(ptype, tuple) else ptype
                raise fail(f"{name}(): {pname} must be {kinds}, got {describe(v)}", where)
            args.append(v)
        try:
            return ctor(*args)
        except ParameterError as e:
            raise fail(f"{name}(): {e}", node) from None

    try:
        result = value(tree.body)
    except RecursionError:
        raise fail("expression nested too deeply") from None
    if not isinstance(result, TERM_TYPES):
        raise fail(f"expected a schedule term such as zb_h1(pp=4, microbatches=8), got "
                   f"{describe(result)}", tree.body)
    return result


def _is(v: Any, ptype: Any) -> bool:
    if isinstance(ptype, tuple):
        return any(_is(v, t) for t in ptype)
    return {_INT: lambda: type(v) is int, _STR: lambda: type(v) is str,
            _BOOL: lambda: type(v) is bool,
            _TERM: lambda: isinstance(v, TERM_TYPES),
            _INTS: lambda: type(v) is list and all(type(x) is int for x in v),
            _STRS: lambda: type(v) is list and all(type(x) is str for x in v),
            _NUM: lambda: type(v) in (int, float),
            _NUMS: lambda: type(v) is list and all(type(x) in (int, float) for x in v),
            }[ptype]()


def describe(v: Any) -> str:
    if isinstance(v, TERM_TYPES):
        return "a schedule term"
    return f"{type(v).__name__} {v!r}"
