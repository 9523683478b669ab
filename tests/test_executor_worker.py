"""One rank of the executor tests (run as a script by ``test_executor.py``; it holds no
tests itself).

    python tests/test_executor_worker.py OUT CASES.json [--final NAME]

Env init (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). For each case
``{"name", "schedule", "mode", "m", "group", "strict", "bare", "dropout", "audio", "sink",
"eval", "mixed", "offload", "lend", "sgd", "term", "unequal"}`` it builds the tiny MLLM's plan (as the example does; ``audio``: the audio
encoder cut too, in that mode; ``sink``: a class-prediction head cut as a sink, in that
mode; ``eval``: the forward-only plan of the term; ``mixed``: the vision encoder with a
float64 parameter beside its float32 ones; ``offload``: ``[gap, prefetch]`` of the
``offload`` modifier; ``lend``: each stage-0 activation of the microbatches listed lent
to stage 1's rank, ``lend_plan``; ``sgd``: the step takes an SGD step, lr ``SGD_LR``, and
the parameters after it are saved too, with the host peak and the moves' census;
``term``: that term's expression, the encoder inline on its first stage; a schedule of
several pipelines keeps the encoder inside model stage 0; ``unequal``: without the
replicas' start-up broadcast, rank 1's weights perturbed, saving the refusal), verifies
it, runs one step without optimizer (``eval``: ``executor.eval``) and saves the loss and
per-microbatch losses
(``eval``: the last stage's outputs too), every local gradient (named like the
single-process model: ``vision.*``, ``audio.*``, ``gen.*``, ``body.*``), the executor's
measured peak of stored activations next to the verifier's reported peak, and (``dropout``: the encoder followed by dropout, every rank seeded
``1000 + rank``) each encoder call's microbatch and mask to ``OUT/NAME.rank.pt``. ``--final`` ends with a failure scenario:

- ``send-mismatch`` (2 ranks): first rank 0 sends a message for a smaller tensor than the
  plan's payload and rank 1 must raise ``PayloadMismatchError`` (``OUT/recv-mismatch.txt``);
  then stage 0 returns a wrong shape: rank 0 must refuse to send it
  (``OUT/send-mismatch.txt``) and stay alive and silent until rank 1, waiting for that
  message, has timed out (2 s) and exited 1; rank 0 then exits 3;
- ``kill`` (4 ranks): rank 1 SIGKILLs itself inside a forward (writing ``OUT/killed_at``).
A failure is printed as one line on stderr (and written to ``OUT/failed.RANK``) and the
rank exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import attrs  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_tiny_mllm as tiny  # noqa: E402
from mpipe_verified.algebra import ForwardOnly, Transpose  # noqa: E402
from mpipe_verified.executor import (Batch, PayloadMismatchError, PipelineError,  # noqa: E402
                                     PipelineExecutor, group_adjacent_comms,
                                     infer_payload_shapes, split_sequential,
                                     with_payload_shapes)
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.spec import parse_expression  # noqa: E402
from mpipe_verified.executor import batch_fit  # noqa: E402
from mpipe_verified.executor.comm import Messages, init_distributed  # noqa: E402
from mpipe_verified.algebra.terms import Offloaded  # noqa: E402
from mpipe_verified.ir import ACT, GRAD, LEND, RETURN, Group, Payload, Recv, Send  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402


SGD_LR = 0.1


def rows_for(m: int) -> int:
    return 2 * m


def lend_plan(plan, mbs):
    """``plan`` with stage 0's activation of each microbatch in ``mbs`` lent (BPipe,
    docs/semantics.md §2.10) by its rank to stage 1's rank: the lend right after the
    activation's send (received right after it), the return right before the gradient
    that comes back (sent right before it)."""
    owner, holder = plan.placement.rank_of(0), plan.placement.rank_of(1)
    programs = [list(p) for p in plan.programs]

    def at(rank, way, kind, stage, mb):
        return next(i for i, op in enumerate(programs[rank]) if type(op) is way
                    and (op.payload.kind, op.payload.stage, op.payload.mb) == (kind, stage, mb))

    for mb in mbs:
        lend, back = Payload(LEND, 0, mb), Payload(RETURN, 0, mb)
        programs[owner].insert(at(owner, Send, ACT, 0, mb) + 1, Send(holder, lend))
        programs[owner].insert(at(owner, Recv, GRAD, 1, mb), Recv(holder, back))
        programs[holder].insert(at(holder, Recv, ACT, 0, mb) + 1, Recv(owner, lend))
        programs[holder].insert(at(holder, Send, GRAD, 1, mb), Send(owner, back))
    return attrs.evolve(plan, programs=tuple(map(tuple, programs)))


class ClassHead(torch.nn.Module):
    """A sink segment: predicts each caption's image class from the body's last output
    (the mean of its logits over positions)."""

    def __init__(self, vocab: int = 64, classes: int = 8) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc = torch.nn.Linear(vocab, classes)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return self.fc(logits.mean(1))


def sink_loss(logits: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, classes)


class MixedDtypes(torch.nn.Module):
    """The vision encoder scaled by a float64 gain: a segment whose parameters have two
    dtypes (its gradient all-reduce must give each gradient back in its own dtype)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 32, dtype=torch.float64))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.inner(images) * self.gain.float()


