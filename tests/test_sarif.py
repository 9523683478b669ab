"""CI outputs of ``check``: SARIF 2.1.0 (``--sarif``), JUnit (``--junit``), ``--quiet``,
several files with the worst exit code, ``--only-schedules``, atomic writes, and the
terminal-only progress line."""

from __future__ import annotations

import csv
import io
import json
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from mpipe_verified.cli import main
from mpipe_verified.progress import Progress
from mpipe_verified.verify import PROPERTIES

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")
EXAMPLES = ROOT / "examples"
BROKEN_CSV, BROKEN_SPEC = EXAMPLES / "broken.csv", EXAMPLES / "broken.toml"


def check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def sarif_of(capsys, tmp_path, *argv) -> tuple[int, dict]:
    path = tmp_path / "out" / "r.sarif"
    code, out, err = check(capsys, *argv, "--sarif", path, "--quiet")
    assert out == ""
    return code, json.loads(path.read_text())


def regions(result: dict) -> list[tuple[int, int | None]]:
    return [(loc["physicalLocation"]["region"]["startLine"],
             loc["physicalLocation"]["region"].get("startColumn"))
            for loc in result["locations"]]


def test_sarif_log_shape_and_rules(capsys, tmp_path):
    code, log = sarif_of(capsys, tmp_path, BROKEN_CSV)
    assert code == 1
    assert log["version"] == "2.1.0" and "sarif-2.1.0" in log["$schema"]
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "mpipe-verify"
    assert [r["id"] for r in driver["rules"]] == list(PROPERTIES)
    assert all(r["shortDescription"]["text"] and r["fullDescription"]["text"]
               for r in driver["rules"])
    assert run["invocations"] == [{"executionSuccessful": True, "exitCode": 1}]
    assert run["artifacts"][0]["location"]["uri"].endswith("examples/broken.csv")
    for result in run["results"]:
        assert result["ruleId"] in PROPERTIES
        assert result["ruleIndex"] == PROPERTIES.index(result["ruleId"])
        assert result["level"] == "error" and result["message"]["text"]
        assert result["locations"]


def test_csv_checked_as_written_points_at_row_and_cell(capsys, tmp_path):
    _, log = sarif_of(capsys, tmp_path, BROKEN_CSV)
    (result,) = log["runs"][0]["results"]
    assert result["ruleId"] == "deadlock"
    assert regions(result) == [(3, 6), (4, 4)]  # rank 2 position 5, rank 3 position 3
    rows = list(csv.reader(io.StringIO(BROKEN_CSV.read_text(), newline="")))
    cells = [rows[line - 1][col - 1] for line, col in regions(result)]
    assert cells == ["2SEND_F1", "3SEND_B0"]
    logical = [loc["logicalLocations"][0]["fullyQualifiedName"] for loc in result["locations"]]
    assert logical == ["rank 2/position 5", "rank 3/position 3"]


def test_spec_points_at_its_schedule_table(capsys, tmp_path):
    code, log = sarif_of(capsys, tmp_path, BROKEN_SPEC)
    assert code == 1
    line = next(n for n, text in enumerate(BROKEN_SPEC.read_text().splitlines(), 1)
                if text.strip() == "[schedule]")
    results = log["runs"][0]["results"]
    assert {r["ruleId"] for r in results} == {"memory"} and len(results) == 4
    assert all(regions(r) == [(line, 1)] for r in results)


def test_compute_only_csv_points_at_the_rank_row_and_the_op_cell(capsys, tmp_path):
    path = tmp_path / "c.csv"
    assert main(["export", str(EXAMPLES / "gpipe.toml"), "--to", "torch-csv",
                 "--compute-only", "-o", str(path)]) == 0
    code, log = sarif_of(capsys, tmp_path, path, "--memory-limit", "5")
    assert code == 1
    rows = list(csv.reader(io.StringIO(path.read_text(), newline="")))
    for result in log["runs"][0]["results"]:
        (loc,) = result["locations"]
        region = loc["physicalLocation"]["region"]
        op = result["properties"]["ops"][0]
        assert region["startLine"] == op["rank"] + 1
        assert rows[region["startLine"] - 1][region["startColumn"] - 1] == op["op"]


