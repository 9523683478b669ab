"""The simulator and its cost model: ``sim.simulate`` is ``semantics.execute`` with
durations, transfer and collective costs and §2.6 memory; a hand-computed run; the
``simulate`` command's JSON; the spec cost tables that feed it."""

from __future__ import annotations

import json
import pathlib

import pytest

from mpipe_verified.algebra import family
from mpipe_verified.algebra.transpose import transpose_family
from mpipe_verified.cli import main
from mpipe_verified.errors import InputError
from mpipe_verified.cost import CommCost, CommModel, CostModel, SegmentCost
from mpipe_verified.formats.spec import parse_spec
from mpipe_verified.ir import (ACT, GRAD, INPUT, SOURCE, Collective, Compute, Cut, Payload,
                               Recv, SegmentWork, Send)
from mpipe_verified.lower import lower
from mpipe_verified.semantics import standard_duration
from mpipe_verified.sim import simulate
from mpipe_verified.spec import Spec
from mpipe_verified.verify import verify

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


# ---------------------------------------------------------------- a run by hand


def test_makespan_by_hand_p2_m2_with_latency():
    """1F1B, p = 2, m = 2, F = 1, B = 2, every transfer takes L = 0.25 (eager).

    The lowering orders transfers by a unit-cost run (F at 0 and 1 on rank 0, 1F0 at 1,
    1B0 at 2..4, 1F1 at 4, 1B1 at 5..7, 0B0 at 4..6, 0B1 at 7..9), so the plan is::

        rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
        rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1

    A send costs its rank nothing; a receive ends L after both ends are posted:

    - rank 0: 0F0 [0, 1], sends at 1, 0F1 [1, 2], sends at 2, posts 0RECV_B0 at 2;
    - rank 1: 1RECV_F0 ends 1 + L; 1F0 [1+L, 2+L]; 1RECV_F1 (send posted at 2) ends
      2 + 2L; 1B0 [2+2L, 4+2L]; 1SEND_B0 at 4+2L; 1F1 [4+2L, 5+2L]; 1B1 [5+2L, 7+2L];
      1SEND_B1 at 7+2L;
    - rank 0: 0RECV_B0 ends 4 + 3L; 0B0 [4+3L, 6+3L]; 0RECV_B1 posted at 6+3L, its send
      at 7+2L (later, as L < 1): ends 7 + 3L; 0B1 [7+3L, 9+3L].

    Makespan 9 + 3L = 9.75; each rank is busy 6, so the bubble fraction is
    1 - 12 / (2 * 9.75)."""
    plan = lower(family("1f1b", 2, 2).derive())
    assert [list(map(str, row)) for row in plan.programs] == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]]
    L = 0.25
    run = simulate(plan, standard_duration, CommCost(latency=L))
    assert run.makespan == pytest.approx(9 + 3 * L)
    assert run.busy == (6.0, 6.0)
    assert run.bubble_fraction == pytest.approx(1 - 12 / (2 * 9.75))
    assert run.start[0][7] == pytest.approx(7 + 3 * L)  # 0B1
    assert run.start[1][3] == pytest.approx(2 + 2 * L)  # 1B0
    assert simulate(plan).makespan == 9.0  # free transfers: the unit-cost run


def test_bandwidth_adds_bytes_over_bandwidth_per_receive():
    plan = lower(family("1f1b", 2, 2).derive())
    comm = CommModel(latency=0.1, bandwidth=10.0, activation_bytes=1.5).comm_cost()
    assert comm.time(Recv(0, Payload(ACT, 0, 0))) == pytest.approx(0.25)
    assert comm.time(Send(1, Payload(ACT, 0, 0))) == 0.0
    run = simulate(plan, standard_duration, comm)
    assert run.makespan == pytest.approx(9 + 3 * 0.25)


def test_sends_before_receives_keep_the_forward_wave_at_one_transfer_per_hop():
    """The lowering posts a rank's own send before it receives the next item from
    upstream (same time in the ordering run), so with transfer time L the first forward
    of stage r starts at r (1 + L): each hop costs one transfer, not more."""
    plan = lower(family("1f1b", 4, 8).derive())
    assert [str(op) for op in plan.programs[1][:4]] == ["1RECV_F0", "1F0", "1SEND_F0",
                                                        "1RECV_F1"]
    L = 0.5
    run = simulate(plan, standard_duration, CommCost(latency=L))
    for r in range(4):
        i = next(i for i, op in enumerate(plan.programs[r]) if str(op) == f"{r}F0")
        assert run.start[r][i] == pytest.approx(r * (1 + L))


