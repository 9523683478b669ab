"""``mpipe-verify import`` and the literal terms it writes (``algebra.literal``): import ->
export gives the compute order back (torch's own schedules, plan-json fixtures, the
examples' CSVs, random plans); literal terms read back from their text and compose with
the operators; bad input exits 2 and writes nothing; the greedy V families reproduce the
reference's orders cell for cell (``fixtures/zero_bubble/v_greedy_orders.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpipe_verified.algebra.families import family
from mpipe_verified.algebra.literal import Program, literal
from mpipe_verified.algebra.terms import DeferW, Relabel, Seq, SplitBW
from mpipe_verified.algebra.transpose import Transpose
from mpipe_verified.cli import main
from mpipe_verified.errors import InputError
from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json
from mpipe_verified.formats.torch_csv import parse_torch_csv
from mpipe_verified.ir import Compute, Overlap, Placement, Schedule
from mpipe_verified.lower import lower
from mpipe_verified.spec import parse_expression
from strategies import plans, terms
from torch_fixtures import SUPPORTED, torch_schedule_csv

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
EXAMPLES = ROOT / "examples"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def compute_order(programs) -> list[list]:
    """Each rank's compute steps (computes and overlaps), nothing else."""
    return [[op for op in prog if isinstance(op, (Compute, Overlap))] for prog in programs]


def round_trip(capsys, tmp_path, path: Path, to: str = "torch-csv") -> tuple[str, str]:
    """Import ``path``, export the spec's compute order; ``(spec text, exported text)``."""
    spec = tmp_path / "imported.toml"
    assert run(capsys, "import", str(path), "-o", str(spec)) == (0, "", "")
    code, out, _ = run(capsys, "export", str(spec), "--to", to, "--compute-only",
                       "--allow-unverified")
    assert code == 0
    return spec.read_text(), out


def torch_cases():
    for name in SUPPORTED:
        v = 1 if name in ("GPipe", "1F1B") else 2
        for p, m in ((2, 4), (4, 8)):
            for fmt in ("compute_only", "compute_comms"):
                yield name, p, m, v, fmt


@pytest.mark.parametrize("name,p,m,v,fmt", list(torch_cases()))
def test_import_of_torch_schedules_exports_their_compute_order(capsys, tmp_path, name, p, m,
                                                               v, fmt):
    try:
        text = torch_schedule_csv(name, p, m, v, fmt)
    except ValueError:
        pytest.skip("torch does not build this one")
    source = tmp_path / "torch.csv"
    source.write_text(text)
    spec, out = round_trip(capsys, tmp_path, source)
    assert "program(" in spec
    assert compute_order(parse_torch_csv(out, "x.csv").programs) == compute_order(
        parse_torch_csv(text, "t.csv").programs)


def test_torch_zbv_imports_as_the_zbv_family_words(capsys, tmp_path):
    source = tmp_path / "zbv.csv"
    source.write_text(torch_schedule_csv("ZBVZeroBubble", 4, 8, 2))
    spec, _ = round_trip(capsys, tmp_path, source)
    ours = literal(family("zbv", 4, 8).derive())
    assert json.dumps(str(ours)) in spec  # torch's ZB-V order is ours, word for word


@pytest.mark.parametrize("path", sorted(p.name for p in FIXTURES.glob("*.json")
                                        if json.loads(p.read_text()).get("format")
                                        == "mpipe-plan-json"))
def test_import_of_plan_json_fixtures(capsys, tmp_path, path):
    from mpipe_verified.formats.plan_json import read_plan_json
    plan = read_plan_json(str(FIXTURES / path))
    if plan.cut.segments or any(type(op).__name__ == "Collective" or getattr(op, "segment", "")
                                for prog in plan.programs for op in prog):
        code, _, err = run(capsys, "import", str(FIXTURES / path), "-o",
                           str(tmp_path / "x.toml"))
        assert code == 2 and str(FIXTURES / path) in err and not (tmp_path / "x.toml").exists()
        return
    _, out = round_trip(capsys, tmp_path, FIXTURES / path, "plan-json")
    assert compute_order(parse_plan_json(out, "x.json").programs) == compute_order(plan.programs)


@pytest.mark.parametrize("example", ["broken.csv", *sorted(
    p.name for p in EXAMPLES.glob("*.toml") if "transpose" not in p.name)])
def test_import_of_the_examples_written_csvs(capsys, tmp_path, example):
    if example.endswith(".csv"):
        source = EXAMPLES / example
    else:
        source = tmp_path / "written.csv"
        code, _, _ = run(capsys, "export", str(EXAMPLES / example), "--to", "torch-csv",
                         "--allow-unverified", "-o", str(source))
        assert code == 0
    _, out = round_trip(capsys, tmp_path, source)
    assert compute_order(parse_torch_csv(out, "x.csv").programs) == compute_order(
        parse_torch_csv(source.read_text(), "s.csv").programs)


