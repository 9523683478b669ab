"""``tune``: the fastest verified schedule for a spec's model (``mpipe_verified.tune``)."""

from __future__ import annotations

import argparse
import json
import sys

from ..formats.output import write_output
from ..progress import Progress
from .targets import PROG


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search the schedules of a spec's model for the fastest "
                                    "verified one under its memory limit",
                       description="Keep the spec's model (costs, comm, memory, segments, "
                                   "ranks, microbatches) and search the schedule: every "
                                   "family (interleaved-1f1b with 2-4 chunks), defer_w lags "
                                   "and, for a transpose spec, every mode the model permits "
                                   "and every ownership; without a cut also dualpipe and "
                                   "chimera where two weight copies fit ([memory] weights), "
                                   "seq1f1b where the model has a sequence ([cost] "
                                   "attention) and offload where memory binds; the costs "
                                   "re-cut to each stage count as simulate --compare does. "
                                   "Prints the fastest verified plan that fits, why it "
                                   "won, the Pareto front of step time "
                                   "against peak memory and how much faster it is than the "
                                   "fastest plain family that fits (with the segment "
                                   "inline, for a spec with a cut; docs/tune.md). Exit 0: a "
                                   "verified plan was found; 1: none fits and verifies.")
    p.add_argument("spec", metavar="SPEC", help="a spec file (.toml) that fixes the model")
    p.add_argument("--budget", type=_budget, metavar="SECONDS",
                   help="bound the search (the spec's loading included) to this many "
                        "seconds; the best candidate evaluated by then is verified after it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", metavar="BEST.toml",
                   help="write the best plan as a spec that check and simulate reproduce")
    p.set_defaults(run=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    from ..formats.spec import load_spec
    from ..formats.spec_writer import spec_text
    from ..sim import now
    from ..tune import document, render, tune
    start = now()  # --budget counts from here (the clock tune's deadline is on)
    spec = load_spec(args.spec)
    progress = Progress(prefix=f"{PROG} tune")
    result = tune(spec, args.budget, lambda n, best: progress.phase(
        f"{n} candidates evaluated, best so far "
        f"{'-' if best is None else f'{best.makespan:.6g}'}"), start=start)
    progress.done()
    doc = document(result, args.spec)
    if args.output and result.best is not None:
        best = result.best.spec
        header = (f"mpipe-verify tune {args.spec}: {result.best.tried.candidate.label}, "
                  f"makespan {doc['best']['makespan']}, peak memory "
                  f"{doc['best']['peak_memory']}, {result.best.status}")
        write_output(args.output, spec_text(best.term, best.cost, best.memory_limit, header))
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else render(doc))
    return 0 if result.best is not None else 1
