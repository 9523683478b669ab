"""Fuzzing plans of several pipelines (docs/semantics.md §2.9): valid ones verify and the
reference accepts them; one-edit mutants (``strategies.mutate``'s edits, and edits of
the new rules: a replica all-reduce dropped or moved, a transfer across pipelines, the
microbatches of two pipelines exchanged) get the reference's verdict, property by
property (``strategies.classify`` says ``agree``)."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import strategies as S
from mpipe_verified.algebra.families import family
from mpipe_verified.algebra.terms import Weave
from mpipe_verified.ir import ACT, GRAD, Collective, Payload, Plan, Recv, Send
from mpipe_verified.lower import lower

PROFILE_EXAMPLES = settings().max_examples


def examples(fraction: float) -> settings:
    return settings(max_examples=max(5, int(PROFILE_EXAMPLES * fraction)), deadline=None)


@st.composite
def pipelines_plans(draw) -> Plan:
    """A lowered plan of two pipelines: DualPipe, Chimera, BitPipe, or a GPipe-like weave
    (looped or V placement for pipeline 0, pipeline 1 mirrored)."""
    kind = draw(st.sampled_from(["dualpipe", "chimera", "bitpipe", "weave"]))
    if kind == "dualpipe":
        p = draw(st.sampled_from([2, 4]))
        return lower(family(kind, p, draw(st.sampled_from([2 * p, 2 * p + 2]))).derive())
    if kind in ("chimera", "bitpipe"):
        p = draw(st.sampled_from([2, 4]))
        return lower(family(kind, p, p * draw(st.integers(1, 2))).derive())
    p = draw(st.integers(1, 3))
    placement, chunks = draw(st.sampled_from([("looped", 1), ("looped", 2), ("v", 2)]))
    m = 2 * draw(st.integers(1, 3))
    return lower(Weave(p, m, "F* B*", chunks=chunks, placement=placement,
                       pipelines=2).derive())


def _cross_pipeline(plan: Plan, ch) -> tuple[Plan, str]:
    """Ship a pipeline's last activation (or first gradient) to a rank of the next
    pipeline's stage, at the end of both programs."""
    n = plan.placement.num_stages // len(plan.pipelines)
    where = plan.placement.stage_to_rank
    choices = [(ACT, s, s + 1) for s in range(n - 1, len(where) - 1, n)
               if where[s] != where[s + 1]]
    choices += [(GRAD, s, s - 1) for s in range(n, len(where), n) if where[s] != where[s - 1]]
    if not choices:
        return plan, ""
    kind, s, to = ch.pick(choices)
    mb = ch.pick(sorted(plan.pipelines[s // n]))
    payload, src, dst = Payload(kind, s, mb), where[s], where[to]
    programs = list(plan.programs)
    programs[src] += (Send(dst, payload),)
    programs[dst] += (Recv(src, payload),)
    return attrs.evolve(plan, programs=tuple(programs)), f"cross {kind} {s}->{to} mb {mb}"


def _replica_edit(plan: Plan, ch) -> tuple[Plan, str]:
    calls = [(r, i) for r, prog in enumerate(plan.programs) for i, op in enumerate(prog)
             if type(op) is Collective]
    if not calls:
        return plan, ""
    r, i = ch.pick(calls)
    prog = list(plan.programs[r])
    op = prog.pop(i)
    how = ch.pick(["drop", "earlier"])
    if how == "earlier":
        prog.insert(ch.int(0, i), op)
    programs = plan.programs[:r] + (tuple(prog),) + plan.programs[r + 1:]
    return attrs.evolve(plan, programs=programs), f"{how} rank {r} #{i} {op}"


def _exchange(plan: Plan, ch) -> tuple[Plan, str]:
    a, b = plan.pipelines
    i, j = ch.int(0, len(a) - 1), ch.int(0, len(b) - 1)
    a2, b2 = list(a), list(b)
    a2[i], b2[j] = b[j], a[i]
    return (attrs.evolve(plan, pipelines=(tuple(sorted(a2)), tuple(sorted(b2)))),
            f"exchange mbs {a[i]} and {b[j]}")


NEW_EDITS = {"cross": _cross_pipeline, "replica": _replica_edit, "exchange": _exchange}


@examples(0.5)
@given(pipelines_plans())
def test_valid_plans_of_two_pipelines_verify_and_the_reference_agrees(plan):
    status, found = S.verifier_verdict(plan)
    assert status == "verified", found
    assert reference.judge_plan(plan).ok


@examples(1.5)
@given(pipelines_plans(), st.data())
def test_one_edit_mutants_get_the_references_verdict(plan, data):
    ch = S.DrawChooser(data.draw)
    kind = ch.pick(sorted(S.applicable(plan)) + sorted(NEW_EDITS))
    mutant, what = (NEW_EDITS[kind](plan, ch) if kind in NEW_EDITS
                    else S.mutate(plan, kind, ch))
    status, found = S.verifier_verdict(mutant)
    expected = S.reference_verdict(mutant)
    verdict = S.classify(status, found, expected)
    assert verdict == "agree", (what, status, found, expected)
