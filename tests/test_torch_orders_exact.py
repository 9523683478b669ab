"""Exactness of the families that reproduce a published order, against DATA.

- ``tests/fixtures/torch_orders/``: per-rank compute orders dumped from torch 2.13's own
  schedule classes (``manifest.json`` names the torch build and the command of each
  file). ``export --family F ... --to torch-csv --compute-only`` equals each file cell
  for cell once torch's idle cells (empty cells: its step grid) are dropped; torch's
  DualPipeV dump has no idle cells, so there the text is equal line for line.
- DeepSeek's DualPipeV (github deepseek-ai/DualPipe, ``dualpipe/dualpipev.py`` at commit
  3da1bbea53606543d7f5f232338fc58096db30e3, ``DualPipeV.step``): its eight steps,
  restated below as data (``deepseek_dualpipev``), give torch's fixture and our term.
- torch's test zoo (pytorch/pytorch ``test/distributed/pipelining/schedule_registry.py``
  at commit 18cadce2f3ccf73698a5ce291c5389c82a3fe53f): ``ScheduleUnbalanced`` (stages
  {0, 1, 4} on rank 0, {2, 3} on rank 1) and ``ScheduleVShaped``, one microbatch, are
  weave terms over explicit stage-to-rank maps.
- Hanayo: no public generator was found (the paper's code is not published); the term
  follows the paper's description and is checked valid, not exact.
"""

from __future__ import annotations

import json
import pathlib
from collections import deque

import pytest

import reference
from mpipe_verified.algebra.families import family
from mpipe_verified.algebra.terms import Weave
from mpipe_verified.cli import main
from mpipe_verified.ir import Placement
from mpipe_verified.lower import lower
from mpipe_verified.spec import parse_expression

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "torch_orders"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())


def export_rows(capsys, name: str, p: int, m: int, chunks: int | None) -> list[str]:
    argv = ["export", "--family", name, "--pp", str(p), "--microbatches", str(m),
            "--to", "torch-csv", "--compute-only"]
    argv += [] if chunks is None else ["--chunks", str(chunks)]
    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("file", sorted(MANIFEST["files"]))
def test_export_equals_torch_cell_for_cell(capsys, file):
    meta = MANIFEST["files"][file]
    theirs = (FIXTURES / file).read_text().splitlines()
    ours = export_rows(capsys, meta["family"], meta["pp"], meta["microbatches"],
                       meta.get("chunks"))
    assert len(ours) == len(theirs) == meta["pp"]
    for row, their_row in zip(ours, theirs):
        assert "" not in row.split(",")
        assert row.split(",") == [c for c in their_row.split(",") if c]
    if meta["family"] == "dualpipev":
        assert ours == theirs  # no idle cells in torch's DualPipeV dump: the same text


def _stage(p: int, r: int, chunk: int) -> int:
    return r if chunk == 0 else 2 * p - 1 - r


def deepseek_dualpipev(p: int, m: int, r: int) -> list[str]:
    """Rank ``r``'s compute order in DeepSeek's ``DualPipeV.step`` (torch CSV cells): its
    eight steps as counts, a ``B`` with zero bubble on being an ``I`` whose ``W`` waits
    in a FIFO queue that each weight step pops."""
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    queue: deque = deque()

    def take(kind: str, chunk: int, split: bool = False) -> str:
        mb = nxt[(kind, chunk)]
        nxt[(kind, chunk)] += 1
        if split:
            queue.append((chunk, mb))
            kind = "I"
        return f"{_stage(p, r, chunk)}{kind}{mb}"

    def weight() -> str:
        chunk, mb = queue.popleft()
        return f"{_stage(p, r, chunk)}W{mb}"

    def both(f: str, b: str) -> str:
        return f"({f};{b})OVERLAP_F_B"

    out: list[str] = []
    out += [take("F", 0) for _ in range(2 * (p - r - 1))]               # 1: nF0
    for _ in range(r + 1):                                               # 2: nF0F1
        out += [take("F", 0), take("F", 1)]
    for _ in range(p - r - 1):                                           # 3: nB1W1F1
        out += [take("B", 1, split=True), weight(), take("F", 1)]
    for i in range(m - 2 * p + r + 1):                                   # 4: main
        if i == 0 and r == p - 1:  # the last rank does not overlap its first pair
            out += [take("F", 0), take("B", 1)]
        else:
            out.append(both(take("F", 0), take("B", 1)))
        out.append(both(take("F", 1), take("B", 0)))
    for _ in range(p - r - 1):                                           # 5: nB1F1B0
        out.append(take("B", 1))
        out.append(both(take("F", 1), take("B", 0)))
    split = False
    for i in range(r + 1):                                               # 6: nB1B0
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        out.append(take("B", 1, split))
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        out.append(take("B", 0, split))
    for _ in range(p - r - 1):                                           # 7: nWB0
        out += [weight(), take("B", 0, split=True)]
    out += [weight() for _ in range(r + 1)]                              # 8: nW
    assert not queue
    return out


@pytest.mark.parametrize("file", [f for f in sorted(MANIFEST["files"])
                                  if MANIFEST["files"][f]["family"] == "dualpipev"])
