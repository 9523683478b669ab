"""The verifier's soundness on one-edit mutants, judged by the independent reference.

    python benchmarks/soundness.py --mutants N --seed S [--jobs J] [--dump FILE]

Mutant ``i`` is built from ``random.Random(f"{S}:{i}")`` alone (so the run is the same
for any ``--jobs``): a mutation kind (uniform over ``strategies.MUTATIONS``), a base
term (uniform over ``strategies.SOURCES``: a family with random valid parameters, p
1..6, m 1..12, chunks 2..3; a random composition of ``strategies.random_term``; or a
``transpose`` with a cut: source or sink segment, every mode and ownership, bodies
1f1b / interleaved-1f1b / zb-h1, p 1..6, m 1..10; a segment mutation always edits a
transpose), its lowered plan (plain, with valid groups, or with collectives), one edit
of that kind, and a memory limit (none, the base's highest peak, or its per-rank
peaks). Two mutants in three get random memory sizes (``strategies.random_sizes``: each
unit's stored size, each payload kind's receive buffer, each rank's static part and the
RNG state of a raw input; halves included) and their limit from the sized base; the rest
use the unit model. Each mutant goes to ``verify`` (rendezvous) and to
``reference.judge`` with the same sizes and limit.

Counts (per mutant): *false accept*: the verifier says verified, the reference finds a
violation. *False reject*: the verifier reports violated where the reference accepts,
or reports a property the reference does not find. Also counted: *missed* (both reject,
the verifier lacks a property the reference finds), *undecided* and *errors* (the
verifier raised). Per kind, per base and per property tables follow; the last line is
exactly ``mutants=N false_accepts=A false_rejects=R``. ``--dump`` writes every disagreement as
one JSON line (index, kind, base source, edit, base programs and cut, limit, both
verdicts).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
import traceback
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import strategies as S  # noqa: E402
from reference import PROPERTIES  # noqa: E402


def one(args: tuple[int, int]) -> dict:
    seed, index = args
    ch = S.RandomChooser(random.Random(f"{seed}:{index}"))
    source = ch.pick(S.SOURCES)
    base, kind, description, mutant, limit = S.random_mutant(ch, depth=2, source=source)
    source = "transpose" if base.cut.segments else source  # a segment edit forces one
    sizes = None
    if ch.pick(["unit", "sized", "sized"]) == "sized":  # the limit then from the sized base
        sizes = S.random_sizes(ch, base)
        limit = S.memory_limit_for(base, ch, sizes)
    expected = S.reference_verdict(mutant, limit, sizes)
    try:
        status, found = S.verifier_verdict(mutant, limit, sizes)
        error = None
    except Exception:  # noqa: BLE001 — a crash is a finding, not the end of the run
        status, found, error = "error", set(), traceback.format_exc(limit=3)
    verdict = "error" if error else S.classify(status, found, expected)
    out = {"index": index, "kind": kind, "source": source, "verdict": verdict, "status": status,
           "found": sorted(found), "expected": sorted(expected), "ops": mutant.num_ops,
           "sized": sizes is not None}
    if verdict != "agree":
        out.update(edit=description, limit=limit, ranks=mutant.num_ranks, sizes=repr(sizes),
                   microbatches=mutant.num_microbatches, error=error, cut=repr(base.cut),
                   base=[[str(op) for op in prog] for prog in base.programs])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dump", help="write each disagreement as a JSON line here")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    n = args.mutants
    verdicts: Counter = Counter()
    by_kind: dict[str, Counter] = defaultdict(Counter)
    by_prop: dict[str, Counter] = defaultdict(Counter)
    by_source: dict[str, Counter] = defaultdict(Counter)
    dump = open(args.dump, "w") if args.dump else None
    step = max(1, n // 10)
    work = [(args.seed, i) for i in range(n)]
    pool = mp.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    results = pool.imap(one, work, chunksize=8) if pool else map(one, work)
    shown = sized = 0
    for done, r in enumerate(results, 1):
        v = r["verdict"]
        verdicts[v] += 1
        sized += r["sized"]
        k = by_kind[r["kind"]]
        k["mutants"] += 1
        k[v] += 1
        k["ref_accepts"] += not r["expected"]
        b = by_source[r["source"]]
        b["mutants"] += 1
        b[v] += 1
        b["ref_accepts"] += not r["expected"]
        for prop in PROPERTIES:
            ref, ours = prop in r["expected"], prop in r["found"]
            c = by_prop[prop]
            c["reference"] += ref
            c["verifier"] += ours
            c["false_accept"] += ref and not ours and r["status"] != "error"
            c["false_reject"] += ours and not ref
        if v != "agree":
            if dump:
                dump.write(json.dumps(r) + "\n")
            if shown < 5:
                shown += 1
                print(f"  disagreement #{r['index']} ({r['kind']}: {r['edit']}): verifier "
                      f"{r['status']} {r['found']}, reference {r['expected']}", flush=True)
        if done % step == 0 or done == n:
            print(f"[{done}/{n}] {time.perf_counter() - started:.0f}s "
                  + " ".join(f"{key}={verdicts[key]}" for key in sorted(verdicts)), flush=True)
    if pool:
        pool.close()
        pool.join()
    if dump:
        dump.close()

    cols = ("mutants", "ref_accepts", "agree", "false_accept", "false_reject", "missed",
            "undecided", "error")
    print("\nby mutation kind:")
    print(f"  {'kind':<20}" + "".join(f"{c:>13}" for c in cols))
    for kind in S.MUTATIONS:
        print(f"  {kind:<20}" + "".join(f"{by_kind[kind][c]:>13}" for c in cols))
    print("\nby base (transpose: plans with a cut):")
    print(f"  {'base':<20}" + "".join(f"{c:>13}" for c in cols))
    for source in S.SOURCES:
        print(f"  {source:<20}" + "".join(f"{by_source[source][c]:>13}" for c in cols))
    print("\nby property (mutants where it is violated, and disagreements on it):")
    pcols = ("reference", "verifier", "false_accept", "false_reject")
    print(f"  {'property':<20}" + "".join(f"{c:>13}" for c in pcols))
    for prop in PROPERTIES:
        print(f"  {prop:<20}" + "".join(f"{by_prop[prop][c]:>13}" for c in pcols))
    print(f"\nsized={sized} missed={verdicts['missed']} undecided={verdicts['undecided']} "
          f"errors={verdicts['error']} seconds={time.perf_counter() - started:.1f}")
    print(f"mutants={n} false_accepts={verdicts['false_accept']} "
          f"false_rejects={verdicts['false_reject']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
