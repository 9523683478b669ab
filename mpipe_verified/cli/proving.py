"""``laws`` and ``recheck``: Z3 proves again, now: the algebra's laws and the families'
invariants, or a plan from the portable certificate ``check --certificate-out`` wrote."""

from __future__ import annotations

import argparse
import json
import os

from ..check import parametric
from ..errors import InputError
from ..formats.files import read_text
from ..formats.torch_csv import parse_torch_csv
from ..ir import Plan, Schedule
from ..question import Question
from ..semantics import COMM_MODELS, RENDEZVOUS
from .targets import (FORMATS, UsageError, add_seq_chunks, as_read, format_of, is_plan_json,
                      memory_limit, sniff, add_solver_rlimit, add_bidirectional,
                      two_chain_target, with_seq_chunks)


def add_laws(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("laws", help="prove the algebra's laws and the families' invariants "
                                    "with Z3",
                       description="Prove every law of proofs/ with Z3: one line per law "
                                   "(status, name, seconds, scope). Every Z3 check is "
                                   "bounded by Z3's deterministic resource limit, never by "
                                   "the clock, so the verdicts do not depend on the "
                                   "machine's speed or load. Exit 0: all proved; 1: a law "
                                   "failed; 3: a law is undecided (none failed), the line "
                                   "saying which limit stopped it.")
    p.add_argument("--json", action="store_true",
                   help='print {"laws": [{"name", "status", "scope", "seconds", '
                        '"statement", "rlimit_used", ...}]}')
    p.add_argument("--law", action="append", metavar="NAME",
                   help="prove only this law (repeatable; the deliberately false demo laws "
                        "false_* are run only when named)")
    p.add_argument("--list", action="store_true", help="list the laws without proving them")
    p.add_argument("--rlimit", type=int, metavar="R",
                   help="Z3 resource units per proof step (one obligation's refutation), "
                        "a deterministic budget: a step that uses it up leaves its law "
                        "'unknown (resource limit)' (default 10000000, about 10x what the "
                        "costliest shipped law uses; docs/proofs.md)")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="outer wall-clock guard on each Z3 check, in seconds (default "
                        "300): only against a check that never returns, far above what "
                        "any shipped law takes, so it never decides one; a check it stops "
                        "leaves its law 'undecided (time)'")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="laws proved at once, each in its own process (default: one per "
                        "CPU; 0: one after another in this process)")
    p.set_defaults(run=run_laws)


def run_laws(args: argparse.Namespace) -> int:
    import time

    from ..proofs import core, registry  # installed from the repository's proofs/
    budget = _laws_budget(args, core)
    if args.jobs is not None and args.jobs < 0:
        raise UsageError(f"--jobs must be >= 0, got {args.jobs}")
    try:
        laws = registry.select(args.law)
    except KeyError as e:
        raise UsageError(f"--law {e.args[0]}: unknown law; known: "
                         f"{', '.join(registry.BY_NAME)}") from None
    if args.list:
        for law in laws:
            print(f"{law.name:<40} {law.scope}")
        return 0
    started = time.perf_counter()
    results = core.run_all(laws, budget, args.jobs)
    if args.json:
        print(json.dumps({"laws": [r.to_json() for r in results]}, indent=2))
    else:
        for r in results:
            detail = f"  [{r.detail}]" if r.status != core.PROVED and r.detail else ""
            print(f"{r.status:<8} {r.name:<40} {r.seconds:7.2f}s  {r.scope}{detail}")
        counts = {s: sum(r.status == s for r in results)
                  for s in (core.PROVED, core.FAILED, core.UNKNOWN)}
        by = core.undecided_counts(results)
        why = (" (" + ", ".join(f"{n} by {limit}" for limit, n in sorted(by.items())) + ")"
               if by else "")
        print(f"total: {len(results)} laws, {counts[core.PROVED]} proved, "
              f"{counts[core.FAILED]} failed, {counts[core.UNKNOWN]} unknown{why} "
              f"({time.perf_counter() - started:.1f}s; rlimit {budget.rlimit} per step)")
    return core.exit_code(results)


