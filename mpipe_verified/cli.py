"""``mpipe-verify``: the command-line contract of docs/semantics.md §6.

Subcommands (each registered by one ``_add_*`` function; all share the target selection
of ``add_target_arguments`` and ``load_target``)::

    mpipe-verify export SPEC|FILE | --family NAME --pp P --microbatches M [--chunks V]
                        [--format auto|spec|torch-csv|plan-json]
                        --to torch-csv|chrome-trace|plan-json [--compute-only]
                        [--allow-unverified] [-o OUT]
    mpipe-verify show   SPEC|FILE | --family ... [--format ...] [--width N]
                        [--svg OUT [--arrows] [--memory]]
    mpipe-verify check  SPEC|FILE... | --family ... [--format ...]
                        [--comm-model rendezvous|eager] [--memory-limit N]
                        [--json | -q | -v] [--expand | --laws] [--no-cache]
                        [--sarif OUT] [--junit OUT] [--svg OUT [--arrows] [--memory]]
                        [--only-schedules] [--stages S] [--microbatches M] [--ranks R]
                        [--certificate-out CERT.json]
    mpipe-verify diff   OLD NEW [--format ...] [--comm-model ...] [--memory-limit N] [--json]
    mpipe-verify simulate SPEC|FILE | --family ... [--compare FAMILY ...] [--memory-limit N]
                        [--comm-model eager|rendezvous] [--json]
    mpipe-verify recheck PLAN CERT.json [--solver-rlimit R] [--json]
    mpipe-verify tune   SPEC [--budget SECONDS] [--json] [-o BEST.toml]

``--family transpose`` takes ``--body``, ``--mode``, ``--ownership``, ``--side`` and
``--encoder-cost`` (every other target rejects them: ``check_transpose_options``).

Invariants: bad input or usage exits 2 with exactly one line on stderr
(``mpipe-verify: error: ...``, naming the file and position where there is one) and
never a traceback; ``-o OUT``, ``--svg``, ``--sarif`` and ``--junit`` are written
atomically (a failure leaves no partial file) and their missing parent directories are
created. ``check`` with several files reports each (a bad one as its error line) and
exits with the worst code (``EXIT_SEVERITY``). ``diff`` exits 1 when NEW violates a
property. ``mpipe-verify --version`` prints the package's ``__version__``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple, NoReturn, Sequence

import attrs

from . import __version__
from .algebra.families import FAMILIES, family
from .algebra.transpose import MODES, OWNERSHIPS, SIDES, SOURCE, TRANSPOSE, transpose_family
from .errors import InputError, ParameterError
from .formats import sarif
from .formats.files import read_text
from .formats.output import write_output
from .forking import in_two_halves
from .formats.torch_csv import (holds_actions, parse_torch_csv,
                                 torch_csv_rows, without_markers)
from .ir import Group, Op, Plan, Recv, Schedule, Send
from .lower import as_plan
from .progress import Progress
from .question import Question, QuestionError
from .semantics import COMM_MODELS, EAGER, RENDEZVOUS, UNIT_MEMORY, MemoryModel, standard_duration
from .cost import NO_COMM_COST, CommCost
from .figures import figures
from .show import render_grid
from .verify import parametric, verify, verify_split
from .verify.report import Locator, Shown, render as render_check

if TYPE_CHECKING:
    from .spec import Spec

PROG = "mpipe-verify"
FORMATS = ("auto", "spec", "torch-csv", "plan-json")
EXPORT_TARGETS = ("torch-csv", "chrome-trace", "plan-json")


class UsageError(Exception):
    """A usage problem; ``str`` is the one line printed after ``mpipe-verify: error:``."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``PROG: error: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


# ---------------------------------------------------------------- shared target selection