def test_imported_spec_checks_as_verified(capsys, tmp_path):
    source = tmp_path / "zb.csv"
    assert run(capsys, "export", str(EXAMPLES / "zb-h1.toml"), "--to", "torch-csv", "-o",
               str(source))[0] == 0
    spec = tmp_path / "zb.toml"
    assert run(capsys, "import", str(source), "-o", str(spec))[0] == 0
    code, out, _ = run(capsys, "check", str(spec))
    assert code == 0 and "VERIFIED" in out


@pytest.mark.parametrize("text,where", [
    ("0F0,0B0\n1F0,1X9\n", ":2:"),                      # an unreadable cell: its row
    ('{"format": "mpipe-plan-json", "version": 1', ":1:"),  # malformed JSON
])
def test_bad_input_exits_2_and_writes_nothing(capsys, tmp_path, text, where):
    source = tmp_path / ("bad.json" if text.startswith("{") else "bad.csv")
    source.write_text(text)
    out = tmp_path / "out.toml"
    code, stdout, err = run(capsys, "import", str(source), "-o", str(out))
    assert code == 2 and stdout == "" and f"{source}{where}" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_spec_or_a_missing_file_is_refused(capsys, tmp_path):
    out = tmp_path / "out.toml"
    code, _, err = run(capsys, "import", str(EXAMPLES / "1f1b.toml"), "-o", str(out))
    assert code == 2 and "not a spec" in err and not out.exists()
    code, _, err = run(capsys, "import", str(tmp_path / "none.csv"), "-o", str(out))
    assert code == 2 and "none.csv" in err and not out.exists()


def test_a_cut_is_refused_with_the_file(capsys, tmp_path):
    source = tmp_path / "t.json"
    from mpipe_verified.algebra.transpose import transpose_family
    source.write_text(format_plan_json(transpose_family(2, 2, mode="owner").derive()))
    code, _, err = run(capsys, "import", str(source), "-o", str(tmp_path / "o.toml"))
    assert code == 2 and f"{source}: $.cut: cannot import" in err


def test_segment_work_in_a_plan_names_its_rank(capsys, tmp_path):
    source = tmp_path / "seg.json"
    fixture = json.loads((FIXTURES / "one_rank_two_segments.json").read_text())
    source.write_text(json.dumps(fixture))
    code, _, err = run(capsys, "import", str(source), "-o", str(tmp_path / "o.toml"))
    assert code == 2 and f"{source}: $." in err and "cannot import" in err


# ------------------------------------------------------------- the literal term


def test_words_are_the_family_patterns_read_per_rank():
    t = literal(family("1f1b", 4, 8).derive())
    assert t.words == ("F^3 (F B)*", "F F (F B)*", "F (F B)*", "(F B)*")
    assert str(t) == ("program(pp=4, microbatches=8, ranks=['F^3 (F B)*', 'F F (F B)*', "
                      "'F (F B)*', '(F B)*'])")


def test_an_order_no_stream_gives_is_listed():
    t = literal(Relabel(family("1f1b", 2, 4), (3, 2, 1, 0)).derive())
    assert t.words == ("= 0F3..2 0B3 0F1 0B2 0F0 0B1..0", "= 1F3 1B3 1F2 1B2 1F1 1B1 1F0 1B0")
    assert parse_expression(str(t)) == t


def test_listed_ranges_and_overlaps_read_back():
    t = parse_expression("program(pp=2, microbatches=3, placement=[0, 1, 1, 0], "
                         "ranks=['= 0F0..2 <3F0 0B0> 3B0 3F1..2 3B1..2 0B1..2', 'F0 F1 B1 B0 "
                         "(F0 F1 B1 B0)*'])")
    s = t.derive()
    assert s.placement == Placement((0, 1, 1, 0), 2)
    assert s.programs[0][3] == Overlap((Compute("F", 3, 0), Compute("B", 0, 0)))
    assert literal(s) == t or literal(s).derive() == s
    assert parse_expression(str(t)) == t


@pytest.mark.parametrize("expression,message", [
    ("program(pp=2, microbatches=2, ranks=['F*'])", "1 words for pp=2"),
    ("program(pp=1, microbatches=2, ranks=['= 0F0..x'])", "cannot read action"),
    ("program(pp=1, microbatches=2, ranks=['F^{p}'])", "may use only integers"),
    ("program(pp=1, microbatches=2, placement=[0, 3], ranks=['F*'])", "outside 0..0"),
    ("program(pp=1, microbatches=2, ranks=['= <0F0>'])", "two or more"),
])
def test_malformed_program_names_its_position(expression, message):
    with pytest.raises(InputError) as err:
        parse_expression(expression, "s.toml", 3, 14)
    assert message in str(err.value) and str(err.value).startswith("s.toml:3:")


