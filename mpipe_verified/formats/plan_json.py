"""``plan-json``: a plan (or schedule) file that holds everything the IR can.

One JSON object::

    {
      "format": "mpipe-plan-json",
      "version": 1,
      "type": "plan",                       # or "schedule" (compute work only)
      "num_ranks": 2,
      "stage_to_rank": [0, 1],
      "num_microbatches": 2,
      "forward_only": true,                 # only in an evaluation plan (no backward)
      "pipelines": [[0, 1], [2, 3]],        # only with several pipelines over one model
      "seq_chunks": 2,                      # only when samples are cut into chunks
      "cut": [
        {"name": "vision", "side": "source", "forward_rank": [0, 1],
         "backward_rank": [0, 1], "recompute": false, "home": 0, "broadcast": true,
         "all_reduce": true}
      ],
      "programs": [
        [
          {"op": "compute", "kind": "F", "stage": 0, "mb": 0, "segment": "vision"},
          {"op": "send", "dst": 1, "payload": {"kind": "act", "stage": 0, "mb": 0}},
          ...
        ],
        [...]
      ]
    }

``forward_only`` (optional, default false) declares an evaluation plan: no backward
work is required of it, and none may occur. ``pipelines`` (optional, default one
pipeline) lists each pipeline's microbatches: lists that partition ``0..m-1``, as many
as divide the stages (docs/semantics.md §2.9). ``seq_chunks`` (optional, default 1) cuts
each sample along its sequence into that many chunks, microbatch ``sample * S + j``
being chunk ``j``; it must divide ``num_microbatches``. ``programs`` holds one list per rank, in
run order; each op is one object whose ``op`` key names its kind:

- ``compute``: ``kind`` (``F``/``B``/``I``/``W``/``R``), ``stage``, ``mb``, ``segment``;
- ``overlap``: ``ops``, its member ``compute`` objects;
- ``send``: ``dst``, ``payload``; ``recv``: ``src``, ``payload``; a payload has ``kind``
  (``act``/``grad``/``input``, or ``lend``/``return``: a stored activation lent to a
  peer rank and given back, docs/semantics.md §2.10), ``stage``, ``mb``, ``segment``, ``shape`` (a list of
  dimensions), ``dtype``, ``to_segment`` and ``leaves`` (a structured payload: a list of
  ``{"path", "shape", "dtype"}``, shape and dtype null for a None leaf; then the
  payload's own ``shape`` and ``dtype`` are absent);
- ``group``: ``ops``, its member ``send``/``recv`` objects;
- ``collective``: ``kind`` (``broadcast``/``all_reduce``/``gather``), ``tag``,
  ``members`` (the ranks taking part, in order) and ``root``;
- ``offload``/``reload``: ``stage``, ``mb``, ``segment``: a stored activation moved to host
  memory and back (docs/semantics.md §2.10);
- ``idle``: an empty step; ``marker``: ``action`` (``UNSHARD``/``RESHARD``/
  ``REDUCE_GRAD``), ``stage``, ``mb``.

Canonical form (what the writer produces): keys in the order above; an op key at its
default (``segment``/``tag`` ``""``; ``shape``, ``dtype``, ``to_segment``, ``leaves``, ``root``,
marker ``mb`` ``null``) is left out; the reader accepts it either way. Two-space
indentation, one cut segment and one op per line, ASCII only, ``\\n`` line ends. So
``parse(format(plan)) == plan`` for every plan and ``format(parse(text)) == text`` for
every text in canonical form, and a schedule change shows as a line diff.

The reader checks every value against what the IR can hold and raises ``InputError``
naming the file and the JSON path (``$.programs[2][5].payload.mb: expected a
non-negative integer, got -1``); malformed JSON names its line and column. Indices,
ranks and counts are integers in ``0..MAX_INDEX`` (booleans are not integers); a cut
segment's ``forward_rank`` and ``backward_rank`` have one entry per microbatch, and a
plan with a cut has a body (``stage_to_rank`` not empty: the segments feed it or are fed
by it); at most ``MAX_IDLE_RANKS`` programs hold no op but idle steps and at most
``MAX_IDLE_STAGES`` stages are computed by no op (``declared``: no rank or stage costs
what no op pays for); ``stage_to_rank`` holds at most ``MAX_INDEX + 1`` entries, each in
``0..num_ranks-1``; a schedule holds no ``send``/``recv``/``group``. Every op names
only what the plan declares (``ranges``: a peer or member in ``0..num_ranks-1``, a
stage of ``stage_to_rank`` or of its segment, a microbatch below ``num_microbatches``)
and moves something (no reload of an activation its rank never offloads, no return of
one it never lent or held). What a well-formed plan may still get wrong (a root outside
the members, an op on the wrong rank, a reload before its offload) is the verifier's to
report. Reading takes time and memory linear in the file's size (at most
``MAX_BYTES``); no index value sizes anything.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from ..declared import (IDLE_RANKS, IDLE_STAGES, MAX_IDLE_RANKS, MAX_IDLE_STAGES,
                        idle_rank_beyond, idle_stage_beyond)
from ..errors import InputError
from ..ir import (COLLECTIVE_KINDS, COMPUTE_KINDS, MARKER_ACTIONS, PAYLOAD_KINDS,
                  RANK_MOVES, SINK, SOURCE, Collective, Compute, Cut, Group, Idle, Leaf, Marker, Offload,
                  Op, Overlap, Payload, Placement, Plan, Recv, Reload, Schedule, SegmentWork,
                  Send, path_steps)
from .output import write_output
from .files import MAX_BYTES, read_text
from .ranges import Named, beyond, of_nothing
from .torch_actions import MAX_INDEX

FORMAT, VERSION = "mpipe-plan-json", 1
PLAN, SCHEDULE = "plan", "schedule"
MAX_DIM = (1 << 63) - 1  # a tensor dimension: torch's int64
EXPECTED = "expected a plan-json file"
_TOP = ("format", "version", "type", "num_ranks", "stage_to_rank", "num_microbatches",
        "cut", "programs")
_OPTIONAL_TOP = ("forward_only", "pipelines", "seq_chunks")
_SEGMENT = ("name", "side", "forward_rank", "backward_rank", "recompute", "home",
            "broadcast", "all_reduce")

# ---------------------------------------------------------------- writing


def format_plan_json(plan: Plan | Schedule) -> str:
    """The canonical plan-json text of ``plan`` (see the module docstring)."""
    head = {"format": FORMAT, "version": VERSION,
            "type": SCHEDULE if isinstance(plan, Schedule) else PLAN,
            "num_ranks": plan.placement.num_ranks,
            "stage_to_rank": list(plan.placement.stage_to_rank),
            "num_microbatches": plan.num_microbatches}
    if plan.forward_only:
        head["forward_only"] = True
    if plan.pipelines:
        head["pipelines"] = [list(p) for p in plan.pipelines]
    if plan.seq_chunks != 1:
        head["seq_chunks"] = plan.seq_chunks
    cut = _rows([_dump(_segment_obj(s)) for s in plan.cut.segments], "  ")
    programs = _rows([_rows([_dump(_op_obj(op)) for op in program], "    ")
                      for program in plan.programs], "  ")
    fields = [f"{_dump(k)}: {_dump(v)}" for k, v in head.items()]
    fields += [f'"cut": {cut}', f'"programs": {programs}']
    return "{\n" + ",\n".join(f"  {f}" for f in fields) + "\n}\n"


def write_plan_json(plan: Plan | Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``format_plan_json(plan)`` to ``path`` atomically (``-``: standard output)."""
    write_output(path, format_plan_json(plan))


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def _rows(items: list[str], indent: str) -> str:
    """A JSON array, one item per line, closed at ``indent`` (``[]`` when empty)."""
    if not items:
        return "[]"
    return "[\n" + ",\n".join(f"{indent}  {i}" for i in items) + f"\n{indent}]"


