"""The kernel packs tuples of integer columns into single keys (``_key``: token codes,
channels, stored-activation and buffer keys, facts kept once each). Two different tuples
never share a key, whatever the values: negative (the stage -1 a zero-stage plan's sink
needs, or what a bulk builder let through), 0, the readers' cap 10**6, near int64's
``BOUND``, or beyond it."""

import json

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from mpipe_verified import kernel
from mpipe_verified.cli import main
from mpipe_verified.formats.plan_json import format_plan_json
from mpipe_verified.ir import (Collective, Compute, Cut, Group, Payload, Placement, Plan, Recv,
                               SegmentWork, Send, build_many)
from mpipe_verified.kernel.columns import BOUND, as_column, pick, row_keys
from mpipe_verified.kernel.obligations import Facts, instances, moves
from mpipe_verified.kernel.rules import Rules, rules_of
from mpipe_verified.verify import verify

IN_INT64 = [-(BOUND - 1), -2, -1, 0, 1, 2, 10**6 - 1, 10**6, 10**6 + 1, BOUND - 2, BOUND - 1]
EXACT = [BOUND, 1 << 63, -(1 << 63), 1 << 70]
VALUES = st.sampled_from(IN_INT64 + EXACT) | st.integers(-3, 3)


def _rows_share_keys_only_when_equal(rows: list) -> np.ndarray:
    keys = row_keys(*(as_column(c) for c in zip(*rows)))
    for i, row in enumerate(rows):
        assert [k == keys[i] for k in keys] == [r == row for r in rows], (row, rows)
    return keys


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda w: st.lists(st.tuples(*[VALUES] * w), min_size=1,
                                                    max_size=12)))
@example([(2, 0, -1, 0), (1, 2, 0, 0)])  # (out, body, stage -1) vs (input, source, 0)
@example([(1, -1), (0, 1)])  # channel 1 -> -1 vs 0 -> 1
def test_a_key_is_shared_only_by_equal_rows_and_sorts_as_they_do(rows):
    """``_key``: equal keys iff equal rows, ordered as the rows are; int64 in ``0 ..
    BOUND - 1`` (what ``2 * key + 1`` and ``_distinct`` rely on)."""
    keys = _rows_share_keys_only_when_equal(rows)
    assert keys.dtype == np.int64 and all(0 <= k < BOUND for k in keys.tolist())
    by_key = sorted(range(len(rows)), key=lambda i: int(keys[i]))
    assert by_key == sorted(range(len(rows)), key=rows.__getitem__)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(IN_INT64),
                          st.sampled_from(IN_INT64)), min_size=1, max_size=20))
def test_a_class_keeps_each_distinct_extreme_fact_once(rows):
    """``_Facts.extend`` keeps one of each distinct 64-bit fact of a class (``_key`` and
    ``_distinct``): near ``-BOUND`` and ``BOUND`` no two facts merge."""
    facts = Facts()
    cls, a, b = (as_column(c) for c in zip(*rows))
    facts.extend("le", "x", [a, b], cls)
    kept = [(key[2], *map(int, x)) for key, lane in facts.lanes.items() for x in lane]
    assert sorted(kept) == sorted(set(rows))


def _zero_stage_plan() -> Plan:
    """No body stage: the sink's forward needs the body's last output (stage -1), which
    nothing makes. A user's collective makes it a plan with comm ops (``recheck`` reads
    it as lowered)."""
    cut = Cut((SegmentWork("src", "source", (0,)), SegmentWork("sink", "sink", (0,))))
    program = (Compute("F", 0, 0, "src"), Compute("F", 0, 0, "sink"),
               Collective("all_reduce", (0,)))
    return Plan(Placement((), 1), 1, (program,), cut)


FORGED = kernel.Witness(finish=((1,),), producers=((0,),), levels=((0,),), peaks=(0,),
                        peak_at=(-1,))  # the sink's input "made" by the source's forward


def test_the_stage_before_stage_0_is_no_token_an_op_makes():
    (nrow, need), _, (_, made) = rules_of(_zero_stage_plan()).tokens
    assert len(need) == 1 and need[0] not in made


def test_a_zero_stage_plan_with_a_forged_producer_is_not_proved(tmp_path, capsys):
    plan = _zero_stage_plan()
    assert verify(plan).status != "verified"
    verdicts = kernel.prove(plan, FORGED)
    assert verdicts["dependency"].status == "failed"
    assert all(v.status == "proved" for name, v in verdicts.items() if name != "dependency")
    cert = kernel.certificate(plan, FORGED, "rendezvous", kernel.Sizes(), None)
    assert kernel.recheck(plan, cert)[0] is False
    plan_file, cert_file = tmp_path / "plan.json", tmp_path / "cert.json"
    plan_file.write_text(format_plan_json(plan))
    cert_file.write_text(json.dumps(cert))
    capsys.readouterr()
    # the command refuses to read such a file at all now (a cut off a body of no stages
    # means nothing: exit 2, located), which is stronger still than not proving it
    code = main(["recheck", str(plan_file), str(cert_file)])
    out, err = capsys.readouterr()
    assert code == 2 and "PROVEN" not in out and "cut off a body of no stages" in err, err


@settings(max_examples=60, deadline=None)
@given(st.tuples(*[st.sampled_from([0, 1, 2, 10**6, BOUND - 1, BOUND, 1 << 70])] * 4))
def test_a_producer_of_another_token_is_refused_at_extreme_numbers(numbers):
    """``F(s2, b2)`` needs the output of ``(s2 - 1, b2)``; a witness naming ``F(s1, b1)``
    as its producer proves dependency exactly when that is the token it makes (a
    receive before it makes what ``F(s1, b1)`` needs)."""
    s1, b1, s2, b2 = numbers
    s2 += 1
    first = (Recv(0, Payload("act", s1 - 1, b1)),) if s1 else ()
    ops = (*first, Compute("F", s1, b1), Compute("F", s2, b2))
    producers = ((0, 1) if s1 else (0,),)
    plan = Plan(Placement((0,), 1), 1, (ops,))
    verdict = kernel.prove(plan, kernel.Witness(None, producers, None, None, None),
                           properties=("dependency",))["dependency"]
    assert verdict.status == ("proved" if (s1, b1) == (s2 - 1, b2) else "failed")


