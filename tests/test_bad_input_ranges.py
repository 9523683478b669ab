"""Bad input of the new dimensions (``formats.ranges``, docs/semantics.md §6): an op naming
a microbatch (chunk), stage or rank outside its plan's declared ranges, a reload or
return of nothing, and a stage map naming a missing rank exit 2 with one line naming the
file and the position (a JSON path, a CSV row and cell, a spec's line), never a
traceback, nothing on stdout. A reload before its offload (both there) stays a
violation. Built through the API, the same plans are rejected by the kernel."""

from __future__ import annotations

import json

import attrs
import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.formats.plan_json import format_plan_json
from mpipe_verified.formats.ranges import beyond, of_nothing
from mpipe_verified.ir import (Collective, Compute, Group, Offload, Payload, Placement, Plan,
                               Recv, Reload, Send)
from mpipe_verified.lower import lower
from mpipe_verified.verify import verify
from plan_edits import lowered
from reference import judge_plan
from test_kernel_moves import B0, B1, F0, F1, LEND, RETURN, holder, lend, one_rank

ERROR = "mpipe-verify: error: "


def bad(capsys, *argv: str) -> str:
    """The one stderr line of a command that must exit 2 and print nothing on stdout."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (code, out, err)
    assert err.count("\n") == 1 and err.startswith(ERROR) and "Traceback" not in err, err
    return err[len(ERROR):].rstrip("\n")


def write_json(tmp_path, plan, edit=None, name="p.json") -> str:
    """``plan`` as plan-json, each ``edit(doc)`` applied to the parsed document first."""
    doc = json.loads(format_plan_json(plan))
    if edit is not None:
        edit(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def csv(tmp_path, text: str, name: str = "p.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


SEQ = lower(family("seq1f1b", 2, 2, seq_chunks=2).derive())  # 2 samples of 2 chunks: 0..3


def _op(doc, rank: int, index: int) -> dict:
    return doc["programs"][rank][index]


def _first(doc, rank: int, op: str, **fields) -> int:
    return next(i for i, o in enumerate(doc["programs"][rank]) if o["op"] == op
                and all(o.get(k) == v for k, v in fields.items()))


# ---------------------------------------------------------------- plan-json


def test_a_chunk_out_of_range_names_its_json_path(tmp_path, capsys):
    """The issue's example: microbatch 9 in a plan of 2 samples of 2 chunks."""
    def edit(doc):
        _op(doc, 0, _first(doc, 0, "compute", kind="F", mb=3))["mb"] = 9
    path = write_json(tmp_path, SEQ, edit)
    i = _first(json.loads(format_plan_json(SEQ)), 0, "compute", kind="F", mb=3)
    assert bad(capsys, "check", path) == (
        f"{path}: $.programs[0][{i}].mb: 0F9: expected a microbatch in 0..3, got 9 "
        "(chunk 1 of sample 4 is out of range: 2 samples of 2 chunks)")


@pytest.mark.parametrize("where,value,needle", [
    ("stage", 7, "expected a stage in 0..1, got 7"),
    ("dst", 5, "expected a rank in 0..1, got 5"),
    ("payload.mb", 4, "expected a microbatch in 0..3, got 4"),
    ("payload.stage", 2, "expected a stage in 0..1, got 2"),
])
def test_an_index_beyond_the_declared_ranges_is_bad_input(tmp_path, capsys, where, value,
                                                            needle):
    plan = lowered("1f1b", 2, 4)
    kind = "compute" if where == "stage" else "send"

    def edit(doc):
        op = _op(doc, 0, _first(doc, 0, kind))
        *inner, key = where.split(".")
        for k in inner:
            op = op[k]
        op[key] = value
    path = write_json(tmp_path, plan, edit)
    i = _first(json.loads(format_plan_json(plan)), 0, kind)
    for command in ("check", "show", "export", "import"):
        extra = ("--to", "plan-json", "-o", str(tmp_path / "out.json")) \
            if command == "export" else ("-o", str(tmp_path / "out.toml")) \
            if command == "import" else ()
        line = bad(capsys, command, path, *extra)
        assert line.startswith(f"{path}: $.programs[0][{i}].{where}: ") and needle in line
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.toml").exists()


def test_a_group_member_and_a_collective_member_are_named_inside_the_op(tmp_path, capsys):
    plan = lowered("gpipe", 2, 2)
    grouped = attrs.evolve(plan, programs=(
        (Group((Send(1, Payload("act", 0, 3)),)),) + plan.programs[0], plan.programs[1]))
    line = bad(capsys, "check", write_json(tmp_path, grouped))
    assert "$.programs[0][0].ops[0].payload.mb: 0SEND_F3: expected a microbatch in 0..1" in line
    called = attrs.evolve(plan, programs=(
        plan.programs[0] + (Collective("all_reduce", (0, 1, 2), "mine"),),
        plan.programs[1] + (Collective("all_reduce", (0, 1, 2), "mine"),)))
    line = bad(capsys, "check", write_json(tmp_path, called))
    assert f"$.programs[0][{len(plan.programs[0])}].members[2]: " in line
    assert line.endswith("expected a rank in 0..1, got 2")


