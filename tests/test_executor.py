"""The executor against a single-process run, with real gloo processes on CPU.

Two launches (2 and 4 ranks, one process per rank, env init on a free port) run every
family (encoder inline on the first stage), transpose in the recompute/owner/frozen modes,
a plan whose adjacent comm ops are posted as groups, the strict wait-after-every-comm mode
and bare (trailer-less) messages; each case's loss and every
parameter gradient after one step must equal a single-process, non-pipelined run of the
same model on the same data (float32, atol 1e-5; in its own dtype: an owner-mode encoder
with a float64 parameter beside float32 ones keeps each gradient's dtype through the
all-reduce), and every case's measured peak of
stored activations per rank must equal the verifier's. An encoder with dropout runs in
recompute and owner mode: each recompute must draw its forward's mask, and the gradients
of both modes must agree. Each launch then ends with failure
scenarios: on 2 ranks a received message smaller than the plan's payload, then a stage
that returns the wrong shape (refused before sending; the silent peer times out); on 4
ranks a rank killed with SIGKILL mid-step, after which the others must exit non-zero
within 60 s.

Two encoders (vision and audio, both transposed in owner or recompute mode, or inline in
zb-h1) and a sink segment (a class-prediction head after the last stage, with its own
loss) are training cases like the others: every gradient equals the single-process run's,
and so does each microbatch's loss (``step(..., return_losses=True)``). Forward-only
plans run ``executor.eval``: the last stage's outputs, per-microbatch losses and loss
equal a single-process forward, no gradient appears, and the measured peak of stored
activations is the verifier's, 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import test_executor_worker as worker  # noqa: E402
import train_tiny_mllm as tiny  # noqa: E402
from mpipe_verified.executor.launch import free_port, rank_env  # noqa: E402

FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev")
MODES = ("recompute", "owner", "frozen")
WORKER = os.path.join(HERE, "test_executor_worker.py")
LAUNCH_TIMEOUT = 300


def cases(world: int) -> list[dict]:
    m = 2 * world  # dualpipev needs m >= 2p
    out = [{"name": f, "schedule": f, "m": m} for f in FAMILIES]
    out += [{"name": f"transpose-{mode}", "schedule": "transpose", "mode": mode, "m": m}
            for mode in MODES]
    out.append({"name": "1f1b-grouped", "schedule": "1f1b", "m": m, "group": True})
    # waiting right after every comm op (overlap_comms=False), and bare messages
    out.append({"name": "zb-h2-strict", "schedule": "zb-h2", "m": m, "strict": True})
    out.append({"name": "transpose-owner-strict", "schedule": "transpose", "mode": "owner",
                "m": m, "strict": True})
    out.append({"name": "dualpipev-bare", "schedule": "dualpipev", "m": m, "bare": True})
    # receives waited for just before their first reader (the default on CUDA)
    out.append({"name": "zb-h1-deferred", "schedule": "zb-h1", "m": m, "defer": True})
    out.append({"name": "audio-owner-deferred", "schedule": "transpose", "mode": "owner",
                "m": m, "audio": "owner", "defer": True})
    # an owner-mode encoder with float32 and float64 parameters (its gradient all-reduce)
    out.append({"name": "owner-mixed-dtypes", "schedule": "transpose", "mode": "owner",
                "m": m, "mixed": True})
    # step, then run again without zero_grad: twice the gradients, the all-reduced
    # encoder's included (each all-reduce sums only its own pass's contributions)
    out.append({"name": "owner-run-twice", "schedule": "transpose", "mode": "owner", "m": m,
                "twice": True})
    # an encoder with dropout: recompute must replay its forward's masks
    out += [{"name": f"dropout-{mode}", "schedule": "transpose", "mode": mode, "m": m,
             "dropout": True} for mode in ("recompute", "owner")]
    # two source encoders, a sink, and evaluation (forward-only) plans
    out += [{"name": f"audio-{mode}", "schedule": "transpose", "mode": mode, "m": m,
             "audio": mode} for mode in ("owner", "recompute")]
    out.append({"name": "audio-zb-h1", "schedule": "zb-h1", "m": m, "audio": "recompute"})
    out.append({"name": "sink-owner", "schedule": "transpose", "mode": "recompute", "m": m,
                "audio": "owner", "sink": "owner"})
    out += [{"name": "eval-1f1b", "schedule": "1f1b", "m": m, "eval": True},
            {"name": "eval-transpose-owner", "schedule": "transpose", "mode": "owner", "m": m,
             "audio": "recompute", "sink": "owner", "eval": True}]
    return out


CASE_NAMES = [c["name"] for c in cases(2) if not c.get("dropout") and not c.get("eval")]
EVAL_NAMES = [c["name"] for c in cases(2) if c.get("eval")]
ALL_NAMES = [c["name"] for c in cases(2)]


class Launch:
    """``world`` worker processes; records each one's exit code (None: still running
    after ``LAUNCH_TIMEOUT``, a hang guard, and killed)."""

    def __init__(self, world: int, out_dir: str, final: str | None,
                 case_list: list[dict] | None = None) -> None:
        self.world, self.out = world, out_dir
        with open(os.path.join(out_dir, "cases.json"), "w") as f:
            json.dump(cases(world) if case_list is None else case_list, f)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "MPIPE_BACKEND"}
        env["MPIPE_BACKEND"] = "gloo"
        self.logs = [open(os.path.join(out_dir, f"stderr.{r}"), "w+") for r in range(world)]
        self.procs = [subprocess.Popen(
            [sys.executable, WORKER, out_dir, os.path.join(out_dir, "cases.json"),
             *(["--final", final] if final else [])], env=rank_env(r, world, port, env),
            stdout=self.logs[r],
            stderr=subprocess.STDOUT) for r in range(world)]
        self.codes: list[int | None] = [None] * world
        deadline = time.time() + LAUNCH_TIMEOUT
        while None in self.codes and time.time() < deadline:
            for r, p in enumerate(self.procs):
                if self.codes[r] is None and p.poll() is not None:
                    self.codes[r] = p.returncode
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def stderr(self, rank: int) -> str:
        self.logs[rank].seek(0)
        return self.logs[rank].read()

    def result(self, name: str, rank: int) -> dict | None:
        path = os.path.join(self.out, f"{name}.{rank}.pt")
        return torch.load(path) if os.path.exists(path) else None

    def describe(self) -> str:
        return "\n".join(f"rank {r} exit {self.codes[r]}:\n{self.stderr(r)[-3000:]}"
                         for r in range(self.world))


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = {}
    for world, final in ((2, "send-mismatch"), (4, "kill")):
        d = tmp_path_factory.mktemp(f"executor{world}")
        out[world] = Launch(world, str(d), final)
    return out


def forward(case: dict, world: int):
    """The plain model (no pipeline) on the case's batch: ``(segments, body, batch,
    output)``; the encoders in cut order feed the first layer."""
    num_stages = worker.case_term(case, world).derive().placement.num_stages
    segments, body = worker.case_model(case, num_stages)
    batch = worker.case_batch(case)
    x = body[0](*[module(batch.segments[name]) for name, module in segments.items()
                  if name != "gen"], batch.body)
    for layer in list(body)[1:]:
        x = layer(x)
    return segments, body, batch, x


def reference(case: dict, world: int) -> tuple[float, dict, list]:
    """Loss, gradients and per-microbatch losses of the plain model on the same batch (a
    sink's loss added, its input detached)."""
    segments, body, batch, x = forward(case, world)
    loss = tiny.loss_fn(x, batch.target)
    m = case["m"]
    per_mb = [tiny.loss_fn(a, b) for a, b in zip(torch.tensor_split(x, m),
                                                  torch.tensor_split(batch.target, m))]
    if "gen" in segments:
        head = segments["gen"](x.detach())
        loss = loss + worker.sink_loss(head, batch.segments["gen"])
        per_mb = [a + worker.sink_loss(h, c) for a, h, c in zip(
            per_mb, torch.tensor_split(head, m), torch.tensor_split(batch.segments["gen"], m))]
    loss.backward()
    grads = {f"{name}.{n}": p.grad for name, module in segments.items()
             for n, p in module.named_parameters() if p.grad is not None}
    grads.update({f"body.{n}": p.grad for n, p in body.named_parameters()})
    return float(loss.detach()), grads, [float(x.detach()) for x in per_mb]


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", CASE_NAMES)
def test_step_matches_single_process(launches, world, name):
    run = launches[world]
    case = next(c for c in cases(world) if c["name"] == name)
    results = [run.result(name, r) for r in range(world)]
    assert all(r is not None for r in results), f"{name} produced no result\n{run.describe()}"
    want_loss, want, want_losses = reference(case, world)
    if case.get("twice"):
        want = {key: 2 * grad for key, grad in want.items()}
    for r, res in enumerate(results):
        assert abs(res["loss"] - want_loss) <= 1e-5, (r, res["loss"], want_loss)
        assert len(res["losses"]) == case["m"], res["losses"]
        for got_mb, want_mb in zip(res["losses"], want_losses):
            assert abs(got_mb - want_mb) <= 1e-5, (r, res["losses"], want_losses)
    got: dict = {}
    for r, res in enumerate(results):
        for key, grad in res["grads"].items():
            segment = key.split(".")[0]
            if segment in res["homes"] and r != res["homes"][segment]:
                # non-home copies: only the owner mode all-reduces them; then they must agree
                torch.testing.assert_close(grad, want[key], atol=1e-5, rtol=0)
                continue
            assert key not in got, f"{key} has a gradient on two ranks"
            got[key] = grad
    assert set(got) == set(want), (sorted(set(want) ^ set(got)))
    if case.get("defer"):  # the deferred form really ran: receives read while in flight
        assert sum(res["deferred"] for res in results) > 0, [r["deferred"] for r in results]
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0,
                                   msg=lambda m, k=key: f"{name} on {world} ranks, {k}: {m}")


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", ALL_NAMES)
def test_measured_stored_peak_equals_verified_peak(launches, world, name):
    """Each rank's most stored activations held at once equals the verifier's peak."""
    run = launches[world]
    results = [run.result(name, r) for r in range(world)]
    assert all(r is not None for r in results), f"{name} produced no result\n{run.describe()}"
    measured = [r["stored_peak"] for r in results]
    assert measured == [r["verified_peak"] for r in results], measured
    if name in EVAL_NAMES:  # an evaluation forward keeps no graph
        assert measured == [0] * world and not any(r["grads"] for r in results)
    else:
        assert max(measured) >= 2  # really measured: a pipeline holds several at once


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", EVAL_NAMES)
def test_eval_returns_the_outputs_and_losses_of_a_single_process_forward(launches, world,
                                                                          name):
    run = launches[world]
    case = next(c for c in cases(world) if c["name"] == name)
    results = [run.result(name, r) for r in range(world)]
    assert all(r is not None for r in results), f"{name} produced no result\n{run.describe()}"
    plan = worker.case_term(case, world).derive()
    holder = plan.placement.rank_of(plan.placement.num_stages - 1)
    with torch.no_grad():
        segments, _, batch, x = forward(case, world)
    m = case["m"]
    if "gen" in segments:  # each sink output on the rank that ran it, once
        heads = {}
        for res in results:
            assert not set(heads) & set(res["sink_outputs"])
            heads.update(res["sink_outputs"])
        with torch.no_grad():
            want = torch.tensor_split(segments["gen"](x), m)
        assert sorted(heads) == list(range(m))
        for mb in range(m):
            torch.testing.assert_close(heads[mb], want[mb], atol=1e-5, rtol=0)
    want_losses = [float(tiny.loss_fn(a, b)) for a, b in zip(
        torch.tensor_split(x, m), torch.tensor_split(batch.target, m))]
    for r, res in enumerate(results):
        if r != holder:  # eval returns None off the last stage's rank
            assert res["outputs"] is None and res["loss"] is None, r
            continue
        torch.testing.assert_close(res["outputs"], x, atol=1e-5, rtol=0)
        assert abs(res["loss"] - float(tiny.loss_fn(x, batch.target))) <= 1e-5
        assert max(abs(a - b) for a, b in zip(res["losses"], want_losses)) <= 1e-5


