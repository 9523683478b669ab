"""``mpipe-verify import FILE -o SPEC.toml``: a schedule file as a spec whose term is its
literal term (``algebra.literal``).

The file is a torch CSV (compute-only or lowered) or plan-json. Its point-to-point ops,
idle cells and bookkeeping markers are dropped (lowering derives the transfers again);
its placement is the one read (stage ``s`` on the rank whose row holds its ops), its
compute order is kept exactly: ``export`` of the written spec gives the same compute
order back. Bad input (unreadable, a spec, a cut or collectives, which a literal cannot
hold) exits 2 with one line naming the file and where, and writes nothing.
"""

from __future__ import annotations

import argparse

from ..algebra.literal import literal
from ..algebra.terms import ForwardOnly
from ..errors import InputError, ParameterError
from ..formats.files import read_text
from ..formats.output import write_output
from ..formats.spec_writer import spec_text
from ..formats.torch_csv import parse_torch_csv
from .targets import UsageError, as_read, compute_only, format_of, sniff

FORMATS = ("auto", "torch-csv", "plan-json")


def add_import(sub) -> None:
    p = sub.add_parser("import", help="write a torch CSV or plan-json schedule as a spec "
                                      "(its literal term)",
                       description="Read a schedule file and write a spec TOML whose "
                                   "[schedule] expression is the schedule's literal term, "
                                   "each rank's order as a short pattern word.")
    p.add_argument("file", metavar="FILE", help="a PyTorch pipelining CSV or plan-json file")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="how to read FILE (auto: by extension, else by content)")
    p.add_argument("-o", "--output", metavar="SPEC.toml", help="output file (default: stdout)")
    p.set_defaults(run=run_import)


def read_schedule(path: str, fmt: str = "auto"):
    """``(schedule, is_json)``: the compute-only schedule of the file at ``path`` and
    whether it was read as plan-json (``UsageError`` for a spec)."""
    named = format_of(path, fmt)
    if named == "spec":
        raise UsageError(f"{path}: import reads a torch CSV or plan-json file, not a spec")
    if named == "plan-json":
        from ..formats.plan_json import read_plan_json
        return compute_only(as_read(read_plan_json(path))), True
    text = read_text(path, "a torch CSV or plan-json file")
    named = named or sniff(text)
    if named == "plan-json":
        from ..formats.plan_json import parse_plan_json
        return compute_only(as_read(parse_plan_json(text, path))), True
    if named == "spec":
        raise UsageError(f"{path}: import reads a torch CSV or plan-json file, not a spec")
    return compute_only(as_read(parse_torch_csv(text, path))), False


def imported_term(schedule, path: str, is_json: bool = False):
    """The literal term of ``schedule`` (``ForwardOnly`` of it for a declared evaluation
    run); for what a literal cannot hold, ``InputError`` naming ``path`` and where: the
    rank's row of a CSV, ``$.programs[R]`` or ``$.cut`` of plan-json."""
    for field, what in (("seq_chunks", "sequence chunks"), ("pipelines", "several pipelines")):
        if getattr(schedule, field) not in (1, ()):
            where = f"$.{field}: " if is_json else ""
            raise InputError(f"{where}cannot import {what}: a literal term holds one pipeline "
                             "of whole microbatches", path, 1 if not is_json else None)
    try:
        term = literal(schedule)
    except ParameterError as e:
        rank = _rank_of(str(e))
        if not is_json:
            raise InputError(f"cannot import: {e}", path, 1 if rank is None else rank + 1,
                             1) from None
        where = "$.cut" if rank is None else f"$.programs[{rank}]"
        raise InputError(f"{where}: cannot import: {e}", path) from None
    return ForwardOnly(term) if schedule.forward_only else term


def _rank_of(message: str) -> int | None:
    """The rank a literal's message names (``rank R: ...``), else None."""
    if message.startswith("rank "):
        head = message[5:].split(":", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def run_import(args: argparse.Namespace) -> int:
    schedule, is_json = read_schedule(args.file, args.format)
    term = imported_term(schedule, args.file, is_json)
    header = (f"Imported from {args.file} by mpipe-verify import: its compute order as a "
              "literal term.\nmpipe-verify export this spec --to torch-csv --compute-only "
              "gives that order back.")
    write_output(args.output or "-", spec_text(term, None, None, header))
    return 0