def _segment_obj(s: SegmentWork) -> dict:
    return {"name": s.name, "side": s.side, "forward_rank": list(s.forward_rank),
            "backward_rank": None if s.backward_rank is None else list(s.backward_rank),
            "recompute": s.recompute, "home": s.home, "broadcast": s.broadcast,
            "all_reduce": s.all_reduce}


def _op_obj(op: Op) -> dict:
    kind = type(op)
    if kind is Compute:
        return _with({"op": "compute", "kind": op.kind, "stage": op.stage, "mb": op.mb},
                     segment=(op.segment, ""))
    if kind is Overlap:
        return {"op": "overlap", "ops": [_op_obj(c) for c in op.ops]}
    if kind is Send:
        return {"op": "send", "dst": op.dst, "payload": _payload_obj(op.payload)}
    if kind is Recv:
        return {"op": "recv", "src": op.src, "payload": _payload_obj(op.payload)}
    if kind is Group:
        return {"op": "group", "ops": [_op_obj(o) for o in op.ops]}
    if kind is Collective:
        return _with({"op": "collective", "kind": op.kind}, tag=(op.tag, ""),
                     members=(list(op.ranks), None), root=(op.root, None))
    if kind is Offload or kind is Reload:
        return _with({"op": "offload" if kind is Offload else "reload", "stage": op.stage,
                      "mb": op.mb}, segment=(op.segment, ""))
    if kind is Idle:
        return {"op": "idle"}
    if kind is Marker:
        return _with({"op": "marker", "action": op.action, "stage": op.stage},
                     mb=(op.mb, None))
    raise ValueError(f"not an op: {op!r}")