def test_family_has_logical_locations_only(capsys, tmp_path):
    code, log = sarif_of(capsys, tmp_path, "--family", "gpipe", "--pp", "2",
                         "--microbatches", "4", "--memory-limit", "2")
    assert code == 1
    run = log["runs"][0]
    assert "artifacts" not in run and run["results"]
    for result in run["results"]:
        for loc in result["locations"]:
            assert "physicalLocation" not in loc and loc["logicalLocations"]


def test_verified_input_has_no_results(capsys, tmp_path):
    code, log = sarif_of(capsys, tmp_path, EXAMPLES / "zb-h1.toml")
    assert code == 0 and log["runs"][0]["results"] == []


def test_several_files_worst_exit_code_and_bad_input_notification(capsys, tmp_path):
    missing = tmp_path / "missing.csv"
    path = tmp_path / "r.sarif"
    code, out, err = check(capsys, EXAMPLES / "zb-h1.toml", BROKEN_CSV, missing,
                           "--sarif", path, "--junit", tmp_path / "r.xml")
    assert code == 2
    assert err.count("\n") == 1 and "missing.csv: no such file" in err
    assert "zb-h1.toml: VERIFIED" in out and "broken.csv: VIOLATED" in out
    run = json.loads(path.read_text())["runs"][0]
    assert run["invocations"][0]["exitCode"] == 2
    assert run["invocations"][0]["executionSuccessful"] is False
    (note,) = run["invocations"][0]["toolExecutionNotifications"]
    assert note["level"] == "error" and "no such file" in note["message"]["text"]
    assert [r["ruleId"] for r in run["results"]] == ["deadlock"]
    code, out, _ = check(capsys, EXAMPLES / "zb-h1.toml", BROKEN_SPEC, "--json")
    docs = json.loads(out)
    assert code == 1 and [d["status"] for d in docs] == ["verified", "violated"]


def test_bad_family_is_reported_by_its_name_in_sarif_and_junit(capsys, tmp_path):
    """A --family that cannot be built is an input error named ``--family NAME`` (not
    None) with no file location; JUnit used to fail with "cannot serialize None"."""
    sarif_path, junit_path = tmp_path / "r.sarif", tmp_path / "r.xml"
    code, out, err = check(capsys, "--family", "gpipe", "--pp", "0", "--microbatches", "2",
                           "--sarif", sarif_path, "--junit", junit_path)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--family gpipe" in err
    run = json.loads(sarif_path.read_text())["runs"][0]
    (note,) = run["invocations"][0]["toolExecutionNotifications"]
    assert note["message"]["text"].startswith("--family gpipe: ") and "None" not in str(note)
    assert "locations" not in note and "artifacts" not in run
    suite = ET.fromstring(junit_path.read_text()).find("testsuite")
    assert suite.get("name") == "--family gpipe" and suite.get("errors") == "1"
    assert suite.find("testcase").get("classname") == "--family gpipe"


def test_junit_one_testcase_per_property(capsys, tmp_path):
    path = tmp_path / "j.xml"
    code, _, _ = check(capsys, BROKEN_CSV, EXAMPLES / "zb-h1.toml", "--junit", path, "-q")
    assert code == 1
    root = ET.fromstring(path.read_text())
    suites = root.findall("testsuite")
    assert [len(s.findall("testcase")) for s in suites] == [5, 5]
    assert [c.get("name") for c in suites[0].findall("testcase")] == list(PROPERTIES)
    failed = [c.get("name") for c in suites[0].findall("testcase") if c.find("failure")
              is not None]
    assert failed == ["deadlock"] and root.get("failures") == "1"


def test_junit_times_are_the_pass_and_the_kernel(capsys, tmp_path):
    """Each test case's time is its property's fast pass plus the kernel's decision, as
    the report's stats give them (op by op: ``--expand``, since ZB-H1's laws would answer
    the spec)."""
    path = tmp_path / "j.xml"
    code, out, _ = check(capsys, EXAMPLES / "zb-h1.toml", "--junit", path, "--json",
                         "--expand")
    assert code == 0
    stats = json.loads(out)["stats"]["properties"]
    cases = ET.fromstring(path.read_text()).find("testsuite").findall("testcase")
    for case in cases:
        info = stats[case.get("name")]
        want = info["linear_seconds"] + info["kernel_seconds"]
        assert abs(float(case.get("time")) - want) < 1e-3, (case.get("name"), want)
    assert sum(stats[c.get("name")]["kernel_seconds"] for c in cases) > 0


