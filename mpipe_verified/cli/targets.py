"""The command line's shared ground: the target selection every command takes
(``SPEC|FILE | --family NAME --pp P --microbatches M [--chunks V | --waves W]
[--seq-chunks S]`` and the transpose options), reading it (``load_target``: a spec or
family derived, a file read), the model
it is timed and judged with (``model_of``), and the one-line usage errors
(``UsageError``, ``fail``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import TYPE_CHECKING, Callable, NamedTuple

import attrs

from ..algebra.families import FAMILIES, FAMILY_NAMES, MAX_SEQ_CHUNKS, family
from ..algebra.terms import Offloaded
from ..algebra.transpose import MODES, OWNERSHIPS, SIDES, SOURCE, TRANSPOSE, transpose_family
from ..errors import InputError, ParameterError
from ..formats.files import read_text
from ..formats.torch_csv import parse_torch_csv
from ..ir import Group, Op, Plan, Recv, Schedule, Send
from ..semantics import UNIT_MEMORY, MemoryModel, standard_duration
from ..cost import NO_COMM_COST, CommCost

if TYPE_CHECKING:
    from ..spec import Spec

PROG = "mpipe-verify"
FORMATS = ("auto", "spec", "torch-csv", "plan-json")


class UsageError(Exception):
    """A usage problem; ``str`` is the one line printed after ``mpipe-verify: error:``."""


def one_line(message: str) -> str:
    return " ".join(str(message).splitlines())


def fail(message: str) -> int:
    """Print ``mpipe-verify: error: MESSAGE`` (one line) on stderr; the exit code 2."""
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr)
    return 2


def add_target_arguments(p: argparse.ArgumentParser, many: bool = False) -> None:
    """The ``SPEC|FILE | --family NAME --pp P --microbatches M [--chunks V | --waves W]`` selection.
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
    g.add_argument("--family", choices=[*FAMILY_NAMES, TRANSPOSE], metavar="NAME",
                   help=f"one of {', '.join([*FAMILY_NAMES, TRANSPOSE])}")
    g.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    g.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches (check with a file: the count it must cover)")
    g.add_argument("--chunks", type=int, metavar="V",
                   help="stages per rank (interleaved-1f1b, looped-bfs, interleaved-zb)")
    g.add_argument("--waves", type=int, metavar="W", help="waves down and up the ranks (hanayo)")
    add_seq_chunks(p)
    g.add_argument("--offload", type=offload_option, metavar="GAP[,PREFETCH]",
                   help="offload each activation whose backward is at least GAP+1 steps "
                        "after its forward to host memory, reloaded PREFETCH steps before "
                        "it (default 1): the term offload(FAMILY, gap=GAP, prefetch=PREFETCH)")
    add_bidirectional(p)
    add_transpose_arguments(p)


def offload_option(text: str) -> tuple[int, int]:
    """``--offload GAP[,PREFETCH]`` (an argparse ``type``): integers, GAP >= 1, PREFETCH >= 0."""
    parts = text.split(",")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or values[0] < 1 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected GAP[,PREFETCH] (integers, GAP >= 1, "
                                         f"PREFETCH >= 0), got {text!r}")
    return values[0], values[1] if len(values) == 2 else 1


def add_seq_chunks(p: argparse.ArgumentParser) -> None:
    """``--seq-chunks S``: seq1f1b's chunks per sample, or a file's (``with_seq_chunks``)."""
    p.add_argument("--seq-chunks", type=int, metavar="S",
                   help="sequence chunks per sample: seq1f1b's (default 2), or a torch CSV's "
                        "or plan-json file's (microbatch mb*S+j is chunk j of sample mb)")


def with_seq_chunks(target: Schedule | Plan, chunks: int | None, name: str,
                    fmt: str = "auto") -> Schedule | Plan:
    """A file's plan read with ``--seq-chunks S`` (None: as written): microbatch
    ``mb * S + j`` is chunk ``j`` of sample ``mb``. S must divide the file's microbatches
    (and be the file's own, where it states one: plan-json's ``seq_chunks``); else bad
    input at the file's microbatch count (plan-json) or its last microbatch's first op."""
    if chunks is None:
        return target
    check_seq_chunks(chunks)
    if target.seq_chunks not in (1, chunks):
        raise UsageError(f"{name}: the file says seq_chunks={target.seq_chunks}, "
                         f"--seq-chunks {chunks}")
    m = target.num_microbatches
    if m % chunks:
        why = (f"--seq-chunks {chunks} does not divide the {m} microbatches of the file "
               "(microbatch mb*S+j is chunk j of sample mb)")
        if is_plan_json(name, fmt):
            raise InputError(f"$.num_microbatches: {why}", name)
        last = m - 1
        raise located(target, name, fmt, mb=last, why=(
            f"microbatch {last} is chunk {last % chunks} of sample {last // chunks}, which "
            f"is incomplete: {why}"))
    try:
        return attrs.evolve(target, seq_chunks=chunks)
    except ValueError as e:  # a sample split across the file's pipelines
        raise UsageError(f"{name}: --seq-chunks {chunks}: {e}") from None