def _payload_obj(p: Payload) -> dict:
    return _with({"kind": p.kind, "stage": p.stage, "mb": p.mb}, segment=(p.segment, ""),
                 shape=(None if p.shape is None else list(p.shape), None),
                 dtype=(p.dtype, None), to_segment=(p.to_segment, None),
                 leaves=(None if p.leaves is None else [_leaf_obj(x) for x in p.leaves], None))


def _leaf_obj(x: Leaf) -> dict:
    return {"path": x.path, "shape": None if x.shape is None else list(x.shape),
            "dtype": x.dtype}


def _with(obj: dict, **fields: tuple[Any, Any]) -> dict:
    """``obj`` plus each ``key=(value, default)`` whose value is not its default."""
    for key, (value, default) in fields.items():
        if value != default:
            obj[key] = value
    return obj


# ---------------------------------------------------------------- reading


def named_error(found: Named, file: str) -> InputError:
    """The bad-input error of an op that names what its plan lacks (``ranges``), at its
    JSON path."""
    where = _where(("programs", found.rank, found.index, *found.field))
    return InputError(f"{where}: {found.message}", file)


def read_plan_json(path: str | os.PathLike[str]) -> Plan | Schedule:
    """Read a plan-json file (at most ``MAX_BYTES``; see ``parse_plan_json``)."""
    name = os.fspath(path)
    text = read_text(name, EXPECTED.removeprefix("expected "), MAX_BYTES)
    return parse_plan_json(text, name)


def parse_plan_json(text: str, file: str) -> Plan | Schedule:
    """The ``Plan`` (or ``Schedule``, for ``"type": "schedule"``) of plan-json text."""
    if len(text) > MAX_BYTES:
        raise InputError(f"text longer than {MAX_BYTES} characters; {EXPECTED}", file)
    return _Reader(file).top(load_json(text, file))


class _Bad(Exception):
    """A value the IR cannot hold at JSON path ``path`` (a tuple of keys and indices)."""

    def __init__(self, path: tuple, message: str) -> None:
        super().__init__(message)
        self.path, self.message = path, message


def load_json(text: str, file: str, expected: str = EXPECTED) -> Any:
    """Strict JSON: no duplicate keys, no NaN/Infinity, bounded nesting and digits; bad
    text is an ``InputError`` naming ``file`` (and the line and column) and ``expected``."""
    def pairs(items: list[tuple[str, Any]]) -> dict:
        obj = dict(items)
        if len(obj) != len(items):
            seen: set[str] = set()
            dup = next(k for k, _ in items if k in seen or seen.add(k))
            raise ValueError(f"duplicate key {_dump(dup)}")
        return obj

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise InputError(f"malformed JSON: {e.msg}; {expected}", file, e.lineno,
                         e.colno) from None
    except RecursionError:
        raise InputError(f"JSON nested too deeply; {expected}", file) from None
    except ValueError as e:  # duplicate key, NaN/Infinity, an integer of >4300 digits
        why = "an integer of too many digits" if "digits" in str(e) else str(e)
        raise InputError(f"malformed JSON: {why}; {expected}", file) from None


