"""The transpose schedule (``algebra.transpose``): every variant verifies; broken variants
are rejected with the right property; cost-aware ownership pays on skewed workloads; the
shipped 8-rank example is >= 1.2x faster than interleaved 1F1B with the encoder inline;
specs, expressions and the CLI options that build it."""

from __future__ import annotations

import pathlib

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipe_verified.algebra import Transpose, family
from mpipe_verified.algebra.transpose import MODES, OWNERSHIPS, transpose_family
from mpipe_verified.cli import main
from mpipe_verified.comparison import baseline_spec, simulation, time_spec
from mpipe_verified.errors import InputError, ParameterError
from mpipe_verified.formats.spec import load_spec, parse_spec
from mpipe_verified.spec import Spec, parse_expression
from mpipe_verified.ir import (ACT, INPUT, SINK, SOURCE, Collective, Compute, Recv, Send,
                               computes_of)
from mpipe_verified.lower import lower
from mpipe_verified.verify import verify
from plan_edits import props

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def with_programs(plan, programs):
    return attrs.evolve(plan, programs=tuple(map(tuple, programs)))


# ---------------------------------------------------------------- every variant verifies


def _variants():
    for p in (2, 4, 8):
        for m in sorted({1, max(1, p - 1), 2 * p + 1}):  # m < p included
            for side in (SOURCE, SINK):
                for mode in MODES:
                    if side == SINK and mode == "recompute":
                        continue
                    for ownership in OWNERSHIPS:
                        yield p, m, side, mode, ownership


@pytest.mark.parametrize("p,m,side,mode,ownership", list(_variants()))
def test_every_variant_verifies(p, m, side, mode, ownership):
    costs = tuple(0.5 + (k % 4) for k in range(m))  # uneven encoder work
    term = transpose_family(p, m, side=side, mode=mode, ownership=ownership, costs=costs)
    schedule = term.derive()
    seg = schedule.cut.segments[0]
    assert seg.side == side and seg.trainable == (mode in ("recompute", "owner"))
    report = verify(lower(schedule))
    assert report.verified, [v.message for v in report.violations][:3]
    spec = Spec.of_term(term)  # ordered for the term's own costs: verified as well
    assert verify(lower(schedule, spec.duration)).verified


@pytest.mark.parametrize("body,chunks", [("interleaved-1f1b", 2), ("zb-h1", None),
                                         ("gpipe", None), ("zbv", None), ("dualpipev", None)])
@pytest.mark.parametrize("mode", ["recompute", "owner", "frozen"])
def test_other_bodies_verify(body, chunks, mode):
    term = transpose_family(4, 8, chunks, body=body, mode=mode, ownership="cost",
                            costs=[1, 3, 0.5, 2, 2, 1, 4, 1])
    assert verify(lower(term.derive())).verified


def test_work_is_conserved_and_inline_stays_home():
    """Transposing adds exactly the segment's ops to the body (its forwards, its backwards
    or recomputes as the mode needs) and leaves the body's ops in their order."""
    body = family("1f1b", 4, 6)
    base = body.derive()
    for ownership in OWNERSHIPS:
        s = Transpose(body, mode="recompute", ownership=ownership).derive()
        for r in range(4):
            mine = [c for op in s.programs[r] for c in computes_of(op)]
            assert [c for c in mine if not c.segment] == \
                [c for op in base.programs[r] for c in computes_of(op)]
        seg = s.cut.segments[0]
        if ownership == "inline":
            assert seg.forward_rank == (0,) * 6 and not seg.broadcast
            assert not any(isinstance(op, Collective) for prog in s.programs for op in prog)
        else:
            assert seg.broadcast and not seg.all_reduce
        kinds = sorted(c.kind for prog in s.programs for op in prog for c in computes_of(op)
                       if c.segment)
        moved = sum(o != 0 for o in seg.forward_rank)
        assert kinds == sorted(["F"] * 6 + ["B"] * 6 + ["R"] * moved)