def check_seq_chunks(chunks: int | None) -> None:
    if chunks is not None and not 1 <= chunks <= MAX_SEQ_CHUNKS:
        raise UsageError(f"--seq-chunks must be an integer from 1 to {MAX_SEQ_CHUNKS:,}, "
                         f"got {chunks}")


def add_bidirectional(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bidirectional", action="store_true",
                   help="a torch CSV holds two pipelines in the two-chain encoding "
                        "(DualPipe's): microbatches 0..m/2-1 down stages 0..S/2-1, "
                        "m/2..m-1 through stages S/2..S-1")


def two_chain_target(args: argparse.Namespace, plan: Plan, name: str) -> Plan:
    """A torch CSV's plan, read in the two-chain encoding with ``--bidirectional`` (a plan
    with comm cells gains the replica all-reduces the encoding implies); else as read."""
    if not getattr(args, "bidirectional", False):
        return plan
    from ..formats.torch_csv import as_two_chains
    from ..lower import with_replica_sums
    try:
        plan = as_two_chains(plan)
    except ValueError as e:
        s, m = plan.placement.num_stages, plan.num_microbatches
        if not m or not (m % 2 or s % 2):
            raise UsageError(f"{name}: --bidirectional: {e}") from None
        stage, mb = (None, m - 1) if m % 2 else (s - 1, None)
        raise located(plan, name, "torch-csv", stage=stage, mb=mb,
                      why=f"--bidirectional: {e}") from None
    return with_replica_sums(plan) if plan.has_comms() else plan


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


def add_solver_rlimit(p: argparse.ArgumentParser) -> None:
    """``--solver-rlimit R``, as every command that asks Z3 takes it."""
    p.add_argument("--solver-rlimit", type=solver_rlimit, metavar="R",
                   help="cap Z3's resource count per query; running out gives exit 3")


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
    """The term of ``--family NAME --pp P --microbatches M [--chunks V | --waves W]`` (and the
    transpose options); raises ``ParameterError`` or ``UsageError``."""
    chunks = getattr(args, "seq_chunks", None)
    check_seq_chunks(chunks)
    if args.family != TRANSPOSE:
        term = family(args.family, args.pp, args.microbatches, args.chunks,
                      waves=getattr(args, "waves", None), seq_chunks=chunks)
    else:
        if chunks is not None:
            raise UsageError("--seq-chunks goes with --family seq1f1b or a file, not with "
                             "--family transpose")
        costs = () if args.encoder_cost is None else encoder_costs(args.encoder_cost,
                                                                    args.microbatches)
        term = transpose_family(args.pp, args.microbatches, args.chunks,
                                body=args.body or "1f1b", side=args.side or SOURCE,
                                mode=args.mode, ownership=args.ownership or "cost", costs=costs)
    offload = getattr(args, "offload", None)
    return term if offload is None else Offloaded(term, *offload)


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
    family_only = ("pp", "chunks", "waves") if getattr(args, "declare", False) else (
        "pp", "microbatches", "chunks", "waves")  # check: --microbatches M declares a file's
    opts = [o for o in family_only + ("offload",) if getattr(args, o, None) is not None]
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
    target, spec, name = read_target(args)
    return declared_target(args, target, name), spec, name


def declared_target(args: argparse.Namespace, target: Schedule | Plan, name: str
                     ) -> Schedule | Plan:
    """``target`` with the sizes ``--stages``/``--microbatches``/``--ranks`` declare
    (``check`` only: ``args.declare``)."""
    if not getattr(args, "declare", False) or getattr(args, "family", None) is not None:
        return target  # a family's sizes are its parameters (M samples: M*S microbatches)
    from ..declared import MAX_SIZE, SIZES, declare
    try:
        return declare(target, args.stages, args.microbatches, args.ranks)
    except (ParameterError, ValueError) as e:
        from ..formats.ranges import Ranges, beyond
        given = {k: v for k, v in zip(SIZES, (args.stages, args.microbatches, args.ranks))
                 if v is not None and 1 <= v <= MAX_SIZE}
        found = beyond(target, Ranges.of(target)._replace(**given)) if given else None
        if found is not None:  # the first op beyond a declared size, at its place
            raise named(found._replace(why=f"{found.why}: {e}"), name, args.format) from None
        raise UsageError(f"{name}: {e}") from None


def named(found, name: str, fmt: str) -> InputError:
    """The bad-input error of ``found`` (``formats.ranges.Named``) at its place in the
    file ``name``: a JSON path for plan-json, else a CSV row and cell."""
    if is_plan_json(name, fmt):
        from ..formats.plan_json import named_error
        return named_error(found, name)
    from ..formats.torch_csv import named_error
    return named_error(found, name)


