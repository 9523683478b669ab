"""The verifier's entry point ``verify(plan, ...)`` (docs/semantics.md §2–§3), called directly.

- broken variants of valid lowered family plans (edited with ``attrs.evolve`` and tuple
  surgery) are rejected with the right property;
- a Z3 ``unknown`` (forced with ``rlimit=1``) is *undecided*, never verified;
- certificates: issued only for verified plans, recheckable, refused for any other plan,
  comm model or property set, and their digest is a stable function of the canonical text;
- collectives and groups on hand-built plans (§2.2, §2.4);
- agreement with the independent reference interpreter (``tests/reference.py``) on a few
  hundred random one-edit mutations (Hypothesis, derandomized).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
from mpipe_verified.algebra.families import family
from plan_edits import defer_receives, fixture, lowered, props, with_program
from mpipe_verified.ir import (ACT, GRAD, Collective, Compute, Group, Idle, Payload, Plan,
                               Recv, Send)
from mpipe_verified.lower import lower
from mpipe_verified.check.parametric import check_certificate
from mpipe_verified.verify import PROPERTIES, Certificate, CertificateError, plan_digest, verify


@functools.lru_cache(maxsize=None)
def F(s, mb):
    return Compute("F", s, mb)


def B(s, mb):
    return Compute("B", s, mb)


def send_act(dst, s, mb):
    return Send(dst, Payload(ACT, s, mb))


def recv_grad(src, s, mb):
    return Recv(src, Payload(GRAD, s, mb))


# ---------------------------------------------------------------- valid plans


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, None), ("1f1b", 4, 8, None),
                                        ("interleaved-1f1b", 4, 8, 2), ("zb-h1", 4, 8, None),
                                        ("zb-h2", 4, 8, None), ("zbv", 4, 8, None),
                                        ("dualpipev", 4, 8, None)])
def test_lowered_families_are_verified_with_a_certificate(name, p, m, v):
    plan = lowered(name, p, m, v)
    report = verify(plan)
    assert report.status == "verified" and report.verified and report.exit_code == 0
    assert report.violations == ()
    assert set(report.stats["properties"]) == set(PROPERTIES)
    assert all(info["status"] == "proved" for info in report.stats["properties"].values())
    check_certificate(plan, report.certificate)
    # the reference agrees, and on the peak too
    res = reference.run_plan(plan)
    assert res.ok
    assert [report.peak_memory[r] for r in range(p)] == res.peak


# ---------------------------------------------------------------- broken variants


def test_dropped_recv_is_a_matching_violation():
    """Drop rank 2's first receive (2RECV_F0) from 1F1B(4, 8): FIFO pairing shifts every
    later activation on channel 1->2 by one (each pair is a mismatch), the last send has no
    receive, 2F0 lacks its input, and rank 1 blocks: matching, dependency and deadlock."""
    plan = lowered("1f1b", 4, 8)
    program = list(plan.programs[2])
    index = next(i for i, op in enumerate(program) if isinstance(op, Recv))
    assert str(program[index]) == "2RECV_F0"
    del program[index]
    report = verify(with_program(plan, 2, program))
    assert report.status == "violated" and report.exit_code == 1
    assert "matching" in props(report)
    assert props(report) == {"matching", "dependency", "deadlock"}
    messages = [v.message for v in report.violations if v.property == "matching"]
    assert any("1SEND_F7 to rank 2 has no matching receive (8 sends, 7 receives on 1->2)" in m
               for m in messages)
    assert any("rank 1 position 2 sends 1SEND_F0 but the matching receive at rank 2 "
               "position 2 is 2RECV_F1" in m for m in messages)


def test_dropped_last_recv_leaves_a_send_unmatched():
    """Dropping the last receive of a channel shifts nothing: only the leftover send is
    unmatched (matching) and blocks forever (deadlock); 0B7 lacks its gradient."""
    plan = lowered("1f1b", 4, 8)
    program = list(plan.programs[0])
    index = max(i for i, op in enumerate(program) if isinstance(op, Recv))
    assert str(program[index]) == "0RECV_B7"
    del program[index]
    report = verify(with_program(plan, 0, program))
    assert props(report) == {"matching", "dependency", "deadlock"}
    (unmatched,) = [v for v in report.violations if v.property == "matching"]
    assert unmatched.ranks == (1,) and "1SEND_B7" in unmatched.message
    assert "no matching receive (8 sends, 7 receives on 1->0)" in unmatched.message
    (dead,) = [v for v in report.violations if v.property == "deadlock"]
    assert "1SEND_B7 has no matching partner" in dead.message


def test_two_sends_swapped_on_one_channel_is_a_mismatch_with_both_ends():
    """GPipe(2, 2) rank 0 is ``0F0,0SEND_F0,0F1,0SEND_F1,...``. Run both forwards first and
    then send mb 1 before mb 0: every input is still available (no dependency problem),
    both pairs still meet (no deadlock), but rank 1's first receive gets mb 1."""
    plan = lowered("gpipe", 2, 2)
    assert [str(op) for op in plan.programs[0][:4]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1"]
    f0, s0, f1, s1 = plan.programs[0][:4]
    broken = with_program(plan, 0, (f0, f1, s1, s0) + plan.programs[0][4:])
    report = verify(broken)
    assert props(report) == {"matching"}
    first, second = report.violations
    assert first.ranks == (0, 1)
    assert [(r, i, op) for r, i, op in first.ops] == [(0, 2, "0SEND_F1"), (1, 0, "1RECV_F0")]
    assert first.trace == ("send end: rank 0, position 2, 0SEND_F1",
                           "recv end: rank 1, position 0, 1RECV_F0")
    assert [(r, i, op) for r, i, op in second.ops] == [(0, 3, "0SEND_F0"), (1, 2, "1RECV_F1")]
    # the eager model does not excuse a mismatch
    assert props(verify(broken, comm_model="eager")) == {"matching"}


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 2, None), ("1f1b", 4, 8, None),
                                        ("zb-h1", 3, 4, None),
                                        ("interleaved-1f1b", 2, 4, 2)])
