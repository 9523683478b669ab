"""The models behind the ZBV, DualPipeV, ZB-H1 and transpose family laws are the code's.

- ZBV's word model (``proofs.family_zbv.model``) is, op for op, what ``derive`` returns
  for every ``p <= 8, m <= 24``, DualPipeV's (``proofs.family_dualpipev.model``) for
  every ``p <= 8, 2p <= m <= 24`` and ZB-H1's (``proofs.family_zb.h1_model``) for every
  ``p <= 8, p <= m <= 24``: the all-sizes laws reason about the package's programs.
- The bounded laws' check (``proofs.instances``: the kernel's obligations over a lowered
  plan) is not a formality: a broken plan, or a wrong stated peak, makes the formula
  satisfiable, and Z3 says so.
- The all-sizes ZBV peak law fails when the stated closed form is off by one somewhere,
  ZB-H1's dependency law when its clock leaves out the wait for the first gradient, and
  the inputs the ZBV, DualPipeV and ZB-H1 dependency laws check are the shared
  semantics' (``needs`` and ``produces``).
"""

from __future__ import annotations

import attrs
import pytest
import z3

from mpipe_verified import kernel
from mpipe_verified.algebra.families import family
from mpipe_verified.algebra.transpose import transpose_family
from mpipe_verified.ir import PROPERTIES, Compute, Plan, Recv, Send
from mpipe_verified.lower import lower
from mpipe_verified.proofs import (core, family_dualpipev, family_transpose, family_zb,
                                   family_zbv, instances)
from mpipe_verified.semantics import needs, peak_memory, produces

PROPS = PROPERTIES


def _sat(formula: str) -> bool:
    solver = z3.Solver()
    solver.from_string(kernel.QUERY_DECLS + f"(assert {formula})")
    answer = solver.check()
    assert answer != z3.unknown
    return answer == z3.sat


