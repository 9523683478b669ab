"""A cut segment folded into model stage 0 (``cost.Fold``): how ``simulate --compare``
runs a transpose spec's model on the families that cannot carry a cut (several
pipelines, sequence chunks). The folded costs are the inline transpose's: on a family
that can do both, folded and inline give the same run."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from mpipe_verified.algebra import families
from mpipe_verified.cli import main
from mpipe_verified.comparison import baseline_spec, on_body, time_spec
from mpipe_verified.cost import CostModel, Fold, SegmentCost
from mpipe_verified.formats.spec import load_spec
from mpipe_verified.ir import (BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD, Compute,
                               Placement)
from mpipe_verified.spec import Spec

MLLM = Path(__file__).resolve().parent.parent / "examples" / "mllm_transpose.toml"
FOLDING = ("dualpipe", "chimera", "bitpipe", "seq1f1b")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_ranks_every_family_on_the_mllm_example_with_no_skip(capsys):
    code, out, _ = run(capsys, "simulate", str(MLLM), "--compare", "dualpipe", "chimera",
                       "zbv", "seq1f1b")
    assert code == 0 and "skipped" not in out
    ranked = out.split("ranked by makespan: ", 1)[1]
    assert all(f"{fam} " in ranked for fam in ("this spec", "dualpipe", "chimera", "zbv",
                                               "seq1f1b"))
    assert ("  (dualpipe, chimera, seq1f1b: the segment 'vision' folded into model stage 0, "
            "as these families cannot carry a cut segment)\n") in out
    code, out, _ = run(capsys, "simulate", str(MLLM), "--compare", "dualpipe", "chimera",
                       "zbv", "seq1f1b", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["inline_segment"] == "vision"
    for fam, entry in doc["compare"].items():
        assert entry["status"] == "verified" and entry["makespan"] > doc["makespan"]
        assert entry.get("folded_segment") == (None if fam == "zbv" else "vision")


def _folded(spec: Spec, body) -> Spec:
    """``body`` bare, with ``spec``'s segment folded into its stage 0 of the model the
    inline baseline runs (``on_body`` folds only on bodies that cannot carry a cut)."""
    model = on_body(spec, body, "inline", ownership="inline").cost
    derived = body.derive()
    cost = model.folded(spec.term.segment, spec.term.trainable, derived.placement, 1)
    return Spec(body, derived, cost, spec.memory_limit, "folded")


@pytest.mark.parametrize("mode", ["owner", "recompute", "frozen"])
@pytest.mark.parametrize("family", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_the_folded_segment_costs_what_the_inline_transpose_costs(mode, family):
    """1F1B and ZB-H1 with the encoder folded into stage 0 run exactly as with the
    encoder inline on rank 0 (the same makespan and peak memory per rank), in every
    mode. Interleaved 1F1B folded ends one body transfer later (latency 0.03 + 3.36e7
    bytes at 1e8 per ms = 0.366): the lowering posts rank 0's receive of stage 8's input
    after the op before it, and with the encoder an op of its own that receive is posted
    before the encoder's forward and overlaps it; folded, it waits for the fused op."""
    spec = load_spec(MLLM)
    spec = attrs.evolve(spec, term=attrs.evolve(spec.term, mode=mode))
    body = families.family(family, 8, 16, 2 if family == "interleaved-1f1b" else None)
    inline = time_spec(on_body(spec, body, "inline", ownership="inline"))
    folded = time_spec(_folded(spec, body))
    assert inline.report.verified and folded.report.verified
    extra = 0.03 + 3.36e7 / 1.0e8 if family == "interleaved-1f1b" else 0.0
    assert folded.run.makespan == pytest.approx(inline.run.makespan + extra)
    assert folded.run.peak_memory == pytest.approx(inline.run.peak_memory)
    assert folded.run.busy == pytest.approx(inline.run.busy)


def test_a_fold_adds_the_segments_inline_costs_to_stage_0():
    seg = SegmentCost(F=(1.0, 2.0), B=(3.0, 5.0), activation=0.5, static=4.0)
    cost = CostModel(segments=(("enc", seg),), static=1.0)
    fold = attrs.evolve(cost, fold=Fold("enc", (0, 4), True))
    assert [fold.compute_time(Compute(k, 0, 1)) for k in
            (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE)] == [3.0, 7.0, 3.5, 3.5, 3.0]
    assert fold.compute_time(Compute(FORWARD, 4, 0)) == 2.0  # a replica of stage 0
    assert fold.compute_time(Compute(BACKWARD, 1, 0)) == 2.0  # another stage: none
    frozen = attrs.evolve(cost, fold=Fold("enc", (0,), False))  # a forward, no backward
    assert [frozen.compute_time(Compute(k, 0, 1)) for k in (FORWARD, BACKWARD)] == [3.0, 2.0]
    chunked = attrs.evolve(fold.chunked(2), attention=0.0)  # sample = mb // 2, chunk 0 only
    assert [chunked.compute_time(Compute(FORWARD, 0, u)) for u in range(4)] == [
        1.5, 0.5, 2.5, 0.5]


def test_folded_sizes_are_in_the_cost_tables_the_verifier_reads():
    """``CostModel.folded``: the activation kept on each stage-0 replica (a chunk's share
    with sequence chunks; none when frozen) and a parameter copy on each rank holding
    one."""
    seg = SegmentCost(activation=0.5, static=4.0)
    cost = CostModel(segments=(("enc", seg),), static=1.0)
    two = Placement((0, 1, 1, 0), 2)  # stage 2 (a replica of stage 0) on rank 1
    fold = cost.folded("enc", True, two, 2)
    assert fold.fold == Fold("enc", (0, 2), True)
    assert (fold.activation, fold.static) == ((1.5, 1.0, 1.5, 1.0), (5.0, 5.0))
    one = Placement((0, 1), 2)
    assert cost.chunked(2).folded("enc", True, one, 1).activation == (0.75, 0.5)
    assert cost.folded("enc", False, one, 1).activation == (1.0, 1.0)


def test_several_pipelines_carry_the_segment_on_every_replica_of_stage_0():
    """DualPipe: stage 0 and its replica sit on the first and last rank; each holds one
    copy of the encoder's parameters, runs the encoder for its own pipeline's samples,
    and the ``replica:0`` all-reduce sums the encoder's gradients too."""
    spec = load_spec(MLLM)
    base = baseline_spec(spec, "dualpipe")
    fold, placement = base.cost.fold, base.schedule.placement
    assert fold == Fold("vision", (0, 8), True)
    assert {placement.stage_to_rank[s] for s in fold.stages} == {0, 7}
    assert base.cost.static == (24.1 + 5.5, *(17.3,) * 6, 24.1 + 5.5)
    replicas = {op.tag: op for prog in time_spec(base).plan.programs for op in prog
                if getattr(op, "tag", "").startswith("replica:")}
    comm = base.cost.comm_cost()
    assert comm.collective_bytes(replicas["replica:0"]) == 6.0e8  # the encoder's gradients
    assert comm.collective_bytes(replicas["replica:1"]) == 0.0  # no stage weights declared


@pytest.mark.parametrize("family", FOLDING)
def test_the_simulated_peak_of_a_folded_model_is_the_verified_peak(family):
    timed = time_spec(baseline_spec(load_spec(MLLM), family))
    assert timed.report.verified
    assert {int(r): v for r, v in timed.report.peak_memory.items()} == pytest.approx(
        timed.run.peak_memory)
