"""The passes read by columns (``semantics.op_table``) propose exactly what the op-by-op
passes propose: the same verdict on whether there are findings (the transfers' pairing
included), the same dependency producers, the same memory levels, peaks and reported
peaks, the same FIFO partners and the same deadlock-run completion times (or none, when
the run gets stuck) under both comm models; on valid plans and on one-edit mutants of
them, with the unit model and with integer sizes and limits."""

from hypothesis import given, settings, strategies as st

from mpipe_verified.algebra import family
from mpipe_verified.errors import InputError
from mpipe_verified.formats.torch_csv import format_torch_csv, parse_torch_csv
from mpipe_verified.lower import lower
from mpipe_verified.question import Question
from mpipe_verified.ir import Compute, Payload, Plan, Placement, Recv, Send
from mpipe_verified.semantics import (COMM_MODELS, UNIT_MEMORY, Chain, MemoryModel,
                                      comm_ticks, execute, op_table, p2p_clean, p2p_columns,
                                      pair_p2p, work_complete)
from mpipe_verified.verify import passes, verify
import strategies as S


def _agree(plan, model=UNIT_MEMORY, limits=None) -> None:
    table = op_table(plan)
    if table is None:
        return
    for name, run in (("completeness", passes.completeness),
                      ("dependency", passes.dependency)):
        fast, slow = run(plan, table), run(plan)
        assert (bool(fast[0]), fast[1]) == (bool(slow[0]), slow[1]), name
    pairing = pair_p2p(plan)
    assert p2p_clean(table) == (not pairing.unmatched and not pairing.mismatched)
    _same_pairs_and_runs(plan, table, pairing)
    fast, slow = passes.memory(plan, model, limits, table), passes.memory(
        plan, model, limits)
    assert (bool(fast[0]),) + fast[1:] == (bool(slow[0]),) + slow[1:]
    assert [type(x) for x in fast[2].values()] == [type(x) for x in slow[2].values()]


def _same_pairs_and_runs(plan, table, pairing) -> None:
    """``p2p_columns`` pairs as ``pair_p2p`` does; ``comm_ticks`` gives the comm steps'
    finish times of ``execute`` (compute free, a tick per comm step), or None exactly
    when that run gets stuck; the deadlock pass hands the kernel the same hint."""
    pairs = p2p_columns(table)
    ends = [(int(table.rank[r]), int(table.index[r]), 0) for r in pairs.rows.tolist()]
    assert {ends[k]: ends[o] for k, o in enumerate(pairs.partner.tolist())
            if o >= 0} == pairing.partner
    for model in COMM_MODELS:
        run = execute(plan, model, lambda op: 0.0, lambda op: 1.0, pairing)
        times = tuple(tuple(int(t) for op, t in zip(program, finish)
                            if type(op) in (Send, Recv))
                      for program, finish in zip(plan.programs, run.finish))
        assert comm_ticks(table, model, pairs) == (times if run.completed else None), model
        fast, slow = passes.deadlock(plan, model, table=table), passes.deadlock(
            plan, model)
        assert (bool(fast[0]), fast[1]) == (bool(slow[0]), slow[1]), model


def _transfer(rank: int, peer: int, mb: int, send: bool):
    payload = Payload("act", 0, mb)
    return Send(peer, payload) if send else Recv(peer, payload)


def test_columns_time_a_rendezvous_deadlock_as_op_by_op():
    """Two ranks that both send first: stuck under rendezvous, done under eager, in
    both paths; with one receive left over the run is stuck under both models. Also a
    rank that sends to itself, and a send to a rank the plan does not have."""
    both_send = tuple((Compute("F", r, 0), _transfer(r, 1 - r, 0, True),
                       _transfer(r, 1 - r, 0, False)) for r in (0, 1))
    extra = (both_send[0] + (_transfer(0, 1, 1, False),), both_send[1])
    to_self = ((_transfer(0, 0, 0, True), _transfer(0, 0, 0, False)), both_send[1][:1])
    nowhere = (both_send[0] + (_transfer(0, 5, 1, True),), both_send[1])
    for programs in (both_send, extra, to_self, nowhere):
        plan = Plan(Placement((0, 1), 2), 1, programs)
        table = op_table(plan)
        _same_pairs_and_runs(plan, table, pair_p2p(plan))
    sparse = [()] * 12  # many ranks, few transfers: the channels in use are numbered
    sparse[3] = (_transfer(3, 9, 0, True), _transfer(3, 9, 1, True))
    sparse[9] = (_transfer(9, 3, 0, False), _transfer(9, 3, 1, False),
                 _transfer(9, 3, 2, False))
    plan = Plan(Placement(tuple(range(12)), 12), 3, tuple(sparse))
    _same_pairs_and_runs(plan, op_table(plan), pair_p2p(plan))
    assert comm_ticks(op_table(Plan(Placement((0, 1), 2), 1, both_send)), "rendezvous") is None
    assert comm_ticks(op_table(Plan(Placement((0, 1), 2), 1, both_send)), "eager") == ((1, 2),
                                                                                   (1, 2))
    assert comm_ticks(op_table(Plan(Placement((0, 1), 2), 1, extra)), "eager") is None
    assert comm_ticks(op_table(Plan(Placement((0, 1), 2), 1, to_self)), "eager") == ((1, 2),
                                                                                 ())


