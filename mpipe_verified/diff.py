"""Semantic diff of two schedules: what a schedule change under review really changes.

``semantic_diff(old, new)`` compares the compute programs rank by rank and judges both
sides:

- **moved**: compute ops present on a rank in both versions whose order changed. The ops
  kept in place are a longest common subsequence of the two orders (each op occurs once
  per rank in a complete schedule, so this is a longest increasing subsequence, found in
  ``O(n log n)``); every other common op is reported as moved, with its old and new
  position. Inserting one op early therefore moves nothing: positions shift, order holds.
- **appeared** / **vanished**: compute ops only in the new / only in the old program of a
  rank; ``from_rank`` / ``to_rank`` say where an op that changed rank came from / went.
- each side's **verdict** (``check.check``: status, violated properties) and its **makespan**,
  **bubble_fraction** and **peak memory** from the simulator (``sim.simulate`` with that
  side's durations, transfer costs and memory model, as ``simulate`` times it), and the
  deltas ``new - old``. A compute-only side is lowered for its own durations, as
  ``check`` does. A side that deadlocks under the checked model is not timed (its
  makespan is None, with ``simulation_error``): a run that cannot happen has no length.
- the gate: ``exit_code`` is 1 when NEW violates a property (``violated`` names them),
  else 0, so ``diff`` can fail a CI job as ``check`` does.

A *position* is the index among the rank's compute steps (comm ops, idle cells and FSDP
markers skipped; an overlapped step is one position holding both its ops), so a spec, its
lowered CSV and its compute-only CSV have the same positions.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Callable

import attrs

from .check import Timing, check
from .cost import NO_COMM_COST, CommCost
from .figures import figure, figures, num_text
from .ir import Compute, Op, Plan, Schedule, computes_of
from .question import Question
from .semantics import RENDEZVOUS, UNIT_MEMORY, MemoryModel, standard_duration
from .verify import question_of


@attrs.frozen
class Side:
    """One version: its name, the schedule or plan, its cost model (durations, memory,
    transfer costs) and limit."""

    name: str
    target: Schedule | Plan
    duration: Callable[[Op], float] = standard_duration
    memory: MemoryModel = UNIT_MEMORY
    memory_limit: float | tuple[float, ...] | None = None
    comm: CommCost = NO_COMM_COST
    spec: object = None  # the spec it was read from: its memory numbers are the question's


def compute_steps(target: Schedule | Plan) -> list[list[tuple[Compute, int]]]:
    """Per rank, each compute op with its position among the rank's compute steps."""
    out = []
    for program in target.programs:
        row, position = [], 0
        for op in program:
            subs = computes_of(op)
            if subs:
                row.extend((c, position) for c in subs)
                position += 1
        out.append(row)
    return out


def rank_diff(old: list[tuple[Compute, int]], new: list[tuple[Compute, int]]
              ) -> tuple[list[dict], list[dict], list[dict]]:
    """``(moved, appeared, vanished)`` of one rank (see the module docstring)."""
    def keyed(row):
        seen: dict[Compute, int] = defaultdict(int)
        out = []
        for op, pos in row:
            out.append(((op, seen[op]), pos))
            seen[op] += 1
        return out
    old_k, new_k = keyed(old), keyed(new)
    old_index = {key: i for i, (key, _) in enumerate(old_k)}
    new_keys = {key for key, _ in new_k}
    common = [(key, pos, old_index[key]) for key, pos in new_k if key in old_index]
    kept = _lis([i for _, _, i in common])
    moved = [{"op": str(key[0]), "old_position": old_k[i][1], "new_position": pos}
             for n, (key, pos, i) in enumerate(common) if n not in kept]
    appeared = [{"op": str(key[0]), "position": pos} for key, pos in new_k
                if key not in old_index]
    vanished = [{"op": str(key[0]), "position": pos} for key, pos in old_k
                if key not in new_keys]
    return moved, appeared, vanished


def _lis(seq: list[int]) -> set[int]:
    """Indices into ``seq`` of one longest strictly increasing subsequence."""
    tails: list[int] = []  # values
    tail_at: list[int] = []  # index in seq of each tail
    parent = [-1] * len(seq)
    for i, x in enumerate(seq):
        k = bisect.bisect_left(tails, x)
        if k == len(tails):
            tails.append(x)
            tail_at.append(i)
        else:
            tails[k] = x
            tail_at[k] = i
        parent[i] = tail_at[k - 1] if k else -1
    out: set[int] = set()
    i = tail_at[-1] if tail_at else -1
    while i >= 0:
        out.add(i)
        i = parent[i]
    return out


def _deadlocks(report) -> bool:
    return any(v.property == "deadlock" for v in report.violations)


def judge(side: Side, comm_model: str = RENDEZVOUS) -> dict:
    """One side's verdict and simulated costs, as JSON: checked (``check.check``) and
    timed unless it deadlocks."""
    own_model = side.spec is None and side.memory is not UNIT_MEMORY  # a caller's own
    question = (question_of(side.memory_limit, comm_model, side.memory) if own_model
                else Question.of_spec(side.spec, side.memory_limit, comm_model,
                                      source=side.target))
    checked = check(side.target, question, side.duration,
                    timing=Timing(side.comm, side.memory), when=lambda r: not _deadlocks(r))
    plan, report, run = checked.plan, checked.report, checked.run
    out = {"source": side.name, "status": report.status, "verified": report.verified,
           "exit_code": report.exit_code, "lowered": isinstance(side.target, Schedule),
           "ranks": plan.num_ranks, "stages": plan.placement.num_stages,
           "microbatches": plan.num_microbatches,
           "compute_ops": sum(len(row) for row in compute_steps(side.target)),
           "violations": [{"property": v.property, "message": v.message}
                          for v in report.violations]}
    error = None
    if _deadlocks(report):
        error = f"not timed: the plan deadlocks under the {comm_model} model"
    elif checked.failure is not None:
        error = str(checked.failure)
    if run is None:
        out.update(makespan=None, bubble_fraction=None, simulation_error=error,
                   peak_memory=figures(report.peak_memory))
    else:
        out.update(makespan=figure(run.makespan),
                   bubble_fraction=round(run.bubble_fraction, 6),
                   peak_memory=figures(run.peak_memory))
    return out


