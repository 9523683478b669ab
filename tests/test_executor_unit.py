"""Executor pieces that need no process group: partitioning, payload shapes, refusal of
uncertified plans (before any torch.distributed call), message checks, the watchdog and
the ``mpipe-run`` launcher (with plain-Python scripts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import attrs
import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from mpipe_verified.algebra import FAMILIES, ForwardOnly, Transpose, family  # noqa: E402
from mpipe_verified.executor import (Batch, CertificateError, PayloadMismatchError,  # noqa: E402
                                     PipelineError, PipelineExecutor, balanced_cuts, certify,
                                     infer_payload_shapes, split_sequential,
                                     with_payload_shapes)
from mpipe_verified.executor.comm import (Messages, ShippedInput, check_outgoing,  # noqa: E402
                                          rng_state, set_rng_state)
from mpipe_verified.executor import split_backward  # noqa: E402
from mpipe_verified.executor import NotVerifiedError  # noqa: E402
from mpipe_verified.executor.steps import compile_steps  # noqa: E402
from mpipe_verified.ir import Payload, Recv, Send, p2p_of  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.semantics import Chain  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MPIPE_RUN = os.path.join(os.path.dirname(sys.executable), "mpipe-run")


# ---------------------------------------------------------------- partitioning


def test_balanced_cuts_minimise_the_largest_stage():
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_cuts([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5]
    assert balanced_cuts([5], 1) == [0]
    with pytest.raises(ValueError):
        balanced_cuts([1, 2], 3)


def test_split_sequential_keeps_layers_order_and_names():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4),
                        nn.Linear(4, 4))
    stages = split_sequential(seq, 3)  # parameters 20, 80, 0, 68, 20: best max is 88
    assert [list(s._modules) for s in stages][:2] == [["0"], ["1"]]
    assert max(sum(p.numel() for p in s.parameters()) for s in stages) == 88
    assert [m for s in stages for m in s] == list(seq)
    with pytest.raises(ValueError, match="cannot cut 5 layers into 6"):
        split_sequential(seq, 6)
    x = torch.randn(2, 4)
    y = x
    for s in stages:
        y = s(y)
    torch.testing.assert_close(y, seq(x))


def tiny_stages(num_stages: int, dim: int = 4):
    torch.manual_seed(0)
    encoder = nn.Linear(3, dim)

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, dim)

        def forward(self, image, tokens):
            return self.emb(tokens) + image[:, None, :]

    layers = [First()] + [nn.Linear(dim, dim) for _ in range(num_stages - 1)]
    return encoder, split_sequential(nn.Sequential(*layers), num_stages)


def tiny_batch(rows: int = 4):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 10, (rows, 5), generator=g)
    return Batch(body=tokens, target=torch.randn(rows, 5, 4, generator=g),
                 segments={"vision": torch.randn(rows, 3, generator=g)})


def shaped_plan(name="1f1b", pp=2, m=2, mode="recompute", ownership="inline"):
    plan = lower(Transpose(family(name, pp, m), mode=mode, ownership=ownership).derive())
    encoder, stages = tiny_stages(plan.placement.num_stages)
    fn = infer_payload_shapes(stages, tiny_batch(), m, {"vision": encoder})
    return with_payload_shapes(plan, fn), plan, encoder, stages


def test_payload_shapes_annotate_both_ends_and_still_verify():
    plan, bare, _, _ = shaped_plan("1f1b", 2, 2, mode="recompute", ownership="full")
    payloads = [c.payload for prog in plan.programs for c in prog if isinstance(c, (Send, Recv))]
    assert payloads and all(p.shape is not None and p.dtype for p in payloads)
    kinds = {p.kind: (p.shape, p.dtype) for p in payloads}
    assert kinds["act"] == ((2, 5, 4), "float32") or kinds["act"] == ((2, 4), "float32")
    assert kinds["input"] == ((2, 3), "float32")  # the encoder's raw input, for recompute
    report = verify(plan)
    assert report.verified
    assert report.certificate.digest != verify(bare).certificate.digest


def test_meta_shape_inference_agrees_with_real_tensors():
    bare = lower(Transpose(family("1f1b", 2, 3), ownership="full").derive())
    encoder, stages = tiny_stages(2)
    real = infer_payload_shapes(stages, tiny_batch(5), 3, {"vision": encoder})
    meta = infer_payload_shapes(stages, tiny_batch(5), 3, {"vision": encoder}, meta=True)
    assert with_payload_shapes(bare, real) == with_payload_shapes(bare, meta)


# ---------------------------------------------------------------- refusal


@pytest.fixture
def no_traffic(monkeypatch):
    """Every torch.distributed entry point the executor could use records its call."""
    calls = []
    for name in ("init_process_group", "isend", "irecv", "send", "recv", "batch_isend_irecv",
                 "broadcast", "all_reduce", "all_gather", "barrier", "new_group"):
        def record(*args, _name=name, **kwargs):
            calls.append(_name)
            raise AssertionError(f"torch.distributed.{_name} called")
        monkeypatch.setattr(dist, name, record)
    return calls


def make(plan, certificate, encoder, stages, rank=0):
    return PipelineExecutor(plan, certificate, stages=stages, segments={"vision": encoder},
                            loss_fn=nn.functional.mse_loss, rank=rank)


def swap_first_two_ops(plan, rank=1):
    prog = list(plan.programs[rank])
    i = next(k for k in range(len(prog) - 1) if prog[k] != prog[k + 1])
    prog[i], prog[i + 1] = prog[i + 1], prog[i]
    programs = list(plan.programs)
    programs[rank] = tuple(prog)
    return attrs.evolve(plan, programs=tuple(programs))


def reshape_one_payload(plan):
    programs = [list(p) for p in plan.programs]
    for prog in programs:
        for i, op in enumerate(prog):
            if isinstance(op, Send):
                prog[i] = Send(op.dst, attrs.evolve(op.payload, shape=(1, 2, 3)))
                return attrs.evolve(plan, programs=tuple(map(tuple, programs)))
    raise AssertionError("no send")


def test_tampered_or_uncertified_plans_are_refused_before_any_communication(no_traffic):
    plan, _, encoder, stages = shaped_plan()
    cert = certify(plan)
    other = certify(shaped_plan("gpipe")[0])
    eager = verify(plan, comm_model="eager").certificate
    refusals = {
        "no certificate": (plan, None, "no certificate"),
        "reordered ops": (swap_first_two_ops(plan), cert, "altered"),
        "changed payload shape": (reshape_one_payload(plan), cert, "altered"),
        "another plan's certificate": (plan, other, "altered"),
        "eager-model certificate": (plan, eager, "eager"),
        "forged properties": (plan, attrs.evolve(cert, properties=("completeness",)),
                              "does not prove"),
    }
    for what, (p, c, words) in refusals.items():
        with pytest.raises(CertificateError, match=words):
            make(p, c, encoder, stages)
    assert no_traffic == [] and not dist.is_initialized()
    make(plan, cert, encoder, stages)  # the genuine pair is accepted (still no traffic)
    assert no_traffic == []


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return {"h": self.fc(x), "pos": torch.arange(x.shape[0])}


class _DictIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, d):
        return self.fc(d["h"]) + d["pos"][:, None]


def test_a_parametric_certificate_runs_only_the_plan_its_parameters_derive(no_traffic):
    """A certificate from the 1F1B laws (``check --family 1f1b`` at pp=2, m=2) names the
    laws and the parameters: the executor takes it for the plan those parameters derive
    (with the payload shapes it runs with) and refuses any other plan of the same size."""
    from mpipe_verified.check import parametric
    params = {"pp": 2, "microbatches": 2, "chunks": None}
    cert = parametric.prove("1f1b", params).certificate
    assert cert.parametric.laws == ("1f1b_completeness", "1f1b_dependency", "1f1b_matching",
                                    "1f1b_deadlock", "1f1b_peak_memory")
    torch.manual_seed(0)
    stages = split_sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2)
    fn = infer_payload_shapes(stages, Batch(body=torch.randn(4, 4), target=torch.randn(4, 4)),
                              2)

    def executor(name):
        plan = with_payload_shapes(lower(family(name, 2, 2).derive()), fn)
        return PipelineExecutor(plan, cert, stages=stages, loss_fn=nn.functional.mse_loss,
                                rank=0)
    executor("1f1b")  # accepted, still before any communication
    # stages passing a structure (a dict with an int64 leaf): payloads carry leaves
    dict_stages = [_DictOut(), _DictIn()]
    leaves = infer_payload_shapes(dict_stages, Batch(body=torch.randn(4, 4),
                                                     target=torch.randn(4, 4)), 2)
    structured = with_payload_shapes(lower(family("1f1b", 2, 2).derive()), leaves)
    assert any(c.payload.leaves for prog in structured.programs for op in prog
               for c in p2p_of(op))
    PipelineExecutor(structured, cert, stages=dict_stages, loss_fn=nn.functional.mse_loss,
                     rank=0)  # accepted: the layout is the executor's annotation
    for other in ("gpipe", "zb-h1"):
        with pytest.raises(CertificateError, match="not the one 1f1b derives"):
            executor(other)
    plan = with_payload_shapes(lower(family("1f1b", 2, 2).derive()), fn)
    with pytest.raises(CertificateError, match="not the one 1f1b derives"):
        PipelineExecutor(swap_first_two_ops(plan, rank=0), cert, stages=stages,
                         loss_fn=nn.functional.mse_loss, rank=0)
    assert no_traffic == []


def test_certify_refuses_a_plan_the_verifier_rejects():
    plan, _, _, _ = shaped_plan()
    broken = attrs.evolve(plan, programs=(plan.programs[0][:-1], plan.programs[1]))
    with pytest.raises(NotVerifiedError, match="violated"):
        certify(broken)


def test_plan_without_shapes_or_modules_is_a_clear_error():
    _, bare, encoder, stages = shaped_plan()
    with pytest.raises(PipelineError, match="with_payload_shapes"):
        make(bare, certify(bare), encoder, stages)
    plan, _, encoder, stages = shaped_plan()
    with pytest.raises(PipelineError, match=r"no module for stage\(s\) \[1\]"):
        make(plan, certify(plan), encoder, {0: stages[0]}, rank=1)
    with pytest.raises(PipelineError, match="segment"):
        PipelineExecutor(plan, certify(plan), stages=stages, loss_fn=nn.functional.mse_loss,
                         rank=0)


def test_eval_and_step_refuse_the_other_kind_of_plan_before_any_communication(no_traffic):
    train, _, encoder, stages = shaped_plan()
    bare = lower(ForwardOnly(Transpose(family("1f1b", 2, 2), mode="recompute",
                                       ownership="inline")).derive())
    evaluation = with_payload_shapes(bare, infer_payload_shapes(stages, tiny_batch(), 2,
                                                                {"vision": encoder}))
    with pytest.raises(PipelineError, match="eval needs a forward-only plan"):
        make(train, certify(train), encoder, stages).eval(tiny_batch())
    for call in ("step", "run"):
        with pytest.raises(PipelineError, match=r"forward-only .*call eval\(batch\)"):
            getattr(make(evaluation, certify(evaluation), encoder, stages), call)(tiny_batch())
    assert no_traffic == [] and not dist.is_initialized()


def test_a_requires_grad_changed_after_construction_is_refused_at_step(no_traffic):
    plan, _, encoder, stages = shaped_plan()
    cert = certify(plan)
    frozen = stages[0][0].emb.weight
    frozen.requires_grad_(False)  # frozen when built, trained later: would get no gradient
    executor = make(plan, cert, encoder, stages)
    assert all(p is not frozen for p in executor.parameters())
    frozen.requires_grad_(True)
    with pytest.raises(PipelineError, match=r"rank 0: parameter '0\.emb\.weight' of stage 0 "
                       r"has requires_grad=True but had False when the executor was built"):
        executor.step(tiny_batch())
    frozen.requires_grad_(True)
    executor = make(plan, cert, encoder, stages)
    encoder.bias.requires_grad_(False)  # and the other way
    with pytest.raises(PipelineError, match=r"parameter 'bias' of segment 'vision' has "
                       r"requires_grad=False but had True"):
        executor.run(tiny_batch())
    assert no_traffic == [] and not dist.is_initialized()


@pytest.mark.parametrize("edit", ["replaced", "added"])
def test_a_parameter_replaced_or_added_after_construction_is_refused(no_traffic, edit):
    plan, _, encoder, stages = shaped_plan()
    executor = make(plan, certify(plan), encoder, stages)
    first = stages[0][0]
    if edit == "replaced":  # frozen in place of the trained one
        first.emb.weight = nn.Parameter(first.emb.weight.detach().clone(), requires_grad=False)
    else:  # an adapter the optimizer never saw
        first.adapter = nn.Linear(4, 4)
    with pytest.raises(PipelineError, match=r"rank 0: the trainable parameters of stage 0 "
                       r"were added, removed or replaced since the executor was built"):
        executor.step(tiny_batch())
    assert no_traffic == [] and not dist.is_initialized()


def test_a_sink_needs_its_loss_and_only_sinks_take_one():
    term = Transpose(Transpose(family("1f1b", 2, 2), ownership="inline"), "gen", side="sink",
                     mode="owner", ownership="inline")
    plan = lower(term.derive())
    encoder, stages = tiny_stages(plan.placement.num_stages)
    plan = with_payload_shapes(plan, infer_payload_shapes(stages, tiny_batch(), 2,
                                                          {"vision": encoder}))
    segments = {"vision": encoder, "gen": nn.Linear(4, 2)}
    home = plan.cut.get("gen").home
    with pytest.raises(PipelineError, match=r"sink segment\(s\) gen here but no loss"):
        PipelineExecutor(plan, certify(plan), stages=stages, segments=segments,
                         loss_fn=nn.functional.mse_loss, rank=home)
    with pytest.raises(PipelineError, match="names vision, which the plan has no sink"):
        PipelineExecutor(plan, certify(plan), stages=stages, segments=segments, rank=home,
                         loss_fn=nn.functional.mse_loss, segment_loss_fns={"vision": len})


# ---------------------------------------------------------------- messages


def transport(sent: torch.Tensor, posted: torch.Tensor) -> torch.Tensor:
    """What gloo does with a message no larger than the posted buffer."""
    posted[: sent.numel()].copy_(sent)
    return posted


def test_message_round_trip_and_checks():
    rx, tx = Messages(1, torch.device("cpu")), Messages(0, torch.device("cpu"))
    want = Payload("act", 1, 2, shape=(3, 5), dtype="float32")
    x = torch.randn(3, 5)
    got = rx.decode(transport(tx.outgoing(x, want), rx.incoming(want)), want, 0, "op")
    assert torch.equal(got, x)
    cases = {
        "smaller": (torch.randn(3, 4), attrs.evolve(want, shape=(3, 4)), r"shape \(3, 4\) float32"),
        "dtype": (torch.ones(3, 5, dtype=torch.int32), attrs.evolve(want, dtype="int32"),
                  r"shape \(3, 5\) int32"),
        "microbatch": (x, attrs.evolve(want, mb=3), "act of stage 1 mb 3"),
        "kind": (x, attrs.evolve(want, kind="grad"), "grad of stage 1 mb 2"),
    }
    for what, (tensor, sent, words) in cases.items():
        buf = transport(tx.outgoing(tensor, sent), rx.incoming(want))
        with pytest.raises(PayloadMismatchError, match=words):
            rx.decode(buf, want, 0, "op")
    with pytest.raises(PayloadMismatchError, match="without a trailer"):
        rx.decode(transport(torch.ones(20, dtype=torch.uint8), rx.incoming(want)), want, 0, "op")


def test_shipped_input_carries_the_rng_state_that_replays_a_dropout_mask():
    cpu = torch.device("cpu")
    want = Payload("input", 0, 1, "vision", shape=(4, 6), dtype="float32")
    x = torch.randn(4, 6)
    torch.manual_seed(7)
    shipped = ShippedInput(x, rng_state(cpu))
    mask = torch.nn.functional.dropout(torch.ones(64), 0.5) != 0
    for check in (True, False):  # with and without the trailer
        rx, tx = Messages(1, cpu, check), Messages(0, cpu, check)
        got = rx.decode(transport(tx.outgoing(shipped, want), rx.incoming(want)), want, 0, "op")
        assert torch.equal(got.tensor, x)
        torch.manual_seed(8)  # another state: the shipped one must win
        set_rng_state(got.rng, cpu)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5) != 0, mask)
    sent_act = attrs.evolve(want, kind="act")
    buf = transport(Messages(0, cpu).outgoing(x, sent_act), Messages(1, cpu).incoming(want))
    with pytest.raises(PayloadMismatchError, match="act of stage 0 mb 1"):
        Messages(1, cpu).decode(buf, want, 0, "op")


def _graph_nodes(root):
    seen, stack = {root}, [root]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


class _Scale(nn.Module):
    """A parameter outside any Linear or norm: its weight gradient goes through autograd."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x * self.scale


