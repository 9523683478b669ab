"""DualPipe's and Chimera's all-sizes laws (``proofs.family_bidirectional``) reason about
the package's plans, and they can fail.

- Through the twin reduction, DualPipeV's word on ``p/2`` ranks (``m/2`` microbatches) is
  DualPipe's programs, and Chimera's unit word (``proofs.family_chimera.model``) is
  Chimera's, op for op, for every even ``p <= 8``, ``m <= 24``; the placement is the one
  the reduction states; the lowered plan ends with exactly the replica tail the laws
  state, and its stated peaks are the measured ones.
- A wrong peak, a clock whose units overlap, or a twin that puts pipeline 1 on the wrong
  ranks makes Z3 find a counterexample.
- The laws cover exactly the families' instances and answer ``check --family``.
"""

from __future__ import annotations

import json

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.ir import Collective
from mpipe_verified.lower import lower
from mpipe_verified.proofs import (core, covering, expanded, family_bidirectional,
                                   family_chimera, family_dualpipev)
from mpipe_verified.semantics import peak_memory

FB = family_bidirectional
SIZES = {"dualpipe": lambda p: range(2 * p, 25, 2), "chimera": lambda p: range(p, 25, p)}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """An empty law-proof cache of this test's own: the laws are proven here."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


WORDS = {"dualpipe": family_dualpipev.model, "chimera": family_chimera.model}


@pytest.mark.parametrize("name", ["dualpipe", "chimera"])
def test_the_twin_of_the_v_word_is_the_package_op_for_op(name):
    for p in (2, 4, 6, 8):
        for m in SIZES[name](p):
            derived = family(name, p, m).derive()
            assert FB.twin(p, m, WORDS[name]) == derived.programs, (p, m)
            owners = derived.placement.stage_to_rank
            assert owners == tuple(range(p)) + tuple(range(p - 1, -1, -1)), (p, m)


@pytest.mark.parametrize("name", ["dualpipe", "chimera"])
def test_the_lowered_plan_ends_with_the_stated_tail_and_reaches_the_stated_peaks(name):
    for p in (2, 4, 6):
        for m in list(SIZES[name](p))[:3]:
            plan = lower(family(name, p, m).derive())
            peaks = peak_memory(plan)
            for r, prog in enumerate(plan.programs):
                h = min(r, p - 1 - r)
                tail = [op for op in prog if type(op) is Collective]
                assert prog[-2:] == tuple(tail), (p, m, r)
                assert [(op.tag, op.ranks) for op in tail] == [
                    (f"replica:{j}", (h, p - 1 - h)) for j in (h, p - 1 - h)]
                assert peaks[r][0] == FB.peak_of(name, p, r), (p, m, r)


@pytest.mark.parametrize("name", ["dualpipe", "chimera"])
def test_lower_is_the_lowering_model_then_the_tail(name):
    """What ``proofs.lowered`` reasons about (each rank's events in key order, the body's
    transfers inside their pipeline) and then the replica tail is ``lower``'s plan."""
    for p in (2, 4, 6, 8):
        sizes = list(SIZES[name](p))[:4]
        assert sizes, (name, p)
        for m in sizes:
            schedule = family(name, p, m).derive()
            body, plan = expanded.lowered(schedule), lower(schedule).programs
            assert len(plan) == len(body) == p and all(
                prog[:len(mine)] == mine and len(prog) == len(mine) + 2
                for prog, mine in zip(plan, body)), (p, m)


def _status(law_) -> str:
    """The law's verdict, checked in a forked process. That every shipped law is proved
    is tests/test_proofs.py's check, in a fresh ``mpipe-verify laws`` process: Z3's step
    counts depend on the terms a process made before, so this suite's process is no place
    to expect ``proved`` within the budget."""
    return core.run_all([law_], jobs=1)[0].status