def test_a_reload_or_return_of_nothing_is_bad_input_at_its_path(tmp_path, capsys):
    nothing = one_rank(F0, F1, B0, Reload(0, 1), B1)
    line = bad(capsys, "check", write_json(tmp_path, nothing))
    assert line.endswith("$.programs[0][3]: 0RELOAD1: a reload of nothing: its rank never "
                         "offloads that activation (an OFFLOAD of the same stage and "
                         "microbatch)")
    no_lend = holder((F0, F1, B1, Recv(1, Payload(RETURN, 0, 0)), B0),
                     (Send(0, Payload(RETURN, 0, 0)),))
    line = bad(capsys, "check", write_json(tmp_path, no_lend))
    assert "$.programs[0][3]: 0RECV_RETURN0: a return of nothing: its rank never lends" in line
    unheld = holder((F0, lend(0), F1, B1, Recv(1, Payload(RETURN, 0, 0)), B0),
                    (Recv(0, Payload(LEND, 0, 1)), Send(0, Payload(RETURN, 0, 0))))
    line = bad(capsys, "check", write_json(tmp_path, unheld))
    assert "$.programs[1][1]: 0SEND_RETURN0: a return of nothing: its rank never holds" in line


def test_a_reload_before_its_offload_stays_a_violation(tmp_path, capsys):
    early = one_rank(F0, Reload(0, 0), F1, B1, Offload(0, 0), B0)
    path = write_json(tmp_path, early)
    assert main(["check", path]) == 1
    assert f"{path}:" in capsys.readouterr().out


def test_a_stage_map_naming_a_missing_rank_is_bad_input(tmp_path, capsys):
    def edit(doc):
        doc["stage_to_rank"][1] = 5
    path = write_json(tmp_path, lowered("1f1b", 2, 2), edit)
    for command in ("check", "import", "show", "diff"):
        extra = (path,) if command == "diff" else ()
        assert bad(capsys, command, path, *extra) == (
            f"{path}: $.stage_to_rank[1]: expected a rank in 0..1, got 5")


def test_declared_microbatches_and_seq_chunks_that_do_not_fit_a_plan_json_file(tmp_path,
                                                                               capsys):
    path = write_json(tmp_path, lowered("1f1b", 2, 5))
    assert bad(capsys, "check", path, "--seq-chunks", "2") == (
        f"{path}: $.num_microbatches: --seq-chunks 2 does not divide the 5 microbatches of "
        "the file (microbatch mb*S+j is chunk j of sample mb)")
    line = bad(capsys, "check", path, "--microbatches", "4")
    assert line.startswith(f"{path}: $.programs[0][") and "mb: 0F4: expected a microbatch " \
        "in 0..3, got 4: it holds microbatches 0..4, more than the 4 declared" in line


# ---------------------------------------------------------------- torch CSV

C5 = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0F4,0B3,0B4\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,1F4,1B4\n"


@pytest.mark.parametrize("argv,expected", [
    (("--seq-chunks", "2"), ":1:8: 0F4: microbatch 4 is chunk 0 of sample 2, which is "
                            "incomplete: --seq-chunks 2 does not divide the 5 microbatches"),
    (("--microbatches", "4"), ":1:8: 0F4: expected a microbatch in 0..3, got 4: it holds "
                              "microbatches 0..4, more than the 4 declared"),
    (("--ranks", "1"), ":2:1: rank 1's program: expected ranks 0..0: it has 2 ranks, more "
                       "than the 1 declared"),
    (("--stages", "1"), ":2:1: 1F0: expected a stage in 0..0, got 1: it holds stages 0..1, "
                        "more than the 1 declared"),
    (("--bidirectional",), ":1:8: 0F4: --bidirectional: the two-chain encoding needs an even "
                           "number of stages and of microbatches"),
])
def test_a_csv_read_with_sizes_it_exceeds_names_the_cell(tmp_path, capsys, argv, expected):
    path = csv(tmp_path, C5)
    assert bad(capsys, "check", path, *argv).startswith(path + expected)


def test_an_odd_stage_count_read_as_two_chains_names_the_last_stage(tmp_path, capsys):
    path = csv(tmp_path, "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n2F0,2F1,2B0,2B1\n")
    assert bad(capsys, "show", path, "--bidirectional").startswith(
        f"{path}:3:1: 2F0: --bidirectional: the two-chain encoding needs")


@pytest.mark.parametrize("text,expected", [
    ("0F0,0F1,0B0,0RELOAD1,0B1\n", ":1:4: 0RELOAD1: a reload of nothing"),
    ("0F0,0B0,0F1,0B1,3OFFLOAD1,3RELOAD1\n", ":1:5: 3OFFLOAD1: expected a stage in 0..0, got 3"),
])
def test_a_csv_move_of_nothing_or_of_no_stage_is_bad_input(tmp_path, capsys, text, expected):
    path = csv(tmp_path, text)
    for command in ("check", "import"):
        assert bad(capsys, command, path).startswith(path + expected)


