"""``mpipe-verify check`` (docs/semantics.md §6): exit codes, the ``--json`` schema, the undecided
path (``--solver-rlimit``), memory limits, and the text report (``verify.report.render``:
one line per file, ``FILE:LINE:COL: PROPERTY: message`` per counterexample, the full
report with ``--verbose``). Mostly in-process through ``cli.main``; a few runs go through
the installed console script to check the real process contract (stdout, stderr, exit
code).
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import subprocess
import sys
from fractions import Fraction

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plan_edits import defer_receives, lowered, with_program
from mpipe_verified.cli import main
from mpipe_verified.formats.torch_csv import format_torch_csv, parse_torch_csv
from mpipe_verified.ir import Plan, Recv
from mpipe_verified.verify import PROPERTIES, plan_digest, verify
from mpipe_verified.verify.report import Locator, Shown, render

SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
STATUSES = {"proved", "violated", "unknown"}


def write(tmp_path, name: str, plan: Plan) -> str:
    path = tmp_path / name
    path.write_text(format_torch_csv(plan), newline="")
    return str(path)


def check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def command(capsys, *argv: str) -> tuple[int, str, str]:
    """Any subcommand: ``(exit code, stdout, stderr)``."""
    code = main(list(argv))
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


def test_json_names_the_plan_s_digest_on_every_verdict(capsys, tmp_path):
    """Verified, violated and undecided: each carries ``digest``, the plan's as read (a
    verified one's is its certificate's)."""
    plan = lowered("1f1b", 2, 4)
    code, doc = check_json(capsys, *family_argv("1f1b", 2, 4), "--expand")
    assert code == 0 and doc["digest"] == doc["certificate"]["digest"] == plan_digest(plan)
    broken = defer_receives(plan)
    path = write(tmp_path, "deferred.csv", broken)
    code, doc = check_json(capsys, path)
    assert code == 1 and "certificate" not in doc
    assert doc["digest"] == plan_digest(parse_torch_csv(pathlib.Path(path).read_text(), path))
    assert doc["digest"] == plan_digest(broken) != plan_digest(plan)
    code, doc = check_json(capsys, *family_argv("1f1b", 2, 4), "--solver-rlimit", "1")
    assert code == 3 and "certificate" not in doc and doc["digest"] == plan_digest(plan)


def test_json_of_a_parametric_answer_names_its_claim_s_digest(capsys):
    code, doc = check_json(capsys, *family_argv("1f1b", 2, 4), "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"
    assert doc["digest"] == doc["certificate"]["digest"] != plan_digest(lowered("1f1b", 2, 4))


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
    assert code == 1 and len(note) == 1 and "on NCCL at scale it hangs" in note[0]
    assert note[0].startswith("    note: this deadlock needs rendezvous")
    for reassuring in ("runs to completion", "works", "fine", "passes under"):
        assert reassuring not in note[0]
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
    name = "--family zb-h1" if source == "family" else argv[0]
    line = next(x for x in out.splitlines() if ": memory: " in x)
    m = re.fullmatch(re.escape(name) + r"(:\d+:\d+)?: memory: rank (\d+) position (\d+) "
                     r"\((\S+)\): memory peak 4 exceeds the limit 3 with (\d+) live tensors",
                     line)
    assert m, line
    rank, position, op, live = int(m[2]), int(m[3]), m[4], int(m[5])
    assert rank == 0 and live == 4
    assert str(lowered("zb-h1", 4, 8).programs[rank][position]) == op
    # as written: the op's cell; a family has no file, so no position
    assert m[1] == (None if source == "family" else f":{rank + 1}:{position + 1}")
    assert out.count("    live: activation of 0F") == 4  # the story: four lines at most
    assert "more lines" not in out
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
    lines = out.splitlines()
    assert re.fullmatch(re.escape(path) + r": VIOLATED \(1 deadlock counterexample; 2 ranks, "
                        r"2 microbatches, 16 ops, peak memory 2, \d+\.\d\d s\)", lines[0])
    assert lines[1] == (f"{path}:1:4: deadlock: wait-for cycle under rendezvous: rank 0@3 "
                        "0SEND_F1 -> rank 1@3 1SEND_B0")
    assert lines[2:4] == [
        "    rank 0, position 3: 0SEND_F1 waits for rank 1 to reach position 4 (1RECV_F1)",
        "    rank 1, position 3: 1SEND_B0 waits for rank 0 to reach position 4 (0RECV_B0)"]
    assert "facts in" not in out and "certificate" not in out  # --verbose only
    # the line and column point at the very cell of the file
    rows = [line.split(",") for line in pathlib.Path(path).read_text().splitlines()]
    assert rows[0][3] == "0SEND_F1" and rows[1][3] == "1SEND_B0"
    code, out, _ = check(capsys, path, "--verbose")
    assert out.startswith(f"{path}: VIOLATED (1 deadlock counterexample; 2 ranks, ")
    assert re.search(r"^  deadlock +violated +1 counterexample confirmed by Z3$", out, re.M)
    for prop in ("completeness", "dependency", "matching", "memory"):
        assert re.search(rf"^  {prop} +proved +\d+ facts? in \d+ Z3 runs?$", out, re.M)
    assert "    at rank 0, position 3 (1:4): 0SEND_F1" in out
    assert "    at rank 1, position 3 (2:4): 1SEND_B0" in out
    assert "  peak memory per rank: 0: 2, 1: 1" in out


def test_mismatch_text_prints_both_ends(capsys, tmp_path):
    plan = lowered("gpipe", 2, 2)
    f0, s0, f1, s1 = plan.programs[0][:4]
    path = write(tmp_path, "swapped.csv", with_program(plan, 0, (f0, f1, s1, s0)
                                                       + plan.programs[0][4:]))
    code, out, _ = check(capsys, path, "--verbose")
    assert code == 1
    assert (f"{path}:1:3: matching: send/recv mismatch on channel 0->1: rank 0 position 2 "
            "sends 0SEND_F1 but the matching receive at rank 1 position 0 is 1RECV_F0") in out
    assert "    send end: rank 0, position 2, 0SEND_F1" in out
    assert "    recv end: rank 1, position 0, 1RECV_F0" in out
    assert "    at rank 0, position 2 (1:3): 0SEND_F1" in out
    assert "    at rank 1, position 0 (2:1): 1RECV_F0" in out


def test_completeness_and_dependency_text_name_the_op_and_what_is_missing(capsys, tmp_path):
    plan = lowered("1f1b", 2, 2)
    rank1 = [op for op in plan.programs[1] if str(op) != "1F0"]
    path = write(tmp_path, "noF.csv", with_program(plan, 1, rank1))
    code, out, _ = check(capsys, path)
    assert code == 1
    assert f"{path}:2:1: completeness: 1F0 (forward) never runs on rank 1" in out
    assert (f"{path}:2:3: dependency: rank 1 position 2: 1B0 needs the stored forward of "
            "stage 1 microbatch 0, which is never computed or received on rank 1") in out
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


def test_render_of_a_lowered_plan_names_no_cell():
    report = verify(lowered("gpipe", 2, 2), memory_limit=1)
    text = render(report, Shown("--family gpipe", 2, as_written=False,
                                locate=Locator("family")), verbose=True)
    assert text.splitlines()[0] == ("--family gpipe: VIOLATED (2 memory counterexamples; "
                                    "2 ranks, 2 microbatches, 16 ops, peak memory 2, limit 1)")
    assert "(lowered plan)" in text and "row " not in text
    assert "--family gpipe: memory: rank 0 position " in text
    assert "peak memory per rank: 0: 2, 1: 2" in text
    verified = render(verify(lowered("gpipe", 2, 2)), Shown("g", 2), verbose=True)
    assert "certificate: sha256 " + verify(lowered("gpipe", 2, 2)).certificate.digest in verified
    assert "certificate" not in render(verify(lowered("gpipe", 2, 2)), Shown("g", 2))


def test_big_plan_two_process_path_says_whether_it_lowered(capsys, tmp_path, monkeypatch):
    """Plans of ``TWO_PROCESS_OPS`` ops or more are verified on two cores; the report
    still says whether the file was checked as written (comm cells) or lowered (compute
    only), and a family goes the same way."""
    from mpipe_verified import check as spine
    from mpipe_verified.ir import Schedule, computes_of
    from mpipe_verified.verify import verify_split

    monkeypatch.setattr(spine, "TWO_PROCESS_OPS", 0)
    split = []  # the plans verify_split judged
    monkeypatch.setattr(spine, "verify_split",
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
    assert f"{path}: dependency: {unlisted} more counterexamples found, not listed" in out
    assert f"(+{unlisted} more found, not listed)" in check(capsys, path, "--verbose")[1]


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
    code, out, err = check(capsys, str(no_mb), "--microbatches", "6")
    assert (code, out) == (2, "")  # microbatch 6 is beyond the 6 declared: bad input at its cell
    assert err == (f"mpipe-verify: error: {no_mb}:1:10: 0F6: expected a microbatch in 0..5, "
                   "got 6: it holds microbatches 0..6, more than the 6 declared\n")


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
    from mpipe_verified.check import TWO_PROCESS_OPS
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


# ---------------------------------------------------------------- the CI-shaped report


def test_a_verified_file_prints_at_most_two_lines(capsys):
    """One line per file (``FILE: VERIFIED (summary)``), a second only for ranks whose
    peaks differ; several files one after another, no blank line between."""
    zbv, one = str(EXAMPLES / "zbv.toml"), str(EXAMPLES / "1f1b.toml")
    code, out, err = check(capsys, zbv)
    assert (code, err) == (0, "") and len(out.splitlines()) == 1
    assert re.fullmatch(re.escape(zbv) + r": VERIFIED \(4 ranks, 8 microbatches, 384 ops, "
                        r"peak memory 8, \d+\.\d\d s\)\n", out), out
    code, out, err = check(capsys, one, zbv)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and "" not in lines
    assert lines[0].startswith(f"{one}: VERIFIED (4 ranks, 8 microbatches, 160 ops, peak "
                               "memory 4, ")
    assert lines[1] == "  peak memory per rank: 0: 4, 1: 3, 2: 2, 3: 1"
    assert lines[2].startswith(f"{zbv}: VERIFIED")
    for spec in sorted(EXAMPLES.glob("*.toml")):
        if "broken" in spec.name or "_64" in spec.name:
            continue
        code, out, _ = check(capsys, str(spec))
        assert code == 0 and len(out.splitlines()) <= 2, (spec, out)
    code, out, _ = check(capsys, zbv, "--verbose")  # the proof and the certificate
    assert "  dependency    proved    " in out and "  certificate: sha256 " in out
    assert check(capsys, zbv, "-q")[1:] == ("", "")
    code, out, err = check(capsys, zbv, "-q", "--verbose")
    assert code == 2 and out == "" and "--quiet prints nothing" in err


def test_broken_csv_prints_its_row_and_cell(capsys):
    path = str(EXAMPLES / "broken.csv")
    code, out, _ = check(capsys, path)
    lines = out.splitlines()
    assert code == 1 and lines[0].startswith(f"{path}: VIOLATED (1 deadlock counterexample; ")
    assert lines[1].startswith(f"{path}:3:6: deadlock: wait-for cycle under rendezvous")
    assert (EXAMPLES / "broken.csv").read_text().splitlines()[2].split(",")[5] == "2SEND_F1"


def test_missing_work_of_a_compute_only_csv_points_at_its_cells(capsys, tmp_path):
    """The 1F1B schedule without its last row, declared 4 ranks: each missing op points at
    the row rank 3 would be on; a dependency at the op's own cell; a send the lowering
    inserted at the cell of the compute op it serves. And nothing in the report reads as
    if the plan worked somewhere: no note of the eager model for an incomplete plan."""
    compute = tmp_path / "1f1b.csv"
    assert main(["export", str(EXAMPLES / "1f1b.toml"), "--to", "torch-csv",
                 "--compute-only", "-o", str(compute)]) == 0
    rows = compute.read_text().splitlines()
    path = tmp_path / "3-rows.csv"
    path.write_text("\n".join(rows[:3]) + "\n")
    capsys.readouterr()
    for verbose in ([], ["--verbose"]):
        code, out, _ = check(capsys, str(path), "--stages", "4", "--ranks", "4",
                             "--microbatches", "8", *verbose)
        assert code == 1
        assert f"{path}:4:1: completeness: 3F0 (forward) never runs on rank 3" in out
        cells = rows[2].split(",")
        m = re.search(re.escape(str(path)) + r":3:(\d+): dependency: rank 2 position \d+: "
                      r"2B0 needs", out)
        assert m and cells[int(m[1]) - 1] == "2B0", out
        m = re.search(re.escape(str(path)) + r":3:(\d+): matching: rank 2 position \d+: "
                      r"2SEND_F2 to rank 3", out)
        assert m and cells[int(m[1]) - 1] == "2F2"
        assert "compute-only, lowered by mpipe" in out.splitlines()[0]
        for reassuring in ("note:", "runs to completion", "gloo", "works"):
            assert reassuring not in out, reassuring
        code, doc = check_json(capsys, str(path), "--stages", "4", "--ranks", "4",
                               "--microbatches", "8")
        assert doc["passes_under"] == ["eager"]  # the JSON is as it was


def test_a_plan_json_violation_points_at_the_op_s_line(capsys, tmp_path):
    good = tmp_path / "good.json"
    assert main(["export", *family_argv("1f1b", 2, 2), "--to", "plan-json",
                 "-o", str(good)]) == 0
    lines = good.read_text().splitlines()
    drop = next(i for i, line in enumerate(lines) if '"op": "recv", "src": 0' in line)
    bad = tmp_path / "bad.json"
    kept = lines[:drop] + lines[drop + 1:]
    bad.write_text("\n".join(kept) + "\n")
    capsys.readouterr()
    code, out, _ = check(capsys, str(bad))
    assert code == 1
    located = list(re.finditer(re.escape(str(bad)) + r":(\d+):(\d+): (\w+): rank (\d+) "
                               r"position (\d+): (\S+)", out))
    assert located, out
    for found in located:
        line, col = int(found[1]), int(found[2])
        assert kept[line - 1][col - 1] == "{", found[0]
        doc = json.loads(bad.read_text())
        op = doc["programs"][int(found[4])][int(found[5])]
        assert json.loads(kept[line - 1].strip().rstrip(",")) == op
    assert re.search(re.escape(str(bad)) + r":\d+:7: dependency: ", out)
    code, out, _ = check(capsys, str(bad), "--verbose")
    assert re.search(r"    at rank 1, position \d+ \(\$\.programs\[1\]\[\d+\], \d+:7\): ", out)


def test_a_spec_violation_points_at_its_schedule_expression(capsys):
    path = str(EXAMPLES / "broken.toml")
    code, out, _ = check(capsys, path)
    line = (EXAMPLES / "broken.toml").read_text().splitlines()[7]
    assert code == 1 and line.startswith("expression = ")
    assert f"{path}:8:1: memory: rank 0 position 12 (0F6): memory peak 7 exceeds the limit 4" in out
    assert out.splitlines()[0].startswith(f"{path}: VIOLATED (4 memory counterexamples; ")
    # seven live tensors: three of them and how many more, all seven with --verbose
    assert out.count("    live: activation of 0F") == 3
    assert out.count("    ... 4 more lines (--verbose)") == 4
    code, out, _ = check(capsys, path, "--verbose")
    assert out.count("    live: activation of 0F") == 7 and "more lines" not in out


def test_counts_agree_with_their_nouns(capsys):
    """"1 counterexample", "1 rank", "1 microbatch", "1 live tensor", "1 fact", "1 Z3
    run" in the text report (the JSON keeps the passes' own message)."""
    argv = [*family_argv("1f1b", 1, 1), "--memory-limit", "0"]
    code, out, _ = check(capsys, *argv, "--verbose")
    assert code == 1
    assert "(1 memory counterexample; 1 rank, 1 microbatch, 2 ops, peak memory 1, limit 0" in out
    assert "with 1 live tensor" in out and "1 counterexample confirmed by Z3" in out
    for wrong in ("1 counterexamples", "1 ranks", "1 microbatches", "1 live tensors",
                  "1 facts", "1 Z3 runs", "1 ops", "1 obligations"):
        assert not re.search(rf"(?<![\d.]){wrong}\b", out), wrong
    assert re.search(r"^  matching +proved +0 facts in 0 Z3 runs$", out, re.M), out
    _, doc = check_json(capsys, *argv)
    assert doc["violations"][0]["message"].endswith("with 1 live tensors")
    from mpipe_verified.verify.report import agreeing, counted
    assert [counted(n, w) for n, w in ((1, "rank"), (2, "rank"), (1, "microbatch"),
                                        (3, "microbatch"), (0, "op"), (1, "fact"),
                                        (1, "Z3 run"), (2, "Z3 run"))] == [
        "1 rank", "2 ranks", "1 microbatch", "3 microbatches", "0 ops", "1 fact", "1 Z3 run",
        "2 Z3 runs"]
    assert agreeing("(1 sends, 11 receives on 0->1) with 1 live tensors") == (
        "(1 send, 11 receives on 0->1) with 1 live tensor")
    # recheck's reasons for a parametric certificate of another size agree too
    from mpipe_verified.check import parametric
    from mpipe_verified.verify.report import Parametric
    claim = Parametric.of("1f1b", {"pp": 2, "microbatches": 2, "chunks": None}, [])
    why = parametric.mismatch(lowered("1f1b", 1, 1), claim)
    assert why.startswith("the plan has 1 rank and 1 microbatch, the certificate's "), why
    claim = Parametric.of("1f1b", {"pp": 1, "microbatches": 1, "chunks": 5}, [])
    assert "derive at least 5 forwards, the plan has 2 steps" in parametric.mismatch(
        lowered("1f1b", 1, 1), claim)


