"""One rank of the sequence-chunk executor tests (run as a script by
``test_executor_seq.py``; it holds no tests itself).

    python tests/test_executor_seq_worker.py OUT CASES.json [--final no-cache]

Env init; the loop of ``test_executor_worker.main`` with this file's cases. For each case ``{"name", "chunks", "samples", "length", "pad", "split"}`` it
builds the tiny GPT's seq1f1b plan (``split``: its backward split into ``I`` and ``W``),
verifies it, runs one SGD step (lr ``LR``) and saves the loss, the per-chunk losses, the
local gradients and parameters after the step (named ``body.S.NAME``), and the measured
peak of stored activations next to the verifier's, to ``OUT/NAME.rank.pt``. ``--final
no-cache`` (2 ranks): the last stage returns its output without a cache; rank 1 must
refuse it (``OUT/no-cache.txt``) and exit 1, rank 0 fail with a ``PeerError`` (a 1 s
wait timeout, or rank 1's closed connection) and exit 1.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tiny_gpt  # noqa: E402
from mpipe_verified.algebra import SplitBW, family  # noqa: E402
from mpipe_verified.executor import (PipelineError, PipelineExecutor,  # noqa: E402
                                     infer_payload_shapes, with_payload_shapes)
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402

LR = 0.1


def case_batch(case: dict):
    return tiny_gpt.make_batch(0, 2 * case["samples"], case["length"], pad=case.get("pad"))


def build(case: dict, world: int):
    """``(plan, report, stages)`` of the case (every stage, on every rank)."""
    term = family("seq1f1b", world, case["samples"], seq_chunks=case["chunks"])
    plan = lower((SplitBW(term) if case.get("split") else term).derive())
    stages = tiny_gpt.build_stages(plan.placement.num_stages)
    plan = with_payload_shapes(plan, infer_payload_shapes(
        stages, case_batch(case), plan.num_microbatches, seq_chunks=case["chunks"]))
    report = verify(plan)
    if not report.verified:
        raise SystemExit(f"case {case['name']}: plan {report.status}")
    return plan, report, stages


def run_case(case: dict, rank: int, world: int, out_dir: str) -> None:
    plan, report, stages = build(case, world)
    ex = PipelineExecutor(plan, report.certificate, stages=stages, loss_fn=tiny_gpt.loss_fn,
                          ignore_index=tiny_gpt.IGNORE if case.get("pad") else None,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    loss, losses = ex.step(case_batch(case), return_losses=True)
    names = {id(p): f"body.{n}" for n, p in nn.ModuleList(stages).named_parameters()}
    grads, params = {}, {}
    for p in ex.parameters():
        grads[names[id(p)]] = p.grad.detach().clone()
        params[names[id(p)]] = p.detach().clone()
    torch.save({"loss": loss, "losses": losses, "grads": grads, "params": params,
                "stored_peak": ex.stored_peak, "verified_peak": report.peak_memory[rank]},
               os.path.join(out_dir, f"{case['name']}.{rank}.pt"))


class NoCache(nn.Module):
    """A stage that breaks the cache contract: it returns its output only."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, cache=None):
        return self.inner(x, cache=cache)[0]


def no_cache(rank: int, world: int, out_dir: str) -> None:
    case = {"name": "no-cache", "chunks": 2, "samples": world, "length": 8}
    plan, report, stages = build(case, world)
    stages[-1] = NoCache(stages[-1])
    ex = PipelineExecutor(plan, report.certificate, stages=stages, loss_fn=tiny_gpt.loss_fn,
                          timeout=1)
    try:
        ex.step(case_batch(case))
    except PipelineError as err:
        if rank == world - 1:
            with open(os.path.join(out_dir, "no-cache.txt"), "w") as f:
                f.write(str(err))
        raise
    raise SystemExit(f"rank {rank}: the no-cache scenario did not fail")


def final(name: str, rank: int, world: int, out_dir: str) -> None:
    if name == "no-cache":
        no_cache(rank, world, out_dir)


if __name__ == "__main__":  # the executor tests' worker loop, with these cases
    import test_executor_worker
    test_executor_worker.main(run_case, final)