def _where(path: tuple) -> str:
    """``$.programs[2][5].payload``; a key that is not a short identifier is quoted."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int)
                         else f".{p}" if p.isidentifier() and len(p) <= 40
                         else f"[{_shown(p)}]" for p in path)


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = _dump(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Reader:
    """Builds IR values from parsed JSON, checking each against what the IR can hold."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.num_ranks = 0
        self.schedule = False
        self.moves = False  # whether an op moves an activation (``ranges.of_nothing``)

    def top(self, doc: Any) -> Plan | Schedule:
        try:
            return self._top(doc)
        except _Bad as e:
            raise InputError(f"{_where(e.path)}: {e.message}", self.file) from None

    def _top(self, doc: Any) -> Plan | Schedule:
        obj = _fields(doc, (), _TOP + _OPTIONAL_TOP, _TOP)
        if obj["format"] != FORMAT:
            raise _Bad(("format",), f"expected {_dump(FORMAT)}, got {_shown(obj['format'])}")
        if obj["version"] != VERSION or type(obj["version"]) is not int:
            raise _Bad(("version",), f"expected {VERSION}, got {_shown(obj['version'])}")
        kind = _choice(obj["type"], ("type",), (PLAN, SCHEDULE))
        self.schedule = kind == SCHEDULE
        self.num_ranks = _index(obj["num_ranks"], ("num_ranks",), low=1)
        placed = _array(obj["stage_to_rank"], ("stage_to_rank",))
        if len(placed) > MAX_INDEX + 1:
            raise _Bad(("stage_to_rank", MAX_INDEX + 1), f"a stage above {MAX_INDEX}: "
                                                         "expected at most "
                                                         f"{MAX_INDEX + 1} stages")
        stage_to_rank = tuple(self._rank(r, ("stage_to_rank", s)) for s, r in enumerate(placed))
        m = _index(obj["num_microbatches"], ("num_microbatches",))
        cut = Cut(tuple(self._segment(s, ("cut", i), m)
                        for i, s in enumerate(_array(obj["cut"], ("cut",)))))
        names = [seg.name for seg in cut.segments]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise _Bad(("cut", i, "name"), f"segment {_dump(name)} is named twice")
        if cut.segments and not stage_to_rank:
            raise _Bad(("cut", 0), f"segment {_dump(names[0])} is cut off a body of no "
                                   "stages (stage_to_rank is empty): a source segment feeds "
                                   "the body's first stage, a sink is fed by its last")
        rows = _array(obj["programs"], ("programs",))
        if len(rows) != self.num_ranks:
            raise _Bad(("programs",), f"expected {self.num_ranks} programs (one per rank of "
                                      f"num_ranks), got {len(rows)}")
        programs = tuple(tuple(self._op(op, ("programs", r, i))
                               for i, op in enumerate(_array(row, ("programs", r))))
                         for r, row in enumerate(rows))
        idle = idle_rank_beyond(programs)
        if idle is not None:
            raise _Bad(("programs", idle), f"the {MAX_IDLE_RANKS + 1}th program without an op "
                                           f"(idle steps aside): {IDLE_RANKS}")
        idle = idle_stage_beyond(programs, len(stage_to_rank))
        if idle is not None:
            raise _Bad(("stage_to_rank", idle), f"the {MAX_IDLE_STAGES + 1}th stage that no "
                                                f"compute op computes: {IDLE_STAGES}")
        placement = Placement(stage_to_rank, self.num_ranks)
        forward_only = _flag(obj.get("forward_only", False), ("forward_only",))
        pipelines = tuple(tuple(_index(mb, ("pipelines", i, k)) for k, mb in
                                enumerate(_array(row, ("pipelines", i))))
                          for i, row in enumerate(_array(obj.get("pipelines", []),
                                                         ("pipelines",))))
        chunks = _index(obj.get("seq_chunks", 1), ("seq_chunks",), low=1)
        if m % chunks:
            raise _Bad(("seq_chunks",), f"seq_chunks={chunks} does not divide the {m} "
                                        "microbatches (num_microbatches)")
        try:
            plan = (Schedule if self.schedule else Plan)(placement, m, programs, cut,
                                                         forward_only, pipelines, chunks)
        except ValueError as e:
            if not pipelines:
                raise
            raise _Bad(("pipelines",), str(e)) from None
        found = beyond(plan) or (of_nothing(plan) if self.moves else None)
        if found is not None:
            raise _Bad(("programs", found.rank, found.index, *found.field), found.message)
        return plan

    def _rank(self, value: Any, path: tuple) -> int:
        rank = _index(value, path)
        if rank >= self.num_ranks:
            raise _Bad(path, f"expected a rank in 0..{self.num_ranks - 1}, got {rank}")
        return rank

    def _segment(self, value: Any, path: tuple, m: int) -> SegmentWork:
        obj = _fields(value, path, _SEGMENT, _SEGMENT)
        forward = self._per_mb(obj["forward_rank"], (*path, "forward_rank"), m)
        back = obj["backward_rank"]
        backward = None if back is None else self._per_mb(back, (*path, "backward_rank"), m)
        name = _string(obj["name"], (*path, "name"))
        if not name:
            raise _Bad((*path, "name"), "expected a non-empty segment name")
        return SegmentWork(name,
                           _choice(obj["side"], (*path, "side"), (SOURCE, SINK)),
                           forward, backward, _flag(obj["recompute"], (*path, "recompute")),
                           self._rank(obj["home"], (*path, "home")),
                           _flag(obj["broadcast"], (*path, "broadcast")),
                           _flag(obj["all_reduce"], (*path, "all_reduce")))

    def _per_mb(self, value: Any, path: tuple, m: int) -> tuple[int, ...]:
        items = _array(value, path)
        if len(items) != m:
            raise _Bad(path, f"expected one rank per microbatch ({m} of num_microbatches), "
                             f"got {len(items)}")
        return tuple(self._rank(r, (*path, i)) for i, r in enumerate(items))

    def _op(self, value: Any, path: tuple, allowed: tuple[str, ...] = ()) -> Op:
        """The op ``value`` (one of ``allowed``, or any kind)."""
        if not isinstance(value, dict):
            raise _Bad(path, f"expected an op object, got {_shown(value)}")
        if "op" not in value:
            raise _Bad(path, 'missing key "op"')
        kind = _choice(value["op"], (*path, "op"), allowed or tuple(_OPS))
        if self.schedule and kind in ("send", "recv", "group"):
            raise _Bad((*path, "op"), f"a schedule holds no {kind} (lowering inserts "
                                      "point-to-point ops); use \"type\": \"plan\"")
        return _OPS[kind](self, value, path)

    def _compute(self, value: Any, path: tuple) -> Compute:
        obj = _fields(value, path, ("op", "kind", "stage", "mb", "segment"),
                      ("op", "kind", "stage", "mb"))
        return Compute(_choice(obj["kind"], (*path, "kind"), COMPUTE_KINDS),
                       _index(obj["stage"], (*path, "stage")), _index(obj["mb"], (*path, "mb")),
                       _string(obj.get("segment", ""), (*path, "segment")))

    def _overlap(self, value: Any, path: tuple) -> Overlap:
        obj = _fields(value, path, ("op", "ops"), ("op", "ops"))
        return Overlap(tuple(self._op(c, (*path, "ops", i), ("compute",))
                             for i, c in enumerate(_members(obj["ops"], (*path, "ops")))))

    def _send(self, value: Any, path: tuple) -> Send:
        obj = _fields(value, path, ("op", "dst", "payload"), ("op", "dst", "payload"))
        return Send(_index(obj["dst"], (*path, "dst")), self._payload(obj, path))

    def _recv(self, value: Any, path: tuple) -> Recv:
        obj = _fields(value, path, ("op", "src", "payload"), ("op", "src", "payload"))
        return Recv(_index(obj["src"], (*path, "src")), self._payload(obj, path))

    def _payload(self, obj: dict, path: tuple) -> Payload:
        payload = _payload(obj["payload"], (*path, "payload"))
        self.moves = self.moves or payload.kind in RANK_MOVES
        return payload

    def _group(self, value: Any, path: tuple) -> Group:
        obj = _fields(value, path, ("op", "ops"), ("op", "ops"))
        return Group(tuple(self._op(o, (*path, "ops", i), ("send", "recv"))
                           for i, o in enumerate(_members(obj["ops"], (*path, "ops")))))

    def _collective(self, value: Any, path: tuple) -> Collective:
        obj = _fields(value, path, ("op", "kind", "tag", "members", "root"),
                      ("op", "kind", "members"))
        members = tuple(_index(r, (*path, "members", i))
                        for i, r in enumerate(_array(obj["members"], (*path, "members"))))
        root = obj.get("root")
        return Collective(_choice(obj["kind"], (*path, "kind"), COLLECTIVE_KINDS), members,
                          _string(obj.get("tag", ""), (*path, "tag")),
                          None if root is None else _index(root, (*path, "root")))

    def _move(self, value: Any, path: tuple) -> Offload | Reload:
        obj = _fields(value, path, ("op", "stage", "mb", "segment"), ("op", "stage", "mb"))
        self.moves = True
        return (Offload if obj["op"] == "offload" else Reload)(
            _index(obj["stage"], (*path, "stage")), _index(obj["mb"], (*path, "mb")),
            _string(obj.get("segment", ""), (*path, "segment")))

    def _idle(self, value: Any, path: tuple) -> Idle:
        _fields(value, path, ("op",), ("op",))
        return Idle()

    def _marker(self, value: Any, path: tuple) -> Marker:
        obj = _fields(value, path, ("op", "action", "stage", "mb"), ("op", "action", "stage"))
        mb = obj.get("mb")
        return Marker(_index(obj["stage"], (*path, "stage")),
                      _choice(obj["action"], (*path, "action"), MARKER_ACTIONS),
                      None if mb is None else _index(mb, (*path, "mb")))