def test_an_undecided_file_names_each_undecided_property(capsys):
    code, out, _ = check(capsys, *family_argv("gpipe", 2, 2), "--solver-rlimit", "1")
    lines = out.splitlines()
    assert code == 3 and lines[0].startswith("--family gpipe: UNDECIDED (5 properties not "
                                             "decided; 2 ranks, 2 microbatches, 16 ops")
    assert all(line.startswith("--family gpipe: undecided: ") for line in lines[1:])
    assert len(lines) == 6


@pytest.mark.parametrize("text", [
    '[schedule]\nfamily = "1f1b"\npp = 4\nmicrobatches = 8\nstages = 12\n',
    '[schedule]\nexpression = "one_f_one_b(pp=4, microbatches=8)"\nmicrobatches = 9\n',
    # the audit's two: a stage declared beside a family, ten microbatches beside eight
    '[schedule]\nfamily = "1f1b"\npp = 4\nmicrobatches = 8\nstages = 5\n',
    '[schedule]\nexpression = "zb_h2(pp=4, microbatches=8)"\nmicrobatches = 10\n',
])
def test_sizes_declared_in_the_file_are_never_answered_by_the_laws(tmp_path, capsys, text):
    """A spec that names a family but declares other sizes beside it is another schedule
    than the family's: even with --laws it is checked op by op (VIOLATED), and export
    refuses it (the laws once answered VERIFIED for it)."""
    spec = tmp_path / "declared.toml"
    spec.write_text(text)
    code, out, _ = command(capsys, "check", "--laws", str(spec))
    assert code == 1 and ": VIOLATED (" in out and "completeness" in out, out
    (tmp_path / "out.json").write_text("{}")  # an earlier run's file
    code, _, err = command(capsys, "export", "--to", "plan-json", "-o",
                           str(tmp_path / "out.json"), str(spec))
    assert code == 1 and "VIOLATED" in err and not (tmp_path / "out.json").exists()
    assert "the earlier" in err and "removed" in err


