"""Compiled and checkpointed stages (``executor/stage_setup.py``, docs/executor.md).

Single process, the executor's own calls: ``StageSetup`` as the executor builds it, the
stage's forward, ``StageSetup.check`` on its output, then ``split_backward``'s ``I`` and
``W`` (or ``B``'s ``torch.autograd.backward(..., inputs=...)``); gradients are compared
with ``torch.equal`` against a plain backward of an uncompiled copy of the stage with
the same weights. Compiled with ``backend="aot_eager"`` (AOTAutograd, like inductor, but
fast to compile) and ``dynamic=True``: the backward is then compiled with the forward,
which is where torch's donated buffers refuse the retained backward of ``I`` (without
the set-up, shown first). End to end: 2 gloo processes run one step of zb-h1 and zbv with
every stage compiled (``test_executor_stage_setup_worker.py``), against a single-process run.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from mpipe_verified.executor import PipelineError, split_backward  # noqa: E402
from mpipe_verified.executor.stage_setup import StageSetup  # noqa: E402
from mpipe_verified.ir import Compute  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
WORKER = os.path.join(HERE, "test_executor_stage_setup_worker.py")

import test_executor_stage_setup_worker as worker  # noqa: E402
from ranks import run_ranks  # noqa: E402

SPLIT = [Compute("F", 1, 0), Compute("I", 1, 0), Compute("W", 1, 0)]  # a zb rank's ops
PLAIN = [Compute("F", 1, 0), Compute("B", 1, 0)]
DONATED = "compiled with non-empty donated buffers"


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test starts with torch's default (donated buffers on) and no compiled code;
    the flag is put back as it was after it."""
    from torch._functorch import config
    with config.patch(donated_buffer=True):
        torch._dynamo.reset()
        yield config
        torch._dynamo.reset()


class Stage(nn.Module):
    """A middle stage: Linear, GELU, LayerNorm, Linear; ``ckpt`` checkpoints its first
    half (``"reentrant"``, ``"non-reentrant"`` or None)."""

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)
        self.ckpt = ckpt

    def first(self, x):
        return self.norm(nn.functional.gelu(self.fc1(x)))

    def forward(self, x):
        if self.ckpt is None:
            h = self.first(x)
        else:
            h = checkpoint(self.first, x, use_reentrant=self.ckpt == "reentrant")
        return self.fc2(h)


def stages(ckpt=None):
    """``(stage, an uncompiled copy with the same weights)``."""
    torch.manual_seed(0)
    stage = Stage(ckpt)
    return stage, copy.deepcopy(stage)


def microbatches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g))
            for rows in (4, 6)]  # two shapes: the second call recompiles or reuses


def plain(module, x, g):
    """``B`` on ``module``: backward into its input and parameters; the input gradient."""
    x = x.clone().requires_grad_(True)
    torch.autograd.backward([module(x)], [g], inputs=[x, *module.parameters()])
    return x.grad


def split(setup, call, module, x, g, mb=0):
    """``F`` (with the executor's check), then ``I`` and ``W``; the input gradient."""
    x = x.clone().requires_grad_(True)
    y = call(x)
    setup.check(Compute("F", 1, mb), module, y)
    (grad_in,), work = split_backward.backward_input(y, g, (x,), tuple(module.parameters()))
    split_backward.backward_weight(work)
    return grad_in


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_compiled_stage_fails_the_split_backward_without_the_set_up():
    stage, _ = stages()
    compiled = torch.compile(stage, backend="aot_eager", dynamic=True)
    x, g = microbatches()[0]
    x = x.requires_grad_(True)
    with pytest.raises(RuntimeError, match=DONATED):
        split_backward.backward_input(compiled(x), g, (x,), tuple(stage.parameters()))


