"""The executor with sequence chunks (seq1f1b) against one process over whole samples,
with real gloo processes on CPU.

One launch per world size (2 and 4 ranks) runs the tiny causal-attention GPT of
``examples/tiny_gpt.py`` under seq1f1b with S = 2 and S = 4 sequence chunks (S = 4 cuts a
sequence of 10 into chunks of 3, 3, 2 and 2: a mean of chunk means would differ), on 2
ranks also S = 3 over padded targets (``ignore_index``) with the backward split into ``I``
and ``W`` (``SplitBW``). Each case's loss, per-chunk losses, every gradient and every parameter after one
SGD step must equal one process running the plain model over whole samples (causal
attention over the full sequence; float32, atol 1e-5), and each rank's measured peak of
stored activations the verifier's. The 2-rank launch ends with a last stage that returns
no cache: its rank refuses it with one line naming the contract, and the other rank fails
with a ``PeerError`` (its wait times out, or it sees rank 1 exit).

``examples/train_tiny_mllm.py --schedule seq1f1b --seq-chunks 2 --check-grads`` and the
script of docs/executor.md's "Sequence chunks" run on 2 ranks (the gradients match; the
loss falls). Without processes: how a batch is cut into chunks, and the refusals of
``chunks`` and ``infer_payload_shapes``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

import test_executor_seq_worker as worker  # noqa: E402
import tiny_gpt  # noqa: E402
from ranks import run_ranks  # noqa: E402
from mpipe_verified.executor import (Batch, BatchError, PipelineError,  # noqa: E402
                                     infer_payload_shapes)
from mpipe_verified.executor import chunks  # noqa: E402

WORKER = os.path.join(HERE, "test_executor_seq_worker.py")
ROOT = os.path.join(HERE, "..")
MPIPE_RUN = os.path.join(os.path.dirname(sys.executable), "mpipe-run")


def cases(world: int) -> list[dict]:
    """S = 2 and 4 on every world; padding with the split backward on 2 ranks (CI time)."""
    out = [{"name": "seq1f1b-2", "chunks": 2, "samples": world, "length": 8},
           {"name": "seq1f1b-4", "chunks": 4, "samples": world, "length": 10}]
    if world == 2:
        out.append({"name": "seq1f1b-3-pad-split", "chunks": 3, "samples": world,
                    "length": 10, "pad": True, "split": True})
    return out


RUNS = [(world, c["name"]) for world in (2, 4) for c in cases(world)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = {}
    for world in (2, 4):
        d = tmp_path_factory.mktemp(f"seq{world}")
        with open(d / "cases.json", "w") as f:
            json.dump(cases(world), f)
        args = [str(d), str(d / "cases.json")] + (["--final", "no-cache"] if world == 2 else [])
        codes, logs = run_ranks(WORKER, args, world, str(d), timeout=300)
        out[world] = (str(d), codes, logs)
    return out


def results(launch, name: str, world: int) -> list[dict]:
    out_dir, codes, logs = launch
    paths = [os.path.join(out_dir, f"{name}.{r}.pt") for r in range(world)]
    assert all(map(os.path.exists, paths)), f"{name}: no result\n{codes}\n" + "\n".join(
        log[-3000:] for log in logs)
    return [torch.load(p) for p in paths]


def reference(case: dict, world: int):
    """One process over whole samples: ``(loss, per-chunk losses, grads, params after
    the SGD step)``."""
    stages = tiny_gpt.build_stages(world)
    batch = worker.case_batch(case)
    logits = tiny_gpt.whole_sequence(stages, batch.body)
    loss = tiny_gpt.loss_fn(logits, batch.target)
    per_chunk = [float(tiny_gpt.loss_fn(x, t).detach())
                 for xs, ts in zip(logits.tensor_split(case["samples"]),
                                   batch.target.tensor_split(case["samples"]))
                 for x, t in zip(xs.tensor_split(case["chunks"], 1),
                                 ts.tensor_split(case["chunks"], 1))]
    loss.backward()
    named = dict(torch.nn.ModuleList(stages).named_parameters())
    grads = {f"body.{n}": p.grad for n, p in named.items()}
    params = {f"body.{n}": (p - worker.LR * p.grad).detach() for n, p in named.items()}
    return float(loss.detach()), per_chunk, grads, params


@pytest.mark.parametrize("world, name", RUNS)
def test_chunked_step_matches_one_process_over_whole_samples(launches, world, name):
    case = next(c for c in cases(world) if c["name"] == name)
    got = results(launches[world], name, world)
    want_loss, want_losses, want_grads, want_params = reference(case, world)
    for res in got:
        assert abs(res["loss"] - want_loss) <= 1e-5, (res["loss"], want_loss)
        assert len(res["losses"]) == len(want_losses)
        for a, b in zip(res["losses"], want_losses):
            assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5, (
                res["losses"], want_losses)
    grads, params = {}, {}
    for res in got:
        assert not set(grads) & set(res["grads"])
        grads.update(res["grads"])
        params.update(res["params"])
    assert set(grads) == set(want_grads)
    for key in want_grads:
        torch.testing.assert_close(grads[key], want_grads[key], atol=1e-5, rtol=0,
                                   msg=lambda m, k=key: f"{name} on {world} ranks, {k}: {m}")
        torch.testing.assert_close(params[key], want_params[key], atol=1e-5, rtol=0,
                                   msg=lambda m, k=key: f"{name} on {world} ranks, {k}: {m}")


@pytest.mark.parametrize("world, name", RUNS)
def test_chunked_stored_peak_equals_verified_peak(launches, world, name):
    got = results(launches[world], name, world)
    measured = [r["stored_peak"] for r in got]
    assert measured == [r["verified_peak"] for r in got], measured
    assert max(measured) >= 2


def test_a_stage_that_returns_no_cache_is_refused(launches):
    out_dir, codes, logs = launches[2]
    path = os.path.join(out_dir, "no-cache.txt")
    assert os.path.exists(path), "\n".join(logs)
    text = open(path).read()
    assert text.startswith("rank 1: 1F0 at position 1: stage 1 returned a Tensor;"), text
    assert "returns (output, cache)" in text and "Sequence chunks" in text, text
    assert codes == [1, 1], (codes, logs)
    assert "PeerError: rank 0:" in logs[0], logs[0]  # timed out, or rank 1's exit seen


def test_a_batch_is_cut_into_samples_then_chunks_along_the_sequence():
    tokens = torch.arange(4 * 7).view(4, 7)
    batch = Batch(body=tokens, target=tokens + 100, kwargs={"flag": True})
    mbs = chunks.split(batch, 6, 3)  # 2 samples of 2 rows, 3 chunks of 3, 2, 2
    assert [tuple(mb.body.shape) for mb in mbs] == [(2, 3), (2, 2), (2, 2)] * 2
    assert torch.equal(torch.cat([mb.body for mb in mbs[3:]], 1), tokens[2:])
    assert torch.equal(mbs[1].target, tokens[:2, 3:5] + 100) and mbs[4].kwargs == {"flag": True}
    assert chunks.tokens(mbs[0].target) == 6.0
    with pytest.raises(BatchError, match="into 8 sequence chunks along dimension 1"):
        chunks.split(batch, 8, 8)
    with pytest.raises(BatchError, match="no segment inputs"):
        chunks.split(Batch(body=tokens, segments={"vision": tokens}), 2, 2)


def test_a_plan_of_chunks_that_also_cuts_segments_is_refused():
    """The algebra never derives one (transpose refuses a chunked body); a file could."""
    import attrs
    from mpipe_verified.algebra import Transpose, family
    from mpipe_verified.lower import lower
    plan = lower(Transpose(family("1f1b", 2, 4), segment="vision", ownership="inline",
                           mode="recompute").derive())
    with pytest.raises(PipelineError, match="also cuts segments .* sequence chunks of the "
                                            "body only"):
        chunks.check_plan(attrs.evolve(plan, seq_chunks=2))
    chunks.check_plan(plan)


def test_infer_payload_shapes_refuses_a_stage_without_a_cache():
    stages = tiny_gpt.build_stages(2)
    batch = tiny_gpt.make_batch(0, 4, 8)
    fn = infer_payload_shapes(stages, batch, 4, seq_chunks=2)
    assert fn is not None
    stages[1] = worker.NoCache(stages[1])
    with pytest.raises(PipelineError, match=r"^stage 1 returned a Tensor; under sequence "
                                            r"chunks a stage is called with cache="):
        infer_payload_shapes(stages, batch, 4, seq_chunks=2)
    with pytest.raises(PipelineError, match="returned no cache"):
        chunks.unpack((torch.ones(1), None), "stage 0")
    with pytest.raises(PipelineError, match="a tuple of 3"):
        chunks.unpack((1, 2, 3), "stage 0")


def test_the_example_checks_grads_of_seq1f1b_on_two_ranks():
    done = subprocess.run(
        [MPIPE_RUN, "--nproc", "2", "--backend", "gloo",
         os.path.join(ROOT, "examples", "train_tiny_mllm.py"), "--schedule", "seq1f1b",
         "--seq-chunks", "2", "--steps", "2", "--check-grads"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 samples of 2 sequence chunks" in done.stdout, done.stdout
    found = re.findall(r"^\[rank0\]:grads match a single-process run: max abs diff (\S+)$",
                       done.stdout, re.M)
    assert len(found) == 1 and float(found[0]) <= 1e-5, done.stdout


def test_the_sequence_chunks_script_of_the_docs_runs_as_written(tmp_path):
    text = open(os.path.join(ROOT, "docs", "executor.md")).read()
    section = text.split("## Sequence chunks\n", 1)[1].split("\n## ", 1)[0]
    script = tmp_path / "chunks.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    done = subprocess.run([MPIPE_RUN, "--nproc", "2", "--backend", "gloo", str(script)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 3 and losses == sorted(losses, reverse=True), done.stdout
