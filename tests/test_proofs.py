"""The Z3 proofs of the algebra's laws (``proofs/``) and ``mpipe-verify laws``: every law
is proved with a stated scope, deliberately false laws come out ``failed`` with Z3's
counterexample, undecided ones ``unknown``, and the models the proofs reason about agree
with the package's code on concrete schedules."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import z3
from hypothesis import given
from hypothesis import strategies as st

from mpipe_verified.algebra import terms as algebra_terms
from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.algebra.pattern import RankStreams
from mpipe_verified.algebra.terms import MergeBW, Relabel, SplitBW, _merge
from mpipe_verified.cli import main
from mpipe_verified.ir import (Compute, Idle, Overlap,
                               Schedule)
from mpipe_verified.lower import lower
from mpipe_verified.semantics import peak_memory
from mpipe_verified.proofs import FALSE_LAWS, LAWS, core, model, registry
from mpipe_verified.proofs.core import Law, Obligation, law
from mpipe_verified.proofs.relabel import PI, relabel_fn
from mpipe_verified.proofs.sequences import merge_go_fn, split_fn

STATUSES = {"proved", "failed", "unknown"}


def _script() -> str:
    found = pathlib.Path(sys.executable).with_name("mpipe-verify")
    return str(found) if found.exists() else shutil.which("mpipe-verify") or "mpipe-verify"


@pytest.fixture(scope="module")
def all_laws_json():
    """One run of every law, through the installed console script, from outside the
    checkout (the command must find proofs/ on its own)."""
    proc = subprocess.run([_script(), "laws", "--json"], capture_output=True, text=True,
                          cwd="/", timeout=600)
    return proc


# ---------------------------------------------------------------- the whole registry


def test_laws_json_schema_and_exit_code(all_laws_json):
    proc = all_laws_json
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert set(out) == {"laws"}
    names = [entry["name"] for entry in out["laws"]]
    assert names == [law.name for law in LAWS]
    for entry in out["laws"]:
        assert {"name", "status", "scope", "seconds", "statement"} <= set(entry)
        assert entry["status"] in STATUSES
        assert isinstance(entry["seconds"], (int, float)) and entry["seconds"] >= 0
        assert isinstance(entry["statement"], str) and "\n" not in entry["statement"]


def test_every_law_is_proved_with_a_scope(all_laws_json):
    for entry in json.loads(all_laws_json.stdout)["laws"]:
        assert entry["status"] == "proved", entry
        scope = entry["scope"]
        assert scope.startswith("all sizes") or scope.startswith("bounded: "), scope
        law = next(law for law in LAWS if law.name == entry["name"])
        # a family invariant says, in the JSON, which family and property it proves
        assert (entry.get("family"), entry.get("property")) == (law.family, law.property)


def test_the_brief_s_laws_are_all_there():
    names = {law.name for law in LAWS}
    assert {"seq_assoc", "seq_identity", "par_comm", "par_assoc", "lower_par",
            "split_merge_identity", "relabel_weave", "lower_work_conservation",
            "par_deadlock_free", "seq_deadlock_free", "1f1b_completeness",
            "1f1b_dependency", "1f1b_peak_memory"} <= names
    unbounded = [law.name for law in LAWS if law.scope.startswith("all sizes")]
    assert len(unbounded) >= 28


def test_one_law_per_family_and_property():
    """Each family invariant is one (family, property) cell, with at most one law for all
    sizes (over the parameters its ``covers`` holds) and one bounded, and every cell of
    the families proven here has its law."""
    cells = [(law.family, law.property, law.for_all_sizes()) for law in LAWS
             if law.family is not None]
    assert len(cells) == len(set(cells))
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"):
        assert {prop for fam, prop, _ in cells if fam == name} == set(core.PROPERTIES), name


@pytest.mark.parametrize("name, least, fewer", [("zbv", 1, None), ("dualpipev", 2, 5),
                                                 ("zb-h1", 1, 2), ("zb-h2", 2, 4)])
def test_families_proven_for_all_sizes_from_m_equal_least_p(name, least, fewer):
    """ZBV's, DualPipeV's (m >= 2p, the family's own condition), ZB-H1's (m >= p) and
    ZB-H2's (m >= 2p - 1) five cells are all-sizes laws that hold every such instance,
    the memory law states the peak, and none claims an instance below (ZB-H1's m < p and
    ZB-H2's m < 2p - 1 are bounded)."""
    laws = [law for law in LAWS if law.family == name]
    for p in (1, 3, 1024):
        params = {"pp": p, "microbatches": least * p, "chunks": None}
        assert all(law.for_all_sizes() and law.proves(params) for law in laws), (name, p)
        peak = next(law for law in laws if law.property == "memory").peak(params)
        assert len(peak) == p
        if p < 1024:  # the stated peak is the one the lowered instance reaches
            measured = peak_memory(lower(family(name, p, least * p).derive()))
            assert tuple(peak) == tuple(measured[r][0] for r in range(p)), (name, p)
    if fewer is not None:  # 3 ranks, fewer microbatches than the laws' scope
        assert not any(law.proves({"pp": 3, "microbatches": fewer, "chunks": None})
                       for law in laws)


def test_a_scope_must_say_all_sizes_or_bounded():
    with pytest.raises(ValueError, match="scope must start"):
        Law("x", "s", "bounded (p <= 8)", lambda: [])
    assert core.bounded("p <= 8") == "bounded: p <= 8"


# ---------------------------------------------------------------- the harness can fail


@pytest.mark.parametrize("false_law", FALSE_LAWS, ids=lambda law: law.name)
def test_false_laws_are_reported_failed_with_a_counterexample(false_law):
    result = false_law()
    assert result.status == "failed"
    assert "counterexample" in result.detail


def test_par_of_plans_exchanging_messages_can_deadlock():
    """``false_par_exchanging`` fails with a counterexample: two plans that each exchange
    messages, put side by side, deadlock."""
    ob, = registry.BY_NAME["false_par_exchanging"].obligations()
    refutation = core.refute(ob)
    assert refutation.status == "failed"
    assert "P_kind_0_0" in refutation.detail


def test_a_wrong_algebra_law_fails():
    @law("seq_comm", "seq(a,b) = seq(b,a)", "all sizes")
    def seq_comm():
        (a, ha), (b, hb) = model.prog_var("a"), model.prog_var("b")
        ab, d = model.seq(a, b)
        ba, _ = model.seq(b, a)
        yield Obligation("equal", model.prog_eq(ab, ba), tuple(ha + hb) + (d,))
    assert seq_comm().status == "failed"


def test_inconsistent_hypotheses_are_not_a_proof():
    x = z3.Int("x")

    @law("vacuous", "anything", "all sizes")
    def vacuous():
        yield Obligation("from x > 0 and x < 0", x == 42, (x > 0, x < 0))
    result = vacuous()
    assert result.status == "failed" and "vacuous" in result.detail


def _fermat3() -> Law:
    x, y, zz = z3.Ints("x y z")

    @law("fermat3", "no positive cubes add up", "all sizes")
    def fermat3():  # Z3 cannot settle this (nonlinear integers) in any budget used here
        yield Obligation("x^3 + y^3 != z^3",
                         z3.Implies(z3.And(x > 0, y > 0, zz > 0),
                                    x * x * x + y * y * y != zz * zz * zz))
    return fermat3


def test_an_undecided_obligation_is_unknown_never_proved():
    result = core.check(_fermat3(), core.Budget(rlimit=20_000))
    assert result.status == "unknown"
    assert result.undecided_by == core.BY_RLIMIT
    assert "x^3 + y^3 != z^3: unknown (resource limit: rlimit 20000 used up)" == result.detail
    assert result.rlimit_used >= 20_000
    assert result.to_json()["undecided_by"] == "resource limit"
    assert core.exit_code([result]) == 3


def test_the_wall_clock_guard_is_reported_as_time_not_as_resource_limit():
    """A budget Z3 cannot use up in time: the outer guard stops the check, and the law
    says so ("undecided (time)"), distinct from the resource limit."""
    result = core.check(_fermat3(), core.Budget(rlimit=core.RLIMIT_MAX, guard_seconds=0.05))
    assert result.status == "unknown" and result.undecided_by == core.BY_TIME
    assert "undecided (time: the 0.05 s wall-clock guard" in result.detail
    assert core.exit_code([result]) == 3


# ---------------------------------------------------------------- deterministic budgets


def test_verdicts_come_from_the_resource_limit_not_the_wall_clock():
    """A shipped law's steps within a tiny resource budget are unknown by the resource
    limit, within the default budget proved, both with a wall-clock guard (a day) that
    never comes into play: the verdict is a function of the budget alone. Checked as
    ``mpipe-verify laws`` checks it, in a fresh process: Z3's step counts depend on the
    terms a process made before, and this suite's process has made many (here the law
    took 16,001 units fresh and over 5 million after the suite's earlier tests)."""
    def run(*extra: str) -> tuple[int, dict]:
        proc = subprocess.run([_script(), "laws", "--law", "par_deadlock_free", "--timeout",
                               "86400", "--json", *extra], capture_output=True, text=True,
                              timeout=600)
        return proc.returncode, json.loads(proc.stdout)["laws"][0]
    code, tiny = run("--rlimit", "50")
    assert (code, tiny["status"], tiny["undecided_by"]) == (3, "unknown", core.BY_RLIMIT)
    assert "unknown (resource limit: rlimit 50 used up)" in tiny["detail"]
    code, full = run()
    assert (code, full["status"], full.get("undecided_by")) == (0, "proved", None)
    assert 0 < full["rlimit_used"] <= core.DEFAULT_RLIMIT // 5


def test_each_z3_check_gets_its_whole_budget_whatever_ran_before():
    """Z3 counts resource units per context, cumulatively; the budget of a check counts
    from where the count stands when it starts, so a step after a costly one (here, one
    that used up a budget larger than the next step's) still gets all of its own."""
    law_ = registry.BY_NAME["seq_assoc"]
    burnt = core.check(_fermat3(), core.Budget(rlimit=200_000))
    assert burnt.undecided_by == core.BY_RLIMIT
    after = core.check(law_, core.Budget(rlimit=100_000))
    assert after.status == "proved", after.detail


def test_budgets_keep_their_margin_over_every_shipped_law(all_laws_json):
    """The budgets are set from the laws' measured resource use (docs/proofs.md,
    "Budgets"): every law's costliest step and vacuity check stay within a fifth of
    them, so the shipped laws decide on any machine, under any load; every vacuity check
    is decided."""
    entries = json.loads(all_laws_json.stdout)["laws"]
    for entry in entries:
        assert 0 <= entry["rlimit_used"] <= core.DEFAULT_RLIMIT // 5, entry["name"]
        assert entry["vacuity_rlimit_used"] <= core.VACUITY_RLIMIT // 5, entry["name"]
        assert entry["detail"] == "", entry
        assert "undecided_by" not in entry


def test_the_family_provers_use_the_laws_budget():
    """``check`` answered by a family's laws proves them in fresh interpreters
    (``proofs.covering``) within the same deterministic budget, and says how much of it
    the costliest step used."""
    from mpipe_verified.proofs import covering
    params = {"pp": 4, "microbatches": 8, "chunks": None}
    proved, count, result = covering._prove_part("1f1b", params, 0, 2)
    assert proved and count > 0
    assert 0 < result.rlimit_used <= core.DEFAULT_RLIMIT // 5
    assert result.undecided_by is None


def test_the_kernel_s_queries_have_a_resource_limit_by_default():
    """The verification kernel's queries are bounded by Z3's resource limit even when the
    caller gives none (``kernel.smt.QUERY_RLIMIT``); running out is reported as the resource
    limit."""
    from mpipe_verified.kernel.smt import QUERY_RLIMIT
    from mpipe_verified.verify import verify
    assert QUERY_RLIMIT > 0
    report = verify(lower(family("1f1b", 2, 2).derive()), rlimit=1)
    assert report.status == "undecided"
    assert any("resource limit" in u for u in report.undecided), report.undecided
    assert verify(lower(family("1f1b", 2, 2).derive())).verified


def test_exit_codes():
    def result(status):
        return core.LawResult("x", "s", "all sizes", status, 0.0)
    assert core.exit_code([result("proved")] * 2) == 0
    assert core.exit_code([result("proved"), result("unknown")]) == 3
    assert core.exit_code([result("unknown"), result("failed")]) == 1


# ---------------------------------------------------------------- the command


def test_cli_runs_selected_laws_and_prints_one_line_each(capsys):
    code = main(["laws", "--law", "seq_assoc", "--law", "1f1b_completeness"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["proved", "seq_assoc"]
    assert lines[1].split()[:2] == ["proved", "1f1b_completeness"]
    assert "all sizes" in lines[0] and lines[0].split()[2].endswith("s")
    assert lines[2].startswith("total: 2 laws, 2 proved")


def test_cli_exit_1_on_a_failed_law(capsys):
    code = main(["laws", "--json", "--law", "false_seq_unshifted", "--law", "seq_identity"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [e["status"] for e in out["laws"]] == ["failed", "proved"]


def test_cli_exit_3_on_an_unknown_law(capsys, monkeypatch):
    x, y, zz = z3.Ints("x y z")
    undecided = Law("undecided", "nonlinear", "all sizes", lambda: [Obligation(
        "cubes", z3.Implies(z3.And(x > 0, y > 0, zz > 0), x * x * x + y * y * y != zz * zz * zz))])
    monkeypatch.setattr(registry, "select", lambda names: [undecided, LAWS[0]])
    code = main(["laws", "--json", "--rlimit", "20000", "--jobs", "0"])
    out = json.loads(capsys.readouterr().out)
    assert code == 3
    assert [e["status"] for e in out["laws"]] == ["unknown", "proved"]
    assert out["laws"][0]["undecided_by"] == "resource limit"
    assert "undecided_by" not in out["laws"][1]
    code = main(["laws", "--rlimit", "20000", "--jobs", "0"])
    text = capsys.readouterr().out
    assert code == 3
    assert "cubes: unknown (resource limit: rlimit 20000 used up)" in text
    assert "1 unknown (1 by resource limit)" in text.splitlines()[-1]


def test_cli_rlimit_and_timeout_help_say_what_they_bound(capsys):
    assert main(["laws", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"default {core.DEFAULT_RLIMIT}" in out
    assert f"default {core.GUARD_SECONDS:g})" in out and "outer wall-clock guard" in out


@pytest.mark.parametrize("argv, needle", [
    (["laws", "--law", "no_such_law"], "unknown law"),
    (["laws", "--timeout", "0"], "--timeout"),
    (["laws", "--rlimit", "0"], "--rlimit"),
    (["laws", "--rlimit", str(2**32)], "--rlimit"),
    (["laws", "--jobs", "-1"], "--jobs"),
])
def test_cli_bad_usage_exits_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_cli_list(capsys):
    assert main(["laws", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == [law.name for law in LAWS]


# ---------------------------------------------------------------- models vs the package


def _enc_work(c: Compute):
    return model.work(model.__dict__[c.kind], c.stage, c.mb, 0)


def _enc(op):
    if isinstance(op, Compute):
        return model.Op.compute(_enc_work(op))
    if isinstance(op, Overlap):
        assert len(op.ops) == 2
        return model.Op.overlap(_enc_work(op.ops[0]), _enc_work(op.ops[1]))
    return model.Op.other(0)


def _seq(ops):
    items = [z3.Unit(_enc(op)) for op in ops]
    if not items:
        return z3.Empty(model.OpSeq)
    return items[0] if len(items) == 1 else z3.Concat(*items)


def _value(expr, *given):
    """Z3's value of a ground term over recursive functions (``given``: constraints on
    the free symbols it uses)."""
    v = z3.Const("value", expr.sort())
    s = z3.Solver()
    s.add(v == expr, *given)
    assert s.check() == z3.sat
    return s.model().eval(v, model_completion=True)


def _same(expr, ops) -> bool:
    s = z3.Solver()
    s.add(expr != _seq(ops))
    return s.check() == z3.unsat


class _Given:
    """A schedule given op by op, as a term."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def derive(self) -> Schedule:
        return self.schedule


KINDS = st.sampled_from("FBIW")
OPS = st.lists(st.one_of(
    st.builds(Compute, KINDS, st.integers(0, 2), st.integers(0, 2)),
    st.just(Idle())), max_size=7)


@given(OPS)
def test_split_and_merge_models_are_the_operators(ops):
    sched = Schedule(algebra_terms.make_placement("looped", 3, 1), 3, (tuple(ops), (), ()))
    split = SplitBW(_Given(sched)).derive().programs[0]
    assert _same(_value(split_fn()(_seq(ops))), split)
    assert _same(_value(merge_go_fn()(z3.Empty(model.OpSeq), _seq(ops))), _merge(tuple(ops)))


def test_merge_after_split_needs_no_bare_i_or_w():
    """The law's precondition is needed: an I W pair already in s is merged."""
    ops = (Compute("I", 0, 0), Compute("W", 0, 0))
    sched = Schedule(algebra_terms.make_placement("looped", 1, 1), 1, (ops,))
    assert MergeBW(SplitBW(_Given(sched))).derive().programs[0] == (
        Compute("B", 0, 0),)


@given(OPS, st.permutations(range(3)))
def test_relabel_model_is_the_operator(ops, perm):
    sched = Schedule(algebra_terms.make_placement("looped", 3, 1), 3, (tuple(ops), (), ()))
    relabeled = Relabel(_Given(sched), tuple(perm)).derive().programs[0]
    value = _value(relabel_fn()(_seq(ops)), *[PI(i) == perm[i] for i in range(3)])
    assert _same(value, relabeled)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_relabelling_a_family_is_weaving_relabelled_streams(monkeypatch, name):
    """``relabel_weave``'s conclusion on the real weave."""
    p, m = 3, 6
    t = family(name, p, m, 2 if name == "interleaved-1f1b" else None)
    perm = tuple(reversed(range(m)))
    expected = Relabel(t, perm).derive()
    original = algebra_terms._rank_streams

    def relabelled_streams(placement, rank, m_, group):
        streams = original(placement, rank, m_, group)
        fwd = [(c, s, perm[mb]) for c, s, mb in streams._order["F"]]
        bwd = [(c, s, perm[mb]) for c, s, mb in streams._order["B"]]
        return RankStreams(fwd, bwd)
    monkeypatch.setattr(algebra_terms, "_rank_streams", relabelled_streams)
    assert t.derive() == expected


def test_docs_proofs_lists_every_law_and_family_cell():
    """docs/proofs.md names every registered law (and the demo false ones) in its tables,
    and every family invariant in its family's row."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "proofs.md").read_text()
    for entry in LAWS + FALSE_LAWS:
        assert f"`{entry.name}`" in text, entry.name
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and line.count("|") == 8}
    for entry in LAWS:
        if entry.family is not None:
            assert f"`{entry.name}`" in rows.get(entry.family, ""), (entry.family, entry.name)
