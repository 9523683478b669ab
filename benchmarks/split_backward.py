"""What a split backward costs in our executor, side by side with its peers, in one run.

    python benchmarks/split_backward.py [--repeats 15] [--steps 8] [--worlds 2 4]

1. ``split_backward_ratio``: one compute-bound stage (a stack of MLP blocks), the time of
   ``I`` then ``W`` (``executor.split_backward``) over the time of one plain backward
   ``B`` of the same forward; median over ``--repeats`` rounds, the contenders rotating
   who goes first. The ratio is of CPU time (one thread does all the work, and CPU time
   does not count the time other processes of a shared machine hold the core); the wall
   ratio is printed beside it. PyTorch's own ``stage_backward_input`` + ``stage_backward_weight``
   and the former executor split (``autograd.grad`` with the graph retained, then a
   backward over the whole graph into the weights) are timed in the same rounds.
2. ``zb_h1_over_1f1b``: the executor's step time with the zb-h1 plan over the 1f1b plan
   (same GPT-like model with causal attention, compute-bound, same stages and batch),
   on 2 and 4 gloo processes, steps alternating; the larger ratio of the world sizes.
   Beside each: the CPU time of a step summed over the ranks (all threads), which bounds
   the step from below on a machine with fewer cores than ranks.

Targets: ``split_backward_ratio <= 1.1``, ``zb_h1_over_1f1b <= 1.0``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
ROWS = 256  # rows of the one-stage input


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15, help="rounds of the stage timing")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per plan and world")
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--dim", type=int, default=512, help="width of the one-stage MLP stack")
    ap.add_argument("--gpt-dim", type=int, default=256, help="width of the GPT")
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)  # set for the launched ranks
    return ap.parse_args(argv)


# ---------------------------------------------------------------- models


def mlp_stack(dim: int, layers: int = 4):
    from torch import nn
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                         nn.Linear(4 * dim, dim)) for _ in range(layers)])


def gpt(dim: int, layers: int, vocab: int = 256, length: int = 32, heads: int = 4):
    """A small GPT: embedding, pre-norm blocks with causal self-attention and an MLP, head."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(
                torch.randn(length, dim) * 0.02)

        def forward(self, tokens):
            return self.tok(tokens) + self.pos[: tokens.shape[1]]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, heads, dim // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, dim))
            return x + self.fc2(F.gelu(self.fc1(self.n2(x))))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

        def forward(self, x):
            return self.out(self.norm(x))

    torch.manual_seed(0)
    return nn.Sequential(Embed(), *[Block() for _ in range(layers)], Head())


# ---------------------------------------------------------------- 1. one stage


def stage_ratio(args) -> dict:
    import torch
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)
    from mpipe_verified.executor import split_backward

    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = mlp_stack(args.dim)
    params = tuple(stage.parameters())
    x0 = torch.randn(ROWS, args.dim)
    g = torch.randn(ROWS, args.dim)

    def forward():
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(True)
        return x, stage(x)

    def plain(x, y):
        torch.autograd.backward(y, g, inputs=[x, *params])

    def ours(x, y):
        _, work = split_backward.backward_input(y, g, (x,), params)
        split_backward.backward_weight(work)

    def former(x, y):
        torch.autograd.grad(y, [x], g, retain_graph=True)
        torch.autograd.backward(y, g, inputs=list(params))

    def torch_split(x, y):
        _, groups = stage_backward_input([y], [g], [x], iter(params))
        stage_backward_weight(iter(params), groups)

    contenders = [("B", plain), ("ours I+W", ours), ("former I+W", former),
                  ("torch I+W", torch_split)]
    want = None
    for name, fn in contenders:  # same gradients first (and a warm-up)
        x, y = forward()
        fn(x, y)
        got = [p.grad.clone() for p in params]
        want = want or got
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, want)), name
    wall = {name: [] for name, _ in contenders}
    cpu = {name: [] for name, _ in contenders}
    for i in range(args.repeats):
        k = i % len(contenders)
        for name, fn in contenders[k:] + contenders[:k]:
            x, y = forward()
            t, c = time.perf_counter(), time.thread_time()
            fn(x, y)
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
    return ({name: statistics.median(ts) for name, ts in wall.items()},
            {name: statistics.median(ts) for name, ts in cpu.items()})