def semantic_diff(old: Side, new: Side, comm_model: str = RENDEZVOUS) -> dict:
    """The diff document (schema in the README, section *diff*)."""
    a, b = compute_steps(old.target), compute_steps(new.target)
    where_old, where_new = _ranks_by_op(a), _ranks_by_op(b)
    ranks = []
    for r in range(max(len(a), len(b))):
        moved, appeared, vanished = rank_diff(a[r] if r < len(a) else [],
                                              b[r] if r < len(b) else [])
        for entry in appeared:
            origin = _elsewhere(where_old, entry["op"], r)
            if origin is not None:
                entry["from_rank"] = origin
        for entry in vanished:
            target = _elsewhere(where_new, entry["op"], r)
            if target is not None:
                entry["to_rank"] = target
        ranks.append({"rank": r, "moved": moved, "appeared": appeared, "vanished": vanished})
    left, right = judge(old, comm_model), judge(new, comm_model)
    changed = [x["rank"] for x in ranks if x["moved"] or x["appeared"] or x["vanished"]]
    return {
        "old": left, "new": right,
        "same_programs": not changed,
        "summary": {"moved": sum(len(x["moved"]) for x in ranks),
                    "appeared": sum(len(x["appeared"]) for x in ranks),
                    "vanished": sum(len(x["vanished"]) for x in ranks),
                    "ranks_changed": changed,
                    "verdict": f"{left['status']} -> {right['status']}"},
        "ranks": ranks,
        "delta": _delta(left, right),
        "violated": sorted({v["property"] for v in right["violations"]}),
        "exit_code": 1 if right["status"] == "violated" else 0,
    }


def _ranks_by_op(steps) -> dict[str, set[int]]:
    out: dict[str, set[int]] = defaultdict(set)
    for r, row in enumerate(steps):
        for c, _ in row:
            out[str(c)].add(r)
    return out


def _elsewhere(where: dict[str, set[int]], text: str, here: int) -> int | None:
    """The lowest rank other than ``here`` holding the op ``text``, if any."""
    others = where.get(text, set()) - {here}
    return min(others) if others else None


def _delta(left: dict, right: dict) -> dict:
    def sub(x, y):
        return None if x is None or y is None else figure(round(y - x, 9))
    peaks = {r: sub(left["peak_memory"][r], right["peak_memory"][r])
             for r in left["peak_memory"] if r in right["peak_memory"]}
    lmax = max(left["peak_memory"].values(), default=None)
    rmax = max(right["peak_memory"].values(), default=None)
    return {"makespan": sub(left["makespan"], right["makespan"]),
            "bubble_fraction": sub(left["bubble_fraction"], right["bubble_fraction"]),
            "peak_memory": peaks, "max_peak_memory": sub(lmax, rmax)}


def render_diff(doc: dict) -> str:
    """The diff as text: verdicts, cost deltas, then per changed rank its ops."""
    old, new, delta = doc["old"], doc["new"], doc["delta"]

    def verdict(side):
        props = sorted({v["property"] for v in side["violations"]})
        return side["status"].upper() + (f" ({', '.join(props)})" if props else "")
    lines = [f"old: {old['source']}: {verdict(old)}",
             f"new: {new['source']}: {verdict(new)}",
             f"makespan: {num_text(old['makespan'])} -> {num_text(new['makespan'])}"
             f"{_signed(delta['makespan'])}",
             f"bubble fraction: {_pct(old['bubble_fraction'])} -> "
             f"{_pct(new['bubble_fraction'])}",
             "peak memory: " + ", ".join(
                 f"rank {r} {num_text(old['peak_memory'][r])} -> "
                 f"{num_text(new['peak_memory'][r])}"
                 f"{_signed(d)}" for r, d in delta["peak_memory"].items())]
    s = doc["summary"]
    if doc["same_programs"]:
        lines.append("compute programs: identical on every rank")
    else:
        lines.append(f"compute programs: {s['moved']} moved, {s['appeared']} appeared, "
                     f"{s['vanished']} vanished on ranks "
                     f"{', '.join(map(str, s['ranks_changed']))}")
    for x in doc["ranks"]:
        if not (x["moved"] or x["appeared"] or x["vanished"]):
            continue
        lines.append(f"rank {x['rank']}: {len(x['moved'])} moved, {len(x['appeared'])} "
                     f"appeared, {len(x['vanished'])} vanished")
        for m in x["moved"]:
            lines.append(f"  moved    {m['op']}: position {m['old_position']} -> "
                         f"{m['new_position']}")
        for m in x["appeared"]:
            origin = f" (from rank {m['from_rank']})" if "from_rank" in m else ""
            lines.append(f"  appeared {m['op']} at position {m['position']}{origin}")
        for m in x["vanished"]:
            target = f" (to rank {m['to_rank']})" if "to_rank" in m else ""
            lines.append(f"  vanished {m['op']} from position {m['position']}{target}")
    if doc["exit_code"]:
        lines.append(f"NEW violates {', '.join(doc['violated'])} (exit 1)")
    return "\n".join(lines) + "\n"


def _signed(d) -> str:
    if d is None:
        return ""
    return f" ({'+' if d >= 0 else '-'}{num_text(abs(d))})"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"
