"""Our torch-CSV export runs as written in PyTorch's own runtime, with correct gradients.

For every family, ``mpipe-verify export --family F --pp P --microbatches M --to
torch-csv`` writes the lowered, verified plan; ``P`` gloo processes (2 and 4) load each
file into torch's ``_PipelineScheduleRuntime`` with ``format="compute_comms"`` (torch
runs our comm order, not its own) and run one step with torch's ``PipelineStage``s.
Every parameter gradient must equal a single-process run of the same model on the same
batch (mean loss; float64).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from mpipe_verified.cli import main as cli_main  # noqa: E402
from mpipe_verified.executor.launch import free_port, rank_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_executor_torch_runtime_worker as worker  # noqa: E402

FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev")
WORLDS = (2, 4)


def microbatches(world: int) -> int:
    return 2 * world  # dualpipev needs m >= 2p


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for world in WORLDS:
        d = tmp_path_factory.mktemp(f"torch{world}")
        files = []
        for name in FAMILIES:
            path = str(d / f"{name}.csv")
            assert cli_main(["export", "--family", name, "--pp", str(world), "--microbatches",
                             str(microbatches(world)), "--to", "torch-csv", "-o", path]) == 0
            files.append(path)
        port, env = free_port(), {k: v for k, v in os.environ.items()}
        procs = [subprocess.Popen([sys.executable, worker.__file__, str(d), *files],
                                  env=rank_env(r, world, port, env), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=240)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append(p.communicate()[0])
        out[world] = (d, [p.returncode for p in procs], logs)
    return out


def reference(num_stages: int, m: int) -> dict:
    modules = worker.model(num_stages)
    x, target = worker.batch(m)
    for module in modules:
        x = module(x)
    worker.loss_fn(x, target).backward()
    return {f"{s}.{n}": p.grad for s, mod in enumerate(modules)
            for n, p in mod.named_parameters()}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_export_runs_in_torch_runtime_with_single_process_gradients(runs, world, name):
    d, codes, logs = runs[world]
    assert codes == [0] * world, "\n".join(log[-2000:] for log in logs)
    got = {}
    for r in range(world):
        got.update(torch.load(os.path.join(d, f"{name}.{r}.pt")))
    text = open(os.path.join(d, f"{name}.csv")).read()
    assert "SEND_F" in text and "REDUCE_GRAD" in text
    num_stages = len({k.split(".")[0] for k in got})
    want = reference(num_stages, microbatches(world))
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-12, rtol=1e-10,
                                   msg=lambda m, k=key: f"{name} on {world} ranks, {k}: {m}")
