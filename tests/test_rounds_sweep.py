"""The looped families in rounds (interleaved-1f1b, interleaved-zb, hanayo) derive a
valid plan for every size they accept. In interleaved-1f1b (and hanayo, which follows it)
rounds whose last one would be shorter than ``p`` are evened out (``families._short_last``);
a short last round deadlocked (``p = 6, m = 37``: rank 0's wrap forward and rank 5's
backward of the round before waited on each other). interleaved-zb keeps its short last
round, which never deadlocks. Whole rounds keep their plans (tests/test_torch_csv_orders.py
pins them)."""

import pytest

from mpipe_verified.algebra.families import _short_last, family
from mpipe_verified.lower import lower
from mpipe_verified.verify import verify

FAMILIES = ("interleaved-1f1b", "interleaved-zb", "hanayo")
LARGER = ((6, 37, 2), (6, 44, 3), (7, 51, 2), (16, 532, 2))


def _verified(name: str, p: int, m: int, v: int | None = None) -> bool:
    return verify(lower(family(name, p, m, v).derive())).verified


@pytest.mark.parametrize("name", FAMILIES)
def test_every_accepted_size_verifies(name):
    sizes = [(p, m) for p in range(2, 9) for m in range(p, 5 * p + 1)
             if m <= p + 1 or _short_last(p, m)]  # the evened sizes, some whole ones
    bad = [(p, m) for p, m in sizes if not _verified(name, p, m)]
    assert not bad


@pytest.mark.parametrize("p,m,v", LARGER)
@pytest.mark.parametrize("name", ["interleaved-1f1b", "interleaved-zb"])
def test_short_last_rounds_that_deadlocked_verify(name, p, m, v):
    assert _verified(name, p, m, v)


def test_whole_rounds_are_unchanged_and_short_ones_are_evened():
    assert not any(_short_last(p, m) for p in range(1, 17) for m in range(p, 40 * p + 1)
                   if m % (m // p) == 0)
    assert _short_last(6, 37) and str(family("interleaved-1f1b", 6, 37)).endswith("even=True)")
    assert "even" not in str(family("interleaved-1f1b", 6, 36))
    assert "even" not in str(family("interleaved-zb", 6, 37))
