"""mpipe-verify check vs PyTorch's own schedule simulator, on PyTorch's own schedules.

For PyTorch's ScheduleInterleaved1F1B with comms (v=2, m=4p) at p in {8, 16, 32, 64}:
time the whole ``mpipe-verify check FILE`` process (all five properties, Z3-backed, under
rendezvous) against ``torch.distributed.pipelining.schedules._simulate_comms_compute``
on the same file (hangs only, under weaker eager semantics; its CSV parsing is not
timed). Runs alternate ours/torch ``--repeat`` times per size; the medians' ratio is
printed per size, with the growth of our time per doubling of ops.

With ``--ours P ...``, the same for our own ``interleaved-1f1b`` plan (v=2, m=4p,
lowered, written as a torch CSV) at each p, and also ``mpipe-verify check --family
interleaved-1f1b`` with the same parameters, against checking that file
(``family/file``). ``--ours-only`` skips torch's own schedules; ``--no-torch`` skips
torch's simulator on our files (for the biggest sizes, where only our growth matters).

    python benchmarks/verify_vs_torch.py [--sizes 8 16 32 64] [--repeat 3]
    python benchmarks/verify_vs_torch.py --ours-only --ours 128 [--repeat 3]

Targets (issue #11): ratio <= 0.25 at p = 64 (torch's file) and <= 1.0 at our p = 128
file; growth <= 2.1x per doubling of ops up to 3*10^6 ops; family/file <= 1.
"""

from __future__ import annotations

import argparse
import math
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


def time_ours(*argv: str) -> float:
    t = time.perf_counter()
    done = subprocess.run([MPIPE, "check", *argv], capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"mpipe-verify check {' '.join(argv)} exited {done.returncode}:\n"
                         f"{done.stdout}{done.stderr}")
    return elapsed


def time_torch(text: str, p: int) -> float:
    order = torch_order(text)
    t = time.perf_counter()
    S._simulate_comms_compute(order, lambda s: s % p, 2 * p)
    return time.perf_counter() - t


def our_csv(p: int) -> str:
    """Our own interleaved-1f1b plan (v=2, m=4p), lowered, as torch CSV text."""
    from mpipe_verified.algebra.families import family
    from mpipe_verified.formats.torch_csv import format_torch_csv
    from mpipe_verified.lower import lower
    return format_torch_csv(lower(family("interleaved-1f1b", p, 4 * p, 2).derive()))


def measure(tmp: str, label: str, p: int, text: str, args) -> dict:
    path = os.path.join(tmp, f"{label}_p{p}.csv")
    with open(path, "w", newline="") as f:
        f.write(text)
    ops = sum(1 for line in text.splitlines() for c in line.split(",") if c)
    fam = ["--family", "interleaved-1f1b", "--pp", str(p), "--microbatches", str(4 * p),
           "--chunks", "2"]
    times: dict = {"ours": [], "torch": [], "family": []}
    for _ in range(args.repeat):  # alternating, so load changes hit all alike
        times["ours"].append(time_ours(path))
        if not args.no_torch:
            times["torch"].append(time_torch(text, p))
        if label == "ours":
            times["family"].append(time_ours(*fam))
    row = {k: statistics.median(v) if v else None for k, v in times.items()}
    return {"label": label, "p": p, "ops": ops, **row}


def report(rows: list) -> None:
    print(f"{'plan':>5} {'p':>4} {'ops':>8} {'ours_s':>8} {'torch_s':>8} {'ratio':>6} "
          f"{'growth':>13} {'family_s':>8} {'family/file':>11}")
    prev = {}
    for r in rows:
        last = prev.get(r["label"])
        growth = "" if last is None else (
            f"{(r['ours'] / last['ours']) ** (1 / math.log2(r['ops'] / last['ops'])):.2f}x/2x ops")
        torch_s, ratio = ("", "") if r["torch"] is None else (
            f"{r['torch']:.2f}", f"{r['ours'] / r['torch']:.2f}")
        fam, fam_ratio = ("", "") if r["family"] is None else (
            f"{r['family']:.2f}", f"{r['family'] / r['ours']:.2f}")
        print(f"{r['label']:>5} {r['p']:>4} {r['ops']:>8} {r['ours']:>8.2f} {torch_s:>8} "
              f"{ratio:>6} {growth:>13} {fam:>8} {fam_ratio:>11}")
        prev[r["label"]] = r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--ours", type=int, nargs="*", default=[],
                    help="also our own interleaved-1f1b plan (and --family) at these p")
    ap.add_argument("--ours-only", action="store_true", help="skip torch's own schedules")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip torch's simulator on our plans")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in [] if args.ours_only else args.sizes:
            text = torch_schedule_csv("Interleaved1F1B", p, 4 * p, 2, "compute_comms")
            rows.append(measure(tmp, "torch", p, text, argparse.Namespace(
                repeat=args.repeat, no_torch=False)))
        for p in args.ours:
            rows.append(measure(tmp, "ours", p, our_csv(p), args))
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