def test_a_csv_reload_before_its_offload_stays_a_violation(tmp_path, capsys):
    path = csv(tmp_path, "0F0,0RELOAD0,0F1,0B1,0OFFLOAD0,0B0\n")
    assert main(["check", path]) == 1
    assert f"{path}:1:2: dependency" in capsys.readouterr().out


# ---------------------------------------------------------------- specs: stage maps


@pytest.mark.parametrize("expression,expected", [
    ("weave(pp=2, microbatches=4, pattern='F* B*', chunks=2, placement='0,1,5')",
     ":2:15: weave(): placement '0,1,5': entry 3 ('5') is not a rank of 0..1"),
    ("program(pp=2, microbatches=2, ranks=['F F B B', 'F F B B'], placement=[0, 5])",
     ":2:15: program(): placement: stage placed on rank 5 outside 0..1"),
    ("restrict(gpipe(pp=2, microbatches=2), ranks=[0, 5])",
     ":2:1: schedule does not derive: restrict names rank 5, outside the term's ranks 0..1"),
])
def test_a_term_naming_a_missing_rank_is_bad_input(tmp_path, capsys, expression, expected):
    path = tmp_path / "s.toml"
    path.write_text(f'[schedule]\nexpression = "{expression}"\n')
    assert bad(capsys, "check", str(path)) == f"{path}{expected}"


def test_a_spec_declaring_fewer_microbatches_than_its_term_is_bad_input(tmp_path, capsys):
    path = tmp_path / "d.toml"
    path.write_text('[schedule]\nexpression = "gpipe(pp=2, microbatches=4)"\nmicrobatches = 3\n')
    assert bad(capsys, "check", str(path)) == (
        f"{path}:3:1: the schedule does not fit the declared sizes: it holds microbatches "
        "0..3, more than the 3 declared")


# ---------------------------------------------------------------- the kernel, via the API


def _kernel_rejects(plan: Plan) -> set[str]:
    report = verify(plan)
    assert report.status == "violated", report.status
    found = {v.property for v in report.violations}
    assert found & judge_plan(plan).violated  # the reference finds one of them too
    return found


def test_the_kernel_still_rejects_them_when_built_through_the_api():
    """The readers refuse these plans; the kernel's own obligations reject them too."""
    base = lowered("1f1b", 2, 2)
    p0 = list(base.programs[0])
    stray = attrs.evolve(base, programs=(tuple(p0 + [Compute("F", 0, 5)]), base.programs[1]))
    assert beyond(stray) is not None and "completeness" in _kernel_rejects(stray)
    far = attrs.evolve(base, programs=(tuple(p0 + [Compute("F", 4, 0)]), base.programs[1]))
    assert beyond(far) is not None and "completeness" in _kernel_rejects(far)
    lost = attrs.evolve(base, programs=(tuple(p0 + [Send(7, Payload("act", 0, 0))]),
                                        base.programs[1]))
    assert beyond(lost) is not None and "matching" in _kernel_rejects(lost)
    nothing = one_rank(F0, F1, B0, Reload(0, 1), B1)
    assert of_nothing(nothing) is not None and _kernel_rejects(nothing) >= {"completeness"}
    no_lend = holder((F0, F1, B1, Recv(1, Payload(RETURN, 0, 0)), B0),
                     (Send(0, Payload(RETURN, 0, 0)),))
    assert of_nothing(no_lend) is not None and _kernel_rejects(no_lend)
    assert beyond(Plan(Placement((0,), 1), 2, ((F0, F1, B0, B1),))) is None


@pytest.mark.parametrize("edit, where, needle", [
    (lambda doc: _op(doc, 0, _first(doc, 0, "overlap")).update(ops=[]),
     "$.programs[0][{i}].ops", "expected one op or more, got an empty array"),
    (lambda doc: doc["programs"][0].insert(0, {"op": "group", "ops": []}),
     "$.programs[0][0].ops", "expected one op or more, got an empty array"),
    (lambda doc: doc.update(pipelines=[[], [0, 1, 2, 3]]),
     "$.pipelines", "non-empty"),
])
def test_an_empty_overlap_group_or_pipeline_is_bad_input(tmp_path, capsys, edit, where, needle):
    """An overlapped step or a group of no ops, or a pipeline of no microbatches, is not
    a plan (its CSV would not read back): exit 2 at its path."""
    plan = lower(family("dualpipe", 2, 4).derive())
    doc = json.loads(format_plan_json(plan))
    where = where.format(i=_first(doc, 0, "overlap"))
    message = bad(capsys, "check", write_json(tmp_path, plan, edit))
    assert f": {where}: " in message and needle in message, message
