"""A real training loop against one process, with real gloo processes on CPU.

Two launches (a 2-rank pipeline; 2 pipeline ranks x 2 replicas) run the tiny MLLM with
what real LLM/MLLM training uses: padded targets (``ignore_index``, and a masked mean
with ``loss_weight``; one microbatch all padding), BatchNorm in the encoder (every
transpose mode and inline) and the body, a parameter no forward uses under data
parallelism with weight decay and momentum, a bf16 head, and global gradient-norm
clipping. After each case every loss, gradient, buffer of every copy of a module,
clipping norm and (with an optimizer) parameter must equal one process running the same
model on the same data: the whole batch at once, or, where the result depends on the
microbatches (BatchNorm's statistics, a bf16 loss), its microbatches one after another in
row order with each loss weighted as the executor weights it.
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

import test_executor_training_loop_worker as worker  # noqa: E402
import train_tiny_mllm as tiny  # noqa: E402
from mpipe_verified.executor import (Batch, BatchError, PipelineError,  # noqa: E402
                                     PipelineExecutor, certify)
from ranks import run_ranks  # noqa: E402

WORKER = os.path.join(HERE, "test_executor_training_loop_worker.py")


def launch(world: int, out: str, timeout: float = 420) -> None:
    codes, texts = run_ranks(WORKER, [out, str(world)], world, out, timeout)
    assert codes == [0] * world, "\n".join(texts)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("loop2"))
    launch(2, out)
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("loop3"))
    launch(3, out)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("loop4"))
    launch(4, out)
    return out


def find(name: str) -> tuple[dict, int]:
    for world, cases in worker.CASES.items():
        for case in cases:
            if case["name"] == name:
                return case, world
    raise KeyError(name)


def forward(encoder, body, batch: Batch):
    x = body[0](encoder(batch.segments["vision"]), batch.body)
    for layer in list(body)[1:]:
        x = layer(x)
    return x


def count(case: dict, mb: Batch) -> float:
    """What the microbatch's mean loss averages over (rows, or valid targets)."""
    if case.get("pad"):
        return float((mb.target != worker.IGNORE).sum())
    return float(mb.target.shape[0])


def reference(case: dict, world: int) -> dict:
    """One process: the same fresh model and data, the same steps, clipping and optimizer."""
    m, dp = worker.microbatches(case), worker.replicas(world)
    term = worker.case_term(case, world)
    encoder, body = worker.case_model(case, term.derive().placement.num_stages)
    fn = worker.loss_fn(case)
    params = [p for p in (*encoder.parameters(), *body.parameters()) if p.requires_grad]
    optimizer = worker.optimizer(params) if case.get("optimizer") else None
    sequential = case.get("bn") or case.get("bf16")
    losses, norm = [], None
    for step in range(case.get("steps", 1)):
        batch = worker.case_batch(case, step, world)
        for p in params:
            p.grad = None
        if sequential:  # microbatch statistics: the microbatches one after another
            mbs = [mb for block in batch.split(dp) for mb in block.split(m)]
            counts = [count(case, mb) for mb in mbs]
            loss = 0.0
            for mb, c in zip(mbs, counts):
                value = fn(forward(encoder, body, mb), mb.target)
                if c:
                    (value * (c / sum(counts))).backward()
                    loss += float(value.detach()) * c / sum(counts)
        else:
            value = fn(forward(encoder, body, batch), batch.target)
            value.backward()
            loss = float(value.detach())
        losses.append(loss)
        if case.get("clip"):
            norm = float(torch.nn.utils.clip_grad_norm_(params, case["clip"]))
        if optimizer is not None:
            optimizer.step()
    named = [(f"vision.{n}", p) for n, p in encoder.named_parameters()]
    named += [(f"body.{n}", p) for n, p in body.named_parameters()]
    buffers = [(f"vision.{n}", b) for n, b in encoder.named_buffers()]
    buffers += [(f"body.{n}", b) for n, b in body.named_buffers()]
    return {"losses": losses, "norm": norm, "grads": {n: p.grad for n, p in named},
            "params": {n: p.detach() for n, p in named},
            "trainable": {n for n, p in named if p.requires_grad},
            "buffers": dict(buffers)}