def case_term(case: dict, world: int):
    if case.get("term"):  # any stage map: the encoder inline on its first stage
        return Transpose(parse_expression(case["term"]), segment="vision",
                         ownership="inline", mode="recompute")
    term = tiny.build_term(case["schedule"], world, case["m"], case.get("mode", "recompute"),
                           audio_mode=case.get("audio"))
    if case.get("sink"):
        term = Transpose(term, "gen", side="sink", mode=case["sink"], ownership="full")
    if case.get("offload"):
        term = Offloaded(term, *case["offload"])
    return ForwardOnly(term) if case.get("eval") else term


def case_model(case: dict, num_stages: int):
    """``(segments, body)``: the encoders (and sink) by name, and the whole body."""
    encoder, body = tiny.build_model(max(6, num_stages - 2))
    segments = {"vision": MixedDtypes(encoder) if case.get("mixed") else encoder}
    if case.get("audio"):
        segments["audio"] = tiny.build_audio()
    if case.get("sink"):
        segments["gen"] = ClassHead()
    for name, how in (("vision", case.get("mode")), ("audio", case.get("audio")),
                      ("gen", case.get("sink"))):
        if how == "frozen":
            segments[name].requires_grad_(False)
    return segments, body


def case_batch(case: dict) -> Batch:
    batch = tiny.make_batch(0, rows_for(case["m"]), audio=bool(case.get("audio")))
    if case.get("schedule") in tiny.PIPELINED:  # the encoder inside model stage 0
        return tiny.inline(batch, ["vision"])
    if not case.get("sink"):
        return batch
    classes = torch.arange(rows_for(case["m"])) % 8
    return Batch(batch.body, batch.target, {**batch.segments, "gen": classes})


def build(case: dict, world: int):
    if case.get("audio") or case.get("sink") or case.get("eval") or case.get("mixed") \
            or case.get("offload") or case.get("lend") or case.get("term"):
        plan = lower(case_term(case, world).derive())
        if case.get("lend"):
            plan = lend_plan(plan, case["lend"])
        segments, full = case_model(case, plan.placement.num_stages)
        stages = split_sequential(full, plan.placement.num_stages)
        sources = {k: v for k, v in segments.items() if k != "gen"}
        plan = with_payload_shapes(plan, infer_payload_shapes(stages, case_batch(case),
                                                              case["m"], sources))
        encoder = segments
    else:
        plan, encoder, stages, full = tiny.prepare(case["schedule"], world, case["m"],
                                                   rows_for(case["m"]),
                                                   case.get("mode", "recompute"))
    if case.get("group"):
        plan = group_adjacent_comms(plan)
        assert any(isinstance(op, Group) for prog in plan.programs for op in prog)
    report = verify(plan)
    if not report.verified:
        raise SystemExit(f"case {case['name']}: plan {report.status}: "
                         f"{[v.message for v in report.violations][:3]}")
    return plan, report, encoder, stages, full


def names(encoder, full) -> dict[int, str]:
    segments = encoder if isinstance(encoder, dict) else {"vision": encoder}
    out = {id(p): f"{name}.{n}" for name, module in segments.items()
           for n, p in module.named_parameters()}
    out.update({id(p): f"body.{n}" for n, p in full.named_parameters()})
    return out


