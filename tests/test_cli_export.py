"""``mpipe-verify export``: the torch markers it adds (the same cells as the quadratic
algorithm they replace, in linear time) and its verdict gate (a plan that does not verify
is refused unless ``--allow-unverified``)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_verified.algebra import families
from mpipe_verified.cli import main
from mpipe_verified.formats import torch_csv
from mpipe_verified.formats.torch_csv import (format_torch_csv, parse_torch_csv,
                                              with_torch_markers)
from mpipe_verified.ir import (ACT, GRAD, Compute, Idle, Marker, Op, Overlap, Payload, Recv,
                               Send, computes_of)
from mpipe_verified.lower import lower

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


# ------------------------------------------------- the markers: reference algorithm

def reference_with_markers(program: tuple[Op, ...], m: int) -> tuple[Op, ...]:
    """The algorithm ``torch_csv._with_markers`` had before it was made linear, kept
    verbatim: each computing step rescans every step after it (``_next_stages``), so a
    rank that computes fewer than three stages scans to its end every time."""
    steps = [tuple(dict.fromkeys(c.stage for c in computes_of(op))) for op in program]
    backwards: dict[int, int] = {}
    last: dict[int, int] = {}
    for index, op in enumerate(program):
        for c in computes_of(op):
            if c.kind in ("B", "W"):
                backwards[c.stage] = backwards.get(c.stage, 0) + 1
                if backwards[c.stage] == m:
                    last[c.stage] = index
    reduce_after: dict[int, list[int]] = {}
    for stage, index in last.items():
        while index + 1 < len(program) and type(program[index + 1]) is Send:
            index += 1
        reduce_after.setdefault(index, []).append(stage)
    out: list[Op] = []
    active: list[int] = []
    for index, op in enumerate(program):
        if steps[index]:
            upcoming = _next_stages(steps[index:])
            for stage in sorted(s for s in active if s not in upcoming):
                active.remove(stage)
                out.append(Marker(stage, "RESHARD"))
            for stage in [s for s in upcoming if s not in active]:
                active.append(stage)
                out.append(Marker(stage, "UNSHARD"))
        out.append(op)
        out.extend(Marker(stage, "REDUCE_GRAD") for stage in reduce_after.get(index, ()))
    out.extend(Marker(stage, "RESHARD") for stage in sorted(active))
    return tuple(out)


def _next_stages(steps: list[tuple[int, ...]]) -> list[int]:
    seen: list[int] = []
    for stages in steps:
        fresh = [s for s in stages if s not in seen]
        seen.extend(fresh if len(stages) > 1 else fresh[:1])
        if len(seen) >= torch_csv.PREFETCH_STAGES:
            break
    return seen


def reference_plan(plan):
    programs = tuple(reference_with_markers(p, plan.num_microbatches) for p in plan.programs)
    return plan.__class__(plan.placement, plan.num_microbatches, programs, plan.cut,
                          plan.forward_only)


SIZES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 8), (5, 3), (8, 16)]
FAMILY_CASES = [(name, p, m, None) for name in families.FAMILIES if name != "interleaved-1f1b"
                for p, m in SIZES]
FAMILY_CASES += [("interleaved-1f1b", p, m, v) for v in (2, 3, 4) for p, m in SIZES]


@pytest.mark.parametrize("name,p,m,v", FAMILY_CASES)
def test_family_markers_equal_the_reference(name, p, m, v):
    if name == "dualpipev":
        m = max(m, 2 * p)  # its least size
    plan = lower(families.family(name, p, m, v).derive())
    ours = with_torch_markers(plan)
    assert ours == reference_plan(plan)
    assert format_torch_csv(ours) == format_torch_csv(reference_plan(plan))


def test_torch_csv_inputs_markers_equal_the_reference():
    """Files read as written: overlapped steps (dualpipev) and the examples' CSV."""
    for path in sorted(EXAMPLES.glob("*.csv")):
        plan = parse_torch_csv(path.read_text(), str(path))
        plan = torch_csv.without_markers(plan)
        assert with_torch_markers(plan) == reference_plan(plan)


