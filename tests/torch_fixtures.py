"""PyTorch-generated pipeline schedules as CSV text, for tests (``from torch_fixtures
import torch_schedule_csv``).

No process group is needed: torch's schedule classes compute every rank's order in their
constructor, so they are built with ``_MockStage`` objects (the attributes the
constructors read) for rank 0, and dumped with torch's own ``_dump_csv``.

Supported ``name`` (``torch.distributed.pipelining.schedules.get_schedule_class`` names):

- ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``: looped placement (stage
  ``s`` on rank ``s % p``), any ``v >= 1`` chunks per rank (``v=1`` gives torch's plain
  1F1B / GPipe-like / ZB-H1-like orders with bubbles), both formats.
- ``ZBVZeroBubble``, ``DualPipeV``: V placement, ``v`` must be 2, both formats.
- ``GPipe``, ``1F1B``: single-stage classes, ``v`` must be 1. ``compute_only`` is their
  ``pipeline_order`` (torch's visualisation order: it ends each rank with ``REDUCE_GRAD``
  and has no idle cells, since torch's ``_add_reduce_grad`` drops them), written by
  ``PipelineScheduleMulti._dump_csv``. ``compute_comms`` lowers that order (markers
  removed) with ``_PipelineScheduleRuntime``'s own lowering. Caveat: torch's 1F1B order is
  wrong (the last rank runs ``F1..F{m}``, never ``F0``), so torch's lowering rejects it and
  ``1F1B``/``compute_comms`` raises ``ValueError``; its ``compute_only`` text is a real
  torch bug, handy as a negative example.

Constraints are torch's: Interleaved1F1B/InterleavedZeroBubble need ``m`` a multiple of
``max(1, m // p)``; DualPipeV and 1F1B need ``m >= number of stages``.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings

import pytest

SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
VSHAPE = ("ZBVZeroBubble", "DualPipeV")
SUPPORTED = SINGLE + LOOPED + VSHAPE
FORMATS = ("compute_only", "compute_comms")


def torch_schedules():
    """torch.distributed.pipelining.schedules, or skip the calling test without it."""
    with warnings.catch_warnings():  # torch warns when numpy is absent
        warnings.simplefilter("ignore")
        return pytest.importorskip("torch.distributed.pipelining.schedules")


class _MockStage:
    """What torch's schedule constructors read from a ``_PipelineStageBase``."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def _dump(obj, dump, fmt: str | None) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "schedule.csv")
        if fmt is None:
            dump(obj, path)
        else:
            dump(obj, path, format=fmt)
        with open(path, newline="", encoding="utf-8") as f:
            return f.read()


@functools.lru_cache(maxsize=None)
def torch_schedule_csv(name: str, p: int, m: int, v: int = 1,
                       fmt: str = "compute_only") -> str:
    """The CSV text torch writes for schedule ``name`` with ``p`` ranks, ``m``
    microbatches and ``v`` stages per rank, in ``fmt`` (``compute_only`` or
    ``compute_comms``). Skips the calling test when torch (or ``name`` in this torch) is
    missing; raises ``ValueError`` for unsupported arguments."""
    S = torch_schedules()
    if name not in SUPPORTED or fmt not in FORMATS:
        raise ValueError(f"unsupported schedule {name!r} or format {fmt!r}; "
                         f"supported: {SUPPORTED}, {FORMATS}")
    need_v = 1 if name in SINGLE else 2 if name in VSHAPE else v
    if v != need_v or v < 1:
        raise ValueError(f"{name} needs v={need_v}, got v={v}")
    try:
        cls = S.get_schedule_class(name)
    except ValueError:
        pytest.skip(f"this torch has no {name} schedule")
    n = p * v
    if name in SINGLE:
        single = cls(_MockStage(0, p, p), m)
        if fmt == "compute_only":
            return _dump(single, S.PipelineScheduleMulti._dump_csv, None)
        order = {r: [a for a in acts if a is not None and a.computation_type != S.REDUCE_GRAD]
                 for r, acts in single.pipeline_order.items()}
        runtime = S._PipelineScheduleRuntime([_MockStage(0, p, p)], m)
        try:
            runtime._prepare_schedule_with_comms(order)
        except (AssertionError, RuntimeError) as e:
            raise ValueError(f"torch rejects its own {name} order: {e}") from None
        return _dump(runtime, type(runtime)._dump_csv, fmt)
    indices = [0, n - 1] if name in VSHAPE else list(range(0, n, p))
    schedule = cls([_MockStage(i, n, p) for i in indices], m)
    return _dump(schedule, type(schedule)._dump_csv, fmt)
