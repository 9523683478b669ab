"""``check --family seq1f1b`` (and a spec naming seq1f1b) answered by seq1f1b's all-sizes
laws (``check.parametric``; the laws: tests/test_proofs_seq1f1b.py): the parameters carry
``seq_chunks`` (``microbatches`` counts samples), the answer agrees with the op-by-op
check, a big instance costs what a small one does, a memory limit below the proven peak
is checked op by op, and a parametric certificate certifies only the plan its parameters
derive (its sequence chunks included)."""

from __future__ import annotations

import json
import subprocess

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.check import parametric
from mpipe_verified.check.parametric import check_certificate
from mpipe_verified.check.policy import family_params
from mpipe_verified.cli import main
from mpipe_verified.lower import lower
from mpipe_verified.proofs import registry
from mpipe_verified.verify import CertificateError
from test_check_parametric import SCRIPT
from test_cli_check import check_json as check

LAWS = ["seq1f1b_completeness", "seq1f1b_dependency", "seq1f1b_matching", "seq1f1b_deadlock",
        "seq1f1b_peak_memory"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """An empty law-proof cache of its own (``XDG_CACHE_HOME``) for each test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def argv(p, m, s):
    return ["--family", "seq1f1b", "--pp", str(p), "--microbatches", str(m), "--seq-chunks",
            str(s)]


def test_the_parameters_carry_the_sequence_chunks():
    params = family_params("seq1f1b", 4, 6, None, term=family("seq1f1b", 4, 6, seq_chunks=3))
    assert params == {"pp": 4, "microbatches": 6, "chunks": None, "seq_chunks": 3}
    # the road counts the plan's microbatches: m samples of S chunks
    assert parametric.estimated_ops("seq1f1b", params) == parametric.estimated_ops(
        "1f1b", {"pp": 4, "microbatches": 18, "chunks": None})


@pytest.mark.parametrize("p, m, s", [(4, 3, 2), (3, 2, 3), (5, 1, 4), (2, 4, 1)])
def test_the_laws_answer_as_the_op_by_op_check_does(capsys, p, m, s):
    code, proof = check(capsys, *argv(p, m, s), "--laws")
    expanded_code, expanded = check(capsys, *argv(p, m, s), "--expand")
    assert code == expanded_code == 0
    assert proof["proof"]["kind"] == "parametric" and expanded["proof"] == {"kind": "instance"}
    assert proof["proof"]["laws"] == LAWS
    assert proof["proof"]["params"] == {"pp": p, "microbatches": m, "chunks": None,
                                        "seq_chunks": s}
    assert {registry.BY_NAME[n].property for n in LAWS} == set(proof["stats"]["properties"])
    assert proof["peak_memory"] == expanded["peak_memory"]  # the formula = the verifier's


def test_the_summary_counts_the_plans_microbatches_as_the_op_by_op_check_does(capsys):
    """The verdict line names m S microbatches on both roads (not m samples)."""
    lines = []
    for road in ("--laws", "--expand"):
        assert main(["check", *argv(3, 2, 3), road]) == 0
        lines.append(capsys.readouterr().out.splitlines()[0])
    assert all("(3 ranks, 6 microbatches, " in line for line in lines), lines


def test_1024_ranks_are_answered_by_the_laws():
    proc = subprocess.run([str(SCRIPT), "check", *argv(1024, 4096, 2), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["proof"]["kind"] == "parametric" and doc["proof"]["laws"] == LAWS
    # rank r: its warmup p - r + S - 2 plus one
    assert doc["peak_memory"]["0"] == 1024 + 1 and doc["peak_memory"]["1023"] == 2


def test_a_memory_limit_below_the_proven_peak_is_checked_op_by_op(capsys):
    code, doc = check(capsys, *argv(4, 4, 2), "--memory-limit", "5", "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"
    code, doc = check(capsys, *argv(4, 4, 2), "--memory-limit", "4", "--laws")
    assert code == 1 and doc["proof"] == {"kind": "instance"}
    assert [v["property"] for v in doc["violations"]] == ["memory"]
    assert doc["violations"][0]["ranks"] == [0]


def test_a_spec_naming_seq1f1b_is_answered_by_its_laws(capsys, tmp_path):
    expression = tmp_path / "e.toml"
    expression.write_text('[schedule]\nexpression = "seq1f1b(4, 6, seq_chunks=2)"\n')
    table = tmp_path / "t.toml"
    table.write_text('[schedule]\nfamily = "seq1f1b"\npp = 4\nmicrobatches = 6\n'
                     'seq_chunks = 3\n')
    for spec, s in ((expression, 2), (table, 3)):
        code, doc = check(capsys, str(spec), "--laws")
        assert code == 0 and doc["proof"]["kind"] == "parametric", spec
        assert doc["proof"]["params"] == {"pp": 4, "microbatches": 6, "chunks": None,
                                          "seq_chunks": s}


def test_a_certificate_certifies_only_the_plan_of_its_sequence_chunks():
    cert = parametric.prove("seq1f1b", {"pp": 3, "microbatches": 2, "chunks": None,
                                        "seq_chunks": 3}).certificate
    check_certificate(lower(family("seq1f1b", 3, 2, seq_chunks=3).derive()), cert)
    for other, why in ((family("seq1f1b", 3, 2, seq_chunks=2), "seq_chunks=3 is not"),
                       (family("seq1f1b", 3, 3, seq_chunks=3), "microbatches=2"),
                       (family("1f1b", 3, 6), "seq_chunks=3 is not")):
        with pytest.raises(CertificateError, match=why):
            check_certificate(lower(other.derive()), cert)


def test_recheck_of_a_seq1f1b_certificate(tmp_path, capsys):
    cert, good, bad = (str(tmp_path / n) for n in ("c.json", "good.json", "bad.json"))
    assert main(["check", *argv(3, 2, 3), "--certificate-out", cert, "-q", "--laws"]) == 0
    assert main(["export", *argv(3, 2, 3), "--to", "plan-json", "-o", good]) == 0
    assert main(["export", *argv(3, 3, 2), "--to", "plan-json", "-o", bad]) == 0
    capsys.readouterr()
    assert main(["recheck", good, cert]) == 0
    assert "PROVEN" in capsys.readouterr().out
    assert main(["recheck", bad, cert]) == 3  # 6 microbatches either way, S differs
    assert "seq_chunks=3 is not the plan's seq_chunks=2" in capsys.readouterr().out