def test_receives_deferred_to_their_consumer_deadlock_under_rendezvous(name, p, m, v):
    """pytorch/pytorch#172668: posting each RECV just before its consumer makes the steady
    1F1B exchange a send/send cycle (rank r sends the next activation while rank r+1 sends
    the previous gradient; neither has posted the receive yet). Under rendezvous that is a
    deadlock with a wait-for cycle; eager buffering hides it."""
    plan = defer_receives(lowered(name, p, m, v))
    assert plan != lowered(name, p, m, v)
    report = verify(plan)
    assert props(report) == {"deadlock"}
    (dead,) = report.violations
    assert dead.message.startswith("wait-for cycle under rendezvous: ")
    assert len(dead.ranks) >= 2 and len(dead.trace) == len(dead.ranks)
    for line in dead.trace:
        assert " waits for rank " in line and " to reach position " in line
    # each rank of the cycle waits on the next one, and the last on the first
    waits_on = [int(line.split(" waits for rank ")[1].split()[0]) for line in dead.trace]
    assert waits_on == list(dead.ranks[1:]) + [dead.ranks[0]]
    assert not reference.run_plan(plan).completed
    eager = verify(plan, comm_model="eager")
    assert eager.status == "verified" and eager.certificate.comm_model == "eager"


def test_deferred_receives_exact_cycle_for_two_ranks():
    plan = defer_receives(lowered("1f1b", 2, 2))
    assert plan.text() == ("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                           "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1")
    (dead,) = verify(plan).violations
    assert dead.trace == (
        "rank 0, position 3: 0SEND_F1 waits for rank 1 to reach position 4 (1RECV_F1)",
        "rank 1, position 3: 1SEND_B0 waits for rank 0 to reach position 4 (0RECV_B0)")
    assert dead.ops == ((0, 3, "0SEND_F1"), (1, 3, "1SEND_B0"))


def test_backward_before_its_forward_is_a_dependency_violation():
    plan = lowered("1f1b", 4, 8)
    program = list(plan.programs[3])
    assert [str(op) for op in program[:4]] == ["3RECV_F0", "3F0", "3RECV_F1", "3B0"]
    program[1], program[3] = program[3], program[1]
    report = verify(with_program(plan, 3, program))
    assert props(report) == {"dependency"}
    (v,) = report.violations
    assert v.ops == ((3, 1, "3B0"),)
    assert "3B0 needs the stored forward of stage 3 microbatch 0, which arrives only later, " \
           "at position 3 (3F0)" in v.message


def test_duplicated_forward_is_a_completeness_violation():
    plan = lowered("1f1b", 4, 8)
    program = list(plan.programs[0])
    assert str(program[0]) == "0F0"
    program.insert(1, program[0])
    report = verify(with_program(plan, 0, program))
    assert props(report) == {"completeness"}
    (v,) = report.violations
    assert v.message == "0F0 occurs 2 times on rank 0" and v.ranks == (0,)


def test_memory_limit_one_below_the_peak_is_violated_and_the_peak_itself_holds():
    plan = lowered("1f1b", 4, 8)
    peaks = verify(plan).peak_memory
    assert peaks == {0: 4.0, 1: 3.0, 2: 2.0, 3: 1.0}
    under = verify(plan, memory_limit=3)
    assert props(under) == {"memory"} and under.exit_code == 1
    (v,) = under.violations
    assert v.ranks == (0,)
    assert "memory peak 4 exceeds the limit 3 with 4 live tensors" in v.message
    assert v.trace == tuple(f"live: activation of 0F{mb} (1)" for mb in range(4))
    exact = verify(plan, memory_limit=4)
    assert exact.status == "verified" and exact.certificate.memory_limit == (4.0,) * 4
    # a per-rank limit: one below on the last rank only
    per_rank = verify(plan, memory_limit=[4, 3, 2, 0])
    assert [v.ranks for v in per_rank.violations] == [(3,)]


def test_odd_float_sizes_are_summed_exactly_and_verified():
    """A stored size with no short decimal (4 * it is not a float sum of it): the level
    facts ``after == before + alloc - free`` hold exactly, so the plan is verified."""
    from mpipe_verified.semantics import MemoryModel, peak_memory
    plan = lowered("1f1b", 4, 8)
    model = MemoryModel(stored=lambda s, seg: 0.8444218515250481)
    report = verify(plan, memory_model=model)
    assert report.status == "verified", report.undecided
    assert report.peak_memory == {r: peak for r, (peak, _) in peak_memory(plan, model).items()}
    assert verify(plan, memory_limit=report.peak_memory[0] + 1e-9,
                  memory_model=model).status == "verified"


def test_a_limit_exceeded_by_a_tiny_amount_is_violated():
    """The unit peak 4 against a limit 1e-10 below it: a real overrun, confirmed by Z3 on
    the exact rationals (rounding the limit to 4 once made Z3 call it holding)."""
    plan = lowered("1f1b", 4, 8)
    report = verify(plan, memory_limit=4 - 1e-10)
    assert report.status == "violated" and props(report) == {"memory"}
    (v,) = report.violations
    assert v.ranks == (0,) and "memory peak 4 exceeds the limit 3.9999999999 " in v.message
    from mpipe_verified import kernel
    over = plan.programs[0].index(next(op for op in plan.programs[0] if str(op) == "0F3"))
    assert kernel.confirm(plan, "memory", [("peak", 0, over)], limits=(4 - 1e-10,) * 4) \
        == ["violated"]
    assert kernel.confirm(plan, "memory", [("peak", 0, over)], limits=(4,) * 4) == ["rejected"]


def test_static_memory_over_the_limit_on_an_empty_program():
    """A rank with no ops and a static part over the limit: reported at position -1
    (as ``semantics.peak_memory`` does), naming no op, not a traceback."""
    from mpipe_verified.semantics import MemoryModel
    plan = lowered("gpipe", 2, 2)
    plan = attrs.evolve(plan, programs=(plan.programs[0], ()))
    model = MemoryModel(static=(0, 5))
    report = verify(plan, memory_limit=5, memory_model=model)
    assert report.stats["properties"]["memory"]["status"] == "proved"
    assert report.peak_memory[1] == 5
    over = [v for v in verify(plan, memory_limit=4, memory_model=model).violations
            if v.property == "memory"]
    assert [(v.message, v.ranks, v.ops) for v in over] == [
        ("rank 1 position -1 (empty program): static memory 5 exceeds the limit 4", (1,), ())]


def test_a_peak_over_its_limit_by_less_than_six_decimals_prints_over_it():
    """Sizes that sum, exactly, just above the limit (three 0.1s against 0.3; a static
    10.65 and 0.1 against 10.75, the float sum of which is 10.75 itself): the message
    prints the two numbers apart, in their order, not as ``0.3 exceeds the limit 0.3``."""
    from decimal import Decimal
    from mpipe_verified.semantics import MemoryModel
    tenth = MemoryModel(stored=lambda stage, segment: 0.1)
    static = MemoryModel(stored=lambda stage, segment: 0.1, static=(10.65,))
    for plan, model, limit, peak_text, limit_text in (
            (lowered("gpipe", 1, 3), tenth, 0.3, "0.30000000000000002", "0.29999999999999999"),
            (lowered("gpipe", 1, 1), static, 10.75, "10.7500000000000004", "10.75")):
        report = verify(plan, memory_limit=limit, memory_model=model)
        (v,) = report.violations
        assert f"memory peak {peak_text} exceeds the limit {limit_text} " in v.message
        assert Decimal(peak_text) > Decimal(limit_text)


def test_static_memory_over_the_limit_by_a_float_rounding_prints_over_it():
    from mpipe_verified.semantics import MemoryModel
    plan = lowered("gpipe", 2, 2)
    plan = attrs.evolve(plan, programs=(plan.programs[0], ()))
    model = MemoryModel(static=(0, 0.1 + 0.2))  # 0.30000000000000004
    (v,) = [v for v in verify(plan, memory_limit=0.3, memory_model=model).violations
            if v.property == "memory" and v.ranks == (1,)]
    assert v.message == ("rank 1 position -1 (empty program): static memory "
                         "0.30000000000000004 exceeds the limit 0.29999999999999999")


def test_a_per_rank_memory_limit_of_the_wrong_length_is_refused():
    """One value for four ranks once bounded rank 0 only and took each other rank's own
    peak as its bound (a rank over 5 could be certified)."""
    from mpipe_verified.verify import verify_loaded
    plan = lowered("1f1b", 4, 8)
    for limit in ((5.0,), [4, 4, 4, 4, 4]):
        with pytest.raises(ValueError, match=f"lists {len(limit)} per-rank values but the "
                                             f"plan has 4 ranks"):
            verify(plan, memory_limit=limit)
    with pytest.raises(ValueError, match="lists 1 per-rank values but the plan has 4 ranks"):
        verify_loaded(functools.partial(lowered, "1f1b", 4, 8), memory_limit=(5.0,))
    with pytest.raises(ValueError, match="finite"):
        verify(plan, memory_limit=float("inf"))
    assert verify(plan, memory_limit=(4, 3, 2, 1)).status == "verified"


def test_dependency_and_matching_findings_are_capped_and_counted():
    """Every receive of 1F1B(8, 64) removed: thousands of missing inputs and unmatched
    sends. Each property lists (and Z3 confirms) at most MAX_FINDINGS of them and counts
    the rest; the listed ones are the first ones, in plan order."""
    from mpipe_verified.verify.passes import MAX_FINDINGS
    plan = lowered("1f1b", 8, 64)
    stripped = attrs.evolve(plan, programs=tuple(
        tuple(op for op in program if not isinstance(op, Recv)) for program in plan.programs))
    recvs = plan.num_ops - stripped.num_ops
    report = verify(stripped)
    info = report.stats["properties"]
    for prop in ("dependency", "matching"):
        assert info[prop]["status"] == "violated"
        assert info[prop]["confirmed"] == MAX_FINDINGS
        assert len([v for v in report.violations if v.property == prop]) == MAX_FINDINGS
    # every receive fed one op (its consumer), and every send is now unmatched
    assert info["dependency"]["confirmed"] + info["dependency"]["unlisted"] == recvs
    assert info["matching"]["confirmed"] + info["matching"]["unlisted"] == recvs
    first = next(v for v in report.violations if v.property == "dependency")
    assert first.message == ("rank 0 position 16: 0B0 needs the gradient of stage 1 "
                             "microbatch 0, which is never computed or received on rank 0")
    small = verify(lowered("1f1b", 4, 8), memory_limit=3).stats["properties"]["memory"]
    assert "unlisted" not in small


def test_unknown_comm_model_is_refused():
    with pytest.raises(ValueError, match="comm model"):
        verify(lowered("gpipe", 2, 2), comm_model="buffered")


# ---------------------------------------------------------------- undecided


@pytest.mark.parametrize("broken", [False, True])
def test_solver_resource_limit_is_undecided_never_verified(broken):
    plan = lowered("1f1b", 4, 8)
    if broken:
        plan = defer_receives(plan)
    report = verify(plan, rlimit=1)
    assert report.status == "undecided" and report.exit_code == 3
    assert not report.verified and report.certificate is None
    assert report.to_json()["verified"] is False
    assert {u.split(":")[0] for u in report.undecided} == set(PROPERTIES)
    assert {info["status"] for info in report.stats["properties"].values()} == {"unknown"}


# ---------------------------------------------------------------- certificates


def test_certificate_accepts_the_same_plan_and_survives_json():
    plan = lowered("zb-h1", 4, 8)
    cert = verify(plan).certificate
    assert cert is not None and cert.properties == PROPERTIES
    assert cert.comm_model == "rendezvous" and cert.memory_limit is None
    check_certificate(plan, cert)
    check_certificate(lower(family("zb-h1", 4, 8).derive()), cert)  # an equal, fresh plan
    check_certificate(plan, Certificate.from_json(cert.to_json()))


def test_certificate_refuses_a_plan_with_one_op_changed():
    plan = lowered("zb-h1", 4, 8)
    cert = verify(plan).certificate
    program = list(plan.programs[1])
    k = next(i for i, op in enumerate(program) if isinstance(op, Compute) and op.kind == "W")
    program[k] = attrs.evolve(program[k], mb=(program[k].mb + 1) % 8)
    with pytest.raises(CertificateError, match="altered"):
        check_certificate(with_program(plan, 1, program), cert)
    # a payload's shape is part of the canonical text too
    program = list(plan.programs[0])
    k = next(i for i, op in enumerate(program) if isinstance(op, Send))
    program[k] = attrs.evolve(program[k], payload=attrs.evolve(program[k].payload,
                                                               shape=(4, 16)))
    with pytest.raises(CertificateError, match="altered"):
        check_certificate(with_program(plan, 0, program), cert)


def test_certificate_refuses_another_comm_model():
    plan = lowered("1f1b", 4, 8)
    rendezvous = verify(plan).certificate
    eager = verify(plan, comm_model="eager").certificate
    with pytest.raises(CertificateError, match="rendezvous model, not eager"):
        check_certificate(plan, rendezvous, comm_model="eager")
    with pytest.raises(CertificateError, match="eager model, not rendezvous"):
        check_certificate(plan, eager)
    check_certificate(plan, eager, comm_model="eager")


@pytest.mark.parametrize("missing", PROPERTIES)
def test_certificate_missing_a_property_is_refused(missing):
    plan = lowered("1f1b", 2, 4)
    cert = verify(plan).certificate
    partial = attrs.evolve(cert, properties=tuple(p for p in PROPERTIES if p != missing))
    with pytest.raises(CertificateError, match=f"does not prove {missing}"):
        check_certificate(plan, partial)


def test_no_certificate_and_old_version_are_refused():
    plan = lowered("1f1b", 2, 4)
    with pytest.raises(CertificateError, match="no certificate"):
        check_certificate(plan, None)
    with pytest.raises(CertificateError, match="expected"):
        check_certificate(plan, attrs.evolve(verify(plan).certificate, version="other/0"))


def test_violated_and_undecided_reports_carry_no_certificate():
    plan = defer_receives(lowered("1f1b", 2, 2))
    assert verify(plan).certificate is None
    assert verify(lowered("1f1b", 2, 2), rlimit=1).certificate is None


_DIGEST_SNIPPET = """
from mpipe_verified.algebra.families import family
from mpipe_verified.lower import lower
from mpipe_verified.verify import plan_digest, verify
plan = lower(family("zb-h1", 4, 8).derive())
print(plan_digest(plan), verify(plan).certificate.digest)
"""


def test_digest_is_stable_across_runs_and_is_the_canonical_text_hash():
    plan = lowered("zb-h1", 4, 8)
    digest = plan_digest(plan)
    assert digest == hashlib.sha256(plan.canonical_text().encode()).hexdigest()
    assert plan.canonical_text().splitlines()[0] == "placement=0,1,2,3;m=8"
    outs = set()
    for seed in ("0", "12345"):  # another process, another hash seed: same digest
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _DIGEST_SNIPPET], capture_output=True,
                             text=True, env=env, check=True, timeout=120).stdout.split()
        outs.add(tuple(out))
    assert outs == {(digest, digest)}
    # idle steps are not part of the canonical text
    padded = with_program(plan, 2, (Idle(),) + plan.programs[2] + (Idle(), Idle()))
    assert plan_digest(padded) == digest
    check_certificate(padded, verify(plan).certificate)


