"""Several pipelines over one model (docs/semantics.md §2.9): the IR field, the rules as
the semantics, the kernel and the reference read them, and plans that break only one of
the new rules, each rejected by the kernel."""

import attrs
import pytest

from mpipe_verified import kernel
from mpipe_verified.ir import (ACT, Collective, Compute, Cut, Payload, Placement, Plan, Recv,
                               Schedule, SegmentWork, Send)
from mpipe_verified.lower import lower
from mpipe_verified.verify import verify
from canonical_decoder import decode
from reference import judge_plan

C = Compute


def _gpipe_pair(placement: Placement) -> Schedule:
    """Two pipelines of two stages over two ranks: pipeline 0 (mbs 0, 1) on stages 0, 1,
    pipeline 1 (mbs 2, 3) on stages 2, 3; each rank runs its forwards, then backwards."""
    programs = [[], []]
    for kind in "FB":
        for s in (range(4) if kind == "F" else reversed(range(4))):
            mbs = (0, 1) if s < 2 else (2, 3)
            programs[placement.rank_of(s)] += [C(kind, s, mb) for mb in mbs]
    return Schedule(placement, 4, tuple(map(tuple, programs)), pipelines=((0, 1), (2, 3)))


MIRRORED = Placement((0, 1, 1, 0), 2)  # pipeline 1 runs the other way: replicas on two ranks
LOOPED = Placement((0, 1, 0, 1), 2)    # both replicas of each stage on one rank


def _statuses(plan: Plan) -> set:
    report = verify(plan)
    return {v.property for v in report.violations} if report.status == "violated" else {
        report.status}


def test_the_field_is_validated():
    ok = _gpipe_pair(MIRRORED)
    for bad in [((0, 1), (1, 2, 3)), ((0, 1), (2,)), ((0, 1, 2, 3), (), ()), ((0, 1), [2, 3]),
                ((0, 1), (2, "3"))]:
        with pytest.raises(ValueError):
            attrs.evolve(ok, pipelines=bad)
    with pytest.raises(ValueError, match="cut"):
        attrs.evolve(ok, cut=Cut((SegmentWork("vision", "source", (0,) * 4),)))


def test_the_canonical_text_names_pipelines_only_when_there_are_several():
    plan = lower(_gpipe_pair(MIRRORED))
    head = plan.canonical_text().split("\n")[0]
    assert head.endswith(";pipelines=0,1|2,3")
    assert decode(plan.canonical_text()) == plan
    one = attrs.evolve(plan, pipelines=())
    assert "pipelines" not in one.canonical_text()
    assert kernel.digest(one) != kernel.digest(plan)


@pytest.mark.parametrize("placement, collectives", [(MIRRORED, 2), (LOOPED, 0)])
def test_lowering_adds_each_replica_all_reduce_and_the_plan_verifies(placement, collectives):
    """Mirrored, each model stage has replicas on both ranks: both ranks end with
    ``replica:0`` then ``replica:1``. Looped, each rank holds both replicas of its stage
    and sums them locally: no collective."""
    plan = lower(_gpipe_pair(placement))
    calls = [[op for op in prog if type(op) is Collective] for prog in plan.programs]
    assert [len(c) for c in calls] == [collectives] * 2
    if collectives:
        assert [op.tag for op in calls[0]] == ["replica:0", "replica:1"]
        assert all(type(prog[-1]) is Collective for prog in plan.programs)
    assert verify(plan).verified
    assert judge_plan(plan).ok
    # nothing crosses between the pipelines
    assert not any(type(op) is Send and op.payload.stage in (1, 3) and op.payload.kind == ACT
                   for prog in plan.programs for op in prog)


def _without(plan: Plan, rank: int, tag: str) -> Plan:
    programs = list(plan.programs)
    programs[rank] = tuple(op for op in programs[rank]
                           if not (type(op) is Collective and op.tag == tag))
    return attrs.evolve(plan, programs=tuple(programs))


