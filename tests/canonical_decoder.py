"""A reader of ``Plan.canonical_text``: ``decode(plan.canonical_text())`` is ``plan``
without its idle steps, for every plan whose fields hold their declared types. The tests
use it to show that the canonical text (what a certificate's digest covers) says
everything about a plan: two plans that differ in anything but idle steps never share it.

Written from the grammar, not from the encoder's code:

- line 1: ``placement=S,S,...;m=M``, then ``;cut=REPR`` (the cut's Python ``repr``), then
  ``;forward_only``, then ``;pipelines=MB,MB|MB,...`` (several pipelines; never with a
  cut, whose repr ends with ``)``), then ``;seq_chunks=S`` (only when S is not 1); each
  further line one rank's ops, separated by ``,``;
- a text (segment, tag, dtype, ``to``) is either plain (``[A-Za-z0-9_.:/+-]*``) or a JSON
  string; a segment prefixes its op as ``SEGMENT:``, the last ``:`` of a plain run;
- ``[SEG:]S{F,B,I,W,R}MB``; ``[SEG:]S{OFFLOAD,RELOAD}MB`` (activation moves); ``S{UNSHARD,RESHARD,REDUCE_GRAD}[MB]``;
  ``(C;C;...)OVERLAP_F_B``; ``[P;P;...]GROUP``; ``KIND(TAG[@ROOT]|R,R,...)``;
- ``[SEG:]S SEND_L MB<PEER FIELDS>`` (the producing segment and stage) and
  ``[SEG:]S RECV_L MB<PEER FIELDS>`` (the consuming ones), ``L`` in ``F``/``B``/``IN``/``LEND``/``RETURN`` (the last two name the activation's stage
  at both ends);
  fields ``|SHAPE|DTYPE`` (``None`` or a Python tuple; ``None`` or a text) or
  ``|leaves=JSON``, then ``|to=TEXT`` (a send's ``to_segment``) or ``|from=[SEG:]S`` (a
  receive across the cut: its payload's segment and stage; the head names the consumer).
"""

from __future__ import annotations

import ast
import json
import re

from mpipe_verified.ir import (ACT, COLLECTIVE_KINDS, GRAD, INPUT, Collective, Compute, Cut,
                               Group, Leaf, Marker, Offload, Overlap, Payload, Placement, Plan,
                               Recv, Reload, SegmentWork, Send)

_PLAIN_RUN = re.compile(r"[A-Za-z0-9_.:/+\-]*")
_INT = r"-?[0-9]+"
_COMPUTE = re.compile(r"([0-9]+)([FBIWR])([0-9]+)")
_MOVE = re.compile(r"([0-9]+)(OFFLOAD|RELOAD)([0-9]+)")
_MARKER = re.compile(r"([0-9]+)(UNSHARD|RESHARD|REDUCE_GRAD)(-?[0-9]+)?")
_P2P = re.compile(rf"({_INT})(SEND|RECV)_(F|B|IN|LEND|RETURN)([0-9]+)")
_SHAPE = re.compile(rf"None|\(\)|\(({_INT}),\)|\(({_INT}(?:, {_INT})+)\)")
_RANKS = re.compile(rf"(?:{_INT}(?:,{_INT})*)?")
_HEAD = re.compile(r"placement=((?:[0-9]+(?:,[0-9]+)*)?);m=([0-9]+)(?:;cut=(.*))?")
_KINDS = {"F": ACT, "B": GRAD, "IN": INPUT, "LEND": "lend", "RETURN": "return"}


class DecodeError(ValueError):
    pass


def decode(text: str) -> Plan:
    """The plan whose canonical text is ``text`` (idle steps are not in it)."""
    head, *rows = text.split("\n")
    chunks = re.search(r";seq_chunks=([0-9]+)$", head)  # a cut's repr ends with ")"
    seq_chunks = 1 if chunks is None else int(chunks.group(1))
    head = head if chunks is None else head[:chunks.start()]
    pipes = re.search(r";pipelines=([0-9,|]+)$", head)
    pipelines = () if pipes is None else tuple(
        tuple(int(mb) for mb in p.split(",")) for p in pipes.group(1).split("|"))
    head = head if pipes is None else head[:pipes.start()]
    forward_only = head.endswith(";forward_only")  # a cut's repr ends with ")"
    m = _HEAD.fullmatch(head.removesuffix(";forward_only"))
    if m is None:
        raise DecodeError(f"bad head {head!r}")
    stages = tuple(int(s) for s in m.group(1).split(",")) if m.group(1) else ()
    cut = Cut() if m.group(3) is None else _cut(m.group(3))
    programs = tuple(_Row(row).ops() for row in rows)
    return Plan(Placement(stages, len(rows)), int(m.group(2)), programs, cut, forward_only,
                pipelines, seq_chunks)


