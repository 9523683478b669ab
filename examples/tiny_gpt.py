"""A tiny causal-attention GPT whose pipeline stages take and extend a KV cache: the model
``train_tiny_mllm.py --schedule seq1f1b`` trains, each sample cut into ``--seq-chunks``
sequence chunks (docs/executor.md, "Sequence chunks").

    mpipe-run --nproc 2 examples/train_tiny_mllm.py --schedule seq1f1b --seq-chunks 2 --check-grads

Stage ``s`` holds ``blocks`` attention blocks, the token and position embedding first on
stage 0 and the vocabulary head last on the last stage. It is called as ``stage(x,
cache=cache)`` and returns ``(output, cache)``: ``cache`` is one ``(keys, values)`` pair
per block, what the sample's earlier chunks left (None for its first chunk), and the
returned cache appends this chunk's. The first stage's position embedding starts where
the cache ends. Run over a whole sample with ``cache=None`` (``whole_sequence``) it is the
plain model, which ``--check-grads`` compares with.

The data: each row counts ``a, a + d, a + 2d, ...`` modulo the vocabulary from a random
start ``a`` and stride ``d`` (deterministic per step and seed); the target is the next
token. With ``pad`` each row keeps a random number of target tokens and the rest are
``IGNORE`` (-100).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from mpipe_verified.algebra import family
from mpipe_verified.executor import Batch, infer_payload_shapes, with_payload_shapes
from mpipe_verified.lower import lower

VOCAB, LENGTH, DIM, HEADS = 64, 12, 32, 2
IGNORE = -100


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP; ``kv``: the earlier positions' keys and
    values, ``(batch, heads, positions, head_dim)`` each, or None."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, kv=None):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(d, -1))
        if kv is not None:
            k, v = torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2)
        past = k.shape[2] - t  # query i sits at position past + i
        later = (torch.arange(k.shape[2], device=x.device)[None, :]
                 > past + torch.arange(t, device=x.device)[:, None])
        scores = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).masked_fill(
            later, float("-inf"))
        x = x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)))), (k, v)


class Stage(nn.Module):
    """``blocks`` blocks, with the embedding first (``first``) and the head last
    (``last``); ``forward(x, cache=None) -> (output, cache)``."""

    def __init__(self, blocks: int, first: bool, last: bool, dim: int = DIM,
                 heads: int = HEADS, vocab: int = VOCAB, length: int = LENGTH) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim) if first else None
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.02) if first else None
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)) if last else None

    def forward(self, x: torch.Tensor, cache=None):
        cache = cache if cache is not None else (None,) * len(self.blocks)
        if self.tok is not None:
            past = 0 if cache[0] is None else cache[0][0].shape[2]
            x = self.tok(x) + self.pos[past:past + x.shape[1]]
        kept = []
        for block, kv in zip(self.blocks, cache):
            x, kv = block(x, kv)
            kept.append(kv)
        return (self.head(x) if self.head is not None else x), tuple(kept)


def build_stages(num_stages: int, blocks: int = 1, seed: int = 0) -> list[Stage]:
    """The model as ``num_stages`` stages; the same seed gives the same weights."""
    torch.manual_seed(seed)
    return [Stage(blocks, s == 0, s == num_stages - 1) for s in range(num_stages)]


def whole_sequence(stages, tokens: torch.Tensor) -> torch.Tensor:
    """The plain model: every stage over whole samples (no cache), the logits."""
    x = tokens
    for stage in stages:
        x, _ = stage(x)
    return x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the valid (not ``IGNORE``) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE)


def make_batch(step: int, rows: int, length: int = LENGTH, seed: int = 0,
               pad: bool = False) -> Batch:
    """Rows counting modulo ``VOCAB`` from a random start by a random stride."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    stride = torch.randint(1, 5, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(length + 1)[None, :]) % VOCAB
    target = tokens[:, 1:]
    if pad:
        kept = torch.randint(0, length + 1, (rows, 1), generator=g)
        target = target.masked_fill(torch.arange(length)[None, :] >= kept, IGNORE)
    return Batch(body=tokens[:, :-1], target=target)


def prepare(pp: int, samples: int, seq_chunks: int, rows: int, seed: int = 0,
            schedule: str = "seq1f1b"):
    """``(plan, stages)``: the family's plan of ``samples`` samples of ``seq_chunks``
    chunks, payload shapes annotated from the first step's batch, and the model's
    stages."""
    plan = lower(family(schedule, pp, samples, seq_chunks=seq_chunks).derive())
    stages = build_stages(plan.placement.num_stages, seed=seed)
    shapes = infer_payload_shapes(stages, make_batch(0, rows, seed=seed),
                                  plan.num_microbatches, seq_chunks=seq_chunks)
    return with_payload_shapes(plan, shapes), stages


def reference_grads(num_stages: int, batch: Batch, seed: int = 0,
                    clip: float | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (``body.S.NAME``) of one process over whole samples."""
    stages = build_stages(num_stages, seed=seed)
    loss_fn(whole_sequence(stages, batch.body), batch.target).backward()
    named = [(f"body.{n}", p) for n, p in nn.ModuleList(stages).named_parameters()]
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
    return {n: p.grad for n, p in named}


def train(args, world: int, rank: int, run) -> int:
    """``train_tiny_mllm.py --schedule seq1f1b``: build the tiny GPT's plan,
    then train it with the example's ``run`` (its ``train``); the exit code."""
    for flag in ("audio", "batchnorm", "bf16"):
        if getattr(args, flag):
            print(f"rank {rank}: --{flag} does not apply to {args.schedule} (the tiny GPT "
                  "has no encoder)", file=sys.stderr)
            return 2
    if getattr(args, "offload", None) is not None:
        print(f"rank {rank}: --offload does not apply to {args.schedule}: a plan of sequence "
              "chunks moves no activation (later chunks read its keys and values)",
              file=sys.stderr)
        return 2
    pp = world // args.dp
    samples = args.microbatches or pp
    rows = args.batch_size or 2 * samples * args.dp
    try:
        if rows % args.dp:
            raise ValueError(f"--batch-size {rows} does not split evenly over {args.dp} replicas")
        plan, stages = prepare(pp, samples, args.seq_chunks, rows // args.dp, args.seed,
                               args.schedule)
    except ValueError as err:
        print(f"rank {rank}: cannot build the plan: {err}", file=sys.stderr)
        return 2
    return run(args, world, rank, plan, stages, {}, nn.ModuleList(stages),
               lambda: reference_grads(plan.placement.num_stages,
                                       make_batch(0, rows, seed=args.seed, pad=args.pad),
                                       args.seed, args.clip),
               lambda step: make_batch(step, rows, seed=args.seed, pad=args.pad),
               f"tiny GPT, {plan.placement.num_stages} stages, {samples} samples of "
               f"{args.seq_chunks} sequence chunks")
