"""``mpipe-verify export`` vs ``check`` of the file it writes, in one run.

For our ``interleaved-1f1b`` plan (``v = 2``, ``m = 4p``) at each ``p`` of ``--sizes``:
time the whole ``mpipe-verify export --family interleaved-1f1b --pp P --microbatches 4P
--chunks 2 --to torch-csv -o FILE`` process (derive, lower, torch's markers, the verdict,
writing) against the whole ``mpipe-verify check FILE`` process on what it wrote. Runs
alternate export/check ``--repeat`` times per size; prints the medians of wall and CPU
seconds (user + system of the process and its children: the machine is shared, so wall
time moves with the load), the ratio export / check of each, and the growth of export's
wall time per doubling of ``p`` (4x the ops).

``export`` verifies what it writes; for a family instance the family's laws answer (as
for ``check --family``), proven once and then cached under ``XDG_CACHE_HOME``. The runs
use a private cache directory, filled by one untimed export first (the steady state);
``--cold`` empties it before every export, so each proves the laws anew.

    .venv/bin/python benchmarks/export_vs_check.py [--sizes 32 64 128] [--repeat 3] [--cold]

Targets: export of the p = 128 plan (784k ops) within 2x the time check takes on it, and
in under 10 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MPIPE = os.path.join(os.path.dirname(sys.executable), "mpipe-verify")


def timed(argv: list[str], env: dict) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one ``mpipe-verify`` process (exit 0 required)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([MPIPE, *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"mpipe-verify {' '.join(argv)} exited {done.returncode}:\n"
                         f"{done.stdout}{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="empty the laws' cache before every export")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="export_vs_check-")
    cache = os.path.join(work, "cache")
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| p | ops | export wall (s) | check wall (s) | wall ratio | export CPU (s) "
          "| check CPU (s) | CPU ratio | export growth |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    last = None
    try:
        for p in args.sizes:
            out = os.path.join(work, f"il-{p}.csv")
            export = ["export", "--family", "interleaved-1f1b", "--pp", str(p),
                      "--microbatches", str(4 * p), "--chunks", "2", "--to", "torch-csv",
                      "-o", out]
            check = ["check", "-q", out]
            if not args.cold:
                timed(export, env)  # fills the cache
            runs: dict[str, list[tuple[float, float]]] = {"export": [], "check": []}
            for _ in range(args.repeat):
                if args.cold:
                    shutil.rmtree(cache, ignore_errors=True)
                runs["export"].append(timed(export, env))
                runs["check"].append(timed(check, env))
            (ew, ec), (cw, cc) = ((statistics.median(w for w, _ in runs[k]),
                                   statistics.median(c for _, c in runs[k]))
                                  for k in ("export", "check"))
            with open(out, newline="") as f:
                ops = sum(sum(1 for cell in line.rstrip("\r\n").split(",") if cell)
                          for line in f)
            growth = f"{ew / last:.2f}x" if last else ""
            last = ew
            print(f"| {p} | {ops:,} | {ew:.2f} | {cw:.2f} | **{ew / cw:.2f}** | {ec:.2f} | "
                  f"{cc:.2f} | {ec / cc:.2f} | {growth} |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