def test_an_exported_transpose_family_is_judged_as_written(tmp_path, capsys, monkeypatch):
    """export lowers --family transpose with its estimated costs, while the laws certify
    the plan lowered with the standard ones (another plan): export judges the plan it
    writes op by op, never by the laws, and the file rechecks from its own check."""
    from mpipe_verified.check import parametric

    def laws(*_, **__):
        raise AssertionError("export asked the laws for a plan they do not certify")

    monkeypatch.setattr(parametric, "answer", laws)
    args = ["--family", "transpose", "--mode", "none", "--ownership", "inline", "--pp", "4",
            "--microbatches", "6"]
    plan, cert = tmp_path / "t.json", tmp_path / "t.cert.json"
    code, _, err = command(capsys, "export", "--to", "plan-json", "-o", str(plan), *args)
    assert code == 0, err
    code, out, _ = command(capsys, "check", str(plan), "--certificate-out", str(cert))
    assert code == 0, out
    code, out, _ = command(capsys, "recheck", str(plan), str(cert))
    assert code == 0 and "PROVEN" in out, out


@pytest.mark.parametrize("static,limit,peak_text,limit_text", [
    ("10.65", "10.75", "10.7500000000000004", "10.75"),  # float sum 10.75: the limit itself
    ("0", "0.3", "0.30000000000000002", "0.29999999999999999"),  # three 0.1s
])
def test_the_summary_prints_a_peak_over_its_limit_apart_from_it(capsys, tmp_path, static,
                                                                  limit, peak_text,
                                                                  limit_text):
    """The summary's figures are the exact peak and limit: when six decimals would print
    them alike, enough digits to show the peak above the limit (and the message agrees)."""
    m = 1 if static != "0" else 3
    path = tmp_path / "tight.toml"
    path.write_text(f'[schedule]\nfamily = "gpipe"\npp = 1\nmicrobatches = {m}\n\n'
                    f"[cost]\nactivation = 0.1\n\n[memory]\nlimit = {limit}\n"
                    f"static = {static}\n")
    code, out, _ = check(capsys, str(path))
    assert code == 1
    assert f", peak memory {peak_text}, limit {limit_text}, " in out.splitlines()[0]
    assert f"memory peak {peak_text} exceeds the limit {limit_text} " in out


