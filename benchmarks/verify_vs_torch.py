"""mpipe-verify check vs PyTorch's own schedule simulator, on PyTorch's own schedules.

For PyTorch's ScheduleInterleaved1F1B with comms (v=2, m=4p) at p in {8, 16, 32, 64}:
time the whole ``mpipe-verify check FILE`` process (all five properties, Z3-backed, under
rendezvous) against ``torch.distributed.pipelining.schedules._simulate_comms_compute``
on the same file (hangs only, under weaker eager semantics; its CSV parsing is not
timed). Runs alternate ours/torch ``--repeat`` times per size; the medians' ratio is
printed per size, with the growth of our time per doubling of ops.

    python benchmarks/verify_vs_torch.py [--sizes 8 16 32 64] [--repeat 3]

Targets (issue #3): ratio <= 0.5 at p = 64; near-linear growth (2x ops -> <= 2.3x time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
warnings.filterwarnings("ignore")

from torch_fixtures import torch_schedule_csv  # noqa: E402  (torch's API, no process group)
from torch.distributed.pipelining import schedules as S  # noqa: E402

MPIPE = os.path.join(os.path.dirname(sys.executable), "mpipe-verify")
IGNORED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


def torch_order(text: str) -> dict:
    rows = [[S._Action.from_str(c) for c in line.split(",")] for line in text.splitlines()]
    return {r: [a for a in row if a is not None and a.computation_type.value not in IGNORED]
            for r, row in enumerate(rows)}


def time_ours(path: str) -> float:
    t = time.perf_counter()
    done = subprocess.run([MPIPE, "check", path], capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"mpipe-verify check {path} exited {done.returncode}:\n{done.stdout}"
                         f"{done.stderr}")
    return elapsed


def time_torch(text: str, p: int) -> float:
    order = torch_order(text)
    t = time.perf_counter()
    S._simulate_comms_compute(order, lambda s: s % p, 2 * p)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.sizes:
            text = torch_schedule_csv("Interleaved1F1B", p, 4 * p, 2, "compute_comms")
            path = os.path.join(tmp, f"interleaved_p{p}.csv")
            with open(path, "w", newline="") as f:
                f.write(text)
            ops = sum(1 for line in text.splitlines() for c in line.split(",") if c)
            ours, theirs = [], []
            for _ in range(args.repeat):
                ours.append(time_ours(path))
                theirs.append(time_torch(text, p))
            rows.append((p, ops, statistics.median(ours), statistics.median(theirs)))
    print(f"{'p':>4} {'ops':>8} {'ours_s':>8} {'torch_s':>8} {'ratio':>6} {'growth':>7}")
    prev = None
    for p, ops, ours, theirs in rows:
        growth = "" if prev is None else f"{ours / prev[0]:.2f}x/{ops / prev[1]:.1f}x"
        print(f"{p:>4} {ops:>8} {ours:>8.2f} {theirs:>8.2f} {ours / theirs:>6.2f} {growth:>7}")
        prev = (ours, ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