def _rejected(broken: Plan, valid: Plan, prop: str, alone: bool = True) -> None:
    """``broken`` violates ``prop`` (only it, with ``alone``) by the kernel-confirmed
    verdict and by the reference, and the kernel does not prove ``prop`` of it from the
    valid plan's witness."""
    found, judged = _statuses(broken), judge_plan(broken).violated
    assert found == judged == {prop} if alone else prop in found and prop in judged
    report = verify(valid)
    assert kernel.prove(broken, report.witness, sizes=report.sizes,
                        properties=(prop,))[prop].status == "failed"


def test_a_missing_replica_all_reduce_is_incomplete():
    plan = lower(_gpipe_pair(MIRRORED))
    _rejected(_without(_without(plan, 0, "replica:1"), 1, "replica:1"), plan, "completeness")


def _split(schedule: Schedule) -> Schedule:
    """Every ``B`` as ``I`` then ``W``."""
    return attrs.evolve(schedule, programs=tuple(
        tuple(x for op in prog for x in ((attrs.evolve(op, kind="I"), attrs.evolve(op, kind="W"))
                                         if op.kind == "B" else (op,)))
        for prog in schedule.programs))


@pytest.mark.parametrize("split", [False, True])
def test_an_all_reduce_before_a_replicas_last_weight_gradient_is_a_dependency_violation(split):
    """Rank 0's ``replica:0`` moved to just before its last weight gradient of stage 0
    (``0B1``, or ``0W1`` when the backward is split)."""
    plan = lower(_split(_gpipe_pair(MIRRORED)) if split else _gpipe_pair(MIRRORED))
    program = list(plan.programs[0])
    call = next(i for i, op in enumerate(program) if getattr(op, "tag", "") == "replica:0")
    last = max(i for i, op in enumerate(program) if str(op) == ("0W1" if split else "0B1"))
    program.insert(last, program.pop(call))  # now just before it
    _rejected(attrs.evolve(plan, programs=(tuple(program),) + plan.programs[1:]), plan,
              "dependency")


def test_an_activation_sent_across_pipelines_is_a_matching_violation():
    """Stage 1 ends pipeline 0; stage 2 (rank 0) starts pipeline 1. Shipping 1F0's output
    there (a well-formed pair, sent after it is made) breaks only the flow rule."""
    plan = lower(_gpipe_pair(LOOPED))
    payload = Payload(ACT, 1, 0)
    _rejected(attrs.evolve(plan, programs=(plan.programs[0] + (Recv(1, payload),),
                                           plan.programs[1] + (Send(0, payload),))),
              plan, "matching")


def test_work_for_a_microbatch_outside_its_pipeline_is_incomplete():
    """The same programs with microbatches 1 and 2 swapped between the pipelines: every
    op is well placed and ordered, but stage 0 now runs microbatch 1 of pipeline 1."""
    plan = lower(_gpipe_pair(LOOPED))
    _rejected(attrs.evolve(plan, pipelines=((0, 2), (1, 3))), plan, "completeness",
              alone=False)


# ---------------------------------------------------------------- the families, exactly

import json  # noqa: E402
import pathlib  # noqa: E402

from mpipe_verified.cli import main  # noqa: E402

ORDERS = {name: entry for file in ("bidirectional.json", "bitpipe.json")
          for name, entry in json.loads((pathlib.Path(__file__).parent / "fixtures" /
                                         "reference_orders" / file).read_text()).items()}
CASES = [(name, key) for name in ORDERS for key in ORDERS[name]["orders"]]