def merged_grads(results: list[dict]) -> dict:
    """One gradient per parameter: the body's from its stage's rank, the encoder's from
    its home rank (owner mode all-reduces them, so every copy is the same)."""
    out = {}
    for r, res in enumerate(results):
        for key, grad in res["grads"].items():
            if not key.startswith("vision.") or r == res["home"]:
                out[key] = grad
    return out


@pytest.mark.parametrize("world", (2, 4))
def test_recompute_replays_the_forward_dropout_masks(launches, world):
    run = launches[world]
    got = {mode: [run.result(f"dropout-{mode}", r) for r in range(world)]
           for mode in ("recompute", "owner")}
    assert all(r is not None for rs in got.values() for r in rs), run.describe()
    case = next(c for c in cases(world) if c["name"] == "dropout-recompute")
    cut = tiny.build_term("transpose", world, case["m"], "recompute").derive().cut
    seg = cut.segments[0]
    recomputed = 0
    for mb in range(case["m"]):
        calls = [(r, grad, mask) for r, res in enumerate(got["recompute"])
                 for m_, grad, mask in res["calls"] if m_ == mb]
        if not seg.needs_recompute(mb):
            assert len(calls) == 1, (mb, [c[:2] for c in calls])
            continue
        assert sorted(c[0] for c in calls) == sorted((seg.forward_rank[mb],
                                                      seg.backward_rank[mb])), mb
        # the forward on its owner, the recompute at home
        forward, again = sorted(calls, key=lambda c: c[0] != seg.forward_rank[mb])
        assert again[1], "the recompute must build a graph"
        assert torch.equal(forward[2], again[2]), f"mb {mb}: the recompute drew another mask"
        recomputed += 1
    assert recomputed >= world - 1
    masks = [mask for res in got["recompute"] for _, _, mask in res["calls"]]
    assert not all(torch.equal(masks[0], m_) for m_ in masks[1:])  # dropout really drew
    want, have = merged_grads(got["owner"]), merged_grads(got["recompute"])
    assert set(want) == set(have) and any(k.startswith("vision.") for k in want)
    for key in want:
        torch.testing.assert_close(have[key], want[key], atol=1e-5, rtol=0,
                                   msg=lambda m_, k=key: f"{world} ranks, {k}: {m_}")


