"""Structured stage inputs and outputs, and shapes that change between steps.

One launch of 2 real gloo processes (``test_executor_trees_worker.py``) runs: a 4-stage
model passing dicts, tuples and lists of float, int64, bool and None leaves, with keyword
inputs for the first stage, under interleaved 1F1B (also with bare messages) and ZBV
(split backward); a plan whose activation is one int64 tensor; a vision encoder whose
tuple output (tokens and a bool mask) crosses the cut under transpose in owner mode; a
LLaVA-style model (image tokens concatenated with text tokens) trained three SGD steps
through a ``ShapeCache`` with a different image count and text length every step; and a
structured message whose leaf layout differs from the plan. Losses and gradients must
equal a single-process run (float32, atol 1e-5).

Without processes: the plan records a structured payload leaf by leaf (its gradient only
for float leaves that require one; the meta device infers the same), plan-json and the
kernel's certificate carry the leaves exactly, both digests cover them, the packed
codec round-trips any structure and names the leaf a message gets wrong, and the sender
refuses a leaf that differs. The two snippets of docs/executor.md's sections on these
capabilities run as written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import attrs
import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_executor_trees_worker as w  # noqa: E402
from mpipe_verified import kernel  # noqa: E402
from mpipe_verified.algebra import family  # noqa: E402
from mpipe_verified.executor import infer_payload_shapes, with_payload_shapes  # noqa: E402
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.executor import Batch, CertificateError, PayloadMismatchError  # noqa: E402
from mpipe_verified.executor import check_certificate, signature  # noqa: E402
from mpipe_verified.executor.launch import free_port, rank_env  # noqa: E402
from mpipe_verified.executor import tree  # noqa: E402
from mpipe_verified.executor.packed import Messages, check_outgoing  # noqa: E402
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json  # noqa: E402
from mpipe_verified.ir import GRAD, Leaf, Payload, Send  # noqa: E402
from mpipe_verified.semantics import MemoryModel  # noqa: E402
from mpipe_verified.verify import verify  # noqa: E402
from mpipe_verified.verify.report import plan_digest  # noqa: E402


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trees"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MPIPE_BACKEND"}
    env["MPIPE_BACKEND"] = "gloo"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "test_executor_trees_worker.py"),
                               out], env=rank_env(r, 2, port, env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    return out


def load(out: str, name: str) -> list[dict]:
    return [torch.load(os.path.join(out, f"{name}.{r}.pt")) for r in range(2)]


def merged(results: list[dict]) -> dict:
    got = {}
    for res in results:
        for key, grad in res["grads"].items():
            assert key not in got, f"{key} has a gradient on two ranks"
            got[key] = grad
    return got


def assert_grads(got: dict, model, what: str) -> None:
    want = {f"{i}.{n}": p.grad for i, layer in enumerate(model)
            for n, p in layer.named_parameters() if p.grad is not None}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0,
                                   msg=lambda m, k=key: f"{what}, {k}: {m}")


@pytest.mark.parametrize("name", sorted(w.TREE_CASES))
def test_dict_and_tuple_stage_outputs_match_a_single_process_run(launch, name):
    model, batch = w.trees_model(), w.trees_batch(8)
    out = model[3](model[2](model[1](model[0](batch.body, **batch.kwargs))))
    loss = w.dict_loss(out, batch.target)
    loss.backward()
    results = load(launch, name)
    assert all(abs(r["loss"] - float(loss.detach())) <= 1e-5 for r in results)
    assert_grads(merged(results), model, name)


def test_an_int64_activation_travels_without_gradient(launch):
    model = w.int_model()
    g = torch.Generator().manual_seed(3)
    tokens, target = torch.randint(0, w.V, (8, w.T), generator=g), torch.randint(
        0, w.V, (8, w.T), generator=g)
    loss = w.tensor_loss(model(tokens), target)
    loss.backward()
    results = load(launch, "int-act")
    assert all(abs(r["loss"] - float(loss.detach())) <= 1e-5 for r in results)
    assert_grads(merged(results), model, "int-act")


def test_a_tuple_encoder_output_crosses_the_cut_under_transpose(launch):
    encoder, body = w.fused_model()
    batch = w.fused_batch()
    logits = body[1](body[0](encoder(batch.segments["vision"]), batch.body))
    loss = w.text_loss(logits, batch.target)
    loss.backward()
    results = load(launch, "fused")
    assert all(abs(r["loss"] - float(loss.detach())) <= 1e-5 for r in results)
    got = merged(results)
    want = {f"vision.{n}": p.grad for n, p in encoder.named_parameters()}
    for key, grad in want.items():
        torch.testing.assert_close(got.pop(key), grad, atol=1e-5, rtol=0)
    assert_grads(got, body, "fused")


def test_shape_cache_trains_llava_style_batches_of_changing_image_counts(launch):
    model = w.llava_model()
    opt = torch.optim.SGD(model.parameters(), lr=w.LLAVA_LR)
    results = load(launch, "llava")
    for step in range(len(w.LLAVA_STEPS)):
        batch = w.llava_batch(step)
        opt.zero_grad()
        loss = w.text_loss(model[1](model[0](*batch.body)), batch.target)
        loss.backward()
        assert all(abs(r["steps"][step]["loss"] - float(loss.detach())) <= 1e-5 for r in results), step
        assert_grads(merged([r["steps"][step] for r in results]), model, f"step {step}")
        opt.step()
    params = {k: v for r in results for k, v in r["params"].items()}
    for i, layer in enumerate(model):
        for n, p in layer.named_parameters():
            torch.testing.assert_close(params[f"{i}.{n}"], p.detach(), atol=1e-5, rtol=0)
    # one plan certified per image count, one optimizer shared by their executors
    assert [(r["certified"], r["optimizers"]) for r in results] == [(3, 1), (3, 1)]


def test_a_message_whose_leaf_differs_from_the_plan_is_refused_naming_the_leaf(launch):
    text = open(os.path.join(launch, "leaf-mismatch.txt")).read()
    assert text.startswith("PayloadMismatchError"), text
    assert '["pos"]' in text and "int32" in text and "int64" in text and "rank 0" in text, text


# ---------------------------------------------------------------- without processes


def trees_plan():
    model, batch = w.trees_model(), w.trees_batch(8)
    return w.tree_plan("interleaved-1f1b", 2, 4, model, batch)


def payload(plan, kind, stage):
    return next(c.payload for prog in plan.programs for c in prog
                if type(c) is Send and c.payload.kind == kind and c.payload.stage == stage
                and c.payload.mb == 0)


def test_the_plan_records_each_leaf_and_a_gradient_only_for_float_leaves_needing_one():
    plan = trees_plan()
    act = payload(plan, "act", 1)
    assert act.shape is None and act.dtype is None
    # Mix's output: (h, [pos, mask as float], aux) for 2 rows of T tokens
    assert act.leaves == (Leaf("(0)", (2, w.T, w.D), "float32"),
                          Leaf("(1)[0]", (2, w.T), "int64"),
                          Leaf("(1)[1]", (2, w.T), "float32"),
                          Leaf("(2)", (2, w.T, 1), "float32"))
    # its gradient: h and aux (the float mask depends on no parameter, pos is int64)
    assert [x.path for x in payload(plan, GRAD, 2).leaves] == ["(0)", "(2)"]
    first = payload(plan, "act", 0)  # Embed's dict, None leaf included
    assert [x.path for x in first.leaves] == ['["h"]', '["pos"]', '["mask"]', '["none"]']
    assert first.leaves[2].dtype == "bool" and first.leaves[3] == Leaf('["none"]')


def test_layouts_inferred_on_the_meta_device_are_the_real_ones():
    model, batch = w.trees_model(), w.trees_batch(8)
    plan = lower(family("interleaved-1f1b", 2, 4, 2).derive())
    assert with_payload_shapes(plan, infer_payload_shapes(list(model), batch, 4, meta=True)) \
        == trees_plan()


def test_leaves_round_trip_through_plan_json_and_the_kernel_certificate():
    plan = trees_plan()
    text = format_plan_json(plan)
    back = parse_plan_json(text, "trees.json")
    assert back == plan and format_plan_json(back) == text
    model = MemoryModel(buffer=lambda p: float(len(p.leaves or ())))  # sizes keyed by leaves
    report = verify(plan, memory_model=model)
    assert report.verified, report.violations
    cert = json.loads(json.dumps(report.portable_certificate(plan)))
    assert report.certificate.digest == plan_digest(back) == kernel.digest(back) == cert["digest"]
    assert any("leaves" in p for p, _ in cert["sizes"]["buffer"])
    assert kernel.recheck(back, cert) == (True, [])
    # the digest covers every leaf: one dtype changed is another plan
    act = payload(plan, "act", 1)
    other = attrs.evolve(act, leaves=(*act.leaves[:1], attrs.evolve(act.leaves[1], dtype="int32"),
                                      *act.leaves[2:]))
    edited = attrs.evolve(plan, programs=tuple(
        tuple(Send(op.dst, other) if type(op) is Send and op.payload == act else op
              for op in prog) for prog in plan.programs))
    assert edited != plan and kernel.digest(edited) != kernel.digest(plan)
    assert kernel.recheck(edited, cert)[0] is False
    with pytest.raises(CertificateError):
        check_certificate(edited, report.certificate)


def test_the_sender_refuses_a_leaf_that_differs_from_the_plan():
    act = payload(trees_plan(), "act", 1)
    h, pos = torch.zeros(2, w.T, w.D), torch.zeros(2, w.T, dtype=torch.int64)
    good = (h, [pos, torch.zeros(2, w.T)], torch.zeros(2, w.T, 1))
    assert len(check_outgoing(good, act, 0, "1SEND_F0 at position 3")) == 4
    bad = (h, [pos.int(), torch.zeros(2, w.T)], torch.zeros(2, w.T, 1))
    with pytest.raises(PayloadMismatchError, match=r"leaf \(1\)\[0\] is \(2, 5\) int32 but "
                                                   r"the plan's is \(2, 5\) int64"):
        check_outgoing(bad, act, 0, "1SEND_F0 at position 3")
    with pytest.raises(PayloadMismatchError, match=r"leaf \(1\)\[2\] is not in the plan"):
        check_outgoing((h, [pos, torch.zeros(2, w.T), None], good[2]), act, 0, "here")


def test_batch_splits_keyword_inputs_and_signatures_tell_shapes_apart():
    batch = Batch(torch.zeros(5, 3), kwargs={"mask": torch.ones(5, 3, dtype=torch.bool),
                                             "causal": True})
    parts = batch.split(2)
    assert [p.kwargs["mask"].shape[0] for p in parts] == [3, 2]
    assert all(p.kwargs["causal"] is True for p in parts)
    assert signature(w.llava_batch(0)) != signature(w.llava_batch(1))


def test_the_docs_snippets_run_as_written(tmp_path):
    """Every ``docs/executor.md`` block that starts ``# mpipe-run --nproc 2 NAME.py`` runs
    so (both at once), exits 0 and prints its line."""
    text = open(os.path.join(HERE, "..", "docs", "executor.md")).read()
    blocks = re.findall(r"```python\n(# mpipe-run --nproc 2 (\w+\.py)\n.*?)```", text, re.S)
    assert sorted(name for _, name in blocks) == ["shapes.py", "trees.py"]
    run = os.path.join(os.path.dirname(sys.executable), "mpipe-run")
    procs = []
    for code, name in blocks:
        (tmp_path / name).write_text(code)
        procs.append(subprocess.Popen([run, "--nproc", "2", name], cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = {name: p.communicate(timeout=240)[0] for (_, name), p in zip(blocks, procs)}
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "[rank0]:loss after 5 steps: " in outputs["trees.py"], outputs
    assert "[rank0]:3 plans certified for 6 steps" in outputs["shapes.py"], outputs


def transfer(value, sent, expected, check=True):
    """``value`` packed for payload ``sent`` and decoded for ``expected`` (the bytes copied
    as a transport would: a shorter message fills the start of the receive buffer)."""
    messages = Messages(1, torch.device("cpu"), check)
    buf, into = messages.outgoing(value, sent), messages.incoming(expected)
    into[:buf.numel()].copy_(buf)
    return messages.decode(into, expected, 0, "1RECV_F0 at position 2")


def test_packed_messages_round_trip_any_structure_and_name_the_leaf_that_differs():
    value = (torch.ones(3, dtype=torch.int8), {"z": torch.full((2,), 1 + 2j,
                                                             dtype=torch.complex128)},
             None, [torch.arange(3), torch.rand(2, 2) > 0.5])
    p = Payload("act", 0, 0, leaves=tree.layout(value))
    for check in (True, False):
        got = transfer(value, p, p, check)
        assert tree.layout(got) == p.leaves and type(got[1]) is dict and type(got[3]) is list
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(tree.flatten(got),
                                                                tree.flatten(value))
                   if a is not None)
    # one fewer leaf: a shorter message, its trailer found earlier
    shorter = value[:3] + ([value[3][0]],)
    with pytest.raises(PayloadMismatchError, match=r"leaf \(3\)\[1\] is absent, but the "
                                                   r"plan's leaf \(3\)\[1\] is \(2, 2\) bool"):
        transfer(shorter, Payload("act", 0, 0, leaves=tree.layout(shorter)), p)
    # same size, another shape of one leaf
    other = value[:3] + ([value[3][0], value[3][1].reshape(4)],)
    with pytest.raises(PayloadMismatchError, match=r"leaf \(3\)\[1\] is \(4,\) bool, but the "
                                                   r"plan's leaf \(3\)\[1\] is \(2, 2\) bool"):
        transfer(other, Payload("act", 0, 0, leaves=tree.layout(other)), p)
    # a single tensor where the plan has a structure
    one = Payload("act", 0, 0, shape=(3,), dtype="int8")
    with pytest.raises(PayloadMismatchError, match=r"\(one tensor\), but the plan expects"):
        transfer(value[0], one, p)
