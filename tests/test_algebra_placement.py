"""Encoder placement solved with Z3's ``Optimize`` (``algebra.placement``): the solution
beats every other assignment in its own model, the schedule derived from it achieves
exactly the objective Z3 reports, the plans verify, a bounded solve still answers, and
in ``tune`` the placement wins on a small spec and its written spec reproduces it."""

from __future__ import annotations

import itertools
import json
import multiprocessing

import attrs
import pytest

from mpipe_verified.algebra import placement
from mpipe_verified.algebra.families import family
from mpipe_verified.algebra.transpose import transpose_family
from mpipe_verified.cli import main
from mpipe_verified.comparison import on_body, time_spec
from mpipe_verified.formats.spec import load_spec, parse_spec
from mpipe_verified.formats.spec_writer import spec_text
from mpipe_verified.lower import lower
from mpipe_verified.figures import figure
from mpipe_verified.tune import HEURISTICS, REFINE, tune
from mpipe_verified.verify import verify

from test_tune import EXAMPLES, SMALL, FakeClock


@pytest.mark.parametrize("side, mode", [("source", "owner"), ("source", "recompute"),
                                        ("source", "frozen"), ("sink", "owner")])
def test_optimum_beats_every_assignment_and_the_derived_schedule_achieves_it(side, mode):
    t = transpose_family(3, 4, body="1f1b", side=side, mode=mode,
                         costs=[2.0, 1.0, 3.0, 1.0])
    problem = t.placement_problem()
    solution = placement.solve(problem)
    assert solution.status == placement.OPTIMAL
    for other in itertools.product(range(3), repeat=4):  # every assignment: 3^4
        assert (solution.top, solution.total) <= placement.overflow(problem, other)
    given = attrs.evolve(t, ownership="given", owners=solution.owners)
    schedule = given.derive()
    owners = schedule.cut.segments[0].forward_rank  # read back from the derived schedule
    assert placement.overflow(problem, owners) == (solution.top, solution.total)
    assert verify(lower(schedule)).verified


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="the fake clock is patched into the solve's forked process")
def test_a_bounded_solve_still_answers_and_is_never_called_optimal(monkeypatch):
    """The 8-rank example's ZB-H2 placement: a tiny resource limit, a 1 s timeout, and a
    worker stopped by the hard cap all return, none of them as optimal. The timeout is
    read on a fake clock (``placement._now``, inherited by the solve's forked process)
    that leaves Z3 half of it for the first of the three objectives and none for the
    second, so the solve stops by its timeout (its clock says so) before its optimum,
    whatever the machine's speed; its process wait is only a generous hang guard."""
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    model = on_body(spec, family("zb-h2", 8, 16), "zb-h2", mode="owner")
    problem = model.term.placement_problem(model.cost)
    tiny = placement.solve(problem, rlimit=1000)
    assert tiny.status in (placement.BOUNDED, placement.NONE)
    with monkeypatch.context() as m:
        m.setattr(placement, "_START", 120.0)  # the hang guard: the process wait
        # reads: solve's start 0.5; in the worker, optimize's start 1.0, objective 1 at
        # 1.5 (0.5 s left: Z3 gets 500 ms), objective 2 (if Z3 answered the first) at 2.0
        # (none left: stop), the end. A worker that ignores its timeout is stopped by the
        # guard instead: no assignment and 0.5 s on solve's clock.
        m.setattr(placement, "_now", FakeClock(step=0.5))
        second = placement.solve(problem, rlimit=10**12, timeout=1.0)
    assert second.status in (placement.BOUNDED, placement.NONE)
    assert second.seconds >= 1.0  # the worker stopped by the timeout, on its clock
    for s in (tiny, second):
        if s.owners is not None:
            assert len(s.owners) == 16 and all(0 <= r < 8 for r in s.owners)
            assert (s.top, s.total) == placement.overflow(problem, s.owners)
    monkeypatch.setattr(placement, "HARD_SECONDS", 0.0)
    monkeypatch.setattr(placement, "_START", 0.0)
    stopped = placement.solve(problem, rlimit=10**12)
    assert stopped.status == placement.NONE and stopped.owners is None


@pytest.mark.parametrize("mode", ["owner", "recompute"])
def test_placement_beats_every_heuristic_on_the_small_spec_and_its_spec_reproduces(
        tmp_path, capsys, mode):
    """The small spec's own body (1F1B, 4 ranks, 8 microbatches): the simulated makespan
    of the Optimize placement is below every heuristic ownership's on the same model;
    the spec written for it lists the owners, and ``simulate`` and ``check`` reproduce
    it from the file alone."""
    spec = parse_spec(SMALL, "small.toml")
    body = spec.term.body
    heuristic = {own: time_spec(on_body(spec, body, "1f1b", mode=mode, ownership=own),
                                check=False).run.makespan for own in HEURISTICS}
    model = on_body(spec, body, "1f1b", mode=mode)
    solution = placement.solve(model.term.placement_problem(model.cost))
    assert solution.status == placement.OPTIMAL
    solved = on_body(spec, body, "1f1b", mode=mode, ownership="given",
                     owners=solution.owners)
    makespan = time_spec(solved, check=False).run.makespan
    assert makespan < min(heuristic.values()), heuristic
    out = tmp_path / "placed.toml"
    out.write_text(spec_text(solved.term, solved.cost, solved.memory_limit, "placed"))
    assert load_spec(out).term.owners == solution.owners
    assert main(["simulate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == figure(makespan)
    assert main(["check", str(out), "--quiet"]) == 0


def test_tune_solves_the_placement_of_its_best_groups():
    """``tune`` on the small spec solves the placement of its ``REFINE`` fastest groups,
    times each solution as a candidate of its own (the same makespan as the spec with
    those owners), and returns a verified plan no slower than every candidate tried."""
    spec = parse_spec(SMALL, "small.toml")
    result = tune(spec)
    assert len(result.placements) == REFINE
    assert len({p.group for p in result.placements}) == REFINE
    for p in result.placements:
        assert p.solution.status == placement.OPTIMAL and p.tried is not None
        assert p.tried.candidate.label == f"{p.group}/optimal"
        model = p.tried.candidate.on(spec)
        assert model.term.owners == p.solution.owners
        assert time_spec(model, check=False).run.makespan == p.tried.makespan
    assert result.best.status == "verified"
    assert result.best.tried.makespan == min(t.makespan for t in result.tried if t.fits)


def test_given_owners_are_checked_with_the_file_and_position(tmp_path, capsys):
    text = SMALL.replace('ownership = "inline"', 'ownership = "given"\nowners = [0, 9]')
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "owners" in err
    with pytest.raises(Exception, match="owners"):
        parse_spec(SMALL.replace('ownership = "inline"', 'ownership = "given"'), "x.toml")