class DropoutProbe(torch.nn.Module):
    """The encoder followed by a real ``nn.Dropout``; logs, per call, the microbatch (found
    by its input), whether a graph was built, and the dropout mask."""

    def __init__(self, inner, microbatches):
        super().__init__()
        self.inner, self.drop, self.mbs, self.calls = inner, torch.nn.Dropout(0.5), microbatches, []

    def forward(self, images):
        y = self.drop(self.inner(images))
        if batch_fit.checking():  # the executor's check of a new batch shape, not a step's
            return y
        mb = next(i for i, x in enumerate(self.mbs) if torch.equal(x, images))
        self.calls.append((mb, torch.is_grad_enabled(), (y != 0).clone()))
        return y


def run_case(case: dict, rank: int, world: int, out_dir: str) -> None:
    plan, report, encoder, stages, full = build(case, world)
    batch = case_batch(case)
    segments = encoder if isinstance(encoder, dict) else {"vision": encoder}
    segment = None
    if case.get("dropout"):  # every rank seeded alike in every mode; ranks differ
        segment = DropoutProbe(encoder, [mb.segments["vision"] for mb in batch.split(case["m"])])
        segments = {"vision": segment}
        torch.manual_seed(1000 + rank)
    ex = PipelineExecutor(plan, report.certificate, stages=stages, segments=segments,
                          loss_fn=tiny.loss_fn, overlap_comms=not case.get("strict"),
                          check_messages=not case.get("bare"),
                          segment_loss_fns={"gen": sink_loss} if case.get("sink") else None,
                          optimizer=(lambda ps: torch.optim.SGD(ps, lr=SGD_LR))
                          if case.get("sgd") else None)
    if case.get("unequal"):  # replicas that do not start equal: the handshake must refuse
        unequal_replicas(ex, case, rank, out_dir)
        return
    deferred = []  # receives still in flight when first read (the deferred form ran)
    if case.get("defer"):  # the CUDA default on this CPU: receives waited for at first read
        ex._defer_receives = True
        resolve = ex._resolve
        ex._resolve = lambda pending: deferred.append(pending.buf is not None) or resolve(
            pending)
    outputs, sink_outputs = None, {}
    if case.get("eval"):
        result = ex.eval(batch)
        if result is not None:
            outputs = None if result.outputs is None else torch.cat(result.outputs)
            sink_outputs = dict(result.segment_outputs.get("gen", {}))
        loss, losses = (None, None) if result is None else (result.loss, result.losses)
    else:
        loss, losses = ex.step(batch, return_losses=True)
        if case.get("twice"):  # again, without zero_grad: the gradients accumulate
            loss, losses = ex.run(batch, return_losses=True)
    table = names(encoder, full)
    grads, params = {}, {}
    for module in (*ex.stages.values(), *ex.segments.values()):
        for p in module.parameters():
            if p.grad is not None:
                grads[table[id(p)]] = p.grad.detach().clone()
            if case.get("sgd"):
                params[table[id(p)]] = p.detach().clone()
    torch.save({"loss": loss, "losses": losses, "outputs": outputs, "sink_outputs": sink_outputs,
                "homes": {seg.name: seg.home for seg in plan.cut.segments},
                "grads": grads,
                "home": plan.cut.segments[0].home if plan.cut.segments else None,
                "stored_peak": ex.stored_peak, "verified_peak": report.peak_memory[rank],
                "calls": getattr(segment, "calls", []), "deferred": sum(deferred),
                "params": params, "host_peak": ex.host_peak, "moves": ex.moves_log,
                "verified_host_peak": report.stats.get("host_peak_memory", {}).get(str(rank), 0)},
               os.path.join(out_dir, f"{case['name']}.{rank}.pt"))


def unequal_replicas(ex, case: dict, rank: int, out_dir: str) -> None:
    """Rank 1's stage weights perturbed and the start-up broadcast skipped: every rank
    must refuse at start-up (``OUT/NAME.RANK.txt``: its message)."""
    ex._broadcast_replicas = False
    if rank == 1:
        with torch.no_grad():
            for module in ex.stages.values():
                for p in module.parameters():
                    p.add_(0.5)
    try:
        ex.step(case_batch(case))
        message = "no error"
    except PipelineError as err:
        message = str(err)
    with open(os.path.join(out_dir, f"{case['name']}.{rank}.txt"), "w") as f:
        f.write(message)