def _op(draw, stages: int, mbs: int) -> Op:
    kind = draw(st.sampled_from(["F", "B", "I", "W", "overlap", "send", "recv", "idle"]))
    compute = st.builds(Compute, st.sampled_from("FBIW"), st.integers(0, stages - 1),
                        st.integers(0, mbs - 1))
    if kind in "FBIW":
        return Compute(kind, draw(st.integers(0, stages - 1)), draw(st.integers(0, mbs - 1)))
    if kind == "overlap":  # may repeat a stage, or hold more than two computes
        return Overlap(tuple(draw(st.lists(compute, min_size=1, max_size=4))))
    if kind == "idle":
        return Idle()
    payload = Payload(draw(st.sampled_from([ACT, GRAD])), draw(st.integers(1, 5)), 0)
    return Send(0, payload) if kind == "send" else Recv(0, payload)


@st.composite
def programs(draw):
    """A rank's program of random steps (any stage, repeats, overlaps, sends, idle
    steps) and a microbatch count for its REDUCE_GRAD cells."""
    stages, mbs = draw(st.integers(1, 7)), draw(st.integers(1, 4))
    ops = tuple(_op(draw, stages, mbs) for _ in range(draw(st.integers(0, 60))))
    return ops, draw(st.integers(1, 4))


@given(programs())
def test_any_program_gets_the_reference_markers(case):
    program, m = case
    assert torch_csv._with_markers(program, m) == reference_with_markers(program, m)


def lines_run(program: tuple[Op, ...], m: int) -> int:
    """The lines of ``torch_csv`` that ``_with_markers(program, m)`` executes (its
    comprehensions' iterations included): its work, counted the same on any machine."""
    count = 0
    here = torch_csv.__file__

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == here else None

    old = sys.gettrace()  # a coverage tracer, say: back after the count
    sys.settrace(calls)
    try:
        torch_csv._with_markers(program, m)
    finally:
        sys.settrace(old)
    return count


def two_stages(n: int) -> tuple[Op, ...]:
    """One rank computing two stages, ``2 n`` steps: the reference rescans to the end at
    every step (``_next_stages`` never finds three stages)."""
    return tuple(op for mb in range(n) for op in (Compute("F", 0, mb), Compute("F", 1, mb)))


def test_markers_are_linear_in_the_steps():
    """Work counted, not timed: twice the steps cost at most 2.2 times the lines executed
    (49 lines a step and 37 more; the reference's rescans cost about 4 times, and 120k
    steps of them about 7 * 10^9 steps visited). Then, at 120k steps, no list the pass
    cuts holds more than PREFETCH_STAGES pairs, and the markers are right."""
    n = 1000
    small, double = lines_run(two_stages(n), n), lines_run(two_stages(2 * n), 2 * n)
    assert double <= 2.2 * small, (small, double)
    n = 60_000
    program = two_stages(n)
    longest = []
    cut = torch_csv._cut
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_csv, "_cut", lambda pairs: longest.append(len(pairs)) or cut(pairs))
        out = torch_csv._with_markers(program, n)
    assert len(longest) == 2 * n  # once a computing step
    assert max(longest) <= torch_csv.PREFETCH_STAGES
    assert out == ((Marker(0, "UNSHARD"), Marker(1, "UNSHARD")) + program[:-1]
                   + (Marker(0, "RESHARD"), program[-1], Marker(1, "RESHARD")))


# ------------------------------------------------------------- the verdict gate

