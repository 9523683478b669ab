"""An independent reference interpreter of DESIGN §3 (the judge of the family tests).

Written from the design text only; it shares no code with ``mpipe_verified``. A plan is
plain data: per rank a list of PyTorch action strings (``2F0``, ``0I3``, ``0W3``,
``1SEND_F3``, ``2RECV_B0``, ``(0F7;7B3)OVERLAP_F_B``; ``""`` is an idle step, ``UNSHARD``/
``RESHARD``/``REDUCE_GRAD`` are ignored) plus the stage -> rank list. Groups and
collectives are not supported (an unknown action is reported as a problem).

Rules (DESIGN §3, rendezvous model):
- each rank runs its actions in order; a compute step runs at once;
- a ``SEND`` and its ``RECV`` complete together, only when both ranks stand at them; the
  k-th send ``src -> dst`` pairs with the k-th receive at ``dst`` from ``src`` (both are
  blocking, so the pair is simply "both heads point at each other");
- a comm cell names a stage of its own rank (SEND: the producer, RECV: the consumer) and
  a peer stage on another rank;
- ``SEND_F`` of stage s mb k must meet ``RECV_F`` of stage s+1 mb k, ``SEND_B`` of stage s
  must meet ``RECV_B`` of stage s-1 mb k; anything else is a mismatch (the data that
  arrives is what was sent);
- §3.5 inputs: ``F(s, mb)`` needs the activation of ``s-1`` (local F or earlier RECV_F);
  ``B``/``I(s, mb)`` need a local ``F(s, mb)`` and the gradient of ``s+1`` (local B/I or
  earlier RECV_B) unless s is last; ``W`` needs ``I``; a SEND needs what it sends. An
  overlapped step reads all inputs before it and publishes all outputs after it;
- unit memory: ``F`` stores 1, freed by ``B`` or ``W`` (allocations of a step count
  before its frees).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ACTION = re.compile(r"(\d+)(F|B|I|W|SEND_F|SEND_B|RECV_F|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)")
OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


@dataclass
class Result:
    completed: bool = False
    stuck: dict = field(default_factory=dict)         # rank -> (index, action)
    incomplete: list = field(default_factory=list)    # completeness problems
    violations: list = field(default_factory=list)    # dependency problems, in run order
    mismatches: list = field(default_factory=list)
    problems: list = field(default_factory=list)      # bad actions, comm on one rank, ...
    peak: list = field(default_factory=list)          # per-rank peak stored activations

    @property
    def first_violation(self):
        return self.violations[0] if self.violations else None

    @property
    def ok(self) -> bool:
        return (self.completed and not self.incomplete and not self.violations
                and not self.mismatches and not self.problems)


def parse(action: str):
    """``(kind, stage, mb)`` tuples of one cell: ``[]`` for idle and markers."""
    action = action.strip()
    if not action:
        return []
    m = OVERLAP.fullmatch(action)
    parts = m.group(1).split(";") if m else [action]
    out = []
    for part in parts:
        a = ACTION.fullmatch(part.strip())
        if a is None:
            raise ValueError(f"unknown action {action!r}")
        if a.group(2) not in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
            out.append((a.group(2), int(a.group(1)), int(a.group(3))))
    return out


def run(programs, stage_to_rank, microbatches) -> Result:
    res = Result()
    n, last = len(programs), len(stage_to_rank) - 1
    steps = []
    for r, prog in enumerate(programs):
        try:
            steps.append([parse(a) for a in prog])
        except ValueError as e:
            res.problems.append(f"rank {r}: {e}")
            return res
    # completeness: F once, and B once or I+W once, on the owning rank; nothing else
    count = {}
    for r, prog in enumerate(steps):
        for step in prog:
            for kind, s, mb in step:
                if kind in "FBIW":
                    if s > last or mb >= microbatches or stage_to_rank[s] != r:
                        res.incomplete.append(f"{s}{kind}{mb} is not work of rank {r}")
                    count[(kind, s, mb)] = count.get((kind, s, mb), 0) + 1
    for s in range(last + 1):
        for mb in range(microbatches):
            f, b, i, w = (count.pop((k, s, mb), 0) for k in "FBIW")
            if f != 1 or not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                res.incomplete.append(f"stage {s} mb {mb}: F={f} B={b} I={i} W={w}")
    res.incomplete += [f"unexpected {s}{k}{mb}" for (k, s, mb) in count]

    have = [set() for _ in range(n)]   # tokens: ("act"|"grad"|"stored"|"I", stage, mb)
    live = [set() for _ in range(n)]
    level, res.peak = [0] * n, [0] * n
    pc = [0] * n

    def peer(kind, s):
        t = s + 1 if kind in ("SEND_F", "RECV_B") else s - 1
        return stage_to_rank[t] if 0 <= t <= last else None

    def needs(kind, s, mb):
        if kind == "F":
            return [("act", s - 1, mb)] if s > 0 else []
        if kind in ("B", "I"):
            return [("stored", s, mb)] + ([("grad", s + 1, mb)] if s < last else [])
        if kind == "W":
            return [("I", s, mb)]
        if kind == "SEND_F":
            return [("act", s, mb)]
        return [("grad", s, mb)] if kind == "SEND_B" else []

    def check(r, i, step):
        for kind, s, mb in step:
            missing = [t for t in needs(kind, s, mb) if t not in have[r]]
            if missing:
                res.violations.append((r, i, f"{s}{kind}{mb}", missing[0]))

    def compute(r, step):
        for kind, s, mb in step:
            if kind == "F":
                have[r] |= {("act", s, mb), ("stored", s, mb)}
                live[r].add((s, mb))
                level[r] += 1
            elif kind in ("B", "I"):
                have[r].add(("grad", s, mb))
                if kind == "I":
                    have[r].add(("I", s, mb))
        res.peak[r] = max(res.peak[r], level[r])
        for kind, s, mb in step:
            if kind in ("B", "W") and (s, mb) in live[r]:
                live[r].remove((s, mb))
                level[r] -= 1

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if not step or step[0][0] in "FBIW":
                    check(r, pc[r], step)
                    compute(r, step)
                    pc[r] += 1
                    progress = True
                    continue
                kind, s, mb = step[0]
                d = peer(kind, s)
                if d is None or d == r or not 0 <= s <= last or stage_to_rank[s] != r:
                    bad = f"rank {r} op {pc[r]}: {s}{kind}{mb} has peer rank {d}"
                    res.problems += [bad] if bad not in res.problems else []
                    break
                if pc[d] >= len(steps[d]) or not steps[d][pc[d]]:
                    break
                k2, s2, mb2 = steps[d][pc[d]][0]
                if k2 not in ("SEND_F", "SEND_B", "RECV_F", "RECV_B") or peer(k2, s2) != r \
                        or (k2[:4] == kind[:4]):
                    break  # peer is not (yet) at the other end of this channel
                (sr, si, (sk, ss, smb)), (rr, ri, (rk, rs, rmb)) = sorted(
                    [(r, pc[r], (kind, s, mb)), (d, pc[d], (k2, s2, mb2))],
                    key=lambda e: e[2][0][0] != "S")
                check(sr, si, [(sk, ss, smb)])
                want = ("RECV_F", ss + 1, smb) if sk == "SEND_F" else ("RECV_B", ss - 1, smb)
                if (rk, rs, rmb) != want:
                    res.mismatches.append(((sr, si, f"{ss}{sk}{smb}"), (rr, ri, f"{rs}{rk}{rmb}")))
                have[rr].add(("act" if sk == "SEND_F" else "grad", ss, smb))
                pc[r] += 1
                pc[d] += 1
                progress = True
    res.stuck = {r: (pc[r], programs[r][pc[r]]) for r in range(n) if pc[r] < len(steps[r])}
    res.completed = not res.stuck
    return res


def run_plan(plan) -> Result:
    """Adapter: the only coupling to the package is ``str(op)`` and the stage list."""
    return run([[str(op) for op in prog] for prog in plan.programs],
               list(plan.placement.stage_to_rank), plan.num_microbatches)