def recv_mismatch(rank: int, out_dir: str) -> None:
    """Rank 0 sends a (4, 7) float32 act where the plan says (4, 8): rank 1's trailer check
    must name both."""
    expected = Payload("act", 1, 2, shape=(4, 8), dtype="float32")
    sent = Payload("act", 1, 2, shape=(4, 7), dtype="float32")
    messages = Messages(rank, torch.device("cpu"))
    if rank == 0:
        dist.isend(messages.outgoing(torch.ones(4, 7), sent), 1).wait()
    elif rank == 1:
        buf = messages.incoming(expected)
        dist.irecv(buf, 0).wait()
        try:
            messages.decode(buf, expected, 0, "1RECV_F2 at position 7")
            message = "no error"
        except PayloadMismatchError as err:
            message = str(err)
        with open(os.path.join(out_dir, "recv-mismatch.txt"), "w") as f:
            f.write(message)
    dist.barrier()


class WrongShape(torch.nn.Module):
    """A stage whose output grows a feature in the step itself, not in the executor's
    check of a new batch shape (so the refusal happens at the send, mid-step, as for a
    stage whose shape the batch alone does not determine)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        y = self.inner(*args)
        return y if batch_fit.checking() else torch.cat([y, y[..., :1]], dim=-1)


class Suicide(torch.nn.Module):
    def __init__(self, inner, out_dir):
        super().__init__()
        self.inner, self.out_dir, self.calls = inner, out_dir, 0

    def forward(self, *args):
        self.calls += 1
        if self.calls == 2:
            with open(os.path.join(self.out_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(*args)


def final(name: str, rank: int, world: int, out_dir: str) -> None:
    if name == "kill":
        case = {"name": "kill", "schedule": "1f1b", "m": 2 * world}
        plan, report, encoder, stages, _ = build(case, world)
        cert = report.certificate
        if rank == 1:
            stages[1] = Suicide(stages[1], out_dir)
        ex = PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                              loss_fn=tiny.loss_fn)
        ex.step(tiny.make_batch(0, rows_for(case["m"])))
        raise SystemExit(f"rank {rank}: the kill scenario did not fail")
    recv_mismatch(rank, out_dir)
    # Stage 0 returns a wrong shape: rank 0 refuses to send it and stays alive but
    # silent; rank 1, waiting for that message, must time out (2 s here) on its own.
    case = {"name": "send-mismatch", "schedule": "1f1b", "m": 2 * world}
    plan, report, encoder, stages, _ = build(case, world)
    cert = report.certificate
    stages[0] = WrongShape(stages[0])
    ex = PipelineExecutor(plan, cert, stages=stages, segments={"vision": encoder},
                          loss_fn=tiny.loss_fn, timeout=2)
    try:
        ex.step(tiny.make_batch(0, rows_for(case["m"])))
    except PayloadMismatchError as err:
        if rank != 0:
            raise
        with open(os.path.join(out_dir, "send-mismatch.txt"), "w") as f:
            f.write(str(err))
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(out_dir, "failed.1")) and time.time() < deadline:
            time.sleep(0.05)
        os._exit(3)
    raise SystemExit(f"rank {rank}: the send-mismatch scenario did not fail")


def main(run_one=run_case, last=final) -> None:
    """Every case with ``run_one(case, rank, world, out)``, then ``last(name, rank, world,
    out)`` for ``--final NAME`` (other workers pass their own: test_executor_seq_worker)."""
    out_dir, cases_file = sys.argv[1], sys.argv[2]
    final_name = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--final" else None
    torch.set_num_threads(1)
    rank, world, _ = init_distributed()
    with open(cases_file) as f:
        cases = json.load(f)
    try:
        for case in cases:
            run_one(case, rank, world, out_dir)
        with open(os.path.join(out_dir, f"done.{rank}"), "w") as f:
            f.write("ok")
        if final_name:
            last(final_name, rank, world, out_dir)
    except PipelineError as err:
        sys.stderr.write(f"rank {rank}: {type(err).__name__}: {err}\n")
        sys.stderr.flush()
        with open(os.path.join(out_dir, f"failed.{rank}"), "w") as f:
            f.write(str(err))
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
