"""Several pipelines over one model, and any stage map, run by the executor against a
single-process run, with real gloo processes on CPU (docs/executor.md, "Several pipelines
over one model").

One launch per world size (2 and 4 ranks, ``test_executor_worker.py``) runs DualPipe,
Chimera and BitPipe (two pipelines over the model's stages: the encoder inside model
stage 0), the single-pipeline families of other stage maps (looped-bfs, interleaved-zb,
hanayo, v-half) and an unbalanced explicit map (a rank holding stages {0, 1, 4},
torch's ``ScheduleUnbalanced``), each for one step with SGD: the loss, each microbatch's
loss, every gradient (on every copy of a replicated stage) and every parameter after the
step (every copy) equal one process's (float32, atol 1e-5), and each rank's measured peak
of stored activations is the verifier's. The 2-rank launch ends with replicas that do not
start equal (the start-up broadcast bypassed, one rank's weights perturbed): every rank
refuses before any step. (``tests/test_executor_example.py`` trains the example with
DualPipe on 2 ranks and Chimera with ``--dp 2`` on 4, ``--check-grads``.)
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import ranks  # noqa: E402
import test_executor_worker as worker  # noqa: E402
import train_tiny_mllm as tiny  # noqa: E402
from mpipe_verified.executor import PipelineError, PipelineExecutor, certify  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402

FAMILIES = ("dualpipe", "chimera", "bitpipe", "looped-bfs", "interleaved-zb", "hanayo",
            "v-half")
MAPS = {2: "weave(pp=2, microbatches=4, pattern='F* B*', chunks=3, placement='0,0,1,1,0')",
        4: "weave(pp=4, microbatches=8, pattern='F* B*', chunks=3, "
           "placement='0,0,1,2,2,3,0')"}
LR = worker.SGD_LR  # what a case's "sgd" trains with
LAUNCH_TIMEOUT = 300


def cases(world: int) -> list[dict]:
    m = 2 * world
    out = [{"name": f, "schedule": f, "m": m, "sgd": LR} for f in FAMILIES]
    out.append({"name": "unbalanced-map", "term": MAPS[world], "m": m, "sgd": LR})
    if world == 2:  # last: its refusal leaves that executor failed
        out.append({"name": "dualpipe-unequal", "schedule": "dualpipe", "m": m,
                    "unequal": True})
    return out


TRAINED = [c["name"] for c in cases(2) if not c.get("unequal")]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One launch per world size, every case of it in turn: ``{world: (out_dir, exit
    codes, output per rank)}``."""
    out = {}
    for world in (2, 4):
        d = str(tmp_path_factory.mktemp(f"pipelines{world}"))
        with open(os.path.join(d, "cases.json"), "w") as f:
            json.dump(cases(world), f)
        codes, errs = ranks.run_ranks(worker.__file__, [d, os.path.join(d, "cases.json")],
                                      world, d, timeout=LAUNCH_TIMEOUT)
        out[world] = (d, codes, errs)
    return out


def results(launches, world: int, name: str) -> list[dict]:
    d, codes, errs = launches[world]
    paths = [os.path.join(d, f"{name}.{r}.pt") for r in range(world)]
    assert all(map(os.path.exists, paths)), f"{name}: no result\n{codes}\n" + "\n".join(
        e[-3000:] for e in errs)
    return [torch.load(p) for p in paths]


def reference(case: dict, world: int) -> tuple[float, list, dict, dict]:
    """One process on the whole batch: loss, each microbatch's loss, every gradient and
    every parameter after one SGD step, of the model the worker builds (the model's
    stages: a plan of K pipelines has K replicas of each)."""
    plan = worker.case_term(case, world).derive()
    n = plan.placement.num_stages // max(len(plan.pipelines), 1)
    encoder, body = tiny.build_models(n, "recompute", 6, 32, 0)
    encoder = encoder["vision"]
    batch = tiny.make_batch(0, worker.rows_for(case["m"]))
    loss, grads = ranks.whole_batch(encoder, body, batch, tiny.loss_fn)
    with torch.no_grad():  # each microbatch's own loss
        x = body[0](encoder(batch.segments["vision"]), batch.body)
        for layer in list(body)[1:]:
            x = layer(x)
        per_mb = [float(tiny.loss_fn(a, b)) for a, b in zip(
            torch.tensor_split(x, case["m"]), torch.tensor_split(batch.target, case["m"]))]
    named = [(f"vision.{n}", p) for n, p in encoder.named_parameters()]
    named += [(f"body.{n}", p) for n, p in body.named_parameters()]
    grads = {key: g.clone() for key, g in grads.items()}
    torch.optim.SGD([p for _, p in named], lr=LR).step()
    return loss, per_mb, grads, {key: p.detach().clone() for key, p in named}


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", TRAINED)
def test_one_sgd_step_equals_one_process(launches, world, name):
    case = next(c for c in cases(world) if c["name"] == name)
    got = results(launches, world, name)
    want_loss, want_losses, want_grads, want_params = reference(case, world)
    for r, res in enumerate(got):
        assert abs(res["loss"] - want_loss) <= 1e-5, (r, res["loss"], want_loss)
        assert max(abs(a - b) for a, b in zip(res["losses"], want_losses)) <= 1e-5, r
    for what, want in (("grads", want_grads), ("params", want_params)):
        seen = set()
        for r, res in enumerate(got):  # every copy of a replicated stage
            for key, value in res[what].items():
                torch.testing.assert_close(value, want[key], atol=1e-5, rtol=0,
                                           msg=lambda m_, k=key, r=r: f"{name} on {world} "
                                           f"ranks, rank {r}, {what} {k}: {m_}")
                seen.add(key)
        assert seen == set(want), sorted(set(want) ^ seen)


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", TRAINED)
def test_measured_stored_peak_equals_verified_peak(launches, world, name):
    got = results(launches, world, name)
    measured = [r["stored_peak"] for r in got]
    assert measured == [r["verified_peak"] for r in got], measured
    assert max(measured) >= 2


