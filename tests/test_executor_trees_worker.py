"""One rank of ``test_executor_trees.py`` (run as a script; it holds no tests), and the
models both use.

    python tests/test_executor_trees_worker.py OUT

Env init (2 ranks). Cases, each saved to ``OUT/NAME.RANK.pt``:

- ``trees-interleaved``, ``trees-zbv``, ``trees-bare``: a 4-stage model whose stages
  pass dicts, tuples and lists holding float, int64, bool and None leaves, with keyword
  inputs for the first stage (``Batch.kwargs``), one step (``trees-bare``: bare messages,
  waiting after every comm op); the loss and every local gradient;
- ``int-act``: a 2-stage 1f1b plan whose activation is one int64 tensor;
- ``fused``: transpose in owner mode, a vision encoder whose output (patch tokens and a
  bool mask) crosses the cut into the body;
- ``llava``: ``ShapeCache`` over a LLaVA-style model (image tokens concatenated with
  text tokens), three SGD steps with 1, 3 and 2 images per sample and text of 5, 3 and
  4 tokens; per step the loss and gradients, then the parameters and the number of
  plans certified;
- ``leaf-mismatch``: rank 0 sends a structured message whose leaf ``["pos"]`` is int32
  where rank 1's plan says int64; rank 1 saves the error text.
A failure is printed as one line on stderr and the rank exits 1.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mpipe_verified.algebra import family  # noqa: E402
from mpipe_verified.executor import (Batch, PipelineExecutor, ShapeCache, certify,  # noqa: E402
                                     infer_payload_shapes, with_payload_shapes)
from mpipe_verified.lower import lower  # noqa: E402

D, V, T = 8, 13, 5


class Embed(nn.Module):
    """Stage 0: tokens, keyword positions (int64) and mask (bool) → a dict."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)

    def forward(self, tokens, *, positions, mask):
        h = self.tok(tokens) + self.pos(positions)
        return {"h": h, "pos": positions, "mask": mask, "none": None}


class Mix(nn.Module):
    """Stage 1: dict → (h, [pos, mask as float: no gradient], aux)."""

    def __init__(self):
        super().__init__()
        self.lin, self.aux = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, d):
        h = torch.tanh(self.lin(d["h"])) * d["mask"].unsqueeze(-1)
        return (h, [d["pos"], d["mask"].float()], self.aux(d["h"]))


class Mix2(nn.Module):
    """Stage 2: tuple → (h, aux passed through untouched, pos)."""

    def __init__(self):
        super().__init__()
        self.lin, self.pos = nn.Linear(D, D), nn.Embedding(T, D)

    def forward(self, t):
        h, (pos, maskf), aux = t
        return (torch.tanh(self.lin(h) + self.pos(pos)) * maskf.unsqueeze(-1), aux, pos)


class Head(nn.Module):
    """Stage 3: tuple → a dict; the loss reads it."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(D, V)

    def forward(self, t):
        h, aux, pos = t
        return {"logits": self.out(h) + aux, "pos": pos}


def trees_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Embed(), Mix(), Mix2(), Head())


def dict_loss(out, target):
    return nn.functional.cross_entropy(out["logits"].reshape(-1, V), target.reshape(-1))


def trees_batch(rows: int, seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (rows, T), generator=g)
    positions = torch.arange(T).expand(rows, T).contiguous()
    mask = torch.rand(rows, T, generator=g) > 0.2
    return Batch(body=tokens, target=torch.randint(0, V, (rows, T), generator=g),
                 kwargs={"positions": positions, "mask": mask})


class Cumsum(nn.Module):
    """A parameter-free stage whose output is one int64 tensor."""

    def forward(self, tokens):
        return torch.cumsum(tokens, dim=1) % V


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


class Patches(nn.Module):
    """A vision encoder whose output is a tuple: patch tokens and their bool mask."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(P, D)

    def forward(self, images):
        return (torch.tanh(self.lin(images)), images.sum(-1) > 0)