def test_collectives_cost_latency_plus_ring_factor_bytes():
    comm = CommCost(collective_latency=0.5, bandwidth=4.0,
                    collective_bytes=lambda op: 8.0)
    ranks = (0, 1, 2, 3)
    assert comm.time(Collective("broadcast", ranks, "params:v", 0)) == pytest.approx(0.5 + 2)
    assert comm.time(Collective("all_reduce", ranks, "grads:v")) == pytest.approx(
        0.5 + 2 * 3 / 4 * 2)
    assert comm.time(Collective("all_reduce", (0,), "grads:v")) == pytest.approx(0.5)
    model = CommModel(parameter_bytes=3.0)
    assert model.collective_bytes(Collective("broadcast", ranks, "params:v", 0)) == 3.0
    assert model.collective_bytes(Collective("gather", ranks, "other")) == 0.0


# ---------------------------------------------------------------- the cost model


def test_cost_model_durations_per_stage_segment_and_microbatch():
    cost = CostModel(F=(1.0, 2.0), B=3.0, segments=(("vision", SegmentCost(F=(1.0, 4.0))),))
    assert cost.duration(Compute("F", 1, 0)) == 2.0
    assert cost.duration(Compute("B", 0, 0)) == 3.0
    assert cost.duration(Compute("F", 0, 1, "vision")) == 4.0
    assert cost.duration(Compute("B", 0, 1, "vision")) == 8.0  # default 2 F
    assert cost.duration(Compute("R", 0, 1, "vision")) == 4.0  # default F
    assert cost.duration(Compute("F", 0, 0, "audio")) == 1.0  # an unnamed segment
    custom = SegmentCost(F=2.0, B=(5.0, 7.0), R=1.5)
    assert (custom.backward(1), custom.recompute(0)) == (7.0, 1.5)


def test_payload_bytes_by_kind():
    comm = CommModel(activation_bytes=1.0, segment_output_bytes=2.0, segment_input_bytes=3.0)
    assert comm.payload_bytes(Payload(ACT, 2, 0)) == 1.0
    assert comm.payload_bytes(Payload(GRAD, 2, 0)) == 1.0
    assert comm.payload_bytes(Payload(ACT, 0, 0, "vision", to_segment="")) == 2.0
    assert comm.payload_bytes(Payload(GRAD, 0, 0, "", to_segment="vision")) == 2.0
    assert comm.payload_bytes(Payload(INPUT, 0, 0, "vision")) == 3.0
    assert comm.payload_bytes(Payload(ACT, 3, 0, "", to_segment="gen")) == 1.0  # to a sink


def test_static_memory_counts_full_copies_and_replicas():
    cost = CostModel(static=(10.0, 10.0, 10.0, 12.0),
                     segments=(("vision", SegmentCost(static=5.0, replica=1.0)),))
    frozen = Cut((SegmentWork("vision", SOURCE, (0, 1, 2, 1), None),))
    assert cost.static_memory(frozen, 4) == (15.0, 11.0, 11.0, 12.0)
    recompute = Cut((SegmentWork("vision", SOURCE, (0, 1, 2, 3), (0, 0, 0, 0), True),))
    assert cost.static_memory(recompute, 4) == (15.0, 11.0, 11.0, 13.0)
    owner = Cut((SegmentWork("vision", SOURCE, (0, 1, 2, 3), (0, 1, 2, 3)),))
    assert cost.static_memory(owner, 4) == (15.0, 15.0, 15.0, 17.0)
    inline = Cut((SegmentWork("vision", SOURCE, (0,) * 4, (0,) * 4),))
    assert cost.static_memory(inline, 4) == (15.0, 10.0, 10.0, 12.0)


