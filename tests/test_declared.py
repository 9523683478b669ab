"""Ranks that run nothing (``declared.MAX_IDLE_RANKS``): a torch CSV, a plan-json file, a
spec's ``ranks`` or ``check --ranks`` may leave at most that many ranks without an op;
more is bad input (exit 2, one line naming the row, JSON path or key), refused before the
verifier spends anything per rank. Every other rank runs an op, so the cost of a check
stays bounded by the plan's ops. Stages that no op computes likewise
(``MAX_IDLE_STAGES``: a plan-json placement, ``--stages``, a spec's ``stages``); and a
declared microbatch count cannot change a cut's (one line, not a traceback)."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from mpipe_verified.cli import main
from mpipe_verified.declared import (MAX_IDLE_RANKS, MAX_IDLE_STAGES, declare,
                                     idle_rank_beyond)
from mpipe_verified.errors import InputError, ParameterError
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json
from mpipe_verified.formats.spec import load_spec
from mpipe_verified.formats.torch_actions import MAX_INDEX
from mpipe_verified.formats.torch_csv import parse_torch_csv
from mpipe_verified.ir import (SOURCE, Compute, Cut, Idle, Marker, Placement, Schedule,
                               SegmentWork)

WORK = "0F0,0B0\n"  # one rank's whole work: the rest run nothing
REASON = f"at most {MAX_IDLE_RANKS} ranks may run nothing"
STAGE_REASON = f"at most {MAX_IDLE_STAGES} stages may go uncomputed"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _schedule(idle_ranks: int) -> Schedule:
    work = (Compute("F", 0, 0), Compute("B", 0, 0))
    return Schedule(Placement((0,), 1 + idle_ranks), 1, (work,) + ((),) * idle_ranks)


# ---------------------------------------------------------------- which ranks run nothing


def test_a_program_of_idle_steps_runs_nothing_and_a_marker_is_an_op():
    programs = [(Compute("F", 0, 0),)] + [(Idle(),) * 3] * MAX_IDLE_RANKS + [()]
    assert idle_rank_beyond(programs) == MAX_IDLE_RANKS + 1
    assert idle_rank_beyond(programs[:-1]) is None
    programs[-1] = (Idle(), Marker(0, "UNSHARD"))
    assert idle_rank_beyond(programs) is None


# ---------------------------------------------------------------- torch CSV


@pytest.mark.parametrize("spelling", ["plain", "general"])
def test_a_csv_with_one_row_too_many_without_an_action_is_refused_at_that_row(spelling):
    """Torch's plain form (read by columns) and any other spelling (read cell by cell)
    refuse the same file at the same row; one row fewer reads."""
    first = WORK if spelling == "plain" else '"0F0",0B0\n'
    rows = ["\n", ",\n", ",,\n"]  # empty, or idle cells only
    fits = first + "".join(rows[r % 3] for r in range(MAX_IDLE_RANKS))
    assert parse_torch_csv(fits, "x.csv").num_ranks == MAX_IDLE_RANKS + 1
    with pytest.raises(InputError) as refused:
        parse_torch_csv(fits + "\n", "x.csv")
    assert (refused.value.line, refused.value.column) == (MAX_IDLE_RANKS + 2, None)
    assert str(refused.value) == (f"x.csv:{MAX_IDLE_RANKS + 2}: the {MAX_IDLE_RANKS + 1}th "
                                  "row without an action (only idle cells, or none): "
                                  f"{REASON} (each costs time and memory that no op "
                                  "accounts for)")


def test_a_million_empty_rows_are_refused_without_a_structure_per_row():
    """What the reader holds stays far below one object per row (each would take over
    50 bytes): it stops at the first row beyond the bound."""
    text = WORK + "\n" * 10**6
    tracemalloc.start()
    with pytest.raises(InputError, match=f":{MAX_IDLE_RANKS + 2}: .*{REASON}"):
        parse_torch_csv(text, "x.csv")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 20 * len(text), peak


def test_rows_that_run_their_stages_do_not_count():
    """Rows with work are not bounded here: each has an op (its cost is the op's)."""
    rows = [f"{s}F0,{s}B0\n" for s in range(MAX_IDLE_RANKS + 8)]
    plan = parse_torch_csv("".join(rows) + "\n" * MAX_IDLE_RANKS, "x.csv")
    assert plan.num_ranks == 2 * MAX_IDLE_RANKS + 8


def test_check_refuses_the_file_in_one_line(capsys, tmp_path):
    path = tmp_path / "idle.csv"
    path.write_text(WORK + "\n" * (10 * MAX_IDLE_RANKS))
    code, out, err = _run(capsys, "check", str(path))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"mpipe-verify: error: {path}:{MAX_IDLE_RANKS + 2}: ") and REASON in err


# ---------------------------------------------------------------- plan-json


def test_a_plan_json_with_one_program_too_many_without_an_op_is_refused_at_it():
    fits = format_plan_json(_schedule(MAX_IDLE_RANKS))
    assert parse_plan_json(fits, "x.json").num_ranks == MAX_IDLE_RANKS + 1
    doc = json.loads(fits)
    doc["num_ranks"] += 1
    doc["programs"].append([{"op": "idle"}])
    with pytest.raises(InputError, match=rf"^x\.json: \$\.programs\[{MAX_IDLE_RANKS + 1}\]: "
                                         rf"the {MAX_IDLE_RANKS + 1}th program without an op "
                                         rf"\(idle steps aside\): {REASON}"):
        parse_plan_json(json.dumps(doc), "x.json")


# ---------------------------------------------------------------- declared ranks