def test_owner_mode_all_reduces_and_frozen_moves_no_parameters():
    owner = transpose_family(4, 8, mode="owner", ownership="full").derive()
    assert owner.cut.segments[0].all_reduce and owner.cut.segments[0].broadcast
    assert all(isinstance(prog[-1], Collective) and prog[-1].kind == "all_reduce"
               for prog in owner.programs)
    frozen = transpose_family(4, 8, mode="frozen", ownership="full").derive()
    assert not any(isinstance(op, Collective) for prog in frozen.programs for op in prog)


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 9), data=st.data())
def test_random_costs_never_make_a_cycle(p, m, data):
    """The placement follows estimates, but every position respects the body's own data
    flow (``_Rank`` bounds), so whatever the costs the woven program verifies."""
    side = data.draw(st.sampled_from([SOURCE, SINK]))
    mode = data.draw(st.sampled_from([x for x in MODES if side == SOURCE or x != "recompute"]))
    body = data.draw(st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h2"]))
    costs = data.draw(st.lists(st.floats(0, 8, allow_nan=False), min_size=m, max_size=m))
    term = transpose_family(p, m, 2 if body == "interleaved-1f1b" else None, body=body,
                            side=side, mode=mode, ownership=data.draw(st.sampled_from(OWNERSHIPS)),
                            costs=costs, body_forward=data.draw(st.sampled_from([0.5, 1, 3])))
    spec = Spec.of_term(term)
    assert verify(lower(spec.schedule, spec.duration)).verified


# ---------------------------------------------------------------- broken variants


def _recompute_plan():
    return lower(transpose_family(4, 8, mode="recompute", ownership="full").derive())


def test_missing_broadcast_on_one_rank():
    """Rank 2 skips the parameter broadcast: the others wait in it forever, and rank 2's
    encoder forwards run without parameters."""
    plan = _recompute_plan()
    programs = [list(p) for p in plan.programs]
    programs[2] = [op for op in programs[2] if not isinstance(op, Collective)]
    report = verify(with_programs(plan, programs))
    assert report.status == "violated"
    assert props(report) == {"completeness", "matching", "dependency", "deadlock"}
    messages = [v.message for v in report.violations]
    assert any("is never called on rank 2" in m for m in messages)
    assert any("needs the broadcast parameters" in m for m in messages)


def test_fifo_order_broken_on_one_owner():
    """Our lowering sends an owner's payloads to rank 0 in event order: per microbatch,
    the encoder output right after its forward, then the raw input for the recompute
    (``vision:0SEND_F1, vision:0SEND_IN1, ..., vision:0SEND_F5, vision:0SEND_IN5``), and
    rank 0 receives them in that order. Regroup owner 1's sends type-major (all outputs,
    then all inputs) in the same slots while rank 0 keeps its order: matching is FIFO per
    ordered pair (docs/semantics.md §2.3), so the k-th send now pairs with a receive of another
    payload — a matching violation on channel 1->0, under rendezvous and eager alike.
    (The output of microbatch 5 now also goes out before its forward ran: dependency.)"""
    plan = _recompute_plan()
    programs = [list(p) for p in plan.programs]
    slots = [i for i, op in enumerate(programs[1])
             if isinstance(op, Send) and op.dst == 0 and op.payload.segment]
    sends = [programs[1][i] for i in slots]
    assert [s.payload.kind for s in sends] == [ACT, INPUT] * (len(sends) // 2)
    regrouped = ([s for s in sends if s.payload.kind == ACT]
                 + [s for s in sends if s.payload.kind == INPUT])
    for i, op in zip(slots, regrouped):
        programs[1][i] = op
    broken = with_programs(plan, programs)
    for model in ("rendezvous", "eager"):
        report = verify(broken, comm_model=model)
        assert "matching" in props(report)
        mismatches = [v for v in report.violations if v.property == "matching"]
        assert all(v.ranks == (1, 0) for v in mismatches)
        assert any("send/recv mismatch on channel 1->0" in v.message for v in mismatches)


def test_recv_of_the_wrong_microbatch():
    """Rank 0 receives encoder output 5 where output 1 arrives: the FIFO pair's payloads
    differ (matching) and ``0F1`` never gets its encoder output (dependency)."""
    plan = _recompute_plan()
    programs = [list(p) for p in plan.programs]
    i = next(i for i, op in enumerate(programs[0]) if isinstance(op, Recv)
             and op.payload.segment == "vision" and op.payload.kind == ACT
             and op.payload.mb == 1)
    op = programs[0][i]
    programs[0][i] = attrs.evolve(op, payload=attrs.evolve(op.payload, mb=5))
    report = verify(with_programs(plan, programs))
    assert props(report) == {"matching", "dependency"}
    assert any("matching receive at rank 0" in v.message and "0RECV_F5" in v.message
               for v in report.violations if v.property == "matching")


def test_segment_backward_on_the_wrong_rank_is_incomplete():
    plan = lower(transpose_family(4, 8, mode="owner", ownership="full").derive())
    programs = [list(p) for p in plan.programs]
    b = Compute("B", 0, 1, "vision")
    programs[1].remove(b)
    programs[2].insert(len(programs[2]) - 1, b)
    assert "completeness" in props(verify(with_programs(plan, programs)))


# ---------------------------------------------------------------- cost-aware ownership


@pytest.mark.parametrize("mode", ["frozen", "owner"])
def test_cost_aware_beats_round_robin_on_a_skewed_workload(mode):
    """1F1B on 8 ranks, 16 microbatches of 1..8 images (0.5 per image, in units of a
    stage's forward): round-robin gives rank r the microbatches r and r + 8, whatever
    their size; cost-aware fills each rank's idle time with what fits."""
    costs = [0.5 * (1 + k % 8) for k in range(16)]
    makespans = {}
    for ownership in ("full", "cost"):
        spec = Spec.of_term(transpose_family(8, 16, mode=mode, ownership=ownership,
                                             costs=costs))
        timed = time_spec(spec)
        assert timed.report.verified
        makespans[ownership] = timed.run.makespan
    assert makespans["cost"] < makespans["full"]


def test_cost_aware_never_loses_to_round_robin_on_its_own_estimate():
    for p, m in ((4, 8), (4, 16), (8, 8)):
        costs = [0.5 * (1 + k % 8) for k in range(m)]
        for mode in ("frozen", "owner", "recompute"):
            runs = {own: time_spec(Spec.of_term(transpose_family(
                p, m, mode=mode, ownership=own, costs=costs)), check=False).run.makespan
                for own in ("full", "cost")}
            assert runs["cost"] <= runs["full"] + 1e-9, (p, m, mode, runs)


# ---------------------------------------------------------------- the shipped example


def test_example_is_at_least_1_2x_over_inline_interleaved_1f1b():
    """examples/mllm_transpose.toml: the transposed plan verifies under the spec's memory
    limit, and the simulator predicts >= 1.2x over interleaved 1F1B with the encoder
    inline on rank 0, which fits the same limit."""
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    assert spec.memory_limit == 72.0 and spec.term.mode == "owner"
    doc, mine, compared = simulation(spec, "example", ["interleaved-1f1b"])
    assert doc["verified"] and mine.report.verified and mine.within_limit()
    base = compared["interleaved-1f1b"]
    assert base.report.verified and base.within_limit()
    ratio = base.run.makespan / mine.run.makespan
    assert ratio >= 1.2, ratio
    assert doc["compare"]["interleaved-1f1b"]["speedup"] == pytest.approx(ratio, rel=1e-5)


def test_baseline_is_the_same_model_inline():
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    base = baseline_spec(spec, "1f1b")
    assert base.term.ownership == "inline" and base.term.mode == spec.term.mode
    assert base.term.costs == spec.term.costs
    assert base.schedule.placement.num_stages == 8  # 16 stages of the spec, re-cut
    assert base.cost.F == pytest.approx(2 * spec.cost.F)
    assert base.cost.activation == pytest.approx(2 * spec.cost.activation)
    assert base.cost.segments == spec.cost.segments
    assert baseline_spec(spec, "interleaved-1f1b").schedule.placement.num_stages == 16


@pytest.mark.parametrize("name", ["mllm_transpose", "mllm_transpose_frozen"])
def test_shipped_8_rank_examples_verify(name):
    spec = load_spec(EXAMPLES / f"{name}.toml")
    report = verify(lower(spec.schedule, spec.duration), spec.memory_limit,
                    memory_model=spec.memory_model)
    assert report.verified


# ---------------------------------------------------------------- specs, expressions, CLI


@pytest.mark.parametrize("term", [
    Transpose(family("1f1b", 2, 3)),
    Transpose(family("interleaved-1f1b", 2, 4, 2), "img", "source", "owner", "cost",
              (1.5, 0.25, 2, 3), 9.6, 19.2),
    Transpose(family("zb-h1", 3, 2), side="sink", mode="frozen", ownership="min",
              costs=(0.0, 1e-3)),
], ids=str)
def test_transpose_terms_round_trip(term):
    assert parse_expression(str(term)) == term
    assert parse_expression(str(term)).derive() == term.derive()


def test_expression_arguments_and_errors():
    t = parse_expression("transpose(one_f_one_b(2, 2), mode='owner', costs=[1, 2.5])")
    assert t.costs == (1.0, 2.5) and t.mode == "owner" and t.ownership == "cost"
    with pytest.raises(InputError, match="transpose mode must be one of"):
        parse_expression("transpose(gpipe(2, 2), mode='lazy')")
    with pytest.raises(InputError, match="costs must be a list of numbers"):
        parse_expression("transpose(gpipe(2, 2), costs=['a'])")
    with pytest.raises(InputError, match="costs needs one entry per microbatch"):
        parse_spec("[schedule]\nexpression = \"transpose(gpipe(2, 2), costs=[1])\"\n", "x")


SPEC = '[schedule]\nfamily = "transpose"\npp = 4\nmicrobatches = 4\n'


def test_one_default_ownership_everywhere(capsys):
    """``Transpose(...)``, ``transpose_family``, the expression language, a
    ``family = "transpose"`` spec and ``--family transpose`` all default to one
    ownership."""
    import inspect
    from mpipe_verified.cli import main
    body = family("1f1b", 4, 4)
    default = inspect.signature(transpose_family).parameters["ownership"].default
    assert Transpose(body).ownership == default
    assert parse_expression("transpose(one_f_one_b(4, 4))").ownership == default
    assert parse_spec(SPEC, "t.toml").term.ownership == default
    assert main(["show", "--family", "transpose", "--pp", "4", "--microbatches", "4"]) == 0
    assert f"ownership={default!r}" in capsys.readouterr().out.splitlines()[0]


def test_transpose_family_spec_defaults():
    spec = parse_spec(SPEC, "t.toml")
    assert spec.term == transpose_family(4, 4)
    assert (spec.term.mode, spec.term.ownership, spec.term.body) == (
        "recompute", "cost", family("1f1b", 4, 4))
    sink = parse_spec(SPEC + '[transpose]\nside = "sink"\n', "t.toml")
    assert sink.term.mode == "owner"
    one = parse_spec(SPEC + "[transpose]\ncosts = 2.5\n", "t.toml")
    assert one.term.costs == (2.5,) * 4


@pytest.mark.parametrize("text,line,needle", [
    (SPEC + '[transpose]\nmode = "lazy"\n', 6, "transpose.mode must be one of recompute"),
    (SPEC + '[transpose]\nbody = "transpose"\n', 6, "transpose.body must be one of gpipe"),
    (SPEC + "[transpose]\ncosts = [1, 2]\n", 6, "list of 4 such numbers (one per microbatch)"),
    (SPEC + '[transpose]\nside = "sink"\nmode = "recompute"\n', 7, "a sink segment"),
    (SPEC + "[transpose]\ncosts = 1\n[cost.segments.vision]\nF = 1\n", 6,
     "give the segment's forward cost once"),
    (SPEC + "[transpose]\nspeed = 1\n", 6, "unknown key 'speed' in [transpose]"),
    ('[schedule]\nfamily = "1f1b"\npp = 2\nmicrobatches = 2\n[transpose]\nmode = "owner"\n', 5,
     '[transpose] goes with [schedule] family = "transpose"'),
    (SPEC + "chunks = 2\n", 5, "1f1b takes no --chunks"),
])
def test_transpose_spec_errors(text, line, needle):
    with pytest.raises(InputError) as e:
        parse_spec(text, "t.toml")
    assert needle in e.value.message, str(e.value)
    assert e.value.line == line, str(e.value)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_family_transpose_defaults(capsys):
    code, out, err = _run(capsys, "check", "--family", "transpose", "--pp", "4",
                          "--microbatches", "3")
    assert (code, err) == (0, "") and "VERIFIED" in out
    code, out, _ = _run(capsys, "check", "--family", "transpose", "--pp", "4",
                        "--microbatches", "8", "--body", "interleaved-1f1b", "--chunks", "2",
                        "--mode", "owner", "--ownership", "full", "--side", "source",
                        "--encoder-cost", "1,2,3,4,1,2,3,4", "--json")
    assert code == 0 and '"verified": true' in out


@pytest.mark.parametrize("argv,needle", [
    (["check", "--family", "1f1b", "--pp", "2", "--microbatches", "2", "--mode", "owner"],
     "--mode goes with --family transpose, not with --family 1f1b"),
    (["check", str(EXAMPLES / "1f1b.toml"), "--encoder-cost", "2"],
     "--encoder-cost goes with --family transpose, not with a file"),
    (["show", "--family", "zb-h1", "--pp", "2", "--microbatches", "2", "--body", "gpipe"],
     "--body goes with --family transpose"),
    (["check", "--family", "transpose", "--pp", "4", "--microbatches", "4", "--encoder-cost",
      "1,2"], "--encoder-cost needs one number or 4 (one per microbatch), got 2"),
    (["check", "--family", "transpose", "--pp", "4", "--microbatches", "4", "--encoder-cost",
      "x"], "--encoder-cost must be a number or a comma list"),
    (["check", "--family", "transpose", "--pp", "4", "--microbatches", "4", "--side", "sink",
      "--mode", "recompute"], "a sink segment is transposed with mode"),
    (["check", "--family", "transpose", "--pp", "4", "--microbatches", "4", "--chunks", "2"],
     "1f1b takes no --chunks"),
])
def test_transpose_options_usage_errors(capsys, argv, needle):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_show_and_export_family_transpose(capsys):
    code, out, _ = _run(capsys, "show", "--family", "transpose", "--pp", "4",
                        "--microbatches", "4", "--mode", "owner", "--encoder-cost", "2",
                        "--width", "0")
    assert code == 0 and "vision:0F" in out and "stuck" not in out
    code, out, _ = _run(capsys, "export", "--family", "transpose", "--pp", "2",
                        "--microbatches", "2", "--to", "chrome-trace")
    assert code == 0 and "vision" in out


def test_transpose_parameter_errors():
    with pytest.raises(ParameterError, match="costs needs one entry per microbatch"):
        transpose_family(2, 3, costs=[1, 2]).derive()
    with pytest.raises(ParameterError, match="finite numbers >= 0"):
        Transpose(family("1f1b", 2, 2), costs=(1, -1))
    with pytest.raises(ParameterError, match="segment 'vision' is already cut from the body"):
        Transpose(Transpose(family("1f1b", 2, 2))).derive()


@pytest.mark.parametrize("outer_side,outer_mode", [(SOURCE, "recompute"), (SOURCE, "owner"),
                                                   (SOURCE, "frozen"), (SINK, "owner")])
@pytest.mark.parametrize("ownership", ("full", "cost"))
def test_a_second_segment_is_woven_around_the_first(outer_side, outer_mode, ownership):
    """Transposing a transposed term keeps the first segment's work in order on every
    rank, adds the second one's, lists sources (in cut order) before sinks, and the
    lowered plan verifies."""
    inner = Transpose(family("zb-h1", 3, 6), "vision", mode="owner", ownership=ownership)
    outer = Transpose(inner, "audio", side=outer_side, mode=outer_mode, ownership=ownership)
    before, after = inner.derive(), outer.derive()
    assert [s.name for s in after.cut.segments] == ["vision", "audio"]
    assert after.cut.get("vision") == before.cut.get("vision")
    assert after.cut.get("audio").side == outer_side
    for old, new in zip(before.programs, after.programs):
        assert [op for op in new if getattr(op, "segment", None) != "audio"
                and not (isinstance(op, Collective) and op.tag.endswith(":audio"))] == list(old)
    report = verify(lower(after))
    assert report.verified, [v.message for v in report.violations][:3]
    reversed_order = Transpose(Transpose(family("1f1b", 2, 4), "gen", side=SINK, mode="owner"),
                               "vision").derive()
    assert [s.name for s in reversed_order.cut.segments] == ["vision", "gen"]