# ---------------------------------------------------------------- 2. executor steps


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mpipe_verified.algebra import family
    from mpipe_verified.executor import (Batch, PipelineExecutor, certify, infer_payload_shapes,
                                         init_distributed, split_sequential,
                                         with_payload_shapes)
    from mpipe_verified.lower import lower

    torch.set_num_threads(1)
    rank, world, _ = init_distributed()
    m = 2 * world
    full = gpt(args.gpt_dim, 2 * world)
    stages = split_sequential(full, world)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4 * m, 33), generator=g)
    batch = Batch(body=tokens[:, :-1], target=tokens[:, 1:])

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    executors = {}
    for name in ("1f1b", "zb-h1"):
        plan = lower(family(name, world, m).derive())
        plan = with_payload_shapes(plan, infer_payload_shapes(stages, batch, m))
        executors[name] = PipelineExecutor(plan, certify(plan), stages=stages, loss_fn=loss_fn)
    times = {name: [] for name in executors}
    names = list(executors)
    cpu = torch.zeros(len(names), dtype=torch.float64)  # this rank's CPU seconds, per plan
    for i in range(2 + args.steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            ex = executors[name]
            ex.zero_grad()
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            ex.run(batch, broadcast_loss=False)
            c = time.process_time() - c
            dist.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - t)
                cpu[names.index(name)] += c
    dist.all_reduce(cpu)  # summed over the ranks
    if rank == 0:
        with open(args.rank_out, "w") as f:
            json.dump({"times": times, "cpu": {name: cpu[i].item() / args.steps
                                               for i, name in enumerate(names)}}, f)
    executors["1f1b"].close()
    return 0


def world_ratio(world: int, args) -> dict:
    from mpipe_verified.executor.launch import launch
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.json")
        argv = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps),
                "--gpt-dim", str(args.gpt_dim), "--rank-out", out]
        code = launch(world, argv, "gloo")
        if code != 0:
            raise SystemExit(f"the {world}-rank run failed (exit {code})")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    args = parse(argv)
    if args.rank_out and "RANK" in os.environ:
        return rank_main(args)
    wall, cpu = stage_ratio(args)
    print(f"one stage (MLP stack, dim {args.dim}, 4 blocks, {ROWS} rows; median of "
          f"{args.repeats} rounds; CPU time of the one compute thread, and wall time):")
    for name in cpu:
        print(f"  {name:11} cpu {cpu[name] * 1e3:8.2f} ms ({cpu[name] / cpu['B']:.2f} x B)"
              f"   wall {wall[name] * 1e3:8.2f} ms ({wall[name] / wall['B']:.2f} x B)")
    worst = 0.0
    for world in args.worlds:
        got = world_ratio(world, args)
        times, step_cpu = got["times"], got["cpu"]
        med = {name: statistics.median(ts) for name, ts in times.items()}
        paired = statistics.median(a / b for a, b in zip(times["zb-h1"], times["1f1b"]))
        ratio = med["zb-h1"] / med["1f1b"]
        worst = max(worst, ratio)
        print(f"{world} ranks (GPT dim {args.gpt_dim}, {2 * world} blocks, m={2 * world}, "
              f"{args.steps} steps each): 1f1b {med['1f1b'] * 1e3:.1f} ms, zb-h1 "
              f"{med['zb-h1'] * 1e3:.1f} ms, ratio {ratio:.3f}, paired {paired:.3f}; "
              f"CPU per step, all ranks: 1f1b {step_cpu['1f1b'] * 1e3:.1f} ms, zb-h1 "
              f"{step_cpu['zb-h1'] * 1e3:.1f} ms ({os.cpu_count()} cores)")
    print(f"split_backward_ratio={cpu['ours I+W'] / cpu['B']:.3f}  (CPU time; wall "
          f"{wall['ours I+W'] / wall['B']:.3f})")
    if args.worlds:
        print(f"zb_h1_over_1f1b={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