def test_quiet_prints_nothing(capsys):
    assert check(capsys, BROKEN_CSV, "--quiet") == (1, "", "")
    assert check(capsys, EXAMPLES / "zb-h1.toml", "-q") == (0, "", "")
    code, out, err = check(capsys, BROKEN_CSV, "--quiet", "--json")
    assert code == 2 and "--quiet prints nothing" in err


def test_only_schedules_skips_other_toml(capsys, tmp_path):
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "x"\n')
    assert check(capsys, other, EXAMPLES / "zb-h1.toml", "--only-schedules", "-q") == (0, "", "")
    code, _, err = check(capsys, other, "-q")
    assert code == 2 and "pyproject.toml" in err


def test_failed_write_leaves_no_partial_file(capsys, tmp_path):
    (tmp_path / "d").mkdir()
    code, _, err = check(capsys, BROKEN_CSV, "--sarif", tmp_path / "d")
    assert code == 2 and "is a directory" in err
    assert list((tmp_path / "d").iterdir()) == []
    target = tmp_path / "keep.sarif"
    target.write_text("old")
    check(capsys, BROKEN_CSV, "--sarif", target, "-q")
    assert json.loads(target.read_text())["version"] == "2.1.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "keep.sarif"]


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_progress_only_on_a_terminal(tty):
    stream = _Stream(tty)
    progress = Progress(stream=stream)
    progress.phase("verifying")
    progress.done()
    assert ("verifying" in stream.getvalue()) is tty
    assert stream.getvalue().endswith("\r\x1b[K") if tty else stream.getvalue() == ""
    assert not Progress(enabled=False, stream=_Stream(True)).enabled


def test_pre_commit_hook_runs_check_on_schedule_files():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    fields = dict(re.findall(r"^\s*-?\s*(\w+): (.+)$", text, re.M))
    assert fields["id"] == "mpipe-verify" and fields["entry"] == "mpipe-verify check"
    assert fields["files"] == r"\.(toml|csv)$" and fields["language"] == "python"
    assert fields["args"] == "[--only-schedules]"
    pattern = re.compile(fields["files"])
    assert pattern.search("schedules/a.toml") and pattern.search("x/torch.csv")
    assert not pattern.search("README.md")


def test_pre_commit_hook_in_a_repository_with_data_csvs(tmp_path):
    """The hook's own command (entry + args from ``.pre-commit-hooks.yaml``) on every file
    its ``files`` pattern matches in a repository that also holds a pyproject.toml and
    data CSVs: only the schedules are judged, so the hook passes; a broken schedule, or
    a schedule CSV with one mistyped cell, still fails it."""
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    fields = dict(re.findall(r"^\s*-?\s*(\w+): (.+)$", text, re.M))
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\n')
    (repo / "data" / "metrics.csv").write_text("step,loss\n1,0.52\n2,0.47\n")
    (repo / "data" / "empty.csv").write_text("")
    (repo / "zb-h1.toml").write_text((EXAMPLES / "zb-h1.toml").read_text())
    (repo / "good.csv").write_text("0F0,0B0\n")
    pattern = re.compile(fields["files"])
    argv = [str(SCRIPT), *fields["entry"].split()[1:], *fields["args"].strip("[]").split(",")]

    def hook() -> subprocess.CompletedProcess:
        files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*")
                       if p.is_file() and pattern.search(str(p.relative_to(repo))))
        return subprocess.run(argv + files, cwd=repo, capture_output=True, text=True,
                              timeout=120)
    proc = hook()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "good.csv: VERIFIED" in proc.stdout and "zb-h1.toml: VERIFIED" in proc.stdout
    assert "metrics" not in proc.stdout + proc.stderr
    (repo / "broken.csv").write_text((EXAMPLES / "broken.csv").read_text())
    assert hook().returncode == 1
    (repo / "broken.csv").write_text("0F0,0X0\n")
    proc = hook()
    assert proc.returncode == 2 and "broken.csv:1:2:" in proc.stderr, proc.stderr
