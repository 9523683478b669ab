"""``check`` and ``export``: the verdict on each input, and the plan written only when
verified. Both go the same road (``check.check`` op by op, or a standard family instance
answered by its proven laws, ``check.parametric``); ``check`` reports it (text, JSON,
SARIF, JUnit, the SVG timeline, the portable certificate), ``export`` gates the file it
writes on it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import TYPE_CHECKING

from ..check import Checked, TWO_PROCESS_OPS, check, parametric, passes_under
from ..check.policy import (certificate_document, document, family_params, spec_family,
                            unproved)
from ..errors import InputError, ParameterError
from ..formats import sarif
from ..formats.files import read_text
from ..formats.output import write_output
from ..lower import as_plan
from ..formats.torch_csv import holds_actions, torch_csv_rows, without_markers
from ..forking import in_two_halves
from ..ir import Plan, Schedule
from ..progress import Progress
from ..question import Question, QuestionError
from ..semantics import COMM_MODELS, RENDEZVOUS, standard_duration
from ..verify.report import Locator, Report, Shown, render as render_check
from .targets import (PROG, add_target_arguments, check_target_options, compute_only,
                      declared_sizes, declared_target, display_name, fail, family_term,
                      format_of, is_plan_json, load_target, memory_limit, model_of, one_line,
                      read_target, add_solver_rlimit, UsageError)
from .views import add_picture_arguments, check_picture_arguments, write_svg

if TYPE_CHECKING:
    from ..spec import Spec

EXPORT_TARGETS = ("torch-csv", "chrome-trace", "plan-json")


def add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a schedule or its lowered plan to a file format",
                       description="Write the lowered plan (default) or the compute-only "
                                   "schedule in another format. A plan is written only if "
                                   "check (default options) verifies it: a violated "
                                   "property exits 1, an undecided check 3, and nothing is "
                                   "written (chrome-trace, a picture, is drawn for any "
                                   "plan).")
    add_target_arguments(p)
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="output format")
    p.add_argument("--compute-only", action="store_true",
                   help="write the compute-only schedule instead of the lowered plan "
                        "(chrome-trace: leave out the comm tracks and flows)")
    p.add_argument("--csv-moves", action="store_true",
                   help="torch-csv: write activation moves as OFFLOAD/RELOAD cells, this "
                        "package's extension (torch cannot run them; without it a plan "
                        "with moves is refused)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="write the plan even if it is violated or undecided, with a "
                        "warning on stderr naming the properties (exit 0)")
    p.add_argument("-o", "--output", metavar="OUT", help="output file (default: stdout)")
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Build the output text and the plan's verdict (``_export_verdict``), then write the
    text; a plan that does not verify is refused (its exit code, one line on stderr,
    nothing written) unless ``--allow-unverified``. Every step is linear in the plan's
    ops, but for the laws' proof, whose time does not depend on the size."""
    target, spec, name = load_target(args)
    model = model_of(spec)
    if args.to == "chrome-trace":  # timed with the spec's cost model (standard costs else)
        from ..formats.chrome_trace import chrome_trace, dumps as dump_trace
        from ..sim import timeline
        run = timeline(target, model.duration, model.memory)
        write_output(args.output or "-", dump_trace(chrome_trace(run, name,
                                                                 args.compute_only)))
        return 0
    from concurrent.futures import ThreadPoolExecutor
    instance = _family_instance(args, spec, target)
    with ThreadPoolExecutor(1) as pool:  # the laws' provers run while the plan is built
        laws = None if instance is None else pool.submit(parametric.answer, *instance,
                                                         model.limit, RENDEZVOUS)
        plan = as_plan(target, model.duration)  # what check judges (and writes, lowered)
        text, newline = _export_text(args, target, plan, name)
        question = Question.of_spec(spec, getattr(args, "memory_limit", None), RENDEZVOUS,
                                    declared_sizes(args, spec),
                                    spec.own_schedule if spec is not None else target,
                                    args.seq_chunks)
        report = _export_verdict(plan, question, None if laws is None else laws.result())
    if not report.verified:
        what = f"{name}: {report.status.upper()} ({', '.join(unproved(report))})"
        if not args.allow_unverified:
            stale = args.output not in (None, "-") and os.path.isfile(args.output)
            if stale:  # as check's --certificate-out: no earlier file passes for this one
                os.remove(args.output)
            print(f"{PROG}: {what}: nothing written" + (f", the earlier {args.output} removed"
                                                         if stale else "")
                  + " (mpipe-verify check shows why; --allow-unverified writes it anyway)",
                  file=sys.stderr)
            return report.exit_code
        print(f"{PROG}: warning: {what}: written anyway (--allow-unverified)",
              file=sys.stderr)
    write_output(args.output or "-", text, newline)
    return 0