def add_target_arguments(p: argparse.ArgumentParser, many: bool = False) -> None:
    """The ``SPEC|FILE | --family NAME --pp P --microbatches M [--chunks V]`` selection.
    With ``many``, ``args.target`` is a list of any number of files (``check``)."""
    if many:
        p.add_argument("target", nargs="*", metavar="SPEC|FILE",
                       help="specs (.toml), PyTorch pipelining CSVs (.csv) or plan-json "
                            "files (.json); several are checked one by one and the exit "
                            "code is the worst")
    else:
        p.add_argument("target", nargs="?", metavar="SPEC|FILE",
                       help="a spec (.toml), a PyTorch pipelining CSV (.csv) or a "
                            "plan-json file (.json)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="how to read SPEC|FILE (auto: by extension, else by content)")
    g = p.add_argument_group("a standard family instead of a file")
    g.add_argument("--family", choices=[*FAMILIES, TRANSPOSE], metavar="NAME",
                   help=f"one of {', '.join([*FAMILIES, TRANSPOSE])}")
    g.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    g.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches (check with a file: the count it must cover)")
    g.add_argument("--chunks", type=int, metavar="V", help="stages per rank (interleaved-1f1b)")
    add_transpose_arguments(p)


TRANSPOSE_OPTIONS = ("body", "mode", "ownership", "side", "encoder_cost")


def add_transpose_arguments(p: argparse.ArgumentParser) -> None:
    """``--family transpose`` options (``algebra.transpose.transpose_family``); any other
    target rejects them (``check_transpose_options``)."""
    g = p.add_argument_group("with --family transpose (an encoder moved into the bubbles)")
    g.add_argument("--body", choices=list(FAMILIES), metavar="NAME",
                   help="the body's family (default 1f1b; --chunks for interleaved-1f1b)")
    g.add_argument("--mode", choices=MODES,
                   help="recompute (default for a source), owner (default for a sink), "
                        "frozen or none")
    g.add_argument("--ownership", choices=OWNERSHIPS,
                   help="who runs each microbatch's encoder forward (default cost)")
    g.add_argument("--side", choices=SIDES, help="source encoder (default) or sink generator")
    g.add_argument("--encoder-cost", metavar="X",
                   help="encoder forward cost: one number, or a comma list per microbatch "
                        "(default 1; body forward 1, backward 2)")


def memory_limit(text: str) -> float:
    """``--memory-limit N`` (an argparse ``type``): a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def solver_rlimit(text: str) -> int:
    """``--solver-rlimit R`` (an argparse ``type``): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def check_transpose_options(args: argparse.Namespace) -> None:
    """The transpose options go with ``--family transpose`` only."""
    given = [o for o in TRANSPOSE_OPTIONS if getattr(args, o, None) is not None]
    if given and getattr(args, "family", None) != TRANSPOSE:
        flag = "--" + given[0].replace("_", "-")
        other = (f"--family {args.family}" if getattr(args, "family", None) is not None
                 else "a file (a spec sets them in its [transpose] table)")
        raise UsageError(f"{flag} goes with --family transpose, not with {other}")


def encoder_costs(text: str, microbatches: int) -> tuple[float, ...]:
    """``--encoder-cost``: one number (every microbatch) or one per microbatch."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--encoder-cost must be a number or a comma list of numbers, got "
                         f"{text!r}") from None
    if not all(0 <= v < float("inf") for v in values):
        raise UsageError(f"--encoder-cost must be finite numbers >= 0, got {text!r}")
    if len(values) == 1:
        return (values[0],) * microbatches
    if len(values) != microbatches:
        raise UsageError(f"--encoder-cost needs one number or {microbatches} (one per "
                         f"microbatch), got {len(values)}")
    return tuple(values)


def family_term(args: argparse.Namespace):
    """The term of ``--family NAME --pp P --microbatches M [--chunks V]`` (and the
    transpose options); raises ``ParameterError`` or ``UsageError``."""
    if args.family != TRANSPOSE:
        return family(args.family, args.pp, args.microbatches, args.chunks)
    costs = () if args.encoder_cost is None else encoder_costs(args.encoder_cost,
                                                                args.microbatches)
    return transpose_family(args.pp, args.microbatches, args.chunks, body=args.body or "1f1b",
                            side=args.side or SOURCE, mode=args.mode,
                            ownership=args.ownership or "cost", costs=costs)


def display_name(args: argparse.Namespace) -> str:
    """How reports name the input: the file as given, or ``--family NAME``."""
    return args.target or f"--family {args.family}"


def check_target_options(args: argparse.Namespace, target: str | None) -> None:
    """One target: a file (``target``) or ``--family`` with its options, never both."""
    check_transpose_options(args)
    if args.family is not None:
        if target is not None:
            raise UsageError(f"give either SPEC|FILE ({target}) or --family, not both")
        declared = [o for o in ("stages", "ranks") if getattr(args, o, None) is not None]
        if declared:  # a family's sizes are its parameters: nothing to declare
            raise UsageError(f"--{declared[0]} declares a file's sizes, not a family's")
        return
    if target is None:
        raise UsageError("give a SPEC, torch CSV or plan-json FILE, or --family NAME "
                         "--pp P --microbatches M")
    family_only = ("pp", "chunks") if getattr(args, "declare", False) else (
        "pp", "microbatches", "chunks")  # check: --microbatches M also declares a file's
    opts = [o for o in family_only if getattr(args, o) is not None]
    if opts:
        raise UsageError(f"--{opts[0]} goes with --family, not with a file")


def format_of(path: str, fmt: str) -> str:
    """The format to read ``path`` in: ``fmt``, or with ``auto`` the one its extension
    names (``.toml``: spec, ``.csv``: torch-csv, ``.json``: plan-json), else ``""``
    (sniffed from the text: ``sniff``)."""
    if fmt != "auto":
        return fmt
    return {".toml": "spec", ".csv": "torch-csv", ".json": "plan-json"}.get(
        os.path.splitext(path)[1].lower(), "")


def sniff(text: str) -> str:
    """The format of a file whose name does not say: a JSON object is plan-json; TOML has
    ``key = value`` or ``[table]`` lines; CSV cells never hold ``{`` or ``=``."""
    if text.lstrip().startswith("{"):
        return "plan-json"
    return "spec" if re.search(r"^\s*(\[|[A-Za-z_\"'][^,\n]*=)", text, re.M) else "torch-csv"


def is_plan_json(path: str, fmt: str) -> bool:
    """``path`` is read as plan-json (by ``--format``, its extension, or its first bytes)."""
    named = format_of(path, fmt)
    if named or not os.path.isfile(path):
        return named == "plan-json"
    try:
        with open(path, "rb") as f:
            return f.read(4096).lstrip().startswith(b"{")
    except OSError:
        return False


class Model(NamedTuple):
    """What a target is timed and judged with: the spec's durations, memory model,
    transfer costs and memory limit, or the standard ones (no limit) without a spec."""

    duration: Callable[[Op], float]
    memory: MemoryModel
    comm: CommCost
    limit: float | tuple[float, ...] | None


def model_of(spec: Spec | None, memory_limit: float | None = None) -> Model:
    """``spec``'s model; ``memory_limit`` (``--memory-limit``) overrides its limit."""
    if spec is None:
        return Model(standard_duration, UNIT_MEMORY, NO_COMM_COST, memory_limit)
    return Model(spec.duration, spec.memory_model, spec.comm_cost,
                 spec.memory_limit if memory_limit is None else memory_limit)


def load_target(args: argparse.Namespace) -> tuple[Schedule | Plan, Spec | None, str]:
    """Resolve the target options to ``(schedule_or_plan, spec, source_name)``.

    A spec or ``--family`` gives its derived ``Schedule`` and a ``Spec`` (``--family``:
    no cost model, no limit); a torch CSV or a plan-json file gives a ``Schedule`` when it
    has no comm ops (compute-only; a plan-json schedule always) and a ``Plan`` otherwise,
    with ``spec`` None. With ``args.declare`` (``check``), ``--stages``/``--microbatches``/
    ``--ranks`` are imposed on the result (``declared.declare``). Raises ``UsageError`` or
    ``InputError``."""
    target, spec, name = _load_target(args)
    return _declared_target(args, target, name), spec, name


def _declared_target(args: argparse.Namespace, target: Schedule | Plan, name: str
                     ) -> Schedule | Plan:
    """``target`` with the sizes ``--stages``/``--microbatches``/``--ranks`` declare
    (``check`` only: ``args.declare``)."""
    if not getattr(args, "declare", False):
        return target
    from .declared import declare
    try:
        return declare(target, args.stages, args.microbatches, args.ranks)
    except ParameterError as e:
        raise UsageError(f"{name}: {e}") from None


def _declared_sizes(args: argparse.Namespace, spec: Spec | None) -> tuple:
    """``(stages, microbatches, ranks)`` as the user declared them: on the command line
    (``check``), else in the spec; None where neither does."""
    given = ((args.stages, args.microbatches, args.ranks) if getattr(args, "declare", False)
             else (None, None, None))
    if getattr(args, "family", None) is not None:  # --pp P --microbatches M: the sizes asked
        given = (given[0], args.microbatches, args.pp)
    own = spec.declared if spec is not None else (None, None, None)
    return tuple(g if g is not None else o for g, o in zip(given, own))


def _load_target(args: argparse.Namespace) -> tuple[Schedule | Plan, Spec | None, str]:
    check_target_options(args, args.target)
    if args.family is not None:
        missing = [f"--{o}" for o in ("pp", "microbatches") if getattr(args, o) is None]
        if missing:
            raise UsageError(f"--family {args.family} needs {' and '.join(missing)}")
        name = display_name(args)
        try:
            from .spec import Spec
            term = family_term(args)
            spec = Spec.of_term(term, name)
        except ParameterError as e:
            raise UsageError(f"{name}: {e}") from None
        return spec.schedule, spec, name
    path = args.target
    fmt = format_of(path, args.format)
    if fmt == "plan-json":  # each format's reader loads only when a file needs it
        from .formats.plan_json import read_plan_json
        return _as_read(read_plan_json(path)), None, path
    text = read_text(path, {"spec": "a TOML spec file", "torch-csv": "a torch CSV file"}.get(
        fmt, "a TOML spec, torch CSV or plan-json file"))
    fmt = fmt or sniff(text)
    if fmt == "spec":
        from .formats.spec import parse_spec
        spec = parse_spec(text, path)
        return spec.schedule, spec, path
    if fmt == "plan-json":
        from .formats.plan_json import parse_plan_json
        return _as_read(parse_plan_json(text, path)), None, path
    return _as_read(parse_torch_csv(text, path)), None, path


def _as_read(plan: Plan | Schedule) -> Plan | Schedule:
    """A file's plan as written when it holds comm ops, else its schedule (lowered later)."""
    if isinstance(plan, Schedule) or plan.has_comms():
        return plan
    return Schedule(plan.placement, plan.num_microbatches, plan.programs, plan.cut,
                    plan.forward_only)


def compute_only(target: Schedule | Plan) -> Schedule:
    """The schedule of ``target``: its point-to-point ops dropped (lowering inserts
    those), its compute work, collectives and cut kept."""
    if isinstance(target, Schedule):
        return target
    programs = tuple(tuple(op for op in prog if not isinstance(op, (Send, Recv, Group)))
                     for prog in target.programs)
    return Schedule(target.placement, target.num_microbatches, programs, target.cut,
                    target.forward_only)


# ---------------------------------------------------------------- export

if TYPE_CHECKING:
    from .verify.report import Report


def _add_export(sub: argparse._SubParsersAction) -> None:
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
        from .formats.chrome_trace import chrome_trace, dumps as dump_trace
        from .sim import timeline
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
                                    _declared_sizes(args, spec),
                                    spec.own_schedule if spec is not None else target)
        report = _export_verdict(plan, question, None if laws is None else laws.result())
    if not report.verified:
        what = f"{name}: {report.status.upper()} ({', '.join(_unproved(report))})"
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
        from .formats.plan_json import format_plan_json
        return format_plan_json(out), "\n"
    if out.forward_only:
        raise UsageError(f"{name}: a forward-only plan cannot be written as a torch CSV (the "
                         "format cannot declare it, so the file would read back as an "
                         "incomplete training plan); export it to plan-json")
    # torch's compute-only reader adds its own markers and refuses ours; its runtime runs a
    # plan with comms as written, which needs torch's REDUCE_GRAD/UNSHARD/RESHARD cells
    if args.compute_only:
        out = without_markers(out)
    rows = partial(torch_csv_rows, out, markers=not args.compute_only)
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
    answered, else the plan judged op by op (``verify``; on two cores from
    ``TWO_PROCESS_OPS`` ops). The markers ``export`` adds move no data, so the verdict
    holds for the file written too."""
    if laws is not None:
        return laws
    return _judge(plan, question)


def _judge(plan: Plan, question: Question, rlimit: int | None = None) -> Report:
    """``plan`` judged op by op for ``question``, as check and export both judge it:
    ``verify``, or on two cores (``verify_split``) from ``TWO_PROCESS_OPS`` ops."""
    judge = verify_split if plan.num_ops >= TWO_PROCESS_OPS else verify
    try:
        return question.answered(judge(plan, rlimit=rlimit, question=question), plan)
    except QuestionError as e:
        raise UsageError(str(e)) from None


def _family_instance(args: argparse.Namespace, spec: Spec | None,
                     target: Schedule | Plan) -> tuple[str, dict] | None:
    """``(family, params)`` when ``target`` is a standard family instance that the laws
    may answer for (``--family`` without an encoder cost, or a spec whose expression is
    a family term and has no cost model); else None."""
    if args.family is not None:  # the plan written is lowered with the model's costs: the
        if getattr(args, "encoder_cost", None) is not None or (  # laws' plan is lowered
                spec is not None and spec.cost is not None):  # with the standard ones
            return None
        return args.family, family_params(args, family_term(args))
    return _spec_family(spec, target)


def _spec_family(spec: Spec | None, target) -> tuple[str, dict] | None:
    """``(family, params)`` when ``target`` is exactly the plain standard family term
    ``spec`` names (no cost model, no sizes declared beside it: the laws' schedule is the
    term's own derivation and nothing else); else None."""
    if (spec is None or spec.cost is not None or spec.declares
            or not isinstance(target, Schedule)):
        return None
    term = spec.term
    for fam in FAMILIES:
        chunks = getattr(term, "chunks", None) if fam == "interleaved-1f1b" else None
        try:
            same = family(fam, getattr(term, "ranks", 0), getattr(term, "microbatches", 0),
                          chunks) == term
        except (ParameterError, TypeError):
            same = False
        if same:
            return fam, {"pp": term.ranks, "microbatches": term.microbatches,
                         "chunks": chunks}
    return None


def _unproved(report: Report) -> list[str]:
    """The properties ``report`` does not prove, in report order: the violated ones, or
    else the undecided ones."""
    props = report.stats.get("properties", {})
    violated = {v.property for v in report.violations}
    names = [p for p in props if p in violated] or [
        p for p, info in props.items() if info.get("status") != "proved"]
    return names or sorted(violated) or ["undecided"]


# ---------------------------------------------------------------- show


def _add_show(sub: argparse._SubParsersAction) -> None:
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


def _check_picture_arguments(args: argparse.Namespace) -> None:
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
    from .formats.svg import render_svg  # drawing modules load only when drawing
    from .sim import timeline
    run = timeline(target, model.duration, model.memory, comm_model)
    write_output(args.svg, render_svg(run, model.duration, title=title, arrows=args.arrows,
                                      memory=args.memory, memory_limit=limit,
                                      violations=violations))


def run_show(args: argparse.Namespace) -> int:
    if args.width is not None and args.width < 0:
        raise UsageError(f"--width must be >= 0, got {args.width}")
    _check_picture_arguments(args)
    target, spec, name = load_target(args)
    title = f"{name}: {spec.term}" if spec is not None else name
    model = model_of(spec)
    if args.svg is not None:  # the picture instead of the text grid
        write_svg(args, target, spec, title, limit=model.limit)
        return 0
    width = args.width if args.width is not None else shutil.get_terminal_size((160, 24)).columns
    sys.stdout.write(title + "\n\n" + render_grid(target, model.duration, model.memory, width))
    return 0


# ---------------------------------------------------------------- check


def _add_check(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--solver-rlimit", type=solver_rlimit, metavar="R",
                   help="cap Z3's resource count per query; running out gives exit 3")
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


TWO_PROCESS_OPS = 50_000  # plans this big are verified on two cores (verify_split)


def run_check(args: argparse.Namespace) -> int:
    _check_picture_arguments(args)
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
            _fail(str(e))
            name = display_name(one)
            is_spec = target is not None and format_of(target, args.format) == "spec"
            checked.append(sarif.Checked(name, None, _input_kind(one, is_spec),
                                         error=_one_line(str(e))))
            results.append(({"source": name, "status": "error", "exit_code": 2,
                             "error": _one_line(str(e))}, ""))
            code = _worst(code, 2)
            continue
        checked.append(item)
        results.append((doc, text))
        code = _worst(code, item.report.exit_code)
    if args.sarif is not None:
        progress.phase("writing SARIF")
        write_output(args.sarif, json.dumps(sarif.sarif_log(checked, code), indent=2) + "\n")
    if args.junit is not None:
        from .formats.junit import junit_xml
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
    read, spec, name = _load_target(args)
    target = _declared_target(args, read, name)
    as_written = isinstance(target, Plan)
    model = model_of(spec, args.memory_limit)
    limit = model.limit
    question = Question.of_spec(spec, args.memory_limit, args.comm_model,
                                _declared_sizes(args, spec),
                            read if spec is None else spec.own_schedule)
    if not as_written:
        progress.phase(f"{name}: lowering")
    quick = _parametric_spec(args, spec, target, name, limit, progress, started)
    if quick is not None:
        return quick
    plan = as_plan(target, model.duration)  # ordered for the spec's own costs
    two = plan.num_ops >= TWO_PROCESS_OPS
    progress.phase(f"{name}: verifying {plan.num_ops} ops with Z3"
                   + (" on two cores" if two else ""))
    report = _judge(plan, question, args.solver_rlimit)
    if args.svg is not None:
        progress.phase(f"{name}: drawing")
        props = sorted({v.property for v in report.violations})
        title = f"{name}: {report.status.upper()}" + (f" ({', '.join(props)})" if props else "")
        write_svg(args, plan, spec, title, args.comm_model, limit, report.violations)
    if args.certificate_out is not None:
        if report.verified:
            write_output(args.certificate_out, json.dumps(report.portable_certificate(plan),
                                                          separators=(",", ":")) + "\n")
        elif os.path.isfile(args.certificate_out):  # no stale certificate survives
            os.remove(args.certificate_out)
    kind = _input_kind(args, spec is not None, as_written)
    text = None
    if args.sarif is not None and kind in (sarif.SPEC, sarif.TORCH_CSV_LOWERED) \
            and report.violations:
        text = read_text(name, "a TOML spec file" if kind == sarif.SPEC else "a torch CSV file")
    doc = report.to_json()
    doc["peak_memory"] = figures(report.peak_memory)
    doc["source"] = name
    doc["lowered"] = not as_written
    doc["proof"] = {"kind": parametric.INSTANCE}
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


def family_params(args: argparse.Namespace, term) -> dict:
    """``--family``'s parameters as the laws read them (``verify.parametric``)."""
    body = args.family if args.family != TRANSPOSE else (args.body or "1f1b")
    chunks = (args.chunks or 2) if body == "interleaved-1f1b" else None
    params = {"pp": args.pp, "microbatches": args.microbatches, "chunks": chunks}
    if args.family == TRANSPOSE:
        params.update(body=body, side=term.side, mode=term.mode, ownership=term.ownership)
    return params


def _parametric_family(args: argparse.Namespace, progress: Progress, started: float):
    """``check --family`` answered by the family's laws (``verify.parametric.answer``:
    the road it picks), or None for the ordinary check: ``--expand``, a picture,
    ``--solver-rlimit`` (a cap on the instance's queries), an encoder cost, the eager
    model, an instance the laws do not cover, or one small enough that op by op is
    faster."""
    if (args.family is None or args.expand or args.svg is not None
            or args.solver_rlimit is not None or getattr(args, "encoder_cost", None) is not None):
        return None
    check_target_options(args, None)
    missing = [f"--{o}" for o in ("pp", "microbatches") if getattr(args, o) is None]
    if missing:
        return None  # load_target says what is missing
    name = display_name(args)
    try:
        params = family_params(args, family_term(args))
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
    instance = _spec_family(spec, target)  # sizes declared in the file: op by op too
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
    claim = report.certificate.parametric
    if args.certificate_out is not None:
        cert = {"format": parametric.FORMAT, **report.certificate.to_json()}
        write_output(args.certificate_out, json.dumps(cert, separators=(",", ":")) + "\n")
    doc = report.to_json()
    doc["peak_memory"] = figures(report.peak_memory)
    doc["source"] = name
    doc["lowered"] = True
    doc["proof"] = {"kind": parametric.PARAMETRIC, "laws": list(claim.laws),
                    "family": fam, "params": claim.mapping}
    shown = Shown(name, int(params["microbatches"]), time.perf_counter() - started)
    return (sarif.Checked(name, report, sarif.FAMILY), doc,
            render_check(report, shown, args.verbose))


def passes_under(plan: Plan, question: Question, rlimit: int | None) -> list[str]:
    """The weaker comm models under which ``plan``, deadlocked under rendezvous, runs to
    completion (``["eager"]`` or ``[]``), as the verifier judges ``question`` under each."""
    report = verify(plan, rlimit=rlimit, question=attrs.evolve(question, comm_model=EAGER))
    return [EAGER] if report.stats["properties"]["deadlock"]["status"] == "proved" else []


def _input_kind(args: argparse.Namespace, is_spec: bool, as_written: bool = True) -> str:
    """How ``check`` read the input, for SARIF locations (``sarif.Checked.kind``)."""
    if args.family is not None:
        return sarif.FAMILY
    if is_spec:
        return sarif.SPEC
    if is_plan_json(args.target, args.format):
        return sarif.PLAN_JSON if as_written else sarif.PLAN_JSON_LOWERED
    return sarif.TORCH_CSV if as_written else sarif.TORCH_CSV_LOWERED


# ---------------------------------------------------------------- laws


def _add_laws(sub: argparse._SubParsersAction) -> None:
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

    from .proofs import core, registry  # installed from the repository's proofs/
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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_export, _add_show,
                                                                  _add_check, _add_laws]


# ---------------------------------------------------------------- diff


def _add_diff(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--comm-model", choices=COMM_MODELS, default=RENDEZVOUS,
                   help="model under which each side is verified")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="per-rank memory limit for both sides (else each spec's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object (README, "
                                                       "section diff)")
    p.set_defaults(run=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    from .diff import Side, render_diff, semantic_diff
    sides = []
    for path in (args.old, args.new):
        target, spec, name = load_target(argparse.Namespace(
            target=path, format=args.format, family=None, pp=None, microbatches=None,
            chunks=None))
        model = model_of(spec, args.memory_limit)
        sides.append(Side(name, target, model.duration, model.memory, model.limit, model.comm,
                          spec))
    doc = semantic_diff(*sides, comm_model=args.comm_model)
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else render_diff(doc))
    return doc["exit_code"]


