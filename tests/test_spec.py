"""Spec files and the expression language: every example loads, ``str(term)`` reads back
to an equal term, and each kind of bad input is an InputError at the right line."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipe_verified.algebra import families, terms
from mpipe_verified.errors import InputError, ParameterError
from mpipe_verified.cost import CostModel
from mpipe_verified.formats.spec import load_spec, parse_spec
from mpipe_verified.spec import FUNCTIONS, Spec, parse_expression
from mpipe_verified.ir import Compute, Overlap, Plan
from mpipe_verified.semantics import UNIT_MEMORY, peak_memory, standard_duration

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
FAMILY_ARGS = {name: (4, 8, 2 if name == "interleaved-1f1b" else None)
               for name in families.FAMILIES}


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_family_example_loads_to_the_family_term(name):
    spec = load_spec(EXAMPLES / f"{name}.toml")
    assert spec.term == families.family(name, *FAMILY_ARGS[name])
    assert spec.schedule == spec.term.derive()
    assert spec.cost is None and spec.memory_limit is None
    assert spec.duration(Compute("B", 0, 0)) == 2.0 and spec.memory_model is UNIT_MEMORY


def test_composed_example_is_zb_h1_with_cost_and_limit():
    spec = load_spec(EXAMPLES / "composed.toml")
    assert isinstance(spec.term, terms.DeferW)
    assert spec.schedule == families.family("zb-h1", 4, 8).derive()
    assert spec.cost == CostModel(1.0, 2.0, 1.0, 1.0, (1.0, 1.0, 1.0, 1.0))
    assert spec.memory_limit == 4.0 and spec.limit_of(3) == 4.0
    peaks = peak_memory(Plan.from_schedule(spec.schedule), spec.memory_model)
    assert max(p for p, _ in peaks.values()) <= spec.memory_limit


def test_every_example_is_covered():
    names = {p.stem for p in EXAMPLES.glob("*.toml")}
    assert names >= set(families.FAMILIES) | {"composed"}
    for path in EXAMPLES.glob("*.toml"):
        load_spec(path)


def test_cost_model_durations_and_per_stage_activation():
    spec = parse_spec('[schedule]\nfamily = "zbv"\npp = 2\nmicrobatches = 4\n'
                      '[cost]\nF = 1.5\nI = 2\nactivation = [1, 2, 3, 4]\n'
                      '[memory]\nlimit = [10, 20.5]\n', "s.toml")
    assert spec.duration(Compute("F", 0, 0)) == 1.5
    assert spec.duration(Compute("W", 0, 0)) == 1.0  # default
    assert spec.duration(Overlap((Compute("F", 0, 0), Compute("I", 3, 1)))) == 3.5
    assert spec.memory_model.stored(2, "") == 3.0
    assert spec.limit_of(1) == 20.5
    assert CostModel().duration(Compute("B", 1, 1)) == standard_duration(Compute("B", 1, 1))


# ---------------------------------------------------------------- expressions


def _all_family_terms():
    for name in families.FAMILIES:
        built = 0
        for p, m in ((1, 1), (2, 4), (4, 8), (3, 7)):
            try:
                yield families.family(name, p, m)
                built += 1
            except ParameterError:  # e.g. dualpipev with m < 2p
                pass
        assert built, f"family {name!r} built no term for the round-trip cases"
    yield families.family("interleaved-1f1b", 4, 8, chunks=3)
    yield families.family("interleaved-1f1b", 2, 7)  # a short last round: even=True


@pytest.mark.parametrize("term", list(_all_family_terms()), ids=str)
def test_family_terms_round_trip(term):
    assert parse_expression(str(term)) == term


@pytest.mark.parametrize("text,expected", [
    ("gpipe(2, 4)", families.gpipe(2, 4)),
    ("one_f_one_b(pp=2, microbatches=4)", families.one_f_one_b(2, 4)),
    ("family('1f1b', pp=2, microbatches=4)", families.one_f_one_b(2, 4)),
    ("family('interleaved-1f1b', 2, 4, chunks=3)", families.interleaved_1f1b(2, 4, 3)),
    ("interleaved_1f1b(2, 4)", families.interleaved_1f1b(2, 4, 2)),
    ("defer_w(split_bw(zb_h1(2, 4)), lag=2)", terms.DeferW(terms.SplitBW(families.zb_h1(2, 4)), "2")),
    ("  restrict(\n  gpipe(2, 2), ranks=[1])", terms.Restrict(families.gpipe(2, 2), (1,))),
])
def test_expression_spellings(text, expected):
    assert parse_expression(text) == expected


_lags = st.sampled_from(["r", "0", "p-1-r", "2", "max(0, r-1)"])


def _terms() -> st.SearchStrategy:
    base = st.builds(lambda name, p, m: families.family(name, p, 2 * p + m),
                     st.sampled_from(list(families.FAMILIES)), st.integers(1, 4),
                     st.integers(0, 4))
    weave = st.builds(terms.Weave, st.integers(1, 4), st.integers(1, 6),
                      st.sampled_from(["F* B*", "F^{p-1-r} (F B)*", "F^3 <F B>* W*"]),
                      st.integers(1, 3), st.just("looped"), st.none() | st.integers(1, 3))

    def extend(inner):
        return (st.builds(terms.Seq, inner, inner) | st.builds(terms.Par, inner, inner)
                | st.builds(terms.SplitBW, inner) | st.builds(terms.MergeBW, inner)
                | st.builds(terms.DeferW, inner, _lags)
                | st.builds(terms.Restrict, inner, st.lists(st.integers(0, 5)).map(tuple))
                | st.builds(terms.Relabel, inner, st.permutations(range(4)).map(tuple)))
    return st.recursive(base | weave, extend, max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(_terms())
def test_composed_terms_round_trip(term):
    assert parse_expression(str(term)) == term


def test_expression_functions_cover_every_family():
    for name in families.FAMILIES:
        fn = "one_f_one_b" if name == "1f1b" else name.replace("-", "_")
        assert fn in FUNCTIONS


@pytest.mark.parametrize("text,column,needle", [
    ("zb_h1(4,", 6, "syntax error"),
    ("os.system('x')", 1, "unknown function 'os.system'"),
    ("__import__('os')", 1, "unknown function '__import__'"),
    ("zb_h1(pp=4, microbatches=2+2)", 26, "unsupported syntax"),
    ("zb_h1(pp='4', microbatches=8)", 10, "pp must be an integer"),
    ("zb_h1(pp=4, micro=8)", 13, "no argument 'micro'"),
    ("zb_h1(4)", 1, "needs argument 'microbatches'"),
    ("seq(zb_h1(4, 8), 3)", 18, "b must be a schedule term"),
    ("[1, 2]", 1, "expected a schedule term"),
    ("weave(2, 2, 'F* X')", 1, "pattern"),
    ("dualpipev(4, 4)", 1, "microbatches >= 2*pp"),
    ("zb_h1(pp=True, microbatches=8)", 10, "pp must be an integer, got bool True"),
    ("weave(2, 7, 'F B', even=1)", 25, "even must be True or False, got int 1"),
    ("", 1, "empty expression"),
])
def test_expression_errors_point_at_the_offending_node(text, column, needle):
    with pytest.raises(InputError) as e:
        parse_expression(text, "f.toml", 7, 1)
    assert (e.value.file, e.value.line, e.value.column) == ("f.toml", 7, column)
    assert needle in e.value.message


# ---------------------------------------------------------------- spec errors

GOOD = '[schedule]\nfamily = "zb-h1"\npp = 4\nmicrobatches = 8\n'


@pytest.mark.parametrize("text,line,needle", [
    ('[schedule]\nfamily = "zb-h1"\npp = = 4\n', 3, "malformed TOML: Invalid value"),
    ('[schedule]\nfamily = "zb-h1\n', 2, "malformed TOML"),
    ("[schedule\n", 1, "malformed TOML"),
    ('[schedule]\nfamily = "zb-h1"\npp = 4\n', 1, "schedule.microbatches is required"),
    (GOOD + "speed = 3\n", 5, "unknown key 'speed' in [schedule]; allowed keys: family, pp"),
    (GOOD + "[costs]\nF = 1\n", 5, "unknown key 'costs'; allowed tables: [schedule], [cost]"),
    (GOOD + "[cost]\nF = 1\nX = 2\n", 7, "unknown key 'X' in [cost]"),
    ("title = 'x'\n" + GOOD, 1, "unknown key 'title'"),
    ("[cost]\nF = 1\n", 1, "missing [schedule]"),
    ('[schedule]\nfamily = "zb-h1"\npp = "4"\nmicrobatches = 8\n', 3, "pp must be an integer >= 1, got str '4'"),
    ('[schedule]\nfamily = "zb-h1"\npp = 4.0\nmicrobatches = 8\n', 3, "pp must be an integer"),
    ('[schedule]\nfamily = "zb-h1"\npp = 0\nmicrobatches = 8\n', 3, "pp must be an integer >= 1"),
    ('[schedule]\nfamily = "zb-h9"\npp = 4\nmicrobatches = 8\n', 2, "unknown family 'zb-h9'; expected one of gpipe"),
    ('[schedule]\nfamily = 3\npp = 4\nmicrobatches = 8\n', 2, "unknown family 3"),
    ('[schedule]\npp = 4\nmicrobatches = 8\n', 1, "needs either family"),
    (GOOD + "expression = 'gpipe(2, 2)'\n", 2, "give either expression or family"),
    ('[schedule]\nexpression = 3\n', 2, "expression must be a string"),
    ('[schedule]\nexpression = "gpipe(2, 2"\n', 2, "syntax error"),
    ('[schedule]\nexpression = "frob(2, 2)"\n', 2, "unknown function 'frob'"),
    ('[schedule]\nexpression = """\nseq(gpipe(2, 2),\n  frob(1))"""\n', 4, "unknown function"),
    ('[schedule]\nexpression = "par(gpipe(2, 2), gpipe(2, 2))"\n', 2, "does not derive: par needs disjoint"),
    ('[schedule]\nfamily = "dualpipev"\npp = 4\nmicrobatches = 6\n', 4, "dualpipev needs microbatches >= 2*pp"),
    ('[schedule]\nfamily = "interleaved-1f1b"\npp = 4\nmicrobatches = 8\nchunks = 1\n', 5, "needs chunks >= 2"),
    ('[schedule]\nfamily = "zb-h1"\npp = 4\nmicrobatches = 8\nchunks = 2\n', 5, "zb-h1 takes no"),
    (GOOD + "[cost]\nB = 0\n", 6, "cost.B must be a positive number"),
    (GOOD + "[cost]\nB = 'fast'\n", 6, "cost.B must be a positive number, got str 'fast'"),
    (GOOD + "[cost]\nactivation = [1, 2]\n", 6, "list of 4 such numbers (one per stage)"),
    (GOOD + "[cost]\nactivation = -1\n", 6, "activation must be a number >= 0"),
    (GOOD + "[memory]\nlimit = [1, 2, 3]\n", 6, "list of 4 such numbers (one per rank)"),
    (GOOD + "[memory]\nlimit = true\n", 6, "memory.limit must be a number >= 0"),
    ("cost = 3\n" + GOOD, 1, "cost must be a table"),
    ("schedule.family = 'gpipe'\nschedule.pp = 'x'\n", 2, "schedule.pp must be"),
    ("a = 1\x00\n", 1, "binary data"),
    (GOOD + "ranks = 3\n", 5, "does not fit the declared sizes: it has 4 ranks"),
    (GOOD + "stages = 0\n", 5, "schedule.stages must be an integer >= 1"),
])
def test_spec_errors_name_file_and_line(text, line, needle):
    with pytest.raises(InputError) as e:
        parse_spec(text, "bad.toml")
    assert e.value.file == "bad.toml"
    assert e.value.line == line, str(e.value)
    assert needle in e.value.message, str(e.value)
    assert "\n" not in str(e.value)


def test_unreadable_files_are_input_errors(tmp_path):
    junk = tmp_path / "junk.toml"
    junk.write_bytes(b"[schedule]\n\x89PNG\xff\xfe")
    with pytest.raises(InputError, match="not UTF-8") as e:
        load_spec(junk)
    assert e.value.line == 2
    with pytest.raises(InputError, match="is a directory"):
        load_spec(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        load_spec(tmp_path / "missing.toml")


def test_malformed_toml_reports_column():
    with pytest.raises(InputError) as e:
        parse_spec('[schedule]\nfamily = "zb-h1"\npp = = 4\n', "x.toml")
    assert (e.value.line, e.value.column) == (3, 6)


def test_spec_of_term():
    spec = Spec.of_term(families.zb_h1(2, 4), "--family zb-h1")
    assert spec.schedule == families.zb_h1(2, 4).derive() and spec.cost is None


def test_declared_sizes_in_a_spec_make_left_out_work_a_completeness_violation():
    """``[schedule] stages``/``ranks`` (and ``microbatches`` beside an expression) are the
    sizes the derived schedule must have: a term that leaves work out is incomplete."""
    from mpipe_verified.lower import lower
    from mpipe_verified.verify import verify
    expr = 'expression = "restrict(one_f_one_b(pp=4, microbatches=4), ranks=[0, 1, 2])"\n'
    spec = parse_spec("[schedule]\n" + expr + "stages = 4\nmicrobatches = 5\n", "r.toml")
    assert (spec.schedule.placement.num_stages, spec.schedule.num_microbatches) == (4, 5)
    report = verify(lower(spec.schedule))
    missing = {v.message.split()[0] for v in report.violations
               if v.property == "completeness"}
    assert {"3F0", "0F4"} <= missing, missing
    plain = parse_spec("[schedule]\n" + expr, "r.toml")
    assert plain.schedule.num_microbatches == 4


@pytest.mark.parametrize("name", list(families.BIDIRECTIONAL))
def test_a_spec_names_a_family_of_two_pipelines(name):
    """``family = "dualpipe"`` (and the other two-pipeline families) in a spec builds the
    same term as ``--family``."""
    text = f'[schedule]\nfamily = "{name}"\npp = 4\nmicrobatches = 8\n'
    spec = parse_spec(text, "two.toml")
    assert spec.term == families.family(name, 4, 8)
    assert len(spec.schedule.pipelines) == 2
