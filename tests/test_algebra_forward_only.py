"""Forward-only (evaluation) plans: the term, the declaration, and the verifier's verdict
on it, in the fast passes and in the kernel on its own.

A plan without backward work verifies only when it says it is forward-only; the same
programs undeclared are incomplete, and the kernel, given the declared plan's witness,
does not prove them. A declared plan that still holds backward work, or a gradient
all-reduce, is refused. Declaring changes the digest; plan-json carries the field.
"""

from __future__ import annotations

import attrs
import pytest

from mpipe_verified import kernel
from mpipe_verified.algebra import FAMILIES, ForwardOnly, Transpose, family
from mpipe_verified.cli import main
from mpipe_verified.errors import ParameterError
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json
from mpipe_verified.spec import parse_expression
from mpipe_verified.ir import FORWARD, Collective, Compute
from mpipe_verified.lower import lower
from mpipe_verified.verify import verify
from mpipe_verified.verify.report import plan_digest


def _eval_plan(name: str, pp: int = 3) -> object:
    return lower(family(name, pp, 6 if name != "dualpipev" else 2 * pp,
                        forward_only=True).derive())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_declared_forward_only_verifies_and_undeclared_is_rejected_by_the_kernel(name):
    plan = _eval_plan(name)
    ops = [c for prog in plan.programs for op in prog for c in getattr(op, "ops", (op,))
           if isinstance(c, Compute)]
    assert ops and all(c.kind == FORWARD for c in ops)
    report = verify(plan)
    assert report.verified, [v.message for v in report.violations][:3]
    assert set(report.peak_memory.values()) == {0}  # a forward stores nothing
    ok, reasons = kernel.recheck(plan, report.portable_certificate(plan))
    assert ok, reasons

    undeclared = attrs.evolve(plan, forward_only=False)
    assert plan_digest(undeclared) != plan_digest(plan)
    bad = verify(undeclared)  # findings are reported only once the kernel confirms them
    assert bad.status == "violated"
    messages = [v.message for v in bad.violations if v.property == "completeness"]
    assert any("never runs" in m and "needs B, or I then W" in m for m in messages), messages
    verdicts = kernel.prove(undeclared, report.witness, sizes=report.sizes)
    assert verdicts["completeness"].status == "failed"
    assert verdicts["memory"].status == "failed"  # undeclared, every F stores a unit


def test_a_declared_plan_with_backward_work_left_in_is_refused():
    train = lower(family("1f1b", 2, 4).derive())
    declared = attrs.evolve(train, forward_only=True)
    report = verify(declared)
    assert report.status == "violated"
    assert any("declared forward-only" in v.message for v in report.violations
               if v.property == "completeness")
    witness = verify(train).witness
    assert kernel.prove(declared, witness)["completeness"].status == "failed"


@pytest.mark.parametrize("mode", ("recompute", "owner", "frozen"))
def test_forward_only_transpose_keeps_forwards_and_broadcast_drops_the_rest(mode):
    term = Transpose(family("1f1b", 2, 4), mode=mode, ownership="full")
    train, evaluation = term.derive(), ForwardOnly(term).derive()
    assert evaluation.forward_only and evaluation.cut == train.cut
    kept = [[op for op in prog if not isinstance(op, Compute) or op.kind == FORWARD]
            for prog in train.programs]
    tags = {op.tag for prog in kept for op in prog if isinstance(op, Collective)}
    want = [[op for op in prog if not (isinstance(op, Collective) and op.tag.startswith("grads:"))]
            for prog in kept]
    assert [list(p) for p in evaluation.programs] == want
    assert (mode == "owner") == ("grads:vision" in tags)
    plan = lower(evaluation)
    assert not any(op.payload.kind in ("grad", "input") for prog in plan.programs
                   for op in prog if hasattr(op, "payload"))
    report = verify(plan)
    assert report.verified, [v.message for v in report.violations][:3]
    if mode == "owner":  # an all-reduce of gradients put back is not required: refused
        ar = Collective("all_reduce", (0, 1), "grads:vision")
        back = attrs.evolve(plan, programs=tuple(prog + (ar,) for prog in plan.programs))
        assert verify(back).status == "violated"


def test_forward_only_is_a_term_of_the_expression_language_and_of_plan_json(tmp_path, capsys):
    term = family("zb-h1", 2, 4, forward_only=True)
    assert parse_expression(str(term)) == term == ForwardOnly(family("zb-h1", 2, 4))
    plan = lower(term.derive())
    text = format_plan_json(plan)
    assert '"forward_only": true' in text
    assert parse_plan_json(text, "x.json") == plan
    assert '"forward_only"' not in format_plan_json(attrs.evolve(plan, forward_only=False))
    path = tmp_path / "eval.json"
    path.write_text(text)
    assert main(["check", str(path)]) == 0
    out = tmp_path / "eval.csv"
    capsys.readouterr()
    assert main(["export", str(path), "--to", "torch-csv", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "forward-only" in err[0] and not out.exists(), err
    path.write_text(text.replace('"forward_only": true', '"forward_only": 1'))
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.json" in err[0] and "forward_only" in err[0], err


def test_forward_only_applies_once_and_before_nothing_that_needs_a_backward():
    with pytest.raises(ParameterError, match="forward-only already"):
        ForwardOnly(family("1f1b", 2, 2, forward_only=True)).derive()
    with pytest.raises(ParameterError, match="take forward_only of the transposed term"):
        Transpose(family("1f1b", 2, 2, forward_only=True)).derive()
