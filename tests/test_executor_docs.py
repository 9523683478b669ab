"""The scripts of docs/executor.md's sections on the loss contract, pipeline groups, tied
parameters, frozen segments and timeouts run as written (from the repository root, on gloo processes) and
print what the docs say they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MPIPE_RUN = os.path.join(os.path.dirname(sys.executable), "mpipe-run")
DOCS = os.path.join(ROOT, "docs", "executor.md")


def scripts(heading: str) -> list[str]:
    """The ``python`` blocks of the section under ``heading`` (up to the next ``## ``)."""
    section = open(DOCS).read().split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run(tmp_path, script: str, nproc: int) -> subprocess.CompletedProcess:
    path = tmp_path / "snippet.py"
    path.write_text(script)
    command = ([MPIPE_RUN, "--nproc", str(nproc), "--backend", "gloo", str(path)] if nproc
               else [sys.executable, str(path)])
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_data_parallel_scripts_run_as_written(tmp_path):
    mesh, groups = scripts("## Pipeline groups and data parallelism")
    done = run(tmp_path, mesh, 4)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"^\[rank0\]:step \d loss ([0-9.]+)$", done.stdout,
                                           re.M)]
    assert len(losses) == 3 and losses == sorted(losses, reverse=True), done.stdout
    done = run(tmp_path, groups, 4)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = re.findall(r"global rank (\d) is plan rank (\d) of replica (\d): loss ([0-9.]+)",
                      done.stdout)
    assert sorted((g, p, r) for g, p, r, _ in seen) == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")], done.stdout
    assert len({loss for *_, loss in seen}) == 1  # every rank gets the whole batch's loss


@pytest.mark.parametrize("heading,printed", [
    ("## Tied parameters", "parameter '0.tok.weight' of stage 0 (rank 0) is also "
                           "'7.out.weight' of stage 1 (rank 1)"),
    ("## Frozen segments", "segment 'vision' is frozen in this plan (no backward)")])
def test_the_refusal_scripts_print_what_the_docs_say(tmp_path, heading, printed):
    (script,) = scripts(heading)
    done = run(tmp_path, script, 0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(printed), done.stdout
    assert " ".join(done.stdout.split()) in " ".join(open(DOCS).read().split())


def test_the_timeouts_script_runs_as_written(tmp_path):
    (script,) = scripts("## Timeouts")
    done = run(tmp_path, script, 2)
    assert done.returncode == 0 and "Error" not in done.stderr, done.stdout + done.stderr


def test_the_loss_contract_script_runs_as_written(tmp_path):
    """Padded targets, a BatchNorm encoder, clipping and AdamW on 2 ranks: three losses."""
    (script,) = scripts("## The loss contract")
    done = run(tmp_path, script, 2)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = re.findall(r"^\[rank0\]:step (\d) loss ([0-9.]+)$", done.stdout, re.M)
    assert [int(k) for k, _ in losses] == [0, 1, 2], done.stdout
    assert all(0 < float(v) < 10 for _, v in losses), done.stdout
