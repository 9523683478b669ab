"""`mpipe-verify tune` on the shipped multimodal examples, and transpose derive growth
(docs/tune.md).

Run:  python benchmarks/tune.py --quick       (the 8-rank searches, trainable and frozen:
                                               ~30 s on 2 shared cores, docs/tune.md)
      python benchmarks/tune.py --derive-only (derive growth only: ~1 minute)
      python benchmarks/tune.py --spec mllm_transpose_64.toml  (that search only)
      python benchmarks/tune.py               (all three: the 8-rank searches, the 64-rank
                                               search and derive growth: ~10-20 minutes)

1. For each example: the whole search (``tune.tune``, budget-free, its placement phase
   included), its wall time and its CPU time (this process and the solver processes it
   waited for: on a shared machine the wall time depends on the load, the CPU time
   less);
   the shipped plan's makespan (the spec as written), the tuned plan's and the baseline's
   (the fastest plain family with the encoder inline that fits), all on the spec's one
   model, and the speedups as ratios of those makespans (from one run); the best
   candidate without the placement phase (a heuristic ownership) beside the best with
   it, and each placement solve (Z3's status, its objective, the plan's makespan, time).
2. ``Transpose.derive`` process time (min of 3) at p = 64, 128, 256 with m = 128
   (interleaved 1F1B body, 2 chunks, owner mode, cost ownership): the ops double with
   each doubling of p, so linear time means a ratio of 2. Measured with Python's cyclic
   collector off (as ``mpipe-verify`` runs: ``cli.console_main``) and on.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import resource
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpipe_verified.algebra.transpose import transpose_family  # noqa: E402
from mpipe_verified.comparison import faster  # noqa: E402
from mpipe_verified.formats.spec import load_spec  # noqa: E402
from mpipe_verified.tune import tune  # noqa: E402

EXAMPLES = ROOT / "examples"


def _cpu() -> float:
    """CPU seconds of this process and of its children that were waited for."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def search(name: str) -> None:
    spec = load_spec(EXAMPLES / name)
    start, cpu = time.monotonic(), _cpu()
    result = tune(spec)
    seconds, cpu = time.monotonic() - start, _cpu() - cpu
    own = next(t for t in result.tried if t.order == 0)
    best, base = result.best.tried, result.baseline.tried if result.baseline else None
    print(f"| {name} | {len(result.tried)} | {seconds:.1f} | {cpu:.1f} | {own.makespan:,.1f} "
          f"| {best.makespan:,.1f} ({best.candidate.label}, {best.peak:.1f} GB, "
          f"{result.best.status}) | {faster(best.makespan, own.makespan)} "
          f"| {base.makespan:,.1f} ({base.candidate.label}) "
          f"| {faster(best.makespan, base.makespan)} |", flush=True)
    heuristic = min((t for t in result.tried if t.fits and t.candidate.ownership != "given"),
                    key=lambda t: (t.makespan, t.order))
    print(f"  best without the placement phase: {heuristic.makespan:,.1f} "
          f"({heuristic.candidate.label}); with it {best.makespan:,.1f}, "
          + ("the same" if heuristic.makespan == best.makespan else
             f"{heuristic.makespan / best.makespan:.4f}x faster"), flush=True)
    for p in result.placements:
        s = p.solution
        print(f"  placement of {p.group}: {s.status}, "
              + ("no assignment" if s.owners is None else
                 f"largest overflow {float(s.top):.1f}, makespan "
                 + ("-" if p.tried is None else f"{p.tried.makespan:,.1f}"))
              + f" ({s.seconds:.1f} s)", flush=True)
    print("  Pareto front: " + "; ".join(
        f"{t.candidate.label} {t.makespan:,.1f} ms / {t.peak:.1f} GB"
        + ("" if t.fits else " (over the limit)") for t in result.pareto), flush=True)


def _derive_time(p: int, collector: bool) -> tuple[float, int]:
    times = []
    for _ in range(3):
        term = transpose_family(p, 128, 2, body="interleaved-1f1b", mode="owner",
                                ownership="cost", costs=1.3)
        gc.collect()
        if not collector:
            gc.disable()
        t0 = time.process_time()
        schedule = term.derive()
        times.append(time.process_time() - t0)
        gc.enable()
        ops = sum(map(len, schedule.programs))
        del schedule
    return min(times), ops


def derive_growth() -> None:
    print("| p | m | ops | derive, collector off (s) | growth | derive, collector on (s) "
          "| growth |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    last = None
    for p in (64, 128, 256):
        off, ops = _derive_time(p, False)
        on, _ = _derive_time(p, True)
        grow = ("", "") if last is None else (f"{off / last[0]:.2f}x", f"{on / last[1]:.2f}x")
        print(f"| {p} | 128 | {ops:,} | {off:.2f} | {grow[0]} | {on:.2f} | {grow[1]} |",
              flush=True)
        last = (off, on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="the 8-rank searches only (no 64-rank search, no derive growth)")
    ap.add_argument("--derive-only", action="store_true")
    ap.add_argument("--spec", action="append", metavar="NAME",
                    help="search only this example (repeatable; no derive growth)")
    args = ap.parse_args()
    print(f"# {os.cpu_count()} cores, load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    if not args.derive_only:
        names = ("mllm_transpose.toml", "mllm_transpose_frozen.toml")
        if args.spec:
            names = tuple(args.spec)
        elif not args.quick:
            names += ("mllm_transpose_64.toml",)
        print("| spec | tried | tune wall (s) | tune CPU (s) | shipped (ms) | tuned (ms) "
              "| tuned than shipped | inline baseline (ms) | tuned than baseline |")
        print("|---|---:|---:|---:|---:|---|---:|---|---:|")
        for name in names:
            search(name)
        print()
    if not (args.quick or args.spec):
        derive_growth()
    print("# load average at the end "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)


if __name__ == "__main__":
    main()
