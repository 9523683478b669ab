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

Matching and deadlock of the lowered plan: ``proofs.lowered`` proves them for every
schedule whose data-flow timing reaches every op, and the family's closed-form timing
witness shows that it does. The other families' laws: ``family_interleaved``,
``family_zb`` (bounded) and part of the registry's other modules.
"""

from __future__ import annotations

import z3

from mpipe_verified.algebra.families import gpipe, one_f_one_b
from mpipe_verified.ir import Compute

from .core import Obligation, all_sizes, bounded, law
from .lowered import deadlock_obligations, matching_obligations
from .model import B, F, I, W
from . import shape
from .shape import ite, mn

P_MAX, M_MAX = 8, 16
BOUND = f"p <= {P_MAX}, m <= {M_MAX}"

p, m, r, k, x = z3.Ints("p m r k x")
SIZES = (p >= 1, m >= 1, 0 <= r, r < p)


def warmup(r_=r, p_=p, m_=m):
    return mn(p_ - 1 - r_, m_)


def one_f_one_b_op(k_, r_=r, p_=p, m_=m):
    """``(kind, mb)`` of rank ``r_``'s op ``k_`` in 1F1B (Z3 terms or Python integers):
    the shape ``F^w (F B)*`` over ``m`` microbatches, ``w`` the warmup."""
    return shape.op(k_, warmup(r_, p_, m_), m_)


def one_f_one_b_pos(kind, x_, r_=r):
    """Position of ``kind(x_)`` on rank ``r_`` (the inverse of ``one_f_one_b_op``)."""
    w = warmup(r_)
    return shape.pos_f(x_, w, m) if kind == F else shape.pos_b(x_, w, m)


def gpipe_op(k_, r_=r, p_=p, m_=m):
    return ite(k_ < m_, F, B), ite(k_ < m_, k_, k_ - m_)


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


def _peaks(formula):
    """The CLI's per-rank peak of a family instance from ``formula(p, m, r)``."""
    return lambda params: tuple(formula(params["pp"], params["microbatches"], r)
                                for r in range(params["pp"]))


def _lowered(kind, op, tf, tb, name):
    """Matching or deadlock of the lowered plan (``proofs.lowered``, any schedule whose
    timing reaches every op) and the family's data-flow timing, which reaches every op."""
    yield from (matching_obligations if kind == "matching" else deadlock_obligations)()
    yield from _dataflow(op, tf, tb, name)


LOWERED = ("the lowering model of proofs.lowered (= lower for p <= 8, m <= 24, "
           "tests/test_proofs_expanded.py)")


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
               f"{CLOSED}"), family="1f1b", property="memory",
     peak=_peaks(lambda p_, m_, r_: min(p_ - r_, m_)))
def one_f_one_b_peak_memory():
    peak = _Peak(lambda r_: mn(p - r_, m), "min(p - r, m)")
    yield from _peak(one_f_one_b_op, _one_f_one_b_nf, _one_f_one_b_nb, peak,
                     mn(warmup(), m - 1), "1F1B")


@law("1f1b_matching",
     "1F1B: the lowered plan pairs each send with its receive (FIFO per rank pair, equal "
     "counts and payloads)",
     all_sizes(f"every p >= 1, m >= 1, rank pair; closed-form timing witness; {LOWERED}"),
     family="1f1b", property="matching")
def one_f_one_b_matching():
    yield from _lowered("matching", one_f_one_b_op, _one_f_one_b_tf, _one_f_one_b_tb,
                        "1F1B")


@law("1f1b_deadlock",
     "1F1B: the lowered plan runs to completion under rendezvous (completion-time witness: "
     "each op's place in lowering's event order)",
     all_sizes(f"every p >= 1, m >= 1, rank pair; closed-form timing witness; {LOWERED}"),
     family="1f1b", property="deadlock")
def one_f_one_b_deadlock():
    yield from _lowered("deadlock", one_f_one_b_op, _one_f_one_b_tf, _one_f_one_b_tb,
                        "1F1B")


# --- GPipe


def _gpipe_tf(r_, x_):
    return x_ + r_


def _gpipe_tb(r_, x_):
    return m + 2 * p - 2 - r_ + x_


@law("gpipe_completeness",
     "GPipe: rank r runs F(r, x) and B(r, x) exactly once per microbatch, and nothing else "
     "(closed form F* B*)", ALL, family="gpipe", property="completeness")
def gpipe_completeness():
    yield from _complete(gpipe_op, gpipe_pos, "GPipe")


@law("gpipe_dependency",
     "GPipe: B(r, x) after F(r, x) on rank r, and a data-flow timing exists: the schedule "
     "runs",
     all_sizes(f"every p >= 1, m >= 1, rank, position; closed-form timing witness; {CLOSED}"),
     family="gpipe", property="dependency")
def gpipe_dependency():
    yield from _order(gpipe_pos, "GPipe")
    yield from _dataflow(gpipe_op, _gpipe_tf, _gpipe_tb, "GPipe")


@law("gpipe_memory", "GPipe: the unit-model peak on every rank is m",
     all_sizes(f"every p >= 1, m >= 1, rank; induction on the position for the level; "
               f"{CLOSED}"), family="gpipe", property="memory",
     peak=_peaks(lambda p_, m_, r_: m_))
def gpipe_memory():
    yield from _peak(gpipe_op, lambda k_: mn(k_, m), lambda k_: z3.If(k_ <= m, 0, k_ - m),
                     _Peak(lambda r_: m, "m"), m - 1, "GPipe")


@law("gpipe_matching",
     "GPipe: the lowered plan pairs each send with its receive (FIFO per rank pair, equal "
     "counts and payloads)",
     all_sizes(f"every p >= 1, m >= 1, rank pair; closed-form timing witness; {LOWERED}"),
     family="gpipe", property="matching")
def gpipe_matching():
    yield from _lowered("matching", gpipe_op, _gpipe_tf, _gpipe_tb, "GPipe")


@law("gpipe_deadlock",
     "GPipe: the lowered plan runs to completion under rendezvous (completion-time witness: "
     "each op's place in lowering's event order)",
     all_sizes(f"every p >= 1, m >= 1, rank pair; closed-form timing witness; {LOWERED}"),
     family="gpipe", property="deadlock")
def gpipe_deadlock():
    yield from _lowered("deadlock", gpipe_op, _gpipe_tf, _gpipe_tb, "GPipe")


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
