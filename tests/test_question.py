"""The trusted shell (``question.py``): the question is formed from the user's words and
the verdict comes from the kernel, so a bug in the code around them cannot make a broken
plan VERIFIED. Each test plants one such bug (as ``benchmarks/fault_injection.py`` does,
here with ``monkeypatch``) in code that the verdict used to trust: the limits, the sizes,
the lowering, the declarations; each of these gave a false VERIFIED before the shell."""

from __future__ import annotations

import json
import pathlib
from fractions import Fraction

import attrs

import pytest

from mpipe_verified import declared, lower as lowering
from mpipe_verified.cost import CostModel
from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.ir import Compute, Placement, Plan, Schedule
from mpipe_verified.lower import lower
from mpipe_verified.question import Asked, Question
from mpipe_verified.semantics import MemoryModel
from mpipe_verified.verify import passes, verify


def check(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["check", "--json", *argv])
    out, _ = capsys.readouterr()
    return code, json.loads(out)


def write_csv(tmp_path, rows: list[list[str]]) -> str:
    path = tmp_path / "plan.csv"
    path.write_text("".join(",".join(row) + "\r\n" for row in rows), newline="")
    return str(path)


def test_a_lowering_that_drops_a_duplicated_forward_is_refused(tmp_path, capsys, monkeypatch):
    """A compute-only file that runs 0F0 twice is broken (completeness). A lowering that
    drops the duplicate made it VERIFIED; the shell compares the lowered plan's compute
    steps with the file's and refuses it: undecided, never verified."""
    path = write_csv(tmp_path, [["0F0", "0F0", "0F1", "0B0", "0B1"],
                                ["1F0", "1B0", "1F1", "1B1"]])
    code, doc = check(capsys, path)
    assert code == 1 and doc["status"] == "violated"

    real = lowering.lower

    def dropping(schedule, duration=None):
        first = schedule.programs[0]
        kept = (first[0],) + first[2:]
        return real(Schedule(schedule.placement, schedule.num_microbatches,
                             (kept,) + schedule.programs[1:]), *(
                                 () if duration is None else (duration,)))
    monkeypatch.setattr(lowering, "lower", dropping)
    code, doc = check(capsys, path)
    assert code == 3 and doc["status"] == "undecided", doc
    assert any("rank 0's steps differ from the input's" in u for u in doc["undecided"])


def test_a_declaration_the_code_ignores_is_refused(tmp_path, capsys, monkeypatch):
    """``--microbatches 3`` on a file with two: the missing microbatch is a completeness
    violation. If ``declare`` ignored the count, the file's own plan was VERIFIED; the
    shell compares the plan's sizes with the declared ones."""
    path = write_csv(tmp_path, [["0F0", "0F1", "0B0", "0B1"],
                                ["1F0", "1B0", "1F1", "1B1"]])
    code, doc = check(capsys, path, "--microbatches", "3")
    assert code == 1 and doc["status"] == "violated"
    monkeypatch.setattr(declared, "declare", lambda target, *_, **__: target)
    code, doc = check(capsys, path, "--microbatches", "3")
    assert code == 3, doc
    assert any("2 microbatches judged, 3 declared" in u for u in doc["undecided"]), doc


def test_limits_from_the_question_not_from_the_passes(capsys, monkeypatch):
    """A memory pass that loses the limit finds nothing over it (before the shell, the
    untrusted code that formed the limits could drop it and the plan was VERIFIED): the
    kernel proves against the question's own limits, refutes the passes' witness, and
    the plan over its limit is undecided, never verified."""
    argv = ["--family", "1f1b", "--pp", "2", "--microbatches", "4", "--memory-limit", "1",
            "--expand"]
    code, doc = check(capsys, *argv)
    assert code == 1 and doc["status"] == "violated"
    real = passes.memory
    monkeypatch.setattr(passes, "memory",
                        lambda plan, model, limits, table=None: real(plan, model, None, table))
    code, doc = check(capsys, *argv)
    assert code == 3 and doc["status"] == "undecided", doc


SPEC = """
[schedule]
family = "1f1b"
pp = 2
microbatches = 4

[cost]
activation = [0.5, 0.25]

[memory]
limit = 2.4
static = [1.0, 2.0]
"""