def _export_text(args: argparse.Namespace, target: Schedule | Plan, plan: Plan,
                 name: str) -> tuple[str, str]:
    """The text ``export`` writes of ``plan`` (``target`` with ``--compute-only``) and
    its line end for ``write_output``; ``UsageError`` for what the format cannot say."""
    out = compute_only(target) if args.compute_only else plan
    if args.to == "plan-json":
        from ..formats.plan_json import format_plan_json
        return format_plan_json(out), "\n"
    if out.forward_only:
        raise UsageError(f"{name}: a forward-only plan cannot be written as a torch CSV (the "
                         "format cannot declare it, so the file would read back as an "
                         "incomplete training plan); export it to plan-json")
    # torch's compute-only reader adds its own markers and refuses ours; its runtime runs a
    # plan with comms as written, which needs torch's REDUCE_GRAD/UNSHARD/RESHARD cells
    if args.compute_only:
        out = without_markers(out)
    rows = partial(torch_csv_rows, out, markers=not args.compute_only, moves=args.csv_moves)
    try:  # a big plan's rows on two cores
        text = (in_two_halves(rows, out.num_ranks) if sum(map(len, out.programs)) >= TWO_PROCESS_OPS
                else rows(range(out.num_ranks)))
        return text, ""  # csv.writer's own \r\n line ends
    except ValueError as e:
        raise UsageError(f"{name}: cannot write it as a torch CSV: {e}") from None


def _export_verdict(plan: Plan, question: Question, laws: Report | None) -> Report:
    """What ``check`` with its default options (rendezvous, the spec's memory limit)
    says of ``plan``: ``laws``, the report of a standard family instance's laws
    (``parametric.answer``, as ``check`` asks it; ``_family_instance``) when they
    answered, else the plan checked op by op (``_checked``). The markers ``export`` adds
    move no data, so the verdict holds for the file written too."""
    if laws is not None:
        return laws
    return _checked(plan, question).report


def _checked(target: Schedule | Plan, question: Question, duration=standard_duration,
             rlimit: int | None = None, phase=lambda text: None) -> Checked:
    """``check(target, question)`` as check and export both run it; a question that does
    not fit the plan is bad input."""
    try:
        return check(target, question, duration, rlimit, split=True, phase=phase)
    except QuestionError as e:
        raise UsageError(str(e)) from None


def _family_instance(args: argparse.Namespace, spec: Spec | None,
                     target: Schedule | Plan) -> tuple[str, dict] | None:
    """``(family, params)`` when ``target`` is a standard family instance that the laws
    may answer for (``--family`` without an encoder cost, or a spec whose expression is
    a family term and has no cost model: ``spec_family``); else None."""
    if args.family is not None:  # the plan written is lowered with the model's costs: the
        if getattr(args, "offload", None) is not None:  # the laws know no activation moves
            return None
        if getattr(args, "encoder_cost", None) is not None or (  # laws' plan is lowered
                spec is not None and spec.cost is not None):  # with the standard ones
            return None
        return args.family, _family_params(args, family_term(args))
    return spec_family(spec, target)