def test_a_compiled_stage_split_backward_equals_a_plain_backward(fresh_compiler):
    setup = StageSetup(0, SPLIT)  # what the executor's constructor does
    assert fresh_compiler.donated_buffer is False
    stage, reference = stages()
    compiled = torch.compile(stage, backend="aot_eager", dynamic=True)
    for mb, (x, g) in enumerate(microbatches()):  # the gradients accumulate over both
        assert torch.equal(split(setup, compiled, stage, x, g, mb), plain(reference, x, g))
    assert_same_grads(stage, reference)


def test_a_compiled_stage_with_static_shapes_too(fresh_compiler):
    setup = StageSetup(0, SPLIT)
    stage, reference = stages()
    compiled = torch.compile(stage, backend="aot_eager")
    for mb, (x, g) in enumerate(microbatches()):
        assert torch.equal(split(setup, compiled, stage, x, g, mb), plain(reference, x, g))
    assert_same_grads(stage, reference)


def test_plans_without_split_backward_keep_donated_buffers(fresh_compiler):
    StageSetup(0, PLAIN)
    assert fresh_compiler.donated_buffer is True
    stage, reference = stages()
    compiled = torch.compile(stage, backend="aot_eager", dynamic=True)
    x, g = microbatches()[0]
    assert torch.equal(plain(compiled, x, g), plain(reference, x, g))  # B: no retained graph
    assert_same_grads(stage, reference)


def test_a_stage_compiled_with_donated_buffers_before_the_set_up_is_refused():
    """A warm-up backward (no retained graph) compiled the backward with donated buffers
    before the executor was built: turning the flag off now would only silence torch's
    check, so the first forward's check refuses it."""
    stage, _ = stages()
    compiled = torch.compile(stage, backend="aot_eager")
    x, g = microbatches()[0]
    compiled(x.clone().requires_grad_(True)).backward(g)
    setup = StageSetup(1, SPLIT)
    with pytest.raises(PipelineError) as err:
        split(setup, compiled, stage, x, g)
    message = str(err.value)
    assert message.startswith("rank 1: 1F0: stage 1 was compiled by torch.compile with "
                              "donated buffers"), message
    assert "\n" not in message


def test_a_stage_compiled_before_the_set_up_whose_backward_is_not_compiled_yet_runs():
    """A forward alone before the set-up (``infer_payload_shapes`` on compiled stages):
    the backward is compiled by ``I``, which retains the graph, so nothing is donated."""
    stage, reference = stages()
    compiled = torch.compile(stage, backend="aot_eager")
    x, g = microbatches()[0]
    compiled(x.clone().requires_grad_(True))
    setup = StageSetup(0, SPLIT)
    assert torch.equal(split(setup, compiled, stage, x, g), plain(reference, x, g))
    assert_same_grads(stage, reference)


def test_reentrant_checkpointing_is_refused_with_one_line_naming_the_stage():
    """Without the check: torch refuses ``B`` only at the backward, or, when the stage
    input is not among ``inputs`` (nothing to send back), the checkpointed layers' weights
    silently get no gradient."""
    stage, _ = stages("reentrant")
    x, g = microbatches()[0]
    x = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="use_reentrant=True"):
        torch.autograd.backward([stage(x)], [g], inputs=[x, *stage.parameters()])
    torch.autograd.backward([stage(x)], [g], inputs=list(stage.parameters()))
    assert stage.fc1.weight.grad is None and stage.fc2.weight.grad is not None
    for setup in (StageSetup(0, SPLIT), StageSetup(0, PLAIN)):
        with pytest.raises(PipelineError) as err:
            setup.check(Compute("F", 1, 0), stage, stage(x.clone().requires_grad_(True)))
        assert str(err.value) == (
            "rank 0: 1F0: stage 1 uses reentrant activation checkpointing "
            "(torch.utils.checkpoint with use_reentrant=True), which torch cannot run under "
            "the executor's backward (autograd.grad, backward(inputs=...)): pass "
            "use_reentrant=False")
    with pytest.raises(PipelineError, match=r"^rank 0: vision:0R1: segment 'vision' uses "):
        StageSetup(0, PLAIN).check(Compute("R", 0, 1, "vision"), stage,
                                   [{"h": stage(x.clone().requires_grad_(True))}])


