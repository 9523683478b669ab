"""One rank of ``test_executor_torch_runtime.py`` (run as a script; it holds no tests itself).

    python tests/test_executor_torch_runtime_worker.py OUT FILE.csv [FILE.csv ...]

Env init (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), gloo. For each exported file it
builds the stages this rank holds (``model`` below: the same weights on every rank) as
torch ``PipelineStage`` objects, loads the file *as written* into torch's own
``_PipelineScheduleRuntime`` (``_load_csv(..., format="compute_comms")``), runs one step
on ``batch()`` and saves every local parameter gradient to ``OUT/NAME.RANK.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

DIM, ROWS_PER_MB = 6, 3


def model(num_stages: int) -> list[nn.Module]:
    """One ``Linear + tanh`` block per stage, float64, seeded: same weights everywhere."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()).double() for _ in range(num_stages)]


def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rows = ROWS_PER_MB * m
    return (torch.randn(rows, DIM, generator=g, dtype=torch.float64),
            torch.randn(rows, DIM, generator=g, dtype=torch.float64))


def loss_fn(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def run_file(path: str, rank: int, out_dir: str) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from mpipe_verified.formats.torch_csv import read_torch_csv

    plan = read_torch_csv(path)
    num_stages, m = plan.placement.num_stages, plan.num_microbatches
    modules = model(num_stages)
    example = torch.zeros(ROWS_PER_MB, DIM, dtype=torch.float64)
    mine = plan.placement.stages_of(rank)
    stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu"),
                            input_args=(example.clone().requires_grad_(s > 0),),
                            output_args=example.clone().requires_grad_(True)) for s in mine]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn)
    schedule._load_csv(path, format="compute_comms")
    x, target = batch(m)
    kwargs = {"target": target} if num_stages - 1 in mine else {}
    schedule.step(*((x,) if 0 in mine else ()), **kwargs)
    grads = {f"{s}.{n}": p.grad.clone() for s in mine
             for n, p in modules[s].named_parameters()}
    name = os.path.splitext(os.path.basename(path))[0]
    torch.save(grads, os.path.join(out_dir, f"{name}.{rank}.pt"))


def main() -> None:
    out_dir, files = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for path in files:
        run_file(path, rank, out_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