# ---------------------------------------------------------------- collectives and groups


def _append(plan: Plan, tails) -> Plan:
    return attrs.evolve(plan, programs=tuple(prog + tuple(tail)
                                             for prog, tail in zip(plan.programs, tails)))


def test_collectives_in_the_same_order_verify():
    plan = lowered("gpipe", 2, 2)
    grads = Collective("all_reduce", (0, 1), "grads")
    params = Collective("broadcast", (0, 1), "params", root=0)
    report = verify(_append(plan, [(grads, params), (grads, params)]))
    assert report.status == "verified"


@pytest.mark.parametrize("second", [Collective("broadcast", (0, 1), "params", root=0),
                                    Collective("all_reduce", (1, 0), "loss")])
def test_two_collectives_over_one_group_in_different_orders(second):
    """§2.4: the k-th collective a member calls over a group is instance k. Swapping two
    collectives of one group on one rank pairs different collectives (different kind, or
    same kind with a different tag): a matching violation naming both calls. (It is not a
    deadlock: each instance still has every member; the group ``(1, 0)`` is ``(0, 1)``.)"""
    plan = lowered("gpipe", 2, 2)
    first = Collective("all_reduce", (0, 1), "grads")
    report = verify(_append(plan, [(first, second), (second, first)]))
    assert props(report) == {"matching"}
    a, b = report.violations
    assert a.message == (f"collective #0 over ranks [0, 1]: rank 1 calls {second} but rank 0 "
                         f"calls {first}")
    assert b.message == (f"collective #1 over ranks [0, 1]: rank 1 calls {first} but rank 0 "
                         f"calls {second}")
    assert a.ops == ((0, 8, str(first)), (1, 8, str(second)))  # both ends


