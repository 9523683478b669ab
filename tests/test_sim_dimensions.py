"""The cost model and simulator on the newer dimensions (cost.py's docstring): the
``replica:J`` all-reduces of several pipelines, sequence chunks whose cost grows with
their position, offload/reload on a copy stream, lend/return on the link; the same
model on every family (``comparison.on_body``); ``simulate --compare`` skipping with a
reason; ``tune`` on examples/long_sequence.toml."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mpipe_verified.algebra import families, terms
from mpipe_verified.cli import main
from mpipe_verified.comparison import on_body, time_spec
from mpipe_verified.cost import CommModel, CostModel
from mpipe_verified.formats.spec import load_spec, parse_spec
from mpipe_verified.ir import (LEND, RETURN, Collective, Compute, Payload, Placement, Plan, Recv,
                               Send)
from mpipe_verified.sim import simulate
from mpipe_verified.spec import Spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LONG = EXAMPLES / "long_sequence.toml"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_chunk_costs_more_the_later_it_is_and_the_chunks_sum_to_the_sample():
    """Chunk j of S: ``(1 - a) + a (2j + 1) / S`` of the mean chunk; W is all linear."""
    cost = CostModel(F=2.0, W=1.0, attention=0.5, seq_chunks=4)
    forwards = [cost.duration(Compute("F", 0, 4 + j)) for j in range(4)]  # sample 1
    assert forwards == pytest.approx([2 * (0.5 + 0.5 * (2 * j + 1) / 4) for j in range(4)])
    assert forwards == sorted(forwards) and sum(forwards) == pytest.approx(8.0)
    assert {cost.duration(Compute("W", 0, j)) for j in range(4)} == {1.0}
    whole = CostModel(F=8.0, attention=0.5)
    assert whole.chunked(4).duration(Compute("F", 0, 0)) == pytest.approx(forwards[0])
    assert whole.chunked(4).chunked(1) == whole


def test_sequence_chunks_do_the_same_work_as_the_whole_sample():
    """The same model on seq1f1b: each rank's busy time is 1F1B's, the stored
    activation of a chunk is 1/S of a sample's."""
    spec = parse_spec('[schedule]\nfamily = "1f1b"\npp = 4\nmicrobatches = 8\n'
                      '[cost]\nF = 4.0\nB = 8.0\nactivation = 4.0\nattention = 0.4\n', "s.toml")
    plain = time_spec(spec, check=False).run
    for chunks in (2, 4):
        chunked = on_body(spec, families.seq1f1b(4, 8, chunks), "seq")
        run = time_spec(chunked, check=False).run
        assert run.busy == pytest.approx(plain.busy)
        assert chunked.cost.activation == pytest.approx(4.0 / chunks)


def test_a_replica_all_reduce_moves_its_stage_gradients_over_a_ring():
    comm = CommModel(bandwidth=10.0, stage_parameter_bytes=40.0, collective_latency=0.5)
    cost = comm.comm_cost()
    op = Collective("all_reduce", (0, 3), "replica:0")
    assert cost.time(op) == pytest.approx(0.5 + 1.0 * 40.0 / 10.0)  # 2(n-1)/n = 1
    body = families.dualpipe(4, 8)
    spans = [time_spec(Spec(body, body.derive(), CostModel(comm=c)), check=False).run.makespan
             for c in (CommModel(), comm)]
    assert spans[1] >= spans[0] + 4.0


def test_a_lent_activation_travels_as_its_stored_bytes():
    """BPipe-style: rank 0 lends microbatch 0's activation to rank 1 and takes it back
    before its backward; each way takes ``stored_bytes / bandwidth`` (3), so the return
    comes at 7 instead of 4 and the step ends at 9 instead of 6."""
    comm = CommModel(bandwidth=2.0, activation_bytes=1.0, stored_bytes=6.0)
    for kind in (LEND, RETURN):
        assert comm.comm_cost().transfer(Payload(kind, 1, 0)) == 3.0
    f0, f1, b0, b1 = (Compute(k, 0, mb) for k, mb in (("F", 0), ("F", 1), ("B", 0), ("B", 1)))
    lend, back = Payload(LEND, 0, 0), Payload(RETURN, 0, 0)
    plan = Plan(Placement((0,), 2), 2, ((f0, Send(1, lend), f1, b1, Recv(1, back), b0),
                                        (Recv(0, lend), Send(0, back))))
    assert [simulate(plan, comm=c.comm_cost()).makespan for c in (CommModel(), comm)] == [
        6.0, 9.0]