def _cut(text: str) -> Cut:
    """A ``Cut`` from its repr: calls of ``Cut``/``SegmentWork`` with literal arguments."""
    def value(node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            cls = {"Cut": Cut, "SegmentWork": SegmentWork}[node.func.id]
            if node.args:
                raise DecodeError("a cut's repr names its fields")
            return cls(**{k.arg: value(k.value) for k in node.keywords})
        if isinstance(node, ast.Tuple):
            return tuple(value(x) for x in node.elts)
        return ast.literal_eval(node)
    cut = value(ast.parse(text, mode="eval").body)
    if type(cut) is not Cut:
        raise DecodeError(f"not a cut: {text!r}")
    return cut


class _Row:
    """One rank's ops, read left to right."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def fail(self, what: str):
        raise DecodeError(f"expected {what} at {self.at} of {self.text!r}")

    def peek(self) -> str:
        return self.text[self.at:self.at + 1]

    def take(self, literal: str) -> None:
        if not self.text.startswith(literal, self.at):
            self.fail(repr(literal))
        self.at += len(literal)

    def match(self, pattern: re.Pattern, what: str) -> re.Match:
        m = pattern.match(self.text, self.at)
        if m is None:
            self.fail(what)
        self.at = m.end()
        return m

    def plain(self) -> str:
        return self.match(_PLAIN_RUN, "a plain text").group()

    def quoted(self) -> str:
        value, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
        if type(value) is not str:
            self.fail("a JSON string")
        return value

    def text_value(self) -> str:
        return self.quoted() if self.peek() == '"' else self.plain()

    def segment_and_rest(self) -> tuple[str, str]:
        """``(segment, what follows its ':')`` of ``[SEG:]REST`` (REST plain, no ``:``)."""
        if self.peek() == '"':
            segment = self.quoted()
            self.take(":")
            return segment, self.plain()
        segment, colon, rest = self.plain().rpartition(":")
        if colon and not segment:
            self.fail("a segment before ':'")
        return segment, rest

    def ops(self) -> tuple:
        out = []
        while self.at < len(self.text):
            if out:
                self.take(",")
            out.append(self.op())
        return tuple(out)

    def members(self, close: str) -> tuple:
        out = []
        while self.peek() != close:
            if out:
                self.take(";")
            out.append(self.op())
        self.take(close)
        return tuple(out)

    def op(self):
        if self.peek() == "(":
            self.take("(")
            ops = self.members(")")
            self.take("OVERLAP_F_B")
            return Overlap(ops)
        if self.peek() == "[":
            self.take("[")
            ops = self.members("]")
            self.take("GROUP")
            return Group(ops)
        if self.peek() != '"':
            start = self.at
            run = self.plain()
            if self.peek() == "(":
                return self.collective(run)
            self.at = start
        segment, rest = self.segment_and_rest()
        if (m := _COMPUTE.fullmatch(rest)) is not None:
            return Compute(m.group(2), int(m.group(1)), int(m.group(3)), segment)
        if (m := _MOVE.fullmatch(rest)) is not None:
            cls = Offload if m.group(2) == "OFFLOAD" else Reload
            return cls(int(m.group(1)), int(m.group(3)), segment)
        if (m := _MARKER.fullmatch(rest)) is not None and not segment:
            mb = None if m.group(3) is None else int(m.group(3))
            return Marker(int(m.group(1)), m.group(2), mb)
        if (m := _P2P.fullmatch(rest)) is not None:
            return self.p2p(segment, int(m.group(1)), m.group(2), _KINDS[m.group(3)],
                            int(m.group(4)))
        self.fail("an op")

    def collective(self, run: str) -> Collective:
        kind = run.lower()
        if kind not in COLLECTIVE_KINDS or run != kind.upper():
            self.fail("a collective's kind")
        self.take("(")
        tag = self.text_value()
        root = None
        if self.peek() == "@":
            self.take("@")
            root = int(self.match(re.compile(_INT), "a root").group())
        self.take("|")
        ranks = self.match(_RANKS, "ranks").group()
        self.take(")")
        return Collective(kind, tuple(int(r) for r in ranks.split(",")) if ranks else (),
                          tag, root)

    def p2p(self, segment: str, stage: int, way: str, kind: str, mb: int):
        self.take("<")
        peer = int(self.match(re.compile("[0-9]+"), "a peer").group())
        layout, fields = {}, {}
        while self.peek() == "|":
            self.take("|")
            if self.text.startswith("leaves=", self.at):
                self.take("leaves=")
                raw, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
                layout["leaves"] = tuple(Leaf(path, None if shape is None else tuple(shape),
                                              dtype) for path, shape, dtype in raw)
            elif self.text.startswith("to=", self.at):
                self.take("to=")
                fields["to"] = self.text_value()
            elif self.text.startswith("from=", self.at):
                self.take("from=")
                seg, rest = self.segment_and_rest()
                if not re.fullmatch("[0-9]+", rest):
                    self.fail("a stage")
                fields["from"] = (seg, int(rest))
            else:
                layout["shape"] = self.shape()
                self.take("|")
                layout["dtype"] = self.dtype()
        self.take(">")
        if way == "SEND":
            if "from" in fields:
                self.fail("no 'from' on a send")
            return Send(peer, Payload(kind, stage, mb, segment, to_segment=fields.get("to"),
                                      **layout))
        if "to" in fields:
            self.fail("no 'to' on a receive")
        if "from" in fields:
            (source, produced), to_segment = fields["from"], segment
        else:
            source, to_segment = segment, None
            produced = stage - 1 if kind == ACT else stage + 1 if kind == GRAD else stage
        return Recv(peer, Payload(kind, produced, mb, source, to_segment=to_segment, **layout))

    def dtype(self) -> str | None:
        if self.peek() == '"':
            return self.quoted()
        run = self.plain()
        return None if run == "None" else run

    def shape(self):
        m = self.match(_SHAPE, "a shape")
        if m.group() == "None":
            return None
        dims = m.group(1) or m.group(2)
        return tuple(int(d) for d in dims.split(", ")) if dims else ()