def test_collective_findings_are_confirmed_by_the_kernel_from_the_plan():
    """Each collective problem is a claim about a position of the plan that the kernel
    checks itself: a claim about a call that is fine is rejected, never confirmed."""
    from mpipe_verified import kernel
    from mpipe_verified.verify import passes
    plan = lowered("gpipe", 3, 1)
    grads = Collective("all_reduce", (0, 1), "grads")
    params = Collective("broadcast", (0, 1), "params", root=1)
    for programs, claims in [([(grads, params), (params, grads), ()], None),
                             ([(grads,), (), ()], [("call", 0, len(plan.programs[0]))]),
                             ([(grads,), (grads,), (grads,)], None)]:
        broken = _append(plan, programs)
        findings, _ = passes.matching(broken)
        got = [f.claim for f in findings]
        assert got and all(c[0] == "call" for c in got)
        if claims is not None:
            assert got == claims
        assert kernel.confirm(broken, "matching", got) == ["violated"] * len(got)
        # the same claims about the plan without the broken calls are rejected
        assert set(kernel.confirm(plan, "matching", got)) == {"rejected"}
    dead = passes.deadlock(_append(plan, [(grads,), (), ()]), "rendezvous")[0]
    assert [f.claim for f in dead] == [("stuck", 0, len(plan.programs[0]))]
    one_f = lowered("1f1b", 4, 8)
    program = list(one_f.programs[0])
    del program[max(i for i, op in enumerate(program) if isinstance(op, Recv))]
    broken = with_program(one_f, 0, program)
    (dead,) = passes.deadlock(broken, "rendezvous")[0]
    assert kernel.confirm(broken, "deadlock", [dead.claim]) == ["violated"]
    assert kernel.confirm(one_f, "deadlock", [dead.claim]) == ["rejected"]