@pytest.mark.parametrize("prefetch,stored,makespan", [
    (1, 0.0, 33.0), (1, 1.0, 33.0), (1, 2.0, 38.0), (0, 0.5, 35.5), (0, 1.0, 39.0)])
def test_a_reload_overlaps_compute_unless_it_comes_too_late(prefetch, stored, makespan):
    """1F1B on 4 ranks (33 time units; a step takes 1 or 2): the host-to-device stream
    hides a reload posted a step ahead (prefetch 1) while it takes no longer than that
    step; posted just before its backward (prefetch 0), or longer, it stalls the
    backward."""
    term = terms.Offloaded(families.one_f_one_b(4, 8), 2, prefetch)
    cost = CostModel(comm=CommModel(stored_bytes=stored, host_bandwidth=1.0))
    run = time_spec(Spec(term, term.derive(), cost), check=False).run
    assert run.makespan == pytest.approx(makespan)


@pytest.mark.parametrize("body", [
    families.dualpipe(4, 8), families.chimera(4, 8), families.seq1f1b(4, 8, 4),
    terms.Offloaded(families.zb_h1(4, 8))], ids=str)
def test_the_simulated_peak_is_the_verified_peak(body):
    """The model of examples/long_sequence.toml (weights, chunked activations, offload)
    on each new family: the simulator's peak per rank is the kernel's."""
    timed = time_spec(on_body(load_spec(LONG), body, "x"), memory_limit=1e9)
    assert timed.report.verified
    assert {int(r): v for r, v in timed.report.peak_memory.items()} == pytest.approx(
        timed.run.peak_memory)


def test_two_weight_copies_count_on_every_rank_of_a_bidirectional_family():
    spec = load_spec(LONG)
    assert spec.cost.static == (19.75,) * 4  # 4 GB + one copy of the rank's stage
    dual = on_body(spec, families.dualpipe(4, 8), "dualpipe")
    assert dual.cost.static == (35.5,) * 4  # + the mirrored pipeline's copy


def test_compare_skips_a_family_that_cannot_run_the_model(capsys):
    code, out, _ = run(capsys, "simulate", str(EXAMPLES / "mllm_transpose.toml"),
                       "--compare", "dualpipe", "seq1f1b", "zbv")
    assert code == 0
    assert ("  dualpipe           skipped: the cut segment 'vision' (a transpose) does not "
            "run over several pipelines\n") in out
    assert "  seq1f1b            skipped: " in out and "ranked by makespan: this spec " in out
    code, out, _ = run(capsys, "simulate", "--family", "1f1b", "--pp", "3", "--microbatches",
                       "6", "--compare", "chimera", "--json")
    doc = json.loads(out)
    assert code == 0 and "even pp" in doc["compare"]["chimera"]["skipped"]


def test_tune_picks_sequence_chunks_or_offload_on_the_long_sequence_example(capsys, tmp_path):
    """No plain family fits the limit; the pick has sequence chunks or offload, says why,
    and is verified; written out, check verifies it."""
    best = tmp_path / "best.toml"
    code, out, _ = run(capsys, "tune", str(LONG), "--json", "-o", str(best))
    doc = json.loads(out)
    pick = doc["best"]
    assert code == 0 and pick["status"] == "verified"
    assert "offload" in pick["schedule"] or "seq1f1b" in pick["schedule"]
    assert pick["peak_memory"] <= 72
    why = doc["why"]
    assert why[0] == (f"{pick['schedule']}: fits the limit of 72 (peak "
                      f"{pick['peak_memory']:.6g}); the fastest verified candidate that fits")
    assert any(line.startswith("zb-h1 peaks at ") and line.endswith(" > 72") for line in why)
    assert doc["baseline"] is None  # no plain family fits
    code, out, _ = run(capsys, "check", str(best))
    assert code == 0 and "VERIFIED" in out
    text = run(capsys, "tune", str(LONG))[1]  # docs/tune.md shows these lines
    shown = text.split("\n", 1)[1].split("Pareto front")[0]
    assert shown in (EXAMPLES.parent / "docs" / "tune.md").read_text()


def test_the_schedules_doc_holds_what_its_command_prints():
    """docs/schedules.md's table is ``python benchmarks/schedules.py``'s output."""
    path = EXAMPLES.parent / "benchmarks" / "schedules.py"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
        "schedules_table", path))
    module.__loader__.exec_module(module)
    doc = (EXAMPLES.parent / "docs" / "schedules.md").read_text()
    assert module.table() in doc