COMMANDS.append(_add_diff)


# ---------------------------------------------------------------- simulate


def _add_simulate(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--compare", nargs="+", action="extend", choices=list(FAMILIES),
                   metavar="FAMILY", help=f"baseline families ({', '.join(FAMILIES)})")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="per-rank memory limit (overrides the spec's [memory] limit)")
    p.add_argument("--comm-model", choices=COMM_MODELS, default="eager",
                   help="timing model (default eager: sends are posted asynchronously); the "
                        "plan is always verified under rendezvous")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from .comparison import ScheduleTerm, render_simulation, simulation
    target, spec, name = load_target(args)
    if spec is None:  # a torch CSV or plan-json file: standard costs
        from .spec import Spec
        schedule = compute_only(target)
        spec = Spec(ScheduleTerm(schedule), schedule, None, None, name)
    try:
        doc, _, _ = simulation(spec, name, args.compare or (), args.memory_limit,
                               args.comm_model, target=target)
    except ParameterError as e:
        raise UsageError(str(e)) from None
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else render_simulation(doc))
    return doc["exit_code"]


COMMANDS.append(_add_simulate)


# ---------------------------------------------------------------- recheck


def _add_recheck(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--comm-model", choices=COMM_MODELS,
                   help="require the certificate to be for this model (it is reported always)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="N",
                   help="require the certificate to prove this per-rank limit, with the "
                        "memory sizes of --memory-model (default: the unit model)")
    p.add_argument("--memory-model", metavar="SPEC.toml",
                   help="require the certificate's memory sizes to be this spec's memory "
                        "model's")
    p.add_argument("--solver-rlimit", type=solver_rlimit, metavar="R",
                   help="cap Z3's resource count per query; running out gives exit 3")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_recheck)


