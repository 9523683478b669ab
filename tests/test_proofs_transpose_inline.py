"""Transpose with inline ownership over a 1F1B body, proven for all sizes
(``proofs.family_transpose_inline``): the model the laws reason about is what ``derive``
and ``lower`` give, the inputs it checks at the cut are the semantics', the laws can fail,
and ``check --family transpose --ownership inline`` is answered by them at any size."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import attrs
import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.algebra.transpose import transpose_family
from mpipe_verified.ir import Compute
from mpipe_verified.lower import lower
from mpipe_verified.proofs import core, expanded, registry
from mpipe_verified.proofs import family_transpose_inline as inline
from mpipe_verified.semantics import Chain, peak_memory, produces
from mpipe_verified.check import parametric
from mpipe_verified.check.parametric import check_certificate
from mpipe_verified.verify import CertificateError
from test_cli_check import check_json as _check

SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")
LAWS = [law for law in registry.LAWS if law.name.startswith("transpose_inline_")]


def _triples(schedule):
    out = []
    for prog in schedule.programs:
        assert all(isinstance(op, Compute) for op in prog)  # no collective, no idle step
        out.append(tuple((c.kind, c.stage, c.mb, c.segment) for c in prog))
    return tuple(out)


def test_the_model_is_derive_and_lower_op_for_op():
    """For every p <= 8, m <= 24 and mode: the model's programs are ``derive``'s, the cut
    keeps every segment op on rank 0 and requires no collective, and the lowering model
    the matching and deadlock laws reason about is ``lower``."""
    for mode in inline.MODES:
        trainable = mode in inline.TRAINABLE
        for p in range(1, 9):
            for m in range(1, 25):
                schedule = transpose_family(p, m, mode=mode, ownership="inline").derive()
                assert _triples(schedule) == inline.programs(p, m, mode), (mode, p, m)
                (seg,) = schedule.cut.segments
                assert seg.forward_rank == (0,) * m and seg.home == 0
                assert seg.backward_rank == ((0,) * m if trainable else None)
                assert Chain(schedule.placement, schedule.cut).required_collectives() == {}
                assert expanded.lowered(schedule) == lower(schedule).programs, (mode, p, m)


@pytest.mark.parametrize("mode", ["owner", "frozen"])
def test_the_inputs_checked_at_the_cut_are_the_semantics(mode):
    """Every input of a segment op, or that the body's first forward takes from the
    segment, is one the dependency law checks (``SEGMENT_EDGES``), and each stated edge
    is one the semantics asks for."""
    plan = lower(transpose_family(3, 4, mode=mode, ownership="inline").derive())
    chain = Chain.of(plan)
    computes = [op for op in plan.programs[0] if isinstance(op, Compute)]
    part = lambda c: ("F" if c.kind == "F" else "B", inline.SEG if c.segment else inline.BODY)
    wanted = set()
    for c in computes:
        for token in chain.needs(c, 0):
            for maker in computes:
                if token in produces(maker) and inline.SEG in (part(maker)[1], part(c)[1]):
                    wanted.add((part(maker), part(c)))
    code = {inline.F: "F", inline.B: "B"}
    stated = {((code[ka], pa), (code[kb], pb)) for (ka, pa), (kb, pb) in inline.SEGMENT_EDGES
              if mode in inline.TRAINABLE or (kb, pb) != (inline.B, inline.SEG)}  # no SB
    assert wanted == stated


@pytest.mark.parametrize("mode", inline.MODES)
def test_the_proven_peak_is_the_measured_one(mode):
    for p, m in ((1, 3), (4, 2), (4, 9), (7, 7)):
        plan = lower(transpose_family(p, m, mode=mode, ownership="inline").derive())
        params = {"pp": p, "microbatches": m, "mode": mode}
        assert inline.peaks(params) == tuple(peak_memory(plan)[r][0] for r in range(p))


def test_the_laws_fail_for_a_wrong_peak_or_a_missing_input(monkeypatch):
    right = inline.peak0
    for off in (-1, 1):  # too low: a step exceeds it; too high: it is never reached
        monkeypatch.setattr(inline, "peak0", lambda tt, p_, m_, off=off: right(tt, p_, m_) + off)
        assert core.check(inline.transpose_inline_memory).status == core.FAILED
    monkeypatch.setattr(inline, "peak0", right)
    # an input the other way round (F(0, x) feeding SF(x)) has no timing that respects it
    reversed_edge = ((inline.F, inline.BODY), (inline.F, inline.SEG))
    monkeypatch.setattr(inline, "SEGMENT_EDGES", inline.SEGMENT_EDGES + (reversed_edge,))
    assert core.check(inline.transpose_inline_dependency).status == core.FAILED


def test_the_laws_cover_every_property_for_all_sizes():
    """(``tests/test_proofs.py`` proves them, with every other law, in a fresh interpreter.)"""
    assert {law.property for law in LAWS} == set(core.PROPERTIES)
    assert all(law.family == "transpose" and law.for_all_sizes() for law in LAWS)


def _argv(mode, ownership="inline", p=3, m=5):
    return ["--family", "transpose", "--pp", str(p), "--microbatches", str(m), "--mode", mode,
            "--ownership", ownership]


@pytest.mark.parametrize("mode", inline.MODES)
def test_inline_is_answered_by_the_laws_as_the_op_by_op_check_does(capsys, mode):
    code, proof = _check(capsys, *_argv(mode), "--laws")  # small: op by op without it
    expanded_code, expanded = _check(capsys, *_argv(mode), "--expand")
    assert code == expanded_code == 0
    assert proof["proof"]["kind"] == "parametric" and expanded["proof"] == {"kind": "instance"}
    assert proof["proof"]["laws"] == [law.name for law in LAWS]
    assert proof["peak_memory"] == expanded["peak_memory"]


def test_other_ownerships_are_checked_op_by_op(capsys):
    for ownership in ("full", "min", "cost"):
        code, doc = _check(capsys, *_argv("owner", ownership))
        assert code == 0 and doc["proof"] == {"kind": "instance"}, ownership
    code, doc = _check(capsys, *_argv("owner"), "--body", "interleaved-1f1b")
    assert code == 0 and doc["proof"] == {"kind": "instance"}


def test_a_memory_limit_below_the_proven_peak_is_checked_op_by_op(capsys):
    code, doc = _check(capsys, *_argv("recompute", p=3, m=5), "--memory-limit", "5")
    assert code == 1 and doc["proof"] == {"kind": "instance"}
    assert doc["violations"][0]["property"] == "memory" and doc["violations"][0]["ranks"] == [0]


def test_a_transpose_certificate_is_refused_for_a_plan_its_parameters_do_not_derive():
    params = {"pp": 3, "microbatches": 5, "chunks": None, "body": "1f1b", "side": "source",
              "mode": "owner", "ownership": "inline"}
    cert = parametric.prove("transpose", params).certificate
    derive = lambda **kw: lower(transpose_family(3, 5, **{"mode": "owner",
                                                          "ownership": "inline", **kw}).derive())
    plan = derive()
    check_certificate(plan, cert)
    swapped = list(plan.programs[0])
    swapped[0], swapped[1] = swapped[1], swapped[0]  # F(0, 0) before its segment forward
    others = {"round-robin owners": derive(ownership="full"),
              "a frozen segment": derive(mode="frozen"),
              "central recompute": derive(mode="recompute"),
              "the body alone": lower(family("1f1b", 3, 5).derive()),
              "two ops swapped": attrs.evolve(plan, programs=(tuple(swapped),
                                                              *plan.programs[1:]))}
    for what, other in others.items():
        with pytest.raises(CertificateError, match="parametric certificate refused"):
            check_certificate(other, cert)


def test_1024_ranks_are_answered_by_the_laws():
    proc = subprocess.run([str(SCRIPT), "check", *_argv("recompute", p=1024, m=4096), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["proof"]["kind"] == "parametric"
    assert doc["peak_memory"]["0"] == 2 * 1024 and doc["peak_memory"]["1023"] == 1
