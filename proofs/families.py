"""Family invariants (``algebra.families``).

**All sizes, closed form.** 1F1B (``F^{p-1-r} (F B)*``) and GPipe (``F* B*``) place stage
``r`` on rank ``r`` (looped, one chunk), and rank ``r``'s ``k``-th op is a closed-form
function of ``(p, m, r, k)``. With ``w = min(p-1-r, m)`` warmup forwards, 1F1B's op ``k`` is

    k < w:            F(k)                       (warmup)
    w <= k < 2m-w:    F(w + (k-w)/2) if k-w even, B((k-w-1)/2) if odd   (steady 1F1B)
    2m-w <= k < 2m:   B(k - m)                   (cooldown)

and GPipe's is ``F(k)`` for ``k < m``, ``B(k-m)`` after. The laws quantify over every
``p >= 1, m >= 1, 0 <= r < p`` and position ``k`` (or microbatch): completeness as a
bijection between positions ``[0, 2m)`` and units with an explicit inverse; dependency as a
closed-form data-flow timing (unit durations) that Z3 checks against every constraint; the
unit-model peak by a closed-form activation level proven to satisfy the level's recurrence
(induction on ``k``). ``closed_forms_match_package`` proves, bounded, that these closed
forms are exactly what the package derives.

**Bounded, package-generated.** Interleaved 1F1B, ZB-H1 and ZB-H2 are derived by the
package for every ``p <= 8, m <= 16`` (interleaved: chunks 2 and 3); each instance becomes
ground SMT-LIB facts (the op table ``K/S/M``, the placement ``OW``, a position witness
``PR/PI`` from unit to position, the package's data-flow start times ``T`` as a witness,
the activation level ``L`` defined by its recurrence) and Z3 refutes "some property fails
on some instance": completeness (every position holds a required unit of its own rank,
at that unit's witnessed position, and every required unit is found there: a bijection),
dependency (the start times respect every §2.5 input and each rank's order), and the
unit-model memory figure.
"""

from __future__ import annotations

import z3

from mpipe_verified.algebra.families import family, gpipe, one_f_one_b
from mpipe_verified.ir import Compute
from mpipe_verified.semantics import schedule_times

from .core import Obligation, all_sizes, bounded, law
from .model import B, F, I, W

P_MAX, M_MAX = 8, 16
BOUND = f"p <= {P_MAX}, m <= {M_MAX}"

p, m, r, k, x = z3.Ints("p m r k x")
SIZES = (p >= 1, m >= 1, 0 <= r, r < p)


def _min(a, b):
    return z3.If(a < b, a, b)


def warmup(r_=r):
    return _min(p - 1 - r_, m)


def one_f_one_b_op(k_, r_=r):
    """``(kind, mb)`` of rank ``r_``'s op ``k_`` in 1F1B."""
    w = warmup(r_)
    j = k_ - w
    steady_kind = z3.If(j % 2 == 0, F, B)
    steady_mb = z3.If(j % 2 == 0, w + j / 2, (j - 1) / 2)
    kind = z3.If(k_ < w, F, z3.If(k_ < 2 * m - w, steady_kind, B))
    mb = z3.If(k_ < w, k_, z3.If(k_ < 2 * m - w, steady_mb, k_ - m))
    return kind, mb


def one_f_one_b_pos(kind, x_, r_=r):
    """Position of ``kind(x_)`` on rank ``r_`` (the inverse of ``one_f_one_b_op``)."""
    w = warmup(r_)
    pos_f = z3.If(x_ < w, x_, w + 2 * (x_ - w))
    pos_b = z3.If(x_ < m - w, w + 2 * x_ + 1, m + x_)
    return pos_f if kind == F else pos_b


def gpipe_op(k_, r_=r):
    return z3.If(k_ < m, F, B), z3.If(k_ < m, k_, k_ - m)


def gpipe_pos(kind, x_, r_=r):
    return x_ if kind == F else m + x_


def _complete(op, pos, name):
    """Rank r's ops ``[0, 2m)`` and the units ``{F, B} x [0, m)`` are in bijection."""
    kind, mb = op(k)
    yield Obligation(f"{name}: each position holds a unit found at that unit's position",
                     z3.Implies(z3.And(0 <= k, k < 2 * m), z3.And(
                         z3.Or(kind == F, kind == B), 0 <= mb, mb < m,
                         z3.If(kind == F, pos(F, mb), pos(B, mb)) == k)), SIZES)
    for kd, letter in ((F, "F"), (B, "B")):
        at = pos(kd, x)
        k2, mb2 = op(at)
        yield Obligation(f"{name}: each {letter}(r, x) sits at its position",
                         z3.Implies(z3.And(0 <= x, x < m),
                                    z3.And(0 <= at, at < 2 * m, k2 == kd, mb2 == x)), SIZES)


