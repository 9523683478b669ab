"""Train a tiny multimodal LM with a certified pipeline plan.

    mpipe-run --nproc 4 examples/train_tiny_mllm.py --schedule transpose --steps 20
    torchrun --nproc-per-node 4 examples/train_tiny_mllm.py --schedule zb-h1 --steps 20
    mpipe-run --nproc 2 examples/train_tiny_mllm.py --schedule transpose --mode owner --audio
    mpipe-run --nproc 4 examples/train_tiny_mllm.py --schedule zb-h1 --dp 2 --check-grads
    mpipe-run --nproc 4 examples/train_tiny_mllm.py --schedule dualpipe --steps 3 --check-grads
    mpipe-run --nproc 2 examples/train_tiny_mllm.py --schedule seq1f1b --seq-chunks 2 --check-grads

The model: a vision encoder (a 2-layer MLP over flattened 3x4x4 synthetic "images") and a
decoder LM (token + position embedding plus the image embedding, attention-free residual
blocks that mix tokens with a causal running mean, a vocabulary head); with ``--audio`` a
second source encoder (an MLP over a synthetic 4x8 "spectrogram") whose embedding is
added like the image's. The data: synthetic image–caption pairs, one caption per image
class, images (and sounds) are the class prototype plus noise (deterministic per step
and seed, identical on every rank).

The script builds the algebra term (``--schedule NAME`` for every family, with the encoder
kept inline on the first stage as a cut segment; ``--schedule transpose --mode
recompute|owner|frozen`` moves the encoder into the bubbles; ``--audio`` cuts the audio
encoder too and, with transpose, moves it as ``--audio-mode`` says; the families of several
pipelines over one model, dualpipe, chimera and bitpipe, take no cut: the encoders run
inside model stage 0 and the plan's stages are replicas of the model's), derives and
lowers it, writes the payload shapes into the plan, verifies it (and refuses to run unless it is
verified), then runs it with ``PipelineExecutor``; rank 0 prints ``step K loss X``.
``--dp N`` runs ``N`` data-parallel replicas of a ``world / N``-rank pipeline (a
``(dp, pp)`` device mesh; each replica takes its block of the batch's rows).
``--check-grads`` compares, after the first step, every gradient with a single-process
run on the whole batch; rank 0 prints ``grads match a single-process run: max abs diff X``.

A real training loop's parts: ``--pad`` gives each caption a random length and marks the
rest of its target ``IGNORE`` (-100), which the loss ignores and the executor weights
microbatches by (``ignore_index``: the step's loss is the mean over valid tokens);
``--batchnorm`` puts a BatchNorm in the vision encoder (its running statistics are kept
as one process would keep them); ``--clip C`` clips the global gradient norm to ``C``;
``--bf16`` runs every module under bf16 autocast (the logits and the loss are bf16). With
``--batchnorm`` or ``--bf16`` the single-process run of ``--check-grads`` takes the
microbatches one after another, as the pipeline does (batch statistics and bf16 rounding
are per microbatch).

``--schedule seq1f1b`` (sequence chunks) trains another model: the tiny causal-attention
GPT of ``tiny_gpt.py``, whose stages take and extend a KV cache, each sample cut into
``--seq-chunks`` chunks along its sequence (``--microbatches`` counts samples there).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mpipe_verified.algebra import FAMILIES, Transpose, family  # noqa: E402
from mpipe_verified.algebra.families import BIDIRECTIONAL, SEQ_FAMILIES  # noqa: E402
from mpipe_verified.algebra.terms import Offloaded  # noqa: E402
from mpipe_verified.cli.targets import offload_option  # noqa: E402
from mpipe_verified.executor import (Batch, CertificateError, PipelineError,  # noqa: E402
                                     PipelineExecutor, infer_payload_shapes, init_distributed,
                                     pipeline_mesh, split_sequential, with_payload_shapes)
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402

SCHEDULES = (*FAMILIES, *BIDIRECTIONAL, "transpose", *SEQ_FAMILIES)
# several pipelines over one model (docs/executor.md): no cut segment there, so the
# encoders run inside model stage 0 (``EncoderFirst``) on the batch's body
PIPELINED = tuple(BIDIRECTIONAL)
MODES = ("recompute", "owner", "frozen")
IMAGE = (3, 4, 4)
SOUND = (4, 8)
IGNORE = -100  # a padded target position (--pad)


# ---------------------------------------------------------------- model


class VisionEncoder(nn.Module):
    def __init__(self, dim: int, hidden: int, batchnorm: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(IMAGE), hidden)
        self.norm = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(images.flatten(1)))))


class Autocast(nn.Module):
    """``inner`` under bf16 autocast (``--bf16``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        device = inputs[0].device.type
        with torch.autocast(device, dtype=torch.bfloat16):
            return self.inner(*inputs)


class AudioEncoder(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(SOUND), hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, sounds: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(sounds.flatten(1))))