def _split_case(case: str) -> tuple[nn.Module, tuple]:
    """A stage and its input shape: every parameter node direct (Linear with and without
    bias, on 2-d and 3-d inputs, layer norm), or one of them not."""
    torch.manual_seed(0)
    body = [nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8, bias=False)]
    if case == "shared weight":  # one Linear used twice along the path
        shared = nn.Linear(8, 8)
        body += [shared, nn.Tanh(), shared]
    elif case == "non-Linear parameter":
        body += [_Scale(8), nn.Linear(8, 8)]
    elif case == "frozen bias":
        frozen = nn.Linear(8, 8)
        frozen.bias.requires_grad_(False)
        body += [frozen]
    shape = (4, 8) if case == "direct 2-d" else (2, 3, 8)
    return nn.Sequential(*body), shape


@pytest.mark.parametrize("case", ("direct 2-d", "direct 3-d", "shared weight",
                                  "non-Linear parameter", "frozen bias"))
def test_split_backward_gives_the_plain_backward_gradients_bitwise(case):
    """I then W, twice into the same ``.grad``: bitwise the input gradient and every
    weight gradient of two plain backwards. I leaves the weights alone; W never runs the
    input path's own nodes again (the GELU). With a direct form for every parameter node,
    I frees the graph as it goes (its saved tensors are gone) and W runs no autograd node
    at all."""
    stage, shape = _split_case(case)
    params = tuple(p for p in stage.parameters() if p.requires_grad)
    inputs = [torch.randn(*shape) for _ in range(2)]
    grads = [torch.randn(*shape) for _ in range(2)]
    all_direct = case.startswith("direct") or case == "frozen bias"

    def run(split: bool):
        for p in params:
            p.grad = None
        grads_in, ran = [], []
        for x0, g in zip(inputs, grads):
            x = x0.clone().requires_grad_(True)
            y = stage(x)
            if not split:
                y.backward(g)
                grads_in.append(x.grad)
                continue
            before = [None if p.grad is None else p.grad.clone() for p in params]
            (grad_in,), work = split_backward.backward_input(y, g, (x,), params)
            assert all((a is None and p.grad is None) or torch.equal(a, p.grad)
                       for a, p in zip(before, params))
            nodes = _graph_nodes(y.grad_fn)
            gelu = next(n for n in nodes if "Gelu" in n.name())
            if all_direct:
                with pytest.raises(RuntimeError, match="freed"):
                    gelu._saved_self  # noqa: B018 (the access is the check)
            for node in nodes:
                node.register_prehook(lambda gs, name=node.name(): ran.append(name))
            split_backward.backward_weight(work)
            grads_in.append(grad_in)
        return grads_in, [p.grad for p in params], ran

    want_x, want, _ = run(False)
    got_x, got, ran = run(True)
    assert not any("Gelu" in name for name in ran)
    assert ran == [] if all_direct else ran != []
    assert all(torch.equal(a, b) for a, b in zip(got_x, want_x))
    assert all(torch.equal(a, b) for a, b in zip(got, want)), case