CERTIFICATE = "expected a certificate written by `mpipe-verify check --certificate-out`"


def run_recheck(args: argparse.Namespace) -> int:
    """Recheck a witness certificate with the kernel; a parametric one (no witness) is
    first turned into one for this plan (``verify.parametric.witness_certificate``,
    untrusted), which the kernel then rechecks the same way."""
    from . import kernel
    from .formats.plan_json import load_json
    plan = _plan_as_written(args.plan, args.format)
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
    from .formats.spec import load_spec
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


def _plan_as_written(path: str, fmt: str) -> Plan:
    """A plan file read as written (no lowering): what a certificate can be about."""
    if fmt == "auto" and not format_of(path, fmt) and os.path.isfile(path):
        fmt = sniff(read_text(path, "a plan file"))
    if is_plan_json(path, fmt):
        from .formats.plan_json import read_plan_json
        plan = _as_read(read_plan_json(path))
    elif format_of(path, fmt) == "torch-csv":
        plan = _as_read(parse_torch_csv(read_text(path, "a torch CSV file"), path))
    else:
        raise UsageError(f"{path}: recheck reads a plan file (plan-json, or a torch CSV with "
                         f"SEND/RECV cells); export a spec's plan first (mpipe-verify export "
                         f"SPEC --to plan-json -o plan.json)")
    if isinstance(plan, Schedule):
        raise UsageError(f"{path}: a plan without comm ops is lowered before it is checked; "
                         f"recheck the lowered plan (mpipe-verify export {path} --to "
                         f"plan-json -o plan.json)")
    return plan


