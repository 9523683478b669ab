"""The ``mpipe-verify`` export and show commands, through ``main`` and the installed
console script: outputs read back to the derived/lowered plan; bad input exits 2 with one
line on stderr and no traceback."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from mpipe_verified.algebra import families
from mpipe_verified.cli import main
from mpipe_verified.formats.torch_csv import (parse_torch_csv, read_torch_csv,
                                              with_torch_markers, without_markers,
                                              write_torch_csv)
from mpipe_verified.ir import Plan
from mpipe_verified.lower import lower

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def family_args(name: str, p: int = 4, m: int = 8) -> list[str]:
    extra = ["--chunks", "2"] if name == "interleaved-1f1b" else []
    return ["--family", name, "--pp", str(p), "--microbatches", str(m), *extra]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_export_family_reads_back_as_the_lowered_plan(capsys, name):
    code, out, err = run(capsys, "export", *family_args(name), "--to", "torch-csv")
    assert (code, err) == (0, "")
    schedule = families.family(name, 4, 8, 2 if name == "interleaved-1f1b" else None).derive()
    read = parse_torch_csv(out, "out.csv")
    assert read == with_torch_markers(lower(schedule))
    assert without_markers(read) == lower(schedule)  # markers are all it adds


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_export_compute_only_reads_back_as_the_schedule(capsys, name):
    code, out, _ = run(capsys, "export", str(EXAMPLES / f"{name}.toml"), "--to", "torch-csv",
                       "--compute-only")
    assert code == 0
    schedule = families.family(name, 4, 8, 2 if name == "interleaved-1f1b" else None).derive()
    assert parse_torch_csv(out, "out.csv") == Plan.from_schedule(schedule)


def test_export_to_file_creates_parents_and_csv_inputs_round_trip(capsys, tmp_path):
    schedule = families.zb_h1(4, 8).derive()
    out = tmp_path / "a" / "b" / "zb.csv"
    assert run(capsys, "export", str(EXAMPLES / "zb-h1.toml"), "--to", "torch-csv",
               "-o", str(out)) == (0, "", "")
    assert read_torch_csv(out) == with_torch_markers(lower(schedule))
    # a lowered CSV is written as is; a compute-only one is lowered
    again = tmp_path / "again.csv"
    assert run(capsys, "export", str(out), "--to", "torch-csv", "-o", str(again))[0] == 0
    assert again.read_bytes() == out.read_bytes()
    compute = tmp_path / "compute.csv"
    write_torch_csv(schedule, str(compute))
    assert read_torch_csv(str(compute)) == Plan.from_schedule(schedule)
    code, text, _ = run(capsys, "export", str(compute), "--to", "torch-csv")
    assert code == 0 and parse_torch_csv(text, "x.csv") == with_torch_markers(lower(schedule))
    # the compute-only view of a lowered file drops its comm cells
    code, text, _ = run(capsys, "export", str(out), "--to", "torch-csv", "--compute-only")
    assert parse_torch_csv(text, "x.csv") == Plan.from_schedule(schedule)
    # unknown extension: sniffed
    lowered = out.read_bytes().decode()
    sniffed = tmp_path / "plan.txt"
    sniffed.write_bytes(compute.read_bytes())
    assert run(capsys, "export", str(sniffed), "--to", "torch-csv")[1] == lowered
    toml = tmp_path / "spec.cfg"
    toml.write_text((EXAMPLES / "zb-h1.toml").read_text())
    assert run(capsys, "export", str(toml), "--to", "torch-csv")[1] == lowered
    forced = tmp_path / "spec.csv"
    forced.write_text((EXAMPLES / "zb-h1.toml").read_text())
    assert run(capsys, "export", str(forced), "--format", "spec", "--to", "torch-csv")[1] == lowered


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_show_lists_every_rank_with_idle_markers(capsys, name):
    code, out, err = run(capsys, "show", str(EXAMPLES / f"{name}.toml"), "--width", "0")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    for r in range(4):
        row = next(line for line in lines if line.startswith(f"rank {r} "))
        assert f"{r}F0" in row or name in ("zbv", "dualpipev")
        assert any(line.startswith(f"rank {r}: busy") for line in lines)
    assert " . " in out or out.count(".   ") > 0
    assert "makespan" in out and "peak memory" in out


def test_show_wraps_and_uses_the_spec_cost_model(capsys, tmp_path):
    code, out, _ = run(capsys, "show", *family_args("gpipe", 2, 8), "--width", "60")
    assert code == 0 and all(len(line) <= 60 for line in out.splitlines()[2:])
    assert out.count("rank 1 |") > 1
    spec = tmp_path / "slow.toml"
    spec.write_text('[schedule]\nfamily = "gpipe"\npp = 2\nmicrobatches = 2\n'
                    "[cost]\nF = 2\nB = 4\n")
    code, out, _ = run(capsys, "show", str(spec), "--width", "0")
    assert "makespan 18," in out  # F 2 and B 4: twice the unit makespan of 9


BAD_TOML = '[schedule]\nfamily = "zb-h1"\npp = = 4\n'


@pytest.mark.parametrize("argv,needle", [
    (["show", "{bad}"], "bad.toml:3:6: malformed TOML"),
    (["show", "{missing}"], "missing.toml: no such file"),
    (["show", "{dir}"], "is a directory"),
    (["show", "{junk}"], "not UTF-8"),
    (["show", "--family", "zb-h9", "--pp", "4", "--microbatches", "8"], "invalid choice: 'zb-h9'"),
    (["show", "--family", "gpipe", "--pp", "0", "--microbatches", "8"], "pp must be an integer >= 1"),
    (["show", "--family", "interleaved-1f1b", "--pp", "4", "--microbatches", "8",
      "--chunks", "1"], "needs chunks >= 2"),
    (["show", "--family", "gpipe", "--pp", "four", "--microbatches", "8"],
     "argument --pp: invalid int value: 'four'"),
    (["show", "--family", "gpipe", "--pp", "4"], "needs --microbatches"),
    (["show"], "give a SPEC, torch CSV or plan-json FILE"),
    (["show", "{good}", "--family", "gpipe"], "not both"),
    (["show", "{good}", "--pp", "3"], "--pp goes with --family"),
    (["export", "{good}", "--to", "pdf"], "invalid choice: 'pdf'"),
    (["show", "{good}", "--arrows"], "--arrows draws on the SVG timeline; add --svg OUT"),
    (["show", "{good}", "--svg", "{dir}"], "is a directory"),
    (["export", "{good}"], "required: --to"),
    (["export", "{good}", "--to", "torch-csv", "-o", "{dir}"], "is a directory"),
    (["frobnicate"], "invalid choice"),
    ([], "required: COMMAND"),
])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, needle):
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    (tmp_path / "junk.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    paths = {"bad": tmp_path / "bad.toml", "missing": tmp_path / "missing.toml",
             "dir": tmp_path, "junk": tmp_path / "junk.csv", "good": EXAMPLES / "zb-h1.toml"}
    code, out, err = run(capsys, *(a.format(**paths) for a in argv))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mpipe-verify"), err
    assert ": error: " in err and needle in err, err
    assert "Traceback" not in err


def test_failed_export_leaves_no_file(capsys, tmp_path):
    out = tmp_path / "x.csv"
    assert run(capsys, "export", "--family", "gpipe", "--pp", "0", "--microbatches", "2",
               "--to", "torch-csv", "-o", str(out))[0] == 2
    assert list(tmp_path.iterdir()) == []


def test_outputs_write_through_symlinks_and_fifos(capsys, tmp_path):
    """-o/--sarif follow a symlink (its target is replaced atomically, the link stays) and
    write into a FIFO (or a device, like /dev/stdout) instead of replacing it with a
    regular file."""
    import json
    import threading

    expected = run(capsys, "export", str(EXAMPLES / "zb-h1.toml"), "--to", "torch-csv")[1]
    target = tmp_path / "real" / "plan.csv"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    assert run(capsys, "export", str(EXAMPLES / "zb-h1.toml"), "--to", "torch-csv",
               "-o", str(link)) == (0, "", "")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert read_torch_csv(target) == parse_torch_csv(expected, "x.csv")
    assert sorted(p.name for p in target.parent.iterdir()) == ["plan.csv"]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    keep = tmp_path / "keep"  # a second name for the FIFO, to release a stuck reader
    os.link(fifo, keep)
    via = tmp_path / "via"
    via.symlink_to(fifo)
    for path, argv in ((fifo, ["export", str(EXAMPLES / "zb-h1.toml"), "--to",
                               "torch-csv", "-o"]),
                       (via, ["check", str(EXAMPLES / "zb-h1.toml"), "-q", "--sarif"])):
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
        reader.start()
        code = main([*argv, str(path)])
        reader.join(10)
        if reader.is_alive():  # nothing opened the FIFO: let the reader go, then fail
            os.close(os.open(keep, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(10)
        capsys.readouterr()
        assert code == 0 and fifo.is_fifo() and via.is_symlink(), path
        assert got and got[0], path
        if path == fifo:
            assert parse_torch_csv(got[0].decode(), "x.csv") == parse_torch_csv(expected,
                                                                                "x.csv")
        else:
            assert json.loads(got[0])["version"] == "2.1.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "keep", "link.csv",
                                                          "real", "via"]


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "export" in capsys.readouterr().out


# ---------------------------------------------------------------- the console script


def _script() -> str:
    found = shutil.which("mpipe-verify", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("mpipe-verify is not installed (pip install -e .)")
    return found


def test_console_script_runs_the_demo(tmp_path):
    """What ``make demo`` runs, in a fresh directory (``out/`` does not exist)."""
    exe = _script()
    show = subprocess.run([exe, "show", str(EXAMPLES / "zb-h1.toml")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert show.returncode == 0 and show.stderr == ""
    assert all(f"rank {r} " in show.stdout for r in range(4))
    export = subprocess.run([exe, "export", str(EXAMPLES / "zb-h1.toml"), "--to", "torch-csv",
                             "-o", "out/zb-h1.csv"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    assert (export.returncode, export.stdout, export.stderr) == (0, "", "")
    assert read_torch_csv(tmp_path / "out" / "zb-h1.csv") == with_torch_markers(
        lower(families.zb_h1(4, 8).derive()))


def test_console_script_bad_input(tmp_path):
    exe = _script()
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    for argv in (["show", "bad.toml"], ["export", "bad.toml", "--to", "chrome-trace"],
                 ["show", "--family", "gpipe", "--pp", "x", "--microbatches", "2"]):
        proc = subprocess.run([exe, *argv], capture_output=True, text=True, cwd=tmp_path,
                              timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_show_names_stuck_ranks(capsys, tmp_path):
    bad = tmp_path / "stuck.csv"
    bad.write_text("0F0,0B0\n1B0,1F0\n")
    code, out, _ = run(capsys, "show", str(bad))
    assert code == 0
    assert "rank 1 is stuck at compute step 0 (1B0)" in out


def test_show_times_sends_and_receives_and_states_a_blocked_run(capsys, tmp_path):
    """The grid runs the plan as written (timeline, as --svg does): each rank receives
    before it sends, so nothing past rank 0's first forward runs (it used to print
    "makespan 6" as if the transfers were free and unordered)."""
    dead = tmp_path / "dead.csv"
    dead.write_text("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
    code, out, err = run(capsys, "show", str(dead), "--width", "0")
    assert (code, err) == (0, "")
    assert "makespan" not in out and "1F0" not in out and "0B0" not in out.split("\n\n")[1]
    assert "stops at time 1: 2 of 2 ranks blocked (eager)" in out
    assert "rank 0 is blocked at position 1: 0RECV_B0 waits for rank 1" in out
    assert "rank 1 is blocked at position 0: 1RECV_F0 waits for rank 0" in out
    # a plan that completes: the same grid and figures as its compute-only schedule
    lowered = tmp_path / "zb.csv"
    assert run(capsys, "export", str(EXAMPLES / "zb-h1.toml"), "--to", "torch-csv",
               "-o", str(lowered))[0] == 0
    _, as_written, _ = run(capsys, "show", str(lowered), "--width", "0")
    _, from_spec, _ = run(capsys, "show", str(EXAMPLES / "zb-h1.toml"), "--width", "0")
    assert as_written.split("\n", 1)[1] == from_spec.split("\n", 1)[1]
    assert "makespan 27," in as_written and "blocked" not in as_written


@pytest.mark.parametrize("env, advised", [({}, False), ({"NUMPY_MADVISE_HUGEPAGE": "1"}, True)])
def test_the_command_asks_numpy_for_no_huge_pages_unless_the_caller_chose(env, advised):
    """``console_main`` turns numpy's huge-page advice off before the command runs, except
    where the caller set numpy's own ``NUMPY_MADVISE_HUGEPAGE``. The probe turns the advice
    on first; its command reads it back from numpy's switch (which returns its previous
    state)."""
    probe = ("import numpy as np\n"
             "core = getattr(np, '_core', None) or np.core\n"
             "switch = core.multiarray._set_madvise_hugepage\n"
             "switch(True)\n"
             "from mpipe_verified import cli\n"
             "cli.main = lambda: print(switch(True)) or 0  # what the command saw\n"
             "cli.console_main()\n")
    base = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**base, **env}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(advised)
