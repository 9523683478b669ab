"""One rank of the training-loop tests (run as a script by ``test_executor_training_loop.py``; it
holds no tests itself).

    python tests/test_executor_training_loop_worker.py OUT WORLD

Env init. ``WORLD`` 2 runs ``CASES[2]`` on a 2-rank pipeline, 4 runs ``CASES[4]`` on 2
pipeline ranks x 2 replicas (a ``(dp, pp)`` mesh). Each case builds the tiny MLLM's plan
with the case's model (``case_model``: a BatchNorm in the encoder and the body, an
unused parameter, a bf16 head), runs ``steps`` steps and saves to ``OUT/NAME.RANK.pt``
the step losses, the gradients of the last step (after clipping, with ``clip``), the
clipping norm, every buffer of every module this rank holds (copies of a segment
included) and, with an optimizer, every parameter this rank holds. The 2-rank launch ends
with batches that do not fit the plan (``OUT/fit.RANK.txt``) and a loss function that
returns a tuple: every rank writes what it raised to ``OUT/contract.RANK.txt``.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import train_tiny_mllm as tiny  # noqa: E402
from mpipe_verified.executor import (Batch, PipelineError, PipelineExecutor,  # noqa: E402
                                     certify, infer_payload_shapes, init_distributed,
                                     pipeline_mesh, split_sequential, with_payload_shapes)
from mpipe_verified.algebra import Transpose, family  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402

PP, IGNORE = 2, -100
VALID = (16, 2, 5, 0)  # valid target tokens of microbatch g: VALID[g % 4] (of 16)
FAMILIES = ("1f1b", "zb-h1", "zbv", "interleaved-1f1b")
CASES = {
    2: [*({"name": f"pad-{f}", "schedule": f, "pad": True} for f in FAMILIES),
        {"name": "pad-owner", "schedule": "transpose", "mode": "owner", "pad": True},
        {"name": "pad-weight-zb-h1", "schedule": "zb-h1", "pad": True, "weight": True},
        *({"name": f"bn-{mode}", "schedule": "transpose", "mode": mode, "bn": True,
           "steps": 2} for mode in ("recompute", "owner", "frozen")),
        {"name": "bn-inline", "schedule": "zb-h1", "bn": True, "steps": 2},
        {"name": "bf16-1f1b", "schedule": "1f1b", "bf16": True},
        {"name": "bf16-zbv", "schedule": "zbv", "bf16": True},
        {"name": "clip-1f1b", "schedule": "1f1b", "clip": 0.05},
        {"name": "clip-owner", "schedule": "transpose", "mode": "owner", "clip": 0.05},
        # the encoder's forwards all on rank 1, none on its home rank 0
        {"name": "bn-given-off-home", "schedule": "transpose", "mode": "frozen", "bn": True,
         "owners": (1, 1, 1, 1), "steps": 2},
        {"name": "bn-momentum-0", "schedule": "transpose", "mode": "owner", "bn": True,
         "momentum": 0.0, "steps": 2},
        {"name": "bn-momentum-none", "schedule": "transpose", "mode": "owner", "bn": True,
         "momentum": None, "steps": 2},
        # rank 1 runs its copy of the encoder in training mode between the steps
        {"name": "bn-drift", "schedule": "transpose", "mode": "owner", "bn": True,
         "drift": True, "steps": 2}],
    3: [{"name": "given-3", "schedule": "transpose", "mode": "frozen", "owners": (1, 2, 1, 2),
         "steps": 2},
        {"name": "bn-given-3", "schedule": "transpose", "mode": "owner", "bn": True,
         "owners": (1, 2, 1, 2), "steps": 2}],
    4: [{"name": "dp-unused", "schedule": "zb-h1", "unused": True, "optimizer": True,
         "steps": 2},
        {"name": "dp-bn-owner", "schedule": "transpose", "mode": "owner", "bn": True,
         "steps": 2},
        {"name": "dp-pad-clip", "schedule": "1f1b", "pad": True, "clip": 0.05},
        {"name": "dp-int16-buffer", "schedule": "zb-h1", "int16": True}],
}


def microbatches(case: dict) -> int:
    return 4


def pp_of(world: int) -> int:
    return 3 if world == 3 else PP


def replicas(world: int) -> int:
    return world // pp_of(world)


def rows(world: int) -> int:
    """The whole batch: 2 rows (16 target tokens) per microbatch of every replica."""
    return 2 * microbatches({}) * replicas(world)


# ---------------------------------------------------------------- models


class BNEncoder(tiny.VisionEncoder):
    """The vision encoder with a BatchNorm between its two layers."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.bn = nn.BatchNorm1d(hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.bn(self.fc1(images.flatten(1)))))


