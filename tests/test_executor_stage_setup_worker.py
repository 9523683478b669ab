"""One rank of ``test_executor_stage_setup.py``'s end-to-end check (run as a script by that test;
it holds no tests itself).

    python tests/test_executor_stage_setup_worker.py OUT

Env init (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). For zb-h1 and zbv on 2 ranks (4
microbatches of 4 rows): the tiny MLLM's stages and vision encoder, each compiled with
``torch.compile(backend="aot_eager", dynamic=True)`` (the backward compiled with the
forward: without the executor's set-up, the first ``I`` fails on donated buffers), one
``run``; the loss and every gradient this rank trains go to ``OUT/SCHEDULE.RANK.pt``
(names as in the single-process model, ``reference``).
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402

import train_tiny_mllm as tiny  # noqa: E402
from ranks import whole_batch  # noqa: E402
from mpipe_verified.executor import PipelineExecutor, certify  # noqa: E402

SCHEDULES = ("zb-h1", "zbv")
PP, M, ROWS = 2, 4, 16


def reference(schedule: str) -> tuple[float, dict]:
    """Loss and gradients of the plain (uncompiled) model on the whole batch, one
    process."""
    plan, encoder, stages, body = tiny.prepare(schedule, PP, M, ROWS)
    return whole_batch(encoder, body, tiny.make_batch(0, ROWS), tiny.loss_fn)


def main(out: str) -> None:
    torch.set_num_threads(1)
    executors = []
    for schedule in SCHEDULES:
        torch._dynamo.reset()
        plan, encoder, stages, body = tiny.prepare(schedule, PP, M, ROWS)
        names = {id(p): f"vision.{n}" for n, p in encoder.named_parameters()}
        names.update({id(p): f"body.{n}" for n, p in body.named_parameters()})
        compiled = [torch.compile(s, backend="aot_eager", dynamic=True) for s in stages]
        ex = PipelineExecutor(plan, certify(plan), stages=compiled, loss_fn=tiny.loss_fn,
                              segments={"vision": torch.compile(encoder, backend="aot_eager",
                                                                dynamic=True)})
        loss = ex.run(tiny.make_batch(0, ROWS))
        grads = {names[id(p)]: p.grad.detach().clone() for p in ex.parameters()}
        torch.save({"loss": loss, "grads": grads},
                   os.path.join(out, f"{schedule}.{ex.rank}.pt"))
        executors.append(ex)
    for ex in reversed(executors):  # the last one's close() ends the process group
        ex.close()


if __name__ == "__main__":
    main(sys.argv[1])
