"""Bounded family invariants from package-derived ground instances.

The package derives the family for every ``(p, m[, v])`` in the bound; each instance
becomes ground SMT-LIB facts (the op table ``K/S/M``, the placement ``OW``, a position
witness ``PR/PI`` from unit to position, the package's data-flow start times ``T`` as a
witness, the activation level ``L`` defined by its recurrence) and Z3 refutes "the
property fails on some instance" for the goals of one property:

- completeness: every position holds a required unit of its own rank, at that unit's
  witnessed position, and every required unit is found there (a bijection);
- dependency: the start times respect every input (§2.5 of the semantics) and each
  rank's order, so the data-flow timing reaches every op (the schedule runs);
- memory: every step's unit-model peak on rank ``r`` is at most the stated per-rank
  formula ``PK(r)``, and some step of rank ``r`` reaches it.

Python supplies witnesses only (a unit's position, the package's start times); Z3 checks
every claim about them against the facts. The facts define each function at pairwise
distinct ground points (one op per position, one position per unit), so they are
consistent by construction.
"""

from __future__ import annotations

from typing import Callable

from mpipe_verified.algebra.families import family
from mpipe_verified.ir import Compute
from mpipe_verified.semantics import schedule_times

from .core import Obligation
from .model import B, F, I, W

KIND = {"F": F, "B": B, "I": I, "W": W}
DURATION = {F: 1, B: 2, I: 1, W: 1}  # semantics.STANDARD_DURATIONS
GOALS = {"completeness": ("position", "found"), "dependency": ("inputs",),
         "memory": ("within", "reaches")}
Peak = Callable[[int, int, int | None, int], int]  # (p, m, v, r) -> peak of rank r


def _instance(tag: int, schedule, split: bool, facts: list, goals: list, kinds: tuple,
              peak: Callable[[int], int] | None = None) -> None:
    """Append the ground facts of one derived schedule and the goals of ``kinds`` (the
    ``GOALS`` entries of one property); ``peak(r)`` is rank r's stated peak."""
    placement, mm = schedule.placement, schedule.num_microbatches
    n_stages = placement.num_stages
    timing = schedule_times(schedule.programs, placement)
    if timing.stuck:
        goals.append("false")
        return
    grad = I if split else B
    pos: dict[tuple[int, int, int], tuple[int, int]] = {}
    facts.append(f"(assert (and (= (NS {tag}) {n_stages}) (= (NM {tag}) {mm})))")
    for s, owner in enumerate(placement.stage_to_rank):
        facts.append(f"(assert (= (OW {tag} {s}) {owner}))")
    units = []
    for rr, prog in enumerate(schedule.programs):
        facts.append(f"(assert (and (= (N {tag} {rr}) {len(prog)}) (= (L {tag} {rr} 0) 0)"
                     f" (= (PK {tag} {rr}) {peak(rr) if peak else 0})))")
        for kk, c in enumerate(prog):
            if not isinstance(c, Compute) or c.segment:
                goals.append("false")
                continue
            kd = KIND[c.kind]
            pos.setdefault((kd, c.stage, c.mb), (rr, kk))
            units.append((rr, kk, kd, c.stage, c.mb))
            t = timing.start[rr][kk]
            assert t == int(t)
            facts.append(f"(assert (op {tag} {rr} {kk} {kd} {c.stage} {c.mb} {int(t)}))")
    for (kd, s, mb), (rr, kk) in pos.items():
        facts.append(f"(assert (at {tag} {kd} {s} {mb} {rr} {kk}))")
    missing = (-1, -1)
    for rr, kk, kd, s, mb in units:
        if "position" in kinds:
            goals.append(f"(position {tag} {rr} {kk} {kd} {s} {mb})")
        if "inputs" in kinds:
            if kd == F:
                first, second = pos.get((F, s - 1, mb), missing), missing
            elif kd in (B, I):
                first = pos.get((F, s, mb), missing)
                second = pos.get((grad, s + 1, mb), missing)
            else:
                first, second = pos.get((I, s, mb), missing), missing
            goals.append(f"(inputs {tag} {rr} {kk} {first[0]} {first[1]} {second[0]} "
                         f"{second[1]})")
        if "within" in kinds:
            goals.append(f"(within {tag} {rr} {kk})")
    if "found" in kinds:
        for s in range(n_stages):
            for mb in range(mm):
                for kd in ((F, I, W) if split else (F, B)):
                    rr, kk = pos.get((kd, s, mb), missing)
                    goals.append(f"(found {tag} {kd} {s} {mb} {rr} {kk})")
    if "reaches" in kinds:
        for r in range(placement.num_ranks):
            mine = [f"(reaches {tag} {rr} {kk})" for rr, kk, *_ in units if rr == r]
            goals.append("(or false " + " ".join(mine) + ")")