PEERS = {"small": [-1, 0, 1, 2, 10**6], "int64": [-(BOUND - 1), -1, 0, 1, BOUND - 1],
         "exact": [-1, 0, 1, 10**6, BOUND, 1 << 70]}


def _bulk_p2p(cls, peers: list, payload: Payload) -> list:
    """Sends or receives with peers no validator saw (as a reader's bulk builder makes
    them)."""
    return build_many(cls, len(peers), {"dst" if cls is Send else "src": peers,
                                        "payload": [payload] * len(peers)})


@pytest.mark.parametrize("peers", PEERS.values(), ids=PEERS)
def test_channels_with_extreme_peers_are_told_apart(peers):
    """``pairs``: ends share a channel code iff they share ``(src, dst)``."""
    act = Payload("act", 0, 0)
    programs = tuple(tuple(_bulk_p2p(Send, peers, act) + _bulk_p2p(Recv, peers, act))
                     for _ in range(3))
    rules = Rules(Plan(Placement((0,), 3), 1, programs))
    chan = rules.pairs[3]
    ends = [(int(rules.rank[row]), op.dst) if type(op) is Send else (op.src, int(rules.rank[row]))
            for row, op in zip(rules.comm.tolist(), pick(rules.ops, rules.comm))]
    for j, end in enumerate(ends):
        assert [c == chan[j] for c in chan] == [e == end for e in ends]


def test_a_send_to_rank_minus_1_meets_no_receive():
    """Rank 1 sends to rank -1 and receives from rank 0, which sends nothing; packed
    without care, channel ``1 -> -1`` is ``0 -> 1`` and the plan was proved."""
    act = Payload("act", 0, 0)
    group = Group((*_bulk_p2p(Send, [-1], act), Recv(0, act)))
    plan = Plan(Placement((1,), 2), 1, ((), (Compute("F", 0, 0), group)), forward_only=True)
    witness = kernel.Witness(((), (1,)), ((), (0,)), ((0,), (0,)), (0, 0), (-1, -1))
    verdicts = kernel.prove(plan, witness)
    assert verdicts["matching"].status == "failed"
    assert verdicts["deadlock"].status == "failed"


def _bulk_computes(kinds: str, units: list) -> list:
    return build_many(Compute, len(units), {"kind": list(kinds), "segment": [u[0] for u in units],
                                           "stage": [u[1] for u in units],
                                           "mb": [u[2] for u in units]})


def test_a_forward_of_microbatch_minus_1_counts_for_no_unit():
    """Two stages, two microbatches; ``F(0, 1)`` is missing and a ``F(1, -1)`` stands in:
    packed as ``unit * m + mb`` it counted as ``F(0, 1)``."""
    ops = _bulk_computes("FFFF", [("", 0, 0), ("", 1, -1), ("", 1, 0), ("", 1, 1)])
    plan = Plan(Placement((0, 0), 1), 2, (tuple(ops),), forward_only=True)
    verdict = kernel.prove(plan, kernel.Witness(None, None, None, None, None),
                           properties=("completeness",))["completeness"]
    assert verdict.status == "failed"


UNITS = {"small": [("", 0, 0), ("", 1, -1), ("", 0, 10**6), ("x", -1, 0), ("", 10**6, 0),
                   ("", 10**6 + 1, -1), ("x", 0, 1)],
         "int64": [("", 0, 0), ("", 1, -1), ("", 0, 10**6), ("x", -1, 0), ("", 10**6, 0),
                   ("", 10**6 + 1, -1), ("x", BOUND - 1, 0), ("", 0, BOUND - 1)],
         "exact": [("", 0, 0), ("", 1, -1), ("x", -1, 1 << 70), ("", 1 << 70, 0),
                   ("", (1 << 70) + 1, -1), ("x", BOUND, 0), ("", 0, BOUND)]}


@pytest.mark.parametrize("units", UNITS.values(), ids=UNITS)
def test_each_stored_activation_is_freed_by_its_own_backward(units):
    """``_moves``: forwards of distinct ``(segment, stage, mb)`` store, the backwards free in
    reverse order; each backward frees its own forward's activation (its own size), never
    another's."""
    ops = _bulk_computes("F" * len(units) + "B" * len(units), units + units[::-1])
    plan = Plan(Placement((0,), 1), 1, (tuple(ops),))
    size = {(seg, s): 1 + k for k, (seg, s, _) in enumerate(units)}
    alloc, freed = moves(Rules(plan), kernel.Sizes(stored=size))
    sizes = [size[(seg, s)] for seg, s, _ in units]
    assert alloc.tolist() == sizes + [0] * len(units)
    assert freed.tolist() == [0] * len(units) + sizes[::-1]


def test_collective_instances_over_extreme_ranks_stay_apart():
    """``_instances`` keys calls by their exact member set: groups that differ only in an
    extreme rank are different instances."""
    groups = [(-1, 0), (0, 1), (0, 10**6), (0, BOUND - 1), (0, BOUND), (0, 1 << 70)]
    program = tuple(Collective("all_reduce", g) for g in groups)
    calls = instances(Rules(Plan(Placement((0,), 1), 1, (program,))))
    assert sorted(calls) == sorted((g, 0) for g in groups)
