"""Shape inference leaves the model as it found it (single process, no process group).

``infer_payload_shapes`` runs the model's forward to learn payload shapes, and
``ShapeCache`` calls it whenever a batch of a new shape comes, in the middle of training.
That forward must not show: every buffer (BatchNorm statistics and its batch counter, a
counter the model keeps itself, a buffer the forward replaces or sets from None), every
parameter and its ``.grad``, every module's ``training`` flag and the random number
generator are bitwise what they were before, with ``meta`` False or True, when the meta
forward falls back to real tensors, and when the forward raises.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

from torch import nn  # noqa: E402

from mpipe_verified.algebra import Transpose, family  # noqa: E402
from mpipe_verified.executor import (Batch, ShapeCache, infer_payload_shapes,  # noqa: E402
                                     with_payload_shapes)
from mpipe_verified.ir import Recv, Send  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402

DIM, FEATURES, IMAGE = 6, 5, 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


class Encoder(nn.Module):
    """The source segment: Linear, BatchNorm1d (train mode), dropout, and a call counter
    updated in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IMAGE, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, image):
        self.calls += 1
        return self.drop(self.bn(self.fc(image)))


class First(nn.Module):
    """Body stage 0: the image embedding added to every position of the body input, a
    BatchNorm1d over the channels, dropout; its buffers: ``calls`` (in place), ``rows``
    (replaced by a new tensor) and ``last`` (None until the first forward sets it).
    ``real_only``: refuse meta tensors (as an op without a meta kernel does);
    ``fail``: raise after the buffers have changed."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("rows", torch.zeros((), dtype=torch.long))
        self.register_buffer("last", None)
        self.real_only = self.fail = False

    def forward(self, image, x):
        if self.real_only and x.device.type == "meta":
            raise NotImplementedError("no meta kernel for this op")
        self.calls += 1
        self.rows = self.rows + x.shape[0]
        h = self.fc(x) + image[:, None, :]
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        self.last = h.detach().mean()
        if self.fail:
            raise RuntimeError("the forward failed")
        return self.drop(h)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, h):
        return self.fc(self.drop(h))


def make_model(device="cpu"):
    """``(encoder, stages)`` in train mode, warmed up by one forward and backward (the
    BatchNorm statistics moved, the counters at 1, ``last`` set, then cleared to None)
    and with half of the parameters holding a ``.grad`` (mid-training: some still None)."""
    torch.manual_seed(0)
    encoder, stages = Encoder().to(device), [First().to(device), Head().to(device)]
    batch = make_batch(8, 5, device)
    h = stages[0](encoder(batch.segments["vision"]), batch.body)
    stages[1](h).square().mean().backward()
    params = [p for m in (encoder, *stages) for p in m.parameters()]
    for i, p in enumerate(params):
        p.grad = None if i % 2 else torch.randn_like(p)
    # a submodule left in eval mode: its flag must survive too
    stages[1].drop.eval()
    stages[0].last = None  # a cache cleared: the next forward sets it again

    return encoder, stages


def make_batch(rows, length, device="cpu"):
    g = torch.Generator().manual_seed(rows * 100 + length)
    batch = Batch(body=torch.randn(rows, length, FEATURES, generator=g),
                  target=torch.randn(rows, length, 4, generator=g),
                  segments={"vision": torch.randn(rows, IMAGE, generator=g)})
    return batch if device == "cpu" else Batch(
        body=batch.body.to(device), target=batch.target.to(device),
        segments={"vision": batch.segments["vision"].to(device)})


def snapshot(encoder, stages):
    """Everything a forward could change, copied: per module, every state_dict tensor,
    every buffer slot (None included), every module's training flag, every parameter's
    ``.grad``; and the RNG states (CPU, and CUDA where there is one)."""
    modules = {"vision": encoder, **{f"stage{i}": s for i, s in enumerate(stages)}}
    state = {}
    for name, module in modules.items():
        state[name] = {
            "state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "buffers": {f"{n}.{k}": None if b is None else b.detach().clone()
                        for n, m in module.named_modules() for k, b in m._buffers.items()},
            "training": {n: m.training for n, m in module.named_modules()},
            "grads": {n: None if p.grad is None else p.grad.clone()
                      for n, p in module.named_parameters()},
            "grad_ids": {n: id(p.grad) for n, p in module.named_parameters()},
        }
    state["rng"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def assert_same(before, after):
    assert before.keys() == after.keys()
    for name in before:
        if name == "rng":
            assert torch.equal(before[name], after[name]), "the CPU RNG state moved"
            continue
        if name == "cuda_rng":
            assert all(torch.equal(a, b) for a, b in zip(before[name], after[name])), \
                "a CUDA RNG state moved"
            continue
        b, a = before[name], after[name]
        assert b["state_dict"].keys() == a["state_dict"].keys(), name
        for k in b["state_dict"]:
            assert b["state_dict"][k].dtype == a["state_dict"][k].dtype, (name, k)
            assert torch.equal(b["state_dict"][k], a["state_dict"][k]), \
                f"{name}.{k} changed: {b['state_dict'][k]} -> {a['state_dict'][k]}"
        assert b["buffers"].keys() == a["buffers"].keys(), name
        for k in b["buffers"]:
            x, y = b["buffers"][k], a["buffers"][k]
            assert (x is None) == (y is None), f"{name}.{k}: {x} -> {y}"
            assert x is None or torch.equal(x, y), f"{name}.{k}: {x} -> {y}"
        assert b["training"] == a["training"], name
        assert b["grad_ids"] == a["grad_ids"], f"{name}: a .grad was replaced"
        for k in b["grads"]:
            x, y = b["grads"][k], a["grads"][k]
            assert (x is None) == (y is None), f"{name}.{k}.grad: {x} -> {y}"
            assert x is None or torch.equal(x, y), f"{name}.{k}.grad changed"


def transposed_plan(m=4):
    return lower(Transpose(family("1f1b", pp=2, microbatches=m), segment="vision",
                           mode="recompute", ownership="full").derive())


def act_shapes(plan):
    return {p.shape for prog in plan.programs for c in prog if isinstance(c, (Send, Recv))
            for p in (c.payload,) if p.kind == "act"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("meta", [False, True])
def test_infer_payload_shapes_leaves_the_model_as_it_was(meta, device):
    encoder, stages = make_model(device)
    before = snapshot(encoder, stages)
    fn = infer_payload_shapes(stages, make_batch(8, 5, device), 4, {"vision": encoder},
                              meta=meta)
    assert_same(before, snapshot(encoder, stages))
    # and the shapes are still right (2 rows per microbatch)
    assert act_shapes(with_payload_shapes(transposed_plan(), fn)) >= {(2, 5, DIM)}


def test_meta_fallback_to_real_tensors_leaves_the_model_as_it_was():
    encoder, stages = make_model()
    stages[0].real_only = True
    before = snapshot(encoder, stages)
    fn = infer_payload_shapes(stages, make_batch(8, 5), 4, {"vision": encoder}, meta=True)
    assert_same(before, snapshot(encoder, stages))
    assert act_shapes(with_payload_shapes(transposed_plan(), fn)) >= {(2, 5, DIM)}


@pytest.mark.parametrize("meta", [False, True])
def test_a_failing_forward_leaves_the_model_as_it_was(meta):
    encoder, stages = make_model()
    stages[0].fail = True
    before = snapshot(encoder, stages)
    with pytest.raises(RuntimeError, match="the forward failed"):
        infer_payload_shapes(stages, make_batch(8, 5), 4, {"vision": encoder}, meta=meta)
    assert_same(before, snapshot(encoder, stages))


@pytest.mark.parametrize("meta", [False, True])
def test_shape_cache_new_signatures_leave_the_model_as_it_was(meta):
    encoder, stages = make_model()
    cache = ShapeCache(transposed_plan(), stages=stages, loss_fn=nn.functional.mse_loss,
                       segments={"vision": encoder}, meta=meta, rank=0)
    before = snapshot(encoder, stages)
    # two signatures: 8 rows of length 5 (microbatches of 2), 10 of length 7 (3, 3, 2, 2)
    first = cache.executor(make_batch(8, 5))
    assert_same(before, snapshot(encoder, stages))
    second = cache.executor(make_batch(10, 7))
    assert_same(before, snapshot(encoder, stages))
    assert first is not second and cache.certified == 2
    assert cache.executor(make_batch(8, 5)) is first
    assert act_shapes(first.plan) >= {(2, 5, DIM)}
    assert act_shapes(second.plan) >= {(3, 7, DIM), (2, 7, DIM)}


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_alone_draws_nothing_from_the_generator(device):
    """No buffer at all: only the random number generator could show the forward."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(FEATURES, DIM), nn.Dropout(0.5)).to(device),
              nn.Sequential(nn.Dropout(0.5), nn.Linear(DIM, 4)).to(device)]
    before = snapshot(stages[0], stages[1:])
    infer_payload_shapes(stages, Batch(body=make_batch(8, 5, device).body), 4)
    assert_same(before, snapshot(stages[0], stages[1:]))