class Embed(nn.Module):
    """Token + position embedding plus the image embedding (broadcast over positions);
    with ``--audio``, the sound's embedding then scales each feature (FiLM-like)."""

    def __init__(self, vocab: int, dim: int, length: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.02)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        image, *sound, tokens = inputs
        x = self.tok(tokens) + self.pos[: tokens.shape[1]] + image[:, None, :]
        for e in sound:
            x = x * (1 + torch.tanh(e))[:, None, :]
        return x


class Block(nn.Module):
    """Attention-free: a residual MLP over each position and its causal running mean."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(2 * dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        mixed = h.cumsum(1) / steps
        return x + self.fc2(F.gelu(self.fc1(torch.cat([h, mixed], -1))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_model(layers: int = 6, dim: int = 32, vocab: int = 64, length: int = 8,
                seed: int = 0, batchnorm: bool = False, bf16: bool = False
                ) -> tuple[nn.Module, nn.Sequential]:
    """``(encoder, body)``; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    encoder = VisionEncoder(dim, 2 * dim, batchnorm)
    layers = [Embed(vocab, dim, length), *[Block(dim) for _ in range(layers)], Head(dim, vocab)]
    if bf16:
        return Autocast(encoder), nn.Sequential(*map(Autocast, layers))
    return encoder, nn.Sequential(*layers)


class EncoderFirst(nn.Module):
    """Model stage 0 with the encoders inside it (a plan of several pipelines has no cut
    segment): called as ``(images, [sounds,] tokens)``, the body of ``inline(batch)``."""

    def __init__(self, encoders: dict[str, nn.Module], first: nn.Module) -> None:
        super().__init__()
        self.encoders, self.first = nn.ModuleDict(encoders), first

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *raw, tokens = inputs
        return self.first(*(e(x) for e, x in zip(self.encoders.values(), raw)), tokens)


def inline(batch: Batch, names) -> Batch:
    """``batch`` for ``EncoderFirst``: the encoders' inputs (``names``, in order) and the
    tokens as the body, no segments."""
    return Batch(body=(*(batch.segments[n] for n in names), batch.body), target=batch.target)


def model_stages(plan) -> int:
    """The model's stages: a plan of K pipelines runs K replicas of each."""
    return plan.placement.num_stages // max(len(plan.pipelines), 1)


def build_audio(dim: int = 32, seed: int = 0) -> nn.Module:
    """The audio encoder (its own seed: the other weights stay as without it)."""
    torch.manual_seed(seed + 1)
    return AudioEncoder(dim, 2 * dim)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the microbatch's valid (not ``IGNORE``) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE)


