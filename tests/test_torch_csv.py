"""Torch pipelining CSV: byte-exact round trips of torch's own dumps, the writer's
contract, and one InputError (with position) per kind of bad input."""

from __future__ import annotations

import io
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipe_verified.errors import InputError
from mpipe_verified.formats import torch_csv_fast
from mpipe_verified.formats.torch_actions import MAX_INDEX
from mpipe_verified.formats.torch_csv import (_parse_general, format_torch_csv, parse_torch_csv,
                                              read_torch_csv, write_torch_csv)
from mpipe_verified.formats.torch_csv_fast import parse_plain
from mpipe_verified.ir import (ACT, GRAD, Collective, Compute, Group, Idle, Marker, Overlap,
                               Payload, Placement, Plan, Recv, Schedule, Send)
from plan_edits import fixture
from torch_fixtures import FORMATS, LOOPED, VSHAPE, torch_schedule_csv, torch_schedules

CASES = [(name, p, m, v, fmt)
         for fmt in FORMATS
         for p in (2, 4)
         for m in (2 * p, 3 * p)
         for name, v in [*((n, 2) for n in LOOPED + VSHAPE), ("Interleaved1F1B", 1),
                         ("InterleavedZeroBubble", 1), ("LoopedBFS", 3), ("GPipe", 1)]]
CASES += [("1F1B", p, 2 * p, 1, "compute_only") for p in (2, 4)]


@pytest.mark.parametrize("name,p,m,v,fmt", CASES)
def test_torch_dump_round_trips_byte_for_byte(tmp_path, name, p, m, v, fmt):
    text = torch_schedule_csv(name, p, m, v, fmt)
    src, dst = tmp_path / "torch.csv", tmp_path / "ours.csv"
    src.write_bytes(text.encode())
    plan = read_torch_csv(str(src))
    write_torch_csv(plan, str(dst))
    assert dst.read_bytes() == src.read_bytes()
    assert format_torch_csv(parse_torch_csv(text, "x.csv")) == text
    assert plan.has_comms() == (fmt == "compute_comms")
    assert plan.num_ranks == p
    expected = Placement.vshape(p) if name in VSHAPE else Placement.looped(p, v)
    assert plan.placement == expected
    if name != "1F1B":  # torch's 1F1B order runs F{m} on the last rank (a torch bug)
        assert plan.num_microbatches == m
    fast = parse_plain(text)  # every dump without overlaps takes the one-pass path
    assert (fast is None) == ("OVERLAP" in text)
    assert fast is None or fast == _parse_general(text, "x.csv") == plan


def _same_plan_on_both_paths(text: str) -> None:
    """The one-pass path builds what the general path builds, and declines (``None``)
    whatever the general path rejects; read in pieces of a few bytes (many rows split
    between the lexer's chunks) it builds the same."""
    fast = parse_plain(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_csv_fast, "_CHUNK", 5)
        assert parse_plain(text) == fast
    try:
        general = _parse_general(text, "x.csv")
    except InputError:
        assert fast is None
        return
    assert fast is None or fast == general


PLAIN = [  # (text, whether the one-pass path reads it): both paths build the same plan
    ("0F999999,0B999999\r\n", True),
    ("0F1000000\r\n", False),  # seven digits: the general path's bound, not the plain form
    ("0F0,0UNSHARD,0RESHARD,0REDUCE_GRAD,0REDUCE_GRAD7\n", True),
    ("0F0,0SEND_F0,0F1\n1RECV_F0,,1RECV_F1\n", True),
    ("0SEND_F0,0RECV_B0\n1RECV_F0,1SEND_B0\n", True),
    ("0F0\n\n\n2F0,,\n1F0\n", True),  # empty rows have no cell, trailing cells are idle
    ("0F0\n1F0", True),  # no last line end
    ("0F00\n", False), ("00F0\n", False), ("0F0F0\n", False), ("F0\n", False),
    ("0f0\n", False), ("0SEND_F\n", False), ("0SEND_X0\n", False), ("0FF0\n", False),
    ("0REDUCE_GRADX\n", False), ("0UNSHARDUNSHARD\n", False), ("0F0,0B1 \n", False),
    ("0F0\r\n1F0\n", False), ("0F0\r1F0\n", False), ("0F٣\n", False), ("0F0;\n", False),
]