def results(out: str, name: str, world: int) -> list[dict]:
    return [torch.load(os.path.join(out, f"{name}.{r}.pt")) for r in range(world)]


def close(got, want, atol=1e-5) -> bool:
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), atol=atol,
                                                      rtol=0)


def check_case(out: str, name: str) -> dict:
    """Every rank's losses, gradients, norm, buffers and parameters against one process."""
    case, world = find(name)
    want = reference(case, world)
    ranks = results(out, name, world)
    tol = 1e-6 if case.get("bf16") else 1e-5
    covered, buffered = set(), set()
    for r, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(want["losses"], abs=tol), (name, r)
        if case.get("clip"):
            assert got["norm"] == pytest.approx(want["norm"], rel=1e-5), (name, r)
        for n, g in got["grads"].items():
            covered.add(n)
            if want["grads"][n] is None:
                assert g is None, f"{name} rank {r}: {n} got a gradient; one process: None"
            else:
                assert g is not None and close(g, want["grads"][n]), (name, r, n)
        for n, b in got["buffers"].items():
            buffered.add(n)
            assert close(b, want["buffers"][n]), (name, r, n, b, want["buffers"][n])
        if case.get("optimizer"):
            for n, p in got["params"].items():
                assert close(p, want["params"][n]), (name, r, n)
    assert covered == want["trainable"], name
    assert buffered == set(want["buffers"]), name  # every buffer compared on some rank
    return want


PADDED = [c["name"] for c in worker.CASES[2] if c.get("pad")]


@pytest.mark.parametrize("name", PADDED)
def test_padded_targets_weigh_microbatches_by_valid_tokens(two, name):
    """16, 2, 5 and 0 valid tokens per microbatch: the loss and gradients are the whole
    batch's mean over valid tokens (rows would give 3.34 for 3.46, an all-padding
    microbatch NaN)."""
    want = check_case(two, name)
    assert torch.isfinite(torch.tensor(want["losses"])).all()


@pytest.mark.parametrize("name", [c["name"] for c in worker.CASES[2] if c.get("bn")])
def test_buffers_equal_one_process_in_every_mode(two, name):
    """A BatchNorm in a cut encoder (owner, recompute, frozen, inline; every forward off
    its home rank; momentum 0 and None; a copy changed by the caller between steps) and
    in the body: after two steps every copy of every module holds one process's running
    statistics (its microbatches in row order, each counted once: a recompute changes
    nothing)."""
    want = check_case(two, name)
    assert int(want["buffers"]["vision.bn.num_batches_tracked"]) == 8


@pytest.mark.parametrize("name", [c["name"] for c in worker.CASES[3]])
def test_a_segment_whose_home_runs_none_of_it(three, name):
    """Three ranks, the encoder's forwards on ranks 1 and 2 only (given owners): frozen,
    its home rank holds no copy (in owner mode home takes part in its collectives); its
    copies' statistics still equal one process's."""
    check_case(three, name)
    home = results(three, name, 3)[0]
    touched = any(n.startswith("vision.") for n in (*home["buffers"], *home["grads"]))
    assert touched == (find(name)[0]["mode"] == "owner"), name


def test_replicas_buffers_unused_parameters_and_clipping(four):
    """2 pipeline ranks x 2 replicas: BatchNorm statistics over both replicas'
    microbatches; a parameter no forward uses keeps no gradient on any replica, so SGD's
    weight decay and momentum leave it as it was; padding and clipping over the whole
    world."""
    for name in ("dp-bn-owner", "dp-pad-clip", "dp-int16-buffer"):
        check_case(four, name)
    want = check_case(four, "dp-unused")
    unused = [n for n in want["grads"] if ".branch." in n]
    assert unused and all(want["grads"][n] is None for n in unused)
    initial = {f"body.{n}": p for n, p in
               worker.case_model({"unused": True}, 2)[1].named_parameters()}
    for got in results(four, "dp-unused", 4):
        for n in unused:
            if n in got["grads"]:
                assert got["grads"][n] is None and torch.equal(got["params"][n], initial[n])


