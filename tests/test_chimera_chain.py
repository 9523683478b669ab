"""Chimera beyond its basic unit, the substitution of DualPipe's and Chimera's laws onto
real ranks, and proof modules that make no Z3 term at import.

- ``--family chimera`` at ``m > p`` chains its units as Chimera's generator
  (Shigangli/Chimera, chimera_pipeline_rank.py) chains its pipelines: the fixture's orders
  at ``m = 2p, 3p, 4p`` are the generator's, dumped by running it (the cell-for-cell
  comparison of every fixture size is tests/test_pipelines.py's); everywhere the order is
  the generator's tick (unit ``c`` of the rank's own pipeline ``2p c + 2j + d``).
- The chained block pins the clock's span to ``4n``; a wrong substitution (rank ``r``
  for its virtual rank, swapped chunks, a missing row of DualPipeV's input table) fails.
"""

from __future__ import annotations

import csv
import json
import pathlib
import subprocess
import sys

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.proofs import core, family_bidirectional, family_chimera, family_dualpipev

FB = family_bidirectional
FIXTURE = (pathlib.Path(__file__).parent / "fixtures" / "reference_orders" /
           "bidirectional.json")
ENTRY = json.loads(FIXTURE.read_text())["chimera"]
SIZES = [tuple(int(part.split("=")[1]) for part in key.split()) for key in ENTRY["orders"]]
CHAINED = [(p, m) for p, m in SIZES if m > p]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_the_fixture_holds_the_generator_s_chained_orders():
    assert ENTRY["commit"] == "6b78ac7ddeb7cc04cba1835c25e7bb8b9a3e02f0"
    assert "chimera_pipeline_rank.py" in ENTRY["file"]
    assert len(CHAINED) >= 2 and {m // p for p, m in CHAINED} >= {2, 3, 4}


@pytest.mark.parametrize("p, m", CHAINED)
def test_the_two_chain_csv_beyond_the_unit_verifies_at_the_proven_peak(p, m, tmp_path,
                                                                     capsys):
    out = tmp_path / "chimera.csv"
    assert main(["export", "--family", "chimera", "--pp", str(p), "--microbatches", str(m),
                 "--to", "torch-csv", "--compute-only", "-o", str(out)]) == 0
    with open(out, newline="") as f:
        assert list(csv.reader(f)) == ENTRY["orders"][f"pp={p} microbatches={m}"]
    capsys.readouterr()
    assert main(["check", str(out), "--bidirectional", "--json"]) == 0
    peaks = json.loads(capsys.readouterr().out)["peak_memory"]
    assert [peaks[str(r)] for r in range(p)] == [FB.peak_of("chimera", p, r)
                                                 for r in range(p)]


def _tick_order(p, m):
    """Each rank's ops sorted by the generator's tick: unit ``c``'s microbatch ``j`` of a
    pipeline whose stage on the rank is at depth ``d`` runs F at ``2p c + 2j + d``, B at
    ``2p c + 2j + 2p-1-d`` (no two on one rank share a tick)."""
    n, out = p // 2, []
    for r in range(p):
        ops = {}
        for c in range(m // p):
            for j in range(n):
                for down in (True, False):
                    d = r if down else p - 1 - r
                    stage, mb = (r, c * n + j) if down else (2 * p - 1 - r, m // 2 + c * n + j)
                    ops[2 * p * c + 2 * j + d] = ("F", stage, mb)
                    ops[2 * p * c + 2 * j + 2 * p - 1 - d] = ("B", stage, mb)
        assert len(ops) == 2 * m
        out.append([ops[t] for t in sorted(ops)])
    return out


def test_the_units_chain_at_the_generator_s_tick_at_every_size():
    """Also where the generator's per-tick schedule loses ops (p >= 6, m >= 3p; p = 2)."""
    for p in (2, 4, 6, 8, 10):
        for k in range(1, 6):
            programs = family("chimera", p, k * p).derive().programs
            assert [[(op.kind, op.stage, op.mb) for op in prog] for prog in programs] \
                == _tick_order(p, k * p), (p, k)


def _status(law_) -> str:
    return core.run_all([law_], jobs=1)[0].status


@pytest.mark.parametrize("delta", [-1, 1])
def test_the_chained_block_pins_the_unit_span(monkeypatch, delta):
    """Unit u+1's clock 4n - 1 or 4n + 1 after unit u's: a B0 F0 pair of a block runs out
    of order."""
    monkeypatch.setattr(family_chimera, "SPAN", 4 * family_chimera.n + delta)
    assert _status(FB.chimera_dependency) == core.FAILED


def test_a_substitution_onto_the_wrong_virtual_rank_fails(monkeypatch):
    """Rank r read as virtual rank r (not min(r, p-1-r)): the real sizes do not give the
    V's (r < n)."""
    monkeypatch.setattr(FB, "dualpipe_sigma", lambda s: (
        (family_dualpipev.p, s.N), (family_dualpipev.m, s.M2), (family_dualpipev.r, s.R)))
    result = core.run_all([FB.dualpipe_memory], jobs=1)[0]
    assert result.status == core.FAILED
    assert "the real sizes give the V's at the substitution" in result.detail


def test_a_substitution_with_swapped_chunks_fails(monkeypatch):
    monkeypatch.setattr(FB, "v_stage", lambda p, r, c: r if c == 1 else 2 * p - 1 - r)
    assert _status(FB.dualpipe_completeness) == core.FAILED


def test_a_real_input_missing_from_dualpipev_s_table_fails(monkeypatch):
    """Without the turn (F1(p-1) after F0(p-1)), the input joining the middle ranks is
    no row of the V's table."""
    rows = family_dualpipev._edges()
    monkeypatch.setattr(family_dualpipev, "_edges",
                        lambda: tuple(e for e in rows if not e[0].startswith("F1(p-1)")))
    assert _status(FB.dualpipe_dependency) == core.FAILED


AST_COUNT = """
import importlib, importlib.util, sys, types
import z3
made = [0]
init = z3.AstRef.__init__
def counting(self, *a, **k):
    made[0] += 1
    init(self, *a, **k)
z3.AstRef.__init__ = counting
spec = importlib.util.find_spec("mpipe_verified.proofs")
package = types.ModuleType("mpipe_verified.proofs")  # not its __init__: every law
package.__path__ = list(spec.submodule_search_locations)
sys.modules["mpipe_verified.proofs"] = package
for dep in ("core", "word", "model", "shape", "lowered", "family_zbv", "family_dualpipev"):
    importlib.import_module("mpipe_verified.proofs." + dep)
before = made[0]
importlib.import_module("mpipe_verified.proofs.family_bidirectional")  # and family_chimera
print(made[0] - before, before)
"""


def test_importing_the_bidirectional_proofs_makes_no_z3_term():
    """Their symbols and words are built when a law runs (so they cannot change the Z3
    step counts of other laws in one process); the count is of Z3 AST wrappers made
    while importing them, their dependencies imported first."""
    done = subprocess.run([sys.executable, "-c", AST_COUNT], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made, before = map(int, done.stdout.split())
    assert made == 0 and before > 0
