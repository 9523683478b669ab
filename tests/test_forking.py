"""``forking.in_two_halves``: the rows of two halves, one written by a forked child, are
the rows of the whole; an error in either half reaches the caller."""

import os

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.forking import forked, in_two_halves
from mpipe_verified.formats.torch_csv import (format_torch_csv, torch_csv_rows,
                                              with_torch_markers)
from mpipe_verified.lower import lower


def test_halves_written_apart_are_the_whole_text():
    plan = lower(family("interleaved-1f1b", 5, 10, 2).derive())
    whole = format_torch_csv(with_torch_markers(plan))
    assert in_two_halves(lambda ranks: torch_csv_rows(plan, ranks, markers=True),
                         plan.num_ranks) == whole
    assert in_two_halves(lambda ranks: torch_csv_rows(plan, ranks), plan.num_ranks) \
        == format_torch_csv(plan)


def test_an_error_in_the_child_half_is_raised_here():
    def rows(ranks: range) -> str:
        if ranks.start > 0:
            raise ValueError(f"rank {ranks.start}: cannot write it")
        return "first half\n"
    with pytest.raises(ValueError, match="rank 2: cannot write it"):
        in_two_halves(rows, 5)


def test_the_first_half_error_wins():
    def rows(ranks: range) -> str:
        raise ValueError(f"from rank {ranks.start}")
    with pytest.raises(ValueError, match="from rank 0"):
        in_two_halves(rows, 4)


def test_the_forked_half_hands_back_its_answer_its_error_or_its_death():
    """``forking.forked``'s child (``verify_split``'s half): its answer comes back, an exception it raises is raised
    in this process, and a child that dies without answering is an error, never a hang
    or a verdict."""
    with forked(lambda a, b: {"sum": a + b}, 2, 3) as answer:
        assert answer() == {"sum": 5}
    with forked(_raise_value_error, "from the child") as answer:
        with pytest.raises(ValueError, match="from the child"):
            answer()
    with forked(os._exit, 7) as answer:
        with pytest.raises(RuntimeError, match="exit code 7"):
            answer()


def _raise_value_error(message: str) -> None:
    raise ValueError(message)