def _v_shape(p: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s``, going down, then back up: the models' ``stage``."""
    return tuple(min(s, 2 * p - 1 - s) for s in range(2 * p))


@pytest.mark.parametrize("name, module, first_m", [("zbv", family_zbv, lambda p: 1),
                                                   ("dualpipev", family_dualpipev,
                                                    lambda p: 2 * p)])
def test_the_model_is_the_package_op_for_op(name, module, first_m):
    for p in range(1, 9):
        for m in range(first_m(p), 25):
            derived = family(name, p, m).derive()
            assert derived.placement.stage_to_rank == _v_shape(p)
            assert module.model(p, m, 2) == derived.programs, (p, m)


@pytest.mark.parametrize("fam", [family_zb.H1, family_zb.H2], ids=lambda f: f.name)
def test_the_zb_words_are_the_package_op_for_op(fam):
    for p in range(1, 9):
        for m in range(1, 25):
            if fam.region(p, m):
                derived = family(fam.name, p, m).derive()
                assert derived.placement.stage_to_rank == tuple(range(p))
                assert fam.model(p, m) == derived.programs, (p, m)


def _replace(plan: Plan, rank: int, program) -> Plan:
    programs = list(plan.programs)
    programs[rank] = tuple(program)
    return Plan(plan.placement, plan.num_microbatches, tuple(programs), plan.cut)


@pytest.fixture(scope="module")
def zbv_plan() -> Plan:
    return lower(family("zbv", 3, 5).derive())


def test_a_sound_lowered_plan_has_no_violation(zbv_plan):
    for prop in PROPS:
        assert not _sat(instances.plan_violation(zbv_plan, prop, family_zbv.peak_of)), prop


def test_a_dropped_op_breaks_completeness(zbv_plan):
    prog = list(zbv_plan.programs[1])
    compute = next(i for i, op in enumerate(prog) if not isinstance(op, (Send, Recv)))
    del prog[compute]
    assert _sat(instances.plan_violation(_replace(zbv_plan, 1, prog), "completeness"))


def test_swapped_sends_break_matching_and_crossed_ends_deadlock(zbv_plan):
    prog = list(zbv_plan.programs[0])
    sends = [i for i, op in enumerate(prog) if isinstance(op, Send)]
    a, b = next((i, j) for i in sends for j in sends if i < j and prog[i].peer == prog[j].peer)
    prog[a], prog[b] = prog[b], prog[a]  # FIFO now pairs each with the other's receive
    assert _sat(instances.plan_violation(_replace(zbv_plan, 0, prog), "matching"))
    # rank 0 waits for its first gradient before sending the first activation
    prog = list(zbv_plan.programs[0])
    first_send = next(i for i, op in enumerate(prog) if isinstance(op, Send))
    first_recv = next(i for i, op in enumerate(prog) if isinstance(op, Recv))
    prog.insert(first_send, prog.pop(first_recv))
    assert _sat(instances.plan_violation(_replace(zbv_plan, 0, prog), "deadlock"))


def test_a_wrong_stated_peak_is_refuted(zbv_plan):
    for off in (-1, 1):  # too low: some step exceeds it; too high: it is never reached
        wrong = lambda p, m, r, off=off: family_zbv.peak_of(p, m, r) + off  # noqa: E731
        assert _sat(instances.plan_violation(zbv_plan, "memory", wrong))
    # as an upper bound, too high is fine and too low is not
    assert not _sat(instances.plan_violation(
        zbv_plan, "memory", lambda p, m, r: family_zbv.peak_of(p, m, r) + 1, exact=False))
    assert _sat(instances.plan_violation(
        zbv_plan, "memory", lambda p, m, r: family_zbv.peak_of(p, m, r) - 1, exact=False))


@pytest.mark.parametrize("variant", family_transpose.VARIANTS, ids="-".join)
def test_transpose_stated_peaks_beyond_the_bound(variant):
    """Past the law's bound (one more rank, three more microbatches) the stated peak is
    the measured one where the law says exact, and a bound elsewhere."""
    body, mode, own = variant
    stated, exact = family_transpose.peak(body, mode, own)
    p, m = family_transpose.P_MAX + 1, family_transpose.M_MAX + 3
    plan = lower(transpose_family(p, m, body=body, mode=mode, ownership=own).derive())
    measured = [peak_memory(plan)[r][0] for r in range(p)]
    claimed = [stated(p, m, r) for r in range(p)]
    if exact:
        assert measured == claimed
    else:
        assert all(x <= y for x, y in zip(measured, claimed))


def test_the_zbv_peak_law_fails_for_a_wrong_closed_form(monkeypatch):
    right = family_zbv.peak_of
    monkeypatch.setattr(family_zbv, "peak_of",
                        lambda p, m, r: family_zbv.mn(right(p, m, r), 2 * p - 1))
    assert core.check(family_zbv.zbv_peak_memory).status == core.FAILED


def _holds(cond, p: int, r: int, module) -> bool:
    at = [(module.p, z3.IntVal(p)), (module.r, z3.IntVal(r))]
    return cond is True or z3.is_true(z3.simplify(z3.substitute(cond, *at)))


def _makers(wanted, units) -> set:
    return {(uk, us) for uk, us in units if wanted & set(produces(Compute(uk, us, 0)))}


def test_zbv_dependency_edges_are_the_semantics_inputs():
    """The inputs the ZBV dependency law checks are exactly what ``semantics.needs``
    asks of each unit and which unit ``semantics.produces`` it."""
    stage = family_zbv.stage
    for p in range(1, 6):
        units = {(kd, stage(p, r, c)) for r in range(p) for kd in "FIW" for c in (0, 1)}
        for r in range(p):
            for kd in "FIW":
                for c in (0, 1):
                    stated = {(pk, stage(p, r + dr, pc))
                              for _, cond, (_, ck, cc), (dr, pk, pc) in family_zbv._edges()
                              if (ck, cc) == (kd, c) and _holds(cond, p, r, family_zbv)}
                    wanted = set(needs(Compute(kd, stage(p, r, c), 0), 2 * p))
                    assert stated == _makers(wanted, units), (p, r, kd, c)


def test_dualpipev_dependency_edges_are_the_semantics_inputs():
    """Likewise for DualPipeV, whose gradient comes from a ``B`` or an ``I``."""
    stage = family_dualpipev.stage
    for p in range(1, 6):
        units = {(kd, stage(p, r, c)) for r in range(p) for kd in "FBIW" for c in (0, 1)}
        for r in range(p):
            for kd in "FBIW":
                for c in (0, 1):
                    stated = {(q, stage(p, r + dr, pc))
                              for _, cond, kinds, cc, (dr, pk, pc) in family_dualpipev._edges()
                              if kd in kinds and cc == c and _holds(cond, p, r,
                                                                      family_dualpipev)
                              for q in (("B", "I") if pk == "grad" else (pk,))}
                    wanted = set(needs(Compute(kd, stage(p, r, c), 0), 2 * p))
                    assert stated == _makers(wanted, units), (p, r, kd, c)


def test_zb_dependency_edges_are_the_semantics_inputs():
    for p in range(1, 6):
        units = {(kd, r) for r in range(p) for kd in "FIW"}
        for r in range(p):
            for kd in "FIW":
                stated = {(pk, r + dr) for _, cond, ck, (dr, pk) in family_zb._edges()
                          if ck == kd and _holds(cond, p, r, family_zb)}
                wanted = set(needs(Compute(kd, r, 0), p))
                assert stated == _makers(wanted, units), (p, r, kd)


def test_the_zb_h1_dependency_law_fails_without_the_wait_for_the_first_gradient():
    """Rank r idles p-1-r steps before its first I: a clock without that wait (ZB-H2's)
    misses an input, and Z3 says so."""
    no_wait = attrs.evolve(family_zb.H1, clock=family_zb.H2.clock)
    dependency = no_wait.laws()[1]
    assert dependency.property == "dependency"
    assert core.check(dependency).status == core.FAILED
    assert core.check(family_zb.zb_h1_dependency).status == core.PROVED
