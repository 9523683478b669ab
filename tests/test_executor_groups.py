"""Pipeline groups, data-parallel replicas, refusals and timeouts, with real gloo processes.

One 4-process launch runs 2 pipeline ranks x 2 replicas (zb-h1 on explicit groups,
transpose owner mode on a ``DeviceMesh``, zbv with a tied embedding and head on one rank):
every replica's gradients must equal a single-process run on the whole batch (float32,
atol 1e-5). Smaller launches check that a world which is not a multiple of the pipeline is
refused, that the start-up timeout is not the wait timeout, and that ranks failing with a
``PipelineError`` exit through ``sys.exit`` with their own codes. ``fully_shard`` stage
modules, tied parameters across ranks and a frozen segment with trainable parameters are
refused at construction.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

import test_executor_groups_worker as worker  # noqa: E402
from ranks import run_ranks, whole_batch  # noqa: E402
import train_tiny_mllm as tiny  # noqa: E402
from mpipe_verified.executor import PipelineError, PipelineExecutor  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402

WORKER = os.path.join(HERE, "test_executor_groups_worker.py")


def launch(world: int, scenario: str, out: str, timeout: float = 240) -> tuple[list, list]:
    """Run the worker on ``world`` processes; ``(exit codes, outputs)``."""
    return run_ranks(WORKER, [out, scenario], world, out, timeout, log=f"log.{scenario}")


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp"))
    codes, texts = launch(4, "dp", out)
    assert codes == [0] * 4, "\n".join(texts)
    return out


def reference(name: str) -> tuple[float, dict]:
    """Loss and gradients of the plain model on the whole batch (one process)."""
    schedule, mode = worker.CASES[name]
    m = 2 * worker.PP
    num_stages = tiny.build_term(schedule, worker.PP, m, mode).derive().placement.num_stages
    encoder, body = tiny.build_model(max(6, num_stages - 2))
    if name == "zbv-tied":
        worker.tie(body)
    return whole_batch(encoder, body, tiny.make_batch(0, worker.rows_for(m)), tiny.loss_fn)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_replicas_match_a_single_process_run(dp_run, name):
    want_loss, want = reference(name)
    results = [torch.load(os.path.join(dp_run, f"{name}.{r}.pt")) for r in range(4)]
    assert [r["plan_rank"] for r in results] == [0, 1, 0, 1]  # pipelines are rows of 2
    for replica in (0, 1):  # each replica's two ranks together train every parameter
        got, twice = {}, {}
        for res in results[2 * replica: 2 * replica + 2]:
            assert abs(res["loss"] - want_loss) <= 1e-5, (name, res["loss"], want_loss)
            assert not set(got) & set(res["grads"])
            got.update(res["grads"])
            twice.update(res["twice"])  # a second run without zero_grad
        assert set(got) == set(want) == set(twice)
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, atol=1e-5, rtol=0,
                                       msg=lambda m, k=key: f"{name} replica {replica} {k}: {m}")
            torch.testing.assert_close(twice[key], 2 * grad, atol=2e-5, rtol=0,
                                       msg=lambda m, k=key: f"{name} twice, {replica} {k}: {m}")


def test_fully_sharded_stages_are_refused_by_name(dp_run):
    for r in range(4):
        text = open(os.path.join(dp_run, f"fsdp.{r}.txt")).read()
        assert text.startswith("stage 1 is an FSDP2 (fully_shard) module"), text


def test_copies_of_a_segment_with_other_trainable_parameters_are_refused(dp_run):
    for r in range(4):
        text = open(os.path.join(dp_run, f"layout.{r}.txt")).read()
        assert f"rank {r % 2}: segment 'vision': ranks [0] against [1] hold different " \
               "trainable parameters" in text, text


def test_replicas_with_other_trainable_parameters_are_refused(dp_run):
    """Every rank refuses together, naming the replicas by their global ranks."""
    for r in range(4):
        text = open(os.path.join(dp_run, f"replicas.{r}.txt")).read()
        assert f"rank {r % 2}: the replicas: ranks [{r % 2}] against [{r % 2 + 2}] hold " \
               "different trainable parameters" in text, text


def test_replicas_holding_different_plan_ranks_are_refused(dp_run):
    for r in range(4):
        text = open(os.path.join(dp_run, f"crossed.{r}.txt")).read()
        assert "the data-parallel group's ranks hold plan ranks" in text, text
        assert "[0, 1]" in text or "[1, 0]" in text, text


def test_world_not_a_multiple_of_the_pipeline_is_refused(tmp_path):
    codes, texts = launch(3, "odd-world", str(tmp_path))
    assert codes == [0, 0, 0], "\n".join(texts)
    for r in range(3):
        lines = open(tmp_path / f"odd.{r}.txt").read().splitlines()
        assert lines == ["the world has 3 processes, not a multiple of the plan's 2 pipeline "
                         "ranks"] * 2, lines


def test_late_rank_fits_the_startup_timeout_and_failures_exit_normally(tmp_path):
    """Rank 1 connects 3 s late (wait timeout 1 s); then rank 0 refuses to send a wrong
    shape, rank 1's receive times out after 1 s (the wait timeout, not the start-up one:
    gloo itself says how long it waited), and both leave through ``sys.exit``. The
    launch's timeout is a hang guard: a rank still running then is killed (exit -9)."""
    codes, texts = launch(2, "skew", str(tmp_path), timeout=120)
    assert codes == [3, 4], "\n".join(texts)
    assert all(os.path.exists(tmp_path / f"connected.{r}") for r in range(2))
    assert "PayloadMismatchError" in texts[0] and "refusing to send act of stage 0" in texts[0]
    assert "PeerError" in texts[1] and "timed out after 1 s" in texts[1], texts[1]
    assert "Timed out waiting 1000ms for recv" in texts[1], texts[1]
    assert "Traceback" not in texts[0] + texts[1]


def test_startup_timeout_ends_a_rank_whose_peer_never_joins(tmp_path):
    """Rank 1 never joins (it waits for rank 0 to fail, then leaves): rank 0's 2 s
    start-up timeout must end it, exit 5 (the launch's timeout is only a hang guard)."""
    codes, texts = launch(2, "startup", str(tmp_path), timeout=120)
    assert codes == [5, 0], "\n".join(texts)
    assert "starting the process group failed (start-up timeout 2 s)" in texts[0], texts[0]


def plan_of(schedule: str, mode: str = "recompute"):
    m = 2 * worker.PP
    plan, encoder, stages, full = tiny.prepare(schedule, worker.PP, m, 2 * m, mode)
    return plan, verify(plan).certificate, encoder, stages, full


def test_parameters_tied_across_ranks_are_refused_by_name():
    plan, cert, encoder, stages, full = plan_of("zb-h1")  # stage 0 on rank 0, 1 on rank 1
    worker.tie(full)
    with pytest.raises(PipelineError, match=r"parameter '0\.tok\.weight' of stage 0 \(rank 0\) "
                                            r"is also '7\.out\.weight' of stage 1 \(rank 1\)"):
        PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                         loss_fn=tiny.loss_fn, rank=0)


def test_frozen_segment_with_trainable_parameters_is_refused():
    plan, cert, encoder, stages, _ = plan_of("transpose", "frozen")
    encoder.fc2.requires_grad_(True)
    with pytest.raises(PipelineError, match=r"segment 'vision' is frozen in this plan .*"
                                            r"\(fc2\.weight, fc2\.bias\)"):
        PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                         loss_fn=tiny.loss_fn, rank=1)