def test_peaks_that_differ_print_apart_on_the_per_rank_line(capsys, tmp_path):
    """The per-rank line appears only when the peaks differ; so they must look different."""
    path = tmp_path / "static.toml"
    path.write_text('[schedule]\nfamily = "gpipe"\npp = 2\nmicrobatches = 1\n\n'
                    "[memory]\nstatic = [2, 2.0000000000000004]\n")
    code, out, _ = check(capsys, str(path))
    assert code == 0
    assert out.splitlines()[1] == "  peak memory per rank: 0: 3, 1: 3.0000000000000004"


_figures = st.one_of(
    st.floats(0, 1e12, allow_nan=False), st.integers(0, 10**12),
    st.fractions(0, 10**6, max_denominator=10**20),
    st.sampled_from([0.3, 0.1 + 0.2, Fraction(0.1) * 3, 10.75,
                     Fraction(10.65) + Fraction(0.1), 4, 4 - 1e-10]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_figures, min_size=1, max_size=4))
def test_apart_prints_different_figures_differently_and_in_their_order(values):
    """Equal numbers print alike, different ones differently and in their order (as
    decimals, or exact fractions); when ``num`` already tells them apart, its texts."""
    from decimal import Decimal
    from mpipe_verified.verify.report import apart, num
    texts = apart(*values)
    exact = [Fraction(v) for v in values]
    for (a, x), (b, y) in itertools.combinations(zip(exact, texts), 2):
        assert (a == b) == (x == y), (values, texts)
        if "/" not in x + y:
            assert (a < b) == (Decimal(x) < Decimal(y)), (values, texts)
    if len({Decimal(num(v)) for v in values}) == len(set(exact)):
        assert texts == [num(v) for v in values]


def test_apart_falls_back_to_exact_fractions_beyond_its_digits():
    from mpipe_verified.verify.report import MAX_DIGITS, apart
    third = Fraction(1, 3)
    close = third + Fraction(1, 10**(MAX_DIGITS + 5))
    assert apart(third, close) == [str(third), str(close)]
    assert apart(third, third + Fraction(1, 10**20))[0] == "0." + "3" * 20