def test_rescaled_keeps_the_model_and_changes_the_cut():
    cost = CostModel(F=1.0, B=2.0, activation=(1.0, 1.0, 3.0, 3.0),
                     comm=CommModel(activation_bytes=5.0))
    coarse = cost.rescaled(4, 2)
    assert (coarse.F, coarse.B) == (2.0, 4.0)
    assert coarse.activation == pytest.approx((2.0, 6.0))
    assert coarse.comm.activation_bytes == 5.0  # a boundary tensor keeps its size
    fine = cost.rescaled(4, 8)
    assert fine.F == 0.5 and fine.activation == pytest.approx((0.5,) * 4 + (1.5,) * 4)
    assert cost.rescaled(4, 4) is cost


def test_memory_of_a_transposed_plan_counts_waiting_outputs():
    """A shipped encoder output waits in a receive buffer on rank 0 until its ``F(0, mb)``
    consumes it; frozen forwards keep no activation."""
    term = transpose_family(4, 8, mode="frozen", ownership="full")
    plan = lower(term.derive())
    cost = CostModel(activation=0.0, segments=(("vision", SegmentCost(output=1.0)),))
    run = simulate(plan, cost.duration, memory=cost.memory_model_for(plan.cut, 4))
    assert run.peak_memory[0] >= 1.0
    assert all(run.peak_memory[r] == 0.0 for r in (1, 2, 3))


# ---------------------------------------------------------------- spec cost tables

TRANSPOSE_SPEC = """\
[schedule]
family = "transpose"
pp = 4
microbatches = 4
[transpose]
mode = "owner"
ownership = "full"
[cost]
F = 2.0
B = 4.0
[cost.segments.vision]
F = [1.0, 2.0, 3.0, 4.0]
output = 0.5
static = 3.0
replica = 1.0
[comm]
latency = 0.1
bandwidth = 100.0
activation_bytes = 10.0
segment_output_bytes = 20.0
parameter_bytes = 50.0
[memory]
static = [1, 2, 3, 4]
limit = 100
"""


def test_transpose_spec_feeds_one_cost_model():
    spec = parse_spec(TRANSPOSE_SPEC, "t.toml")
    term = spec.term
    assert term.costs == (1.0, 2.0, 3.0, 4.0)
    assert (term.body_forward, term.body_backward) == (2.0, 4.0)
    assert spec.duration(Compute("F", 0, 2, "vision")) == 3.0
    assert spec.duration(Compute("B", 0, 2, "vision")) == 6.0
    assert spec.duration(Compute("B", 1, 2)) == 4.0
    assert spec.comm_cost.transfer(Payload(ACT, 0, 0, "vision", to_segment="")) == \
        pytest.approx(0.3)
    mem = spec.memory_model
    assert mem.static == (4.0, 5.0, 6.0, 7.0)  # owner mode: every rank a full copy
    assert mem.buffer(Payload(ACT, 0, 1, "vision", to_segment="")) == 0.5


@pytest.mark.parametrize("extra,line,needle", [
    ("[cost.segments.audio]\nF = 1\n", 18, "this schedule has no segment 'audio'"),
    ("[cost.segments.vision.x]\nF = 1\n", 18, "unknown key 'x' in [cost.segments.vision]"),
    ("[comm]\nspeed = 1\n", 19, "unknown key 'speed' in [comm]"),
])
def test_cost_table_errors(extra, line, needle):
    base = TRANSPOSE_SPEC.replace("[comm]", "[comm_]").split("[comm_]")[0]
    with pytest.raises(InputError) as e:
        parse_spec(base + "[memory]\nlimit = 100\n" + extra, "t.toml")
    assert needle in e.value.message, str(e.value)
    assert e.value.line == line, str(e.value)


def test_comm_bandwidth_must_be_positive():
    text = TRANSPOSE_SPEC.replace("bandwidth = 100.0", "bandwidth = 0")
    with pytest.raises(InputError, match="comm.bandwidth must be a positive number") as e:
        parse_spec(text, "t.toml")
    assert e.value.line == 18


