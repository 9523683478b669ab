"""The seq1f1b family and ``--seq-chunks`` on the command line: Seq1F1B's per-rank orders
(tests/fixtures/orders/seq1f1b.json, with their source and commit) exported cell for cell,
files read as sequence chunks, and bad chunk counts refused (exit 2)."""

from __future__ import annotations

import json
import pathlib

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json
from mpipe_verified.formats.spec import parse_spec
from mpipe_verified.lower import lower
from mpipe_verified.spec import parse_expression
from mpipe_verified.verify import verify

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "orders" / "seq1f1b.json"
CASES = json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"p{c['pp']}m{c['microbatches']}"
                                                      f"s{c['seq_chunks']}")
def test_export_equals_seq1f1b_cell_for_cell(case, tmp_path, capsys):
    out = tmp_path / "seq.csv"
    code = main(["export", "--family", "seq1f1b", "--pp", str(case["pp"]), "--microbatches",
                 str(case["microbatches"]), "--seq-chunks", str(case["seq_chunks"]),
                 "--to", "torch-csv", "--compute-only", "-o", str(out)])
    assert code == 0
    assert out.read_text().splitlines() == case["rows"]
    assert main(["check", str(out), "--seq-chunks", str(case["seq_chunks"]), "-q"]) == 0


def test_check_refuses_a_chunk_before_its_predecessor(tmp_path, capsys):
    """1F1B's order read as two chunks per sample runs a chunk's backward before the next
    chunk's: exit 1, dependency, the cell named; as plain microbatches it verifies."""
    csv = tmp_path / "o.csv"
    csv.write_text("0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n")
    assert main(["check", str(csv), "-q"]) == 0
    assert main(["check", str(csv), "--seq-chunks", "2"]) == 1
    out = capsys.readouterr().out
    assert f"{csv}:1:3: dependency: rank 0 position 5: 0B0 (chunk 0 of sample 0) runs " \
           "before the backward of chunk 1" in out
    csv.write_text("0F1,0F0,0B1,0B0\n")
    assert main(["check", str(csv), "--seq-chunks", "2"]) == 1
    assert f"{csv}:1:1: dependency: rank 0 position 0: 0F1 (chunk 1 of sample 0) runs before " \
           "the forward of chunk 0" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--seq-chunks", "3"], "--seq-chunks 3 does not divide the 4 microbatches"),
    (["--seq-chunks", "0"], "--seq-chunks must be an integer from 1 to 1,000,000, got 0"),
    (["--seq-chunks", "-2"], "--seq-chunks must be an integer from 1 to 1,000,000, got -2")])
def test_a_bad_chunk_count_is_bad_input(args, message, tmp_path, capsys):
    csv = tmp_path / "o.csv"
    csv.write_text("0F0,0F1,0F2,0F3,0B1,0B0,0B3,0B2\n")
    for command in (["check", str(csv)], ["show", str(csv)], ["simulate", str(csv)],
                    ["export", str(csv), "--to", "plan-json"], ["diff", str(csv), str(csv)]):
        assert main(command + args) == 2, command
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["check", "--family", "seq1f1b", "--pp", "2", "--microbatches", "2"] + args[:1]
                + ["0"]) == 2
    assert main(["check", "--family", "1f1b", "--pp", "2", "--microbatches", "2",
                 "--seq-chunks", "2"]) == 2
    assert "1f1b takes no --seq-chunks" in capsys.readouterr().err


def test_seq_chunks_reach_the_family_through_every_command(tmp_path, capsys):
    family_args = ["--family", "seq1f1b", "--pp", "4", "--microbatches", "4", "--seq-chunks",
                   "2"]
    for command in (["check", "-q"], ["show"], ["simulate"],
                    ["export", "--to", "plan-json", "-o", str(tmp_path / "p.json")]):
        assert main(command[:1] + family_args + command[1:]) == 0, command
    plan = parse_plan_json((tmp_path / "p.json").read_text(), "p.json")
    assert plan.seq_chunks == 2 and plan.num_microbatches == 8
    assert main(["recheck", str(tmp_path / "p.json"), str(tmp_path / "none.json")]) == 2


def test_plan_json_carries_seq_chunks(tmp_path, capsys):
    plan = lower(family("seq1f1b", 3, 2, seq_chunks=3).derive())
    text = format_plan_json(plan)
    assert '"seq_chunks": 3' in text and parse_plan_json(text, "x.json") == plan
    plain = lower(family("1f1b", 3, 2).derive())
    assert "seq_chunks" not in format_plan_json(plain)
    (tmp_path / "p.json").write_text(text)
    assert main(["check", str(tmp_path / "p.json"), "--seq-chunks", "3", "-q"]) == 0
    assert main(["check", str(tmp_path / "p.json"), "--seq-chunks", "2"]) == 2
    bad = text.replace('"seq_chunks": 3', '"seq_chunks": 4')
    with pytest.raises(Exception, match=r"\$\.seq_chunks: seq_chunks=4 does not divide"):
        parse_plan_json(bad, "x.json")


def test_the_spec_and_the_expression_take_seq_chunks():
    spec = parse_spec('[schedule]\nfamily = "seq1f1b"\npp = 2\nmicrobatches = 3\n'
                      'seq_chunks = 3\n', "s.toml")
    assert spec.schedule.seq_chunks == 3 and spec.schedule.num_microbatches == 9
    assert verify(lower(spec.schedule)).status == "verified"
    term = family("seq1f1b", 2, 3, seq_chunks=3)
    assert parse_expression(str(term)) == term
    assert parse_expression("seq1f1b(pp=2, microbatches=3, seq_chunks=3)") == term


def test_the_executor_takes_a_plan_of_sequence_chunks():
    """The executor runs sequence chunks (it refused them before; tests/test_executor_seq.py
    runs them against one process): a certified plan of chunks builds an executor."""
    torch = pytest.importorskip("torch")
    from mpipe_verified.executor import PipelineExecutor, certify
    plan = lower(family("seq1f1b", 1, 1).derive())
    ex = PipelineExecutor(plan, certify(plan), stages={0: torch.nn.Linear(2, 2)},
                          loss_fn=lambda out, target: out.sum(), rank=0)
    assert ex.plan.seq_chunks == 2


def test_the_executor_refuses_sequence_chunks_over_several_pipelines():
    """No family makes such a plan (the algebra refuses the pair), but a plan-json file can
    carry both: the executor says it runs either dimension, never a wrong mix."""
    pytest.importorskip("torch")
    import attrs
    from mpipe_verified.executor.errors import PipelineError
    from mpipe_verified.executor.model_checks import check_model
    plan = attrs.evolve(lower(family("dualpipe", 2, 4).derive()), seq_chunks=2)
    with pytest.raises(PipelineError, match="not both together"):
        check_model(plan, [], {})