def test_received_message_smaller_than_payload_is_refused(launches):
    run = launches[2]
    path = os.path.join(run.out, "recv-mismatch.txt")
    assert os.path.exists(path), run.describe()
    text = open(path).read()
    assert "(4, 7) float32" in text and "(4, 8) float32" in text and "rank 0" in text, text


def test_wrong_shape_is_refused_before_sending_and_a_silent_peer_times_out(launches):
    run = launches[2]
    path = os.path.join(run.out, "send-mismatch.txt")
    assert os.path.exists(path), run.describe()
    text = open(path).read()
    assert "refusing to send act of stage 0 mb 0" in text, text
    assert "(2, 8, 33) float32" in text and "(2, 8, 32) float32" in text, text
    assert run.codes == [3, 1], run.describe()
    err = run.stderr(1)
    assert "PeerError" in err and "timed out after 2 s" in err and "1RECV_F0" in err, err


def test_killed_rank_ends_the_others_through_its_closed_connections(launches):
    """Rank 1 SIGKILLs itself mid-step: every other rank fails at once because a peer's
    connection closed (rank 1's, or that of a rank that failed before it), not by a wait
    timeout (300 s, as long as the launch's hang guard)."""
    run = launches[4]
    assert os.path.exists(os.path.join(run.out, "killed_at")), run.describe()
    assert run.codes[1] == -9, run.describe()
    for r in (0, 2, 3):
        assert run.codes[r] not in (0, None), run.describe()
        err = run.stderr(r)
        assert "PeerError" in err, err[-2000:]  # e.g. "the peer died or closed its ..."
        assert "timed out after" not in err and "made no progress" not in err, err[-2000:]
