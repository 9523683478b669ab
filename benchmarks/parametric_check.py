"""``mpipe-verify check --family``: answered by the family's laws (the default) against
the op-by-op check of the same instance (``--expand``), side by side, as ratios.

Run:  python benchmarks/parametric_check.py [--family interleaved-1f1b] [--chunks 2]
                                             [--sizes 8 16 32 64] [--big 1024]
                                             [--ownership inline] [--mode recompute]
                                             [--peer interleaved-1f1b]

(``--ownership`` and ``--mode`` go with ``--family transpose``.)

For each ``p`` in ``--sizes`` (``m = 4p``) both commands run as whole processes,
alternating, and the table gives the wall time of each (median of ``--repeat``) and
``laws / op-by-op``. Then the laws alone at ``p = --big`` (``m = 4p``), where the op-by-op
check is out of reach, to show the time does not grow with the instance; with ``--peer``,
alternating with the peer family's laws at the same ``p, m`` (chunks ``--chunks`` where
it is interleaved 1F1B), as the ratio ``family / peer``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")


def run(argv: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run([str(SCRIPT), "check", *argv, "--json"], capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"check {' '.join(argv)} exited {proc.returncode}: {proc.stderr}")
    return seconds, json.loads(proc.stdout)


def instance(family: str, p: int, chunks: int | None, options=()) -> list[str]:
    argv = ["--family", family, "--pp", str(p), "--microbatches", str(4 * p)]
    return argv + (["--chunks", str(chunks)] if chunks else []) + list(options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="interleaved-1f1b")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--big", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ownership", help="with --family transpose")
    ap.add_argument("--mode", help="with --family transpose")
    ap.add_argument("--peer", default=None, help="another family's laws at --big, side by side")
    args = ap.parse_args()
    chunks = args.chunks if args.family == "interleaved-1f1b" else None
    options = [x for name in ("ownership", "mode") if getattr(args, name)
               for x in (f"--{name}", getattr(args, name))]
    print("| p | m | ops | laws (s) | op by op (s) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p in args.sizes:
        argv = instance(args.family, p, chunks, options)
        laws, expand, ops = [], [], 0
        for _ in range(args.repeat):
            t, doc = run(argv)
            assert doc["proof"]["kind"] == "parametric", doc["proof"]
            laws.append(t)
            t, doc = run(argv + ["--expand"])
            expand.append(t)
            ops = doc["stats"]["ops"]
        a, b = statistics.median(laws), statistics.median(expand)
        print(f"| {p} | {4 * p} | {ops:,} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    big(args, chunks, options)


def big(args, chunks, options) -> None:
    """The laws at ``p = --big``, alternating with ``--peer``'s when given."""
    peer_chunks = args.chunks if args.peer == "interleaved-1f1b" else None
    own, other, doc = [], [], {}
    for _ in range(args.repeat if args.peer else 1):
        t, doc = run(instance(args.family, args.big, chunks, options))
        assert doc["proof"]["kind"] == "parametric", doc["proof"]
        own.append(t)
        if args.peer:
            t, peer_doc = run(instance(args.peer, args.big, peer_chunks))
            assert peer_doc["proof"]["kind"] == "parametric", peer_doc["proof"]
            other.append(t)
    t = statistics.median(own)
    print(f"\nlaws at p = {args.big}, m = {4 * args.big}: {t:.2f} s "
          f"({doc['stats']['obligations']} obligations, {doc['stats']['seconds']:.2f} s "
          f"proving them)")
    if args.peer:
        u = statistics.median(other)
        print(f"{args.peer}'s laws at the same p, m: {u:.2f} s; {args.family} / "
              f"{args.peer} = {t / u:.2f} (medians of {args.repeat})")


if __name__ == "__main__":
    main()