class _HookedOutputs(nn.Module):
    """Gradient hooks on a layer norm's and a Linear's outputs (scaling, clamping), as
    gradient-scaling and clipping code registers them."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.inner, self.outer = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        h.register_hook(lambda g: g.clamp(-0.05, 0.05))
        y = self.inner(h)
        y.register_hook(lambda g: g * 3)
        return self.outer(torch.tanh(y))


class _BroadcastBias(nn.Module):
    """One Linear whose bias of shape (1,) broadcasts: the stage output's own node is the
    parameter node, with no direct form."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.ones(1))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("allow_direct", (True, False))
@pytest.mark.parametrize("make", (_HookedOutputs, _BroadcastBias))
def test_split_backward_applies_output_hooks_once(make, allow_direct):
    """A hook on a parameter node's output changes the gradient that node's backward
    reads: I then W give bitwise a plain backward's gradients, the hook counted once,
    in either form (direct, or autograd running the node again in W)."""
    torch.manual_seed(0)
    stage = make()
    params = tuple(stage.parameters())
    x0, g = torch.randn(4, 8), torch.randn(4, 8)
    x = x0.clone().requires_grad_(True)
    stage(x).backward(g)
    want = [p.grad.clone() for p in params]
    stage.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    (_,), work = split_backward.backward_input(stage(x), g, (x,), params,
                                               allow_direct=allow_direct)
    split_backward.backward_weight(work)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))


