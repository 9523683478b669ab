"""The reference judge (``reference.judge``) on plans with a cut: it accepts every valid
transpose plan (and counts the memory the package counts), rejects each segment mutation
kind for the property the design says it breaks, and agrees with ``verify`` on the whole
set of violated properties; plus one hand-written plan checked against the rules alone."""

from __future__ import annotations

import random

import pytest

import reference
import strategies as S
from mpipe_verified.algebra.transpose import OWNERSHIPS, transpose_family
from mpipe_verified.ir import SINK, SOURCE
from mpipe_verified.lower import lower
from mpipe_verified.semantics import peak_memory


def _valid(body: str):
    v = 2 if body == "interleaved-1f1b" else None
    for p in (2, 4):
        for side in (SOURCE, SINK):
            for mode in S.transpose_modes(side):
                for ownership in OWNERSHIPS:
                    for m in ((2 * p,) if body == "dualpipev" else (1, p + 1)):
                        yield transpose_family(p, m, v, body=body, side=side, mode=mode,
                                               ownership=ownership)


@pytest.mark.parametrize("body", S.TRANSPOSE_BODIES + ("gpipe", "zbv", "dualpipev"))
def test_reference_accepts_every_valid_transpose_plan(body):
    for term in _valid(body):
        plan = lower(term.derive())
        judged = reference.judge_plan(plan)
        assert judged.ok, (str(term), judged.violated, judged.incomplete[:2],
                           judged.dependency[:2], judged.matching[:2])
        peaks = peak_memory(plan)
        assert judged.peak == [peaks[r][0] for r in range(plan.num_ranks)], str(term)


# the property each segment edit breaks, by the rules alone: the cut's required work or
# collectives, or the cut itself against the programs (completeness), or, with both ends of a cross-cut transfer gone, the input
# its consumer needs (dependency)
BREAKS = {"drop_all_reduce": "completeness", "narrow_all_reduce": "completeness",
          "broadcast_root": "completeness", "drop_recompute": "completeness",
          "move_segment_forward": "completeness", "drop_cut_transfer": "dependency",
          "edit_cut": "completeness"}


@pytest.mark.parametrize("kind", S.SEGMENT_MUTATIONS)
def test_each_segment_mutation_is_rejected_as_verify_rejects_it(kind):
    """Seeded mutants of ``kind`` until the reference finds the property ``BREAKS``
    names; every mutant on the way, and that one, must get the same verdict from
    ``verify``, property by property."""
    for seed in range(40):
        ch = S.RandomChooser(random.Random(f"{kind}:{seed}"))
        _, _, description, mutant, limit = S.random_mutant(ch, kind)
        expected = S.reference_verdict(mutant, limit)
        status, found = S.verifier_verdict(mutant, limit)
        assert S.classify(status, found, expected) == "agree", (description, status, found,
                                                                expected)
        if BREAKS[kind] in expected:
            assert (status, found) == ("violated", expected)
            return
    pytest.fail(f"no {kind} mutant breaks {BREAKS[kind]} in 40 seeds")


# ---------------------------------------------------------------- by hand, plain data
# Two ranks, body stage s on rank s, one microbatch; segment "enc" (a source, home rank
# 0) runs its forward and backward on rank 1.

ENC = reference.Segment("enc", "source", forward=(1,), backward=(1,), recompute=False,
                        home=0)
FROZEN = reference.Segment("enc", "source", forward=(1,), backward=None, recompute=False,
                           home=0)
BCAST = ("K", "broadcast", (0, 1), "params:enc", 0)
REDUCE = ("K", "all_reduce", (0, 1), "grads:enc", None)


def _c(kind, stage, seg=""):
    return ("C", ((kind, stage, 0, seg),))


def _p(is_send, peer, kind, stage, seg="", to=None):
    return ("P", ((is_send, peer, (kind, stage, 0, seg, None, None, ("to_segment", to))),),
            False)


def _plan(trainable: bool = True):
    back0 = [_p(False, 1, "grad", 1), _c("B", 0)]
    rank0 = [_p(False, 1, "act", 0, "enc", ""), _c("F", 0), _p(True, 1, "act", 0)] + back0
    rank1 = [_c("F", 0, "enc"), _p(True, 0, "act", 0, "enc", ""), _p(False, 0, "act", 0),
             _c("F", 1), _c("B", 1), _p(True, 0, "grad", 1)]
    if trainable:
        rank0 = [BCAST] + rank0 + [_p(True, 1, "grad", 0, "", "enc"), REDUCE]
        rank1 = [BCAST] + rank1 + [_p(False, 0, "grad", 0, "", "enc"), _c("B", 0, "enc"),
                                   REDUCE]
    return [rank0, rank1]


def _judge(programs, seg=ENC, limit=None):
    return reference.judge(programs, [0, 1], 1, limit, [seg])


def test_judge_reads_the_cut_rules_on_a_hand_written_plan():
    judged = _judge(_plan())
    assert judged.ok
    assert judged.peak == [1, 2]  # rank 1 keeps the encoder's activation for its backward
    frozen = _judge(_plan(trainable=False), FROZEN)
    assert frozen.ok and frozen.peak == [1, 1]  # a frozen forward keeps nothing
    assert _judge(_plan(), limit=1).violated == {"memory"}

    # no broadcast anywhere: the cut's collective is missing, and rank 1 runs the
    # encoder without its parameters
    programs = [[c for c in prog if c != BCAST] for prog in _plan()]
    assert _judge(programs).violated == {"completeness", "dependency"}
    # the all-reduce before rank 1's encoder backward: its gradient is not ready yet
    programs = _plan()
    programs[1] = programs[1][:-2] + [REDUCE] + programs[1][-2:-1]
    assert _judge(programs).violated == {"dependency"}
    # the broadcast rooted at rank 1 on both ranks: well formed, but not from home
    programs = [[("K", "broadcast", (0, 1), "params:enc", 1) if c == BCAST else c
                 for c in prog] for prog in _plan()]
    assert _judge(programs).violated == {"completeness"}
    # an all-reduce with a root is malformed (and not the one the cut requires)
    programs = [[("K", "all_reduce", (0, 1), "grads:enc", 0) if c == REDUCE else c
                 for c in prog] for prog in _plan()]
    assert _judge(programs).violated == {"completeness", "matching"}
    # the trainable plan judged as if the segment were frozen: backward, broadcast and
    # all-reduce are all work it must not contain
    assert _judge(_plan(), FROZEN).violated == {"completeness"}
