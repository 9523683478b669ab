"""One rank of the pipeline-group tests (run as a script by ``test_executor_groups.py``;
it holds no tests itself).

    python tests/test_executor_groups_worker.py OUT SCENARIO

Env init (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Scenarios:

- ``dp`` (4 ranks: 2 pipeline ranks x 2 replicas): the tiny MLLM's zb-h1 plan on
  explicit ``group=``/``dp_group=`` groups, transpose owner mode on a ``(dp, pp)``
  ``DeviceMesh``, and zbv with the token embedding tied to the vocabulary head (both on
  rank 0 of the V placement); one step each, saving the loss and every gradient this
  rank trains to ``OUT/NAME.RANK.pt`` (names as in the single-process model); then a
  ``fully_shard`` stage must be refused (``OUT/fsdp.RANK.txt``), and so must
  data-parallel groups that pair different plan ranks (``OUT/crossed.RANK.txt``);
- ``odd-world`` (3 ranks, a 2-rank plan): ``pipeline_mesh`` and the default executor
  must refuse; the messages go to ``OUT/odd.RANK.txt``;
- ``skew`` (2 ranks; wait timeout 1 s): rank 1 joins 3 s late, which the start-up
  timeout must absorb; then stage 0 returns a wrong shape, rank 0 refuses to send it and
  rank 1's receive times out after 1 s; each exits through ``sys.exit`` (rank 0: 3,
  rank 1: 4) once both have failed (``OUT/failed.RANK``);
- ``startup`` (2 ranks): rank 1 never joins (it waits for ``OUT/startup.0``, which rank 0
  writes once it has failed, then exits 0); rank 0's start-up timeout is 2 s: it must
  fail with a ``PeerError`` and exit 5 through ``sys.exit``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train_tiny_mllm as tiny  # noqa: E402
from test_executor_worker import WrongShape  # noqa: E402
from mpipe_verified.executor import (PeerError, PipelineError,  # noqa: E402
                                     PipelineExecutor, init_distributed, pipeline_mesh)
from mpipe_verified.verify import verify  # noqa: E402

PP, DP = 2, 2
CASES = {"zb-h1-groups": ("zb-h1", "recompute"), "transpose-owner-mesh": ("transpose", "owner"),
         "zbv-tied": ("zbv", "recompute")}


def rows_for(m: int) -> int:
    return 2 * m * DP


def tie(full) -> None:
    """The vocabulary head's weight becomes the token embedding's (both (vocab, dim))."""
    full[-1].out.weight = full[0].tok.weight


def build(name: str):
    schedule, mode = CASES[name]
    m = 2 * PP
    plan, encoder, stages, full = tiny.prepare(schedule, PP, m, rows_for(m) // DP, mode)
    if name == "zbv-tied":
        tie(full)
    report = verify(plan)
    assert report.verified, report.status
    return plan, report.certificate, encoder, stages, full


def groups(name: str) -> dict:
    rank = dist.get_rank()
    if name == "transpose-owner-mesh":
        return {"mesh": pipeline_mesh(PP), "pp_dim": "pp", "dp_dim": "dp"}
    # explicit groups, made by every rank in one order (torch's new_group contract)
    pipes = [dist.new_group([i * PP + r for r in range(PP)]) for i in range(DP)]
    columns = [dist.new_group([i * PP + r for i in range(DP)]) for r in range(PP)]
    return {"group": pipes[rank // PP], "dp_group": columns[rank % PP]}


def run_dp(out: str) -> None:
    rank = dist.get_rank()
    for name in CASES:
        plan, cert, encoder, stages, full = build(name)
        ex = PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                              loss_fn=tiny.loss_fn, **groups(name))
        batch = tiny.make_batch(0, rows_for(plan.num_microbatches))
        loss = ex.step(batch)
        table = {id(p): f"vision.{n}" for n, p in encoder.named_parameters()}
        table.update({id(p): f"body.{n}" for n, p in full.named_parameters()})
        grads = {table[id(p)]: p.grad.detach().clone() for p in ex.parameters()}
        ex.run(batch)  # again, without zero_grad: every summed gradient doubles
        twice = {table[id(p)]: p.grad.detach().clone() for p in ex.parameters()}
        torch.save({"loss": loss, "grads": grads, "twice": twice, "plan_rank": ex.rank},
                   os.path.join(out, f"{name}.{rank}.pt"))
        ex.close()
    refuse_fsdp(out)
    refuse_crossed_replicas(out)
    refuse_other_layouts(out)
    refuse_other_replica_layouts(out)


def refuse_other_replica_layouts(out: str) -> None:
    """The second replica freezes the first parameter of each of its stages: the replicas'
    gradient sum would add different parameters together, so every rank refuses at
    start-up, naming the replicas' global ranks (``OUT/replicas.RANK.txt``)."""
    def freeze(plan, encoder, stages, rank):
        if rank >= PP:
            for s in plan.placement.stages_of(rank % PP):
                next(stages[s].parameters()).requires_grad_(False)
    _step_after(freeze, "zb-h1-groups", os.path.join(out, "replicas"))


