"""SVG timelines (``formats.svg``, ``show --svg``, ``check --svg``): valid XML, one lane
per rank, one box per compute op, idle time visible, arrows and memory strips on request,
cost-model durations, and counterexamples drawn as far as the plan runs."""

from __future__ import annotations

import pathlib
import xml.etree.ElementTree as ET

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.formats.svg import render_svg
from mpipe_verified.sim import timeline
from mpipe_verified.formats.torch_csv import read_torch_csv
from mpipe_verified.ir import computes_of
from plan_edits import fixture
from mpipe_verified.lower import lower
from mpipe_verified.semantics import RENDEZVOUS, pair_p2p, standard_duration
from mpipe_verified.verify import verify

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NS = "{http://www.w3.org/2000/svg}"
CASES = [("gpipe", 2, 3, None), ("1f1b", 4, 8, None), ("interleaved-1f1b", 2, 4, 2),
         ("zb-h1", 3, 6, None), ("zbv", 2, 4, None), ("dualpipev", 2, 4, None)]


def parse(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{NS}svg"
    return root


def classes(el: ET.Element) -> set[str]:
    return set(el.get("class", "").split())


def elements(root: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in root.iter(f"{NS}{tag}") if cls in classes(e)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_one_lane_per_rank_and_one_box_per_compute_op(name, p, m, v):
    schedule = family(name, p, m, v).derive()
    root = parse(render_svg(timeline(schedule), standard_duration, title=name))
    lanes = elements(root, "g", "lane")
    assert [int(g.get("data-rank")) for g in lanes] == list(range(p))
    for rank, lane in enumerate(lanes):
        boxes = elements(lane, "rect", "op")
        ops = [c for op in schedule.programs[rank] for c in computes_of(op)]
        assert len(boxes) == len(ops)
        kinds = sorted(next(k for k in "FBIW" if k in classes(b)) for b in boxes)
        assert kinds == sorted(c.kind for c in ops)
        assert all(b.get("data-rank") == str(rank) for b in boxes)
        assert len(elements(lane, "rect", "idle")) == 1  # the hatched background
        titles = [b.find(f"{NS}title").text for b in boxes]
        assert sorted(t.split(" ")[0] for t in titles) == sorted(map(str, ops))


def test_idle_time_shows_between_boxes():
    root = parse(render_svg(timeline(family("1f1b", 4, 8).derive()), standard_duration))
    lane0 = elements(root, "g", "lane")[0]
    spans = sorted((float(b.get("x")), float(b.get("x")) + float(b.get("width")))
                   for b in elements(lane0, "rect", "op"))
    gaps = [b0 - a1 for (_, a1), (b0, _) in zip(spans, spans[1:])]
    assert max(gaps) > 1  # rank 0 waits for the first backward
    assert "idle 27%" in ET.tostring(lane0, "unicode")


def test_arrows_one_per_send_recv_pair_and_memory_strip_per_rank():
    plan = lower(family("zb-h1", 4, 8).derive())
    root = parse(render_svg(timeline(plan), standard_duration, arrows=True, memory=True,
                            memory_limit=3))
    pairs = sum(len(v) for v in pair_p2p(plan).channels.values())
    assert len(elements(root, "line", "flow")) == pairs > 0
    strips = elements(root, "g", "memory")
    assert [g.get("data-rank") for g in strips] == ["0", "1", "2", "3"]
    assert all(len(elements(g, "line", "limit")) == 1 for g in strips)
    assert "peak 4 / 3 over" in ET.tostring(strips[0], "unicode")


def test_cost_model_durations_set_box_widths(tmp_path):
    spec = tmp_path / "slow.toml"
    spec.write_text('[schedule]\nfamily = "gpipe"\npp = 2\nmicrobatches = 2\n'
                    "[cost]\nF = 2\nB = 6\n")
    out = tmp_path / "slow.svg"
    assert main(["show", str(spec), "--svg", str(out)]) == 0
    root = parse(out.read_text())
    widths = {k: {float(b.get("width")) for b in elements(root, "rect", k)} for k in "FB"}
    assert len(widths["F"]) == len(widths["B"]) == 1
    assert widths["B"].pop() == pytest.approx(3 * widths["F"].pop())
    assert "makespan 24," in out.read_text()  # F 2+2, rank 1: F 2+2, B 6+6, rank 0: B 6+6


def test_show_svg_is_deterministic_and_atomic(tmp_path, capsys):
    a, b = tmp_path / "a" / "x.svg", tmp_path / "b.svg"
    for out in (a, b):
        assert main(["show", str(EXAMPLES / "zb-h1.toml"), "--svg", str(out), "--arrows",
                     "--memory"]) == 0
    assert capsys.readouterr() == ("", "")
    assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b.svg", "x.svg"]


def test_check_svg_draws_the_deadlock_as_far_as_it_runs(tmp_path, capsys):
    out = tmp_path / "dead.svg"
    assert main(["check", str(EXAMPLES / "broken.csv"), "--svg", str(out), "--arrows"]) == 1
    assert "deadlock" in capsys.readouterr().out
    root = parse(out.read_text())
    plan = read_torch_csv(EXAMPLES / "broken.csv")
    run = timeline(plan, comm_model=RENDEZVOUS)
    blocked = elements(root, "rect", "blocked")
    assert sorted(int(r.get("data-rank")) for r in blocked) == sorted(w.rank for w in run.waits)
    cycle = {(r, i) for v in verify(plan).violations for r, i, _ in v.ops}
    marked = {(int(r.get("data-rank")), int(r.get("data-position")))
              for r in blocked if "violation" in classes(r)}
    assert marked == cycle == {(2, 5), (3, 3)}
    assert len(elements(root, "line", "waits-for")) == 2
    executed = sum(1 for r in range(plan.num_ranks) for i in range(run.executed(r))
                   if computes_of(plan.programs[r][i]))
    assert len(elements(root, "rect", "op")) == executed
    assert "wait-for cycle" in "".join(root.itertext())


def test_segments_get_their_own_shades():
    plan = fixture("one_rank_two_segments")
    root = parse(render_svg(timeline(plan), standard_duration))
    fills = {b.find(f"{NS}title").text.split(" ")[0]: b.get("fill")
             for b in elements(root, "rect", "op")}
    assert fills["vision:0F0"] != fills["llm:0F0"]
    assert "segment vision" in "".join(root.itertext())


@pytest.mark.parametrize("argv,needle", [
    (["show", "{good}", "--memory"], "--memory draws on the SVG timeline"),
    (["check", "{good}", "{good}", "--svg", "x.svg"], "--svg draws one schedule"),
])
def test_picture_usage_errors_exit_2(capsys, argv, needle):
    code = main([a.format(good=EXAMPLES / "zb-h1.toml") for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1


def test_recompute_boxes_and_segment_input_arrows_are_drawn(tmp_path, capsys):
    """A transpose source with recompute (the default mode) runs ``R`` ops and ships the
    segment's ``input``: both have a colour and a legend entry (they used to raise
    KeyError, exit 1 with a traceback)."""
    family = ["--family", "transpose", "--pp", "4", "--microbatches", "4"]
    out = tmp_path / "r.svg"
    assert main(["check", *family, "--svg", str(out), "-q"]) == 0
    root = parse(out.read_text())
    recompute = elements(root, "rect", "R")
    assert recompute and {b.get("fill") for b in recompute}.isdisjoint(
        {b.get("fill") for k in "FBIW" for b in elements(root, "rect", k)})
    assert "R recompute" in "".join(root.itertext())
    assert main(["show", *family, "--svg", str(out), "--arrows", "--memory"]) == 0
    assert capsys.readouterr() == ("", "")
    root = parse(out.read_text())
    assert elements(root, "line", "input") and elements(root, "rect", "R")
    assert "segment input send→recv" in "".join(root.itertext())
