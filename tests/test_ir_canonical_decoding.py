"""The canonical text (what a certificate's digest covers) is injective: it is read back
(``canonical_decoder.decode``) to the plan it was written from, less its idle steps, for
any well-typed plan and for lowered plans with renamed segments; the near-collisions an
audit found (and others of their kind) differ; a field of the wrong type is refused
rather than spelled like a value of the right one."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canonical_decoder import decode
from mpipe_verified.algebra.transpose import transpose_family
from mpipe_verified.ir import (ACT, GRAD, INPUT, SOURCE, Collective, Compute, Cut, Group, Idle,
                               Marker, Overlap, Payload, Placement, Plan, Recv, SegmentWork,
                               Send, map_payloads)
from mpipe_verified.kernel import digest
from mpipe_verified.lower import lower
from strategies import (DrawChooser, any_plans, decorate, lowered, random_term,
                        random_transpose_term, texts)


def without_idle(plan: Plan) -> Plan:
    return attrs.evolve(plan, programs=tuple(tuple(op for op in prog if type(op) is not Idle)
                                             for prog in plan.programs))


def reads_back(plan: Plan) -> None:
    assert decode(plan.canonical_text()) == without_idle(plan)


@given(any_plans())
def test_any_plan_reads_back_from_its_canonical_text(plan):
    reads_back(plan)


def renamed(plan: Plan, old: str, new: str) -> Plan:
    """``plan`` with its segment ``old`` called ``new`` everywhere: the cut, ops,
    payloads and the tags ``params:OLD``/``grads:OLD``."""
    def name(x):
        return new if x == old else x

    def op(x):
        if type(x) is Compute:
            return attrs.evolve(x, segment=name(x.segment))
        if type(x) is Overlap:
            return Overlap(tuple(map(op, x.ops)))
        if type(x) is Collective and x.tag.partition(":")[2] == old:
            return attrs.evolve(x, tag=f"{x.tag.partition(':')[0]}:{new}")
        return x

    plan = map_payloads(plan, lambda p: attrs.evolve(
        p, segment=name(p.segment),
        to_segment=None if p.to_segment is None else name(p.to_segment)))
    cut = Cut(tuple(attrs.evolve(s, name=name(s.name)) for s in plan.cut.segments))
    return attrs.evolve(plan, cut=cut, programs=tuple(tuple(map(op, prog))
                                                      for prog in plan.programs))


@st.composite
def lowered_plans(draw):
    """A lowered term or transpose, maybe with groups or collectives; a transpose's
    segment often renamed to any text."""
    ch = DrawChooser(draw)
    if ch.pick(["term", "transpose"]) == "term":
        return decorate(lowered(random_term(ch, 1)), ch, ch.pick(["plain", "groups",
                                                                  "collectives"]))
    plan = decorate(lowered(random_transpose_term(ch)), ch, ch.pick(["plain", "groups"]))
    (segment,) = plan.cut.segments
    return renamed(plan, segment.name, draw(texts.filter(bool) | st.just(segment.name)))


@settings(max_examples=60, deadline=None)
@given(lowered_plans())
def test_lowered_plans_read_back_from_their_canonical_text(plan):
    reads_back(plan)


def test_renaming_a_segment_renames_it_everywhere():
    plan = lower(transpose_family(3, 4, body="1f1b", side=SOURCE, mode="owner",
                                  ownership="full").derive())
    (segment,) = plan.cut.segments
    text = renamed(plan, segment.name, "a,b").canonical_text()
    assert segment.name not in text and text.count('"a,b"') > 10


# ---------------------------------------------------------------- near-collisions


def one_rank(*ops, ranks: int = 2) -> Plan:
    """One stage on rank 0; rank 0 runs ``ops``, the other ranks nothing."""
    return Plan(Placement((0,), ranks), 1, (tuple(ops),) + ((),) * (ranks - 1))


def act(**fields) -> Payload:
    return Payload(ACT, 0, 0, **fields)


NEAR = {  # pairs of different plans the first canonical text spelled alike
    "empty shape": (one_rank(Send(1, act(shape=()))), one_rank(Send(1, act()))),
    "tag holding @": (one_rank(Collective("broadcast", (0, 1), "params@0")),
                      one_rank(Collective("broadcast", (0, 1), "params", root=0))),
    "empty dtype": (one_rank(Send(1, act(dtype=""))), one_rank(Send(1, act()))),
    "dtype None": (one_rank(Send(1, act(shape=(2,), dtype="None"))),
                   one_rank(Send(1, act(shape=(2,))))),
    "a send's to_segment": (one_rank(Send(1, act(segment="vision", to_segment=""))),
                            one_rank(Send(1, act(segment="vision")))),
    "the stage a cut receive comes from": (
        one_rank(Recv(1, Payload(ACT, 3, 0, to_segment="gen"))),
        one_rank(Recv(1, Payload(ACT, 1, 0, to_segment="gen")))),
    "the segment a cut receive comes from": (
        one_rank(Recv(1, Payload(INPUT, 0, 2, "vision", to_segment=""))),
        one_rank(Recv(1, Payload(INPUT, 0, 2)))),
    "a segment holding ,": (one_rank(Compute("F", 0, 0, "x:0F1,y")),
                            one_rank(Compute("F", 0, 1, "x"), Compute("F", 0, 0, "y"))),
    "a segment holding ;": (
        one_rank(Overlap((Compute("F", 0, 0, "x:0F1;y"),))),
        one_rank(Overlap((Compute("F", 0, 1, "x"), Compute("F", 0, 0, "y"))))),
    "a segment holding a line end": (
        one_rank(Compute("F", 0, 0, "x:0F0\ny"), ranks=1),
        Plan(Placement((0,), 2), 1, ((Compute("F", 0, 0, "x"),), (Compute("F", 0, 0, "y"),)))),
    "a dtype holding >": (
        one_rank(Send(1, act(dtype="a>,0SEND_F0<1|None|b"))),
        one_rank(Send(1, act(dtype="a")), Send(1, act(dtype="b")))),
    "a tag holding | and )": (
        one_rank(Collective("all_reduce", (0,), "a|0),ALL_REDUCE(b")),
        one_rank(Collective("all_reduce", (0,), "a"), Collective("all_reduce", (0,), "b"))),
    "a group member's segment holding ;": (
        one_rank(Group((Send(1, Payload(GRAD, 1, 0, "v<1>;w")),))),
        one_rank(Group((Send(1, Payload(GRAD, 1, 0, "v")), Send(1, Payload(GRAD, 1, 0, "w")))))),
}


@pytest.mark.parametrize("name", list(NEAR))
def test_plans_the_first_text_confused_have_different_texts(name):
    a, b = NEAR[name]
    assert a != b
    assert a.canonical_text() != b.canonical_text() and digest(a) != digest(b)
    reads_back(a)
    reads_back(b)


def test_an_empty_shape_is_not_no_shape():
    """The audit's first collision: ``shape=()`` and no shape."""
    a, b = NEAR["empty shape"]
    assert digest(a) != digest(b)