def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("to", ["torch-csv", "plan-json"])
def test_a_violated_plan_is_refused_and_nothing_written(capsys, tmp_path, to):
    out_file = tmp_path / "out" / "broken.csv"
    code, out, err = run(capsys, "export", str(EXAMPLES / "broken.toml"), "--to", to,
                         "-o", str(out_file))
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and err.startswith("mpipe-verify: ")
    assert "broken.toml: VIOLATED (memory)" in err and "--allow-unverified" in err
    assert not out_file.exists() and not out_file.parent.exists()
    code, out, err = run(capsys, "export", str(EXAMPLES / "broken.toml"), "--to", to)
    assert (code, out) == (1, "")  # nor to stdout


def test_a_violated_csv_is_refused(capsys):
    code, out, err = run(capsys, "export", str(EXAMPLES / "broken.csv"), "--to", "torch-csv")
    assert (code, out) == (1, "")
    assert "broken.csv: VIOLATED (deadlock)" in err


def test_allow_unverified_writes_it_with_a_warning(capsys, tmp_path):
    out_file = tmp_path / "broken.csv"
    code, out, err = run(capsys, "export", str(EXAMPLES / "broken.toml"), "--to", "torch-csv",
                         "-o", str(out_file), "--allow-unverified")
    assert (code, out) == (0, "")
    assert err.count("\n") == 1
    assert err.startswith("mpipe-verify: warning: ") and "VIOLATED (memory)" in err
    code, written, _ = run(capsys, "export", str(EXAMPLES / "broken.toml"), "--to",
                           "torch-csv", "--allow-unverified")
    assert code == 0 and out_file.read_bytes().decode() == written
    # what was written is that plan (a CSV carries no limit: the spec's is given again)
    assert main(["check", "-q", str(out_file), "--memory-limit", "4"]) == 1


def test_an_undecided_plan_exits_3_unless_allowed(capsys, tmp_path, monkeypatch):
    import mpipe_verified.check as spine  # where export's check looks verify up
    from mpipe_verified.verify import verify
    monkeypatch.setattr(spine, "verify", lambda *a, **k: verify(*a, **{**k, "rlimit": 1}))
    out_file = tmp_path / "z.csv"
    argv = ["export", str(EXAMPLES / "broken.csv"), "--to", "torch-csv", "-o", str(out_file)]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (3, "") and "UNDECIDED" in err and not out_file.exists()
    code, out, err = run(capsys, *argv, "--allow-unverified")
    assert code == 0 and out_file.exists() and "warning: " in err and "UNDECIDED" in err


@pytest.mark.parametrize("argv", [
    [str(EXAMPLES / "zb-h1.toml")],
    ["--family", "interleaved-1f1b", "--pp", "4", "--microbatches", "8", "--chunks", "2"],
    ["--family", "zbv", "--pp", "4", "--microbatches", "8"],
])
def test_a_verified_plan_is_written_silently(capsys, tmp_path, argv):
    out_file = tmp_path / "ok.csv"
    code, out, err = run(capsys, "export", *argv, "--to", "torch-csv", "-o", str(out_file))
    assert (code, out, err) == (0, "", "")
    assert main(["check", "-q", str(out_file)]) == 0
    code, out, err = run(capsys, "export", *argv, "--to", "torch-csv", "--allow-unverified")
    assert (code, err) == (0, "") and out.encode() == out_file.read_bytes()


def test_chrome_trace_draws_any_plan(capsys):
    code, out, err = run(capsys, "export", str(EXAMPLES / "broken.toml"), "--to",
                         "chrome-trace")
    assert (code, err) == (0, "")
    names = {e["name"] for e in json.loads(out)["traceEvents"] if e.get("ph") == "X"}
    assert {"0F0", "3I7", "3W7"} <= names, sorted(names)[:10]  # the violated plan, drawn


def test_bad_input_still_exits_2_before_any_verdict(capsys, tmp_path):
    code, out, err = run(capsys, "export", "--family", "transpose", "--pp", "2",
                         "--microbatches", "2", "--to", "torch-csv")
    assert (code, out) == (2, "") and err.startswith("mpipe-verify: error: ")
