"""A rank receives each activation, gradient or raw input at most once (docs/semantics.md
§2.3): a second receive of a token it holds would keep a second buffer of the same tensor,
which a non-zero buffer model counted as a leftover (the first buffer never freed) in a
plan that verified. It is a ``matching`` violation, found by the passes (op by op and by
columns), the kernel (from the plan alone) and the reference; the memory figures of such
a plan agree in all three readings."""

from __future__ import annotations

import attrs

from mpipe_verified import kernel
from mpipe_verified.cli import main
from mpipe_verified.formats.plan_json import format_plan_json
from mpipe_verified.formats.torch_csv import format_torch_csv
from mpipe_verified.ir import Recv, Send
from mpipe_verified.semantics import MemoryModel, op_table, p2p_clean, pair_p2p, peak_memory
from mpipe_verified.verify import passes, verify
from plan_edits import lowered
from reference import Sizes, judge_plan

BUFFER = MemoryModel(buffer=lambda payload: 5.0)


def received_twice():
    """GPipe on 2 ranks, 1 microbatch: rank 0 sends its activation twice, rank 1 receives
    it twice before its forward (FIFO pairs them; every payload agrees)."""
    plan = lowered("gpipe", 2, 1)
    p0, p1 = list(plan.programs[0]), list(plan.programs[1])
    send = next(op for op in p0 if isinstance(op, Send))
    recv = next(op for op in p1 if isinstance(op, Recv))
    p0.insert(p0.index(send) + 1, send)
    p1.insert(p1.index(recv) + 1, recv)
    return attrs.evolve(plan, programs=(tuple(p0), tuple(p1)))


def test_a_token_received_twice_is_a_matching_violation_in_every_reading():
    plan = received_twice()
    assert pair_p2p(plan).repeated == ((1, 1, 0),)
    report = verify(plan, memory_model=BUFFER)
    assert report.status == "violated"
    (v,) = report.violations
    assert v.property == "matching" and v.message.startswith(
        "rank 1 position 1: 1RECV_F0 from rank 0 receives what rank 1 received before")
    assert judge_plan(plan).violated == {"matching"}
    verdicts = kernel.prove(plan, kernel.Witness(None, None, None, None, None))  # no pass
    assert verdicts["matching"].status == "failed"
    assert kernel.confirm(plan, "matching", [("received", 1, 1)]) == ["violated"]
    assert kernel.confirm(plan, "matching", [("received", 1, 0)]) == ["rejected"]


def test_the_column_form_sees_it_too():
    plan = received_twice()
    table = op_table(plan)
    assert table is not None and not p2p_clean(table)
    found, _ = passes.matching(plan, table=table)
    assert [f.claim for f in found] == [("received", 1, 1)]
    assert p2p_clean(op_table(lowered("1f1b", 3, 5)))  # a valid plan stays clean


def test_its_memory_agrees_in_all_three_readings():
    """The second buffer counts again and is freed once in the semantics, the kernel
    (the peaks it proved) and the reference alike; the verdict says the plan is wrong."""
    plan = received_twice()
    report = verify(plan, memory_model=BUFFER)
    semantics = {r: peak for r, (peak, _) in peak_memory(plan, BUFFER).items()}
    reference = judge_plan(plan, sizes=Sizes(buffer={"act": 5, "grad": 5})).peak
    assert report.peak_memory == semantics == dict(enumerate(reference)) == {0: 6, 1: 11}


def test_the_command_line_names_the_second_receive(tmp_path, capsys):
    plan = received_twice()
    json_path, csv_path = tmp_path / "twice.json", tmp_path / "twice.csv"
    json_path.write_text(format_plan_json(plan))
    csv_path.write_text(format_torch_csv(plan))
    for path, where in ((json_path, None), (csv_path, ":2:2:")):
        assert main(["check", str(path)]) == 1
        out = capsys.readouterr().out
        assert "VIOLATED (1 matching counterexample" in out and "receives what rank 1" in out
        if where:
            assert f"{path}{where} matching" in out


