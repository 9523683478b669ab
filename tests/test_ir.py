"""The canonical text (what a certificate's digest covers) stays byte for byte what it
was: digests pinned in ``fixtures/digests.json``, and the one-frame row spelling equal
to the op-by-op one on every kind of op and payload. That it says everything about a
plan: ``test_ir_canonical_decoding.py``."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from mpipe_verified.algebra.transpose import MODES, SINK, SOURCE, transpose_family
from mpipe_verified.formats.plan_json import read_plan_json
from mpipe_verified.formats.torch_csv import parse_torch_csv
from mpipe_verified.ir import (ACT, GRAD, INPUT, Collective, Compute, Group, Idle, Leaf, Marker,
                               Overlap, Payload, Recv, Send, _canonical, _canonical_row,
                               map_payloads)
from mpipe_verified.lower import lower
from mpipe_verified.verify import plan_digest
from plan_edits import lowered
from torch_fixtures import torch_schedule_csv

FIXTURES = Path(__file__).parent / "fixtures"
PINNED = FIXTURES / "digests.json"


def _shaped(payload: Payload) -> Payload:
    """Shapes and dtypes on activations, leaves on gradients (as the executor's plans)."""
    if payload.kind == ACT:
        return attrs.evolve(payload, shape=(2, payload.mb + 1), dtype="float32")
    return attrs.evolve(payload, leaves=(Leaf("(0)", (2, 3), "bfloat16"), Leaf('["none"]')))


def pinned_plans() -> dict:
    """Name -> plan: every plan-json fixture, the families, transposes of every side and
    mode, torch's own dumps (markers, overlaps, idle steps), and payload layouts."""
    plans = {f"fixture {p.stem}": read_plan_json(p) for p in sorted(FIXTURES.glob("*.json"))
             if p != PINNED}
    for name, p, m, v in [("gpipe", 2, 3, None), ("1f1b", 4, 8, None), ("zb-h1", 4, 8, None),
                          ("zb-h2", 3, 6, None), ("interleaved-1f1b", 4, 8, 2),
                          ("zbv", 3, 6, None), ("dualpipev", 4, 8, None)]:
        plans[f"family {name} {p} {m} {v}"] = lowered(name, p, m, v)
    for side in (SOURCE, SINK):
        for mode in MODES:
            if side == SINK and mode == "recompute":
                continue
            term = transpose_family(3, 4, body="1f1b", side=side, mode=mode, ownership="full")
            plans[f"transpose {side} {mode}"] = lower(term.derive())
    for name, v in (("DualPipeV", 2), ("Interleaved1F1B", 2)):
        text = torch_schedule_csv(name, 2, 4, v, "compute_comms")
        plans[f"torch {name}"] = parse_torch_csv(text, "t.csv")
    plans["shaped 1f1b"] = map_payloads(lowered("1f1b", 3, 4), _shaped)
    return plans


def test_digests_are_unchanged():
    """The pins were written by the op-by-op canonical text, before the one-frame rows (a
    fixture added since has no pin; a pinned one rewritten needs its pin rewritten). The
    pins of the plans that send across the cut were rewritten once, when the text began
    to say what the first one left out there (a send's ``to_segment``, the segment and
    stage a receive comes from); every other op is spelled as before."""
    pinned = json.loads(PINNED.read_text())
    plans = pinned_plans()
    assert {name: plan_digest(plans[name]) for name in pinned} == pinned


ODD = [  # everything the one-frame spelling hands to _canonical, and its own cases
    Compute("F", 1, 2), Compute("W", 0, 3, segment="vision"), Idle(), Marker(0, "UNSHARD"),
    Overlap((Compute("F", 0, 1), Compute("B", 3, 0))),
    Send(1, Payload(ACT, 0, 5)), Send(0, Payload(GRAD, 1, 5)), Recv(0, Payload(ACT, 0, 5)),
    Recv(2, Payload(GRAD, 3, 5)), Send(3, Payload(ACT, 0, 1, segment="vision", to_segment="")),
    Recv(3, Payload(ACT, 0, 1, segment="vision", to_segment="")),
    Recv(1, Payload(GRAD, 0, 1, to_segment="vision")),
    Send(1, Payload(INPUT, 0, 2, segment="vision")), Recv(0, Payload(INPUT, 0, 2, "vision")),
    Send(1, Payload(ACT, 0, 0, shape=(2, 3), dtype="float32")),
    Recv(1, Payload(GRAD, 2, 0, shape=(), dtype=None)),
    Send(1, Payload(ACT, 0, 0, leaves=())), Recv(0, Payload(GRAD, 1, 0, leaves=(Leaf("(0)"),))),
    Group((Send(1, Payload(ACT, 0, 0)), Recv(1, Payload(GRAD, 1, 0)))),
    Collective("all_reduce", (0, 1), "grads:vision"), Collective("broadcast", (0, 1), "p", 0),
]


@pytest.mark.parametrize("op", ODD, ids=str)
def test_one_frame_row_spells_each_op_as_canonical_does(op):
    row = (Idle(), op, Compute("B", 0, 0), op)
    expected = ",".join(_canonical(x) for x in row if type(x) is not Idle)
    assert _canonical_row(row) == expected