def _laws_budget(args: argparse.Namespace, core):
    """``laws``' ``core.Budget``: ``--rlimit`` (resource units per proof step) and
    ``--timeout`` (the outer wall-clock guard), each defaulting to the laws' own."""
    rlimit = core.DEFAULT_RLIMIT if args.rlimit is None else args.rlimit
    guard = core.GUARD_SECONDS if args.timeout is None else args.timeout
    if not 1 <= rlimit <= core.RLIMIT_MAX:
        raise UsageError(f"--rlimit must be an integer from 1 to {core.RLIMIT_MAX}, got "
                         f"{rlimit}")
    if not 0 < guard < float("inf"):
        raise UsageError(f"--timeout must be a finite number of seconds > 0, got "
                         f"{guard:g}")
    return core.Budget(rlimit=rlimit, guard_seconds=guard)


def add_recheck(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recheck", help="re-prove a plan from its portable certificate",
                       description="Have the verification kernel and Z3 re-prove PLAN (read "
                                   "as written) from the certificate that `check "
                                   "--certificate-out` wrote: its witness, or for a "
                                   "parametric certificate a witness the fast passes make "
                                   "now for the plan it names. Exit 0: all five properties "
                                   "proven for this plan; 3: the certificate does not "
                                   "establish them (forged, stale, another plan's); 2: bad "
                                   "input.")
    p.add_argument("plan", metavar="PLAN",
                   help="the plan as written: a plan-json file, or a torch CSV with SEND/RECV "
                        "cells")
    p.add_argument("certificate", metavar="CERT.json")
    p.add_argument("--format", choices=FORMATS, default="auto", help="the plan's format")
    add_bidirectional(p)
    p.add_argument("--comm-model", choices=COMM_MODELS,
                   help="require the certificate to be for this model (it is reported always)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="require the certificate to prove this per-rank limit, with the "
                        "memory sizes of --memory-model (default: the unit model)")
    p.add_argument("--memory-model", metavar="SPEC.toml",
                   help="require the certificate's memory sizes to be this spec's memory "
                        "model's")
    add_solver_rlimit(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_seq_chunks(p)
    p.set_defaults(run=run_recheck)


CERTIFICATE = "expected a certificate written by `mpipe-verify check --certificate-out`"


def run_recheck(args: argparse.Namespace) -> int:
    """Recheck a witness certificate with the kernel; a parametric one (no witness) is
    first turned into one for this plan (``check.parametric.witness_certificate``,
    untrusted), which the kernel then rechecks the same way."""
    from .. import kernel
    from ..formats.plan_json import load_json
    plan = with_seq_chunks(_plan_as_written(args.plan, args.format, args), args.seq_chunks,
                           args.plan, args.format)
    data = load_json(read_text(args.certificate, "a certificate (JSON)"), args.certificate,
                     CERTIFICATE)
    if not isinstance(data, dict):
        raise InputError(f"a JSON object at the top; {CERTIFICATE}", args.certificate)
    required, named = _required_sizes(args, plan)
    kind, reasons, given = "witness", [], data
    if data.get("format") == parametric.FORMAT:
        kind = parametric.PARAMETRIC
        data, reasons = parametric.witness_certificate(plan, data, args.solver_rlimit)
    try:
        limits = Question(memory_limit=args.memory_limit).limits(plan.num_ranks)
    except ValueError as e:
        raise UsageError(f"--memory-limit: {e}") from None
    proven, reasons = (False, reasons) if data is None else kernel.recheck(
        plan, data, args.solver_rlimit, args.comm_model, limits, required)
    data = data or given  # refused: say what the certificate itself claimed
    under = {"kind": kind, "comm_model": data.get("comm_model"),
             "memory_limit": data.get("memory_limit"),
             "memory_sizes": named if proven and named else "unit model"
             if kind == parametric.PARAMETRIC else _sizes_named(kernel, plan, data.get("sizes"))}
    if required is not None and not proven:
        reasons.append(f"memory sizes required: {named}")
    if proven and kind == parametric.PARAMETRIC:
        reasons.append("the parametric certificate's parameters derive this plan; the kernel "
                       "proved it from a witness made now")
    if args.json:
        print(json.dumps({"source": args.plan, "certificate": args.certificate,
                          "proven": proven, "reasons": reasons, **under}, indent=2))
    else:  # a proven certificate's limit is None or one exact number per rank
        limit = under["memory_limit"]
        verdict = ("PROVEN (all five properties, by the kernel): under the "
                   f"{under['comm_model']} model, memory limit per rank "
                   f"{'none' if limit is None else _exactly(kernel, limit)}, memory "
                   f"sizes: {under['memory_sizes']}"
                   if proven else "NOT ESTABLISHED")
        print("\n".join([f"{args.plan}: {verdict}"] + [f"  {r}" for r in reasons]))
    return 0 if proven else 3


def _exactly(kernel, limit: list) -> str:
    """A certificate's per-rank limits as the numbers proven: an int, the shortest float
    text that is exactly the number, else the exact fraction."""
    def shown(x) -> str:
        exact = kernel.exact(x)
        return (str(exact) if isinstance(exact, int) or float(exact) != exact
                else repr(float(exact)))
    return ", ".join(map(shown, limit))


def _required_sizes(args: argparse.Namespace, plan: Plan) -> tuple:
    """``(sizes, what they are)`` that recheck requires of a certificate: those of
    ``--memory-model``'s spec (its ranks and segments must be the plan's), else the unit
    model's when ``--memory-limit`` is given (a limit means nothing under sizes the
    certificate picked), else ``(None, None)``."""
    if args.memory_model is None:
        return ((Question().sizes(plan), "unit model")
                if args.memory_limit is not None else (None, None))
    from ..formats.spec import load_spec
    spec = load_spec(args.memory_model)
    ours, theirs = ((x.num_ranks, tuple(s.name for s in x.cut.segments))
                    for x in (plan, spec.schedule))
    if ours != theirs:
        raise UsageError(f"{args.memory_model}: its memory model is for {theirs[0]} ranks and "
                         f"the segments {list(theirs[1])}, the plan {args.plan} has "
                         f"{ours[0]} ranks and {list(ours[1])}")
    try:
        return (Question.of_spec(spec, None, RENDEZVOUS).sizes(plan),
                f"the memory model of {args.memory_model}")
    except (IndexError, KeyError, TypeError, ValueError) as e:  # e.g. sizes for fewer stages
        raise UsageError(f"{args.memory_model}: its memory model does not fit the plan "
                         f"{args.plan} ({type(e).__name__}: {e})") from None


def _sizes_named(kernel, plan: Plan, sizes) -> str:
    """"unit model" when a certificate's sizes are the unit model's for ``plan``."""
    try:
        unit = kernel.read_sizes(sizes) == Question().sizes(plan)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        unit = False
    return "unit model" if unit else "the certificate's own"


def _plan_as_written(path: str, fmt: str, args=None) -> Plan:
    """A plan file read as written (no lowering): what a certificate can be about."""
    if fmt == "auto" and not format_of(path, fmt) and os.path.isfile(path):
        fmt = sniff(read_text(path, "a plan file"))
    if is_plan_json(path, fmt):
        from ..formats.plan_json import read_plan_json
        plan = as_read(read_plan_json(path))
    elif format_of(path, fmt) == "torch-csv":
        plan = as_read(two_chain_target(args, parse_torch_csv(read_text(path,
                                                                        "a torch CSV file"),
                                                              path), path))
    else:
        raise UsageError(f"{path}: recheck reads a plan file (plan-json, or a torch CSV with "
                         f"SEND/RECV cells); export a spec's plan first (mpipe-verify export "
                         f"SPEC --to plan-json -o plan.json)")
    if isinstance(plan, Schedule):
        raise UsageError(f"{path}: a plan without comm ops is lowered before it is checked; "
                         f"recheck the lowered plan (mpipe-verify export {path} --to "
                         f"plan-json -o plan.json)")
    return plan
