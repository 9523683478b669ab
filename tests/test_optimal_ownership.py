"""Ownership ``optimal``: the encoder forwards' owners chosen by Z3's ``Optimize`` over
the body's idle time (``_Weaver._optimal_owners``). The woven plans verify, the owners are
deterministic and no other assignment has a smaller largest overflow."""

import itertools

import pytest

from mpipe_verified.algebra.transpose import (OPTIMAL_LIMIT, SOURCE, Transpose, _Weaver,
                                              transpose_family)
from mpipe_verified.cli import main
from mpipe_verified.errors import ParameterError
from mpipe_verified.lower import lower
from mpipe_verified.semantics import schedule_times
from mpipe_verified.verify import verify


def _weaver(t: Transpose) -> _Weaver:
    body = t.body.derive()
    cost = t.estimate_cost()
    home = 0 if t.side == SOURCE else body.placement.stage_to_rank[-1]
    timing = schedule_times(body.programs, body.placement, cost.duration)
    return _Weaver(t, body, timing, cost, home, "optimal")


def _largest_overflow(w: _Weaver, owners) -> float:
    """The model's objective for ``owners``: on each rank, how far the forwards due by
    each deadline (released from each release) exceed its idle time there."""
    source = w.t.side == SOURCE
    order = w.order if source else list(reversed(w.order))
    stage = 0 if source else w.last
    worst = 0.0
    for r, rk in enumerate(w.ranks):
        load = 0.0
        for mb in order:
            rank, i = w.position[_forward(stage, mb)]
            t = (w.ranks[rank].start0 if source else w.ranks[rank].finish0)[i]
            load += w.seg.forward(mb) if owners[mb] == r else 0.0
            worst = max(worst, load - w._idle(rk, t, before=source))
    return worst


def _forward(stage, mb):
    from mpipe_verified.ir import Compute
    return Compute("F", stage, mb)


@pytest.mark.parametrize("side, mode", [("source", "owner"), ("source", "recompute"),
                                        ("source", "frozen"), ("sink", "owner")])
def test_optimal_owners_verify_and_beat_every_other_assignment(side, mode):
    t = transpose_family(3, 4, body="1f1b", side=side, mode=mode, ownership="optimal",
                         costs=[2.0, 1.0, 3.0, 1.0])
    plan = lower(t.derive())
    assert verify(plan).verified
    assert plan == lower(t.derive())  # the same model, the same owners
    w = _weaver(t)
    owners = w._optimal_owners()
    best = _largest_overflow(w, owners)
    for other in itertools.product(range(3), repeat=4):  # every assignment: 3^4
        assert best <= _largest_overflow(w, other) + 1e-9


def test_optimal_ownership_is_bounded_and_reachable_from_the_command_line(capsys):
    assert main(["check", "--family", "transpose", "--pp", "4", "--microbatches", "8",
                 "--mode", "owner", "--ownership", "optimal"]) == 0
    p, m = 64, OPTIMAL_LIMIT // 64 + 1
    with pytest.raises(ParameterError, match="optimal"):
        transpose_family(p, m, ownership="optimal").derive()
