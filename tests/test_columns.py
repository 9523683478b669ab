"""The passes read by columns (``semantics.op_table``) propose exactly what the op-by-op
passes propose: the same verdict on whether there are findings (the transfers' pairing
included), the same dependency producers, the same memory levels, peaks and reported peaks; on valid plans and on
one-edit mutants of them, with the unit model and with integer sizes and limits."""

from hypothesis import given, settings, strategies as st

from mpipe_verified.algebra import family
from mpipe_verified.formats.torch_csv import format_torch_csv, parse_torch_csv
from mpipe_verified.lower import lower
from mpipe_verified.semantics import UNIT_MEMORY, MemoryModel, op_table, p2p_clean, pair_p2p
from mpipe_verified.verify import properties, verify
import strategies as S


def _agree(plan, model=UNIT_MEMORY, limits=None) -> None:
    table = op_table(plan)
    if table is None:
        return
    for name, run in (("completeness", properties.completeness),
                      ("dependency", properties.dependency)):
        fast, slow = run(plan, table), run(plan)
        assert (bool(fast[0]), fast[1]) == (bool(slow[0]), slow[1]), name
    pairing = pair_p2p(plan)
    assert p2p_clean(table) == (not pairing.unmatched and not pairing.mismatched)
    fast, slow = properties.memory(plan, model, limits, table), properties.memory(
        plan, model, limits)
    assert (bool(fast[0]),) + fast[1:] == (bool(slow[0]),) + slow[1:]
    assert [type(x) for x in fast[2].values()] == [type(x) for x in slow[2].values()]


BODY_EDITS = ("drop", "duplicate", "swap_adjacent", "move", "swap_sends", "payload")


@st.composite
def body_mutants(draw):
    """``(base, broken, memory limit)``: a lowered plan without groups, collectives or a
    cut (what has a table) and one edit of it."""
    ch = S.DrawChooser(draw)
    base = S.lowered(draw(S.terms()))
    kinds = [k for k in BODY_EDITS if k in S.applicable(base)]
    broken = S.mutate(base, ch.pick(kinds), ch)[0] if kinds else base
    return base, broken, S.memory_limit_for(base, ch)


@settings(max_examples=80, deadline=None)
@given(st.one_of(body_mutants(), S.mutants().map(lambda m: (m[0], m[3], m[4]))), st.data())
def test_column_passes_agree_with_op_by_op(mutant, data):
    base, broken, limit = mutant
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    model = MemoryModel(stored=lambda stage, segment: float(sizes[stage % len(sizes)]),
                        static=tuple(float(r % 3) for r in range(base.num_ranks)))
    for plan in (base, broken):
        _agree(plan)
        _agree(plan, model, properties.memory_limits(limit, plan.num_ranks))


def test_a_torch_csv_plan_is_read_by_columns_and_verified():
    """The plan ``check FILE`` reads from a torch CSV has a table, and it is verified with
    the column passes' hints (the kernel checks them)."""
    plan = parse_torch_csv(format_torch_csv(lower(family("interleaved-1f1b", 4, 8, 2)
                                                  .derive())), "x.csv")
    assert op_table(plan) is not None
    _agree(plan)
    report = verify(plan, memory_limit=16)
    assert report.verified, report.undecided