def _order(pos, name):
    yield Obligation(f"{name}: B(r, x) after F(r, x)",
                     z3.Implies(z3.And(0 <= x, x < m), pos(F, x) < pos(B, x)), SIZES)


def _dataflow(op, tf, tb, name):
    """Unit-duration start times ``tf(r, x)``, ``tb(r, x)``: each rank's ops in order,
    ``F(r,x)`` after ``F(r-1,x)`` finished, ``B(r,x)`` after ``B(r+1,x)`` (or, on the last
    rank, after ``F(r,x)``) finished."""
    def t(k_):
        kind, mb = op(k_)
        return z3.If(kind == F, tf(r, mb), tb(r, mb))
    yield Obligation(f"{name}: each rank's ops run in order",
                     z3.Implies(z3.And(0 <= k, k + 1 < 2 * m), t(k) + 1 <= t(k + 1)), SIZES)
    inside = z3.And(0 <= x, x < m)
    yield Obligation(f"{name}: F(r, x) starts after F(r-1, x) finishes",
                     z3.Implies(z3.And(inside, r >= 1), tf(r - 1, x) + 1 <= tf(r, x)), SIZES)
    yield Obligation(f"{name}: B(r, x) starts after B(r+1, x) finishes",
                     z3.Implies(z3.And(inside, r + 1 < p), tb(r + 1, x) + 1 <= tb(r, x)), SIZES)
    yield Obligation(f"{name}: on the last rank, B(r, x) starts after F(r, x) finishes",
                     z3.Implies(z3.And(inside, r == p - 1), tf(r, x) + 1 <= tb(r, x)), SIZES)


def _peak(op, n_f, n_b, peak, witness, name):
    """Unit model: ``F`` stores 1, ``B`` frees it. ``level(k) = n_f(k) - n_b(k)`` (ops
    before position k) satisfies the level's recurrence (so it is the level), and the peak
    ``max_k level(k) + [op k is F]`` equals ``peak``, reached at ``witness``."""
    def level(k_):
        return n_f(k_) - n_b(k_)

    def delta(k_):
        kind, _ = op(k_)
        return z3.If(kind == F, 1, -1)
    yield Obligation(f"{name}: level(0) = 0", level(0) == 0, SIZES)
    yield Obligation(f"{name}: level(k+1) = level(k) + (+1 for F, -1 for B)",
                     z3.Implies(z3.And(0 <= k, k < 2 * m), level(k + 1) == level(k) + delta(k)),
                     SIZES)
    kind, _ = op(k)
    alloc = z3.If(kind == F, 1, 0)
    yield Obligation(f"{name}: every step's peak <= {peak}",
                     z3.Implies(z3.And(0 <= k, k < 2 * m), level(k) + alloc <= peak(r)), SIZES)
    kw, _ = op(witness)
    yield Obligation(f"{name}: the peak {peak} is reached",
                     z3.And(0 <= witness, witness < 2 * m, kw == F,
                            level(witness) + 1 == peak(r)), SIZES)


class _Peak:
    """A printable peak formula (its ``str`` goes into obligation names)."""

    def __init__(self, fn, text: str) -> None:
        self.fn, self.text = fn, text

    def __call__(self, r_):
        return self.fn(r_)

    def __str__(self) -> str:
        return self.text


# --- 1F1B


def _one_f_one_b_tf(r_, x_):
    return z3.If(x_ <= warmup(r_), x_ + r_, 2 * x_ + r_)


def _one_f_one_b_tb(r_, x_):
    return 2 * x_ + 2 * p - 1 - r_


def _one_f_one_b_nf(k_):
    w = warmup()
    return z3.If(k_ <= w, k_, z3.If(k_ <= 2 * m - w, w + (k_ - w + 1) / 2, m))


def _one_f_one_b_nb(k_):
    w = warmup()
    return z3.If(k_ <= w, 0, z3.If(k_ <= 2 * m - w, (k_ - w) / 2, k_ - m))


CLOSED = "the pattern's closed form, = the package's weave for p <= 8, m <= 16"
ALL = all_sizes(f"every p >= 1, m >= 1, rank r < p and position or microbatch; {CLOSED}")


@law("1f1b_completeness",
     "1F1B: rank r runs F(r, x) and B(r, x) exactly once for every microbatch x, and "
     "nothing else (closed form F^{p-1-r} (F B)*)", ALL, family="1f1b",
     property="completeness")
def one_f_one_b_completeness():
    yield from _complete(one_f_one_b_op, one_f_one_b_pos, "1F1B")


@law("1f1b_dependency",
     "1F1B: B(r, x) comes after F(r, x) on rank r, and a data-flow timing exists (F(r,x) "
     "after F(r-1,x), B(r,x) after B(r+1,x), each rank in order): the schedule runs",
     all_sizes(f"every p >= 1, m >= 1, rank, position; closed-form timing witness; {CLOSED}"),
     family="1f1b", property="dependency")