@pytest.mark.parametrize("name, size", CASES)
def test_the_family_writes_the_reference_order_and_checks_only_as_bidirectional(
        name, size, tmp_path, capsys):
    """``export --compute-only`` of the family equals the reference implementation's
    order (tests/fixtures/reference_orders/bidirectional.json, bitpipe.json: source, file,
    commit),
    cell for cell; that file is VERIFIED with ``--bidirectional``, incomplete without."""
    import csv
    pp, m = (int(part.split("=")[1]) for part in size.split())
    out = tmp_path / f"{name}.csv"
    assert main(["export", "--family", name, "--pp", str(pp), "--microbatches", str(m),
                 "--to", "torch-csv", "--compute-only", "-o", str(out)]) == 0
    with open(out, newline="") as f:
        assert list(csv.reader(f)) == ORDERS[name]["orders"][size]
    assert main(["check", str(out), "--bidirectional", "-q"]) == 0
    assert main(["check", str(out), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert "completeness" in {v["property"] for v in doc["violations"]}


@pytest.mark.parametrize("name, sizes", [
    ("dualpipe", [(2, 4), (2, 6), (4, 8), (4, 10), (6, 12), (8, 16), (8, 18)]),
    ("chimera", [(2, 2), (2, 4), (4, 4), (4, 12), (6, 6), (8, 16)]),
    ("bitpipe", [(2, 2), (2, 4), (4, 4), (4, 12), (6, 6), (6, 12), (8, 8)])])
def test_the_families_verify_and_the_reference_agrees(name, sizes):
    from mpipe_verified.algebra.families import family
    for pp, m in sizes:
        plan = lower(family(name, pp, m).derive())
        assert verify(plan).verified, (name, pp, m)
        assert judge_plan(plan).ok, (name, pp, m)



def test_bitpipe_places_its_stages_as_bitpipe_does_and_checks_its_sizes():
    """BitPipe's layer table (megatron/model/transformer.py, its "V_shaped way", 4 ranks):
    rank r holds pipeline 0's stages r and 7-r and pipeline 1's 3-r and 4+r, so the
    mirrored V of ``Weave(placement='v', pipelines=2)`` is its placement; p must be even
    and m a multiple of p (its own RuntimeError); ``--chunks 2`` is the term's own."""
    from mpipe_verified.algebra.families import family
    from mpipe_verified.errors import ParameterError
    schedule = family("bitpipe", 4, 8).derive()
    assert schedule.placement.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0, 3, 2, 1, 0, 0, 1, 2, 3)
    assert schedule.pipelines == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert family("bitpipe", 4, 8, chunks=2).derive() == schedule
    for pp, m, chunks in ((4, 6, None), (3, 3, None), (4, 8, 1)):
        with pytest.raises(ParameterError, match="bitpipe"):
            family("bitpipe", pp, m, chunks)

def test_a_plan_of_other_pipelines_is_not_written_as_a_torch_csv(tmp_path, capsys):
    from mpipe_verified.formats.plan_json import write_plan_json
    schedule = attrs.evolve(_gpipe_pair(LOOPED), pipelines=((0, 2), (1, 3)))
    path = tmp_path / "odd.json"
    write_plan_json(schedule, path)
    assert main(["export", str(path), "--to", "torch-csv", "--allow-unverified"]) == 2
    assert "two-chain encoding" in capsys.readouterr().err


def test_bidirectional_needs_an_even_csv_and_a_csv(tmp_path, capsys):
    odd = tmp_path / "odd.csv"
    odd.write_text("0F0,1F0,1B0,0B0\n")
    assert main(["check", str(odd), "--bidirectional"]) == 2
    assert "even number" in capsys.readouterr().err
    assert main(["check", "--family", "1f1b", "--pp", "2", "--microbatches", "2",
                 "--bidirectional"]) == 2


def test_the_algebras_operators_keep_the_pipelines():
    """``seq`` runs both parts in the same K pipelines (the second's microbatches after
    the first's), ``relabel`` renames microbatches in the pipelines too, ``split_bw``
    keeps them; each result verifies."""
    from mpipe_verified.algebra.families import family
    from mpipe_verified.algebra.terms import Relabel, Seq, SplitBW, Weave
    unit = family("chimera", 4, 4)
    twice = Seq(unit, unit).derive()
    assert twice.pipelines == ((0, 1, 4, 5), (2, 3, 6, 7))
    swapped = Relabel(unit, (2, 3, 0, 1)).derive()
    assert swapped.pipelines == ((2, 3), (0, 1))
    for schedule in (twice, swapped, SplitBW(unit).derive()):
        assert verify(lower(schedule)).verified
    one = Weave(4, 4, "F0* F1* B1* B0*", chunks=2, placement="v")  # one pipeline, V
    with pytest.raises(Exception, match="pipelines"):
        Seq(family("chimera", 4, 4), one).derive()


def test_transpose_over_several_pipelines_is_a_parameter_error():
    """A cut segment over two pipelines is not defined: refused, never a traceback."""
    from mpipe_verified.algebra import Transpose
    from mpipe_verified.algebra.families import family
    from mpipe_verified.errors import ParameterError
    for name in ("dualpipe", "chimera", "bitpipe"):
        with pytest.raises(ParameterError, match="one pipeline"):
            Transpose(family(name, 4, 8)).derive()


@pytest.mark.parametrize("name, sizes", [
    ("dualpipe", [(p, m) for p in (2, 4, 6, 8) for m in range(2 * p, 2 * p + 7, 2)]),
    ("chimera", [(p, k * p) for p in (2, 4, 6, 8) for k in (1, 2, 3)])])
def test_bounded_the_families_verify_at_every_size_up_to_eight_ranks(name, sizes):
    """No all-sizes laws for these families yet: every size in the bound verifies."""
    from mpipe_verified.algebra.families import family
    for pp, m in sizes:
        assert verify(lower(family(name, pp, m).derive())).verified, (name, pp, m)


def test_the_kernel_reads_the_pipelines_itself():
    """A plan whose ``pipelines`` field got past the IR's validation (a bool for a
    microbatch, a partition that misses one) is not complete for the kernel."""
    plan = lower(_gpipe_pair(MIRRORED))
    report = verify(plan)
    for bad in (((0, True), (2, 3)), ((0, 1), (2,)), ((0, 1, 2, 3),) * 2):
        forged = attrs.evolve(plan)
        object.__setattr__(forged, "pipelines", bad)
        verdict = kernel.prove(forged, report.witness, sizes=report.sizes,
                               properties=("completeness",))["completeness"]
        assert verdict.status == "failed", bad


def test_compare_keeps_the_model_of_a_schedule_of_two_pipelines():
    """DualPipe on 4 ranks holds 8 stages, two replicas of a 4-stage model: 1F1B on the
    same model is not re-cut (each of its 4 stages is one model stage)."""
    from mpipe_verified.algebra.families import family
    from mpipe_verified.comparison import baseline_spec, model_stages
    from mpipe_verified.spec import Spec
    spec = Spec.of_term(family("dualpipe", 4, 8), "dualpipe")
    assert model_stages(spec.schedule) == 4
    assert baseline_spec(spec, "1f1b").cost is None


def test_plan_json_carries_pipelines_and_refuses_bad_ones(tmp_path, capsys):
    from mpipe_verified.formats.plan_json import format_plan_json, parse_plan_json
    plan = lower(_gpipe_pair(MIRRORED))
    text = format_plan_json(plan)
    assert '"pipelines": [[0, 1], [2, 3]]' in text and parse_plan_json(text, "p") == plan
    assert "pipelines" not in format_plan_json(attrs.evolve(plan, pipelines=()))
    doc = json.loads(text)
    path = tmp_path / "bad.json"
    for bad, where in (([[0, 1], [1, 2, 3]], "$.pipelines:"), ([[0, 1], [2, True]],
                                                               "$.pipelines[1][1]:"),
                       ([[0, 1, 2, 3]] * 3, "$.pipelines:")):
        path.write_text(json.dumps(dict(doc, pipelines=bad)))
        assert main(["check", str(path)]) == 2
        err = capsys.readouterr().err
        assert where in err and "Traceback" not in err, err
    path.write_text(json.dumps(dict(doc, pipelines=[[0, 1, 2], [3]])))  # well formed, but
    assert main(["check", str(path), "-q"]) == 1  # stage 0 runs microbatch 2 of pipeline 1
