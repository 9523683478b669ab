"""``mpipe-verify tune``: the search returns a verified plan within the limit that no
family alone beats on the same model, the written spec reproduces it, and a budget stops
the search with the best found so far."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import time

import pytest

from mpipe_verified import sim
from mpipe_verified.algebra.families import FAMILIES
from mpipe_verified.cli import main
from mpipe_verified.comparison import simulation
from mpipe_verified.formats.spec import load_spec, parse_spec
from mpipe_verified.formats.spec_writer import spec_text
from mpipe_verified.lower import as_plan
from mpipe_verified.tune import _solve, candidates, space_size, tune
from mpipe_verified.verify import verify

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# 4 ranks, 8 microbatches, a trainable encoder with per-microbatch costs; the 8-unit
# limit rules out GPipe and the deep-warmup families, so the limit shapes the answer.
SMALL = """
[schedule]
family = "transpose"
pp = 4
microbatches = 8

[transpose]
body = "1f1b"
mode = "owner"
ownership = "inline"

[cost]
F = 1.0
B = 2.0
I = 1.0
W = 1.0
activation = 1.0

[cost.segments.vision]
F = [1.5, 0.5, 2.0, 1.0, 1.5, 0.5, 2.0, 1.0]
activation = 0.5
static = 1.0
replica = 0.25

[comm]
latency = 0.05
parameter_bytes = 1.0
bandwidth = 10.0

[memory]
limit = 10
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "small.toml"
    path.write_text(SMALL)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tuned_plan_is_verified_and_no_slower_than_any_family_alone(small, capsys, tmp_path):
    """Every family on its own (``simulate --compare``: the same model, the encoder
    inline) that fits the limit is at least as slow as the tuned plan, which is verified
    by the kernel with the spec's limit; the written spec reproduces its makespan in
    ``simulate`` and verifies in ``check``; two budget-free runs agree."""
    out = tmp_path / "best.toml"
    code, text, _ = run(capsys, "tune", str(small), "--json", "-o", str(out))
    assert code == 0
    doc = json.loads(text)
    best = doc["best"]
    assert best["status"] == "verified" and doc["complete"]
    assert best["peak_memory"] <= 10
    spec = load_spec(small)
    compare, _, alone = simulation(spec, "small", compare=tuple(FAMILIES))
    fitting = [t.run.makespan for t in alone.values() if t.within_limit()]
    assert len(fitting) >= 3 and any(not t.within_limit() for t in alone.values())
    assert best["makespan"] <= min(fitting + [compare["makespan"]])
    assert best["makespan"] < min(fitting)  # moving the encoder pays on this model
    assert doc["baseline"]["makespan"] == min(fitting)
    written = load_spec(out)
    assert str(written.term) == best["expression"]
    report = verify(as_plan(written.schedule, written.duration), written.memory_limit,
                    memory_model=written.memory_model)
    assert report.verified
    code, text, _ = run(capsys, "simulate", str(out), "--json")
    assert code == 0 and json.loads(text)["makespan"] == best["makespan"]
    assert run(capsys, "check", str(out), "--quiet")[0] == 0
    again = json.loads(run(capsys, "tune", str(small), "--json")[1])
    assert untimed(again) == untimed(doc)


def untimed(doc: dict) -> dict:
    """A ``tune`` document without its wall-clock times (the search's and each solve's)."""
    return {k: [{f: x for f, x in e.items() if f != "seconds"} for e in v]
            if k == "placements" else v for k, v in doc.items()
            if k not in ("seconds", "search_seconds")}


class FakeClock:
    """A clock that moves ``step`` seconds each time it is read (``sim._now``, what every
    budget check reads): a search under a budget then stops after the same number of
    reads, hence the same candidates, on a quiet machine and on a loaded one. The step
    is a power of two, so the times it gives are exact."""

    def __init__(self, step: float = 2.0 ** -10) -> None:
        self.step, self.reads = step, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.reads * self.step


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(sim, "_now", fake)
    return fake


def test_budget_returns_the_best_found_so_far(clock):
    """With a 1 s budget on the 8-rank example (a full search evaluates 289 candidates
    and solves 3 placements), the search stops early and returns the fastest fitting
    candidate it tried, verified, never slower than the spec's own schedule (always
    tried first). By the fake clock the search stops at the first check past the
    deadline (the one read after it is ``search_seconds``), and the final verification
    comes after it."""
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    result = tune(spec, budget=1.0)
    assert not result.complete and 0 < len(result.tried) < result.total == 289
    # reads: the start, ..., the first at or past start + 1.0 (DeadlinePassed), `searched`
    assert result.budget == 1.0
    assert 1.0 <= result.search_seconds - clock.step < 1.0 + clock.step
    assert result.seconds >= result.search_seconds
    fitting = [t for t in result.tried if t.fits]
    assert result.best is not None and result.best.status == "verified"
    assert result.best.tried.makespan == min(t.makespan for t in fitting)
    own = next(t for t in result.tried if t.order == 0)
    assert result.best.tried.makespan <= own.makespan
    assert result.best.spec.term == result.best.tried.candidate.on(spec).term
    again = tune(spec, budget=1.0)  # the same clock reads: the same candidates
    assert [t.candidate.label for t in again.tried] == [t.candidate.label
                                                         for t in result.tried]
    assert len(tune(spec, budget=2.0).tried) > len(result.tried)  # more budget, more tried