def test_sizes_from_the_spec_numbers_not_from_its_cost_model(tmp_path, capsys, monkeypatch):
    """The spec's own numbers give the sizes: rank 0 peaks at 1 + 2 x 0.5 = 2 and rank
    1 at 2 + 0.25 = 2.25, both within 2.4; with a limit of 2.2 rank 1 is over. A cost
    model that reported the unit model instead (all static parts 0) made the second
    VERIFIED; the shell turns the spec's numbers into sizes itself."""
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    code, doc = check(capsys, str(spec), "--expand")
    assert code == 0, doc
    assert doc["peak_memory"] == {"0": 2.0, "1": 2.25}
    code, doc = check(capsys, str(spec), "--expand", "--memory-limit", "2.2")
    assert code == 1
    monkeypatch.setattr(CostModel, "memory_model_for",
                        lambda self, cut, ranks: MemoryModel())
    code, doc = check(capsys, str(spec), "--expand", "--memory-limit", "2.2")
    assert code == 1 and doc["status"] == "violated", doc


def test_spec_sizes_are_exact_sums_of_the_numbers_written():
    """0.1 + 0.2 is summed as the two rationals the spec's floats denote, not as floats."""
    schedule = family("1f1b", 2, 2).derive()
    plan = lower(schedule)
    cost = CostModel(static=(0.1, 0.2))
    sizes = Question(memory=cost).sizes(plan)
    assert sizes.static == (Fraction(0.1), Fraction(0.2))
    assert Question().sizes(plan).static == (0, 0)


def test_the_report_status_is_the_kernels_verdict():
    """The printed status, exit code and digest are the shell's ``Verdict``; a plan whose
    passes found nothing but which is not the question's is never verified."""
    schedule = family("1f1b", 2, 2).derive()
    plan = lower(schedule)
    report = verify(plan, question=Question(source=schedule))
    assert report.status == report.verdict.status == "verified"
    assert report.exit_code == 0 and report.verdict.digest == report.certificate.digest
    other = family("gpipe", 2, 2).derive()
    report = verify(plan, question=Question(source=other))
    assert report.status == "undecided" and report.exit_code == 3
    assert report.certificate is None and report.to_json()["digest"] == report.verdict.digest


def test_refusal_names_what_differs():
    schedule = family("1f1b", 2, 4).derive()
    plan = lower(schedule)
    assert Question(source=schedule).refusal(plan) is None
    assert Question(declared=(None, 5, None)).refusal(plan) == "4 microbatches judged, 5 declared"
    swapped = Plan(plan.placement, plan.num_microbatches,
                   (plan.programs[0][1:] + plan.programs[0][:1],) + plan.programs[1:])
    assert Question(source=schedule).refusal(swapped) == "rank 0's steps differ from the input's"
    forward_only = Schedule(schedule.placement, 4, tuple(
        tuple(op for op in prog if isinstance(op, Compute) and op.kind == "F")
        for prog in schedule.programs), forward_only=True)
    assert "forward-only" in Question(source=forward_only).refusal(plan)
    both = Placement((0, 0), 2)  # both stages on rank 0; rank 1 runs a stray forward
    work = (Compute("F", 0, 0), Compute("F", 1, 0), Compute("B", 1, 0), Compute("B", 0, 0))
    source = Schedule(both, 1, (work, (Compute("F", 0, 0),)))
    one_rank = Plan(Placement((0, 0), 1), 1, (work,))  # a declaration that dropped rank 1
    assert Question(declared=(None, None, 1), source=source).refusal(one_rank) \
        == "the plan has fewer ranks than the input"


@pytest.mark.parametrize("limit, message", [
    ((1, 2, 3), "lists 3 per-rank values but the plan has 2 ranks"),
    (float("inf"), "finite number"),
    (True, "finite number"),
])
def test_limits_as_written_are_checked(limit, message):
    with pytest.raises(ValueError, match=message):
        Question(memory_limit=limit).limits(2)


def test_asked_decides_with_exact_limits():
    plan = lower(family("1f1b", 2, 2).derive())
    asked = Asked(plan, Question(memory_limit=0.1))
    assert asked.limits == (Fraction(0.1), Fraction(0.1))


LIMITED = """
[schedule]
family = "1f1b"
pp = 2
microbatches = 4

[cost]
F = 2.0

[memory]
limit = 1
"""


def test_the_spec_limit_reaches_the_question_whatever_the_cost_model_says(
        tmp_path, capsys, monkeypatch):
    """The spec's own ``[memory] limit`` (1, below the peak of 2) is the question's even
    if the code that builds the command's model drops it."""
    from mpipe_verified.cli import verdicts  # where check looks model_of up
    spec = tmp_path / "s.toml"
    spec.write_text(LIMITED)
    real = verdicts.model_of
    monkeypatch.setattr(verdicts, "model_of", lambda spec, limit=None: real(spec, limit)._replace(
        limit=None))
    code, doc = check(capsys, str(spec), "--expand")
    assert code == 1 and doc["status"] == "violated", doc