@pytest.mark.parametrize("name", ["bf16-1f1b", "bf16-zbv"])
def test_bf16_loss_is_summed_in_float(two, name):
    """bf16 logits and loss: the step's loss is the float sum of the microbatches'
    weighted losses (summed in bf16 it was 0.0156 off)."""
    check_case(two, name)


@pytest.mark.parametrize("name", ["clip-1f1b", "clip-owner"])
def test_clip_grad_norm_is_the_global_norm(two, name):
    """``clip_grad_norm_`` returns torch's norm of the whole model's gradients (a
    segment's counted once, on its home) and clips every rank's alike."""
    check_case(two, name)


def test_a_loss_fn_breaking_the_contract_is_named(two):
    texts = [open(os.path.join(two, f"contract.{r}.txt")).read() for r in range(2)]
    assert texts[1].startswith("PipelineError: rank 1: loss_fn returned a tuple; it must "
                               "return one floating-point scalar tensor"), texts[1]
    assert "\n" not in texts[1]
    assert texts[0] != "accepted" and texts[0].startswith("PeerError"), texts[0]


def test_a_batch_that_does_not_fit_is_refused_by_every_rank_before_the_plan(two):
    """An epoch's smaller last batch, and an autocast the layouts were not inferred under:
    ``BatchError`` on both ranks, naming ShapeCache and autocast, before any of the plan's
    traffic; the executor then trains on a batch that fits."""
    for r in range(2):
        small, bf16, then = open(os.path.join(two, f"fit.{r}.txt")).read().split("\n")
        for line in (small, bf16):
            assert line.startswith("BatchError: rank "), line
            assert ("ShapeCache" in line and "autocast" in line) or "refused it" in line
        assert "float32 but the plan's payload is (2, " in small or "refused it" in small
        assert "bfloat16 but the plan's payload is" in bf16 or "refused it" in bf16, bf16
        assert then.startswith("then: ")
    texts = [open(os.path.join(two, f"fit.{r}.txt")).read() for r in range(2)]
    assert all(any("ShapeCache" in t.split("\n")[k] for t in texts) for k in (0, 1)), texts


def test_eval_runs_every_module_in_eval_mode_and_restores_it(two):
    """A body with dropout and a BatchNorm, left in training mode: two ``eval`` calls give
    the same outputs, those of one process's ``model.eval()``; no buffer moves; every
    module is back in training mode afterwards."""
    encoder, body = worker.eval_model()
    encoder.eval(), body.eval()
    batch = tiny.make_batch(0, worker.rows(2))
    with torch.no_grad():
        want = [forward(encoder, body, mb) for mb in batch.split(worker.microbatches({}))]
    last = torch.load(os.path.join(two, "eval.1.pt"))
    assert last["outputs"][0] is not None
    for got in last["outputs"]:
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    for r in range(2):
        saved = torch.load(os.path.join(two, f"eval.{r}.pt"))
        assert all(saved["training"]) and saved["before"].keys() == saved["after"].keys()
        assert all(torch.equal(saved["before"][n], b) for n, b in saved["after"].items())


def test_a_saved_state_resumes_with_the_same_losses(two):
    """``state_dict`` after 2 Adam steps, loaded into freshly built modules and executor:
    steps 3 and 4 give the very losses of the run that went on (a fresh start does not)."""
    for r in range(2):
        got = torch.load(os.path.join(two, f"resume.{r}.pt"))
        assert got["steps"] == 4
        assert got["resumed"] == got["straight"], got
        assert got["fresh"] != got["straight"], got