def located(target: Schedule | Plan, name: str, fmt: str, why: str, stage: int | None = None,
            mb: int | None = None) -> InputError:
    """Bad input ``why`` at the first op of ``target`` naming body ``stage`` or microbatch
    ``mb`` (its largest: where a count that does not fit shows), else at the file."""
    from ..formats.ranges import first_naming
    found = first_naming(target, stage, mb)
    if found is None:
        return InputError(why, name)
    return named(found._replace(why=why), name, fmt)


def declared_sizes(args: argparse.Namespace, spec: Spec | None) -> tuple:
    """``(stages, microbatches, ranks)`` as the user declared them: on the command line
    (``check``), else in the spec; None where neither does."""
    given = ((args.stages, args.microbatches, args.ranks) if getattr(args, "declare", False)
             else (None, None, None))
    if getattr(args, "family", None) is not None:  # --pp P --microbatches M: the sizes asked
        chunks = spec.schedule.seq_chunks if spec is not None else 1  # M samples of S chunks
        given = (given[0], None if args.microbatches is None else args.microbatches * chunks,
                 args.pp)
    own = spec.declared if spec is not None else (None, None, None)
    return tuple(g if g is not None else o for g, o in zip(given, own))


def read_target(args: argparse.Namespace) -> tuple[Schedule | Plan, Spec | None, str]:
    """``load_target`` before the declared sizes: the target as read or derived."""
    check_target_options(args, args.target)
    if args.family is not None and getattr(args, "bidirectional", False):
        raise UsageError("--bidirectional reads a torch CSV; a family states its pipelines "
                         "itself")
    if args.family is not None:
        missing = [f"--{o}" for o in ("pp", "microbatches") if getattr(args, o) is None]
        if missing:
            raise UsageError(f"--family {args.family} needs {' and '.join(missing)}")
        name = display_name(args)
        try:
            from ..spec import Spec
            term = family_term(args)
            spec = Spec.of_term(term, name)
        except ParameterError as e:
            raise UsageError(f"{name}: {e}") from None
        return spec.schedule, spec, name
    target, spec, name = _read_file(args)
    chunks = getattr(args, "seq_chunks", None)
    if spec is not None and chunks is not None:
        raise UsageError(f"{name}: --seq-chunks goes with --family or a torch CSV or "
                         "plan-json file; a spec sets [schedule] seq_chunks")
    return with_seq_chunks(target, chunks, name, args.format), spec, name


def _read_file(args: argparse.Namespace) -> tuple[Schedule | Plan, Spec | None, str]:
    """The target file as read (a spec derived)."""
    path = args.target
    fmt = format_of(path, args.format)
    if getattr(args, "bidirectional", False) and fmt not in (None, "torch-csv"):
        raise UsageError(f"{path}: --bidirectional reads a torch CSV (a spec or plan-json "
                         "file states its pipelines itself)")
    if fmt == "plan-json":  # each format's reader loads only when a file needs it
        from ..formats.plan_json import read_plan_json
        return as_read(read_plan_json(path)), None, path
    text = read_text(path, {"spec": "a TOML spec file", "torch-csv": "a torch CSV file"}.get(
        fmt, "a TOML spec, torch CSV or plan-json file"))
    fmt = fmt or sniff(text)
    if fmt == "spec":
        from ..formats.spec import parse_spec
        spec = parse_spec(text, path)
        return spec.schedule, spec, path
    if fmt == "plan-json":
        from ..formats.plan_json import parse_plan_json
        return as_read(parse_plan_json(text, path)), None, path
    if getattr(args, "bidirectional", False) and fmt != "torch-csv":
        raise UsageError(f"{path}: --bidirectional reads a torch CSV (a spec or plan-json "
                         "file states its pipelines itself)")
    return as_read(two_chain_target(args, parse_torch_csv(text, path), path)), None, path


def as_read(plan: Plan | Schedule) -> Plan | Schedule:
    """A file's plan as written when it holds comm ops, else its schedule (lowered later)."""
    if isinstance(plan, Schedule) or plan.has_comms():
        return plan
    return Schedule(plan.placement, plan.num_microbatches, plan.programs, plan.cut,
                    plan.forward_only, plan.pipelines, plan.seq_chunks)


def compute_only(target: Schedule | Plan) -> Schedule:
    """The schedule of ``target``: its point-to-point ops dropped (lowering inserts
    those), its compute work, collectives and cut kept."""
    if isinstance(target, Schedule):
        return target
    programs = tuple(tuple(op for op in prog if not isinstance(op, (Send, Recv, Group)))
                     for prog in target.programs)
    return Schedule(target.placement, target.num_microbatches, programs, target.cut,
                    target.forward_only, target.pipelines, target.seq_chunks)

