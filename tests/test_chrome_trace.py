"""Chrome/Perfetto traces (``export --to chrome-trace``): valid JSON, one process per rank
with a compute and a comm track, cost-model durations, and one flow (``s``/``f`` with the
same id, each inside its comm slice) for every matched send/receive pair."""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.formats.chrome_trace import chrome_trace, dumps
from mpipe_verified.sim import timeline
from mpipe_verified.formats.torch_csv import read_torch_csv
from mpipe_verified.ir import computes_of
from mpipe_verified.lower import lower
from mpipe_verified.semantics import pair_p2p

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def export(capsys, *argv: str) -> dict:
    assert main(["export", *argv, "--to", "chrome-trace"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def by_phase(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def check_flows(trace: dict, plan) -> int:
    """Every flow start/end pair shares an id, runs src → dst, and lies in a comm slice."""
    slices = defaultdict(list)
    for e in by_phase(trace, "X"):
        slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    starts = {e["id"]: e for e in by_phase(trace, "s")}
    ends = {e["id"]: e for e in by_phase(trace, "f")}
    assert starts.keys() == ends.keys()
    assert len(starts) == len(by_phase(trace, "s"))  # ids are unique
    for fid, s in starts.items():
        f = ends[fid]
        assert f["bp"] == "e" and s["tid"] == f["tid"] == 1
        src_names = [n for t0, t1, n in slices[(s["pid"], 1)] if t0 <= s["ts"] < t1]
        dst_names = [n for t0, t1, n in slices[(f["pid"], 1)] if t0 <= f["ts"] < t1]
        assert len(src_names) == 1 and "SEND" in src_names[0]
        assert len(dst_names) == 1 and "RECV" in dst_names[0]
    return len(starts)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, None), ("interleaved-1f1b", 2, 4, 2),
                                         ("zbv", 2, 4, None), ("dualpipev", 2, 4, None)])
def test_a_flow_for_every_send_recv_pair(capsys, name, p, m, v):
    argv = ["--family", name, "--pp", str(p), "--microbatches", str(m)]
    trace = export(capsys, *argv, *(["--chunks", str(v)] if v else []))
    plan = lower(family(name, p, m, v).derive())
    pairs = sum(len(x) for x in pair_p2p(plan).channels.values())
    assert check_flows(trace, plan) == pairs > 0
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in by_phase(trace, "M")
             if e["name"] in ("process_name", "thread_name") and e["tid"] == 1
             or e["name"] == "process_name"}
    assert {names[(r, 0)] for r in range(p)} == {f"rank {r}" for r in range(p)}
    compute = [e for e in by_phase(trace, "X") if e["tid"] == 0]
    steps = sum(1 for prog in plan.programs for op in prog if computes_of(op))
    assert len(compute) == steps
    # comm slices of one rank never overlap (flows bind to exactly one slice)
    for r in range(p):
        comm = sorted((e["ts"], e["dur"]) for e in by_phase(trace, "X")
                      if e["pid"] == r and e["tid"] == 1)
        assert all(a + d <= b for (a, d), (b, _) in zip(comm, comm[1:]))


def test_cost_model_durations(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('[schedule]\nfamily = "1f1b"\npp = 2\nmicrobatches = 2\n'
                    "[cost]\nF = 1.5\nB = 4\n")
    trace = export(capsys, str(spec))
    durs = {e["name"][1]: e["dur"] for e in by_phase(trace, "X") if e["tid"] == 0}
    assert durs == {"F": 1500.0, "B": 4000.0}
    assert trace["otherData"]["makespan"] == 16.5  # 1.5 + 1.5 + 4 + 1.5 + 4 + 4


def test_compute_only_has_no_comm_track_and_writes_atomically(tmp_path, capsys):
    out = tmp_path / "deep" / "t.json"
    assert main(["export", str(EXAMPLES / "zb-h1.toml"), "--to", "chrome-trace",
                 "--compute-only", "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert {e["tid"] for e in trace["traceEvents"]} == {0}
    assert not by_phase(trace, "s") and not by_phase(trace, "f")
    assert [p.name for p in out.parent.iterdir()] == ["t.json"]


def test_a_plan_that_stops_is_traced_as_far_as_it_runs():
    plan = read_torch_csv(EXAMPLES / "broken.csv")
    trace = json.loads(dumps(chrome_trace(timeline(plan, comm_model="rendezvous"), "b")))
    meta = trace["otherData"]
    assert meta["completed"] is False
    assert sorted(b["rank"] for b in meta["blocked"]) == [0, 1, 2, 3]
    assert 0 < check_flows(trace, plan) < sum(len(x) for x in pair_p2p(plan).channels.values())