def refuse_other_layouts(out: str) -> None:
    """Plan rank 1's copy of the owner-mode encoder freezes its first parameter (in both
    pipelines): the members of its gradient all-reduce would sum different parameters,
    so every rank refuses at start-up (``OUT/layout.RANK.txt``)."""
    def freeze(plan, encoder, stages, rank):
        if rank % PP == 1:
            next(encoder.parameters()).requires_grad_(False)
    _step_after(freeze, "transpose-owner-mesh", os.path.join(out, "layout"))


def _step_after(edit, name: str, prefix: str) -> None:
    """Case ``name``'s model edited by ``edit(plan, encoder, stages, rank)``, one step:
    what it said (``accepted``, or the refusal) in ``PREFIX.RANK.txt``."""
    plan, cert, encoder, stages, _ = build(name)
    rank = dist.get_rank()
    edit(plan, encoder, stages, rank)
    try:
        ex = PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                              loss_fn=tiny.loss_fn, **groups(name))
        ex.step(tiny.make_batch(0, rows_for(plan.num_microbatches)))
        message = "accepted"
    except PipelineError as err:
        message = str(err)
    with open(f"{prefix}.{rank}.txt", "w") as f:
        f.write(message)


def refuse_fsdp(out: str) -> None:
    """A ``fully_shard`` stage module is refused by name (``OUT/fsdp.RANK.txt``)."""
    from torch.distributed.fsdp import fully_shard

    plan, cert, encoder, stages, _ = build("zb-h1-groups")
    mesh = pipeline_mesh(PP)
    fully_shard(stages[1], mesh=mesh["dp"])
    try:
        PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                         loss_fn=tiny.loss_fn, mesh=mesh, dp_dim="dp")
        message = "accepted"
    except PipelineError as err:
        message = str(err)
    with open(os.path.join(out, f"fsdp.{dist.get_rank()}.txt"), "w") as f:
        f.write(message)


def refuse_crossed_replicas(out: str) -> None:
    """Data-parallel groups that pair plan rank 0 of one replica with plan rank 1 of the
    other ({0, 3}, {1, 2}) are refused at the handshake (``OUT/crossed.RANK.txt``)."""
    rank = dist.get_rank()
    plan, cert, encoder, stages, _ = build("zb-h1-groups")
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    ex = PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                          loss_fn=tiny.loss_fn, group=pipes[rank // PP],
                          dp_group=crossed[0 if rank in (0, 3) else 1])
    try:
        ex.connect()
        message = "accepted"
    except PipelineError as err:
        message = str(err)
    with open(os.path.join(out, f"crossed.{rank}.txt"), "w") as f:
        f.write(message)


def run_odd(out: str) -> None:
    lines = []
    plan, cert, encoder, stages, _ = build("zb-h1-groups")
    for attempt in (lambda: pipeline_mesh(PP),
                    lambda: PipelineExecutor(plan, cert, stages=stages,
                                             segments={"vision": encoder},
                                             loss_fn=tiny.loss_fn, rank=0).connect()):
        try:
            attempt()
            lines.append("accepted")
        except PipelineError as err:
            lines.append(str(err))
    with open(os.path.join(out, f"odd.{dist.get_rank()}.txt"), "w") as f:
        f.write("\n".join(lines))


def run_skew(out: str, rank: int) -> int:
    schedule, m = "1f1b", 2 * PP
    plan, encoder, stages, _ = tiny.prepare(schedule, PP, m, 2 * m)
    cert = verify(plan).certificate
    if rank == 1:
        time.sleep(3)  # longer than the wait timeout: start-up must absorb it
    stages[0] = WrongShape(stages[0])
    ex = PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                          loss_fn=tiny.loss_fn, timeout=1, startup_timeout=60)
    ex.connect()
    with open(os.path.join(out, f"connected.{rank}"), "w") as f:
        f.write("connected")
    try:
        ex.step(tiny.make_batch(0, 2 * m))
    except PipelineError as err:
        sys.stderr.write(f"rank {rank}: {type(err).__name__}: {err}\n")
        with open(os.path.join(out, f"failed.{rank}"), "w") as f:
            f.write(str(err))
        deadline = time.time() + 30  # exit once both have failed (a live peer keeps
        while time.time() < deadline and not all(  # the other waiting, not closing)
                os.path.exists(os.path.join(out, f"failed.{r}")) for r in range(PP)):
            time.sleep(0.05)
        return 3 if rank == 0 else 4
    return 0


def main() -> int:
    out, scenario = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if scenario == "startup":
        failed = os.path.join(out, "startup.0")
        if rank == 1:  # never joins; gone once rank 0 has failed (a hang guard else)
            deadline = time.time() + 100
            while not os.path.exists(failed) and time.time() < deadline:
                time.sleep(0.05)
            return 0
        try:
            init_distributed(timeout=2)
        except PeerError as err:
            sys.stderr.write(f"rank {rank}: {type(err).__name__}: {err}\n")
            open(failed, "w").close()
            return 5
        return 0
    init_distributed()
    if scenario == "dp":
        run_dp(out)
        dist.destroy_process_group()
        return 0
    if scenario == "odd-world":
        run_odd(out)
        dist.destroy_process_group()
        return 0
    return run_skew(out, rank)


if __name__ == "__main__":
    sys.exit(main())