@pytest.mark.parametrize("text,plain", PLAIN)
def test_one_pass_path_reads_exactly_the_plain_form(text, plain):
    assert (parse_plain(text) is not None) == plain
    _same_plan_on_both_paths(text)


def test_one_pass_path_shares_one_payload_per_transfer():
    plan = parse_plain(torch_schedule_csv("Interleaved1F1B", 4, 8, 2, "compute_comms"))
    ends: dict = {}
    for program in plan.programs:
        for op in program:
            if isinstance(op, (Send, Recv)):
                ends.setdefault(op.payload, set()).add(id(op.payload))
    assert ends and all(len(ids) == 1 for ids in ends.values())
    assert sum(isinstance(op, (Send, Recv)) for prog in plan.programs for op in prog) == \
        2 * len(ends)


def test_cells_map_to_ops():
    plan = parse_torch_csv(torch_schedule_csv("DualPipeV", 2, 4, 2, "compute_comms"), "d.csv")
    rank0 = plan.programs[0]
    assert rank0[:4] == (Marker(0, "UNSHARD"), Marker(3, "UNSHARD"), Compute("F", 0, 0),
                         Send(1, Payload(ACT, 0, 0)))
    assert Recv(1, Payload(ACT, 2, 0)) in rank0  # 3RECV_F0: stage 2 lives on rank 1
    assert Recv(1, Payload(GRAD, 1, 0)) in rank0  # 0RECV_B0: stage 1 lives on rank 1
    assert Send(1, Payload(GRAD, 3, 1)) in rank0  # 3SEND_B1 goes to stage 2 on rank 1
    assert Overlap((Compute("F", 0, 3), Compute("B", 3, 1))) in rank0
    assert Marker(3, "REDUCE_GRAD") in rank0


def test_idle_and_empty_rows_survive():
    text = ",0F0,,\r\n\r\n\"\"\r\n1F0,1B0\r\n"
    plan = parse_torch_csv(text, "x.csv")
    assert plan.programs == ((Idle(), Compute("F", 0, 0), Idle(), Idle()), (), (Idle(),),
                             (Compute("F", 1, 0), Compute("B", 1, 0)))
    assert plan.placement == Placement((0, 3), 4)
    assert format_torch_csv(plan) == text


def test_lenient_spellings_are_written_canonically():
    plan = parse_torch_csv(' 0F0 ,"0B0",\t\n( 1F1 ; 1B1 )OVERLAP_F_B', "x.csv")
    assert plan.programs == ((Compute("F", 0, 0), Compute("B", 0, 0), Idle()),
                             (Overlap((Compute("F", 1, 1), Compute("B", 1, 1))),))
    assert format_torch_csv(plan) == "0F0,0B0,\r\n(1F1;1B1)OVERLAP_F_B\r\n"


# ---------------------------------------------------------------- writing

def _plan() -> Plan:
    return fixture("markers_overlap_idle")


TEXT = ("0UNSHARD,0F0,0SEND_F0,,0RECV_B0,0B0,0REDUCE_GRAD\r\n"
        "1RECV_F0,(1F0;1B0)OVERLAP_F_B,1SEND_B0,\r\n")


def test_write_to_path_and_stream(tmp_path):
    assert format_torch_csv(_plan()) == TEXT
    out = tmp_path / "plan.csv"
    write_torch_csv(_plan(), out)
    assert out.read_bytes() == TEXT.encode()
    assert os.listdir(tmp_path) == ["plan.csv"]
    buf = io.StringIO(newline="")
    write_torch_csv(_plan(), buf)
    assert buf.getvalue() == TEXT
    assert parse_torch_csv(TEXT, "x.csv") == _plan()


