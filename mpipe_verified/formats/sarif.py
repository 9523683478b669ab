"""SARIF 2.1.0 logs of ``mpipe-verify check`` (for GitHub code scanning and other CI viewers).

``sarif_log(checked, exit_code)`` builds one log with one run whose tool driver is
``mpipe-verify`` and declares the five properties of docs/semantics.md §3 as rules. Every violation
becomes one result (``ruleId`` = the property) located in the input file:

- a torch CSV checked as written: each op of the violation at ``startLine`` = rank + 1
  (the CSV row) and ``startColumn`` = position + 1 (the cell), as in the text report;
- a compute-only torch CSV (lowered by mpipe before checking): the rank's row, and the
  op's cell when the op is a compute cell of that row (inserted comm ops have no cell);
- a spec: the line of its ``[schedule]`` table (positions refer to the lowered plan);
- ``--family``: no file; the location is logical only.

Every location also carries a logical location ``rank R/position I`` naming the op, so
positions stay exact where the file has no cell for them. A file that could not be read
(exit 2) or a property Z3 could not decide (exit 3) is reported as a tool execution
notification, and ``executionSuccessful`` is false.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import pathlib
import re
import urllib.parse

import attrs

from .. import __version__
from ..verify import PROPERTIES, Report, Violation

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
VERSION = "2.1.0"
TOOL = "mpipe-verify"
SPEC, TORCH_CSV, TORCH_CSV_LOWERED, FAMILY = "spec", "torch-csv", "torch-csv-lowered", "family"
PLAN_JSON, PLAN_JSON_LOWERED = "plan-json", "plan-json-lowered"

RULES = {
    "completeness": ("Every required op occurs once, on its rank",
                     "Every required compute op occurs exactly once on the rank that owns "
                     "its stage (F, and B or I then W, per stage and microbatch), and nothing "
                     "else occurs."),
    "dependency": ("Every op's inputs are on its rank before it runs",
                   "Every op's inputs (the previous stage's activation, the next stage's "
                   "gradient, the stored activation, I before W) are available on its rank "
                   "before it runs: computed locally earlier or received earlier."),
    "matching": ("Every send meets a receive of the same payload",
                 "Per ordered rank pair, the k-th send matches the k-th receive (FIFO, tags "
                 "ignored as NCCL does); matched pairs carry the same payload and none is "
                 "left over."),
    "deadlock": ("No wait-for cycle under rendezvous semantics",
                 "Under strict rendezvous (a send completes only when its receive is "
                 "posted, as with NCCL), every rank runs to its end."),
    "memory": ("Peak memory stays within the limit",
               "The peak of stored activations and receive buffers on every rank is at most "
               "its memory limit."),
}


@attrs.frozen
class Checked:
    """One input of a ``check`` run: ``name`` as given, its ``report`` (None when it could
    not be read: ``error`` is then the one-line reason), how it was read (``kind``:
    ``spec``, ``torch-csv`` as written, ``torch-csv-lowered``, ``plan-json`` as written,
    ``plan-json-lowered``, ``family``) and its ``text`` (to find lines and cells)."""

    name: str
    report: Report | None
    kind: str = FAMILY
    text: str | None = None
    error: str | None = None

    @property
    def is_file(self) -> bool:
        return self.kind != FAMILY and self.name is not None and not self.name.startswith("--")


def sarif_log(checked: list[Checked], exit_code: int) -> dict:
    """The SARIF log of the checked inputs (see the module docstring)."""
    artifacts: list[dict] = []
    index: dict[str, int] = {}
    results: list[dict] = []
    notes: list[dict] = []
    for item in checked:
        if item.is_file:
            index[item.name] = len(artifacts)
            artifacts.append({"location": _artifact(item.name, None)})
        if item.report is None:
            notes.append(_note("error", f"{item.name}: {item.error}", item, index))
            continue
        for reason in item.report.undecided:
            notes.append(_note("warning", f"{item.name}: undecided: {reason}", item, index))
        results += [_result(item, v, index.get(item.name)) for v in item.report.violations]
    driver = {"name": TOOL, "version": __version__, "semanticVersion": __version__,
              "rules": [_rule(name) for name in PROPERTIES]}
    # successful: every input was read and decided (a violation is a successful run)
    invocation = {"executionSuccessful": exit_code in (0, 1), "exitCode": exit_code}
    if notes:
        invocation["toolExecutionNotifications"] = notes
    run = {"tool": {"driver": driver}, "invocations": [invocation], "results": results}
    if artifacts:
        run["artifacts"] = artifacts
    return {"$schema": SCHEMA, "version": VERSION, "runs": [run]}


def _rule(name: str) -> dict:
    short, full = RULES[name]
    return {"id": name, "name": name, "shortDescription": {"text": short},
            "fullDescription": {"text": full}, "help": {"text": full},
            "defaultConfiguration": {"level": "error"},
            "properties": {"tags": ["pipeline-parallel", "schedule", "correctness"]}}


def _result(item: Checked, v: Violation, artifact: int | None) -> dict:
    text = v.message + "".join(f"\n{line}" for line in v.trace)
    locations = [_location(item, artifact, r, i, op) for r, i, op in v.ops]
    if not locations:  # e.g. a missing op: point at the rank (or the whole input)
        locations = [_location(item, artifact, r, None, None) for r in v.ranks] or [
            _location(item, artifact, None, None, None)]
    digest = hashlib.sha256(f"{v.property}\n{v.message}".encode()).hexdigest()[:32]
    return {"ruleId": v.property, "ruleIndex": PROPERTIES.index(v.property), "level": "error",
            "message": {"text": text}, "locations": locations,
            "partialFingerprints": {"mpipeViolation/v1": digest},
            "properties": {"ranks": list(v.ranks),
                           "ops": [{"rank": r, "position": i, "op": op} for r, i, op in v.ops]}}


def _location(item: Checked, artifact: int | None, rank: int | None, position: int | None,
              op: str | None) -> dict:
    where = ("the whole schedule" if rank is None else f"rank {rank}" if position is None
             else f"rank {rank}, position {position}: {op}")
    loc: dict = {"message": {"text": where}}
    if item.is_file:
        physical = {"artifactLocation": _artifact(item.name, artifact)}
        region = _region(item, rank, position, op)
        if region:
            physical["region"] = region
        loc["physicalLocation"] = physical
    if rank is not None:
        logical = {"name": op or f"rank {rank}", "kind": "element",
                   "fullyQualifiedName": f"rank {rank}" + (
                       "" if position is None else f"/position {position}")}
        loc["logicalLocations"] = [logical]
    return loc


def _region(item: Checked, rank, position, op) -> dict | None:
    if item.kind == SPEC:
        line = _schedule_line(item.text or "")
        return {"startLine": line, "startColumn": 1} if line else None
    if rank is None or item.kind in (PLAN_JSON, PLAN_JSON_LOWERED):
        return None  # JSON has no cell grid: the op's logical location names it
    if item.kind == TORCH_CSV:
        region = {"startLine": rank + 1}
        if position is not None:
            region["startColumn"] = position + 1
        return region
    region = {"startLine": rank + 1}  # lowered: the cell of a compute op, if it has one
    if op is not None and item.text is not None:
        rows = list(csv.reader(io.StringIO(item.text, newline="")))
        if rank < len(rows):
            cells = [c.strip() for c in rows[rank]]
            if op in cells:
                region["startColumn"] = cells.index(op) + 1
    return region


def _schedule_line(text: str) -> int | None:
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"\s*\[\s*schedule\s*\]", line):
            return n
    return None


def _artifact(name: str, index: int | None) -> dict:
    path = pathlib.PurePath(name)
    if os.path.isabs(name):
        loc = {"uri": pathlib.Path(name).as_uri()}
    else:
        loc = {"uri": urllib.parse.quote(path.as_posix()), "uriBaseId": "%SRCROOT%"}
    if index is not None:
        loc["index"] = index
    return loc


def _note(level: str, text: str, item: Checked, index: dict) -> dict:
    note: dict = {"level": level, "message": {"text": text}}
    if item.is_file:
        note["locations"] = [{"physicalLocation": {
            "artifactLocation": _artifact(item.name, index.get(item.name))}}]
    return note