def one_f_one_b_dependency():
    yield from _order(one_f_one_b_pos, "1F1B")
    yield from _dataflow(one_f_one_b_op, _one_f_one_b_tf, _one_f_one_b_tb, "1F1B")


@law("1f1b_peak_memory",
     "1F1B: the peak of stored activations (unit model) on rank r is min(p - r, m)",
     all_sizes(f"every p >= 1, m >= 1, rank; induction on the position for the level; "
               f"{CLOSED}"), family="1f1b", property="memory")
def one_f_one_b_peak_memory():
    peak = _Peak(lambda r_: _min(p - r_, m), "min(p - r, m)")
    yield from _peak(one_f_one_b_op, _one_f_one_b_nf, _one_f_one_b_nb, peak,
                     _min(warmup(), m - 1), "1F1B")


# --- GPipe


@law("gpipe_invariants",
     "GPipe: rank r runs F(r, x) then B(r, x) exactly once per microbatch, a data-flow "
     "timing exists, and its unit-model peak is m", ALL)
def gpipe_invariants():
    yield from _complete(gpipe_op, gpipe_pos, "GPipe")
    yield from _order(gpipe_pos, "GPipe")
    yield from _dataflow(gpipe_op, lambda r_, x_: x_ + r_,
                         lambda r_, x_: m + 2 * p - 2 - r_ + x_, "GPipe")
    yield from _peak(gpipe_op, lambda k_: _min(k_, m), lambda k_: z3.If(k_ <= m, 0, k_ - m),
                     _Peak(lambda r_: m, "m"), m - 1, "GPipe")


# --- the closed forms are the package's


def _smt_fun(name: str, expr) -> str:
    return f"(define-fun {name} ((p Int) (m Int) (r Int) (k Int)) Int {expr.sexpr()})"


@law("closed_forms_match_package",
     "the closed forms above are the package's 1F1B and GPipe programs: stage r on rank r, "
     "2m ops, op k as stated",
     bounded(f"{BOUND}; every rank and position, package-derived"), weight=2)
def closed_forms_match_package():
    for name, make, op in (("1F1B", one_f_one_b, one_f_one_b_op), ("GPipe", gpipe, gpipe_op)):
        kind, mb = op(k)
        defs = _smt_fun("ck", kind) + _smt_fun("cm", mb)
        facts = []
        for pp in range(1, P_MAX + 1):
            for mm in range(1, M_MAX + 1):
                sched = make(pp, mm).derive()
                if sched.placement.stage_to_rank != tuple(range(pp)):
                    facts.append("false")
                for rr, prog in enumerate(sched.programs):
                    facts.append("true" if len(prog) == 2 * mm else "false")
                    for kk, c in enumerate(prog):
                        if not isinstance(c, Compute) or c.stage != rr or c.segment:
                            facts.append("false")
                            continue
                        code = {"F": F, "B": B, "I": I, "W": W}[c.kind]
                        facts.append(f"(= (ck {pp} {mm} {rr} {kk}) {code})"
                                     f"(= (cm {pp} {mm} {rr} {kk}) {c.mb})")
        yield Obligation(f"{name}: package programs = closed form",
                         smt=(defs, "(and " + " ".join(facts) + ")"))


# ---------------------------------------------------------------- bounded families

KIND = {"F": F, "B": B, "I": I, "W": W}
DURATION = {F: 1, B: 2, I: 1, W: 1}  # semantics.STANDARD_DURATIONS


def _instance(tag: int, schedule, split: bool, facts: list, goals: list,
              peak: int | None = None, exact: bool = False) -> None:
    """Append the ground facts and the property goals of one derived schedule (see the
    module docstring and ``_decls``). Python supplies witnesses only (a unit's position,
    an input's producer position); Z3 checks every claim about them against the facts.
    ``peak`` bounds every step's unit-model peak; with ``exact``, some step reaches it."""
    placement, mm = schedule.placement, schedule.num_microbatches
    n_stages = placement.num_stages
    timing = schedule_times(schedule.programs, placement)
    if timing.stuck:
        goals.append("false")
        return
    grad = I if split else B
    pos: dict[tuple[int, int, int], tuple[int, int]] = {}
    facts.append(f"(assert (and (= (NS {tag}) {n_stages}) (= (NM {tag}) {mm}) "
                 f"(= (PK {tag}) {peak if peak is not None else 0})))")
    for s, owner in enumerate(placement.stage_to_rank):
        facts.append(f"(assert (= (OW {tag} {s}) {owner}))")
    units = []
    for rr, prog in enumerate(schedule.programs):
        facts.append(f"(assert (and (= (N {tag} {rr}) {len(prog)}) (= (L {tag} {rr} 0) 0)))")
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
        goals.append(f"(position {tag} {rr} {kk} {kd} {s} {mb})")
        if kd == F:
            first, second = pos.get((F, s - 1, mb), missing), missing
        elif kd in (B, I):
            first, second = pos.get((F, s, mb), missing), pos.get((grad, s + 1, mb), missing)
        else:
            first, second = pos.get((I, s, mb), missing), missing
        goals.append(f"(inputs {tag} {rr} {kk} {first[0]} {first[1]} {second[0]} {second[1]})")
        if peak is not None:
            goals.append(f"(within {tag} {rr} {kk})")
    kinds = (F, I, W) if split else (F, B)
    for s in range(n_stages):
        for mb in range(mm):
            for kd in kinds:
                rr, kk = pos.get((kd, s, mb), missing)
                goals.append(f"(found {tag} {kd} {s} {mb} {rr} {kk})")
    if exact:
        goals.append("(or " + " ".join(f"(reaches {tag} {rr} {kk})" for rr, kk, *_ in units)
                     + ")")