def test_collective_agreement_is_part_of_the_certificate(monkeypatch):
    """A pairing that forgot a kind/tag/root disagreement must not certify: the agreement
    of every member with the lowest one is a fact Z3 checks."""
    import attrs as attrs_
    from mpipe_verified import verify as verify_module
    from mpipe_verified.semantics import pair_collectives
    plan = lowered("gpipe", 2, 2)
    grads = Collective("all_reduce", (0, 1), "grads")
    params = Collective("broadcast", (0, 1), "params", root=0)
    broken = _append(plan, [(grads, params), (params, grads)])
    assert props(verify(broken)) == {"matching"}
    monkeypatch.setattr(verify_module, "pair_collectives",
                        lambda p: attrs_.evolve(pair_collectives(p), problems=()))
    report = verify(broken)
    assert report.status != "verified" and report.certificate is None
    assert report.stats["properties"]["matching"]["status"] == "unknown"


def test_collectives_over_overlapping_groups_in_different_orders_deadlock():
    """Rank 0 calls A over {0,1} then B over {0,1,2}; rank 1 calls B then A: rank 0 waits in
    A for rank 1, which waits in B for rank 0."""
    plan = lowered("gpipe", 3, 1)
    a = Collective("all_reduce", (0, 1), "a")
    b = Collective("all_reduce", (0, 1, 2), "b")
    report = verify(_append(plan, [(a, b), (b, a), (b,)]))
    assert props(report) == {"deadlock"}
    (dead,) = report.violations
    assert set(dead.ranks) == {0, 1}
    assert any(f"{a} waits for rank 1" in t for t in dead.trace)
    assert any(f"{b} waits for rank 0" in t for t in dead.trace)


