"""The cost per op of ``mpipe-verify check`` across families, side by side in one run.

Each family named by ``--families`` is built at about the same op count (``--ops N``, its
lowered plan's ops; ``--pp P`` ranks, the microbatches chosen to reach N), then the whole
``mpipe-verify check --family NAME ... --expand -q`` process is timed (op by op, every
verdict from the kernel; ``--expand`` so no family is answered by its laws instead).
Runs alternate between the families ``--repeat`` times; the medians per op are printed
with their ratio to the first family's (default: interleaved-1f1b). An op is a step of a
rank's program, so an overlapped pair (DualPipe's ``OVERLAP_F_B``) or a group of transfers
is one op; the medians per *action* (each compute and each transfer end or collective call,
an overlap counted as its members) are printed beside them, with their ratio too.

Any family name ``mpipe-verify check --family`` takes works; ``interleaved-1f1b`` gets
``--chunks V`` and ``seq1f1b`` ``--seq-chunks S`` (the defaults of this script: 2 each).

    python benchmarks/per_op_cost.py --families interleaved-1f1b seq1f1b dualpipe [--ops 100000]

Target: ``dualpipe`` and ``seq1f1b`` each cost at most 1.10x interleaved-1f1b per op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mpipe_verified.errors import ParameterError  # noqa: E402
from mpipe_verified.algebra.families import family  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402


def family_args(name: str, args) -> list[str]:
    """The options this family takes besides ``--pp`` and ``--microbatches``."""
    if name == "interleaved-1f1b":
        return ["--chunks", str(args.chunks)]
    if name == "seq1f1b":
        return ["--seq-chunks", str(args.seq_chunks)]
    return []


def actions_of(plan) -> int:
    """The plan's steps with an overlap or a group counted as its members (so each
    compute, transfer end, collective call or move once)."""
    return sum(len(getattr(step, "ops", (step,))) for program in plan.programs
               for step in program)


def plan_of(name: str, pp: int, m: int, args):
    options = dict(zip(*[iter(family_args(name, args))] * 2))
    chunks = options.get("--chunks")
    seq = options.get("--seq-chunks")
    term = family(name, pp, m, None if chunks is None else int(chunks),
                  seq_chunks=None if seq is None else int(seq))
    return lower(term.derive())


def ops_of(name: str, pp: int, m: int, args) -> int:
    return plan_of(name, pp, m, args).num_ops


def sized(name: str, args) -> tuple[int, int]:
    """``(microbatches, ops)``: the microbatch count whose plan is nearest ``args.ops``
    (ops grow linearly in microbatches: measured at two counts, then solved; any count
    works, the round families evening out a short last round)."""
    low = 2 * args.pp
    a, b = ops_of(name, args.pp, low, args), ops_of(name, args.pp, 2 * low, args)
    per = max((b - a) / low, 1e-9)
    m = max(low, round(low + (args.ops - a) / per))
    for m in range(m, m + 2 * args.pp):  # the next count the family takes (dualpipe: even)
        try:
            return m, ops_of(name, args.pp, m, args)
        except ParameterError:
            continue
    raise SystemExit(f"{name}: no microbatch count from {m - 2 * args.pp + 1} to {m} builds")


def time_check(name: str, m: int, args) -> float:
    argv = [sys.executable, "-m", "mpipe_verified.cli", "check", "--family", name, "--pp",
            str(args.pp), "--microbatches", str(m), *family_args(name, args), "--expand",
            "-q"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    t = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:])} exited {done.returncode}:\n"
                         f"{done.stdout}{done.stderr}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["interleaved-1f1b", "seq1f1b"])
    ap.add_argument("--ops", type=int, default=100_000, help="ops per plan (about)")
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=2, help="interleaved-1f1b's chunks")
    ap.add_argument("--seq-chunks", type=int, default=2, help="seq1f1b's chunks per sample")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sizes = {name: sized(name, args) for name in args.families}
    times: dict[str, list[float]] = {name: [] for name in args.families}
    for _ in range(args.repeat):
        for name in args.families:
            times[name].append(time_check(name, sizes[name][0], args))
    base = args.families[0]
    actions = {n: actions_of(plan_of(n, args.pp, sizes[n][0], args)) for n in args.families}
    per_op = {n: statistics.median(times[n]) / sizes[n][1] for n in args.families}
    per_action = {n: statistics.median(times[n]) / actions[n] for n in args.families}
    print(f"{'family':<20} {'microbatches':>12} {'ops':>9} {'actions':>9} {'median s':>9} "
          f"{'us/op':>7} {'ratio':>6} {'us/action':>9} {'ratio':>6}")
    for n in args.families:
        print(f"{n:<20} {sizes[n][0]:>12} {sizes[n][1]:>9} {actions[n]:>9} "
              f"{statistics.median(times[n]):>9.2f} {per_op[n] * 1e6:>7.2f} "
              f"{per_op[n] / per_op[base]:>6.2f} {per_action[n] * 1e6:>9.2f} "
              f"{per_action[n] / per_action[base]:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
