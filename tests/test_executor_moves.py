"""The executor runs activation moves (docs/semantics.md §2.10, docs/executor.md
"Activation moves") against a single-process run, with real gloo processes on CPU.

One launch per world size (2 and 4 ranks, ``test_executor_worker.py``) runs the
``offload`` modifier on 1f1b and zb-h1 and a lend/return plan (1f1b with stage 0's
activations lent to stage 1's rank, ``worker.lend_plan``: the algebra makes no rank
moves), each with one SGD step: the loss, every gradient and every parameter after the
step equal one process's (float32, atol 1e-5); each rank's measured peaks of stored
activations on the device and in host memory equal the verifier's; and each offloaded
activation really left the device: after its ``OFFLOAD`` none of its bytes is on the
device and, past the first stage (whose token ids the batch holds), no dropped device
tensor is still alive (``Activation.census``). In one process, an offloaded activation's
own storages are emptied and its other saved tensors collected, and the backward after
the reload is bitwise the plain one.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import test_executor as base  # noqa: E402
import test_executor_example as example  # noqa: E402
import test_executor_worker as worker  # noqa: E402
from mpipe_verified.executor import moves  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402


def cases(world: int) -> list[dict]:
    m = 2 * world
    return [{"name": "offload-1f1b", "schedule": "1f1b", "m": m, "offload": [1, 1],
             "sgd": True},
            {"name": "offload-zb-h1", "schedule": "zb-h1", "m": m, "offload": [1, 0],
             "sgd": True},
            {"name": "lend-1f1b", "schedule": "1f1b", "m": m, "lend": [0, 1], "sgd": True}]


NAMES = [c["name"] for c in cases(2)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return {world: base.Launch(world, str(tmp_path_factory.mktemp(f"moves{world}")), None,
                               cases(world)) for world in (2, 4)}


def results_of(launches, world: int, name: str) -> list[dict]:
    run = launches[world]
    results = [run.result(name, r) for r in range(world)]
    assert all(r is not None for r in results), f"{name} produced no result\n{run.describe()}"
    return results


def plan_of(case: dict, world: int):
    plan = lower(worker.case_term(case, world).derive())
    return worker.lend_plan(plan, case["lend"]) if case.get("lend") else plan


def test_the_cases_move_activations_and_verify():
    for world in (2, 4):
        for case in cases(world):
            plan = plan_of(case, world)
            text = plan.canonical_text()
            assert ("OFFLOAD" in text) == bool(case.get("offload"))
            assert ("LEND" in text) == bool(case.get("lend"))
            assert verify(plan).verified, (world, case["name"])


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", NAMES)
def test_loss_grads_and_sgd_step_match_single_process(launches, world, name):
    case = next(c for c in cases(world) if c["name"] == name)
    results = results_of(launches, world, name)
    want_loss, want, _ = base.reference(case, world)
    segments, body, _, _ = base.forward(case, world)  # a fresh model: the weights before
    before = {f"{n}.{k}": p.detach() for n, mod in segments.items()
              for k, p in mod.named_parameters()}
    before.update({f"body.{k}": p.detach() for k, p in body.named_parameters()})
    got_grads, got_params = {}, {}
    for r, res in enumerate(results):
        assert abs(res["loss"] - want_loss) <= 1e-5, (r, res["loss"], want_loss)
        for key, grad in res["grads"].items():
            assert key not in got_grads, f"{key} has a gradient on two ranks"
            got_grads[key] = grad
        got_params.update(res["params"])
    assert set(got_grads) == set(want)
    for key in want:
        torch.testing.assert_close(got_grads[key], want[key], atol=1e-5, rtol=0)
        torch.testing.assert_close(got_params[key], before[key] - worker.SGD_LR * want[key],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", NAMES)
def test_device_and_host_peaks_equal_the_verifiers(launches, world, name):
    results = results_of(launches, world, name)
    assert [r["stored_peak"] for r in results] == [r["verified_peak"] for r in results]
    assert [r["host_peak"] for r in results] == [r["verified_host_peak"] for r in results]
    if name.startswith("offload"):
        assert results[0]["host_peak"] >= 1  # rank 0 offloads (its backwards come late)
    else:
        assert all(r["host_peak"] == 0 for r in results)


_STAGE = re.compile(r"^(\d+)(OFFLOAD|RELOAD)\d+$")


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", NAMES)
def test_moved_activations_really_leave_the_device(launches, world, name):
    results = results_of(launches, world, name)
    plan = plan_of(next(c for c in cases(world) if c["name"] == name), world)
    for rank, res in enumerate(results):
        log = res["moves"]
        offloads = [(op, c) for op, c in log if "OFFLOAD" in op]
        assert len(offloads) == sum("OFFLOAD" in str(op) for op in plan.programs[rank])
        for op, census in offloads:
            assert census["device"] == 0 and census["host"] > 0, (rank, op, census)
            if int(_STAGE.match(op).group(1)) > 0:
                assert census["shared"] == 0, (rank, op, census)  # every dropped tensor freed
        for op, census in log:
            if "RELOAD" in op:
                assert census["host"] == 0 and census["device"] > 0, (rank, op, census)
        lent = [c for op, c in log if "SEND_LEND" in op]
        if name.startswith("lend") and rank == 0:
            assert len(lent) == 2 and all(c["sent"] > 0 for c in lent), log


def _stage():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                               torch.nn.Tanh())


def test_an_offloaded_activation_frees_its_device_tensors_and_backward_is_bitwise_plain():
    x0 = torch.randn(4, 8)
    plain = _stage()
    plain(x0.clone().requires_grad_(True)).sum().backward()
    stage = _stage()
    mover = moves.Mover(0, torch.device("cpu"))
    capture = moves.Capture((stage,))
    x = x0.clone().requires_grad_(True)
    with capture.hooks():
        y = stage(x)
    activation = mover.activation(capture, [x], [y])
    dropped = [weakref.ref(h.tensor) for h in activation.handles]
    assert dropped and activation.own  # intermediates by handle; input and output by storage
    activation.offload()
    gc.collect()
    assert all(ref() is None for ref in dropped)  # nothing else held them: freed
    assert x.untyped_storage().nbytes() == 0 and y.untyped_storage().nbytes() == 0
    assert activation.census() == {"device": 0, "host": activation.nbytes(), "shared": 0}
    activation.reload()
    assert torch.equal(x, x0)
    torch.autograd.backward([y], [torch.ones_like(y)], inputs=[x, *stage.parameters()])
    for a, b in zip(plain.parameters(), stage.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_example_offloads_zb_h1_and_checks_grads():
    example.example_grads_match(2, ["--schedule", "zb-h1", "--offload", "1", "--steps", "1"])


def test_a_move_of_a_segment_activation_is_refused_at_construction():
    import attrs
    import train_tiny_mllm as tiny
    from mpipe_verified.executor import PipelineError, PipelineExecutor
    from mpipe_verified.ir import Compute, Offload, Reload
    plan, encoder, stages, _ = tiny.prepare("1f1b", 2, 4, 8)
    program = list(plan.programs[0])
    program.insert(program.index(Compute("F", 0, 0, "vision")) + 1, Offload(0, 0, "vision"))
    program.insert(program.index(Compute("B", 0, 0, "vision")), Reload(0, 0, "vision"))
    plan = attrs.evolve(plan, programs=(tuple(program), *plan.programs[1:]))
    report = verify(plan)
    assert report.verified
    with pytest.raises(PipelineError, match="moves body activations only"):
        PipelineExecutor(plan, report.certificate, stages=stages,
                         segments={"vision": encoder}, loss_fn=tiny.loss_fn, rank=0)


def test_a_rank_move_for_another_activation_is_refused_by_its_header():
    from mpipe_verified.executor import PayloadMismatchError
    from mpipe_verified.ir import LEND, RETURN, Payload
    mover = moves.Mover(1, torch.device("cpu"))
    head = mover._header(Payload(LEND, 0, 1), 64)
    assert mover._check(head, Payload(LEND, 0, 1), 0, "1RECV_LEND1", "header") == 64
    for other in (Payload(LEND, 0, 0), Payload(RETURN, 0, 1)):
        with pytest.raises(PayloadMismatchError, match="received lend of stage 0 mb 1"):
            mover._check(head, other, 0, "1RECV_LEND0", "header")


def test_a_move_between_i_and_w_is_refused():
    from mpipe_verified.executor import PipelineError
    from mpipe_verified.ir import Compute, Offload, Reload
    program = (Compute("F", 0, 0), Compute("I", 0, 0), Offload(0, 0), Compute("W", 0, 0),
               Reload(0, 0))
    with pytest.raises(PipelineError, match="between its I and its W"):
        moves.check_plan(program, 0, {("", 0, 0)})
    moves.check_plan((Compute("F", 0, 0), Offload(0, 0), Reload(0, 0), Compute("I", 0, 0),
                      Compute("W", 0, 0)), 0, {("", 0, 0)})
