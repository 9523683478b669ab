"""Dump one of PyTorch's own pipeline schedules as PyTorch's pipelining CSV.

No process group and no model are needed: torch's schedule classes compute every rank's
order in their constructor, so they are built here over mock stages (only the attributes
the constructors read) and written with torch's own ``_dump_csv``.

    python examples/torch_schedule.py NAME --pp P --microbatches M [--chunks V] [--comms] -o OUT

NAME is a torch schedule class name: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble
(looped placement, ``--chunks`` stages per rank), ZBVZeroBubble, DualPipeV (V placement)
or GPipe, 1F1B (one stage per rank; compute-only). ``--comms`` writes the lowered plan
with torch's SEND/RECV cells (``format="compute_comms"``). Then run
``mpipe-verify check OUT``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

SINGLE, VSHAPE = ("GPipe", "1F1B"), ("ZBVZeroBubble", "DualPipeV")


class MockStage:
    """What torch's schedule constructors read from a ``_PipelineStageBase``."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        self.stage_index, self.num_stages, self.group_size = stage_index, num_stages, group_size
        self.group_rank = 0
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--comms", action="store_true", help="write torch's lowered plan")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.pipelining import schedules as S
    p, m = args.pp, args.microbatches
    cls = S.get_schedule_class(args.name)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    if args.name in SINGLE:
        if args.comms:
            sys.exit(f"{args.name}: one stage per rank; only its compute-only order is dumped")
        S.PipelineScheduleMulti._dump_csv(cls(MockStage(0, p, p), m), args.output)
        return 0
    v = 2 if args.name in VSHAPE else (args.chunks or 2)
    n = p * v
    indices = [0, n - 1] if args.name in VSHAPE else list(range(0, n, p))
    schedule = cls([MockStage(i, n, p) for i in indices], m)
    schedule._dump_csv(args.output, format="compute_comms" if args.comms else "compute_only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