def test_collective_before_a_receive_deadlocks_with_a_cycle():
    plan = lowered("gpipe", 2, 2)
    ar = Collective("all_reduce", (0, 1), "grads")
    broken = attrs.evolve(plan, programs=((ar,) + plan.programs[0], plan.programs[1] + (ar,)))
    report = verify(broken)
    assert props(report) == {"deadlock"}
    (dead,) = report.violations
    assert dead.ops == ((0, 0, str(ar)), (1, 0, "1RECV_F0"))


def test_collective_missing_on_one_member():
    plan = lowered("gpipe", 2, 2)
    ar = Collective("all_reduce", (0, 1), "grads")
    report = verify(_append(plan, [(ar,), ()]))
    assert props(report) == {"matching", "deadlock"}
    by = {v.property: v for v in report.violations}
    assert "is never called on rank 1" in by["matching"].message
    assert "waits forever: rank 1 never makes call #0 over ranks [0, 1]" in by["deadlock"].message
    assert by["deadlock"].ops == ((0, 8, str(ar)),)


def test_collective_called_by_a_non_member():
    plan = lowered("gpipe", 3, 1)
    ar = Collective("all_reduce", (0, 1), "grads")
    report = verify(_append(plan, [(ar,), (ar,), (ar,)]))
    assert "matching" in props(report)
    assert any("rank 2 calls" in v.message and "is not a member" in v.message
               for v in report.violations)


