"""Where `mpipe-verify check FILE` spends its time: each stage of the check, run one after
another in this one process (no fork), wall seconds and the resident memory after it.

    python benchmarks/check_stages.py --ours 128        # our interleaved-1f1b export
    python benchmarks/check_stages.py FILE.csv

Stages, as `verify_split` runs them: start-up (importing the CLI), reading the file,
the op table, the kernel's reading of the plan (these before the fork), then the
parent's half (completeness, memory, matching, then the digest) and the child's half
(dependency, deadlock). Like the command, the collector is off and numpy advises no huge
pages. A profile, not a comparison: `verify_vs_torch.py` times the command itself.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", help="a torch CSV plan")
    ap.add_argument("--ours", type=int, metavar="P",
                    help="our interleaved-1f1b export at p=P (v=2, m=4p) instead of a file")
    args = ap.parse_args()
    if (args.file is None) == (args.ours is None):
        ap.error("give a FILE or --ours P")
    path = args.file
    if args.ours is not None:  # made in another process: this one starts clean
        path = os.path.join(tempfile.mkdtemp(), f"ours_p{args.ours}.csv")
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from verify_vs_torch import our_csv; "
                        "open(sys.argv[2], 'w', newline='').write(our_csv(int(sys.argv[3])))",
                        HERE, path, str(args.ours)], check=True)
    gc.disable()
    rows, clock = [], time.perf_counter()

    def stage(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        rows.append((name, now - clock, rss_mb()))
        clock = now
    from mpipe_verified import cli, kernel
    cli._without_huge_pages()
    from mpipe_verified.formats.torch_csv import read_torch_csv
    from mpipe_verified.question import Asked, Question
    from mpipe_verified.semantics import op_table
    from mpipe_verified.verify import _comm_properties, _local_properties
    stage("start-up")
    plan = read_torch_csv(path)
    stage("read")
    table = op_table(plan)
    stage("op table")
    kernel.read(plan)
    stage("kernel read")
    asked = Asked(plan, Question())  # the unit model, no limit, rendezvous
    _local_properties(asked, table, None)
    asked.digest()
    stage("parent half")
    _comm_properties(asked, table, None)
    stage("child half")
    print(f"{plan.num_ops} ops, {path}")
    for name, seconds, rss in rows:
        print(f"{name:>12} {seconds:7.2f} s  rss {rss:7.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