class SeqNorm(nn.Module):
    """A residual BatchNorm over the features of every position of ``(N, L, D)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(x.transpose(1, 2)).transpose(1, 2)


class Tagged(nn.Module):
    """A block with an int16 buffer no forward changes (gloo cannot broadcast int16)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("tag", torch.arange(4, dtype=torch.int16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Unused(nn.Module):
    """A block with a parameter its forward never uses (a branch not taken)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = tiny.Block(dim)
        self.branch = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class BF16Head(nn.Module):
    """The vocabulary head under bf16 autocast: it returns bf16 logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


def case_model(case: dict, num_stages: int) -> tuple[nn.Module, nn.Sequential]:
    """``(encoder, body)``, freshly built with the same seed on every rank."""
    encoder, body = tiny.build_model(max(6, num_stages - 2))
    layers = list(body)
    if case.get("bn"):
        torch.manual_seed(11)
        encoder = BNEncoder(32, 64)
        encoder.bn.momentum = case.get("momentum", 0.1)
        layers.insert(2, SeqNorm(32))
    if case.get("int16"):
        layers[1] = Tagged(layers[1])
    if case.get("unused"):
        torch.manual_seed(12)
        layers[-2] = Unused(32)
    if case.get("bf16"):
        layers[-1] = BF16Head(layers[-1])
    if case.get("mode") == "frozen":
        encoder.requires_grad_(False)
    return encoder, nn.Sequential(*layers)


def case_batch(case: dict, step: int, world: int) -> Batch:
    """The tiny MLLM's batch; with ``pad``, microbatch ``g`` of the whole batch keeps
    ``VALID[g % 4]`` target tokens and the rest are ``IGNORE``."""
    batch = tiny.make_batch(step, rows(world))
    if not case.get("pad"):
        return batch
    target = batch.target.clone()
    for g, block in enumerate(torch.tensor_split(target, target.shape[0] // 2)):
        flat = block.view(-1)
        flat[VALID[g % len(VALID)]:] = IGNORE
    return Batch(batch.body, target, batch.segments)


def loss_fn(case: dict):
    vocab = 64
    if case.get("weight"):
        def masked_mean(logits, target):  # a mask-weighted mean, 0/0 when all masked
            keep = target >= 0
            each = F.cross_entropy(logits.reshape(-1, vocab), target.clamp(min=0).reshape(-1),
                                   reduction="none")
            return (each * keep.reshape(-1)).sum() / keep.sum()
        return masked_mean
    if case.get("pad"):
        return lambda logits, target: F.cross_entropy(
            logits.reshape(-1, vocab), target.reshape(-1), ignore_index=IGNORE)
    return tiny.loss_fn


def loss_options(case: dict) -> dict:
    if case.get("weight"):
        return {"loss_weight": lambda target: (target >= 0).sum()}
    if case.get("pad"):
        return {"ignore_index": IGNORE}
    return {}


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


# ---------------------------------------------------------------- one rank


def case_term(case: dict, world: int):
    m, pp = microbatches(case), pp_of(world)
    if case.get("owners"):
        return Transpose(family("1f1b", pp, m), segment="vision", mode=case["mode"],
                         ownership="given", owners=case["owners"])
    return tiny.build_term(case["schedule"], pp, m, case.get("mode", "recompute"))


def build(case: dict, world: int):
    m = microbatches(case)
    term = case_term(case, world)
    plan = lower(term.derive())
    encoder, body = case_model(case, plan.placement.num_stages)
    stages = split_sequential(body, plan.placement.num_stages)
    block = case_batch(case, 0, world).split(replicas(world))[0]
    plan = with_payload_shapes(plan, infer_payload_shapes(stages, block, m,
                                                          {"vision": encoder}))
    return plan, encoder, body, stages


def run_case(case: dict, world: int, out: str, groups: dict) -> None:
    plan, encoder, body, stages = build(case, world)
    ex = PipelineExecutor(plan, certify(plan), stages=stages, segments={"vision": encoder},
                          loss_fn=loss_fn(case), **loss_options(case), **groups,
                          optimizer=optimizer if case.get("optimizer") else None)
    losses, norm = [], None
    for step in range(case.get("steps", 1)):
        batch = case_batch(case, step, world)
        ex.zero_grad()
        losses.append(ex.run(batch))
        if case.get("clip"):
            norm = float(ex.clip_grad_norm_(case["clip"]))
        if ex.optimizer is not None:
            ex.optimizer.step()
        if case.get("drift") and ex.rank == 1 and step == 0:  # the caller's own forward
            encoder(case_batch(case, 7, world).segments["vision"])
    names = {id(p): f"vision.{n}" for n, p in encoder.named_parameters()}
    names.update({id(p): f"body.{n}" for n, p in body.named_parameters()})
    held = {id(b): f"vision.{n}" for n, b in encoder.named_buffers()}
    held.update({id(b): f"body.{n}" for n, b in body.named_buffers()})
    modules = [*ex.stages.values(), *ex.segments.values()]
    result = {
        "losses": losses, "norm": norm, "plan_rank": ex.rank,
        "grads": {names[id(p)]: None if p.grad is None else p.grad.detach().clone()
                  for p in ex.parameters()},
        "buffers": {held[id(b)]: b.detach().clone() for mod in modules for b in mod.buffers()},
        "params": {names[id(p)]: p.detach().clone() for p in ex.parameters()},
    }
    torch.save(result, os.path.join(out, f"{case['name']}.{dist.get_rank()}.pt"))
    ex.close()


def misfits(out: str) -> None:
    """A transpose plan (owner mode: the encoder's outputs travel) annotated for 8-row
    batches gets the epoch's smaller last batch (6 rows), then a bf16 autocast its layouts
    were not inferred under: every rank refuses each with a
    ``BatchError`` before the plan starts (``OUT/fit.RANK.txt``, one message a line) and
    then trains on a batch that fits."""
    case = {"name": "fit", "schedule": "transpose", "mode": "owner"}  # encoder outputs sent
    plan, encoder, body, stages = build(case, 2)
    ex = PipelineExecutor(plan, certify(plan), stages=stages, segments={"vision": encoder},
                          loss_fn=tiny.loss_fn, timeout=20, group=dist.group.WORLD)
    lines = []
    for attempt in (lambda: ex.run(tiny.make_batch(0, 6)),
                    lambda: _under_bf16(ex, tiny.make_batch(0, 8))):
        try:
            attempt()
            lines.append("accepted")
        except PipelineError as err:
            lines.append(f"{type(err).__name__}: {err}")
    lines.append(f"then: {ex.run(tiny.make_batch(0, 8)):.4f}")
    with open(os.path.join(out, f"fit.{dist.get_rank()}.txt"), "w") as f:
        f.write("\n".join(lines))
    ex.close()


def _under_bf16(ex, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return ex.run(batch)


def evaluation(out: str) -> None:
    """A body with dropout and a BatchNorm, in training mode, evaluated twice by a
    forward-only plan: ``OUT/eval.RANK.pt`` holds both calls' last-stage outputs, the
    buffers before and after, and every module's mode after."""
    from mpipe_verified.algebra import ForwardOnly

    case = {"bn": True, "dropout": True}
    term = ForwardOnly(tiny.build_term("1f1b", PP, microbatches(case)))
    plan = lower(term.derive())
    encoder, body = eval_model()
    stages = split_sequential(body, plan.placement.num_stages)
    batch = tiny.make_batch(0, rows(2))
    plan = with_payload_shapes(plan, infer_payload_shapes(stages, batch, microbatches(case),
                                                          {"vision": encoder}))
    ex = PipelineExecutor(plan, certify(plan), stages=stages, segments={"vision": encoder},
                          loss_fn=tiny.loss_fn, group=dist.group.WORLD)
    before = {n: b.clone() for n, b in body.named_buffers()}
    first, second = ex.eval(batch), ex.eval(batch)
    torch.save({"outputs": [None if e is None else e.outputs for e in (first, second)],
                "before": before, "after": dict(body.named_buffers()),
                "training": [m.training for m in (*body.modules(), *encoder.modules())]},
               os.path.join(out, f"eval.{dist.get_rank()}.pt"))
    ex.close()


def eval_model():
    """The tiny MLLM with a BatchNorm and a dropout in its body."""
    encoder, body = tiny.build_model(6)
    torch.manual_seed(13)
    layers = list(body)
    layers.insert(2, SeqNorm(32))
    layers.insert(4, nn.Dropout(0.5))
    return encoder, nn.Sequential(*layers)


def resume(out: str) -> None:
    """Adam, 4 steps; the same from a state saved after 2 steps into freshly built
    modules; and from freshly built modules without the state (``OUT/resume.RANK.pt``:
    the three runs' last two losses)."""
    def executor():
        plan, encoder, body, stages = build({"schedule": "zb-h1"}, 2)
        return PipelineExecutor(plan, certify(plan), stages=stages,
                                segments={"vision": encoder}, loss_fn=tiny.loss_fn,
                                group=dist.group.WORLD,
                                optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))

    def train(ex, steps):
        return [ex.step(tiny.make_batch(step, rows(2))) for step in steps]

    first = executor()
    train(first, range(2))
    path = os.path.join(out, f"state.{dist.get_rank()}.pt")
    torch.save(first.state_dict(), path)
    straight = train(first, range(2, 4))
    resumed = executor()
    resumed.load_state_dict(torch.load(path))
    again = train(resumed, range(resumed.steps, 4))
    fresh = train(executor(), range(2, 4))
    torch.save({"straight": straight, "resumed": again, "fresh": fresh,
                "steps": resumed.steps}, os.path.join(out, f"resume.{dist.get_rank()}.pt"))
    first.close()


def broken_contract(out: str) -> None:
    """A loss function returning ``(loss, logits)``: the last stage's rank must refuse it
    with one line naming ``loss_fn``; its peer then fails too (the step is over)."""
    case = {"name": "contract", "schedule": "1f1b"}
    plan, encoder, body, stages = build(case, 2)
    ex = PipelineExecutor(plan, certify(plan), stages=stages, segments={"vision": encoder},
                          loss_fn=lambda y, t: (tiny.loss_fn(y, t), y), timeout=20,
                          group=dist.group.WORLD)
    try:
        ex.run(case_batch(case, 0, 2))
        message = "accepted"
    except PipelineError as err:
        message = f"{type(err).__name__}: {err}"
    with open(os.path.join(out, f"contract.{dist.get_rank()}.txt"), "w") as f:
        f.write(message)


def main() -> int:
    out, world = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    init_distributed()
    groups = {"group": dist.group.WORLD}  # close() then leaves the process group up
    if world == 4:
        groups = {"mesh": pipeline_mesh(PP), "pp_dim": "pp", "dp_dim": "dp"}
    for case in CASES[world]:
        run_case(case, world, out, groups)
    if world == PP:
        evaluation(out)
        resume(out)
        misfits(out)
        broken_contract(out)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