def make_batch(step: int, rows: int, vocab: int = 64, length: int = 8, classes: int = 8,
               seed: int = 0, audio: bool = False, pad: bool = False) -> Batch:
    """Synthetic image–caption pairs (with ``audio``, and a sound per pair): class
    prototypes (fixed by ``seed``) plus noise. With ``pad`` each caption keeps a random
    number of target tokens (0 to ``length``) and the rest are ``IGNORE``."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(classes, *IMAGE, generator=g)
    captions = torch.randint(0, vocab, (classes, length + 1), generator=g)
    g.manual_seed(seed * 1_000_003 + step + 1)
    labels = torch.randint(0, classes, (rows,), generator=g)
    images = prototypes[labels] + 0.3 * torch.randn(rows, *IMAGE, generator=g)
    text = captions[labels]
    segments = {"vision": images}
    if audio:  # drawn after the rest: the other fields stay as without it
        sounds = torch.randn(classes, *SOUND, generator=g)
        segments["audio"] = sounds[labels] + 0.3 * torch.randn(rows, *SOUND, generator=g)
    target = text[:, 1:]
    if pad:  # drawn last, like the audio
        kept = torch.randint(0, length + 1, (rows, 1), generator=g)
        target = target.masked_fill(torch.arange(length)[None, :] >= kept, IGNORE)
    return Batch(body=text[:, :-1], target=target, segments=segments)


# ---------------------------------------------------------------- plan


def build_term(schedule: str, pp: int, microbatches: int, mode: str = "recompute",
               ownership: str = "full", body: str = "1f1b", audio_mode: str | None = None,
               offload: tuple[int, int] | None = None):
    """Every family keeps the encoder inline on the first stage (a cut segment on rank
    0; in ``PIPELINED`` families, which take no cut, inside model stage 0);
    ``transpose`` moves it into the bubbles of the ``body`` family. ``audio_mode``
    (None: no audio) cuts the audio encoder the same way, after the vision one.
    ``offload``: ``(gap, prefetch)`` of the ``offload`` modifier, applied last."""
    term = family(body if schedule == "transpose" else schedule, pp, microbatches)
    for name, how in (("vision", mode), ("audio", audio_mode)):
        if how is None or schedule in PIPELINED:
            continue
        if schedule == "transpose":
            term = Transpose(term, segment=name, mode=how, ownership=ownership)
        else:
            term = Transpose(term, segment=name, ownership="inline",
                             mode="frozen" if how == "frozen" else "recompute")
    return term if offload is None else Offloaded(term, *offload)


def prepare(schedule: str, pp: int, microbatches: int, rows: int, mode: str = "recompute",
            ownership: str = "full", body: str = "1f1b", layers: int = 6, dim: int = 32,
            seed: int = 0):
    """Term → plan (lowered, shapes annotated) and the model split to the plan's stages.
    Returns ``(plan, encoder, stages, full_body)``."""
    plan, encoders, stages, full = prepare_encoders(schedule, pp, microbatches, rows, mode,
                                                    ownership, body, layers, dim, seed)
    return plan, encoders["vision"], stages, full


def build_models(num_stages: int, mode: str, layers: int, dim: int, seed: int,
                 audio_mode: str | None = None, batchnorm: bool = False, bf16: bool = False
                 ) -> tuple[dict[str, nn.Module], nn.Module]:
    """``(encoders by segment name in cut order, full body)`` for a plan of
    ``num_stages`` stages, a frozen mode's encoder frozen (the same weights every call)."""
    vision, full = build_model(max(layers, num_stages - 2), dim, seed=seed,
                               batchnorm=batchnorm, bf16=bf16)
    encoders = {"vision": vision}
    if audio_mode is not None:
        encoders["audio"] = build_audio(dim, seed)
    for name, how in (("vision", mode), ("audio", audio_mode)):
        if how == "frozen":
            encoders[name].requires_grad_(False)
    return encoders, full


def prepare_encoders(schedule: str, pp: int, microbatches: int, rows: int,
                     mode: str = "recompute", ownership: str = "full", body: str = "1f1b",
                     layers: int = 6, dim: int = 32, seed: int = 0,
                     audio_mode: str | None = None, batchnorm: bool = False,
                     bf16: bool = False, offload: tuple[int, int] | None = None):
    """``prepare`` with the audio encoder too when ``audio_mode`` is given: returns
    ``(plan, encoders, stages, full_body)``, ``encoders`` by segment name, in cut order.
    ``PIPELINED`` schedules: ``stages`` are the model's, the encoders inside stage 0
    (``EncoderFirst``; train on ``inline(batch, encoders)``)."""
    term = build_term(schedule, pp, microbatches, mode, ownership, body, audio_mode, offload)
    plan = lower(term.derive())
    num_stages = model_stages(plan)
    encoders, full = build_models(num_stages, mode, layers, dim, seed, audio_mode,
                                  batchnorm, bf16)
    stages = split_sequential(full, num_stages)
    batch = make_batch(0, rows, seed=seed, audio=audio_mode is not None)
    if plan.pipelines:
        stages[0] = EncoderFirst(encoders, stages[0])
        shapes = infer_payload_shapes(stages, inline(batch, encoders), microbatches)
    else:
        shapes = infer_payload_shapes(stages, batch, microbatches, encoders)
    return with_payload_shapes(plan, shapes), encoders, stages, full


# ---------------------------------------------------------------- checking


