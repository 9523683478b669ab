"""The verification kernel's own CPU time, per property, in this process.

The plans of ``verify_vs_torch.py``: PyTorch's Interleaved1F1B with comms (v=2, m=4p) at
``--torch P`` and our lowered ``interleaved-1f1b`` export at ``--ours P``, each read
from its torch CSV text. ``verify`` (the untrusted passes) supplies the witness once;
then ``kernel.prove`` runs one property at a time, ``--repeat`` times (``gc`` off,
``time.process_time``, medians), in ``check``'s two halves (completeness and memory;
dependency, matching and deadlock), each on a fresh copy of the plan; the total is
printed beside the properties.

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


HALVES = (("completeness", "memory"), ("dependency", "matching", "deadlock"))


def profile(plan, repeat: int) -> dict:
    """Median CPU seconds per property; each half of ``check``'s split (its two
    processes) starts from a fresh copy of the plan, so what the kernel reads once per
    plan is counted in the first property of each half."""
    report = verify(plan)
    assert report.verified, report.status
    times: dict = {name: [] for name in kernel.PROPERTIES}
    gc.disable()
    for _ in range(repeat):
        for half in HALVES:
            fresh = attrs.evolve(plan)
            for name in half:
                t = time.process_time()
                verdict = kernel.prove(fresh, report.witness, sizes=report.sizes,
                                       properties=(name,))[name]
                times[name].append(time.process_time() - t)
                assert verdict.status == "proved", (name, verdict)
    gc.enable()
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", type=int, nargs="*", default=[64])
    parser.add_argument("--ours", type=int, nargs="*", default=[128])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| plan | ops | " + " | ".join(kernel.PROPERTIES) + " | total (CPU s) |")
    print("|---|---:|" + "---:|" * (len(kernel.PROPERTIES) + 1))
    for label, plan in plans(args):
        row = profile(plan, args.repeat)
        cells = " | ".join(f"{row[n]:.3f}" for n in kernel.PROPERTIES)
        print(f"| {label} | {plan.num_ops:,} | {cells} | {sum(row.values()):.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