def test_the_gradients_for_two_source_segments_are_two_payloads():
    """Two source segments (vision, then audio) cut from one body: rank 1 receives the
    body's first-stage gradient of a microbatch once for each (``to_segment`` differs):
    verified in every reading; the same gradient for one segment received twice is not."""
    from mpipe_verified.algebra import Transpose, family
    from mpipe_verified.lower import lower
    inner = Transpose(family("zb-h1", 3, 6), "vision", mode="owner", ownership="full")
    plan = lower(Transpose(inner, "audio", mode="owner", ownership="full").derive())
    grads = [op for op in plan.programs[1] if isinstance(op, Recv) and op.payload.to_segment]
    assert {op.payload.to_segment for op in grads} == {"vision", "audio"}
    assert op_table(plan) is None  # a plan with a cut has no column form: op by op only
    assert not pair_p2p(plan).repeated
    assert verify(plan).verified and not judge_plan(plan).violated
    no_pass = kernel.Witness(None, None, None, None, None)
    assert kernel.prove(plan, no_pass)["matching"].status == "proved"
    p0, p1 = list(plan.programs[0]), list(plan.programs[1])
    recv = grads[-1]
    send = next(op for op in p0 if isinstance(op, Send) and op.payload == recv.payload)
    p0.insert(p0.index(send) + 1, send)
    p1.insert(p1.index(recv) + 1, recv)
    twice = attrs.evolve(plan, programs=(tuple(p0), tuple(p1), plan.programs[2]))
    assert pair_p2p(twice).repeated
    assert {v.property for v in verify(twice).violations} == {"matching"}
    assert "matching" in judge_plan(twice).violated
    assert kernel.prove(twice, no_pass)["matching"].status == "failed"


def _received_twice_with(payload_edit):
    """GPipe on 2 ranks, 1 microbatch, its activation sent and received a second time
    with ``payload_edit`` applied to the second pair's payload."""
    plan = lowered("gpipe", 2, 1)
    p0, p1 = list(plan.programs[0]), list(plan.programs[1])
    send = next(op for op in p0 if isinstance(op, Send))
    recv = next(op for op in p1 if isinstance(op, Recv))
    payload = payload_edit(send.payload)
    p0.insert(p0.index(send) + 1, attrs.evolve(send, payload=payload))
    p1.insert(p1.index(recv) + 1, attrs.evolve(recv, payload=payload))
    return attrs.evolve(plan, programs=(tuple(p0), tuple(p1)))


def test_a_to_segment_that_crosses_nothing_does_not_excuse_a_second_receive():
    """Only a real crossing of the cut (the body's stage 0 gradient to a source, its last
    output to a sink) makes a receive another tensor: a made-up ``to_segment`` on a body
    activation is still the same activation received twice, in every reading."""
    no_pass = kernel.Witness(None, None, None, None, None)
    for to in ("bogus", ""):
        plan = _received_twice_with(lambda p: attrs.evolve(p, to_segment=to))
        assert pair_p2p(plan).repeated == ((1, 1, 0),)
        assert {v.property for v in verify(plan).violations} == {"matching"}
        assert "matching" in judge_plan(plan).violated
        assert kernel.prove(plan, no_pass)["matching"].status == "failed"


def test_two_sinks_on_one_rank_each_receive_the_body_output():
    """Two sink segments whose forwards share a rank each receive the body's last output
    (each sink's copy): verified in every reading."""
    from mpipe_verified.algebra import Transpose, family
    from mpipe_verified.lower import lower
    inner = Transpose(family("1f1b", 2, 4), "gen1", side="sink", mode="frozen",
                      ownership="min")
    plan = lower(Transpose(inner, "gen2", side="sink", mode="frozen",
                           ownership="min").derive())
    got = [op.payload for op in plan.programs[0] if isinstance(op, Recv)
           and op.payload.to_segment]
    assert {p.to_segment for p in got} == {"gen1", "gen2"}
    assert len({(p.kind, p.stage, p.mb) for p in got}) < len(got)  # one output, two sinks
    assert verify(plan).verified and not judge_plan(plan).violated
    no_pass = kernel.Witness(None, None, None, None, None)
    assert kernel.prove(plan, no_pass)["matching"].status == "proved"