def test_a_word_that_leaves_work_does_not_derive():
    from mpipe_verified.errors import ParameterError
    with pytest.raises(ParameterError, match="unscheduled"):
        Program(1, 2, ("F B",)).derive()
    with pytest.raises(ParameterError, match="outside"):
        Program(1, 2, ("= 0F0 0F5",)).derive()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_literals_compose_with_the_operators(name):
    body = family(name, 4, 8, 2 if name == "interleaved-1f1b" else None)
    lit = literal(body.derive())
    assert SplitBW(lit).derive() == SplitBW(body).derive()
    assert Seq(lit, lit).derive() == Seq(body, body).derive()
    perm = tuple(reversed(range(8)))
    assert Relabel(lit, perm).derive() == Relabel(body, perm).derive()
    if name != "zb-h1":
        assert DeferW(SplitBW(lit), "1").derive() == DeferW(SplitBW(body), "1").derive()
    for text in (f"split_bw({lit})", f"seq({lit}, {lit})", f"defer_w(split_bw({lit}), lag='1')"):
        assert str(parse_expression(text)) == text


def test_transpose_over_an_imported_body():
    body = literal(family("1f1b", 4, 8).derive())
    ours = Transpose(body, mode="owner").derive()
    assert ours == Transpose(family("1f1b", 4, 8), mode="owner").derive()
    text = str(Transpose(body, mode="owner"))
    assert parse_expression(text) == Transpose(body, mode="owner")


# ------------------------------------------------------------- V-Half and V-Min

V_CASES = json.loads((FIXTURES / "zero_bubble" / "v_greedy_orders.json").read_text())


@pytest.mark.parametrize("case", V_CASES["cases"] + V_CASES["hand"]["cases"],
                         ids=lambda c: f"{c['family']}-{c['pp']}-{c['microbatches']}")
def test_v_families_reproduce_the_reference_orders(capsys, case):
    code, out, err = run(capsys, "export", "--family", case["family"], "--pp", str(case["pp"]),
                         "--microbatches", str(case["microbatches"]), "--to", "torch-csv",
                         "--compute-only")
    assert (code, err) == (0, "")
    rows = [line.split(",") for line in out.splitlines()]
    assert rows == case["rows"]


def test_the_v_fixture_names_its_source():
    src = V_CASES["source"]
    assert src["repo"] == "sail-sg/zero-bubble-pipeline-parallelism"
    assert src["file"].endswith("zbv_greedy.py") and len(src["commit"]) == 40


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 8), (5, 7), (6, 16)])
def test_v_families_run_clean(name, p, m):
    import reference
    schedule = family(name, p, m).derive()
    assert schedule.placement == Placement.vshape(p)
    res = reference.run_plan(lower(schedule))
    assert res.ok, (res.stuck, res.incomplete[:3], res.first_violation)


def test_v_min_holds_less_than_v_half_less_than_zbv(capsys):
    peaks = {}
    for name in ("zbv", "v-half", "v-min"):
        code, out, _ = run(capsys, "check", "--family", name, "--pp", "6", "--microbatches",
                           "24", "--json")
        assert code == 0
        peaks[name] = max(json.loads(out)["peak_memory"].values())
    assert peaks["v-min"] < peaks["v-half"] < peaks["zbv"]


# ------------------------------------------------------------- fuzz

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(plans())
def test_import_then_export_gives_back_random_plans_compute_order(term_and_plan):
    from mpipe_verified.cli.importing import imported_term
    _, plan = term_and_plan
    schedule = Schedule(plan.placement, plan.num_microbatches,
                        tuple(tuple(op for op in prog if isinstance(op, (Compute, Overlap)))
                              for prog in plan.programs), plan.cut, plan.forward_only)
    if schedule.cut.segments:
        return
    term = imported_term(schedule, "x.csv")
    again = parse_expression(str(term)).derive()
    assert compute_order(again.programs) == compute_order(plan.programs)


@SETTINGS
@given(terms(), st.data())
def test_random_literal_terms_round_trip_through_their_text(term, data):
    schedule = term.derive()
    lit = literal(schedule)
    assert parse_expression(str(lit)) == lit
    assert lit.derive() == attrs_evolve_programs(schedule)
    perm = data.draw(st.permutations(range(schedule.num_microbatches)))
    shuffled = literal(Relabel(lit, tuple(perm)).derive())
    assert parse_expression(str(shuffled)).derive() == Relabel(term, tuple(perm)).derive()