# ---------------------------------------------------------------- the simulate command


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json_schema(capsys):
    code, out, err = _run(capsys, "simulate", str(EXAMPLES / "mllm_transpose.toml"),
                          "--compare", "interleaved-1f1b", "1f1b", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["verified"] is True
    assert isinstance(doc["makespan"], (int, float)) and doc["makespan"] > 0
    assert isinstance(doc["bubble_fraction"], float) and 0 <= doc["bubble_fraction"] < 1
    assert set(doc["peak_memory"]) == {str(r) for r in range(8)}
    assert all(isinstance(v, (int, float)) for v in doc["peak_memory"].values())
    assert set(doc["busy"]) == set(doc["bubble"]) == set(doc["peak_memory"])
    assert set(doc["compare"]) == {"interleaved-1f1b", "1f1b"}
    for entry in doc["compare"].values():
        assert isinstance(entry["makespan"], (int, float))
        assert isinstance(entry["bubble_fraction"], float)
        assert entry["speedup"] == pytest.approx(entry["makespan"] / doc["makespan"],
                                                 rel=1e-5)
        assert entry["within_limit"] is True and entry["status"] == "verified"


def test_simulate_text_and_family_target(capsys):
    code, out, _ = _run(capsys, "simulate", "--family", "transpose", "--pp", "4",
                        "--microbatches", "8", "--mode", "owner", "--encoder-cost", "2",
                        "--compare", "1f1b")
    assert code == 0
    assert "makespan" in out and "bubble fraction" in out and "1f1b" in out


def test_simulate_refuses_an_unverified_plan(capsys):
    code, out, _ = _run(capsys, "simulate", str(EXAMPLES / "broken.toml"), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["verified"] is False and doc["makespan"] is None
    assert {v["property"] for v in doc["violations"]} == {"memory"}
    code, out, _ = _run(capsys, "simulate", str(EXAMPLES / "broken.toml"))
    assert code == 1 and "refusing to simulate" in out


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--family", "1f1b", "--pp", "2", "--microbatches", "2", "--mode", "owner"],
     "--mode goes with --family transpose"),
    (["simulate", str(EXAMPLES / "1f1b.toml"), "--compare", "zb-h9"], "invalid choice"),
    (["simulate", "--family", "1f1b", "--pp", "4", "--microbatches", "4", "--compare",
      "dualpipev"], "--compare dualpipev: dualpipev needs microbatches >= 2*pp"),
])
def test_simulate_usage_errors(capsys, argv, needle):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and needle in err and err.count("\n") == 1


def test_simulate_a_spec_without_a_cut_compares_bare_families(capsys):
    code, out, _ = _run(capsys, "simulate", str(EXAMPLES / "zb-h1.toml"), "--compare", "1f1b",
                        "--json")
    doc = json.loads(out)
    assert code == 0 and doc["makespan"] == 27
    assert doc["compare"]["1f1b"]["makespan"] == 33


def test_unit_model_figures_are_integers(capsys):
    """Without a cost model every figure is integral and the JSON says ``4``, not
    ``4.0`` (check, simulate and diff alike)."""
    spec = str(EXAMPLES / "1f1b.toml")
    docs = [json.loads(_run(capsys, *argv, "--json")[1]) for argv in (
        ("check", spec), ("simulate", spec), ("diff", spec, spec))]
    numbers = [*docs[0]["peak_memory"].values(), docs[1]["makespan"],
               *docs[1]["peak_memory"].values(), *docs[1]["busy"].values(),
               docs[2]["new"]["makespan"], *docs[2]["new"]["peak_memory"].values(),
               docs[2]["delta"]["makespan"]]
    assert numbers and all(type(x) is int for x in numbers), numbers
    assert '"peak_memory": {"0": 4' in json.dumps(docs[0])
    texts = [_run(capsys, *argv)[1] for argv in (("check", spec), ("simulate", spec),
                                                  ("diff", spec, spec))]
    assert "peak memory per rank: 0: 4, 1: 3" in texts[0]
    assert "makespan 33, " in texts[1] and "makespan: 33 -> 33" in texts[2]
    assert not any(".0 " in t or ".0," in t or ".0\n" in t for t in texts), texts


