"""Bad input to ``mpipe-verify`` (docs/semantics.md §6): exit 2, exactly one line on stderr
that names the file and, where the problem has a place, its 1-based row/line and column;
nothing on stdout (``check --json``: the error object), no traceback, and never exit 0.

Semantics decided here for ragged and empty rows of a torch CSV:

- **Ragged rows are legal.** Ranks run different numbers of steps (torch's own dumps have
  rows of different lengths, and idle cells, e.g. ZBV), so rows of unequal length and
  empty (idle) cells anywhere are accepted and judged on their merits.
- **An empty row is a rank with no ops**, exactly as torch's ``_load_csv`` reads it
  (``csv.reader`` yields ``[]``, torch stores an empty action list for that rank). It is
  accepted when the rest of the file is consistent (the placement skips that rank).
- **Rejected (exit 2):** rows that contradict each other — one rank's row wrapped onto two
  lines puts a stage on two rows ("stage 0 appears on rows 1 and 2", with the row and
  column of the second appearance); rows that leave a gap in the stages; a file whose
  rows are all empty or all idle (no actions at all); and anything malformed inside a
  cell or in the CSV quoting.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from mpipe_verified.cli import main
from mpipe_verified.ir import Schedule

SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")

GOOD_TOML = '[schedule]\nfamily = "1f1b"\npp = 2\nmicrobatches = 2\n'

# name -> (file bytes, or None for "not created" / "a directory"; expected prefix after
# "mpipe-verify: error: <path>", i.e. ":<line>[:<col>]: message start")
CASES = {
    "truncated.csv": (b"0F0,0SEND_F0,0B0\r\n1RECV_F0,1F0,1B", ":2:3: expected a microbatch index"),
    "truncated_quote.csv": (b'0F0,0B0\r\n1F0,"1B', ":2: malformed CSV"),
    "garbled_quote.csv": (b'0F0,0B0\r\n1F0,"1B0"x\r\n', ":2: malformed CSV"),
    "garbled_cell.csv": (b"0F0,0B0\r\n1F\"0,1B0\r\n", ":2:1: expected an action like"),
    "semicolons.csv": (b"0F0;0B0\r\n", ":1:1: expected an action like"),
    "tabs.csv": (b"0F0,0B0\r\n1F0\t1B0\r\n", ":2:1: expected an action like"),
    "unknown_action.csv": (b"0F0,0X0,0B0\r\n1F0,1B0\r\n", ":1:2: expected an action like"),
    "unknown_word.csv": (b"0F0,0B0\r\n1F0,1FORWARD0\r\n", ":2:2: expected an action like"),
    "missing_mb.csv": (b"0F0,0B\r\n", ":1:2: expected a microbatch index after 0B"),
    "empty.csv": (b"", ": empty file"),
    "only_empty_rows.csv": (b"\r\n\r\n\r\n", ": no actions in any row"),
    "only_idle_cells.csv": (b" , ,\r\n,\r\n", ": no actions in any row"),
    "wrapped_row.csv": (b"0F0,0B0\r\n0F1,0B1\r\n1F0,1B0,1F1,1B1\r\n",
                        ":2:1: stage 0 appears on rows 1 and 2"),
    "stage_gap.csv": (b"0F0,0B0\r\n\r\n2F0,2B0\r\n", ": stage 1 appears on no row"),
    "non_integer.csv": (b"0F0,0Bx\r\n1F0,1B0\r\n", ":1:2: expected an action like"),
    "float_index.csv": (b"0F0,0B0.5\r\n", ":1:2: expected an action like"),
    "negative.csv": (b"0F0,-1B0\r\n1F0,1B0\r\n", ":1:2: expected an action like"),
    "leading_zero.csv": (b"0F0,0B00\r\n", ":1:2: expected an action like"),
    "huge_mb.csv": (b"0F0,0B99999999999999999999\r\n1F0,1B0\r\n",
                    ":1:2: microbatch index 99999999999999999999 in"),
    "huge_stage.csv": (b"0F0,0B0\r\n123456789012F0\r\n", ":2:1: stage index 123456789012 in"),
    "huge_digits.csv": (b"0F" + b"9" * 5000 + b"\r\n", ":1:1: microbatch index 9999"),
    "unicode_digits.csv": ("0F0,0B\u0661\r\n".encode(), ":1:2: expected an action like"),
    "binary.csv": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe junk", ":1: not UTF-8 text (byte 0x89)"),
    "binary_line3.csv": (b"0F0,0B0\r\n1F0,1B0\r\n\xff\xfe\x00", ":3: not UTF-8 text (byte 0xff)"),
    "nul.csv": (b"0F0,0B0\r\n1F0\x00,1B0\r\n", ":2:1: expected an action like"),
    "bom.csv": (b"\xef\xbb\xbf0F0,0B0\r\n", ":1:1: expected an action like"),
    "overlap_comm.csv": (b"(0F0;0SEND_F0)OVERLAP_F_B\r\n", ":1:1: OVERLAP_F_B may only combine"),
    "no_peer.csv": (b"0SEND_F0,0F0\r\n", ":1:1: 0SEND_F0: stage 0 is the last"),
    "directory.csv": (None, ": is a directory"),
    "missing.csv": (None, ": no such file"),
    "malformed.toml": (b'[schedule\nfamily = "1f1b"\n', ":1:10: malformed TOML"),
    "malformed_value.toml": (b'[schedule]\nfamily = "1f1b"\npp = = 4\n', ":3:6: malformed TOML"),
    "wrong_type.toml": (b'[schedule]\nfamily = "1f1b"\npp = "four"\nmicrobatches = 8\n',
                        ":3:1: schedule.pp must be an integer >= 1, got str 'four'"),
    "wrong_type_limit.toml": (GOOD_TOML.encode() + b'[memory]\nlimit = "x"\n',
                              ":6:1: memory.limit must be a number >= 0"),
    "wrong_type_family.toml": (b'[schedule]\nfamily = 3\npp = 4\nmicrobatches = 8\n',
                               ":2:1: unknown family 3"),
    "binary.toml": (b"\x00\x01\x02", ":1: binary data (NUL byte)"),
    "empty.toml": (b"", ":1: missing [schedule] table"),
}


def make(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    data, _ = CASES[name]
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    elif name.startswith("directory"):
        path.mkdir()
    return path


def assert_one_line(err: str, path: pathlib.Path, expected: str) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    prefix = f"mpipe-verify: error: {path}{expected}"
    assert err.startswith(prefix), (err, prefix)


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_bad_input_exits_2_with_one_line(capsys, tmp_path, name):
    path = make(tmp_path, name)
    for extra in ([], ["--json"]):
        code = main(["check", str(path), *extra])
        out, err = capsys.readouterr()
        assert code == 2
        assert_one_line(err, path, CASES[name][1])
        assert_error_object(out, err, extra)


def assert_error_object(out: str, err: str, extra) -> None:
    """``--json`` prints the bad input's error object (the stderr line's message), plain
    text nothing."""
    if not extra:
        assert out == ""
        return
    doc = json.loads(out)
    assert (doc["status"], doc["exit_code"]) == ("error", 2)
    assert err.strip() == f"mpipe-verify: error: {doc['error']}"


@pytest.mark.parametrize("name", ["truncated.csv", "binary.csv", "directory.csv",
                                  "malformed.toml", "wrong_type.toml"])
def test_export_bad_input_exits_2_and_writes_nothing(capsys, tmp_path, name):
    path = make(tmp_path, name)
    out_file = tmp_path / "out" / "plan.csv"
    code = main(["export", str(path), "--to", "torch-csv", "-o", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert_one_line(err, path, CASES[name][1])
    assert not out_file.exists()


@pytest.mark.parametrize("name", ["truncated.csv", "binary.csv", "missing.csv",
                                  "malformed.toml", "directory.csv"])
def test_console_script_bad_input_is_one_line_without_traceback(tmp_path, name):
    path = make(tmp_path, name)
    for cmd in (["check", str(path), "--json"], ["export", str(path), "--to", "torch-csv"]):
        proc = subprocess.run([str(SCRIPT), *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert_one_line(proc.stderr, path, CASES[name][1])
        assert_error_object(proc.stdout, proc.stderr, cmd[-1:] if cmd[0] == "check" else [])


def test_bad_options_exit_2(capsys, tmp_path):
    good = tmp_path / "good.csv"
    good.write_bytes(b"0F0,0B0\r\n")
    for argv, needle in ((["--memory-limit", "lots"], "invalid float value: 'lots'"),
                         (["--comm-model", "buffered"], "invalid choice: 'buffered'"),
                         (["--solver-rlimit", "1.5"], "invalid int value: '1.5'"),
                         (["--format", "xml"], "invalid choice: 'xml'")):
        code = main(["check", str(good), *argv])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


# ---------------------------------------------------------------- ragged rows: accepted


RAGGED_OK = {
    # different row lengths: rank 1 has trailing idle cells, rank 0 none
    "ragged.csv": b"0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1,,\r\n",
    # idle cells in the middle of a row and rows of 3 different lengths
    "idle_cells.csv": b"0F0,,0F1,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n",
    # bare \n line ends and no final newline
    "lf.csv": b"0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1",
    # a trailing comma (one idle cell)
    "trailing_comma.csv": b"0F0,0B0,\r\n1F0,1B0\r\n",
    # an empty row is a rank with no ops (torch's _load_csv reads it the same way)
    "empty_row.csv": b"0F0,0B0\r\n\r\n1F0,1B0\r\n",
}


@pytest.mark.parametrize("name", sorted(RAGGED_OK))
def test_ragged_rows_that_are_otherwise_fine_are_accepted(capsys, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(RAGGED_OK[name])
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), out
    assert "VERIFIED" in out.splitlines()[0]
    ranks = 3 if name == "empty_row.csv" else 2
    assert f"({ranks} ranks," in out.splitlines()[0]


def test_ragged_torch_dump_is_accepted(capsys, tmp_path):
    """A real torch dump whose rows differ in length (ZBV pads with idle cells)."""
    from torch_fixtures import torch_schedule_csv
    text = torch_schedule_csv("ZBVZeroBubble", 4, 4, 2, "compute_only")
    assert len({len(line.split(",")) for line in text.splitlines()}) > 1
    path = tmp_path / "zbv.csv"
    path.write_text(text, newline="")
    assert main(["check", str(path)]) == 0


# ---------------------------------------------------------------- a 10-byte denial of service


def test_a_large_microbatch_index_does_not_hang_check(tmp_path):
    """Regression guard: a 10-byte file ``0F100000`` is accepted by the parser (indices
    up to ``MAX_INDEX = 10**6`` are allowed) and the microbatch count is inferred as
    100001, so 200001 completeness findings exist. Earlier the verifier confirmed each
    finding with its own Z3 solver (~2 minutes and 40 MB of JSON for this file, ~20 minutes
    for ``0F1000000``); a CI gate must not be stalled by a tiny input. It must answer
    (exit 1 or 2, no traceback); the subprocess timeout is a hang guard, half the
    regression's two minutes (the check takes a fraction of a second)."""
    path = tmp_path / "big_index.csv"
    path.write_bytes(b"0F100000\r\n")
    started = time.monotonic()
    try:
        proc = subprocess.run([str(SCRIPT), "check", str(path), "--json"],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpipe-verify check {path.name} (10 bytes) still running after "
                    f"{time.monotonic() - started:.0f} s")
    assert "Traceback" not in proc.stderr, proc.stderr[-500:]
    assert proc.returncode in (1, 2)
    assert proc.returncode != 2 or proc.stderr.count("\n") == 1