def test_a_tag_holding_at_is_not_a_root():
    """The audit's second collision: a tag ``params@0`` and the tag ``params`` rooted at 0."""
    a, b = NEAR["tag holding @"]
    assert digest(a) != digest(b)


def test_a_cut_that_names_the_separators_reads_back():
    seg = SegmentWork('x",\n;|', "source", (0,), (0,), home=0, broadcast=True)
    plan = Plan(Placement((0,), 1), 1, ((Compute("F", 0, 0, seg.name),),), Cut((seg,)), True)
    reads_back(plan)


WRONG_TYPES = {  # a value that a text of the right type would spell alike
    "segment None": one_rank(Compute("F", 0, 0, None)),
    "payload segment None": one_rank(Send(1, act(segment=None))),
    "dtype 3": one_rank(Send(1, act(shape=(2,), dtype=3))),
    "to_segment 0": one_rank(Send(1, act(to_segment=0))),
    "tag None": one_rank(Collective("all_reduce", (0, 1), None)),
    "rank '1'": one_rank(Collective("all_reduce", (0, "1"))),
    "root '0'": one_rank(Collective("broadcast", (0, 1), "p", "0")),
    "marker mb '3'": one_rank(Marker(0, "UNSHARD", "3")),
    "shape ('2',)": one_rank(Send(1, act(shape=("2",)))),
    "microbatches '1'": attrs.evolve(one_rank(), num_microbatches="1"),
    "not an op": one_rank("0F0"),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_a_field_of_the_wrong_type_is_refused(name):
    with pytest.raises(TypeError):
        WRONG_TYPES[name].canonical_text()
