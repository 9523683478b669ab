"""Reading a torch CSV, the plan digest and ``mpipe-verify``'s start-up: this tree against
another revision of the package, side by side.

The revision (``--base``, default ``main``) is copied with ``git archive`` into a temporary
directory. On our lowered ``interleaved-1f1b`` plan (v=2, m=4p, written as a torch CSV),
each run is one fresh process per side, alternating: CPU seconds of ``parse_torch_csv``
on the file's text and of ``verify.plan_digest`` on the plan it read (``gc`` off, as in
``mpipe-verify``), and of the start-up ``import mpipe_verified.cli`` (the process's
own CPU time, with numpy and Z3). Prints medians of ``--repeat`` runs, the ratios this
tree / base, and checks that both sides give the same digest.

    python benchmarks/read_digest.py [--base main] [--ours 128] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

CHILD = r"""
import gc, json, sys, time
sys.path.insert(0, sys.argv[1])
gc.disable()
if sys.argv[2] == "import":
    import mpipe_verified.cli as cli
    assert cli.__file__.startswith(sys.argv[1]), cli.__file__
    print(json.dumps([time.process_time()]))
    raise SystemExit
import numpy, z3  # loaded by mpipe-verify's start-up anyway
from mpipe_verified.formats import torch_csv
from mpipe_verified.verify import plan_digest
assert torch_csv.__file__.startswith(sys.argv[1]), torch_csv.__file__
text = open(sys.argv[2], newline="").read()
t0 = time.process_time()
plan = torch_csv.parse_torch_csv(text, sys.argv[2])
t1 = time.process_time()
digest = plan_digest(plan)
print(json.dumps([t1 - t0, time.process_time() - t1, digest, plan.num_ops]))
"""


def run(root: str, arg: str) -> list:
    out = subprocess.run([sys.executable, "-c", CHILD, root, arg], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="git revision to compare with")
    ap.add_argument("--ours", type=int, default=128, help="p of the interleaved-1f1b plan")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from verify_vs_torch import our_csv
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.mkdir(base)
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, "mpipe_verified"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        path = os.path.join(tmp, f"ours{args.ours}.csv")
        with open(path, "w", newline="") as f:
            f.write(our_csv(args.ours))
        runs: dict[str, list] = {"base": [], "this": []}
        for _ in range(args.repeat):
            for side, root in (("base", base), ("this", ROOT)):
                runs[side].append(run(root, path) + run(root, "import"))
    med = {side: [statistics.median(r[i] for r in rows) for i in (0, 1, 4)]
           for side, rows in runs.items()}
    digests = {r[2] for rows in runs.values() for r in rows}
    print(f"plan: interleaved-1f1b p={args.ours}, {runs['this'][0][3]:,} ops; "
          f"base {args.base}; medians of {args.repeat}, CPU seconds")
    print(f"{'':8} {'read':>8} {'digest':>8} {'start-up':>9}")
    for side in ("base", "this"):
        print(f"{side:8} " + " ".join(f"{x:8.3f}" for x in med[side]))
    print(f"{'ratio':8} " + " ".join(f"{t / b:8.2f}" for t, b in zip(med["this"], med["base"])))
    print(f"same digest on both sides: {len(digests) == 1}")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