INDEX_CSV = ("0F999999,4F0,0B999999\n1F999999,5F7,1B999999\n2F999999,6F3,2B999999\n"
             "3F999999,7F1,3B999999\n")


def _check_peak(path) -> tuple[str, int]:
    """``check -q`` on ``path`` in a process of its own: its exit code and the memory
    ``check`` itself allocated at its peak (tracemalloc around ``main``, in bytes)."""
    code = ("import tracemalloc; from mpipe_verified.cli import main; tracemalloc.start(); "
            f"c = main(['check', {str(path)!r}, '-q']); "
            "print(c, tracemalloc.get_traced_memory()[1])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    exit_code, peak = proc.stdout.split()
    return exit_code, int(peak)


@pytest.mark.parametrize("name", ["index.csv", "index.json"])
def test_memory_does_not_grow_with_the_indices(tmp_path, name):
    """A few ops whose microbatch index is 999999 (a million microbatches, eight stages)
    take ``check`` no more memory than the same ops at index 0 (it never enumerates the
    microbatches a plan cannot hold): well under a megabyte more, not a million units'
    worth. The small file answers with its violations, exit 1."""
    from mpipe_verified.formats.plan_json import format_plan_json
    from mpipe_verified.formats.torch_csv import parse_torch_csv
    peaks = []
    for text in (INDEX_CSV, INDEX_CSV.replace("999999", "0")):
        path = tmp_path / (name if "999999" in text else "small_" + name)
        if name.endswith(".csv"):
            path.write_text(text)
        else:  # the same ops as a plan-json schedule
            schedule = parse_torch_csv(text, "x")
            path.write_text(format_plan_json(Schedule(
                schedule.placement, schedule.num_microbatches, schedule.programs)))
        exit_code, peak = _check_peak(path)
        assert exit_code == "1"
        peaks.append(peak)
    big, small = peaks
    assert big < small + 1_000_000, (big, small)


# ---------------------------------------------------------------- non-finite memory limits


@pytest.mark.parametrize("limit", ["nan", "inf", "-inf", "1e400"])
def test_non_finite_memory_limit_exits_2(capsys, limit):
    """PACKAGE BUG (fails until fixed): ``--memory-limit`` is parsed with ``type=float``,
    so ``nan``/``inf``/``-inf``/``1e400`` reach the verifier, whose SMT emission
    (then ``Fraction(v)``) raises ``ValueError: cannot convert NaN to
    integer ratio`` / ``OverflowError: cannot convert Infinity to integer ratio``. The
    console script then prints a traceback and exits 1 (the code for "violated"). The
    same values in a spec's ``[memory] limit`` are rejected cleanly ("must be a number
    >= 0"), so the flag should be too: exit 2, one line."""
    code = main(["check", "--family", "1f1b", "--pp", "2", "--microbatches", "2",
                 f"--memory-limit={limit}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--memory-limit" in err and "Traceback" not in err, err


def test_non_finite_memory_limit_console_script_has_no_traceback():
    """The same bug through the installed script (currently: traceback, exit 1)."""
    proc = subprocess.run([str(SCRIPT), "check", "--family", "1f1b", "--pp", "2",
                           "--microbatches", "2", "--memory-limit", "nan"],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-300:]
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "1e400", "0", "-1"])
def test_laws_timeout_must_be_finite_and_positive(capsys, timeout):
    """``laws --timeout nan`` (or inf) used to reach ``int(timeout * 1000)`` and end in a
    traceback; it is a usage error: exit 2, one line, nothing proved."""
    code = main(["laws", "--law", "seq_assoc", f"--timeout={timeout}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--timeout must be" in err, err