def add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="verify the five properties with Z3",
                       description="Verify completeness, dependency, matching, deadlock and "
                                   "memory. Exit 0: all hold; 1: a property is violated; "
                                   "2: bad input; 3: undecided (solver unknown/timeout).")
    add_target_arguments(p, many=True)
    p.add_argument("--comm-model", choices=COMM_MODELS, default=RENDEZVOUS,
                   help="rendezvous (NCCL-like, default) or eager (sends never block; weaker)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="per-rank memory limit (unit model for torch CSV: one unit per "
                        "stored activation); overrides the spec's [memory] limit")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (docs/semantics.md §6); a list of them for "
                        "several files")
    add_solver_rlimit(p)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print no report: the exit code tells (bad input still names the "
                        "file on stderr)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="the full report: each property's proof (facts and Z3 runs, or the "
                        "law and its scope), every op's position, the whole trace of each "
                        "counterexample, every rank's peak and the certificate")
    road = p.add_mutually_exclusive_group()
    road.add_argument("--expand", action="store_true",
                      help="check a standard family instance op by op, whatever its size "
                           "(by default check picks the faster road: op by op for a small "
                           "plan, the family's laws proven for every size for a big one)")
    road.add_argument("--laws", action="store_true",
                      help="answer a standard family instance by the family's laws "
                           "whatever its size, where they cover it (a parametric "
                           "certificate)")
    p.add_argument("--no-cache", action="store_true",
                   help="prove the family's laws now rather than take a proof this same "
                        "package cached (in $XDG_CACHE_HOME/mpipe-verify, else "
                        "~/.cache/mpipe-verify), and keep none")
    g = p.add_argument_group(
        "declared sizes, with --microbatches M (a CSV carries none: a dropped stage row "
        "or last microbatch reads as a smaller schedule); missing work is a completeness "
        "violation")
    g.add_argument("--stages", type=int, metavar="S",
                   help="the schedule has S stages (a stage the file never mentions is "
                        "placed on rank s %% R)")
    g.add_argument("--ranks", type=int, metavar="R",
                   help="the schedule has R ranks (a rank without a row runs nothing)")
    p.set_defaults(declare=True)  # --microbatches M with a file: M microbatches
    p.add_argument("--only-schedules", action="store_true",
                   help="skip files that are not schedules, as a pre-commit hook sees "
                        "them: .toml files without a [schedule] table (pyproject.toml, "
                        "configs) and .csv files none of whose cells is a pipelining "
                        "action such as 2F0, 1SEND_F3 or (0F7;7B3)OVERLAP_F_B (data and "
                        "metrics tables); a CSV with even one action cell is checked")
    g = p.add_argument_group("CI outputs (written atomically, parents created)")
    g.add_argument("--certificate-out", metavar="CERT.json",
                   help="when VERIFIED, write the portable certificate with its witness "
                        "(what `mpipe-verify recheck` reads); otherwise nothing is written "
                        "and a file already there is removed")
    g.add_argument("--sarif", metavar="OUT",
                   help="write a SARIF 2.1.0 log: one result per violation, located at the "
                        "input's row and column")
    g.add_argument("--junit", metavar="OUT",
                   help="write JUnit XML: one test case per property and input")
    add_picture_arguments(p)
    p.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    check_picture_arguments(args)
    if args.quiet and (args.json or args.verbose):
        raise UsageError(f"--quiet prints nothing; drop {'--json' if args.json else '--verbose'}"
                         " or --quiet")
    for flag in ("svg", "sarif", "junit"):
        if args.json and getattr(args, flag) == "-":
            raise UsageError(f"--{flag} - and --json both write to stdout; give --{flag} a "
                             "file")
    for flag in ("sarif", "junit"):
        path = getattr(args, flag)
        if path is not None and path != "-" and os.path.isdir(path):
            raise UsageError(f"--{flag} {path}: is a directory, expected a file path")
    targets = _check_targets(args)
    if args.svg is not None and len(targets) > 1:
        raise UsageError("--svg draws one schedule; give one SPEC|FILE")
    if args.certificate_out is not None:
        if len(targets) > 1:
            raise UsageError("--certificate-out certifies one plan; give one SPEC|FILE")
        if args.certificate_out == "-" or os.path.isdir(args.certificate_out):
            raise UsageError("--certificate-out needs a file path (the report goes to stdout)")
        if targets[0] is not None and os.path.exists(args.certificate_out) and os.path.exists(
                targets[0]) and os.path.samefile(targets[0], args.certificate_out):
            raise UsageError(f"--certificate-out {args.certificate_out} is the input itself")
    progress = Progress(False if args.quiet else None)
    checked: list[sarif.Checked] = []
    results: list[tuple[dict, str]] = []  # (JSON object, text report) per input
    code = 0
    for target in targets:
        one = argparse.Namespace(**{**vars(args), "target": target})
        try:
            if args.only_schedules and _not_a_schedule(one):
                continue
            item, doc, text = _check_one(one, progress)
        except (UsageError, InputError, ParameterError) as e:
            progress.done()
            fail(str(e))
            name = display_name(one)
            is_spec = target is not None and format_of(target, args.format) == "spec"
            checked.append(sarif.Checked(name, None, _input_kind(one, is_spec),
                                         error=one_line(str(e))))
            results.append(({"source": name, "status": "error", "exit_code": 2,
                             "error": one_line(str(e))}, ""))
            code = _worst(code, 2)
            continue
        checked.append(item)
        results.append((doc, text))
        code = _worst(code, item.report.exit_code)
    if args.sarif is not None:
        progress.phase("writing SARIF")
        write_output(args.sarif, json.dumps(sarif.sarif_log(checked, code), indent=2) + "\n")
    if args.junit is not None:
        from ..formats.junit import junit_xml
        write_output(args.junit, junit_xml(checked))
    progress.done()
    to_stdout = "-" in (args.sarif, args.junit, args.svg)
    shown = [(doc, text) for doc, text in results if doc.get("status") != "error"]
    if args.json and not to_stdout and results:  # bad inputs too, as error objects
        docs = [doc for doc, _ in results]
        print(json.dumps(docs[0] if len(targets) == 1 else docs, indent=2))
    elif not args.quiet and not to_stdout and shown:  # --verbose: a blank line between
        print(("\n\n" if args.verbose else "\n").join(text for _, text in shown))
    return code