def test_split_backward_keeps_ddp_gradient_hooks(tmp_path):
    """DistributedDataParallel hooks the gradient accumulators where the parameters do not
    show it: a stage holding one keeps the autograd form, so its buckets still reduce (a
    direct form would skip them: the counter tells the two apart)."""
    code = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from torch import nn
        from mpipe_verified.executor import split_backward
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0,
                                world_size=1)
        net = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))
        reduced = []
        def hook(state, bucket):
            reduced.append(1)
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        net.register_comm_hook(None, hook)
        for allow in (split_backward.direct_allowed(net), True):
            reduced.clear()
            x = torch.randn(3, 4, requires_grad=True)
            y = net(x)
            _, work = split_backward.backward_input(y, torch.ones_like(y), (x,),
                                                    tuple(net.parameters()), allow)
            direct = len(work.direct)
            split_backward.backward_weight(work)
            print(allow, direct, len(reduced))
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False 0 1", "True 2 0"]


def test_sender_checks_shape_and_dtype():
    want = Payload("grad", 2, 0, shape=(3, 5), dtype="float32")
    check_outgoing(torch.zeros(3, 5), want, 0, "op")
    with pytest.raises(PayloadMismatchError, match=r"\(3, 6\) float32 but the plan's payload "
                                                   r"is \(3, 5\) float32"):
        check_outgoing(torch.zeros(3, 6), want, 0, "op")
    with pytest.raises(PayloadMismatchError, match="float64"):
        check_outgoing(torch.zeros(3, 5, dtype=torch.float64), want, 0, "op")