def test_deepseek_dualpipev_equals_torch_fixture(file):
    meta = MANIFEST["files"][file]
    p, m = meta["pp"], meta["microbatches"]
    theirs = (FIXTURES / file).read_text().splitlines()
    assert [",".join(deepseek_dualpipev(p, m, r)) for r in range(p)] == theirs


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6])
def test_dualpipev_term_equals_deepseek(p):
    for m in range(2 * p, 3 * p + 2):
        ours = family("dualpipev", p, m).derive()
        assert [[str(op) for op in prog] for prog in ours.programs] == \
            [deepseek_dualpipev(p, m, r) for r in range(p)], (p, m)


# pytorch/pytorch test/distributed/pipelining/schedule_registry.py @ 18cadce2: the
# pipeline_order of each zoo schedule without its idle (None) steps.
TORCH_ZOO = {
    "ScheduleUnbalanced": ("0,0,1,1,0", 3, [["0F0", "1F0", "4F0", "4B0", "1B0", "0B0"],
                                            ["2F0", "3F0", "3B0", "2B0"]]),
    "ScheduleVShaped": ("0,1,1,0", 2, [["0F0", "3F0", "3B0", "0B0"],
                                       ["1F0", "2F0", "2B0", "1B0"]]),
}


@pytest.mark.parametrize("name", sorted(TORCH_ZOO))
def test_torch_zoo_maps_are_terms(name):
    stage_map, chunks, rows = TORCH_ZOO[name]
    term = Weave(2, 1, "F* B*", chunks=chunks, placement=stage_map)
    schedule = term.derive()
    assert schedule.placement.stage_to_rank == tuple(int(x) for x in stage_map.split(","))
    assert [[str(op) for op in prog] for prog in schedule.programs] == rows
    assert parse_expression(str(term)) == term
    assert reference.run_plan(lower(schedule)).ok


def test_an_unbalanced_map_runs_at_any_microbatch_count():
    for m in (1, 2, 5):
        term = Weave(2, m, "F* B*", chunks=3, placement="0,0,1,1,0")
        assert reference.run_plan(lower(term.derive())).ok


def test_orders_round_trip_and_mean_what_they_say():
    term = Weave(2, 3, "F* B*", chunks=2, order="bfs", backward="desc")
    assert "order='bfs'" in str(term) and "backward='desc'" in str(term)
    assert parse_expression(str(term)) == term
    rank0 = [str(op) for op in term.derive().programs[0]]
    assert rank0 == ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2",
                     "2B2", "2B1", "2B0", "0B2", "0B1", "0B0"]
    dfs = Weave(2, 3, "F* B*", chunks=2, group=2, backward="desc").derive()
    assert [str(op) for op in dfs.programs[0]][6:] == ["2B1", "2B0", "0B1", "0B0", "2B2", "0B2"]


def test_zigzag_is_down_up_down():
    assert Weave(3, 1, "F* B*", chunks=4, placement="zigzag").derive().placement == \
        Placement((0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0), 3)
    assert family("hanayo", 4, 8, waves=1).derive().placement == Placement.vshape(4)


@pytest.mark.parametrize("waves", [1, 2, 3])
def test_hanayo_is_valid(waves):
    for p in (1, 2, 3, 4):
        for m in (1, p, p + 1, 2 * p, 3 * p):
            schedule = family("hanayo", p, m, waves=waves).derive()
            assert schedule.placement.num_stages == 2 * waves * p
            assert reference.run_plan(lower(schedule)).ok, (p, m, waves)


@pytest.mark.parametrize("stage_map, needle", [
    ("0,2,1", "entry 2 ('2') is not a rank of 0..1"),
    ("0,x", "entry 2 ('x') is not a rank"),
    ("0,1,1,0,1", "5 entries; pp=2, chunks=2 needs 2 to 4"),
    ("0,0", "rank 1 holds no stage"),
    ("0,0,0,1", "entry 3 puts stage 3 on rank 0, beyond chunks=2"),
])
def test_a_bad_map_exits_2_with_the_position(capsys, tmp_path, stage_map, needle):
    spec = tmp_path / "bad.toml"
    spec.write_text('[schedule]\nexpression = "weave(pp=2, microbatches=2, pattern=\\"F* B*\\", '
                    f'chunks=2, placement=\\"{stage_map}\\")"\n')
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"{spec}:2:" in err and needle in err


@pytest.mark.parametrize("argv, needle", [
    (["--family", "hanayo", "--chunks", "2"], "hanayo takes --waves, not --chunks"),
    (["--family", "zbv", "--waves", "2"], "zbv takes no --waves"),
    (["--family", "hanayo", "--waves", "0"], "hanayo needs waves >= 1"),
    (["--family", "interleaved-zb", "--chunks", "1"], "interleaved-zb needs chunks >= 2"),
])
def test_family_options_bad_usage_exits_2(capsys, argv, needle):
    assert main(["show", *argv, "--pp", "2", "--microbatches", "4"]) == 2
    assert needle in capsys.readouterr().err
