"""``mpipe-verify check`` (docs/semantics.md §6): exit codes, the ``--json`` schema, the undecided
path (``--solver-rlimit``), memory limits, and the human-readable counterexamples of
``render_report``. Mostly in-process through ``cli.main``; a few runs go through the
installed console script to check the real process contract (stdout, stderr, exit code).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import attrs
import pytest

from plan_edits import defer_receives, lowered, with_program
from mpipe_verified.cli import main, render_report
from mpipe_verified.formats.torch_csv import format_torch_csv
from mpipe_verified.ir import Plan, Recv
from mpipe_verified.verify import PROPERTIES, verify

SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")
STATUSES = {"proved", "violated", "unknown"}


def write(tmp_path, name: str, plan: Plan) -> str:
    path = tmp_path / name
    path.write_text(format_torch_csv(plan), newline="")
    return str(path)


def check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def check_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = check(capsys, *argv, "--json")
    assert err == ""
    return code, json.loads(out)


def family_argv(name, p, m, v=None):
    return ["--family", name, "--pp", str(p), "--microbatches", str(m),
            *(["--chunks", str(v)] if v else [])]


# ---------------------------------------------------------------- JSON schema


def assert_schema(doc: dict, ranks: int) -> None:
    """docs/semantics.md §6: ``{"verified": bool, "violations": [{"property", "message", "ranks",
    "ops"}], "peak_memory": {rank: value}, "stats": {...}}``."""
    assert {"verified", "violations", "peak_memory", "stats"} <= set(doc)
    assert isinstance(doc["verified"], bool)
    assert isinstance(doc["violations"], list)
    for v in doc["violations"]:
        assert {"property", "message", "ranks", "ops"} <= set(v)
        assert v["property"] in PROPERTIES
        assert isinstance(v["message"], str) and v["message"]
        assert isinstance(v["ranks"], list) and v["ranks"]
        assert all(isinstance(r, int) and 0 <= r < ranks for r in v["ranks"])
        assert isinstance(v["ops"], list)
        for op in v["ops"]:
            assert set(op) == {"rank", "position", "op"}
            assert isinstance(op["rank"], int) and isinstance(op["position"], int)
            assert isinstance(op["op"], str) and op["op"]
    peaks = doc["peak_memory"]
    assert isinstance(peaks, dict) and sorted(peaks, key=int) == [str(r) for r in range(ranks)]
    assert all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in peaks.values())
    stats = doc["stats"]
    assert isinstance(stats, dict)
    assert stats["ranks"] == ranks and isinstance(stats["ops"], int) and stats["ops"] > 0
    assert stats["comm_model"] in ("rendezvous", "eager")
    assert set(stats["properties"]) == set(PROPERTIES)
    assert all(info["status"] in STATUSES for info in stats["properties"].values())
    assert doc["verified"] == (doc["violations"] == [] and all(
        info["status"] == "proved" for info in stats["properties"].values()))


def test_json_schema_verified(capsys):
    code, doc = check_json(capsys, *family_argv("1f1b", 4, 8), "--expand")
    assert code == 0
    assert_schema(doc, 4)
    assert doc["verified"] is True and doc["violations"] == []
    assert doc["peak_memory"] == {"0": 4, "1": 3, "2": 2, "3": 1}
    assert doc["certificate"]["digest"] == verify(lowered("1f1b", 4, 8)).certificate.digest
    assert doc["lowered"] is True


def test_json_schema_violated(capsys, tmp_path):
    plan = lowered("1f1b", 4, 8)
    program = list(plan.programs[2])
    del program[next(i for i, op in enumerate(program) if isinstance(op, Recv))]
    path = write(tmp_path, "dropped.csv", with_program(plan, 2, program))
    code, doc = check_json(capsys, path, "--memory-limit", "3")
    assert code == 1
    assert_schema(doc, 4)
    assert doc["verified"] is False and "certificate" not in doc
    assert {v["property"] for v in doc["violations"]} == {"matching", "dependency",
                                                          "deadlock", "memory"}
    assert doc["lowered"] is False


def test_json_through_the_console_script(tmp_path):
    """The installed ``mpipe-verify``: JSON on stdout only, nothing on stderr (op by op:
    ``--expand``, since ZB-H1's laws would answer the family instance)."""
    path = write(tmp_path, "deferred.csv", defer_receives(lowered("1f1b", 2, 4)))
    for argv, code in ((["--family", "zb-h1", "--pp", "2", "--microbatches", "4",
                         "--expand"], 0),
                       ([path], 1), ([path, "--comm-model", "eager"], 0)):
        proc = subprocess.run([str(SCRIPT), "check", *argv, "--json"], capture_output=True,
                              text=True, timeout=120)
        assert (proc.returncode, proc.stderr) == (code, ""), proc.stderr
        doc = json.loads(proc.stdout)
        assert_schema(doc, 2)
        assert doc["verified"] is (code == 0)


# ---------------------------------------------------------------- exit codes


def test_deferred_receives_deadlock_and_eager_accepts(capsys, tmp_path):
    path = write(tmp_path, "deferred.csv", defer_receives(lowered("1f1b", 4, 8)))
    code, doc = check_json(capsys, path)
    assert code == 1
    assert [v["property"] for v in doc["violations"]] == ["deadlock"]
    assert doc["violations"][0]["message"].startswith("wait-for cycle under rendezvous")
    code, doc = check_json(capsys, path, "--comm-model", "eager")
    assert code == 0 and doc["verified"] is True
    assert doc["stats"]["comm_model"] == "eager"
    assert doc["certificate"]["comm_model"] == "eager"


def test_a_deadlock_that_passes_under_eager_says_it_hangs_at_scale(capsys, tmp_path):
    """A rendezvous deadlock is rechecked under eager: when eager passes, the report says
    in one sentence why it still hangs on NCCL (``passes_under: ["eager"]``); when eager
    deadlocks too (each rank waits to receive first), it says nothing of the kind."""
    eager_ok = write(tmp_path, "deferred.csv", defer_receives(lowered("1f1b", 4, 8)))
    recv_first = tmp_path / "recv-first.csv"
    recv_first.write_text("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
    code, doc = check_json(capsys, eager_ok)
    assert code == 1 and doc["passes_under"] == ["eager"]
    code, out, _ = check(capsys, eager_ok)
    note = [line for line in out.splitlines() if "batch_isend_irecv" in line]
    assert code == 1 and len(note) == 1 and "hangs at scale" in note[0]
    assert note[0].strip().startswith("note: under the eager model")
    code, doc = check_json(capsys, str(recv_first))
    assert code == 1 and [v["property"] for v in doc["violations"]] == ["deadlock"]
    assert doc["passes_under"] == []
    assert "batch_isend_irecv" not in check(capsys, str(recv_first))[1]
    code, doc = check_json(capsys, *family_argv("1f1b", 4, 8))
    assert code == 0 and "passes_under" not in doc


@pytest.mark.parametrize("source", ["family", "csv"])
def test_memory_limit_one_below_peak_exit_1_and_at_peak_exit_0(capsys, tmp_path, source):
    argv = (family_argv("zb-h1", 4, 8) if source == "family"
            else [write(tmp_path, "zb.csv", lowered("zb-h1", 4, 8))])
    code, doc = check_json(capsys, *argv)
    peak = max(doc["peak_memory"].values())
    assert code == 0 and peak == 4
    code, out, err = check(capsys, *argv, "--memory-limit", str(peak - 1))
    assert code == 1 and err == ""
    line = next(x for x in out.splitlines() if x.startswith("memory: "))
    m = re.fullmatch(r"memory: rank (\d+) position (\d+) \((\S+)\): memory peak 4 exceeds the "
                     r"limit 3 with (\d+) live tensors", line)
    assert m, line
    rank, position, op, live = int(m[1]), int(m[2]), m[3], int(m[4])
    assert rank == 0 and live == 4
    assert str(lowered("zb-h1", 4, 8).programs[rank][position]) == op
    assert out.count("    live: activation of 0F") == 4
    code, out, err = check(capsys, *argv, "--memory-limit", str(peak))
    assert (code, err) == (0, "") and "VERIFIED" in out


# ---------------------------------------------------------------- undecided


def test_solver_rlimit_1_is_exit_3_never_verified(capsys):
    code, doc = check_json(capsys, *family_argv("1f1b", 4, 8), "--solver-rlimit", "1")
    assert code == 3
    assert doc["verified"] is False and doc["status"] == "undecided"
    assert doc["violations"] == [] and "certificate" not in doc
    assert_schema(doc, 4)
    assert {info["status"] for info in doc["stats"]["properties"].values()} == {"unknown"}
    code, out, _ = check(capsys, *family_argv("1f1b", 4, 8), "--solver-rlimit", "1")
    assert code == 3
    assert out.splitlines()[0].startswith("--family 1f1b: UNDECIDED")
    assert "undecided: deadlock:" in out and "certificate" not in out


def test_solver_rlimit_1_on_a_broken_plan_is_never_verified(capsys, tmp_path):
    path = write(tmp_path, "deferred.csv", defer_receives(lowered("1f1b", 2, 4)))
    code, doc = check_json(capsys, path, "--solver-rlimit", "1")
    assert code == 3 and doc["verified"] is False and doc["status"] == "undecided"


def test_solver_rlimit_through_the_console_script():
    proc = subprocess.run([str(SCRIPT), "check", "--family", "gpipe", "--pp", "2",
                           "--microbatches", "2", "--solver-rlimit", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["status"] == "undecided" and doc["verified"] is False


# ---------------------------------------------------------------- counterexample text


def test_deadlock_text_is_a_per_rank_wait_for_trace(capsys, tmp_path):
    path = write(tmp_path, "deferred.csv", defer_receives(lowered("1f1b", 2, 2)))
    code, out, _ = check(capsys, path)
    assert code == 1
    assert out.splitlines()[0] == f"{path}: VIOLATED (2 ranks, 16 ops, rendezvous)"
    assert re.search(r"^  deadlock +violated +1 counterexamples confirmed by Z3$", out, re.M)
    for prop in ("completeness", "dependency", "matching", "memory"):
        assert re.search(rf"^  {prop} +proved +\d+ facts in \d+ Z3 runs$", out, re.M)
    assert ("deadlock: wait-for cycle under rendezvous: rank 0@3 0SEND_F1 -> "
            "rank 1@3 1SEND_B0") in out
    assert "    at rank 0, position 3 (row 1, column 4): 0SEND_F1" in out
    assert "    at rank 1, position 3 (row 2, column 4): 1SEND_B0" in out
    assert ("    rank 0, position 3: 0SEND_F1 waits for rank 1 to reach position 4 "
            "(1RECV_F1)") in out
    assert ("    rank 1, position 3: 1SEND_B0 waits for rank 0 to reach position 4 "
            "(0RECV_B0)") in out
    # the row/column point at the very cells of the file
    rows = [line.split(",") for line in pathlib.Path(path).read_text().splitlines()]
    assert rows[0][3] == "0SEND_F1" and rows[1][3] == "1SEND_B0"


def test_mismatch_text_prints_both_ends(capsys, tmp_path):
    plan = lowered("gpipe", 2, 2)
    f0, s0, f1, s1 = plan.programs[0][:4]
    path = write(tmp_path, "swapped.csv", with_program(plan, 0, (f0, f1, s1, s0)
                                                       + plan.programs[0][4:]))
    code, out, _ = check(capsys, path)
    assert code == 1
    assert ("matching: send/recv mismatch on channel 0->1: rank 0 position 2 sends 0SEND_F1 "
            "but the matching receive at rank 1 position 0 is 1RECV_F0") in out
    assert "    send end: rank 0, position 2, 0SEND_F1" in out
    assert "    recv end: rank 1, position 0, 1RECV_F0" in out
    assert "    at rank 0, position 2 (row 1, column 3): 0SEND_F1" in out
    assert "    at rank 1, position 0 (row 2, column 1): 1RECV_F0" in out


def test_completeness_and_dependency_text_name_the_op_and_what_is_missing(capsys, tmp_path):
    plan = lowered("1f1b", 2, 2)
    rank1 = [op for op in plan.programs[1] if str(op) != "1F0"]
    path = write(tmp_path, "noF.csv", with_program(plan, 1, rank1))
    code, out, _ = check(capsys, path)
    assert code == 1
    assert "completeness: 1F0 (forward) never runs on rank 1" in out
    assert ("dependency: rank 1 position 2: 1B0 needs the stored forward of stage 1 "
            "microbatch 0, which is never computed or received on rank 1") in out
    assert "    at rank 1, position 2 (row 2, column 3): 1B0" in out
    # a duplicate names the op and its count; a missing backward says what would do
    rank0 = list(plan.programs[0])
    rank0.insert(0, rank0[0])
    path = write(tmp_path, "dup.csv", with_program(plan, 0, rank0))
    code, out, _ = check(capsys, path)
    assert code == 1 and "completeness: 0F0 occurs 2 times on rank 0" in out
    rank1 = [op for op in plan.programs[1] if str(op) != "1B1"]
    path = write(tmp_path, "noB.csv", with_program(plan, 1, rank1))
    code, out, _ = check(capsys, path)
    assert ("completeness: 1B1 never runs on rank 1 (backward of stage 1 microbatch 1 needs "
            "B, or I then W)") in out


def test_render_report_of_a_lowered_plan_says_so():
    report = verify(lowered("gpipe", 2, 2), memory_limit=1)
    text = render_report(report, "--family gpipe", as_written=False)
    assert text.splitlines()[0] == ("--family gpipe: VIOLATED (2 ranks, 16 ops, rendezvous, "
                                    "lowered by mpipe)")
    assert "(lowered plan)" in text and "row " not in text
    assert "peak memory per rank: 0: 2, 1: 2" in text
    verified = render_report(verify(lowered("gpipe", 2, 2)), "g", as_written=False)
    assert "certificate: sha256 " + verify(lowered("gpipe", 2, 2)).certificate.digest in verified


def test_big_plan_two_process_path_says_whether_it_lowered(capsys, tmp_path, monkeypatch):
    """Plans of ``TWO_PROCESS_OPS`` ops or more are verified on two cores; the report
    still says whether the file was checked as written (comm cells) or lowered (compute
    only), and a family goes the same way."""
    from mpipe_verified import cli
    from mpipe_verified.ir import Schedule, computes_of
    from mpipe_verified.verify import verify_split

    monkeypatch.setattr(cli, "TWO_PROCESS_OPS", 0)
    split = []  # the plans verify_split judged
    monkeypatch.setattr(cli, "verify_split",
                        lambda plan, *a, **k: split.append(plan) or verify_split(plan, *a, **k))
    plan = lowered("1f1b", 2, 4)
    compute = Schedule(plan.placement, plan.num_microbatches,
                       tuple(tuple(op for op in prog if computes_of(op))
                             for prog in plan.programs))
    for name, target, as_written in (("comm.csv", plan, True), ("compute.csv", compute, False)):
        path = tmp_path / name
        path.write_text(format_torch_csv(target), newline="")
        code, doc = check_json(capsys, str(path))
        assert code == 0 and doc["verified"] and doc["lowered"] is not as_written, name
        code, out, _ = check(capsys, str(path))
        assert code == 0 and ("lowered by mpipe" in out) is not as_written, name
    code, doc = check_json(capsys, *family_argv("1f1b", 2, 4), "--expand")  # op by op
    assert code == 0 and doc["verified"] and doc["lowered"] is True
    assert len(split) == 5 and split[-1].num_ops == doc["stats"]["ops"]


def test_text_report_counts_findings_past_the_cap(tmp_path, capsys):
    """Every receive of 1F1B(8, 64) removed: the text report says how many more violations
    were found than it lists (the JSON's ``unlisted``)."""
    plan = lowered("1f1b", 8, 64)
    stripped = attrs.evolve(plan, programs=tuple(
        tuple(op for op in program if not isinstance(op, Recv)) for program in plan.programs))
    path = write(tmp_path, "stripped.csv", stripped)
    code, out, _ = check(capsys, path)
    _, doc = check_json(capsys, path)
    unlisted = doc["stats"]["properties"]["dependency"]["unlisted"]
    assert code == 1 and unlisted > 0
    assert f"(+{unlisted} more found, not listed)" in out


# ---------------------------------------------------------------- declared sizes


def test_declared_sizes_turn_dropped_work_into_completeness_violations(capsys, tmp_path):
    """A CSV carries no stage or microbatch count: without the removed row or microbatch
    it reads as a smaller valid schedule. ``--stages``/``--ranks``/``--microbatches``
    declare the sizes, and the verifier's completeness property names what is missing."""
    compute = [[str(op) for op in prog if "SEND" not in str(op) and "RECV" not in str(op)]
               for prog in lowered("1f1b", 4, 8).programs]
    no_row = tmp_path / "no-last-row.csv"
    no_row.write_text("\n".join(",".join(row) for row in compute[:3]) + "\n")
    no_mb = tmp_path / "no-last-mb.csv"
    no_mb.write_text("\n".join(",".join(c for c in row if not c.endswith("7"))
                               for row in compute) + "\n")
    for path, declared, missing in (
            (no_row, ["--stages", "4", "--ranks", "4"], {"3F0", "3B7"}),
            (no_mb, ["--microbatches", "8"], {"0F7", "3B7"})):
        assert check_json(capsys, str(path))[0] == 0, path
        code, doc = check_json(capsys, str(path), *declared)
        assert code == 1
        props = {v["property"] for v in doc["violations"]}
        assert "completeness" in props
        named = {v["message"].split()[0] for v in doc["violations"]
                 if v["property"] == "completeness" and "never runs" in v["message"]}
        assert missing <= named, named
    code, doc = check_json(capsys, str(no_mb), "--microbatches", "7")
    assert code == 0  # the file is complete for the 7 microbatches it holds
    code, doc = check_json(capsys, str(no_mb), "--microbatches", "6")
    assert code == 1 and any("is not part of this plan" in v["message"]
                             for v in doc["violations"])


@pytest.mark.parametrize("argv,needle", [
    (["--stages", "3"], "holds stages 0..3, more than the 3 declared"),
    (["--ranks", "2"], "has 4 ranks, more than the 2 declared"),
    (["--stages", "0"], "stages must be in 1..1000000"),
])
def test_declared_sizes_below_the_file_are_bad_input(capsys, tmp_path, argv, needle):
    path = write(tmp_path, "1f1b.csv", lowered("1f1b", 4, 4))
    code, out, err = check(capsys, path, *argv)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert path in err and needle in err, err


def test_python_dash_m_checks_a_big_csv_on_two_cores(tmp_path):
    """``python -m mpipe_verified.cli`` runs the module's own copy; a plan of
    ``TWO_PROCESS_OPS`` ops or more is verified there on two cores all the same."""
    from mpipe_verified.cli import TWO_PROCESS_OPS
    path = tmp_path / "big.csv"
    assert main(["export", *family_argv("1f1b", 8, 2600), "--to", "torch-csv",
                 "-o", str(path)]) == 0
    assert sum(bool(c) for row in path.read_text().splitlines()
               for c in row.split(",")) >= TWO_PROCESS_OPS
    proc = subprocess.run([sys.executable, "-m", "mpipe_verified.cli", "check", str(path),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert json.loads(proc.stdout)["verified"] is True


@pytest.mark.parametrize("flag", ["--svg", "--sarif", "--junit"])
def test_json_and_another_output_on_stdout_are_refused(capsys, flag):
    """``--svg - --json`` used to print the SVG and drop the JSON without a word."""
    code, out, err = check(capsys, *family_argv("1f1b", 2, 2), flag, "-", "--json")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"{flag} - and --json both write to stdout" in err
