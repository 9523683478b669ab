"""SVG timelines of a plan: one lane per rank, one box per compute op.

``render_svg(timeline, duration, ...)`` draws a ``sim.Timeline``:

- one lane per rank (``<g class="lane" data-rank="r">``) over a hatched background, so
  idle time shows as hatching between boxes; the right margin gives each rank's idle share;
- one box per compute op (``<rect class="op F" ...>``), filled by kind (``F`` blue, ``B``
  green, ``I`` orange, ``W`` purple), lighter or darker per model segment, labelled with
  its action text (``2F0``: stage 2, forward, microbatch 0) when the label fits, and
  carrying a tooltip (``<title>``) with rank, position, stage, microbatch and times; an
  overlapped step (DualPipeV) stacks its ops in one slot;
- with ``arrows``, one arrow per matched send/receive pair (``semantics.pair_p2p``), from
  the send's post on the producer's lane to the receive's completion on the consumer's;
- with ``memory``, a strip under each lane with the rank's memory level over time
  (docs/semantics.md §2.6), its peak, and the limit as a dashed line when one is given;
- for a run that stops (a counterexample), each blocked op as a dashed red bar from the
  moment it was posted to the right edge; ops named by ``violations`` get a red outline
  (comm ops a red marker), and each violation's message is printed under the legend.

The output is deterministic (same input, same bytes): numbers are printed with at most
two decimals and nothing depends on the clock or the environment.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence
from xml.sax.saxutils import escape, quoteattr

from ..ir import Compute, Idle, Marker, Offload, Op, Reload, computes_of, p2p_of
from ..semantics import pair_p2p
from ..sim import Timeline

KIND_FILL = {"F": "#4c78a8", "B": "#54a24b", "I": "#f58518", "W": "#b279a2", "R": "#72b7b2"}
KIND_NAME = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
             "R": "recompute"}
SEGMENT_SHADE = (0.0, 0.45, -0.35, 0.7, -0.55, 0.25)  # >0 lighter, <0 darker
ARROW_COLOUR = {"act": "#27467a", "grad": "#2f6b2f", "input": "#8c6d31", "lend": "#9d755d",
                "return": "#9d755d"}
ARROW_NAME = {"act": "activation", "grad": "gradient", "input": "segment input",
              "lend": "lent activation", "return": "returned activation"}
MOVE_MARK = "#e45756"  # offload (a triangle down, to host) and reload (up, to device)
RED = "#d62728"

LANE, MEM, GAP = 26, 34, 10
LEFT, RIGHT, TOP = 64, 104, 66
FONT = 11
CHAR = 0.62  # average glyph width in ems (sans-serif digits and capitals)


def render_svg(tl: Timeline, duration: Callable[[Op], float], *, title: str = "",
               arrows: bool = False, memory: bool = False,
               memory_limit: float | Sequence[float] | None = None,
               violations: Iterable = ()) -> str:
    """The SVG text of ``tl`` (see the module docstring). ``violations``: objects with
    ``property``, ``message`` and ``ops`` (``(rank, position, text)``), e.g. a report's."""
    return _Drawing(tl, duration, title, arrows, memory, memory_limit, tuple(violations)).svg()