def test_a_verdict_on_another_question_is_not_this_ones(tmp_path, capsys, monkeypatch):
    """If the verifier answered a question of its own (here: without the limit), the
    command refuses that verdict: undecided, never VERIFIED."""
    from mpipe_verified import verify as verifier
    spec = tmp_path / "s.toml"
    spec.write_text(LIMITED)
    monkeypatch.setattr(verifier, "_asked", lambda plan, question, *_: Asked(
        plan, Question()))
    code, doc = check(capsys, str(spec), "--expand")
    assert code == 3 and doc["status"] == "undecided", doc
    assert any("answers another question" in u for u in doc["undecided"])


def test_sizes_a_spec_leaves_out_are_the_shells_defaults(tmp_path):
    """A spec that writes no memory numbers means the unit model, whatever defaults its
    cost tables carry; the numbers it writes are the only ones read."""
    from mpipe_verified.formats.spec import parse_spec
    spec = parse_spec(LIMITED, "s.toml")
    assert spec.memory_written == {}
    assert Question.of_spec(spec).memory == "unit"
    plan = lower(spec.schedule)
    wrong = CostModel(F=2.0, activation=0.0)  # a cost model whose default went wrong
    assert Question.of_spec(attrs.evolve(spec, cost=wrong)).sizes(plan) == Question().sizes(plan)
    written = parse_spec(SPEC, "s.toml")
    assert written.memory_written == {"activation": (0.5, 0.25), "static": (1.0, 2.0)}
    sizes = Question.of_spec(written).sizes(lower(written.schedule))
    assert sizes.static == (1, 2) and sizes.stored == {("", 0): Fraction(1, 2),
                                                        ("", 1): Fraction(1, 4)}


def test_an_answer_the_kernel_did_not_give_is_not_counted(capsys, monkeypatch):
    """A hand-over that says "proved" without asking the kernel: the verdict counts only
    the answers ``Asked.decide`` sealed, so the broken example stays unverified."""
    from mpipe_verified import verify as verifier
    from mpipe_verified.question import Answer
    path = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "broken.toml")
    code, doc = check(capsys, path)
    assert code == 1
    real = verifier._Judge.__call__

    def says_proved(self, name, run):
        _, detail, _ = real(self, name, run)  # the pass runs; the kernel's answer is dropped
        return Answer("proved", facts=1, runs=1), detail, []
    monkeypatch.setattr(verifier._Judge, "__call__", says_proved)
    code, doc = check(capsys, path)
    assert code == 3 and doc["status"] == "undecided", doc
    assert any("an answer the kernel did not give" in u for u in doc["undecided"]), doc


def test_a_family_transpose_takes_no_sizes_from_the_algebra(capsys, monkeypatch):
    """``--family transpose`` means the unit sizes: an estimate that zeroed the stored
    activations does not change what is proved."""
    from mpipe_verified.algebra import transpose
    argv = ["--family", "transpose", "--pp", "4", "--microbatches", "8", "--expand",
            "--memory-limit", "2"]
    code, doc = check(capsys, *argv)
    assert code == 1
    real = transpose.Transpose.estimate_cost
    monkeypatch.setattr(transpose.Transpose, "estimate_cost",
                        lambda self: attrs.evolve(real(self), activation=0.0))
    code, doc = check(capsys, *argv)
    assert code == 1 and doc["status"] == "violated", doc


def test_a_spec_asks_for_its_own_pp_and_microbatches(tmp_path, capsys, monkeypatch):
    """A family spec's ``pp`` and ``microbatches`` are sizes it asks for: a derivation on
    other sizes (here one microbatch short) is refused, not proved."""
    from mpipe_verified.algebra import families
    spec = tmp_path / "s.toml"
    spec.write_text('[schedule]\nfamily = "1f1b"\npp = 4\nmicrobatches = 8\n')
    code, _ = check(capsys, str(spec), "--expand")
    assert code == 0
    real = families.family
    monkeypatch.setattr(families, "family", lambda name, pp, microbatches, **k: real(
        name, pp, microbatches - 1, **k))
    code, doc = check(capsys, str(spec), "--expand")
    assert code == 3 and doc["status"] == "undecided", doc
    assert any("7 microbatches judged, 8 declared" in u for u in doc["undecided"]), doc


def test_numbers_of_another_length_than_the_plan_are_bad_input(tmp_path, capsys):
    """A spec's per-rank static memory for 4 ranks, checked with ``--ranks 5``: one line,
    exit 2, no traceback."""
    spec = tmp_path / "s.toml"
    spec.write_text('[schedule]\nfamily = "1f1b"\npp = 4\nmicrobatches = 8\n\n'
                    '[memory]\nstatic = [1, 1, 1, 1]\n')
    code = main(["check", str(spec), "--ranks", "5"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert "lists 4 numbers, one per rank, but the plan has 5 ranks" in err, err