class Fuse(nn.Module):
    """Body stage 0: the encoder's tuple (masked patches) before the text tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)

    def forward(self, patches, tokens):
        img, mask = patches
        return torch.cat([img * mask.unsqueeze(-1), self.embed(tokens)], dim=1)


def fused_model(seed: int = 0):
    torch.manual_seed(seed)
    return Patches(), nn.Sequential(Fuse(), Decoder())


def fused_batch(rows: int = 8) -> Batch:
    g = torch.Generator().manual_seed(7)
    return Batch(body=torch.randint(0, V, (rows, T), generator=g),
                 target=torch.randint(0, V, (rows, T), generator=g),
                 segments={"vision": torch.randn(rows, 3, P, generator=g)})


def int_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Cumsum(), Lookup())


def tensor_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


# LLaVA-style: K image tokens per image, concatenated before the text tokens.
P, K = 6, 2


class VisionText(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision, self.embed = nn.Linear(P, K * D), nn.Embedding(V, D)

    def forward(self, images, tokens):
        rows = images.shape[0]
        img = self.vision(images).reshape(rows, -1, D)  # (rows, images * K, D)
        return torch.cat([img, self.embed(tokens)], dim=1)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix, self.out = nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, x):
        ctx = x.cumsum(dim=1) / torch.arange(1, x.shape[1] + 1).unsqueeze(-1)
        return self.out(torch.tanh(self.mix(ctx)))


def llava_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(VisionText(), Decoder())


def text_loss(logits, target):
    """Cross-entropy over the text positions (the last ``target.shape[1]``)."""
    text = logits[:, -target.shape[1]:]
    return nn.functional.cross_entropy(text.reshape(-1, V), target.reshape(-1))


LLAVA_STEPS = ((1, 5), (3, 3), (2, 4))  # (images per sample, text tokens) per step
LLAVA_ROWS, LLAVA_LR = 4, 0.1


def llava_batch(step: int) -> Batch:
    images, text = LLAVA_STEPS[step]
    g = torch.Generator().manual_seed(100 + step)
    return Batch(body=(torch.randn(LLAVA_ROWS, images, P, generator=g),
                       torch.randint(0, V, (LLAVA_ROWS, text), generator=g)),
                 target=torch.randint(0, V, (LLAVA_ROWS, text), generator=g))


TREE_CASES = {"trees-interleaved": ("interleaved-1f1b", 2, {}), "trees-zbv": ("zbv", None, {}),
              # bare messages (no leaf table, no trailer), waiting after every comm op
              "trees-bare": ("interleaved-1f1b", 2, {"check_messages": False,
                                                     "overlap_comms": False})}


def tree_plan(schedule: str, chunks, m: int, model, batch):
    term = family(schedule, 2, m, chunks) if chunks else family(schedule, 2, m)
    plan = lower(term.derive())
    return with_payload_shapes(plan, infer_payload_shapes(list(model), batch, m))


def local_grads(ex) -> dict:
    return {f"{s}.{n}": p.grad.detach().clone() for s, module in ex.stages.items()
            for n, p in module.named_parameters() if p.grad is not None}


def run_trees(name: str, rank: int, out: str) -> None:
    schedule, chunks, options = TREE_CASES[name]
    model, batch = trees_model(), trees_batch(8)
    plan = tree_plan(schedule, chunks, 4, model, batch)
    ex = PipelineExecutor(plan, certify(plan), stages=list(model), loss_fn=dict_loss, **options)
    loss = ex.step(batch)
    torch.save({"loss": loss, "grads": local_grads(ex)}, os.path.join(out, f"{name}.{rank}.pt"))


def run_fused(rank: int, out: str) -> None:
    """Transpose (owner mode): the encoder's tuple output crosses the cut."""
    from mpipe_verified.algebra import Transpose
    encoder, body = fused_model()
    batch = fused_batch()
    term = Transpose(family("1f1b", 2, 4), segment="vision", mode="owner", ownership="full")
    plan = with_payload_shapes(lower(term.derive()), infer_payload_shapes(
        list(body), batch, 4, {"vision": encoder}))
    ex = PipelineExecutor(plan, certify(plan), stages=list(body), segments={"vision": encoder},
                          loss_fn=text_loss)
    loss = ex.step(batch)
    grads = local_grads(ex)
    if rank == plan.cut.segments[0].home:
        grads.update({f"vision.{n}": p.grad.detach().clone()
                      for n, p in encoder.named_parameters()})
    torch.save({"loss": loss, "grads": grads}, os.path.join(out, f"fused.{rank}.pt"))