def _decls(split: bool) -> str:
    """Declarations, fact macros and property macros. Facts: ``op`` (position ``(r, k)``
    of instance ``t`` holds ``kd(s, mb)``, starting at ``time``; and the level recurrence
    ``L(k+1) = L(k) + DL(kind)``), ``at`` (the unit's witnessed position ``PR/PI``).
    Properties: ``position`` (completeness: the op there is a required unit of this rank,
    and that unit's witnessed position is this one, so no unit occurs twice), ``found``
    (the required unit is at its witnessed position, so none is missing), ``inputs``
    (§2.5 on the start times: the given producer positions hold the op's inputs, which
    finish before it starts; the rank's next op starts after it finishes), ``within`` /
    ``reaches`` (the step's unit-model peak is at most / exactly the rank's ``PK``)."""
    kinds = (F, I, W) if split else (F, B)
    grad = I if split else B

    def holds(pr, pk, kind, stage):  # position (pr, pk) holds kind(stage, mb) and has
        return (f"(and (= (K t {pr} {pk}) {kind}) (= (S t {pr} {pk}) {stage}) "  # finished
                f"(= (M t {pr} {pk}) mb) (<= (+ (T t {pr} {pk}) (D {kind})) (T t r k)))")
    return (
        "(declare-fun NS (Int) Int)(declare-fun NM (Int) Int)(declare-fun PK (Int Int) Int)"
        "(declare-fun OW (Int Int) Int)(declare-fun N (Int Int) Int)"
        "(declare-fun K (Int Int Int) Int)(declare-fun S (Int Int Int) Int)"
        "(declare-fun M (Int Int Int) Int)(declare-fun T (Int Int Int) Int)"
        "(declare-fun L (Int Int Int) Int)(declare-fun PR (Int Int Int Int) Int)"
        "(declare-fun PI (Int Int Int Int) Int)"
        f"(define-fun D ((k Int)) Int (ite (= k {B}) {DURATION[B]} 1))"
        f"(define-fun DL ((k Int)) Int (ite (= k {F}) 1 (ite (or (= k {B}) (= k {W})) (- 1) 0)))"
        "(define-fun op ((t Int) (r Int) (k Int) (kd Int) (s Int) (mb Int) (time Int)) Bool"
        " (and (= (K t r k) kd) (= (S t r k) s) (= (M t r k) mb) (= (T t r k) time)"
        " (= (L t r (+ k 1)) (+ (L t r k) (DL kd)))))"
        "(define-fun at ((t Int) (kd Int) (s Int) (mb Int) (r Int) (k Int)) Bool"
        " (and (= (PR t kd s mb) r) (= (PI t kd s mb) k)))"
        "(define-fun position ((t Int) (r Int) (k Int) (kd Int) (s Int) (mb Int)) Bool"
        " (and (= (K t r k) kd) (= (S t r k) s) (= (M t r k) mb)"
        f" (or {' '.join(f'(= kd {x})' for x in kinds)}) (<= 0 s) (< s (NS t))"
        " (= (OW t s) r) (<= 0 mb) (< mb (NM t)) (= (PR t kd s mb) r) (= (PI t kd s mb) k)))"
        "(define-fun found ((t Int) (kd Int) (s Int) (mb Int) (r Int) (k Int)) Bool"
        " (and (= (PR t kd s mb) r) (= (PI t kd s mb) k) (<= 0 k) (< k (N t r))"
        " (= (K t r k) kd) (= (S t r k) s) (= (M t r k) mb)))"
        "(define-fun inputs ((t Int) (r Int) (k Int) (pr Int) (pk Int) (qr Int) (qk Int)) Bool"
        " (let ((kd (K t r k)) (s (S t r k)) (mb (M t r k)))"
        " (and (=> (< (+ k 1) (N t r)) (<= (+ (T t r k) (D kd)) (T t r (+ k 1))))"
        f" (=> (and (= kd {F}) (> s 0)) {holds('pr', 'pk', F, '(- s 1)')})"
        f" (=> (or (= kd {B}) (= kd {I})) {holds('pr', 'pk', F, 's')})"
        f" (=> (and (or (= kd {B}) (= kd {I})) (< (+ s 1) (NS t))) {holds('qr', 'qk', grad, '(+ s 1)')})"
        f" (=> (= kd {W}) {holds('pr', 'pk', I, 's')}))))"
        f"(define-fun within ((t Int) (r Int) (k Int)) Bool"
        f" (<= (+ (L t r k) (ite (= (K t r k) {F}) 1 0)) (PK t r)))"
        f"(define-fun reaches ((t Int) (r Int) (k Int)) Bool"
        f" (= (+ (L t r k) (ite (= (K t r k) {F}) 1 0)) (PK t r)))")


def family_obligations(name: str, prop: str, p_max: int, m_max: int, chunks=(None,),
                       peak: Peak | None = None, only=None):
    """One obligation per ``p <= p_max``: every ``m <= m_max`` (and chunk count; those
    ``only(p, m, v)`` accepts, when given) at once, with the goals of ``prop`` (``GOALS``;
    matching and deadlock use the dependency goals: the lowered plan's guarantees need
    only that the timing reaches every op)."""
    kinds = GOALS.get(prop, GOALS["dependency"])
    split = name.startswith("zb")
    for pp in range(1, p_max + 1):
        facts, goals = [_decls(split)], []
        tag = 0
        for mm in range(1, m_max + 1):
            for v in chunks:
                if only is not None and not only(pp, mm, v):
                    continue
                sched = family(name, pp, mm, v).derive()
                rank_peak = None if peak is None else (
                    lambda r, pp=pp, mm=mm, v=v: peak(pp, mm, v, r))
                _instance(tag, sched, split, facts, goals, kinds, rank_peak)
                tag += 1
        if not tag:
            continue
        yield Obligation(f"{name} p={pp}: every m <= {m_max}",
                         smt=("".join(facts), "(and " + " ".join(goals) + ")"))