_OPS: dict[str, Callable[[_Reader, Any, tuple], Op]] = {
    "compute": _Reader._compute, "overlap": _Reader._overlap, "send": _Reader._send,
    "recv": _Reader._recv, "group": _Reader._group, "collective": _Reader._collective,
    "idle": _Reader._idle, "marker": _Reader._marker, "offload": _Reader._move,
    "reload": _Reader._move}


def _payload(value: Any, path: tuple) -> Payload:
    keys = ("kind", "stage", "mb", "segment", "shape", "dtype", "to_segment", "leaves")
    obj = _fields(value, path, keys, keys[:3])
    shape, dtype = _shape(obj.get("shape"), path), obj.get("dtype")
    to_segment, leaves = obj.get("to_segment"), obj.get("leaves")
    if leaves is not None:
        if shape is not None or dtype is not None:
            raise _Bad((*path, "leaves"), "a payload with leaves has no shape or dtype of "
                                          "its own")
        leaves = tuple(_leaf(x, (*path, "leaves", i))
                       for i, x in enumerate(_array(leaves, (*path, "leaves"))))
    return Payload(_choice(obj["kind"], (*path, "kind"), PAYLOAD_KINDS),
                   _index(obj["stage"], (*path, "stage")), _index(obj["mb"], (*path, "mb")),
                   _string(obj.get("segment", ""), (*path, "segment")), shape,
                   None if dtype is None else _string(dtype, (*path, "dtype")),
                   None if to_segment is None else _string(to_segment, (*path, "to_segment")),
                   leaves)