def unconnected(m: int = 4, **options):
    plan, encoder, stages, _ = tiny.prepare("1f1b", 2, m, 2 * m)
    return PipelineExecutor(plan, certify(plan), stages=stages, segments={"vision": encoder},
                            loss_fn=tiny.loss_fn, rank=0, **options)


def test_a_short_batch_is_refused_before_any_communication():
    """3 rows for 4 microbatches: a ``BatchError`` (a ``PipelineError`` and a
    ``ValueError``) before the process group is touched, and the executor stays usable."""
    ex = unconnected()
    with pytest.raises(PipelineError, match=r"rank 0: the batch: cannot split a batch of 3 "
                                            r"rows into 4 microbatches") as err:
        ex.run(tiny.make_batch(0, 3))
    assert isinstance(err.value, BatchError) and isinstance(err.value, ValueError)
    assert not ex._failed and not torch.distributed.is_initialized()
    with pytest.raises(BatchError, match="take a Batch, got dict"):
        ex.run({"body": torch.zeros(8)})


@pytest.mark.parametrize("options, message", [
    ({"loss_reduction": "avg"}, "loss_reduction must be 'mean' or 'sum'"),
    ({"ignore_index": -100, "loss_weight": len}, "not both"),
    ({"loss_reduction": "sum", "ignore_index": -100}, "every microbatch has weight 1"),
])
def test_loss_options_are_checked(options, message):
    with pytest.raises(PipelineError, match=message):
        unconnected(**options)


def test_microbatch_weights():
    """The weights the executor gives: rows, valid targets, a count; all padding is 0;
    over replicas each replica's share of the whole batch."""
    from mpipe_verified.executor.loss import microbatch_weights

    target = torch.full((8, 4), -100)
    for i, valid in enumerate((4, 1, 3, 0, 2, 2, 0, 0)):
        target[i, :valid] = 1
    batch = Batch(body=torch.zeros(8, 4), target=target)
    every = [batch.split(4)]
    assert microbatch_weights(every, 0, "mean") == [0.25] * 4
    assert microbatch_weights(every, 0, "mean", ignore_index=-100) == [
        5 / 12, 3 / 12, 4 / 12, 0.0]
    assert microbatch_weights(every, 0, "mean", loss_weight=lambda t: (t == 1).sum()) == [
        5 / 12, 3 / 12, 4 / 12, 0.0]
    assert microbatch_weights(every, 0, "sum") == [1.0] * 4
    blocks = [block.split(2) for block in batch.split(2)]
    assert microbatch_weights(blocks, 1, "mean", ignore_index=-100) == [4 / 12, 0.0]
    nothing = Batch(body=torch.zeros(2, 4), target=torch.full((2, 4), -100))
    assert microbatch_weights([nothing.split(2)], 0, "mean", ignore_index=-100) == [0.0, 0.0]


@pytest.mark.parametrize("returned, what", [
    ((torch.tensor(1.0), torch.zeros(2)), "a tuple"),
    ({"loss": torch.tensor(1.0)}, "a dict"),
    (torch.ones(6), "a (6,) float32 tensor"),
    (torch.tensor(3), "a () int64 tensor"),
    (2.5, "a float"),
])
def test_the_loss_contract_names_what_loss_fn_returned(returned, what):
    from mpipe_verified.executor.loss import checked

    with pytest.raises(PipelineError) as err:
        checked(returned, "loss_fn", 1)
    message = str(err.value)
    assert message.startswith(f"rank 1: loss_fn returned {what}; it must return one "
                              "floating-point scalar tensor") and "\n" not in message
    assert checked(torch.ones(1, 1), "loss_fn", 1).shape == ()


def test_every_refusal_is_a_pipeline_error():
    """``except PipelineError`` catches what the executor raises: a refused certificate too
    (still a ``verify.report.CertificateError`` for code that catches that)."""
    from mpipe_verified.verify.report import CertificateError

    plan, encoder, stages, _ = tiny.prepare("1f1b", 2, 4, 8)
    with pytest.raises(PipelineError) as err:
        PipelineExecutor(plan, None, stages=stages, segments={"vision": encoder},
                         loss_fn=tiny.loss_fn, rank=0)
    assert isinstance(err.value, CertificateError)


