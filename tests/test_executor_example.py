"""The example end to end: ``mpipe-run`` starts the ranks, the script builds, verifies and
runs the plan, rank 0 prints ``step K loss X`` (``[rank0]:``-prefixed by ``mpipe-run``)
and the loss falls."""

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