EXIT_SEVERITY = (0, 3, 1, 2)  # several inputs: undecided < violated < bad input


def _worst(a: int, b: int) -> int:
    return max(a, b, key=EXIT_SEVERITY.index)


def _check_targets(args: argparse.Namespace) -> list[str | None]:
    """The inputs of ``check``: ``[None]`` for ``--family``, else the files given."""
    check_target_options(args, args.target[0] if args.target else None)
    return [None] if args.family is not None else list(args.target)


def _not_a_schedule(args: argparse.Namespace) -> bool:
    """``--only-schedules``: a readable TOML file with no ``[schedule]`` table, or a
    readable CSV none of whose cells is a pipelining action (``holds_actions``)."""
    path = args.target
    if path is None:
        return False
    if format_of(path, args.format) == "torch-csv":
        try:
            text = read_text(path, "a torch CSV file")
        except InputError:
            return False  # let check say what is wrong with it
        return not holds_actions(text)
    if format_of(path, args.format) != "spec":
        return False
    import tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False  # let check say what is wrong with it
    return "schedule" not in data


def _check_one(args: argparse.Namespace, progress: Progress
               ) -> tuple[sarif.Checked, dict, str]:
    """Verify one input; returns its SARIF/JUnit record, JSON object and text report."""
    started = time.perf_counter()
    spec = None
    progress.phase(f"{display_name(args)}: reading")
    quick = _parametric_family(args, progress, started)
    if quick is not None:
        return quick
    read, spec, name = read_target(args)
    target = declared_target(args, read, name)
    as_written = isinstance(target, Plan)
    model = model_of(spec, args.memory_limit)
    limit = model.limit
    question = Question.of_spec(spec, args.memory_limit, args.comm_model,
                                declared_sizes(args, spec),
                                read if spec is None else spec.own_schedule, args.seq_chunks)
    if not as_written:
        progress.phase(f"{name}: lowering")
    quick = _parametric_spec(args, spec, target, name, limit, progress, started)
    if quick is not None:
        return quick
    checked = _checked(target, question, model.duration, args.solver_rlimit,  # lowered for
                       lambda text: progress.phase(f"{name}: {text}"))  # the spec's costs
    plan, report = checked.plan, checked.report
    if args.svg is not None:
        progress.phase(f"{name}: drawing")
        props = sorted({v.property for v in report.violations})
        title = f"{name}: {report.status.upper()}" + (f" ({', '.join(props)})" if props else "")
        write_svg(args, plan, spec, title, args.comm_model, limit, report.violations)
    if args.certificate_out is not None:
        if report.verified:
            _write_certificate(args.certificate_out, report, plan)
        elif os.path.isfile(args.certificate_out):  # no stale certificate survives
            os.remove(args.certificate_out)
    kind = _input_kind(args, spec is not None, as_written)
    text = None
    if args.sarif is not None and kind in (sarif.SPEC, sarif.TORCH_CSV_LOWERED) \
            and report.violations:
        text = read_text(name, "a TOML spec file" if kind == sarif.SPEC else "a torch CSV file")
    doc = document(report, name, lowered=not as_written)
    passes = None
    if args.comm_model == RENDEZVOUS and any(v.property == "deadlock"
                                             for v in report.violations):
        progress.phase(f"{name}: verifying under the eager model")
        passes = passes_under(plan, question, args.solver_rlimit)
        doc["passes_under"] = passes
    files = {sarif.SPEC: "a TOML spec file", sarif.PLAN_JSON: "a plan-json file",
             sarif.PLAN_JSON_LOWERED: "a plan-json file"}
    source = (text if text is not None else (lambda: read_text(name, files[kind]))
              if kind in files else None)
    shown = Shown(name, plan.num_microbatches, time.perf_counter() - started,
                  lowered_file=kind in (sarif.TORCH_CSV_LOWERED, sarif.PLAN_JSON_LOWERED),
                  passes_under=None if passes is None else tuple(passes),
                  locate=Locator(kind, source, plan, None if as_written else target),
                  json_paths=kind == sarif.PLAN_JSON, as_written=as_written)
    return (sarif.Checked(name, report, kind, text), doc,
            render_check(report, shown, args.verbose) if not (args.quiet or args.json)
            else "")


