"""Text rendering of a schedule or plan as a per-rank time grid.

One line per rank; each column is one time quantum (the largest step that divides every
op's duration: 1 with the standard costs, where a ``B`` spans 2 columns). An op's cell
holds its text (``0F3``, ``1B0``, an overlapped step as ``0F7;7B3``) padded over its
span; idle columns show ``.``. Times come from ``sim.timeline``, as in the
SVG and the Chrome trace: a compute-only schedule is lowered, the plan runs with its sends
and receives under eager (transfers free; collectives are barriers, not drawn), and a plan
that blocks is drawn as far as it runs. A compute-only schedule whose inputs never arrive
(an op before its producer) is timed by data flow (``semantics.schedule_times``) instead:
its lowered plan would run such an op anyway. A footer gives the makespan (or where the
run stops), each rank's idle time (bubble) and peak memory (``semantics.peak_memory``),
and every rank that cannot finish. Wide grids wrap into blocks of columns that fit
``width`` characters.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

from .figures import num_text
from .ir import Collective, Op, Plan, Schedule, computes_of
from .semantics import (UNIT_MEMORY, Chain, MemoryModel, host_peaks, peak_memory, schedule_times,
                        standard_duration)
from .sim import timeline

IDLE = "."


def render_grid(target: Schedule | Plan, duration: Callable[[Op], float] = standard_duration,
                memory: MemoryModel = UNIT_MEMORY, width: int = 0) -> str:
    """The grid text of ``target`` (``width`` 0: never wrap). Ends with a newline."""
    runs, footer = _timed(target, duration, memory)
    steps = [[(op, s, f) for op, s, f in row if computes_of(op)] for row in runs]
    quantum = _quantum([f - s for row in steps for _, s, f in row] or [1.0])
    cells: list[dict[int, tuple[str, int]]] = []  # rank -> first column -> (text, columns)
    for row in steps:
        cells.append({round(s / quantum): (_text(op), max(1, round((f - s) / quantum)))
                      for op, s, f in row})
    ncols = max((c + n for row in cells for c, (_, n) in row.items()), default=0)
    cw = max([len(IDLE) + 1] + [math.ceil((len(t) + 1) / n) for row in cells
                                 for t, n in row.values()])
    label = max(len(f"rank {len(runs) - 1}"), len("time")) + 1
    per_block = max(1, (width - label - 2) // cw) if width else max(1, ncols)
    lines: list[str] = []
    for b0 in range(0, max(ncols, 1), per_block):
        b1 = min(ncols, b0 + per_block)
        if b0:
            lines.append("")
        axis = "".join(f"{num_text(c * quantum):<{cw}}" if c % 5 == 0 else " " * cw
                       for c in range(b0, b1))
        lines.append(f"{'time':<{label}}| {axis}".rstrip())
        for r, row in enumerate(cells):
            lines.append(f"{f'rank {r}':<{label}}| {_row(row, b0, b1, cw)}".rstrip())
    lines.append("")
    lines.extend(footer)
    return "\n".join(lines) + "\n"


def _timed(target: Schedule | Plan, duration, memory) -> tuple[list[list[tuple]], list[str]]:
    """Per rank, ``(op, start, finish)`` of each op that ran, and the footer lines."""
    if isinstance(target, Schedule):
        # collectives stay for the timing (a transpose's broadcast gates the segment forwards)
        programs = tuple(tuple(op for op in prog
                               if computes_of(op) or isinstance(op, Collective))
                         for prog in target.programs)
        flow = schedule_times(programs, target.placement, duration, chain=Chain.of(target))
        if flow.stuck:  # an input never arrives: the lowered plan would not notice
            runs = [list(zip(prog, flow.start[r], flow.finish[r]))
                    for r, prog in enumerate(programs)]
            stuck = [f"rank {r} is stuck at compute step {index} ({programs[r][index]}): "
                     f"waits for {token.kind} of stage {token.stage} microbatch {token.mb}"
                     for r, index, token in flow.stuck]
            return runs, _footer(target, runs, flow.makespan, None, duration, memory) + stuck
    run = timeline(target, duration, memory)
    programs = run.plan.programs
    runs = [[(programs[r][i], run.start[r][i], run.finish[r][i]) for i in range(run.executed(r))]
            for r in range(run.plan.num_ranks)]
    blocked = [f"rank {w.rank} is blocked at position {w.index}: {w.reason}"
               for w in run.waits]
    stops = None if run.completed else (f"stops at time {num_text(run.makespan)}: "
                                        f"{len(run.waits)} of {len(runs)} ranks blocked "
                                        f"({run.comm_model})")
    return runs, _footer(target, runs, run.makespan, stops, duration, memory) + blocked


def _quantum(durations: list[float]) -> float:
    """The largest step dividing every positive duration (durations rounded to 1/1000)."""
    fracs = [Fraction(d).limit_denominator(1000) for d in durations if d > 0] or [Fraction(1)]
    den = math.lcm(*(f.denominator for f in fracs))
    return math.gcd(*(int(f * den) for f in fracs)) / den


def _row(row: dict[int, tuple[str, int]], b0: int, b1: int, cw: int) -> str:
    out: list[str] = []
    c = b0
    for start, (_, n) in row.items():  # an op begun in an earlier block continues here
        if start < b0 < start + n:
            out.append(" " * (cw * (min(start + n, b1) - b0)))
            c = min(start + n, b1)
    while c < b1:
        if c in row:
            text, n = row[c]
            n = min(n, b1 - c)
            w = cw * n
            out.append(text.ljust(w) if len(text) < w else text[:w - 1] + " ")
            c += n
        else:
            out.append(f"{IDLE:<{cw}}")
            c += 1
    return "".join(out)


def _text(op: Op) -> str:
    """``str(op)``; an overlapped step is shown as ``0F7;7B3``."""
    return ";".join(map(str, computes_of(op)))


def _footer(target, runs, span, stops: str | None, duration, memory) -> list[str]:
    """Makespan (or ``stops``: where a blocked run ends), bubble, and each rank's busy and
    idle time (compute steps and collectives that ran) and peak memory."""
    plan = target if isinstance(target, Plan) else Plan.from_schedule(target)
    peaks = peak_memory(plan, memory)
    busy = [sum(duration(op) for op, _, _ in row if computes_of(op) or isinstance(op, Collective))
            for row in runs]
    total = span * len(runs)
    ratio = (1 - sum(busy) / total) if total else 0.0
    out = [f"{stops or f'makespan {num_text(span)}'}, bubble {ratio:.1%} "
           f"({len(runs)} ranks, {plan.num_microbatches} microbatches)"]
    host = host_peaks(plan, memory)  # offloaded activations (§2.10), on ranks that offload
    for r in range(len(runs)):
        out.append(f"rank {r}: busy {num_text(busy[r])}, "
                   f"idle {num_text(span - busy[r])}, peak memory {num_text(peaks[r][0])}"
                   + (f", host peak {num_text(host[r])}" if r in host else ""))
    return out