def _decls(split: bool) -> str:
    """Declarations, fact macros and property macros. Facts: ``op`` (position ``(r, k)``
    of instance ``t`` holds ``kd(s, mb)``, starting at ``time``; and the level recurrence
    ``L(k+1) = L(k) + DL(kind)``), ``at`` (the unit's witnessed position ``PR/PI``).
    Properties: ``position`` (completeness: the op there is a required unit of this rank,
    and that unit's witnessed position is this one, so no unit occurs twice), ``found``
    (the required unit is at its witnessed position, so none is missing), ``inputs``
    (§2.5 on the start times: the given producer positions hold the op's inputs, which
    finish before it starts; the rank's next op starts after it finishes), ``within`` /
    ``reaches`` (the step's unit-model peak is at most / exactly ``PK``)."""
    kinds = (F, I, W) if split else (F, B)
    grad = I if split else B

    def holds(pr, pk, kind, stage):  # position (pr, pk) holds kind(stage, mb) and has
        return (f"(and (= (K t {pr} {pk}) {kind}) (= (S t {pr} {pk}) {stage}) "  # finished
                f"(= (M t {pr} {pk}) mb) (<= (+ (T t {pr} {pk}) (D {kind})) (T t r k)))")
    return (
        "(declare-fun NS (Int) Int)(declare-fun NM (Int) Int)(declare-fun PK (Int) Int)"
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
        f" (<= (+ (L t r k) (ite (= (K t r k) {F}) 1 0)) (PK t)))"
        f"(define-fun reaches ((t Int) (r Int) (k Int)) Bool"
        f" (= (+ (L t r k) (ite (= (K t r k) {F}) 1 0)) (PK t)))")


def _family_obligations(name: str, split: bool, chunks=(None,), peak=None, exact=False):
    """One obligation per ``p``: every ``m <= M_MAX`` (and chunk count) at once. The facts
    define each function at pairwise distinct ground points (one op per position, one
    position per unit), so they are consistent by construction."""
    for pp in range(1, P_MAX + 1):
        facts, goals = [_decls(split)], []
        tag = 0
        for mm in range(1, M_MAX + 1):
            for v in chunks:
                sched = family(name, pp, mm, v).derive()
                _instance(tag, sched, split, facts, goals,
                          None if peak is None else peak(pp, mm), exact)
                tag += 1
        yield Obligation(f"{name} p={pp}: every m <= {M_MAX}",
                         smt=("".join(facts), "(and " + " ".join(goals) + ")"))


@law("interleaved_1f1b_complete_dependency",
     "interleaved 1F1B (chunks 2 and 3): every F(s, x) and B(s, x) exactly once on the rank "
     "owning s, and a data-flow timing (the package's) respects every input",
     bounded(f"{BOUND}, chunks in {{2, 3}}; package-derived instances"), weight=20)
def interleaved_complete_dependency():
    yield from _family_obligations("interleaved-1f1b", split=False, chunks=(2, 3))


@law("zb_h1_invariants",
     "ZB-H1: complete (F, I, W once each per stage and microbatch), data-flow respected, and "
     "the unit-model peak over ranks is exactly min(p, m)",
     bounded(f"{BOUND}; package-derived instances"), weight=8)
def zb_h1_invariants():
    yield from _family_obligations("zb-h1", split=True, peak=lambda pp, mm: min(pp, mm),
                                   exact=True)


@law("zb_h2_invariants",
     "ZB-H2: complete, data-flow respected, and the unit-model peak on every rank is at most "
     "2p - 1",
     bounded(f"{BOUND}; package-derived instances"), weight=8)
def zb_h2_invariants():
    yield from _family_obligations("zb-h2", split=True, peak=lambda pp, mm: 2 * pp - 1)