def test_torch_reads_our_cells_as_we_wrote_them():
    S = torch_schedules()
    for cell in TEXT.replace("\r\n", ",").split(","):
        action = S._Action.from_str(cell)
        assert ("" if action is None else str(action)) == cell


def test_write_accepts_schedule():
    sched = Schedule(Placement.looped(2), 2, ((Compute("F", 0, 0), Idle(), Compute("F", 0, 1)),
                                               (Idle(), Compute("F", 1, 0))))
    assert format_torch_csv(sched) == "0F0,,0F1\r\n,1F0\r\n"


@pytest.mark.parametrize("op", [
    Group((Send(1, Payload(ACT, 0, 0)),)),
    Collective("all_reduce", (0, 1)),
    Compute("F", 0, 0, segment="vision"),
    Send(0, Payload(ACT, 0, 0)),  # stage 1 lives on rank 1, not 0
    Send(1, Payload(ACT, 1, 0)),  # there is no stage 2
])
def test_writer_rejects_what_the_format_cannot_say(tmp_path, op):
    plan = Plan(Placement((0, 1), 2), 1, ((op,), ()))
    out = tmp_path / "plan.csv"
    out.write_text("old")
    with pytest.raises(ValueError):
        write_torch_csv(plan, out)
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["plan.csv"]


def test_failed_replace_leaves_old_file(tmp_path, monkeypatch):
    out = tmp_path / "plan.csv"
    out.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_torch_csv(_plan(), out)
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["plan.csv"]


# -------------------------------------------------------------- bad input

BAD = [  # (text, line, column, words in the message)
    ("", None, None, "empty file"),
    ("\r\n\r\n", None, None, "no actions"),
    (",,\r\n,\r\n", None, None, "no actions"),
    ("0F0,xyz\r\n", 1, 2, "expected an action like 2F0, 1SEND_F3 or "
                          "(0F7;7B3)OVERLAP_F_B, got 'xyz'"),
    ("0F0\r\n1FOO1\r\n", 2, 1, "got '1FOO1'"),
    ("-1F0\r\n", 1, 1, "got '-1F0'"),
    ("0F0,0Fx\r\n", 1, 2, "got '0Fx'"),
    ("0F0,0F1.5\r\n", 1, 2, "got '0F1.5'"),
    ("0F0,0F\r\n", 1, 2, "microbatch index after 0F"),
    ("0F0,0F01\r\n", 1, 2, "leading zeros"),
    ("0F٣\r\n", 1, 1, "got '0F٣'"),
    (f"0F0,0F{MAX_INDEX + 1}\r\n", 1, 2, "microbatch index 1000001"),
    (f"{10**30}F0\r\n", 1, 1, "stage index"),
    ("0F" + "9" * 5000 + "\r\n", 1, 1, "too large"),
    ("0F0,0F\x001\r\n", 1, 2, "got '0F\\x001'"),
    ("0F0\r\n\x7fELF\x02\x01\r\n", 2, 1, "expected an action"),
    ("0RECV_F0,0F0\r\n1F0\r\n", 1, 1, "no previous stage to receive an activation"),
    ("0F0\r\n1F0,1SEND_F0\r\n", 2, 2, "no next stage to send"),
    ("0SEND_B0\r\n1F0\r\n", 1, 1, "no previous stage to send its gradient"),
    ("0F0\r\n1RECV_B0\r\n", 2, 1, "no next stage to receive a gradient"),
    ("0F0,1F0\r\n1B0\r\n", 2, 1, "stage 1 appears on rows 1 and 2"),
    ("0F0\r\n(2F0;1B0)OVERLAP_F_B\r\n0B0\r\n", 3, 1, "stage 0 appears on rows 1 and 3"),
    ("0F0\r\n2F0\r\n", None, None, "stage 1 appears on no row"),
    ("1F0\r\n", None, None, "stage 0 appears on no row"),
    ('0F0\r\n"1F0,1B0\r\n', 2, None, "malformed CSV"),
    ('0F0,"1F0"x\r\n', 1, None, "malformed CSV"),
    ("(0F7;1SEND_F3)OVERLAP_F_B\r\n1F0\r\n", 1, 1, "only combine compute actions"),
    ("0F0,(0F1;0UNSHARD)OVERLAP_F_B\r\n", 1, 2, "only combine compute actions"),
    ("(0F1;)OVERLAP_F_B\r\n", 1, 1, "expected an action"),
    ("()OVERLAP_F_B\r\n", 1, 1, "expected an action"),
    ("((0F1;0B1)OVERLAP_F_B;0F2)OVERLAP_F_B\r\n", 1, 1, "expected an action"),
    ("(0F1;0B1)OVERLAP_X\r\n", 1, 1, "expected an action"),
    ('"0F0\r\n1F0"\r\n', 1, 1, "expected an action"),
]