@pytest.mark.parametrize("world", (2, 4))
def test_replicated_stages_are_held_by_several_ranks(launches, world):
    """The sums and equal copies above are real: in DualPipe every model stage's gradient
    is on two ranks."""
    got = results(launches, world, "dualpipe")
    holders: dict = {}
    for r, res in enumerate(got):
        for key in res["grads"]:
            holders.setdefault(key, set()).add(r)
    assert holders and all(len(h) == 2 for h in holders.values()), holders


def test_replicas_that_do_not_start_equal_are_refused_by_every_rank(launches):
    d, codes, errs = launches[2]
    texts = []
    for r in range(2):
        path = os.path.join(d, f"dualpipe-unequal.{r}.txt")
        assert os.path.exists(path), f"{codes}\n" + "\n".join(e[-3000:] for e in errs)
        texts.append(open(path).read())
    for r, text in enumerate(texts):
        assert text.startswith(f"rank {r}: the replicas of model stage 0: ranks [0] "
                               "against [1] hold different weights"), text
    # both went on after refusing: the worker finished its cases (its exit code is left
    # out: gloo's threads once aborted one of them at interpreter exit, after the cases)
    assert all(os.path.exists(os.path.join(d, f"done.{r}")) for r in range(2)), (codes, errs)


# ------------------------------------------------------------ refused at construction


@pytest.fixture(scope="module")
def dualpipe():
    """A certified DualPipe plan on 2 ranks (4 plan stages over a model of 2) and the
    model's 2 stages."""
    plan, _, stages, _ = tiny.prepare("dualpipe", 2, 4, 8)
    return plan, certify(plan), stages


def test_the_model_stages_are_asked_for(dualpipe):
    plan, cert, stages = dualpipe
    with pytest.raises(PipelineError, match=r"4 stage modules, but the plan runs 2 "
                       r"pipelines over a model of 2 stages: pass the model's 2"):
        PipelineExecutor(plan, cert, stages=[*stages, *stages], loss_fn=tiny.loss_fn, rank=0)
    with pytest.raises(PipelineError, match=r"key the modules by model stage \(0\.\.1\)"):
        PipelineExecutor(plan, cert, stages={0: stages[0], 3: stages[1]},
                         loss_fn=tiny.loss_fn, rank=0)
    ex = PipelineExecutor(plan, cert, stages=stages, loss_fn=tiny.loss_fn, rank=0)
    assert {s: ex.stages[s] for s in (0, 3)} == {0: stages[0], 3: stages[1]}


def test_a_parameter_tied_across_model_stages_is_refused(dualpipe):
    plan, cert, stages = dualpipe
    tied = [stages[0], torch.nn.Sequential(stages[1])]
    tied[1].register_parameter("tie", next(stages[0].parameters()))
    with pytest.raises(PipelineError, match="parameters tied across model stages"):
        PipelineExecutor(plan, cert, stages=tied, loss_fn=tiny.loss_fn, rank=0)


def test_evaluating_several_pipelines_is_refused():
    from mpipe_verified.algebra import family
    from mpipe_verified.executor import infer_payload_shapes, with_payload_shapes
    plan = lower(family("dualpipe", 2, 4, forward_only=True).derive())
    _, _, stages, _ = tiny.prepare("dualpipe", 2, 4, 8)
    batch = tiny.inline(tiny.make_batch(0, 8), ["vision"])
    plan = with_payload_shapes(plan, infer_payload_shapes(stages, batch, 4))
    with pytest.raises(PipelineError, match="forward-only plan of several pipelines"):
        PipelineExecutor(plan, certify(plan), stages=stages, loss_fn=tiny.loss_fn, rank=0)