def test_non_reentrant_checkpointing_runs_and_equals_a_plain_backward():
    stage, reference = stages("non-reentrant")
    reference.ckpt = None
    setup = StageSetup(0, SPLIT)
    for mb, (x, g) in enumerate(microbatches()):
        assert torch.equal(split(setup, stage, stage, x, g, mb), plain(reference, x, g))
    assert_same_grads(stage, reference)
    stage.zero_grad()
    reference.zero_grad()
    x, g = microbatches()[0]
    assert torch.equal(plain(stage, x, g), plain(reference, x, g))  # B
    assert_same_grads(stage, reference)


def test_reentrant_checkpointing_inside_a_compiled_stage_is_traced_and_runs():
    """``torch.compile`` traces the checkpointed region into its graph: no reentrant node
    is left, nothing is refused, and the split backward equals a plain one."""
    stage, reference = stages("reentrant")
    reference.ckpt = None
    setup = StageSetup(0, SPLIT)
    compiled = torch.compile(stage, backend="aot_eager")
    for mb, (x, g) in enumerate(microbatches()):
        assert torch.equal(split(setup, compiled, stage, x, g, mb), plain(reference, x, g))
    assert_same_grads(stage, reference)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_the_graph_is_looked_at_once_per_module_and_not_without_a_graph():
    stage, _ = stages("reentrant")
    setup = StageSetup(0, PLAIN)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        setup.check(Compute("F", 1, 0), stage, stage(x))  # no graph: nothing to look at
    with pytest.raises(PipelineError):
        setup.check(Compute("F", 1, 1), stage, stage(x))
    fine, _ = stages()
    setup.check(Compute("F", 1, 0), fine, fine(x))
    fine.ckpt = "reentrant"  # changed after its first forward: not looked at again
    setup.check(Compute("F", 1, 1), fine, fine(x))


def test_compiled_stages_train_on_two_gloo_ranks_like_a_single_process(tmp_path):
    codes, texts = run_worker(str(tmp_path))
    assert codes == [0, 0], "\n".join(texts)
    for schedule in worker.SCHEDULES:
        want_loss, want = worker.reference(schedule)
        got = {}
        for r in range(2):
            res = torch.load(tmp_path / f"{schedule}.{r}.pt")
            assert abs(res["loss"] - want_loss) <= 1e-5, (schedule, res["loss"], want_loss)
            assert not set(got) & set(res["grads"])
            got.update(res["grads"])
        assert set(got) == set(want), schedule
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, atol=1e-5, rtol=0,
                                       msg=lambda m, k=key: f"{schedule} {k}: {m}")


def run_worker(out: str, timeout: float = 240) -> tuple[list, list]:
    """Run the worker on 2 gloo processes; ``(exit codes, outputs)``."""
    return run_ranks(WORKER, [out], 2, out, timeout)


def test_the_docs_script_runs_as_written(tmp_path):
    """docs/executor.md's compiled-stages script on 2 gloo processes (``aot_eager`` in
    place of the default backend, which compiles for much longer) prints the docs'
    losses."""
    text = open(os.path.join(HERE, "..", "docs", "executor.md")).read()
    section = text.split("## Compiled and checkpointed stages\n", 1)[1].split("\n## ", 1)[0]
    script = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert "torch.compile(stage)" in script
    (tmp_path / "compiled.py").write_text(
        script.replace("torch.compile(stage)", 'torch.compile(stage, backend="aot_eager")'))
    run = os.path.join(os.path.dirname(sys.executable), "mpipe-run")
    done = subprocess.run([run, "--nproc", "2", "--backend", "gloo",
                           str(tmp_path / "compiled.py")], cwd=os.path.join(HERE, ".."),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = re.findall(r"^\[rank0\]:(step \d loss [0-9.]+)$", done.stdout, re.M)
    assert printed == re.findall(r"`(step \d loss\s+[0-9.]+)`", section.replace("\n", " ")), \
        done.stdout