COMMANDS.append(_add_recheck)


# ---------------------------------------------------------------- tune


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search the schedules of a spec's model for the fastest "
                                    "verified one under its memory limit",
                       description="Keep the spec's model (costs, comm, memory, segments, "
                                   "ranks, microbatches) and search the schedule: every "
                                   "family (interleaved-1f1b with 2-4 chunks), defer_w lags "
                                   "and, for a transpose spec, every mode the model permits "
                                   "and every ownership, the costs re-cut to each stage "
                                   "count as simulate --compare does. Prints the fastest "
                                   "verified plan that fits, the Pareto front of step time "
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
    from .formats.spec import load_spec
    from .formats.spec_writer import spec_text
    from .sim import now
    from .tune import document, render, tune
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


COMMANDS.append(_add_tune)


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Verified pipeline-parallel schedules.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def console_main() -> NoReturn:
    """The ``mpipe-verify`` command: ``main`` in a process of its own. Reference counting
    frees everything the command builds (plans and facts are acyclic), so the cyclic
    collector stays off: it would only rescan every op of a big plan. Once ``main`` has
    answered (its files written and closed, its child processes joined), the process
    flushes its two streams and ends without tearing down the interpreter: freeing a big
    plan's objects and their caches one by one took 0.3 s at 10^6 ops. Big arrays get
    no huge pages (``_without_huge_pages``)."""
    gc.disable()
    _without_huge_pages()
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # stdout closed early (| head)
        code = code or 141
    except (OSError, ValueError):  # a stream closed or gone: nothing left to write to
        pass
    os._exit(code)


def _without_huge_pages() -> None:
    """Ask numpy not to advise huge pages for its big arrays (what its environment
    variable ``NUMPY_MADVISE_HUGEPAGE=0`` does; a choice made there is kept). Where the
    kernel serves advised huge pages by compacting memory at the first touch (Linux's
    common ``transparent_hugepage/defrag = madvise``), each new array of tens of MB
    stalled there: at 3.1M ops, 1.3-1.5 s of the system time of ``check``."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    advise = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if advise is not None:
        advise(False)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BrokenPipeError:  # stdout closed early (| head): not an error worth a line
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except (UsageError, InputError, ParameterError) as e:
        return _fail(str(e))
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}")
    except KeyboardInterrupt:
        return 130


def _one_line(message: str) -> str:
    return " ".join(str(message).splitlines())


def _fail(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # python -m: run the module's own copy (the package's
    from mpipe_verified.cli import console_main as _main  # one module, not __main__)
    sys.exit(_main())
