"""The example end to end: ``mpipe-run`` starts the ranks, the script builds, verifies and
runs the plan, rank 0 prints ``step K loss X`` (``[rank0]:``-prefixed by ``mpipe-run``)
and the loss falls. The scripts in docs/executor.md's evaluation and several-encoders
sections run as written and their losses fall (the example's ``--audio`` model is the one
``test_executor.py`` checks gradients of)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MPIPE_RUN = os.path.join(os.path.dirname(sys.executable), "mpipe-run")


def test_example_trains_with_transpose_on_two_ranks():
    done = subprocess.run(
        [MPIPE_RUN, "--nproc", "2", "--backend", "gloo",
         os.path.join(ROOT, "examples", "train_tiny_mllm.py"), "--schedule", "transpose",
         "--mode", "owner", "--steps", "6"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "plan verified" in done.stdout
    losses = [float(x) for x in re.findall(r"^\[rank0\]:step \d+ loss ([0-9.]+)$",
                                           done.stdout, re.M)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, done.stdout


SNIPPETS = {"## Evaluation: forward-only plans": r"eval loss ([0-9.]+)",
            "## Several encoders, and sinks": r"step \d+ loss ([0-9.]+)"}


@pytest.mark.parametrize("heading", sorted(SNIPPETS))
def test_the_executor_docs_scripts_run_as_written(tmp_path, heading):
    text = open(os.path.join(ROOT, "docs", "executor.md")).read()
    section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    script = tmp_path / "snippet.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    done = subprocess.run([MPIPE_RUN, "--nproc", "2", "--backend", "gloo", str(script)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(SNIPPETS[heading], done.stdout)]
    assert len(losses) >= 3 and losses == sorted(losses, reverse=True), done.stdout


def example_grads_match(nproc: int, flags: list[str]) -> str:
    """Run the example with ``--check-grads`` on ``nproc`` gloo ranks; assert that rank 0
    reports a match (max abs diff at most 1e-5); return its output."""
    done = subprocess.run(
        [MPIPE_RUN, "--nproc", str(nproc), "--backend", "gloo",
         os.path.join(ROOT, "examples", "train_tiny_mllm.py"), *flags, "--check-grads"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.findall(r"^\[rank0\]:grads match a single-process run: max abs diff (\S+)$",
                       done.stdout, re.M)
    assert len(found) == 1 and float(found[0]) <= 1e-5, done.stdout
    return done.stdout


def test_example_checks_grads_of_two_replicas_of_a_two_rank_pipeline():
    out = example_grads_match(4, ["--schedule", "zb-h1", "--dp", "2", "--steps", "1"])
    assert "(2 pipeline x 2 data-parallel)" in out, out


@pytest.mark.parametrize("nproc, flags", [
    (2, ["--schedule", "transpose", "--mode", "owner", "--clip", "1.0"]),
    (4, ["--schedule", "zb-h1", "--dp", "2"]),
    (2, ["--schedule", "dualpipe", "--clip", "1.0"]),  # two pipelines over one model
    (4, ["--schedule", "chimera", "--dp", "2"]),
])
def test_example_checks_grads_of_a_real_training_loop(nproc, flags):
    """Padded captions (ignore_index), a BatchNorm in the encoder, bf16 autocast, global
    clipping: every gradient after the first step equals one process's. Also with two
    pipelines over one model (the encoder, with its BatchNorm, in the replicated model
    stage 0), and those under data parallelism."""
    example_grads_match(nproc, [*flags, "--steps", "2", "--pad", "--batchnorm", "--bf16"])


def test_example_refuses_a_dp_that_does_not_divide_the_world():
    done = subprocess.run(
        [MPIPE_RUN, "--nproc", "3", "--backend", "gloo",
         os.path.join(ROOT, "examples", "train_tiny_mllm.py"), "--dp", "2"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--dp 2 does not divide the world of 3 processes" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