def _family_params(args: argparse.Namespace, term) -> dict:
    """``--family``'s parameters as the laws read them (``policy.family_params``)."""
    return family_params(args.family, args.pp, args.microbatches, args.chunks, args.body,
                         term)


def _parametric_family(args: argparse.Namespace, progress: Progress, started: float):
    """``check --family`` answered by the family's laws (``check.parametric.answer``:
    the road it picks), or None for the ordinary check: ``--expand``, a picture,
    ``--solver-rlimit`` (a cap on the instance's queries), an encoder cost, the eager
    model, an instance the laws do not cover, or one small enough that op by op is
    faster."""
    if (args.family is None or args.expand or args.svg is not None
            or args.solver_rlimit is not None or getattr(args, "encoder_cost", None) is not None
            or getattr(args, "offload", None) is not None):
        return None
    check_target_options(args, None)
    missing = [f"--{o}" for o in ("pp", "microbatches") if getattr(args, o) is None]
    if missing:
        return None  # load_target says what is missing
    name = display_name(args)
    try:
        params = _family_params(args, family_term(args))
    except ParameterError:
        return None  # load_target reports it
    return _answer(args, args.family, params, args.memory_limit, name, progress, started)


def _parametric_spec(args, spec, target, name: str, limit, progress: Progress,
                     started: float):
    """A spec whose expression is a standard family term with no cost model, answered by
    the family's laws like ``--family`` (None otherwise). Declared sizes (``--stages``,
    ``--microbatches``, ``--ranks``, or the same keys in the file's ``[schedule]``) make
    ``target`` another schedule than the term's: it is then checked op by op."""
    declared = any(getattr(args, o, None) is not None
                   for o in ("stages", "microbatches", "ranks"))
    if args.expand or args.svg is not None or args.solver_rlimit is not None or declared:
        return None
    instance = spec_family(spec, target)  # sizes declared in the file: op by op too
    if instance is None:
        return None
    return _answer(args, *instance, limit, name, progress, started)


def _answer(args, fam: str, params: dict, limit, name: str, progress: Progress,
            started: float):
    """The parametric report's SARIF record, JSON object and text, or None (the road
    ``parametric.answer`` picks is op by op, or the laws did not answer)."""
    report = parametric.answer(
        fam, params, limit, args.comm_model,
        mode=parametric.LAWS if args.laws else parametric.AUTO, cache=not args.no_cache,
        proving=lambda: progress.phase(f"{name}: proving the {fam} laws with Z3"))
    if report is None:
        return None
    if args.certificate_out is not None:
        _write_certificate(args.certificate_out, report, None)
    doc = document(report, name, lowered=True)
    microbatches = int(params["microbatches"]) * int(params.get("seq_chunks") or 1)
    shown = Shown(name, microbatches, time.perf_counter() - started)
    return (sarif.Checked(name, report, sarif.FAMILY), doc,
            render_check(report, shown, args.verbose))


def _write_certificate(path: str, report: Report, plan: Plan | None) -> None:
    """``--certificate-out``: the verified report's certificate, one JSON line."""
    write_output(path, json.dumps(certificate_document(report, plan),
                                  separators=(",", ":")) + "\n")


def _input_kind(args: argparse.Namespace, is_spec: bool, as_written: bool = True) -> str:
    """How ``check`` read the input, for SARIF locations (``sarif.Checked.kind``)."""
    if args.family is not None:
        return sarif.FAMILY
    if is_spec:
        return sarif.SPEC
    if is_plan_json(args.target, args.format):
        return sarif.PLAN_JSON if as_written else sarif.PLAN_JSON_LOWERED
    return sarif.TORCH_CSV if as_written else sarif.TORCH_CSV_LOWERED