@pytest.mark.parametrize("text,line,column,words", BAD)
def test_bad_text_is_an_input_error(text, line, column, words):
    with pytest.raises(InputError) as err:
        parse_torch_csv(text, "bad.csv")
    e = err.value
    assert (e.file, e.line, e.column) == ("bad.csv", line, column)
    assert words in e.message
    assert str(e).startswith("bad.csv" + ("" if line is None else f":{line}"))


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "junk.csv"
    path.write_bytes(b"0F0,0B0\r\n1F0,\xff\xfe\x00\r\n")
    with pytest.raises(InputError) as err:
        read_torch_csv(str(path))
    assert (err.value.file, err.value.line) == (str(path), 2)
    assert "not UTF-8" in err.value.message


def test_missing_file_and_directory(tmp_path):
    missing = str(tmp_path / "nope.csv")
    with pytest.raises(InputError) as err:
        read_torch_csv(missing)
    assert (err.value.file, err.value.line) == (missing, None)
    assert "no such file" in str(err.value)
    with pytest.raises(InputError) as err:
        read_torch_csv(str(tmp_path))
    assert (err.value.file, err.value.line) == (str(tmp_path), None)
    assert "directory" in err.value.message


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123FBIWSENDRCV_OLAPUHX(;),\"\r\n \x00é-")),
               max_size=60))
def test_any_text_parses_or_raises_input_error(text):
    try:
        parse_torch_csv(text, "fuzz.csv")
    except InputError as e:
        assert e.file == "fuzz.csv"
    _same_plan_on_both_paths(text)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_read_or_raise_input_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "f.csv"
    path.write_bytes(data)
    try:
        read_torch_csv(str(path))
    except InputError:
        pass


@st.composite
def _canonical_rows(draw) -> list[list[str]]:
    """Rows of canonical cells; row ``r`` of ``n`` holds stages ``r`` (and ``r + n``)."""
    n, v = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    kinds = st.sampled_from(["F", "B", "I", "W", "SEND_F", "SEND_B", "RECV_F", "RECV_B",
                             "REDUCE_GRAD"])
    rows = []
    for r in range(n):
        stage = st.sampled_from([r + n * k for k in range(v)])
        cell = st.one_of(
            st.just(""),
            st.builds("{}{}{}".format, stage, kinds, st.integers(0, 12)),
            st.builds("{}{}".format, stage, st.sampled_from(["UNSHARD", "RESHARD"])),
            st.builds("({}F{};{}B{})OVERLAP_F_B".format, stage, st.integers(0, 3), stage,
                      st.integers(0, 3)))
        rows.append([f"{r + n * k}F0" for k in range(v)] + draw(st.lists(cell, max_size=6)))
    return rows


@settings(max_examples=300, deadline=None)
@given(_canonical_rows())
def test_every_accepted_canonical_file_round_trips(rows):
    text = "".join(",".join(r) + "\r\n" for r in rows)
    _same_plan_on_both_paths(text)
    _same_plan_on_both_paths(text.replace("\r\n", "\n"))
    try:
        plan = parse_torch_csv(text, "gen.csv")
    except InputError as e:  # only a send/receive past either end of the pipeline
        assert "there is no" in e.message
        return
    assert format_torch_csv(plan) == text
    assert parse_torch_csv(format_torch_csv(plan), "gen.csv") == plan