def reference_grads(num_stages: int, rows: int, mode: str, layers: int, dim: int, seed: int,
                    audio_mode: str | None = None, batchnorm: bool = False,
                    bf16: bool = False, pad: bool = False, clip: float | None = None,
                    pieces: int = 1) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient of one single-process run of the freshly
    built model (``vision.NAME``, ``audio.NAME``, ``body.NAME``) with the plan's
    ``num_stages`` on the first step's batch, clipped to ``clip``: the whole batch at
    once, or with ``batchnorm``/``bf16`` its ``pieces`` microbatches (of every replica, in
    row order) one after another, each loss weighted by its share of the valid targets."""
    encoders, body = build_models(num_stages, mode, layers, dim, seed, audio_mode,
                                  batchnorm, bf16)
    batch = make_batch(0, rows, seed=seed, audio=audio_mode is not None, pad=pad)
    parts = batch.split(pieces) if batchnorm or bf16 else [batch]
    valid = [int((mb.target != IGNORE).sum()) for mb in parts]
    for mb, count in zip(parts, valid):
        x = body[0](*(e(mb.segments[n]) for n, e in encoders.items()), mb.body)
        for layer in list(body)[1:]:
            x = layer(x)
        if count:  # a microbatch of padding only adds nothing
            (loss_fn(x, mb.target) * (count / sum(valid))).backward()
    named = [(f"{s}.{n}", p) for s, e in encoders.items() for n, p in e.named_parameters()]
    named += [(f"body.{n}", p) for n, p in body.named_parameters()]
    trained = [(n, p) for n, p in named if p.requires_grad]
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], clip)
    return {n: p.grad for n, p in trained}


def check_grads(executor: PipelineExecutor, encoders: dict[str, nn.Module], full: nn.Module,
                want: dict[str, torch.Tensor]) -> bool:
    """Compare the gradients this rank trains with ``want``; over the whole world, every
    parameter must be covered and the largest difference at most 1e-5 (printed by rank 0)."""
    names = {id(p): f"{s}.{n}" for s, e in encoders.items() for n, p in e.named_parameters()}
    names.update({id(p): f"body.{n}" for n, p in full.named_parameters()})
    order = sorted(want)
    covered = torch.zeros(len(order) + 1, dtype=torch.float64)
    for p in executor.parameters():
        name = names[id(p)]
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        covered[order.index(name)] = 1
        covered[-1] = max(float(covered[-1]), float((got - want[name]).abs().max()))
    diff = covered[-1:].clone()
    dist.all_reduce(covered[:-1], op=dist.ReduceOp.MAX)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    missing = [n for n, c in zip(order, covered[:-1].tolist()) if not c]
    ok = not missing and float(diff) <= 1e-5
    if dist.get_rank() == 0:
        verdict = "match" if ok else "differ from"
        print(f"grads {verdict} a single-process run: max abs diff {float(diff):.2e}"
              + (f" ({len(missing)} parameters without a gradient: {missing[:3]})"
                 if missing else ""), flush=True)
    return ok


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                    help="seq1f1b trains the tiny causal-attention GPT of tiny_gpt.py "
                         "instead (sequence chunks: see --seq-chunks)")
    ap.add_argument("--seq-chunks", type=int, default=2, metavar="S",
                    help="seq1f1b: sequence chunks per sample (default 2)")
    ap.add_argument("--mode", choices=MODES, default="recompute",
                    help="transpose: how the encoder trains (frozen also applies to families)")
    ap.add_argument("--ownership", choices=("inline", "full", "min", "cost"), default="full",
                    help="transpose: which ranks run the encoder forwards")
    ap.add_argument("--body", choices=tuple(FAMILIES), default="1f1b",
                    help="transpose: the body schedule")
    ap.add_argument("--audio", action="store_true",
                    help="a second source encoder (audio), cut after the vision one")
    ap.add_argument("--audio-mode", choices=MODES, default=None,
                    help="--audio: how the audio encoder trains (default: --mode)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=None,
                    help="default: 2 x ranks (seq1f1b: samples, default: ranks)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="default: 4 x microbatches (seq1f1b: 2 x samples)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas (world = pipeline ranks x DP)")
    ap.add_argument("--check-grads", action="store_true",
                    help="after the first step, compare every gradient with a "
                         "single-process full-batch run")
    ap.add_argument("--pad", action="store_true",
                    help="captions of random length, the rest of each target ignored "
                         "(ignore_index): the loss is the mean over valid tokens")
    ap.add_argument("--batchnorm", action="store_true",
                    help="a BatchNorm in the vision encoder")
    ap.add_argument("--clip", type=float, default=None, metavar="C",
                    help="clip the global gradient norm to C every step")
    ap.add_argument("--bf16", action="store_true", help="every module under bf16 autocast")
    ap.add_argument("--timeout", type=float, default=None, help="seconds (MPIPE_TIMEOUT)")
    ap.add_argument("--offload", type=offload_option, default=None, metavar="GAP[,PREFETCH]",
                    help="offload(TERM, gap, prefetch): each body activation whose backward "
                         "is at least GAP+1 steps later goes to host memory after its "
                         "forward and comes back PREFETCH steps before that backward")
    args = ap.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.dp < 1 or world % args.dp:
        print(f"rank {rank}: --dp {args.dp} does not divide the world of {world} processes",
              file=sys.stderr)
        return 2
    if args.schedule in SEQ_FAMILIES:  # sequence chunks: the tiny GPT (tiny_gpt.py)
        import tiny_gpt
        return tiny_gpt.train(args, world, rank, train)
    pp = world // args.dp
    m = args.microbatches or 2 * pp
    rows = args.batch_size or 4 * m * args.dp
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    audio_mode = (args.audio_mode or args.mode) if args.audio else None
    try:
        if rows % args.dp:
            raise ValueError(f"--batch-size {rows} does not split evenly over {args.dp} replicas")
        plan, encoders, stages, full = prepare_encoders(args.schedule, pp, m, rows // args.dp,
                                                        args.mode, args.ownership, args.body,
                                                        args.layers, args.dim, args.seed,
                                                        audio_mode, args.batchnorm, args.bf16,
                                                        args.offload)
    except ValueError as err:
        print(f"rank {rank}: cannot build the plan: {err}", file=sys.stderr)
        return 2
    def want():
        return reference_grads(model_stages(plan), rows, args.mode, args.layers, args.dim,
                               args.seed, audio_mode, args.batchnorm, args.bf16, args.pad,
                               args.clip, m * args.dp)
    pipes = (f" ({len(plan.pipelines)} pipelines of {model_stages(plan)})"
             if plan.pipelines else "")

    def batch_at(step: int) -> Batch:
        batch = make_batch(step, rows, seed=args.seed, audio=args.audio, pad=args.pad)
        return inline(batch, encoders) if plan.pipelines else batch

    return train(args, world, rank, plan, stages, encoders, full, want, batch_at,
                 f"{plan.placement.num_stages} stages{pipes}, {m} microbatches")


def train(args, world: int, rank: int, plan, stages, encoders, full, want, batch_at,
          described: str) -> int:
    """Verify ``plan`` (exit 1 if it is not), then run it for ``args.steps`` steps on
    ``batch_at(step)`` (Adam, ``args.clip``), comparing the gradients after the first with
    ``want()`` with ``--check-grads``; the exit code. ``described``: the model's part of
    rank 0's first line."""
    report = verify(plan)
    if not report.verified:
        if rank == 0:
            print(f"plan is {report.status}; refusing to run it", file=sys.stderr)
            for v in report.violations[:5]:
                print(f"  {v.property}: {v.message}", file=sys.stderr)
        return 1
    certificate, want = report.certificate, want() if args.check_grads else None
    pp = world // args.dp
    try:
        groups = {}
        if args.dp > 1:
            init_distributed()  # the mesh needs the process group first
            groups = {"mesh": pipeline_mesh(pp), "pp_dim": "pp", "dp_dim": "dp"}
        executor = PipelineExecutor(
            plan, certificate, stages=stages, segments=encoders,
            loss_fn=loss_fn, ignore_index=IGNORE, timeout=args.timeout,
            optimizer=lambda ps: torch.optim.Adam(ps, lr=args.lr), **groups)
        if rank == 0:
            print(f"{args.schedule}: {world} ranks ({pp} pipeline x {args.dp} data-parallel), "
                  f"{described}, {plan.num_ops} ops; "
                  f"plan verified ({certificate.digest[:12]})", flush=True)
        for step in range(args.steps):
            loss = executor.step(batch_at(step), max_grad_norm=args.clip)
            if rank == 0:
                print(f"step {step} loss {loss:.4f}", flush=True)
            if step == 0 and want is not None and not check_grads(executor, encoders, full, want):
                return 1
        executor.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except CertificateError as err:
        print(f"rank {rank}: refused: {err}", file=sys.stderr, flush=True)
        return 2
    except PipelineError as err:
        print(f"rank {rank}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