def test_watchdog_ends_a_stuck_process():
    """Armed for 0.2 s, the watchdog ends a process that would sleep for ten minutes:
    exit 124 and its line (``timeout``: a generous hang guard, raising if it does not)."""
    code = textwrap.dedent("""
        import time
        from mpipe_verified.executor.comm import Watchdog
        w = Watchdog(3, grace_s=0.0)
        w.arm("0RECV_F1 at position 4 with rank 1", 0.2)
        time.sleep(600)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 124, done.stderr
    assert "rank 3: 0RECV_F1 at position 4 with rank 1 made no progress" in done.stderr


# ---------------------------------------------------------------- launcher


def run_launcher(tmp_path, body: str, nproc: int = 2, timeout: float = 120):
    """``mpipe-run`` on ``body`` (its first argument: ``tmp_path``); ``timeout``: a
    generous hang guard (``TimeoutExpired``), not a measure of speed."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([MPIPE_RUN, "--nproc", str(nproc), str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=timeout)


# A rank that must be stopped: it writes its pid, then sleeps for longer than the guard
# (a launcher that waited for it would hit the guard). The failing rank fails only once
# that pid is written, so the stopped rank is surely running by then.
STOPPED = """
    import os, signal, sys, time

    def stopped(out):
        with open(os.path.join(out, "pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(out, "pid.tmp"), os.path.join(out, "pid"))
        time.sleep(600)

    def when_stopped_is_running(out):
        while not os.path.exists(os.path.join(out, "pid")):
            time.sleep(0.01)
"""


def gone(pid: int) -> bool:
    """No process ``pid`` (the launcher waited for it: not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_launcher_sets_env_and_succeeds(tmp_path):
    done = run_launcher(tmp_path, """
        import os, sys
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        with open(os.path.join(sys.argv[1], "env." + os.environ["RANK"]), "w") as f:
            f.write(" ".join(os.environ[k] for k in keys))
    """, nproc=3)
    assert done.returncode == 0, done.stderr
    envs = [(tmp_path / f"env.{r}").read_text().split() for r in range(3)]
    assert [e[0] for e in envs] == ["0", "1", "2"] and {e[1] for e in envs} == {"3"}
    assert len({e[4] for e in envs}) == 1 and envs[0][3] == "127.0.0.1"


def test_launcher_forwards_a_failure_and_stops_the_others(tmp_path):
    """Rank 1 exits 3 while rank 0 sleeps: the launcher exits 3, says so, and has
    stopped rank 0 (its process is gone) rather than waiting for it."""
    done = run_launcher(tmp_path, STOPPED + """
    if os.environ["RANK"] == "1":
        when_stopped_is_running(sys.argv[1])
        raise SystemExit(3)
    stopped(sys.argv[1])
    """)
    assert done.returncode == 3, done.stderr
    assert "rank 1 exited with code 3; stopping the other ranks" in done.stderr
    assert gone(int((tmp_path / "pid").read_text()))


def test_launcher_reports_a_killed_rank(tmp_path):
    """Rank 0 is killed (SIGKILL) while rank 1 sleeps: the launcher exits 137 (128 + 9),
    says so, and has stopped rank 1."""
    done = run_launcher(tmp_path, STOPPED + """
    if os.environ["RANK"] == "0":
        when_stopped_is_running(sys.argv[1])
        os.kill(os.getpid(), signal.SIGKILL)
    stopped(sys.argv[1])
    """)
    assert done.returncode == 137, done.stderr
    assert "rank 0 exited with code 137; stopping the other ranks" in done.stderr
    assert gone(int((tmp_path / "pid").read_text()))


def test_launcher_forwards_whole_lines_prefixed_with_the_rank(tmp_path):
    """Ranks that write a character at a time into a pipe still come out one whole line
    each, prefixed with the rank (stdout and stderr each to its own stream)."""
    done = run_launcher(tmp_path, """
        import os, sys
        r = os.environ["RANK"]
        for i in range(40):
            for ch in f"rank {r} line {i} " + "x" * 30 + "\\n":
                sys.stdout.write(ch)
                sys.stdout.flush()
        print(f"done {r}", file=sys.stderr)
        sys.stdout.write("no newline")
    """, nproc=3)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    pattern = re.compile(r"\[rank(\d)\]:(rank \1 line \d+ x{30}|no newline)")
    assert len(lines) == 3 * 41 and all(pattern.fullmatch(x) for x in lines), lines[:5]
    for r in range(3):  # each rank's lines in its own order
        own = [x for x in lines if x.startswith(f"[rank{r}]:rank")]
        assert own == [f"[rank{r}]:rank {r} line {i} " + "x" * 30 for i in range(40)]
    assert sorted(done.stderr.splitlines()) == [f"[rank{r}]:done {r}" for r in range(3)]


def test_launcher_runs_a_module_with_dash_m(tmp_path):
    (tmp_path / "rankmod.py").write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    done = subprocess.run([MPIPE_RUN, "--nproc", "2", "-m", "rankmod"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]:hello from 0", "[rank1]:hello from 1"]


def test_launcher_usage_errors():
    done = subprocess.run([MPIPE_RUN, "--nproc", "2", "no/such/script.py"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "no such script" in done.stderr


# ---------------------------------------------------------------- stored activations

@pytest.mark.parametrize("term", [
    *(family(name, 4, 8) for name in FAMILIES),
    *(Transpose(family("1f1b", 4, 8), mode=mode, ownership=own)
      for mode in ("recompute", "owner", "frozen") for own in ("full", "inline")),
    ForwardOnly(Transpose(family("zb-h1", 4, 8), mode="owner")),
], ids=repr)
def test_the_steps_hold_stored_activations_as_the_verifier_counts_them(term):
    """Each rank's compiled steps hold and free stored activations so that the most held
    at once (allocations before frees) is the verifier's unit-memory peak, and every one
    held is freed by the end: the executor takes them from ``step_effects``."""
    plan = lower(term.derive())
    report = verify(plan)
    for rank in range(plan.num_ranks):
        live = peak = 0
        for step in compile_steps(plan.programs[rank], rank, Chain.of(plan)):
            live += len(step.holds)
            peak = max(peak, live)
            live -= len(step.frees)
        assert (peak, live) == (report.peak_memory[rank], 0), rank


def test_a_split_backward_keeps_the_saved_value_only_until_its_last_reader():
    """The interpreter counts a split backward's stored activation until ``W`` (the
    verifier's peak), but drops the saved value after ``I``, its last reader: ``W`` runs
    on the weight work ``I`` left, so the forward's saved output is already collected."""
    import gc
    import weakref

    from mpipe_verified.executor.interpreter import Interpreter
    from mpipe_verified.semantics import produces

    class Value:
        pass

    from mpipe_verified.algebra.terms import make_placement
    from mpipe_verified.ir import Compute as Op, Schedule

    order = [("F", 0), ("F", 1), ("I", 0), ("I", 1), ("F", 2), ("W", 0), ("I", 2),
             ("W", 1), ("W", 2)]  # the weight work deferred, as zero bubble defers it
    program = tuple(Op(kind, 0, mb) for kind, mb in order)
    plan = lower(Schedule(make_placement("looped", 1, 1), 3, (program,)))
    saved, alive_at_w = {}, []

    class Compute:
        def run(self, op, needs, step, store, done):
            if op.kind == "W":
                gc.collect()
                alive_at_w.append(saved[op.mb]() is not None)
            out = {t: Value() for t in produces(op)}
            for t, value in out.items():
                if t[0] == "stored":
                    saved[t[3]] = weakref.ref(value)
            return out

    class Transport:
        def begin(self):
            pass

        def end(self, resolve):
            pass

    steps = compile_steps(plan.programs[0], 0, Chain.of(plan))
    interpreter = Interpreter(0, steps, Compute())
    interpreter.run(None, Transport(), lambda pending: pending)
    assert alive_at_w == [False] * 3
    assert interpreter.stored_peak == verify(plan).peak_memory[0] == 3
