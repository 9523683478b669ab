"""The verification kernel's own CPU time, per property, in this process.

The plans of ``verify_vs_torch.py``: PyTorch's Interleaved1F1B with comms (v=2, m=4p) at
``--torch P`` and our lowered ``interleaved-1f1b`` export at ``--ours P``, each read
from its torch CSV text. ``verify`` (the untrusted passes) supplies the witness once;
then, ``--repeat`` times (``gc`` off, ``time.process_time``, medians), in ``check``'s two
halves, each on a fresh copy of the plan: ``kernel.Sizes.of`` (the unit model), then
``kernel.prove`` of completeness and memory; ``kernel.prove`` of dependency, matching
and deadlock. ``witness`` is the validation of the witness's numbers
(``kernel.Witness``). The total is printed beside the columns.

    python benchmarks/kernel_profile.py [--torch 64] [--ours 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import attrs

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
warnings.filterwarnings("ignore")

from mpipe_verified import kernel  # noqa: E402
from mpipe_verified.formats.torch_csv import parse_torch_csv  # noqa: E402
from mpipe_verified.ir import PROPERTIES  # noqa: E402
from mpipe_verified.semantics import UNIT_MEMORY  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402


def plans(args) -> list:
    out = []
    if args.torch:
        from torch_fixtures import torch_schedule_csv
        for p in args.torch:
            text = torch_schedule_csv("Interleaved1F1B", p, 4 * p, 2, "compute_comms")
            out.append((f"torch p={p}", parse_torch_csv(text, "torch.csv")))
    if args.ours:
        from verify_vs_torch import our_csv
        for p in args.ours:
            out.append((f"ours p={p}", parse_torch_csv(our_csv(p), "ours.csv")))
    return out


HALVES = (("sizes", "completeness", "memory"), ("dependency", "matching", "deadlock"))
COLUMNS = ("witness", "sizes") + PROPERTIES


def profile(plan, repeat: int) -> dict:
    """Median CPU seconds per column; each half of ``check``'s split (its two
    processes) starts from a fresh copy of the plan, so what the kernel reads once per
    plan is counted in the first column of each half."""
    report = verify(plan)
    assert report.verified, report.status
    fields = attrs.astuple(report.witness, recurse=False)
    times: dict = {name: [] for name in COLUMNS}
    gc.disable()
    for _ in range(repeat):
        t = time.process_time()
        witness = kernel.Witness(*fields)
        times["witness"].append(time.process_time() - t)
        for half in HALVES:
            fresh = attrs.evolve(plan)
            for name in half:
                t = time.process_time()
                if name == "sizes":
                    assert kernel.Sizes.of(fresh, UNIT_MEMORY) == report.sizes
                else:
                    verdict = kernel.prove(fresh, witness, sizes=report.sizes,
                                           properties=(name,))[name]
                    assert verdict.status == "proved", (name, verdict)
                times[name].append(time.process_time() - t)
    gc.enable()
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", type=int, nargs="*", default=[64])
    parser.add_argument("--ours", type=int, nargs="*", default=[128])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| plan | ops | " + " | ".join(COLUMNS) + " | total (CPU s) |")
    print("|---|---:|" + "---:|" * (len(COLUMNS) + 1))
    for label, plan in plans(args):
        row = profile(plan, args.repeat)
        cells = " | ".join(f"{row[n]:.3f}" for n in COLUMNS)
        print(f"| {label} | {plan.num_ops:,} | {cells} | {sum(row.values()):.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
