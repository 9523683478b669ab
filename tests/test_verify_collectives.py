"""Plainly broken collective plans are VIOLATED, never undecided (issue 25): the passes
pair collective calls as the kernel does (instance k of a rank set: the k-th call over
the distinct ranks it lists), so each of their claims is one the kernel confirms from the
plan, and a call made by a rank outside its own rank set is a stuck op the kernel confirms."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import strategies as S

from mpipe_verified import kernel
from mpipe_verified.cli import main
from mpipe_verified.formats.plan_json import format_plan_json
from mpipe_verified.ir import Collective, Payload, Plan, Recv, Send
from mpipe_verified.verify import verify
from plan_edits import fixture, lowered, props

MODELS = ("rendezvous", "eager")


def _append(plan: Plan, tails) -> Plan:
    """``plan`` with ``tails[rank]`` run after each rank's program."""
    return attrs.evolve(plan, programs=tuple(prog + tuple(tail)
                                             for prog, tail in zip(plan.programs, tails)))


def _violated(plan: Plan, comm_model: str = "rendezvous"):
    """The report of a plan that must be VIOLATED with every property decided."""
    report = verify(plan, comm_model=comm_model)
    assert report.undecided == ()
    assert report.status == "violated"
    return report


def _found(report, prop: str) -> list:
    return [v for v in report.violations if v.property == prop]


@pytest.mark.parametrize("comm_model", MODELS)
def test_a_member_listed_twice_by_one_caller_is_a_matching_violation(comm_model):
    """Rank 0 lists rank 1 twice, ranks 1 and 2 list the set once: one instance over
    {0, 1, 2}, which completes; the duplicate is the violation, at rank 0's call."""
    plan = lowered("gpipe", 3, 1)
    dup, once = (Collective("all_reduce", ranks, "x") for ranks in ((0, 1, 1, 2), (0, 1, 2)))
    end = len(plan.programs[0])
    report = _violated(_append(plan, [(dup,), (once,), (once,)]), comm_model)
    assert props(report) == {"matching"}
    (found,) = _found(report, "matching")
    assert found.ops == ((0, end, str(dup)),)
    assert "lists a member twice" in found.message


def test_a_cut_plans_broadcast_listing_a_member_twice_is_located_in_the_file(tmp_path, capsys):
    """The ``params:vision`` broadcast of a transpose, with rank 1 listed twice on rank 1:
    ``check`` exits 1 and names the file's line and column of that call."""
    plan = fixture("owner_transpose")
    call = plan.programs[1][0]
    assert call.tag == "params:vision"
    dup = attrs.evolve(call, ranks=call.ranks + (1,))
    broken = attrs.evolve(plan, programs=(plan.programs[0], (dup,) + plan.programs[1][1:]))
    text = format_plan_json(broken)
    path = tmp_path / "dup_member.json"
    path.write_text(text)
    lines = text.splitlines()
    line = next(n for n, x in enumerate(lines, 1) if '"members": [0, 1, 1]' in x)
    column = lines[line - 1].index("{") + 1
    code = main(["check", str(path)])
    out, _ = capsys.readouterr()
    assert code == 1
    assert (f"{path}:{line}:{column}: matching: rank 1 position 0: {dup} lists a member "
            f"twice") in out.splitlines()
    assert "undecided" not in out


@pytest.mark.parametrize("comm_model", MODELS)
def test_a_non_member_caller_below_the_members_does_not_hide_their_disagreement(comm_model):
    """Rank 0 calls a collective over {1, 2}; ranks 1 and 2 disagree on its kind. Rank 0's
    call never completes (deadlock), it is not a member, and rank 1's call differs from
    the lowest caller's (matching)."""
    plan = lowered("gpipe", 3, 1)
    bcast = Collective("broadcast", (1, 2), "x", root=1)
    reduce = Collective("all_reduce", (1, 2), "x")
    ends = [len(prog) for prog in plan.programs]
    report = _violated(_append(plan, [(bcast,), (reduce,), (bcast,)]), comm_model)
    assert props(report) == {"matching", "deadlock"}
    (dead,) = _found(report, "deadlock")
    assert dead.ops == ((0, ends[0], str(bcast)),)
    assert "rank 0 is not one of its members" in dead.message
    located = {op[:2] for v in _found(report, "matching") for op in v.ops}
    assert located == {(0, ends[0]), (1, ends[1])}


def test_a_non_member_call_is_a_confirmed_deadlock():
    """Ranks 0 and 1 complete their all-reduce over {0, 1}; rank 2 calls it too and is
    stuck for good. The kernel confirms rank 2's stuck call and still refuses the same
    claim about rank 0's call, which completes."""
    plan = lowered("gpipe", 3, 1)
    call = Collective("all_reduce", (0, 1), "x")
    ends = [len(prog) for prog in plan.programs]
    broken = _append(plan, [(call,), (call,), (call,)])
    report = _violated(broken)
    assert props(report) == {"matching", "deadlock"}
    (dead,) = _found(report, "deadlock")
    assert dead.ops == ((2, ends[2], str(call)),)
    assert kernel.confirm(broken, "deadlock", [("stuck", 2, ends[2])]) == ["violated"]
    assert kernel.confirm(broken, "deadlock", [("stuck", 0, ends[0])]) == ["rejected"]


@pytest.mark.parametrize("comm_model", MODELS)
def test_a_cycle_through_a_collective_and_a_receive_is_confirmed(comm_model):
    """Rank 0 calls an all-reduce over {0, 1} (listing rank 1 twice) and then sends to
    rank 1; rank 1 first receives that send, then calls the all-reduce: rank 0 waits in
    the collective for rank 1, which waits in its receive for rank 0."""
    plan = lowered("gpipe", 2, 1)
    dup, call = Collective("all_reduce", (0, 1, 1), "x"), Collective("all_reduce", (0, 1), "x")
    act = Payload("act", 0, 0)
    ends = [len(prog) for prog in plan.programs]
    report = _violated(_append(plan, [(dup, Send(1, act)), (Recv(0, act), call)]), comm_model)
    assert props(report) == {"matching", "deadlock"}
    (dead,) = _found(report, "deadlock")
    assert {op[:2] for op in dead.ops} == {(0, ends[0]), (1, ends[1])}
    assert dead.message.startswith("wait-for cycle")
    # the duplicate member, and rank 1's second receive of act(0, 0) (docs/semantics.md
    # §2.3: a token received twice)
    assert {v.ops for v in _found(report, "matching")} == {
        ((0, ends[0], str(dup)),), ((1, ends[1], str(Recv(0, act))),)}


@settings(max_examples=20)
@given(st.data())
def test_plain_collective_member_edits_are_decided_as_the_reference_judges(data):
    """A family plan with collectives, one call broken (``edit_collective_members``): the
    report is violated, nothing undecided, with the properties the reference finds."""
    ch = S.DrawChooser(data.draw)
    plan = S.with_collectives(S.lowered(S.random_family_term(ch, p=ch.int(2, 4))), ch)
    broken, edit = S.edit_collective_members(plan, ch)
    report = verify(broken)
    assert report.undecided == (), edit
    assert report.status == "violated", edit
    assert props(report) == reference.judge_plan(broken).violated, edit