def _steady_exchange(grouped: bool) -> Plan:
    """1F1B on 2 ranks, 2 microbatches, where rank 0 sends activation 1 and receives
    gradient 0 at the same step, and rank 1 sends gradient 0 and receives activation 1."""
    return fixture(f"steady_exchange_{'grouped' if grouped else 'ungrouped'}")


def test_group_completes_where_the_same_ops_ungrouped_deadlock():
    grouped = verify(_steady_exchange(grouped=True))
    assert grouped.status == "verified"
    check_certificate(_steady_exchange(grouped=True), grouped.certificate)
    ungrouped = verify(_steady_exchange(grouped=False))
    assert props(ungrouped) == {"deadlock"}
    (dead,) = ungrouped.violations
    assert dead.ops == ((0, 3, "0SEND_F1"), (1, 3, "1SEND_B0"))
    assert not reference.run_plan(_steady_exchange(grouped=False)).completed
    # the certificate of the grouped plan does not cover the ungrouped one
    with pytest.raises(CertificateError):
        check_certificate(_steady_exchange(grouped=False), grouped.certificate)


def test_group_members_still_pair_fifo():
    """A group does not excuse a mismatch: swapping the group's receive for another
    microbatch's is a matching violation."""
    plan = _steady_exchange(grouped=True)
    bad = Group((send_act(1, 0, 1), recv_grad(1, 1, 1)))
    rank0 = list(plan.programs[0])
    rank0[3] = bad
    rank0[5] = recv_grad(1, 1, 0)
    report = verify(with_program(plan, 0, rank0))
    assert "matching" in props(report)


# ---------------------------------------------------------------- agreement with reference


BASES = [("gpipe", 2, 3, None), ("1f1b", 3, 4, None), ("interleaved-1f1b", 2, 4, 2),
         ("zb-h1", 3, 4, None), ("zb-h2", 2, 4, None), ("zbv", 2, 3, None),
         ("dualpipev", 2, 4, None)]