class _Drawing:
    def __init__(self, tl, duration, title, arrows, memory, memory_limit, violations):
        self.tl, self.duration, self.title = tl, duration, title
        self.arrows, self.memory, self.violations = arrows, memory, violations
        self.limits = _per_rank(memory_limit, tl.plan.num_ranks)
        plan = tl.plan
        self.segments = sorted({c.segment for prog in plan.programs for op in prog
                                for c in computes_of(op)})
        # activation and gradient arrows always have markers; others only when drawn
        shipped = {m.payload.kind for prog in plan.programs for op in prog
                   for m in p2p_of(op)} if arrows else set()
        self.arrow_kinds = [k for k in ARROW_COLOUR if k in ("act", "grad") or k in shipped]
        span = tl.makespan
        self.tail = 0.0 if tl.completed else max(2.0, 0.12 * span)
        self.end = span + self.tail
        self.scale = min(48.0, max(2.0, 960.0 / self.end)) if self.end > 0 else 48.0
        self.block = LANE + (MEM if memory else 0) + GAP
        self.marked = {(r, i): v for v in violations for r, i, _ in v.ops}
        self.width = max(640, round(LEFT + self.end * self.scale + RIGHT))

    # -------------------------------------------------------------- geometry

    def x(self, t: float) -> float:
        return LEFT + t * self.scale

    def lane_y(self, rank: int) -> float:
        return TOP + rank * self.block

    # -------------------------------------------------------------- document

    def svg(self) -> str:
        tl = self.tl
        n = tl.plan.num_ranks
        body: list[str] = []
        body += self._header()
        body += self._grid(n)
        for rank in range(n):
            body += self._lane(rank)
        if self.arrows:
            body += self._arrows()
        body += self._wait_arrows()
        y = TOP + n * self.block + 8
        legend, y = self._legend(y)
        body += legend
        notes, y = self._notes(y)
        body += notes
        height = round(y + 8)
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
                f'height="{height}" viewBox="0 0 {self.width} {height}" '
                f'font-family="Helvetica, Arial, sans-serif" font-size="{FONT}">')
        return "\n".join([head, *self._defs(), f'<rect width="{self.width}" '
                          f'height="{height}" fill="#ffffff"/>', *body, "</svg>"]) + "\n"

    def _defs(self) -> list[str]:
        out = ['<defs>',
               '<pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
               'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3f3f3"/>'
               '<line x1="0" y1="0" x2="0" y2="6" stroke="#dadada" stroke-width="2"/>'
               '</pattern>']
        for kind in self.arrow_kinds:
            colour = ARROW_COLOUR[kind]
            out.append(f'<marker id="arrow-{kind}" viewBox="0 0 8 8" refX="8" refY="4" '
                       f'markerWidth="6" markerHeight="6" orient="auto-start-reverse">'
                       f'<path d="M0,0 L8,4 L0,8 z" fill="{colour}"/></marker>')
        out.append(f'<marker id="arrow-wait" viewBox="0 0 8 8" refX="8" refY="4" '
                   f'markerWidth="5" markerHeight="5" orient="auto-start-reverse">'
                   f'<path d="M0,0 L8,4 L0,8 z" fill="{RED}"/></marker>')
        out.append('</defs>')
        return out

    def _header(self) -> list[str]:
        tl = self.tl
        plan = tl.plan
        busy = sum(tl.busy(r, self.duration) for r in range(plan.num_ranks))
        total = tl.makespan * plan.num_ranks
        bubble = (1 - busy / total) if total else 0.0
        what = (f"makespan {_n(tl.makespan)}, bubble {bubble:.1%}" if tl.completed else
                f"stops at time {_n(tl.makespan)}: {len(tl.waits)} of {plan.num_ranks} "
                f"ranks blocked ({tl.comm_model})")
        sub = (f"{what} · {plan.num_ranks} ranks, {plan.placement.num_stages} stages, "
               f"{plan.num_microbatches} microbatches")
        return [_text(LEFT, 20, self.title or "schedule", size=14, weight="bold",
                      cls="title"),
                _text(LEFT, 37, sub, fill="#444444", cls="subtitle")]

    def _grid(self, n: int) -> list[str]:
        """Time axis: a tick label every ``step`` time units and a faint vertical line."""
        step = _nice_step(36.0 / self.scale)
        top, bottom = TOP - 6, TOP + n * self.block - GAP + 2
        out = ['<g class="axis" fill="#666666" stroke="#e2e2e2">',
               _text(LEFT - 8, TOP - 12, "time", anchor="end", stroke="none")]
        k = 0
        while k * step <= self.end + 1e-9:
            x = _n(self.x(k * step))
            out.append(f'<line x1="{x}" y1="{_n(top)}" x2="{x}" y2="{_n(bottom)}"/>')
            out.append(_text(self.x(k * step), TOP - 12, _n(k * step), anchor="middle",
                             stroke="none"))
            k += 1
        out.append("</g>")
        return out

    # -------------------------------------------------------------- lanes

    def _lane(self, rank: int) -> list[str]:
        tl, plan = self.tl, self.tl.plan
        y = self.lane_y(rank)
        prog = plan.programs[rank]
        out = [f'<g class="lane" data-rank="{rank}">',
               _text(LEFT - 8, y + LANE / 2 + 4, f"rank {rank}", anchor="end",
                     weight="bold", cls="rank"),
               f'<rect class="idle" x="{_n(self.x(0))}" y="{_n(y)}" '
               f'width="{_n(tl.makespan * self.scale)}" height="{LANE}" fill="url(#idle)"/>']
        for index in range(tl.executed(rank)):
            op = prog[index]
            t0, t1 = tl.start[rank][index], tl.finish[rank][index]
            subs = computes_of(op)
            if subs:
                h = LANE / len(subs)
                for k, c in enumerate(subs):
                    out += self._box(rank, index, c, t0, t1, y + k * h, h, op)
            elif (rank, index) in self.marked and not isinstance(op, (Idle, Marker)):
                out.append(self._comm_mark(rank, index, op, t0, t1, y))
            elif isinstance(op, (Offload, Reload)):
                out.append(self._move_mark(rank, index, op, t0, y))
        for w in tl.waits:
            if w.rank == rank:
                out.append(self._blocked(w, y))
        out.append(self._side_note(rank, y))
        out.append("</g>")
        if self.memory:
            out += self._memory(rank, y + LANE + 3)
        return out

    def _box(self, rank, index, c: Compute, t0, t1, y, h, op) -> list[str]:
        fill = _shade(KIND_FILL[c.kind], self._segment_shade(c.segment))
        x, w = self.x(t0), max((t1 - t0) * self.scale, 0.5)
        marked = (rank, index) in self.marked
        cls = f"op {c.kind}" + (" violation" if marked else "")
        stroke = (f' stroke="{RED}" stroke-width="2.5"' if marked
                  else ' stroke="#ffffff" stroke-width="1"')
        seg = f"segment {c.segment}, " if c.segment else ""
        tip = (f"{c} — {KIND_NAME[c.kind]}, {seg}stage {c.stage}, microbatch {c.mb}; "
               f"rank {rank}, position {index}; time {_n(t0)}–{_n(t1)}")
        if len(computes_of(op)) > 1:
            tip += f"; overlapped step {';'.join(map(str, computes_of(op)))}"
        if marked:
            tip += f"; {self.marked[(rank, index)].property} violation"
        out = [f'<rect class="{cls}" data-rank="{rank}" data-position="{index}" '
               f'x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{_n(h)}" rx="2" '
               f'fill="{fill}"{stroke}><title>{escape(tip)}</title></rect>']
        label = str(c)
        size = min(FONT, h - 3)
        while size >= 8 and len(label) * CHAR * size > w - 3:
            size -= 1
        if size >= 8:
            out.append(_text(x + w / 2, y + h / 2 + size * 0.36, label, anchor="middle",
                             size=size, fill=_ink(fill), cls="label"))
        return out

    def _move_mark(self, rank, index, op, t, y) -> str:
        """A small triangle at the lane's foot: down for an offload (to host memory), up
        for a reload (back to the device)."""
        x, foot = self.x(t), y + LANE
        tip, base = (foot, foot - 6) if isinstance(op, Offload) else (foot - 6, foot)
        where = "to host memory" if isinstance(op, Offload) else "back to the device"
        return (f'<path class="move {type(op).__name__.lower()}" data-rank="{rank}" '
                f'data-position="{index}" d="M{_n(x - 3.5)},{_n(base)} L{_n(x + 3.5)},'
                f'{_n(base)} L{_n(x)},{_n(tip)} Z" fill="{MOVE_MARK}"><title>'
                f'{escape(str(op))} — activation of stage {op.stage}, microbatch {op.mb}, '
                f'{where}; rank {rank}, position {index}; time {_n(t)}</title></path>')

    def _comm_mark(self, rank, index, op, t0, t1, y) -> str:
        v = self.marked[(rank, index)]
        x = self.x(t0)
        w = max((t1 - t0) * self.scale, 6.0)
        tip = f"{op} — rank {rank}, position {index}; {v.property} violation: {v.message}"
        return (f'<rect class="comm violation" data-rank="{rank}" data-position="{index}" '
                f'x="{_n(x - 3 if t1 == t0 else x)}" y="{_n(y - 3)}" width="{_n(w)}" '
                f'height="{LANE + 6}" fill="none" stroke="{RED}" stroke-width="2">'
                f'<title>{escape(tip)}</title></rect>')

    def _blocked(self, wait, y) -> str:
        op = self.tl.plan.programs[wait.rank][wait.index]
        t0 = self.tl.blocked_since(wait.rank)
        x0, x1 = self.x(t0), self.x(self.end)
        marked = (wait.rank, wait.index) in self.marked
        cls = "blocked" + (" violation" if marked else "")
        tip = f"rank {wait.rank}, position {wait.index}: blocked forever: {wait.reason}"
        if marked:
            tip += f"; {self.marked[(wait.rank, wait.index)].property} violation"
        text = ""
        for label in (f"blocked: {op}", str(op)):
            if len(label) * CHAR * FONT <= x1 - x0 - 6:
                text = _text(x0 + 4, y + LANE / 2 + 4, label, fill=RED, weight="bold",
                             cls="label")
                break
        style = (f'fill="#f7c4c4" stroke="{RED}" stroke-width="3"' if marked else
                 f'fill="#fbe3e3" stroke="{RED}" stroke-width="2" stroke-dasharray="5 3"')
        return (f'<rect class="{cls}" data-rank="{wait.rank}" data-position="{wait.index}" '
                f'x="{_n(x0)}" y="{_n(y + 1)}" width="{_n(max(x1 - x0, 4))}" '
                f'height="{LANE - 2}" {style}><title>{escape(tip)}</title></rect>{text}')

    def _wait_arrows(self) -> list[str]:
        """For each blocked op named by a violation (a wait-for cycle), a red arrow to
        the rank it waits for."""
        tl = self.tl
        blocked = {w.rank for w in tl.waits}
        out = []
        for w in tl.waits:
            if (w.rank, w.index) not in self.marked or w.on is None or w.on[0] not in blocked:
                continue
            q = w.on[0]
            down = q > w.rank
            shift = 10 if down else 24  # arrows of a two-rank cycle run side by side
            x1 = self.x(tl.blocked_since(w.rank)) + shift
            x2 = self.x(tl.blocked_since(q)) + shift
            y1 = self.lane_y(w.rank) + (LANE if down else 0)
            y2 = self.lane_y(q) + (0 if down else LANE)
            other = tl.plan.programs[w.on[0]][w.on[1]]
            out.append(f'<line class="waits-for" x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" '
                       f'y2="{_n(y2)}" stroke="{RED}" stroke-width="2" '
                       f'marker-end="url(#arrow-wait)"><title>rank {w.rank} waits for rank '
                       f'{q} to reach position {w.on[1]} ({escape(str(other))})</title>'
                       f'</line>')
        return out

    def _side_note(self, rank, y) -> str:
        tl = self.tl
        x = self.x(self.end) + 10
        if not tl.completed and any(w.rank == rank for w in tl.waits):
            return _text(x, y + LANE / 2 + 4, "blocked", fill=RED, cls="note")
        busy = tl.busy(rank, self.duration)
        idle = (1 - busy / tl.makespan) if tl.makespan else 0.0
        return _text(x, y + LANE / 2 + 4, f"idle {idle:.0%}", fill="#555555", cls="note")

    def _segment_shade(self, segment: str) -> float:
        if len(self.segments) < 2:
            return 0.0
        return SEGMENT_SHADE[self.segments.index(segment) % len(SEGMENT_SHADE)]

    # -------------------------------------------------------------- memory

    def _memory(self, rank: int, top: float) -> list[str]:
        tl = self.tl
        h = MEM - 8
        vmax = 1.1 * max([*tl.peak_memory.values(), *(x for x in self.limits if x is not None),
                          1e-9])  # headroom: a limit at the peak stays visible
        base = top + h

        def y(level: float) -> float:
            return base - h * level / vmax
        points = tl.memory[rank]
        end = tl.makespan if tl.completed else tl.blocked_since(rank)
        d = [f"M{_n(self.x(0))},{_n(base)}", f"V{_n(y(points[0][1]))}"]
        for t, level in points[1:]:
            d.append(f"H{_n(self.x(t))}V{_n(y(level))}")
        d.append(f"H{_n(self.x(max(end, points[-1][0])))}V{_n(base)}Z")
        peak = tl.peak_memory.get(rank, 0.0)
        out = [f'<g class="memory" data-rank="{rank}">',
               f'<line x1="{_n(self.x(0))}" y1="{_n(base)}" x2="{_n(self.x(self.end))}" '
               f'y2="{_n(base)}" stroke="#bbbbbb"/>',
               f'<path d="{"".join(d)}" fill="#9ecae1" fill-opacity="0.55" '
               f'stroke="#3182bd" stroke-width="1"><title>rank {rank} memory, peak '
               f'{_n(peak)}</title></path>',
               _text(LEFT - 8, base - 2, "mem", anchor="end", fill="#3182bd", size=9)]
        note = f"peak {_n(peak)}"
        limit = self.limits[rank]
        if limit is not None:
            over = peak > limit
            out.append(f'<line class="limit" x1="{_n(self.x(0))}" y1="{_n(y(limit))}" '
                       f'x2="{_n(self.x(self.end))}" y2="{_n(y(limit))}" stroke="{RED}" '
                       f'stroke-dasharray="4 3"><title>memory limit {_n(limit)}</title>'
                       f'</line>')
            note += f" / {_n(limit)}" + (" over" if over else "")
        out.append(_text(self.x(self.end) + 10, base - 2, note, size=9,
                         fill=RED if limit is not None and peak > limit else "#3182bd"))
        out.append("</g>")
        return out

    # -------------------------------------------------------------- arrows

    def _arrows(self) -> list[str]:
        tl, plan = self.tl, self.tl.plan
        out = ['<g class="arrows" fill="none" stroke-width="1" stroke-opacity="0.6">']
        for (src, dst), pairs in sorted(pair_p2p(plan).channels.items()):
            for (sr, si, sm), (rr, ri, _) in pairs:
                if si >= tl.executed(sr) or ri >= tl.executed(rr):
                    continue
                payload = p2p_of(plan.programs[sr][si])[sm].payload
                x1, x2 = self.x(tl.start[sr][si]), self.x(tl.finish[rr][ri])
                down = rr > sr
                y1 = self.lane_y(sr) + (LANE if down else 0)
                y2 = self.lane_y(rr) + (0 if down else LANE)
                if rr == sr:
                    y1 = y2 = self.lane_y(sr) + LANE / 2
                colour = ARROW_COLOUR[payload.kind]
                out.append(f'<line class="flow {payload.kind}" x1="{_n(x1)}" y1="{_n(y1)}" '
                           f'x2="{_n(x2)}" y2="{_n(y2)}" stroke="{colour}" '
                           f'marker-end="url(#arrow-{payload.kind})"><title>'
                           f'{escape(str(plan.programs[sr][si]))} rank {sr} → '
                           f'{escape(str(plan.programs[rr][ri]))} rank {rr}</title></line>')
        out.append("</g>")
        return out

    # -------------------------------------------------------------- legend and notes

    def _legend(self, y: float) -> tuple[list[str], float]:
        plan = self.tl.plan
        kinds = [k for k in KIND_FILL if any(c.kind == k for prog in plan.programs
                                              for op in prog for c in computes_of(op))]
        items: list[tuple[str, str]] = [(f'fill="{KIND_FILL[k]}"', f"{k} {KIND_NAME[k]}")
                                        for k in kinds]
        if len(self.segments) > 1:
            for s in self.segments:
                shade = _shade("#888888", self._segment_shade(s))
                items.append((f'fill="{shade}"', f"segment {s or '(default)'}"))
        items.append(('fill="url(#idle)" stroke="#cccccc"', "idle"))
        if any(isinstance(op, (Offload, Reload)) for prog in plan.programs for op in prog):
            items.append((f'fill="{MOVE_MARK}"', "offload ▼ / reload ▲"))
        if self.arrows:
            items += [(f'fill="{ARROW_COLOUR[k]}"', f"{ARROW_NAME[k]} send→recv")
                      for k in self.arrow_kinds]
        if self.memory:
            items.append(('fill="#9ecae1" stroke="#3182bd"', "memory"))
        if not self.tl.completed:
            items.append((f'fill="#fbe3e3" stroke="{RED}" stroke-dasharray="3 2"', "blocked"))
        if self.violations:
            items.append((f'fill="#ffffff" stroke="{RED}" stroke-width="2"', "violation"))
        out = ['<g class="legend">']
        x = LEFT
        for swatch, label in items:
            w = 14 + 6 + len(label) * CHAR * FONT + 14
            if x + w > self.width - 8 and x > LEFT:
                x, y = LEFT, y + 18
            out.append(f'<rect x="{_n(x)}" y="{_n(y)}" width="14" height="12" {swatch}/>')
            out.append(_text(x + 20, y + 10, label, fill="#333333"))
            x += w
        out.append("</g>")
        return out, y + 18

    def _notes(self, y: float) -> tuple[list[str], float]:
        if not self.violations:
            return [], y
        tl = self.tl
        limit = max(20, int((self.width - LEFT - 10) / (CHAR * FONT)))
        out = ['<g class="violations">']
        for v in self.violations:
            lines = [f"{v.property}: {v.message}"]
            for r, i, text in v.ops:
                if i >= tl.executed(r) and not any(w.rank == r and w.index == i
                                                   for w in tl.waits):
                    lines.append(f"  rank {r}, position {i} ({text}) is never reached")
            for k, line in enumerate(lines):
                y += 15
                shown = line if len(line) <= limit else line[:limit - 1] + "…"
                out.append(_text(LEFT, y, shown, fill=RED if k == 0 else "#555555",
                                 cls="violation-note", tip=line if shown != line else ""))
        out.append("</g>")
        return out, y + 4