def test_compare_without_cost_is_the_standard_costs_written_out(tmp_path, capsys):
    """``--compare`` re-cuts one model: a spec without ``[cost]`` compares exactly like
    the same spec with the standard costs written out, so ZBV (8 stages of half the
    model on 4 ranks) comes out faster than 1F1B, as it does with explicit costs."""
    bare = (EXAMPLES / "1f1b.toml").read_text()
    written = tmp_path / "costed.toml"
    written.write_text(bare + "\n[cost]\nF = 1\nB = 2\nI = 1\nW = 1\nactivation = 1\n")
    families = ("zbv", "interleaved-1f1b", "gpipe")
    docs = [json.loads(_run(capsys, "simulate", path, "--compare", *families, "--json")[1])
            for path in (str(EXAMPLES / "1f1b.toml"), str(written))]
    for fam in families:
        a, b = docs[0]["compare"][fam], docs[1]["compare"][fam]
        assert (a["makespan"], a["peak_memory"]) == (b["makespan"], b["peak_memory"]), fam
    assert docs[0]["makespan"] == docs[1]["makespan"]
    assert docs[0]["compare"]["zbv"]["makespan"] < docs[0]["makespan"]
    assert docs[0]["compare"]["zbv"]["speedup"] < 1


def test_check_and_simulate_judge_the_same_plan():
    """``check`` lowers a spec with its own costs, as ``simulate`` does."""
    from mpipe_verified.comparison import time_spec
    from mpipe_verified.formats.spec import load_spec
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    timed = time_spec(spec)
    report = verify(lower(spec.schedule, spec.duration), spec.memory_limit,
                    memory_model=spec.memory_model)
    assert report.certificate.digest == timed.report.certificate.digest


def test_of_term_keeps_a_transposes_own_costs():
    term = transpose_family(2, 2, mode="none")
    spec = Spec.of_term(term)
    assert spec.duration(Compute("F", 0, 0, "vision")) == 0.0  # parameter-free: free
    plan = lower(spec.schedule, spec.duration)  # zero-cost producers still lower soundly
    assert verify(plan).verified


def test_compare_says_which_schedule_is_faster(capsys):
    """The text names the direction: ZBV (25.5) against this 1F1B spec (33) is "1.294x
    faster", never a "speedup" below 1; a family as fast says so; a spec without a cut
    says nothing about a segment, and a transpose spec names the segment kept inline."""
    code, out, _ = _run(capsys, "simulate", str(EXAMPLES / "1f1b.toml"), "--compare", "zbv",
                        "gpipe")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert rows["zbv"].split()[1] == "25.5" and rows["zbv"].endswith("1.294x faster")
    assert rows["gpipe"].endswith("as fast")
    assert "compared on the same model and costs:\n" in out and "than this spec" in out
    assert "(than this spec: each family's makespan against this spec's 33)" in out
    assert "speedup" not in out and "segment" not in out and "0.773" not in out
    doc = json.loads(_run(capsys, "simulate", str(EXAMPLES / "1f1b.toml"), "--compare", "zbv",
                          "--json")[1])
    assert doc["inline_segment"] is None
    assert doc["compare"]["zbv"]["speedup"] == pytest.approx(25.5 / 33)  # this spec's
    code, out, _ = _run(capsys, "simulate", str(EXAMPLES / "mllm_transpose.toml"), "--compare",
                        "1f1b")
    assert ("compared on the same model and costs (the segment 'vision' inline on its home "
            "rank):") in out
    row = next(line for line in out.splitlines() if line.startswith("  1f1b "))
    assert row.endswith("1.573x slower")


def test_faster_in_words():
    from mpipe_verified.comparison import faster
    assert faster(25.5, 33) == "1.294x faster"
    assert faster(33, 25.5) == "1.294x slower"
    assert faster(33, 33) == "as fast" and faster(None, 33) == "-"


def test_a_passed_deadline_stops_the_simulation():
    """``tune --budget`` passes its deadline down: ``simulate`` and ``time_spec`` raise
    ``DeadlinePassed`` once it has passed, and time as before without one."""
    import time

    from mpipe_verified.comparison import time_spec
    from mpipe_verified.formats.spec import load_spec
    from mpipe_verified.sim import DeadlinePassed
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    plan = lower(spec.schedule, spec.duration)
    past = time.monotonic() - 1.0
    with pytest.raises(DeadlinePassed):
        simulate(plan, spec.duration, spec.comm_cost, spec.memory_model, deadline=past)
    with pytest.raises(DeadlinePassed):
        time_spec(spec, check=False, deadline=past)
    later = time.monotonic() + 3600.0
    assert (simulate(plan, spec.duration, spec.comm_cost, spec.memory_model,
                     deadline=later).makespan
            == time_spec(spec, check=False).run.makespan)