@st.composite
def one_edit(draw):
    key = draw(st.sampled_from(BASES))
    plan = lowered(*key)
    rank = draw(st.integers(0, plan.num_ranks - 1))
    program = list(plan.programs[rank])
    edit = draw(st.sampled_from(["drop", "duplicate", "swap"]))
    index = draw(st.integers(0, len(program) - (2 if edit == "swap" else 1)))
    if edit == "drop":
        del program[index]
    elif edit == "duplicate":
        program.insert(index, program[index])
    else:
        program[index], program[index + 1] = program[index + 1], program[index]
    return key, edit, rank, index, with_program(plan, rank, program)


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(one_edit())
def test_deadlock_and_completeness_verdicts_agree_with_the_reference(case):
    key, edit, rank, index, plan = case
    report = verify(plan)
    res = reference.run_plan(plan)
    assert not res.problems, res.problems
    assert report.status in ("verified", "violated")
    found = props(report)
    assert ("deadlock" in found) == (not res.completed), (key, edit, rank, index, res.stuck)
    assert ("completeness" in found) == bool(res.incomplete), (key, edit, rank, index,
                                                              res.incomplete)
    if report.verified:
        assert res.ok


# ---------------------------------------------------------------- known package bugs


def test_eager_unmatched_send_does_not_block():
    """Regression (a package bug, fixed). docs/semantics.md §2.7: under the eager model sends are
    buffered and never block. A plan whose only fault is one extra send (1F1B(4, 8) with
    rank 1's last ``1SEND_B7`` duplicated) violates ``matching`` under both models, but
    under eager every rank still runs to its end, so ``deadlock`` must hold. The verifier
    used to report "1SEND_B7 has no matching partner: it waits forever" under eager too
    (``semantics._comm_completion`` returned ``_NEVER`` for a member without a partner
    before it looked at ``comm_model == EAGER``)."""
    plan = lowered("1f1b", 4, 8)
    program = list(plan.programs[1])
    k = max(i for i, op in enumerate(program) if isinstance(op, Send))
    assert str(program[k]) == "1SEND_B7"
    program.insert(k, program[k])
    broken = with_program(plan, 1, program)
    assert props(verify(broken)) == {"matching", "deadlock"}  # rendezvous: it blocks
    assert props(verify(broken, comm_model="eager")) == {"matching"}


def test_collective_mismatch_names_both_ranks_and_both_ops():
    """Regression (a package bug, fixed). docs/semantics.md §3: a counterexample names the
    ranks and the ops (by position). A point-to-point mismatch lists both ends in ``ranks`` and
    ``ops``; a collective whose members disagree (rank 0 calls ALL_REDUCE(grads), rank 1
    BROADCAST(params) as instance #0 of group [0, 1]) used to name rank 0's call only in
    the message text (``ranks == (1,)``, ``ops`` with rank 1's position only)."""
    plan = lowered("gpipe", 2, 2)
    grads = Collective("all_reduce", (0, 1), "grads")
    params = Collective("broadcast", (0, 1), "params", root=0)
    report = verify(_append(plan, [(grads, params), (params, grads)]))
    first = report.violations[0]
    assert first.property == "matching"
    assert set(first.ranks) == {0, 1}
    assert set(first.ops) == {(0, 8, str(grads)), (1, 8, str(params))}


def test_overlapped_members_read_before_and_write_after_their_step(tmp_path):
    """The rule of an ``OVERLAP_F_B`` step: its members run together, every input read
    before the step and every output written after it. So a backward overlapped with a
    forward of *another* microbatch is fine, while one overlapped with its own forward
    needs that forward's output inside the step: a dependency violation at that step."""
    from mpipe_verified.formats.torch_csv import parse_torch_csv

    def judged(text: str):
        plan = parse_torch_csv(text, "overlap.csv")
        return verify(plan if plan.has_comms() else lower(plan))
    assert judged("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n").verified
    own = judged("(0F0;0B0)OVERLAP_F_B\n")
    assert [(v.property, v.ops[0][:2]) for v in own.violations] == [("dependency", (0, 0))]
    # two stages on one rank: stage 1's forward cannot use stage 0's output of the step
    chained = judged("(0F0;1F0)OVERLAP_F_B,1B0,0B0\n")
    assert {v.property for v in chained.violations} == {"dependency"}
    assert judged("0F0,(1F0;0F1)OVERLAP_F_B,(1B0;1F1)OVERLAP_F_B,1B1,0B0,0B1\n").verified
