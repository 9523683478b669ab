"""Test workers as real ranks: a script run as ``world`` gloo processes on this machine
(env init on a free port), and the tiny MLLM's one-process reference.

Not a test file itself; the executor tests import it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mpipe_verified.executor.launch import free_port, rank_env


def run_ranks(script: str, args: list[str], world: int, out: str, timeout: float = 240,
              log: str = "log") -> tuple[list[int], list[str]]:
    """Run ``python script *args`` as ranks ``0..world-1`` (gloo; the caller's
    ``MPIPE_BACKEND`` and ``MPIPE_TIMEOUT`` left out), each writing stdout and stderr to
    ``out/LOG.RANK``; ranks still running after ``timeout`` seconds are killed. Returns
    ``(exit codes, outputs)``."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MPIPE_BACKEND", "MPIPE_TIMEOUT")}
    logs = [open(os.path.join(out, f"{log}.{r}"), "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, script, *args],
                              env=rank_env(r, world, port, env, backend="gloo"),
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    texts = []
    for f in logs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return [p.returncode for p in procs], texts


def whole_batch(encoder, body, batch, loss_fn) -> tuple[float, dict]:
    """The tiny MLLM in one process on the whole batch: ``(loss, gradients)``, named
    ``vision.NAME`` and ``body.NAME`` as the executor tests name them."""
    x = body[0](encoder(batch.segments["vision"]), batch.body)
    for layer in list(body)[1:]:
        x = layer(x)
    loss = loss_fn(x, batch.target)
    loss.backward()
    grads = {f"vision.{n}": p.grad for n, p in encoder.named_parameters()}
    grads.update({f"body.{n}": p.grad for n, p in body.named_parameters()})
    return float(loss.detach()), grads