def test_a_wrong_peak_fails(monkeypatch):
    """One less than the peak (Chimera: n + h; DualPipe: 2n, DualPipeV's on n ranks)."""
    monkeypatch.setattr(family_chimera, "PEAK", family_chimera.n + family_chimera.h)
    assert _status(FB.chimera_memory) == core.FAILED
    monkeypatch.setattr(family_dualpipev, "PEAK", 2 * family_dualpipev.p)
    assert _status(FB.dualpipe_memory) == core.FAILED


def test_a_clock_whose_units_overlap_fails(monkeypatch):
    """Unit u's clock span one short: virtual rank 0's last B0 meets the next unit's F0."""
    monkeypatch.setattr(family_chimera, "SPAN", 6 * family_chimera.n - 3)
    assert _status(FB.chimera_dependency) == core.FAILED


def test_a_twin_with_pipeline_1_on_the_wrong_ranks_fails(monkeypatch):
    """Pipeline 1's model stage d on rank d (not p-1-d): both pipelines on one rank per
    stage, no mirror, and the reduction's obligations say so."""
    monkeypatch.setattr(FB, "owner", lambda pipe, d: d)
    assert _status(FB.chimera_completeness) == core.FAILED


@pytest.mark.parametrize("name, good, bad", [
    ("dualpipe", [(2, 4), (4, 8), (1024, 2048), (8, 30)], [(3, 6), (4, 6), (4, 9)]),
    ("chimera", [(2, 2), (4, 8), (1024, 4096)], [(3, 6), (4, 6), (5, 5)])])
def test_the_laws_cover_exactly_the_family_s_instances(name, good, bad):
    for p, m in good:
        laws = covering.needed_laws(name, {"pp": p, "microbatches": m, "chunks": None})
        assert laws is not None and [law.family for law in laws] == [name] * 5, (p, m)
        peaks = covering.memory_law(laws).peak({"pp": p, "microbatches": m})
        assert peaks == tuple(FB.peak_of(name, p, r) for r in range(p))
    for p, m in bad:
        assert covering.needed_laws(name, {"pp": p, "microbatches": m,
                                           "chunks": None}) is None, (p, m)


@pytest.mark.parametrize("name, p, m", [("dualpipe", 4, 12), ("chimera", 6, 12)])
def test_check_family_is_answered_by_the_laws_as_the_op_by_op_check(capsys, name, p, m):
    argv = ["check", "--family", name, "--pp", str(p), "--microbatches", str(m), "--json"]
    assert main([*argv, "--laws"]) == 0
    proof = json.loads(capsys.readouterr().out)
    assert main([*argv, "--expand"]) == 0
    expanded = json.loads(capsys.readouterr().out)
    assert proof["proof"]["kind"] == "parametric" and expanded["proof"] == {"kind": "instance"}
    assert proof["proof"]["laws"] == [f"{name}_{prop}" for prop in (
        "completeness", "dependency", "matching", "deadlock", "memory")]
    assert proof["peak_memory"] == expanded["peak_memory"]


def test_a_parametric_certificate_of_dualpipe_is_rechecked(tmp_path, capsys):
    cert, plan = str(tmp_path / "c.json"), str(tmp_path / "p.json")
    argv = ["--family", "dualpipe", "--pp", "4", "--microbatches", "8"]
    assert main(["check", *argv, "--laws", "-q", "--certificate-out", cert]) == 0
    assert main(["export", *argv, "--to", "plan-json", "-o", plan]) == 0
    capsys.readouterr()
    assert main(["recheck", plan, cert]) == 0



@pytest.mark.parametrize("name, m, first, middle", [("dualpipe", 2048, 1025, 1025),
                                                     ("chimera", 4096, 513, 1024)])
def test_1024_ranks_are_answered_by_the_laws(capsys, name, m, first, middle):
    assert main(["check", "--family", name, "--pp", "1024", "--microbatches", str(m),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["proof"]["kind"] == "parametric"
    assert doc["peak_memory"]["0"] == doc["peak_memory"]["1023"] == first
    assert doc["peak_memory"]["511"] == middle