def _shape(value: Any, path: tuple) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(_index(d, (*path, "shape", i), high=MAX_DIM)
                 for i, d in enumerate(_array(value, (*path, "shape"))))


def _leaf(value: Any, path: tuple) -> Leaf:
    obj = _fields(value, path, ("path", "shape", "dtype"), ("path", "shape", "dtype"))
    where = _string(obj["path"], (*path, "path"))
    try:
        path_steps(where)
    except ValueError as e:
        raise _Bad((*path, "path"), str(e)) from None
    shape, dtype = _shape(obj["shape"], path), obj["dtype"]
    if (shape is None) != (dtype is None):
        raise _Bad(path, "a leaf has a shape and a dtype, or neither (a None leaf)")
    return Leaf(where, shape, None if dtype is None else _string(dtype, (*path, "dtype")))


def _fields(value: Any, path: tuple, allowed: tuple[str, ...],
            required: tuple[str, ...]) -> dict:
    """``value`` as an object with only ``allowed`` keys and every ``required`` one."""
    if not isinstance(value, dict):
        raise _Bad(path, f"expected an object, got {_shown(value)}")
    for key in value:
        if key not in allowed:
            raise _Bad((*path, key), f"unknown key (expected {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise _Bad(path, f"missing key {_dump(key)}")
    return value


def _index(value: Any, path: tuple, low: int = 0, high: int = MAX_INDEX) -> int:
    if type(value) is not int or value < low:
        what = "a non-negative integer" if low == 0 else f"an integer >= {low}"
        raise _Bad(path, f"expected {what}, got {_shown(value)}")
    if value > high:
        raise _Bad(path, f"expected an integer at most {high}, got {value}")
    return value


def _typed(kind: type, what: str) -> Callable[[Any, tuple], Any]:
    """A checker: the value at ``path`` is exactly of ``kind`` (else: expected ``what``)."""
    def check(value: Any, path: tuple) -> Any:
        if type(value) is not kind:
            raise _Bad(path, f"expected {what}, got {_shown(value)}")
        return value
    return check


_string = _typed(str, "a string")
_flag = _typed(bool, "true or false")
_array = _typed(list, "an array")


def _members(value: Any, path: tuple) -> list:
    """An overlapped step's or a group's ops: a non-empty array."""
    if not _array(value, path):
        raise _Bad(path, "expected one op or more, got an empty array")
    return value


def _choice(value: Any, path: tuple, choices: tuple[str, ...]) -> str:
    if type(value) is not str or value not in choices:
        raise _Bad(path, f"expected one of {', '.join(choices)}, got {_shown(value)}")
    return value