# ---------------------------------------------------------------- helpers


def _per_rank(limit, ranks: int) -> list[float | None]:
    if limit is None:
        return [None] * ranks
    if isinstance(limit, (int, float)):
        return [float(limit)] * ranks
    return [float(limit[r]) if r < len(limit) else None for r in range(ranks)]


def _n(x: float) -> str:
    """A number with at most two decimals, no trailing zeros (deterministic output)."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _nice_step(minimum: float) -> float:
    """The smallest of 1, 2, 5 × 10^k that is at least ``minimum``."""
    if minimum <= 0:
        return 1.0
    k = math.floor(math.log10(minimum))
    for m in (1, 2, 5, 10):
        step = m * 10.0 ** k
        if step >= minimum - 1e-12:
            return step
    return 10.0 ** (k + 1)


def _text(x: float, y: float, text: str, *, anchor: str = "start", size: float | None = None,
          fill: str | None = None, weight: str | None = None, cls: str | None = None,
          stroke: str | None = None, tip: str = "") -> str:
    attrs = [f'x="{_n(x)}"', f'y="{_n(y)}"']
    if anchor != "start":
        attrs.append(f'text-anchor="{anchor}"')
    if size is not None and size != FONT:
        attrs.append(f'font-size="{_n(size)}"')
    if fill:
        attrs.append(f'fill="{fill}"')
    if stroke:
        attrs.append(f'stroke="{stroke}"')
    if weight:
        attrs.append(f'font-weight="{weight}"')
    if cls:
        attrs.append(f"class={quoteattr(cls)}")
    title = f"<title>{escape(tip)}</title>" if tip else ""
    return f"<text {' '.join(attrs)}>{title}{escape(text)}</text>"


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def _shade(colour: str, amount: float) -> str:
    """Mix ``colour`` towards white (``amount > 0``) or black (``amount < 0``)."""
    target = 255 if amount > 0 else 0
    a = abs(amount)
    return "#" + "".join(f"{round(c + (target - c) * a):02x}" for c in _rgb(colour))


def _ink(fill: str) -> str:
    """Black or white text, whichever reads better on ``fill``."""
    r, g, b = _rgb(fill)
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"
