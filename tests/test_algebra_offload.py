"""The offload modifier ``offload(t, gap=G, prefetch=P)`` (``algebra.terms.Offloaded``):
PipeOffload-style moves added to any term. Bounded laws: for every standard family at
small sizes and every setting, the offloaded plan keeps the term's verdict (complete,
dependencies met, no deadlock), each rank's device peak is at most the term's (an
activation's device lifetime only shrinks), and the reference judge agrees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mpipe_verified.algebra import FAMILIES, family
from mpipe_verified.algebra.terms import Offloaded, SplitBW, offload_program
from mpipe_verified.cli import main
from mpipe_verified.errors import ParameterError
from mpipe_verified.ir import Compute, Offload, Reload
from mpipe_verified.lower import lower
from mpipe_verified.semantics import peak_memory
from mpipe_verified.spec import parse_expression
from mpipe_verified.verify import verify
from reference import judge_plan

F, B = (lambda s, mb, k=k: Compute(k, s, mb) for k in "FB")


def test_the_rule_places_moves_by_the_gap_and_the_prefetch_distance():
    program = (F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2))
    assert offload_program(program, 2, 0) == (
        F(0, 0), Offload(0, 0), F(0, 1), Offload(0, 1), F(0, 2), Offload(0, 2),
        Reload(0, 0), B(0, 0), Reload(0, 1), B(0, 1), Reload(0, 2), B(0, 2))
    assert offload_program(program, 2, 1) == (
        F(0, 0), Offload(0, 0), F(0, 1), Offload(0, 1), Reload(0, 0), F(0, 2),
        Offload(0, 2), Reload(0, 1), B(0, 0), Reload(0, 2), B(0, 1), B(0, 2))
    assert offload_program(program, 3, 1) == program  # no backward that far away


def _instances():
    for name in sorted(FAMILIES):
        for p, m in ((2, 4), (3, 6), (4, 8)):
            try:
                yield name, family(name, p, m)
            except ParameterError:
                continue


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(_instances())), st.integers(1, 4), st.integers(0, 3),
       st.booleans())
def test_offload_keeps_the_verdict_and_never_raises_a_device_peak(instance, gap, prefetch,
                                                                   split):
    name, term = instance
    term = SplitBW(term) if split and name in ("1f1b", "gpipe") else term
    schedule = Offloaded(term, gap, prefetch).derive()
    erased = tuple(tuple(op for op in prog if not isinstance(op, (Offload, Reload)))
                   for prog in schedule.programs)
    assert erased == term.derive().programs  # it only adds moves
    plain, moved = lower(term.derive()), lower(schedule)
    report = verify(moved)
    assert report.status == "verified", (name, [v.message for v in report.violations])
    assert judge_plan(moved).ok
    before, after = peak_memory(plain), peak_memory(moved)
    assert all(after[r][0] <= before[r][0] for r in before)


def test_offload_is_a_term_of_the_expression_language_and_of_the_command_line(capsys):
    term = parse_expression("offload(family('1f1b', pp=4, microbatches=8), gap=2)")
    assert isinstance(term, Offloaded) and (term.gap, term.prefetch) == (2, 1)
    assert parse_expression(str(term)) == term
    with pytest.raises(ParameterError):
        Offloaded(term.term, 0, 1)
    # the plain 1f1b keeps 4 activations on rank 0; offloaded, 2 fit
    args = ["check", "--family", "1f1b", "--pp", "4", "--microbatches", "8",
            "--memory-limit", "2"]
    assert main(args) == 1
    assert main(args + ["--offload", "2,1"]) == 0
    assert "host peak 3" in capsys.readouterr().out
    assert main(["check", "examples/1f1b.toml", "--offload", "2"]) == 2
    assert main(["simulate", "--family", "1f1b", "--pp", "4", "--microbatches", "8",
                 "--offload", "2"]) == 0
    assert "host peak memory: 0: 3, 1: 2, 2: 1" in capsys.readouterr().out


def test_a_spec_offloads_any_term_by_its_expression(tmp_path, capsys):
    spec = tmp_path / "offload.toml"
    spec.write_text('[schedule]\nexpression = "offload(family(\'zb-h1\', pp=4, '
                    'microbatches=8), gap=1, prefetch=0)"\n\n[memory]\nlimit = 4\n')
    assert main(["check", str(spec)]) == 0
    assert "host peak" in capsys.readouterr().out