def test_the_executor_package_star_import_gives_its_functions():
    """``from mpipe_verified.executor import *`` binds every name of ``__all__`` to what
    the docs call it (``certify`` the function, not a submodule)."""
    import subprocess

    code = ("from mpipe_verified.executor import *\n"
            "import mpipe_verified.executor as e, types\n"
            "bad = [n for n in e.__all__ if isinstance(globals()[n], types.ModuleType)]\n"
            "assert not bad and callable(certify), bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_world_larger_than_the_plan_points_to_group_and_mesh(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(PipelineError, match=r"rank 3 is outside the plan's ranks 0\.\.1 \(the "
                       r"world has 4 processes\): to run the pipeline on a part of the world "
                       r".*pass group= or mesh="):
        plan, encoder, stages, _ = tiny.prepare("1f1b", 2, 4, 8)
        PipelineExecutor(plan, certify(plan), stages=stages, segments={"vision": encoder},
                         loss_fn=tiny.loss_fn)


def test_split_layers_cuts_any_list_of_layers():
    """Given costs, parameter counts, named boundaries; measured costs are one positive
    number per layer and leave the layers as they were."""
    from torch import nn

    from mpipe_verified.executor import measured_costs, split_layers

    layers = [nn.Linear(4, 4), nn.Linear(4, 64), nn.Linear(64, 4), nn.Linear(4, 4)]
    by_params = split_layers(layers, 2)
    assert [len(s) for s in by_params] == [2, 2]
    given = split_layers(layers, 2, costs=[5, 1, 1, 1])
    assert [list(dict(s.named_children())) for s in given] == [["0"], ["1", "2", "3"]]
    named = [(f"l{i}", m) for i, m in enumerate(layers)]
    cut = split_layers(named, 3, boundaries=["l1", "l3"])
    assert [list(dict(s.named_children())) for s in cut] == [["l0"], ["l1", "l2"], ["l3"]]
    x = torch.randn(8, 4)
    assert torch.equal(cut[2](cut[1](cut[0](x))), layers[3](layers[2](layers[1](layers[0](x)))))
    with pytest.raises(ValueError, match="boundaries must name 2 of the layers"):
        split_layers(named, 3, boundaries=["l9", "l3"])
    before = [p.detach().clone() for m in layers for p in m.parameters()]
    costs = measured_costs(layers, x, repeats=2)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert all(p.grad is None for m in layers for p in m.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, (p for m in layers
                                                           for p in m.parameters())))


def test_clipping_follows_torch_for_infinite_and_nan_norms():
    """One rank's clipping (the reduction a no-op) against torch's own, for finite, inf
    and NaN gradients."""
    from torch import nn

    from mpipe_verified.executor.clipping import clip_grad_norm

    for bad in (None, float("inf"), float("nan")):
        mine, theirs = nn.Linear(3, 2), nn.Linear(3, 2)
        for model in (mine, theirs):
            torch.manual_seed(0)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
                if bad is not None:
                    p.grad[0] = bad
        got = clip_grad_norm(list(mine.parameters()), 0.5, 2.0, lambda t, is_max: None,
                             "cpu")
        want = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.5)
        assert torch.allclose(got, want, rtol=1e-6, equal_nan=True), (got, want)
        for a, b in zip(mine.parameters(), theirs.parameters()):
            assert torch.allclose(a.grad, b.grad, equal_nan=True, rtol=1e-6, atol=1e-7)


def test_an_evaluation_batch_without_a_target_is_weighted_by_rows():
    from mpipe_verified.executor.loss import microbatch_weights

    batch = Batch(body=torch.zeros(8, 4))
    assert microbatch_weights([batch.split(4)], 0, "mean", ignore_index=-100) == [0.25] * 4
    assert microbatch_weights([batch.split(4)], 0, "mean", loss_weight=len) == [0.25] * 4
