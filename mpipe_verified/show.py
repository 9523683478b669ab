"""Text rendering of a schedule or plan as a per-rank time grid.

One line per rank; each column is one time quantum (the largest step that divides every
op's duration: 1 with the standard costs, where a ``B`` spans 2 columns). An op's cell
holds its text (``0F3``, ``1B0``, an overlapped step as ``0F7;7B3``) padded over its
span; idle columns show ``.``. Times come from ``semantics.schedule_times`` over the
compute steps and collectives (point-to-point ops, idle cells and markers are dropped:
transfers are implicit and free; a collective is a zero-cost barrier, not drawn). A footer gives the makespan, each rank's
idle time (bubble) and peak memory (``semantics.peak_memory``), and any rank that cannot
finish. Wide grids wrap into blocks of columns that fit ``width`` characters.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

from .ir import Collective, Op, Plan, Schedule, computes_of
from .semantics import UNIT_MEMORY, MemoryModel, peak_memory, schedule_times, standard_duration

IDLE = "."


def render_grid(target: Schedule | Plan, duration: Callable[[Op], float] = standard_duration,
                memory: MemoryModel = UNIT_MEMORY, width: int = 0) -> str:
    """The grid text of ``target`` (``width`` 0: never wrap). Ends with a newline."""
    # collectives stay for the timing (a transpose's broadcast gates the segment forwards)
    programs = tuple(tuple(op for op in prog if computes_of(op) or isinstance(op, Collective))
                     for prog in target.programs)
    timing = schedule_times(programs, target.placement, duration, cut=target.cut)
    spans = [list(zip(timing.start[r], timing.finish[r])) for r in range(len(programs))]
    quantum = _quantum([f - s for row in spans for s, f in row] or [1.0])
    cells: list[dict[int, tuple[str, int]]] = []  # rank -> first column -> (text, columns)
    for r, row in enumerate(spans):
        cells.append({round(s / quantum): (_text(op), max(1, round((f - s) / quantum)))
                      for op, (s, f) in zip(programs[r], row) if computes_of(op)})
    ncols = max((c + n for row in cells for c, (_, n) in row.items()), default=0)
    cw = max([len(IDLE) + 1] + [math.ceil((len(t) + 1) / n) for row in cells
                                 for t, n in row.values()])
    label = max(len(f"rank {len(programs) - 1}"), len("time")) + 1
    per_block = max(1, (width - label - 2) // cw) if width else max(1, ncols)
    lines: list[str] = []
    for b0 in range(0, max(ncols, 1), per_block):
        b1 = min(ncols, b0 + per_block)
        if b0:
            lines.append("")
        axis = "".join(f"{_num(c * quantum):<{cw}}" if c % 5 == 0 else " " * cw
                       for c in range(b0, b1))
        lines.append(f"{'time':<{label}}| {axis}".rstrip())
        for r, row in enumerate(cells):
            lines.append(f"{f'rank {r}':<{label}}| {_row(row, b0, b1, cw)}".rstrip())
    lines.append("")
    lines.extend(_footer(target, programs, timing, duration, memory))
    return "\n".join(lines) + "\n"


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


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _footer(target, programs, timing, duration, memory) -> list[str]:
    plan = target if isinstance(target, Plan) else Plan.from_schedule(target)
    span = timing.makespan
    peaks = peak_memory(plan, memory)
    busy = [sum(duration(op) for op in prog[:len(timing.start[r])])
            for r, prog in enumerate(programs)]
    total = span * len(programs)
    ratio = (1 - sum(busy) / total) if total else 0.0
    out = [f"makespan {_num(span)}, bubble {ratio:.1%} "
           f"({len(programs)} ranks, {plan.num_microbatches} microbatches)"]
    for r in range(len(programs)):
        out.append(f"rank {r}: busy {_num(busy[r])}, idle {_num(span - busy[r])}, "
                   f"peak memory {_num(peaks[r][0])}")
    for r, index, token in timing.stuck:
        out.append(f"rank {r} is stuck at compute step {index} ({programs[r][index]}): "
                   f"waits for {token.kind} of stage {token.stage} microbatch {token.mb}")
    return out