def test_a_free_releases_only_its_own_key_s_allocation():
    """Stage 1's backward right after stage 0's forward of the same microbatch frees
    nothing of it (another key): the column memory levels agree with op by op."""
    plan = Plan(Placement((0, 0), 1), 2, ((Compute("F", 0, 0), Compute("B", 1, 0),
                                           Compute("F", 1, 1)),))
    _agree(plan)


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
        _agree(plan, model, Question(memory_limit=limit).limits(plan.num_ranks))


def _columns_apply(plan, model=UNIT_MEMORY, limits=None) -> None:
    """On a valid plan each column pass answers by itself (no fall-back to op by op,
    which ``_agree`` alone could not tell from the column answer): completeness by
    counts, producers equal to the op-by-op hint, memory levels and the pairing."""
    table = op_table(plan)
    chain = Chain.of(plan)
    assert work_complete(table, chain)
    assert passes._producers(table, chain) == passes.dependency(plan)[1]
    assert passes._levels(table, model, limits) is not None
    assert p2p_clean(table) and comm_ticks(table, "rendezvous") is not None


def test_the_column_forms_apply_to_valid_plans():
    for name, p, m, v in (("interleaved-1f1b", 4, 8, 2), ("1f1b", 3, 5, None),
                          ("zb-h1", 3, 6, None), ("zbv", 2, 4, None)):
        plan = lower(family(name, p, m, v).derive())
        _columns_apply(plan)
        _columns_apply(plan, MemoryModel(stored=lambda stage, segment: float(stage % 3),
                                         static=(2.0,) * p), (100,) * p)


def test_a_torch_csv_plan_is_read_by_columns_and_verified():
    """The plan ``check FILE`` reads from a torch CSV has a table, and it is verified with
    the column passes' hints (the kernel checks them)."""
    plan = parse_torch_csv(format_torch_csv(lower(family("interleaved-1f1b", 4, 8, 2)
                                                  .derive())), "x.csv")
    assert op_table(plan) is not None
    _agree(plan)
    _columns_apply(plan)
    report = verify(plan, memory_limit=16)
    assert report.verified, report.undecided


def _same_table(plan) -> None:
    """The table from the classes the plain reader recorded equals the one found op by
    op (same columns, and each class's first and last op the same objects)."""
    from mpipe_verified import ir
    known = ir.known_op_cells(plan)
    assert known is not None  # the plain reader built it
    fast = op_table(plan)
    ir.remember_op_cells(Plan(Placement((0,), 1), 1, ((),)), ())  # forget it
    assert ir.known_op_cells(plan) is None
    slow = op_table(plan)
    for column in ("rank", "index", "cls", "mb"):
        assert (getattr(fast, column) == getattr(slow, column)).all(), column
    assert fast.counts == slow.counts and len(fast.classes) == len(slow.classes)
    assert all(a[0] == b[0] and a[1] is b[1] and a[2] is b[2]
               for a, b in zip(fast.classes, slow.classes))


@settings(max_examples=60, deadline=None)
@given(body_mutants(), st.booleans(), st.data())
def test_the_classes_a_plain_csv_reader_records_are_the_op_by_op_ones(mutant, edited, data):
    """On valid and edited plans, also with idle cells and markers put anywhere (the
    reader then keys them as one class per row, as ``op_table`` does)."""
    plan = mutant[1] if edited else mutant[0]
    if op_table(plan) is None:  # overlapped steps: the plain reader does not read them
        return
    try:
        text = format_torch_csv(plan)
    except ValueError:  # an edit torch's format cannot express
        return
    stage_of = {r: s for s, r in reversed(list(enumerate(plan.placement.stage_to_rank)))}
    rows = []
    for r, row in enumerate(text.splitlines()):
        cells = row.split(",")
        for _ in range(data.draw(st.integers(0, 2))):  # markers name a stage of their row
            extra = data.draw(st.sampled_from(("", "UNSHARD", "RESHARD", "REDUCE_GRAD3")))
            cell = extra and r in stage_of and f"{stage_of[r]}{extra}" or ""
            cells.insert(data.draw(st.integers(0, len(cells))), cell)
        rows.append(",".join(cells))
    try:
        read = parse_torch_csv("\n".join(rows) + "\n", "x.csv")
    except InputError:  # an edit that put a stage on two rows
        return
    _same_table(read)


def test_check_s_op_table_is_the_reader_s(tmp_path, monkeypatch, capsys):
    """``check FILE`` judges the plan the reader built (``declare`` keeps it when nothing
    is declared), so the cells it recorded reach ``op_table``; the cells are dropped with
    the plan and cannot be written to."""
    import gc
    from mpipe_verified import ir
    from mpipe_verified.semantics import table as op_tables
    from mpipe_verified.cli import main
    from mpipe_verified.declared import declare
    text = format_torch_csv(lower(family("1f1b", 3, 5).derive()))
    plan = parse_torch_csv(text, "x.csv")
    assert declare(plan) is plan and declare(plan, microbatches=6).num_microbatches == 6
    _same_table(plan)
    plan = parse_torch_csv(text, "x.csv")
    assert not ir.known_op_cells(plan)[0].flags.writeable
    del plan
    gc.collect()
    assert ir._KNOWN_CELLS[1] is None  # nothing kept once the plan is gone
    used = []
    classes = op_tables._classes_of_cells
    monkeypatch.setattr(op_tables, "_classes_of_cells",
                        lambda *a: used.append(1) or classes(*a))
    path = tmp_path / "1f1b.csv"
    path.write_text(text)
    assert main(["check", str(path), "-q"]) == 0 and used