def test_budget_run_out_is_reported_with_the_count(capsys, clock):
    """``tune --budget`` says that the budget ran out and how many candidates it
    evaluated, in the text and in ``--json`` (``complete``, ``tried``, ``budget``); by the
    fake clock the search ends at the budget (the CLI's start counts) and the final
    verification comes after it."""
    spec = str(EXAMPLES / "mllm_transpose.toml")
    code, text, _ = run(capsys, "tune", spec, "--budget", "0.5", "--json")
    doc = json.loads(text)
    assert code == 0 and doc["complete"] is False and doc["budget"] == 0.5
    assert 0 < doc["tried"] < doc["candidates"] == 289
    # rounded to ms: 0.5 + one step (the read past the deadline) + one (``searched``)
    assert 0.5 <= doc["search_seconds"] - clock.step <= 0.5 + clock.step + 0.0005
    assert doc["seconds"] >= doc["search_seconds"]
    code, text, _ = run(capsys, "tune", spec, "--budget", "0.5")
    first = text.splitlines()[0]
    assert code == 0 and first.startswith(f"{spec}: the budget ran out (--budget 0.5 s): ")
    assert f"{doc['tried']} of 289 candidates evaluated in 0.5 s" in first
    assert "the final verification" in first


def test_a_budget_spent_before_any_candidate_still_verifies_the_spec():
    """A budget that runs out before the first candidate is timed: the spec's own
    schedule is timed and verified in the final step, so the answer is the spec."""
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    result = tune(spec, budget=1e-6, start=sim.now() - 1.0)
    assert not result.complete and [t.order for t in result.tried] == [0]
    assert result.best is not None and result.best.status == "verified"
    assert result.best.tried.candidate.label == "the spec's own schedule"
    assert result.best.spec == spec


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="the stuck solver is patched into a forked process")
def test_a_solve_ends_by_its_deadline(monkeypatch):
    """Under a budget a placement solve is stopped at the deadline whatever Z3 does: a
    solver stuck for a minute (it would then claim an optimum) is stopped, so the solve
    answers with no assignment; a deadline already passed raises at once."""
    from mpipe_verified.algebra import placement
    from mpipe_verified.sim import DeadlinePassed
    spec = load_spec(EXAMPLES / "mllm_transpose.toml")
    problem = spec.term.placement_problem(spec.cost)

    def stuck(problem, rlimit, timeout):  # runs in the forked worker
        time.sleep(60)
        return placement.Solution((problem.home,) * problem.microbatches, 0, 0,
                                  placement.OPTIMAL, 60.0)

    monkeypatch.setattr(placement, "optimize", stuck)
    solution = _solve(problem, sim.now() + 0.2)  # hang guard: the stuck worker's 60 s
    assert solution.status == placement.NONE and solution.owners is None
    with pytest.raises(DeadlinePassed):
        _solve(problem, sim.now() - 1.0)


def test_the_space_size_is_the_length_of_the_derived_space():
    """``space_size`` (what a stopped search reports) is the length of the lazily
    derived space, for every small example."""
    for path in sorted(EXAMPLES.glob("*.toml")):
        if path.name == "broken.toml" or "_64" in path.name:
            continue
        spec = load_spec(path)
        assert space_size(spec) == sum(1 for _ in candidates(spec)), path.name


def test_tune_text_says_what_is_faster_than_what(small, capsys):
    """The baseline line names what the best is faster than, and a spec without a cut
    says nothing about a segment (examples/1f1b.toml: the best, interleaved 1F1B with 4
    chunks and defer_w(r), 24.75, against ZBV's 25.5)."""
    code, text, _ = run(capsys, "tune", str(EXAMPLES / "1f1b.toml"))
    lines = text.splitlines()
    assert code == 0 and lines[0].startswith(f"{EXAMPLES / '1f1b.toml'}: 37 of 37 candidates "
                                              "evaluated in ")
    assert "best: interleaved-1f1b/v4+defer_w(r): makespan 24.75," in text
    assert "baseline (the fastest plain family that fits): zbv: makespan 25.5\n" in text
    assert "  the best is 1.030x faster than the baseline\n" in text
    assert "segment" not in text and "x faster\n" not in text.split("baseline")[0]
    doc = json.loads(run(capsys, "tune", str(EXAMPLES / "1f1b.toml"), "--json")[1])
    assert doc["segment"] is None and doc["best"]["makespan"] < doc["baseline"]["makespan"]
    assert doc["baseline"]["speedup"] == pytest.approx(25.5 / 24.75, rel=1e-5)
    code, text, _ = run(capsys, "tune", str(small))
    assert ("baseline (the fastest plain family with the segment 'vision' inline that "
            "fits): ") in text
    assert "any segment" not in text


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[schedule]\nfamily = 'nope'\npp = 2\nmicrobatches = 2\n")
    out = tmp_path / "best.toml"
    for argv in ((str(bad),), (str(bad), "--budget", "0"), (str(tmp_path / "none.toml"),)):
        code, text, err = run(capsys, "tune", *argv, "-o", str(out))
        assert code == 2 and text == "" and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err
    assert not out.exists()


def test_written_spec_reads_back_to_the_same_model():
    """``spec_text`` of every example reads back to an equal term, cost model and limit."""
    for path in sorted(EXAMPLES.glob("*.toml")):
        if path.name == "broken.toml" or "_64" in path.name:  # 64 ranks: seconds to derive
            continue
        spec = load_spec(path)
        again = parse_spec(spec_text(spec.term, spec.cost, spec.memory_limit, "x"), "x.toml")
        assert (again.term, again.cost, again.memory_limit) == (
            spec.term, spec.cost, spec.memory_limit), path.name
