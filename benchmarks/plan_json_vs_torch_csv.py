"""Reading a plan-json file vs reading the torch CSV of the same plan, in one run.

    .venv/bin/python benchmarks/plan_json_vs_torch_csv.py [--sizes 8 16 32 64] [--repeat 5]

The plans are the lowered ``interleaved-1f1b`` plans (``v = 2``, ``m = 4p``), the plans of
``verify_vs_torch.py``. Each size is written in both formats; then ``parse_plan_json``
and ``parse_torch_csv`` (its one-pass reader for torch's plain form) read the text,
alternating, ``--repeat`` times each, with ``gc`` off as in ``mpipe-verify``. Prints the
file sizes, the median read times and the ratio plan-json / torch CSV (both readers
validate every field and build the same IR; plan-json spells every field out, so its
files are larger).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpipe_verified.algebra.families import family  # noqa: E402
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json  # noqa: E402
from mpipe_verified.formats.torch_csv import format_torch_csv, parse_torch_csv  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402


def timed(read, text: str, name: str) -> float:
    started = time.perf_counter()
    read(text, name)
    return time.perf_counter() - started


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    gc.disable()
    print("| p | ops | plan-json (KB) | torch CSV (KB) | plan-json (s) | torch CSV (s) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for p in args.sizes:
        plan = lower(family("interleaved-1f1b", p, 4 * p, 2).derive())
        texts = {"json": format_plan_json(plan), "csv": format_torch_csv(plan)}
        assert parse_plan_json(texts["json"], "x.json") == plan
        assert parse_torch_csv(texts["csv"], "x.csv") == plan
        runs: dict[str, list[float]] = {"json": [], "csv": []}
        for _ in range(args.repeat):
            runs["json"].append(timed(parse_plan_json, texts["json"], "x.json"))
            runs["csv"].append(timed(parse_torch_csv, texts["csv"], "x.csv"))
            gc.collect()
        js, cs = (statistics.median(runs[k]) for k in ("json", "csv"))
        print(f"| {p} | {plan.num_ops:,} | {len(texts['json']) / 1024:,.0f} | "
              f"{len(texts['csv']) / 1024:,.0f} | {js:.3f} | {cs:.3f} | {js / cs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
