"""Activation moves in the formats and on the command line: plan-json carries them; a
torch CSV holds them only as this package's extension (``export --csv-moves``), else
export refuses the plan (exit 2); a move of nothing or of a stage the plan lacks is bad
input (exit 2), other bad moves are the verifier's to report (exit 1, with the position),
and the host memory they use is reported beside the device peak."""

from __future__ import annotations

import json

from mpipe_verified.cli import main
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json
from mpipe_verified.formats.torch_csv import format_torch_csv, parse_torch_csv, torch_csv_rows
from test_kernel_moves import B0, B1, F0, F1, OFFLOADED, REL1, one_rank


def test_plan_json_and_the_csv_extension_read_back_what_they_wrote():
    assert parse_plan_json(format_plan_json(OFFLOADED), "x.json") == OFFLOADED
    text = torch_csv_rows(OFFLOADED, range(1), moves=True)
    assert text == "0F0,0OFFLOAD0,0F1,0OFFLOAD1,0RELOAD0,0B0,0RELOAD1,0B1\r\n"
    assert parse_torch_csv(text, "x.csv") == OFFLOADED


def test_export_to_torch_csv_refuses_moves_unless_asked(tmp_path, capsys):
    src = tmp_path / "off.json"
    src.write_text(format_plan_json(OFFLOADED))
    out = tmp_path / "off.csv"
    assert main(["export", str(src), "--to", "torch-csv", "-o", str(out)]) == 2
    assert "--csv-moves" in capsys.readouterr().err and not out.exists()
    assert main(["export", str(src), "--to", "torch-csv", "--csv-moves", "-o", str(out)]) == 0
    assert "0OFFLOAD0" in out.read_text()
    try:
        format_torch_csv(OFFLOADED)
    except ValueError as e:
        assert "OFFLOAD" in str(e)
    else:
        raise AssertionError("a plan with moves has no torch CSV form")


def test_bad_moves_are_bad_input_or_violations_with_their_position_and_host_memory_is_reported(
        tmp_path, capsys):
    """A reload of nothing and a move of a stage no row places are bad input at their
    cell (exit 2, nothing on stdout); a reload before its offload is a violation there."""
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,0B0,0RELOAD1,0B1\n")  # a reload of nothing
    assert main(["check", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"mpipe-verify: error: {bad}:1:4: 0RELOAD1: a reload "
                                        "of nothing")
    stray = tmp_path / "stray.csv"
    stray.write_text("0F0,0B0,0F1,0B1,3OFFLOAD1,3RELOAD1\n")  # a stage the plan lacks
    assert main(["check", str(stray)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{stray}:1:5: 3OFFLOAD1: expected a stage in 0..0, got 3" in err
    early = tmp_path / "early.csv"
    early.write_text("0F0,0RELOAD0,0F1,0B1,0OFFLOAD0,0B0\n")  # the reload comes first
    assert main(["check", str(early)]) == 1
    assert f"{early}:1:2: dependency" in capsys.readouterr().out
    good = tmp_path / "good.json"
    good.write_text(format_plan_json(OFFLOADED))
    assert main(["check", str(good), "--memory-limit", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["peak_memory"] == {"0": 1} and doc["stats"]["host_peak_memory"] == {"0": 2}
    assert main(["show", str(good)]) == 0
    assert "peak memory 1, host peak 2" in capsys.readouterr().out
    assert one_rank(F0, B0, F1, REL1, B1).num_ops == 5


def test_rank_moves_travel_in_plan_json_and_never_in_a_torch_csv():
    from test_kernel_moves import LENT
    assert parse_plan_json(format_plan_json(LENT), "x.json") == LENT
    assert '"kind": "lend"' in format_plan_json(LENT)
    try:
        torch_csv_rows(LENT, range(2), moves=True)
    except ValueError as e:
        assert "peer rank" in str(e)
    else:
        raise AssertionError("a lend names its peer, which a torch CSV cannot")


def test_a_malformed_move_in_plan_json_is_bad_input_with_its_path(tmp_path, capsys):
    doc = json.loads(format_plan_json(OFFLOADED))
    doc["programs"][0][1] = {"op": "reload", "stage": 0, "mb": -1}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["check", str(bad)]) == 2
    assert "$.programs[0][1].mb" in capsys.readouterr().err
