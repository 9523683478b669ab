"""The ``plan-json`` format (``formats.plan_json``): exact round trips for every family,
every transpose variant and every op kind; the CLI reading and writing it (same verdict
and certificate as the spec it came from); every malformed input a one-line error with
its JSON path; linear-size reading; the committed fixtures."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import tracemalloc

import attrs
import pytest
from hypothesis import given, settings

from fixtures.make_fixtures import FIXTURES, GRADS
from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.algebra.transpose import MODES, OWNERSHIPS, transpose_family
from mpipe_verified.cli import main
from mpipe_verified.errors import InputError
from mpipe_verified.formats import plan_json, ranges
from mpipe_verified.formats.plan_json import (format_plan_json, parse_plan_json,
                                              read_plan_json, write_plan_json)
from mpipe_verified.ir import (SINK, SOURCE, Collective, Compute, Cut, Group, Marker, Overlap,
                               Placement, Plan, Recv, Schedule, SegmentWork, Send)
from mpipe_verified.lower import lower
from plan_edits import FIXTURE_DIR, fixture
from strategies import any_plans

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def round_trips(value: Plan | Schedule) -> str:
    text = format_plan_json(value)
    back = parse_plan_json(text, "x.json")
    assert back == value and type(back) is type(value)
    assert format_plan_json(back) == text
    return text


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("p,m", [(2, 4), (4, 9)])
def test_every_family_round_trips_as_schedule_and_plan(name, p, m):
    schedule = family(name, p, m, 2 if name == "interleaved-1f1b" else None).derive()
    assert json.loads(round_trips(schedule))["type"] == "schedule"
    assert json.loads(round_trips(lower(schedule)))["type"] == "plan"


def _transpose_variants():
    for side in (SOURCE, SINK):
        for mode in MODES:
            if not (side == SINK and mode == "recompute"):
                for ownership in OWNERSHIPS:
                    yield side, mode, ownership


@pytest.mark.parametrize("side,mode,ownership", list(_transpose_variants()))
def test_every_transpose_variant_round_trips(side, mode, ownership):
    costs = (0.5, 3.0, 1.5, 2.5, 1.0)
    schedule = transpose_family(4, 5, side=side, mode=mode, ownership=ownership,
                                costs=costs).derive()
    plan = lower(schedule)
    doc = json.loads(round_trips(plan))
    (seg,) = doc["cut"]
    assert seg["side"] == side and seg["recompute"] == (mode == "recompute")
    assert (seg["backward_rank"] is None) == (mode in ("frozen", "none"))
    round_trips(schedule)


def widened(plan: Plan) -> Plan:
    """``plan`` declaring every rank, body stage and microbatch its ops name (more ranks,
    stages placed on rank 0, segments' per-microbatch ranks 0), without the ops that name
    a stage other than 0 of one of its segments (one stage each)."""
    segments = {s.name for s in plan.cut.segments}
    big = 1 << 62  # every rank, stage and microbatch: only a segment's stage is checked
    everything = ranges.Ranges(big, big, big, 1, frozenset(segments))
    programs = tuple(tuple(op for op in prog if ranges.op_beyond(op, everything) is None)
                     for prog in plan.programs)
    top = {"rank": plan.num_ranks - 1, "stage": plan.placement.num_stages - 1,
           "mb": plan.num_microbatches - 1}
    for prog in programs:
        for op in prog:
            for what, value in _named(op):
                top[what] = max(top[what], value)
    ranks, stages, m = top["rank"] + 1, top["stage"] + 1, top["mb"] + 1
    grow = m - plan.num_microbatches
    cut = Cut(tuple(attrs.evolve(s, forward_rank=s.forward_rank + (0,) * grow,
                                 backward_rank=None if s.backward_rank is None
                                 else s.backward_rank + (0,) * grow)
                    for s in plan.cut.segments))
    placement = Placement(plan.placement.stage_to_rank
                          + (0,) * (stages - plan.placement.num_stages), ranks)
    return attrs.evolve(plan, placement=placement, num_microbatches=m, cut=cut,
                        programs=programs + ((),) * (ranks - plan.num_ranks))


def _named(op) -> list:
    """``(rank|stage|mb, value)`` for each rank, body stage and microbatch ``op`` names."""
    if isinstance(op, (Overlap, Group)):
        return [x for member in op.ops for x in _named(member)]
    if isinstance(op, (Send, Recv)):
        p = op.payload
        return [("rank", op.peer), ("mb", p.mb)] + ([] if p.segment else [("stage", p.stage)])
    if isinstance(op, Collective):
        return [("rank", r) for r in op.ranks]
    if isinstance(op, (Compute, Marker)):
        body = not getattr(op, "segment", "")
        return ([("stage", op.stage)] if body else []) + (
            [] if op.mb is None else [("mb", op.mb)])
    return []


@settings(max_examples=200, deadline=None)
@given(any_plans())
def test_any_plan_round_trips_exactly(plan):
    """Every field of every op kind, defaults and non-defaults (``shape`` ``()`` vs
    ``None``, ``to_segment`` ``""`` vs ``None``, any Unicode name), comes back, once the
    plan declares every rank, stage and microbatch its ops name; as drawn, a plan whose
    op names one it lacks is refused at that op's field (``formats.ranges``)."""
    found = ranges.beyond(plan)
    if found is not None:
        where = plan_json._where(("programs", found.rank, found.index, *found.field))
        with pytest.raises(InputError, match=re.escape(f"{where}: {found.op}: ")):
            parse_plan_json(format_plan_json(plan), "x.json")
    else:
        round_trips(plan)
    plan = widened(plan)
    assert ranges.beyond(plan) is None
    text = round_trips(plan)
    assert text.isascii() and text.endswith("}\n")
    assert sum(line.startswith('      {"op": ') for line in text.splitlines()) == plan.num_ops


def test_file_write_and_read_back(tmp_path):
    plan = fixture("steady_exchange_grouped")
    out = tmp_path / "sub" / "plan.json"
    write_plan_json(plan, out)
    assert read_plan_json(out) == plan
    assert out.read_text() == format_plan_json(plan)


def test_one_op_per_line_in_run_order():
    text = format_plan_json(fixture("markers_overlap_idle"))
    lines = text.splitlines()
    start = lines.index('  "programs": [')
    rank0 = [json.loads(line.strip().rstrip(",")) for line in lines[start + 2:start + 9]]
    assert [o["op"] for o in rank0] == ["marker", "compute", "send", "idle", "recv",
                                        "compute", "marker"]
    assert rank0[2] == {"op": "send", "dst": 1, "payload": {"kind": "act", "stage": 0,
                                                             "mb": 0}}


# ---------------------------------------------------------------- fixtures


@pytest.mark.parametrize("name", list(FIXTURES))
def test_fixture_files_are_what_their_builders_write(name):
    path = FIXTURE_DIR / f"{name}.json"
    text = path.read_text()
    plan = read_plan_json(path)
    assert plan == FIXTURES[name]()
    assert format_plan_json(plan) == text


def _collectives(plan, kind=None, tag=None):
    return [(r, op) for r, prog in enumerate(plan.programs) for op in prog
            if isinstance(op, Collective) and (kind is None or op.kind == kind)
            and (tag is None or op.tag == tag)]


def test_false_accept_fixtures_read_round_trip_and_carry_their_fault():
    base = fixture("owner_transpose")
    assert {r for r, _ in _collectives(base, "all_reduce", GRADS)} == {0, 1}
    backward = set(base.cut.segments[0].backward_rank)
    broken = {n: fixture(n) for n in FIXTURES if n.startswith("false_accept_")}
    assert len(broken) == 4
    for name, plan in broken.items():
        round_trips(plan)
        assert plan.cut == base.cut and plan != base, name
    assert _collectives(broken["false_accept_no_all_reduce"], "all_reduce") == []
    ((rank, narrow),) = _collectives(broken["false_accept_narrow_all_reduce"], "all_reduce")
    assert rank in narrow.ranks and backward - set(narrow.ranks)
    swapped = broken["false_accept_broadcast_for_all_reduce"]
    assert not _collectives(swapped, "all_reduce") and len(_collectives(swapped, tag=GRADS)) == 2
    roots = {op.root for _, op in _collectives(broken["false_accept_broadcast_root_7"],
                                               "broadcast")}
    assert roots == {7} and base.num_ranks == 2


# ---------------------------------------------------------------- the CLI


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("source", [
    [str(EXAMPLES / "zbv.toml")],
    ["--family", "interleaved-1f1b", "--pp", "4", "--microbatches", "8", "--chunks", "2"],
    ["--family", "transpose", "--pp", "4", "--microbatches", "6", "--mode", "owner"],
    ["--family", "dualpipev", "--pp", "2", "--microbatches", "4"],
])
@pytest.mark.parametrize("compute_only", [False, True])
def test_export_then_check_gives_the_specs_verdict_and_digest(tmp_path, capsys, source,
                                                              compute_only):
    out = tmp_path / "plan.json"
    extra = ["--compute-only"] if compute_only else []
    assert _run(capsys, "export", *source, "--to", "plan-json", "-o", str(out), *extra) \
        == (0, "", "")
    code, text, _ = _run(capsys, "check", *source, "--json", "--expand")
    want = json.loads(text)
    code2, text2, err2 = _run(capsys, "check", str(out), "--json")
    got = json.loads(text2)
    assert (code2, err2) == (code, "") and code == 0
    assert got["certificate"]["digest"] == want["certificate"]["digest"]
    assert got["lowered"] is compute_only  # a schedule is lowered, a plan checked as written
    assert json.loads(out.read_text())["type"] == ("schedule" if compute_only else "plan")


def test_every_command_reads_plan_json(tmp_path, capsys):
    spec = str(EXAMPLES / "zb-h1.toml")
    out = tmp_path / "zb.json"
    assert main(["export", spec, "--to", "plan-json", "-o", str(out)]) == 0
    code, text, _ = _run(capsys, "diff", spec, str(out), "--json")
    doc = json.loads(text)
    assert code == 0 and doc["summary"]["moved"] == 0 and doc["new"]["verified"]
    assert doc["new"]["lowered"] is False and doc["old"]["lowered"] is True
    code, text, _ = _run(capsys, "show", str(out), "--width", "0")
    assert code == 0 and "0F0" in text
    code, text, _ = _run(capsys, "simulate", str(out), "--json")
    assert code == 0 and json.loads(text)["makespan"] > 0
    bare = tmp_path / "no_extension"  # sniffed from its text
    bare.write_text(out.read_text())
    assert _run(capsys, "check", str(bare), "-q")[0] == 0
    code, text, _ = _run(capsys, "export", str(bare), "--format", "plan-json", "--to",
                         "plan-json")
    assert code == 0 and text == out.read_text()


def test_a_plan_without_comm_ops_is_lowered_like_a_compute_only_csv(tmp_path, capsys):
    schedule = family("1f1b", 2, 3).derive()
    path = tmp_path / "compute.json"
    path.write_text(format_plan_json(Plan.from_schedule(schedule)))
    code, text, _ = _run(capsys, "check", str(path), "--json")
    doc = json.loads(text)
    assert code == 0 and doc["lowered"] is True
    assert main(["check", "--family", "1f1b", "--pp", "2", "--microbatches", "3", "--json",
                 "--expand"]) == 0
    assert json.loads(capsys.readouterr().out)["certificate"] == doc["certificate"]


def test_violations_as_written_name_the_ops_json_path(capsys):
    code, out, _ = _run(capsys, "check", str(FIXTURE_DIR / "recv_first_deadlock.json"))
    assert code == 1 and "recv_first_deadlock.json:11:7: deadlock: " in out  # 0RECV_B0's
    code, out, _ = _run(capsys, "check", "--verbose",
                        str(FIXTURE_DIR / "recv_first_deadlock.json"))
    assert code == 1 and "deadlock" in out
    assert "($.programs[0][0], 11:7)" in out and "($.programs[1][0], 15:7)" in out


# ---------------------------------------------------------------- bad input


def _base() -> dict:
    return json.loads(format_plan_json(fixture("owner_transpose")))


def _set(path, value):
    def edit(doc):
        *parents, last = path
        for key in parents:
            doc = doc[key]
        doc[last] = value
    return edit


def _delete(path):
    def edit(doc):
        *parents, last = path
        for key in parents:
            doc = doc[key]
        del doc[last]
    return edit


# programs[0]: [0] broadcast, [1] vision F, [2] recv (payload), ... [9] send ... [13] all-reduce
BAD = [  # (edit, JSON path, words)
    (_set(("programs", 0, 1, "mb"), -1), "$.programs[0][1].mb",
     "expected a non-negative integer, got -1"),
    (_set(("programs", 0, 1, "mb"), True), "$.programs[0][1].mb", "got true"),
    (_set(("programs", 0, 1, "stage"), 1.0), "$.programs[0][1].stage", "got 1.0"),
    (_set(("programs", 0, 1, "stage"), "0"), "$.programs[0][1].stage", 'got "0"'),
    (_set(("programs", 0, 1, "mb"), 10**12), "$.programs[0][1].mb", "at most 1000000"),
    (_set(("programs", 0, 1, "kind"), "X"), "$.programs[0][1].kind", "expected one of F, B"),
    (_set(("programs", 0, 1, "extra"), 1), "$.programs[0][1].extra", "unknown key"),
    (_delete(("programs", 0, 1, "stage")), "$.programs[0][1]", 'missing key "stage"'),
    (_set(("programs", 0, 1, "op"), "jump"), "$.programs[0][1].op", "expected one of compute"),
    (_delete(("programs", 0, 1, "op")), "$.programs[0][1]", 'missing key "op"'),
    (_set(("programs", 0, 1), [1]), "$.programs[0][1]", "expected an op object, got an array"),
    (_set(("programs", 0, 2, "payload", "mb"), -1), "$.programs[0][2].payload.mb",
     "non-negative"),
    (_set(("programs", 0, 2, "payload", "kind"), "weights"), "$.programs[0][2].payload.kind",
     "expected one of act, grad, input"),
    (_set(("programs", 0, 2, "payload", "shape"), [2, -3]),
     "$.programs[0][2].payload.shape[1]", "non-negative"),
    (_set(("programs", 0, 2, "payload", "shape"), "2x3"), "$.programs[0][2].payload.shape",
     "expected an array"),
    (_set(("programs", 0, 2, "payload", "dtype"), 5), "$.programs[0][2].payload.dtype",
     "expected a string"),
    (_set(("programs", 0, 2, "payload", "to_segment"), False),
     "$.programs[0][2].payload.to_segment", "expected a string"),
    (lambda doc: doc["programs"][0][7]["payload"].update(shape=[2], leaves=[]),
     "$.programs[0][7].payload.leaves", "no shape or dtype of its own"),
    (_set(("programs", 0, 7, "payload", "leaves"), [{"path": "(0).x", "shape": [2],
                                                     "dtype": "int64"}]),
     "$.programs[0][7].payload.leaves[0].path", "bad leaf path '(0).x' at character 3"),
    (_set(("programs", 0, 7, "payload", "leaves"), [{"path": "(0)", "shape": [2],
                                                     "dtype": None}]),
     "$.programs[0][7].payload.leaves[0]", "a shape and a dtype, or neither"),
    (_set(("programs", 0, 7, "payload", "leaves"), {"(0)": [2]}),
     "$.programs[0][7].payload.leaves", "expected an array"),
    (_set(("programs", 0, 2, "src"), -2), "$.programs[0][2].src", "non-negative"),
    (_set(("programs", 0, 0, "root"), "0"), "$.programs[0][0].root",
     'expected a non-negative integer, got "0"'),
    (_set(("programs", 0, 0, "root"), True), "$.programs[0][0].root", "got true"),
    (_set(("programs", 0, 0, "members"), "0,1"), "$.programs[0][0].members",
     "expected an array"),
    (_set(("programs", 0, 0, "members"), [0, None]), "$.programs[0][0].members[1]", "got null"),
    (_set(("programs", 0, 0, "kind"), "scatter"), "$.programs[0][0].kind", "broadcast"),
    (_set(("programs", 0, 0, "tag"), ["x"]), "$.programs[0][0].tag", "got an array"),
    (_set(("programs", 0, 1), {"op": "group", "ops": [{"op": "compute", "kind": "F",
                                                        "stage": 0, "mb": 0}]}),
     "$.programs[0][1].ops[0].op", 'expected one of send, recv, got "compute"'),
    (_set(("programs", 0, 1), {"op": "overlap", "ops": [{"op": "idle"}]}),
     "$.programs[0][1].ops[0].op", 'expected one of compute, got "idle"'),
    (_set(("programs", 0, 1), {"op": "idle", "stage": 0}), "$.programs[0][1].stage",
     "unknown key"),
    (_set(("programs", 0, 1), {"op": "marker", "action": "SHARD", "stage": 0}),
     "$.programs[0][1].action", "UNSHARD"),
    (_set(("stage_to_rank", 1), 2), "$.stage_to_rank[1]", "expected a rank in 0..1, got 2"),
    (_set(("num_ranks",), 0), "$.num_ranks", "expected an integer >= 1, got 0"),
    (_set(("num_ranks",), 3), "$.programs", "expected 3 programs"),
    (_set(("num_microbatches",), 3), "$.cut[0].forward_rank", "one rank per microbatch"),
    (_set(("cut", 0, "backward_rank"), [0]), "$.cut[0].backward_rank", "one rank per"),
    (_set(("cut", 0, "side"), "middle"), "$.cut[0].side", "expected one of source, sink"),
    (_set(("cut", 0, "recompute"), 0), "$.cut[0].recompute", "expected true or false, got 0"),
    (_delete(("cut", 0, "home")), "$.cut[0]", 'missing key "home"'),
    (_set(("cut",), {}), "$.cut", "expected an array, got an object"),
    (_set(("format",), "torch-csv"), "$.format", 'expected "mpipe-plan-json"'),
    (_set(("version",), 2), "$.version", "expected 1, got 2"),
    (_set(("version",), True), "$.version", "expected 1, got true"),
    (_set(("type",), "trace"), "$.type", "expected one of plan, schedule"),
    (_set(("type",), "schedule"), "$.programs[0][2].op", "a schedule holds no recv"),
    (_set(("colour",), "red"), "$.colour", "unknown key"),
    (_set(("programs", 1, 0, "x" * 10**6), 1), '$.programs[1][0]["' + "x" * 36 + '...]',
     "unknown key"),
    (_set(("programs", 1, 0, "a\nb"), 1), '$.programs[1][0]["a\\nb"]', "unknown key"),
    (_delete(("programs",)), "$", 'missing key "programs"'),
    (_set(("stage_to_rank",), []), "$.cut[0]", "cut off a body of no stages"),
]


@pytest.mark.parametrize("edit,where,words", BAD, ids=[b[1] + " " + b[2] for b in BAD])
def test_bad_values_exit_2_with_one_line_naming_the_json_path(tmp_path, capsys, edit, where,
                                                              words):
    doc = _base()
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    for command in ("check", "show", "export --to plan-json", "simulate"):
        code, out, err = _run(capsys, *command.split(), str(path))
        assert (code, out) == (2, ""), command
        assert err.startswith(f"mpipe-verify: error: {path}: {where}: ") and words in err, err
        assert err.count("\n") == 1 and len(err) < 400


@pytest.mark.parametrize("kind", ["plan", "schedule"])
@pytest.mark.parametrize("side", [SOURCE, SINK])
def test_a_cut_off_a_body_of_no_stages_is_refused_not_lowered(tmp_path, capsys, kind, side):
    """A compute-only file (lowered before it is checked) whose cut has no body to feed
    or be fed by: one located line, exit 2, nothing lowered."""
    segment = SegmentWork("enc", side, (0,), (0,))
    work = (Compute("F", 0, 0, "enc"), Compute("B", 0, 0, "enc"))
    doc = json.loads(format_plan_json(Schedule(Placement((), 2), 1, (work, ()),
                                               Cut((segment,)))))
    doc["type"] = kind
    path = tmp_path / "empty_body.json"
    path.write_text(json.dumps(doc))
    for command in ("check", "show", "export --to plan-json"):
        code, out, err = _run(capsys, *command.split(), str(path))
        assert (code, out) == (2, ""), command
        assert err == (f"mpipe-verify: error: {path}: $.cut[0]: segment \"enc\" is cut off "
                       "a body of no stages (stage_to_rank is empty): a source segment feeds "
                       "the body's first stage, a sink is fed by its last\n")


@pytest.mark.parametrize("text,where,words", [
    ('{"format": "mpipe-plan-json",\n  "version": 1,,}', ":2:16:", "malformed JSON: Expecting property name"),
    ("", ":1:1:", "malformed JSON"),
    ('{"a": NaN}', ": ", "NaN is not a JSON number"),
    ('{"a": 1, "a": 2}', ": ", 'duplicate key "a"'),
    ('{"a": ' + "9" * 5000 + "}", ": ", "malformed JSON: an integer of too many digits"),
    ("[" * 100_000 + "]" * 100_000, ": ", "nested too deeply"),
    ("[1, 2]", ": $: ", "expected an object, got an array"),
])
def test_malformed_json_is_one_line_with_its_position(tmp_path, capsys, text, where, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    code, out, err = _run(capsys, "check", str(path))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"mpipe-verify: error: {path}{where}") and words in err, err


def test_non_utf8_and_oversized_files(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_bytes(b'{\n"format": "\xff"}')
    with pytest.raises(InputError, match=r"plan.json:2: not UTF-8 text \(byte 0xff\)"):
        read_plan_json(path)
    path.write_text(format_plan_json(fixture("recv_first_deadlock")))
    monkeypatch.setattr(plan_json, "MAX_BYTES", 100)
    with pytest.raises(InputError, match="file larger than 100 bytes"):
        read_plan_json(path)


def test_a_huge_index_in_a_small_file_reads_in_linear_time_and_memory():
    """Index values size nothing: the largest allowed microbatch index reads as fast and
    in as little memory as index 0 (a reader that made one thing per microbatch would
    take a million times more)."""
    doc = json.loads(format_plan_json(fixture("recv_first_deadlock")))
    doc["num_microbatches"] = plan_json.MAX_INDEX
    for prog in doc["programs"]:
        for op in prog:
            op["payload"]["mb"] = plan_json.MAX_INDEX - 1
    text = json.dumps(doc)
    assert len(text) < 1000
    tracemalloc.start()
    plan = parse_plan_json(text, "big.json")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert plan.programs[0][0].payload.mb == plan_json.MAX_INDEX - 1
    assert plan.num_microbatches == plan_json.MAX_INDEX
    assert peak < 200_000, peak  # bytes: nothing per microbatch


def test_reading_memory_grows_linearly_with_the_file():
    """Twice the ops take about twice the memory (peak, traced)."""
    def peak(m):
        text = format_plan_json(lower(family("1f1b", 4, m).derive()))
        tracemalloc.start()
        parse_plan_json(text, "x.json")
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top
    assert peak(128) < 2.5 * peak(64)


def test_root_outside_the_plan_and_odd_members_are_read_not_rejected():
    """What the plan's ranks allow (a root outside the members, even outside the plan;
    duplicate members) is the verifier's to judge; a member or a peer outside the plan's
    ranks is bad input at its path."""
    doc = _base()
    doc["programs"][0][0].update(root=7, members=[1, 1, 0])
    plan = parse_plan_json(json.dumps(doc), "odd.json")
    assert plan.programs[0][0] == Collective("broadcast", (1, 1, 0), "params:vision", 7)
    copy.deepcopy(plan)  # still an ordinary, hashable IR value
    hash(plan.programs[0][0])
    for path, edit in (("$.programs[0][0].members[2]", {"members": [1, 1, 9]}),
                       ("$.programs[0][4].dst", {"dst": 5})):
        doc = _base()
        doc["programs"][0][0 if "members" in edit else 4].update(edit)
        with pytest.raises(InputError, match=re.escape(path) + r": .*expected a rank in 0\.\.1"):
            parse_plan_json(json.dumps(doc), "odd.json")


def test_sarif_locates_a_plan_json_op_by_rank_and_position_not_a_csv_cell(tmp_path, capsys):
    out = tmp_path / "log.sarif"
    code, _, _ = _run(capsys, "check", str(FIXTURE_DIR / "recv_first_deadlock.json"),
                      "--sarif", str(out), "-q")
    (result,) = [r for r in json.loads(out.read_text())["runs"][0]["results"]
                 if r["ruleId"] == "deadlock"]
    assert code == 1
    for loc in result["locations"]:
        assert "region" not in loc["physicalLocation"]
        assert loc["logicalLocations"][0]["fullyQualifiedName"].endswith("/position 0")


def test_simulate_refuses_a_plan_that_cannot_run_instead_of_crashing(capsys):
    """A plan read as written may not run to completion under any model (both ranks
    receive first): ``simulate`` reports the violations and exits 1 (it used to time the
    plan anyway and die with a SimulationError traceback)."""
    code, out, err = _run(capsys, "simulate", str(FIXTURE_DIR / "recv_first_deadlock.json"))
    assert (code, err) == (1, "") and "refusing to simulate" in out and "deadlock" in out