def attrs_evolve_programs(schedule: Schedule) -> Schedule:
    """``schedule`` as a literal keeps it: its placement, microbatches and programs."""
    return Schedule(schedule.placement, schedule.num_microbatches, schedule.programs)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plans())
def test_the_command_round_trips_random_lowered_plans_as_csv(term_and_plan):
    """``import`` of a random lowered plan's torch CSV, then ``export --compute-only``:
    the same compute steps in the same order on every rank."""
    import contextlib
    import io
    import tempfile
    from mpipe_verified.formats.torch_csv import format_torch_csv
    _, plan = term_and_plan
    if plan.cut.segments:
        return
    with tempfile.TemporaryDirectory() as d:
        source, spec = Path(d) / "plan.csv", Path(d) / "plan.toml"
        source.write_text(format_torch_csv(plan))
        assert main(["import", str(source), "-o", str(spec)]) == 0
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["export", str(spec), "--to", "torch-csv", "--compute-only",
                         "--allow-unverified"])
    assert code == 0
    assert compute_order(parse_torch_csv(out.getvalue(), "x.csv").programs) == compute_order(
        parse_torch_csv(format_torch_csv(plan), "p.csv").programs)


def test_a_forward_only_plan_imports_as_forward_only_of_its_literal(capsys, tmp_path):
    source = tmp_path / "eval.json"
    source.write_text(format_plan_json(family("1f1b", 2, 3, forward_only=True).derive()))
    spec, out = round_trip(capsys, tmp_path, source, "plan-json")
    assert "forward_only(program(" in spec
    read = parse_plan_json(out, "x.json")
    assert read.forward_only and compute_order(read.programs) == compute_order(
        family("1f1b", 2, 3, forward_only=True).derive().programs)


def test_chunks_go_with_a_named_placement():
    with pytest.raises(InputError, match="chunks goes with"):
        parse_expression("program(pp=1, microbatches=1, placement=[0, 0], chunks=2, "
                         "ranks=['F0 F1 B1 B0'])")


def test_an_absurd_range_is_bad_input_not_a_hang():
    with pytest.raises(InputError, match="longer than"):
        parse_expression("program(pp=1, microbatches=1, ranks=['= 0F0..999999999999'])")


def test_activation_moves_are_refused_with_their_rank(capsys, tmp_path):
    """A literal holds compute work only: an offloaded plan (moves between device and
    host) is bad input, named at the rank's program."""
    source = tmp_path / "off.json"
    assert run(capsys, "export", "--family", "zb-h1", "--pp", "4", "--microbatches", "8",
               "--offload", "2,1", "--to", "plan-json", "-o", str(source))[0] == 0
    code, _, err = run(capsys, "import", str(source), "-o", str(tmp_path / "o.toml"))
    assert code == 2 and f"{source}: $.programs[0]: cannot import" in err
    assert "OFFLOAD" in err and not (tmp_path / "o.toml").exists()


@pytest.mark.parametrize("name, options, field", [
    ("seq1f1b", ["--seq-chunks", "2"], "seq_chunks"),
    ("dualpipe", [], "pipelines")])
def test_a_plan_a_literal_cannot_hold_is_refused_not_flattened(tmp_path, capsys, name,
                                                               options, field):
    """Sequence chunks or several pipelines: importing them as a literal term of plain
    microbatches would drop a rule (a VIOLATED plan would come back VERIFIED), so the
    field is named and nothing is written."""
    source, out = tmp_path / "plan.json", tmp_path / "out.toml"
    code, _, _ = run(capsys, "export", "--family", name, "--pp", "2", "--microbatches", "4",
                     *options, "--to", "plan-json", "--compute-only", "-o", str(source))
    assert code == 0
    code, _, err = run(capsys, "import", str(source), "-o", str(out))
    assert code == 2 and f"$.{field}: cannot import" in err and not out.exists()


def test_seq_chunks_that_split_a_sample_across_pipelines_are_bad_input(tmp_path, capsys):
    source = tmp_path / "dp.csv"
    code, _, _ = run(capsys, "export", "--family", "dualpipe", "--pp", "2", "--microbatches",
                     "6", "--to", "torch-csv", "--compute-only", "-o", str(source))
    assert code == 0
    code, _, err = run(capsys, "check", str(source), "--bidirectional", "--seq-chunks", "2")
    assert code == 2 and "a sample in one pipeline" in err
    code, _, err = run(capsys, "check", "--family", "seq1f1b", "--pp", "2", "--microbatches",
                       "2", "--seq-chunks", str(10**14))
    assert code == 2 and "--seq-chunks must be an integer from 1 to 1,000,000" in err