def test_declared_ranks_may_add_ranks_up_to_the_bound():
    one = _schedule(0)
    assert declare(one, ranks=MAX_IDLE_RANKS + 1).num_ranks == MAX_IDLE_RANKS + 1
    with pytest.raises(ParameterError, match=f"^{MAX_IDLE_RANKS + 2} ranks declared, "
                                             f"{MAX_IDLE_RANKS + 1} of them without an op: "
                                             f"{REASON}"):
        declare(one, ranks=MAX_IDLE_RANKS + 2)
    with pytest.raises(ParameterError, match=REASON):
        declare(_schedule(MAX_IDLE_RANKS), ranks=MAX_IDLE_RANKS + 2, stages=3)


def test_declaring_no_new_rank_refuses_nothing():
    """A schedule's own idle ranks (a spec's ``restrict``) are its ops' cost to bound, not
    the declaration's."""
    many = _schedule(MAX_IDLE_RANKS + 5)
    assert declare(many, ranks=many.num_ranks, stages=2).num_ranks == many.num_ranks


@pytest.mark.parametrize("ranks", [MAX_IDLE_RANKS + 2, 10**6])
def test_check_ranks_beyond_the_bound_is_one_line(capsys, tmp_path, ranks):
    path = tmp_path / "one.csv"
    path.write_text(WORK)
    code, out, err = _run(capsys, "check", str(path), "--ranks", str(ranks))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err == (f"mpipe-verify: error: {path}: {ranks} ranks declared, {ranks - 1} of them "
                   f"without an op: {REASON} (each costs time and memory that no op accounts "
                   "for)\n")


def test_a_spec_declaring_too_many_ranks_names_the_key(tmp_path):
    path = tmp_path / "wide.toml"
    path.write_text('[schedule]\nfamily = "gpipe"\npp = 2\nmicrobatches = 2\n'
                    f"ranks = {MAX_IDLE_RANKS + 3}\n")
    with pytest.raises(InputError, match=f"wide.toml:5:1: .*{REASON}"):
        load_spec(path)


# ---------------------------------------------------------------- stages no op computes


def test_declared_stages_may_add_stages_up_to_the_bound():
    one = _schedule(0)
    assert declare(one, stages=MAX_IDLE_STAGES + 1).placement.num_stages == MAX_IDLE_STAGES + 1
    with pytest.raises(ParameterError, match=f"^{MAX_IDLE_STAGES + 2} stages declared, more "
                                             f"than {MAX_IDLE_STAGES} of them computed by no "
                                             f"op: {STAGE_REASON}"):
        declare(one, stages=MAX_IDLE_STAGES + 2)


def test_check_stages_beyond_the_bound_is_one_line(capsys, tmp_path):
    path = tmp_path / "one.csv"
    path.write_text(WORK)
    code, out, err = _run(capsys, "check", str(path), "--stages", str(10**6))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"mpipe-verify: error: {path}: {10**6} stages declared") and (
        STAGE_REASON in err)


def test_a_plan_json_placing_too_many_stages_no_op_computes_is_refused_at_one():
    doc = json.loads(format_plan_json(_schedule(1)))
    doc["stage_to_rank"] = [0, 1] * (MAX_IDLE_STAGES // 2) + [0]
    assert parse_plan_json(json.dumps(doc), "x.json").placement.num_stages == (
        MAX_IDLE_STAGES + 1)
    doc["stage_to_rank"].append(1)
    with pytest.raises(InputError, match=rf"^x\.json: \$\.stage_to_rank\[{MAX_IDLE_STAGES + 1}"
                                         rf"\]: the {MAX_IDLE_STAGES + 1}th stage that no "
                                         rf"compute op computes: {STAGE_REASON}"):
        parse_plan_json(json.dumps(doc), "x.json")


def test_a_plan_json_placing_more_stages_than_an_index_can_name_is_refused():
    doc = json.loads(format_plan_json(_schedule(0)))
    doc["stage_to_rank"] = [0] * (MAX_INDEX + 2)
    with pytest.raises(InputError, match=rf"\$\.stage_to_rank\[{MAX_INDEX + 1}\]: a stage "
                                         rf"above {MAX_INDEX}: expected at most "
                                         rf"{MAX_INDEX + 1} stages"):
        parse_plan_json(json.dumps(doc), "x.json")


# ---------------------------------------------------------------- microbatches of a cut


def test_check_microbatches_of_a_plan_with_a_cut_is_one_line_not_a_traceback(capsys, tmp_path):
    """Its segments name a rank per microbatch: no count but their own fits them."""
    segment = SegmentWork("enc", SOURCE, (0, 0), (0, 0))
    work = tuple(Compute(k, 0, mb, seg) for k, order in (("F", ("enc", "")), ("B", ("", "enc")))
                 for seg in order for mb in (0, 1))
    path = tmp_path / "cut.json"
    path.write_text(format_plan_json(Schedule(Placement((0,), 1), 2, (work,),
                                              Cut((segment,)))))
    assert main(["check", "-q", str(path), "--microbatches", "2"]) == 0
    code, out, err = _run(capsys, "check", str(path), "--microbatches", "3")
    assert (code, out) == (2, "")
    assert err == (f"mpipe-verify: error: {path}: 3 microbatches declared for a plan of 2 "
                   "with a cut: each segment names its forward and backward rank per "
                   "microbatch\n")


def test_a_spec_declaring_microbatches_beside_a_transpose_names_the_key(tmp_path):
    path = tmp_path / "cut.toml"
    path.write_text('[schedule]\nexpression = "transpose(one_f_one_b(pp=2, microbatches=2))"\n'
                    "microbatches = 3\n")
    with pytest.raises(InputError, match="cut.toml:3:1: .*3 microbatches declared for a "
                                         "plan of 2 with a cut"):
        load_spec(path)