def run_int(rank: int, out: str) -> None:
    model = int_model()
    g = torch.Generator().manual_seed(3)
    batch = Batch(torch.randint(0, V, (8, T), generator=g), torch.randint(0, V, (8, T), generator=g))
    plan = with_payload_shapes(lower(family("1f1b", 2, 4).derive()),
                               infer_payload_shapes(list(model), batch, 4))
    ex = PipelineExecutor(plan, certify(plan), stages=list(model), loss_fn=tensor_loss)
    loss = ex.step(batch)
    torch.save({"loss": loss, "grads": local_grads(ex)}, os.path.join(out, f"int-act.{rank}.pt"))


def run_llava(rank: int, out: str) -> None:
    model = llava_model()
    cache = ShapeCache(lower(family("zb-h1", 2, 2).derive()), stages=list(model),
                       loss_fn=text_loss,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=LLAVA_LR))
    steps = []
    for step in range(len(LLAVA_STEPS)):
        ex = cache.executor(llava_batch(step))
        loss = cache.step(llava_batch(step))
        steps.append({"loss": loss, "grads": local_grads(ex)})
    params = {f"{s}.{n}": p.detach().clone() for s, module in ex.stages.items()
              for n, p in module.named_parameters()}
    torch.save({"steps": steps, "params": params, "certified": cache.certified,
                "optimizers": len({id(e.optimizer) for e in cache._executors.values()})},
               os.path.join(out, f"llava.{rank}.pt"))


def leaf_mismatch(rank: int, out: str) -> None:
    import torch.distributed as dist

    from mpipe_verified.executor.errors import PayloadMismatchError
    from mpipe_verified.executor.packed import Messages
    from mpipe_verified.ir import Leaf, Payload

    def payload(pos_dtype):
        return Payload("act", 0, 1, leaves=(Leaf('["h"]', (2, 3), "float32"),
                                            Leaf('["pos"]', (2,), pos_dtype),
                                            Leaf('["none"]')))

    messages = Messages(rank, torch.device("cpu"))
    if rank == 0:
        value = {"h": torch.ones(2, 3), "pos": torch.arange(2, dtype=torch.int32), "none": None}
        dist.isend(messages.outgoing(value, payload("int32")), 1).wait()
    else:
        buf = messages.incoming(payload("int64"))
        dist.irecv(buf, 0).wait()
        try:
            messages.decode(buf, payload("int64"), 0, "1RECV_F1 at position 4")
            text = "no error"
        except PayloadMismatchError as err:
            text = f"PayloadMismatchError: {err}"
        with open(os.path.join(out, "leaf-mismatch.txt"), "w") as f:
            f.write(text)
    dist.barrier()


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    from mpipe_verified.executor import PipelineError
    from mpipe_verified.executor.comm import init_distributed
    rank, _, _ = init_distributed()
    try:
        for name in TREE_CASES:
            run_trees(name, rank, out)
        run_int(rank, out)
        run_fused(rank, out)
        run_llava(rank, out)
        leaf_mismatch(rank, out)
    except PipelineError as err:
        sys.stderr.write(f"rank {rank}: {type(err).__name__}: {err}\n")
        sys.stderr.flush()
        os._exit(1)
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
