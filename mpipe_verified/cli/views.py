"""``show``, ``simulate`` and ``diff``: a schedule drawn, timed, or set against another
(the SVG timeline is drawn here for ``check --svg`` too)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import TYPE_CHECKING

from ..algebra.families import BIDIRECTIONAL, FAMILIES, SEQ_FAMILIES
from ..errors import ParameterError
from ..formats.output import write_output
from ..ir import Plan, Schedule
from ..semantics import COMM_MODELS, RENDEZVOUS
from ..show import render_grid
from .targets import (FORMATS, UsageError, add_bidirectional, add_seq_chunks,
                      add_target_arguments,
                      compute_only, load_target, memory_limit, model_of)

if TYPE_CHECKING:
    from ..spec import Spec

COMPARED = (*FAMILIES, *BIDIRECTIONAL, *SEQ_FAMILIES)  # what simulate --compare takes


def add_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a per-rank time grid of a schedule",
                       description="Print one line per rank over time (idle steps as '.'), "
                                   "then makespan, idle time and peak memory per rank.")
    add_target_arguments(p)
    p.add_argument("--width", type=int, metavar="N",
                   help="wrap the grid to N characters (0: never; default: terminal width)")
    add_picture_arguments(p)
    p.set_defaults(run=run_show)


def add_picture_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SVG timeline")
    g.add_argument("--svg", metavar="OUT",
                   help="draw the timeline as SVG to OUT ('-': stdout): one lane per rank, "
                        "one box per compute op, times from the cost model")
    g.add_argument("--arrows", action="store_true", help="with --svg: an arrow per send→recv")
    g.add_argument("--memory", action="store_true",
                   help="with --svg: each rank's memory curve (and the limit, if any)")


def check_picture_arguments(args: argparse.Namespace) -> None:
    for flag in ("arrows", "memory"):
        if getattr(args, flag) and args.svg is None:
            raise UsageError(f"--{flag} draws on the SVG timeline; add --svg OUT")
    if args.svg is not None and args.svg != "-" and os.path.isdir(args.svg):
        raise UsageError(f"--svg {args.svg}: is a directory, expected a file path")


def write_svg(args: argparse.Namespace, target: Schedule | Plan, spec: Spec | None,
              title: str, comm_model: str = "eager", limit=None, violations=()) -> None:
    """Time ``target`` with the spec's costs (standard costs without one) and write the
    SVG timeline to ``args.svg``."""
    model = model_of(spec)
    from ..formats.svg import render_svg  # drawing modules load only when drawing
    from ..sim import timeline
    run = timeline(target, model.duration, model.memory, comm_model)
    write_output(args.svg, render_svg(run, model.duration, title=title, arrows=args.arrows,
                                      memory=args.memory, memory_limit=limit,
                                      violations=violations))


def run_show(args: argparse.Namespace) -> int:
    if args.width is not None and args.width < 0:
        raise UsageError(f"--width must be >= 0, got {args.width}")
    check_picture_arguments(args)
    target, spec, name = load_target(args)
    title = f"{name}: {spec.term}" if spec is not None else name
    model = model_of(spec)
    if args.svg is not None:  # the picture instead of the text grid
        write_svg(args, target, spec, title, limit=model.limit)
        return 0
    width = args.width if args.width is not None else shutil.get_terminal_size((160, 24)).columns
    sys.stdout.write(title + "\n\n" + render_grid(target, model.duration, model.memory, width))
    return 0



def add_diff(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="what a schedule change changes: moved ops, verdicts, "
                                    "makespan and memory",
                       description="Compare two schedules (specs, torch CSVs or plan-json "
                                   "files): compute ops that moved, appeared or vanished per "
                                   "rank, the verdict of each side, and the makespan and "
                                   "peak-memory deltas from the simulator. Exit 1 when NEW "
                                   "violates a property (named in the report), 0 otherwise, "
                                   "2 on bad input.")
    p.add_argument("old", metavar="OLD", help="the schedule before the change")
    p.add_argument("new", metavar="NEW", help="the schedule after the change")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="how to read OLD and NEW (auto: by extension, else by content)")
    add_bidirectional(p)
    p.add_argument("--comm-model", choices=COMM_MODELS, default=RENDEZVOUS,
                   help="model under which each side is verified")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="per-rank memory limit for both sides (else each spec's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object (README, "
                                                       "section diff)")
    add_seq_chunks(p)
    p.set_defaults(run=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    from ..diff import Side, render_diff, semantic_diff
    sides = []
    for path in (args.old, args.new):
        target, spec, name = load_target(argparse.Namespace(
            target=path, format=args.format, family=None, pp=None, microbatches=None,
            chunks=None, bidirectional=args.bidirectional, seq_chunks=args.seq_chunks))
        model = model_of(spec, args.memory_limit)
        sides.append(Side(name, target, model.duration, model.memory, model.limit, model.comm,
                          spec))
    doc = semantic_diff(*sides, comm_model=args.comm_model)
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else render_diff(doc))
    return doc["exit_code"]



def add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="time a verified schedule with its cost model and "
                                        "compare it with other families",
                       description="Verify the plan (exit 1 and no figures if it is not "
                                   "verified), then time it with the spec's cost model "
                                   "(sim.simulate): makespan, bubble fraction, per-rank busy "
                                   "time, bubble and peak memory. --compare times the same "
                                   "model under other families with the cut segment inline "
                                   "on its home rank, the spec's per-stage costs (or the "
                                   "standard ones) re-cut to each family's stage count "
                                   "(docs/semantics.md §5, docs/transpose.md).")
    add_target_arguments(p)
    p.add_argument("--compare", nargs="+", action="extend", choices=list(COMPARED),
                   metavar="FAMILY", help=f"baseline families ({', '.join(COMPARED)}; a "
                                         "family that cannot run the model, e.g. dualpipe "
                                         "with an odd pp, is skipped with its reason)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="per-rank memory limit (overrides the spec's [memory] limit)")
    p.add_argument("--comm-model", choices=COMM_MODELS, default="eager",
                   help="timing model (default eager: sends are posted asynchronously); the "
                        "plan is always verified under rendezvous")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from ..comparison import ScheduleTerm, render_simulation, simulation
    target, spec, name = load_target(args)
    if spec is None:  # a torch CSV or plan-json file: standard costs
        from ..spec import Spec
        schedule = compute_only(target)
        spec = Spec(ScheduleTerm(schedule), schedule, None, None, name)
    try:
        doc, _, _ = simulation(spec, name, args.compare or (), args.memory_limit,
                               args.comm_model, target=target)
    except ParameterError as e:
        raise UsageError(str(e)) from None
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else render_simulation(doc))
    return doc["exit_code"]
