"""The verifier's passes: the five properties of docs/semantics.md §3, each as a fast linear
pass over the plan (through the shared ``semantics``): untrusted hint generators for the
kernel.

Every function returns ``(findings, hint)`` (``memory`` adds the peaks): ``findings`` pair
each violation with the *claim* the kernel must confirm from the plan before it is
reported (``kernel.confirm``); ``hint`` is this property's part of the witness the kernel
checks when nothing was found (producer positions, completion times, memory levels; None
where the kernel needs none).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

import attrs
import numpy as np

from ..ir import COMM_STEP, Plan, Recv, Send, p2p_of
from ..semantics import (UNIT_MEMORY, Chain, MemoryModel, OpTable, Token, collective_issues,
                         column_levels, comm_ticks, execute, live_tensors, memory_levels,
                         memory_moves, move_issues, p2p_clean, pair_collectives, pair_p2p,
                         produces, required_work, wait_cycle, work_complete, work_table)
from .report import Violation, apart


@attrs.frozen
class Finding:
    """A violation and the claim (``kernel.confirm``'s vocabulary) that backs it."""

    violation: Violation
    claim: tuple


def _op_ref(plan: Plan, rank: int, index: int) -> tuple[int, int, str]:
    return (rank, index, str(plan.programs[rank][index]))


# ---------------------------------------------------------------- completeness

MAX_FINDINGS = 200  # per property; the rest are counted, not listed


class Findings(list):
    """A property's findings: at most ``MAX_FINDINGS`` listed (each confirmed by Z3),
    and ``unlisted``, how many more the pass found (dependency and matching count them;
    completeness stops looking at the cap)."""

    unlisted: int = 0

    def add(self, make: Callable[[], Finding]) -> None:
        """List ``make()`` below the cap, else only count it (never built)."""
        if len(self) < MAX_FINDINGS:
            self.append(make())
        else:
            self.unlisted += 1


def completeness(plan: Plan, table: OpTable | None = None) -> tuple[list[Finding], None]:
    """Required work (``semantics.required_work``) and the collectives the cut requires
    (``semantics.collective_issues``); the kernel needs no witness for this property.
    With the plan's ``table`` a complete plan is read by columns; any other goes op by
    op, which lists the findings."""
    chain = Chain.of(plan)
    if table is not None and work_complete(table, chain):
        return [], None
    table = work_table(plan, chain)
    findings = []
    for issue in required_work(plan, table, limit=MAX_FINDINGS):
        c = issue.op
        ops = (_op_ref(plan, *issue.where),) if issue.where else ()
        rank = issue.where[0] if issue.where else (chain.expected_rank(c) or 0)
        if issue.problem == "short":
            claim = ("work",)
        elif (c.segment, c.stage, c.mb) in table.counts:
            claim = ("unit", c.segment, c.stage, c.mb)
        else:
            claim = ("stray",) + issue.where
        findings.append(Finding(Violation("completeness", issue.detail, (rank,), ops), claim))
    for issue in collective_issues(plan, limit=MAX_FINDINGS):
        ops = (_op_ref(plan, *issue.where),) if issue.where else ()
        findings.append(Finding(Violation("completeness", issue.detail, (issue.rank,), ops),
                                ("collective", issue.tag, issue.rank)))
    for move in move_issues(plan, limit=MAX_FINDINGS):
        findings.append(Finding(Violation("completeness", move.detail, (move.key[0],),
                                          (_op_ref(plan, *move.where),)), ("move", *move.key)))
    return findings[:MAX_FINDINGS], None


def dependency(plan: Plan, table: OpTable | None = None
               ) -> tuple[list[Finding], tuple | None]:
    """Every op's inputs (§2.5) are on its rank before it runs. The hint: per rank, for each op
    and each of its inputs in sorted order, the position that first produced it. With the
    plan's ``table`` (``semantics.op_table``) a plan with every input in place is read by
    columns; any other goes op by op, which lists the findings."""
    chain = Chain.of(plan)
    hint = None if table is None else _producers(table, chain)
    if hint is not None:
        return Findings(), hint
    findings = Findings()
    producers = []
    make = produces if plan.seq_chunks == 1 else chain.produces
    for rank, program in enumerate(plan.programs):
        have: dict = {}
        given: list[int] = []
        missing = []  # (index, token) listed, explained once the rank is read
        for index, op in enumerate(program):
            for token in sorted(chain.needs(op, rank)):
                pos = have.get(token)
                given.append(-1 if pos is None else pos)
                if pos is None:
                    if len(findings) + len(missing) < MAX_FINDINGS:
                        missing.append((index, token))
                    else:
                        findings.unlisted += 1
            for token in make(op):
                if token not in have:
                    have[token] = index
        producers.append(tuple(given))
        # ``have`` now holds where each token first appears on this rank: a missing
        # input's token, if at all, appears only there (at or after its use)
        findings.extend(_missing_input(plan, rank, index, Token(*token), have.get(token))
                        for index, token in missing)
    return findings, (None if findings else tuple(producers))


def _producers(table: OpTable, chain: Chain) -> tuple | None:
    """The dependency hint by columns: each needed token's first producer on its rank
    (``produces``), found by sorting; None when an input is missing or comes too late
    (or the table cannot state the rules)."""
    needed = table.rule_columns(lambda rank, op: sorted(chain.needs(op, rank)))
    made = table.rule_columns(lambda rank, op: chain.produces(op))
    if needed is None or made is None:
        return None
    n_row, n_tok, n_shift, n_names = needed
    m_row, m_tok, m_shift, m_names = made
    names = {name: i for i, name in enumerate(m_names)}
    to_made = np.array([names.get(name, -1) for name in n_names] or [0], dtype=np.int64)
    reach = int(max(np.abs(n_shift).max(initial=0), np.abs(m_shift).max(initial=0)))
    width = int(table.mb.max(initial=0)) + 2 * reach + 1  # token microbatches -reach..
    span = width * max(len(m_names), 1)
    if span * len(table.counts) >= 2**62:  # the keys would not fit in 64 bits
        return None

    def keys(row, tok, shift):  # rank, token kind and microbatch as one integer
        return (table.rank[row] * span + tok * width) + (table.mb[row] + shift + reach)
    made_keys = keys(m_row, m_tok, m_shift)
    order = np.lexsort((table.index[m_row], made_keys))
    made_keys, made_at = made_keys[order], table.index[m_row][order]
    first = np.ones(len(made_keys), dtype=bool)
    first[1:] = made_keys[1:] != made_keys[:-1]
    made_keys, made_at = made_keys[first], made_at[first]
    tok = to_made[n_tok]
    want = keys(n_row, tok, n_shift)
    at = np.minimum(np.searchsorted(made_keys, want), max(len(made_keys) - 1, 0))
    if len(want) and (not len(made_keys) or not np.all(
            (tok >= 0) & (made_keys[at] == want) & (made_at[at] < table.index[n_row]))):
        return None
    given = made_at[at].tolist() if len(want) else []
    per_rank = np.bincount(table.rank[n_row], minlength=len(table.counts)).tolist()
    out, start = [], 0
    for n in per_rank:
        out.append(tuple(given[start:start + n]))
        start += n
    return tuple(out)


def _missing_input(plan, rank, index, token, produced_at) -> Finding:
    if token.kind in ("kv", "kv_grad"):
        return _chunk_order(plan, rank, index, token, produced_at)
    what = {"out": "activation", "stored": "stored forward", "grad": "gradient",
            "wgrad_ready": "input-gradient step", "input": "shipped input",
            "params": "broadcast parameters", "wdone": "weight gradient",
            "offloaded": "offload of the stored activation",
            "reloaded": "reload of the offloaded activation",
            "held": "lent activation held for its owner",
            "returned": "return of the lent activation"}[token.kind]
    seg = f"{token.segment}:" if token.segment else ""
    name = f"{what} of stage {seg}{token.stage} microbatch {token.mb}"
    op = plan.programs[rank][index]
    if produced_at is None:
        message = f"rank {rank} position {index}: {op} needs the {name}, which is never " \
                  f"computed or received on rank {rank}"
    else:
        message = f"rank {rank} position {index}: {op} needs the {name}, which arrives only " \
                  f"later, at position {produced_at} ({plan.programs[rank][produced_at]})"
    return Finding(Violation("dependency", message, (rank,), (_op_ref(plan, rank, index),)),
                   ("input", rank, index))


def _chunk_order(plan, rank, index, token, produced_at) -> Finding:
    """A chunk whose forward runs before its previous chunk's forward (``kv``), or whose
    backward runs before its next chunk's backward (``kv_grad``), on its rank."""
    op, chunks = plan.programs[rank][index], plan.seq_chunks
    sample, j = divmod(token.mb, chunks)
    needer = (token.segment, token.stage, token.mb + (1 if token.kind == "kv" else -1))
    members = [c for c in getattr(op, "ops", ()) if (c.segment, c.stage, c.mb) == needer]
    if members:  # an overlapped step: name the member whose chunk it is
        op = f"{members[0]} in {op}"
    seg = f"{token.segment}:" if token.segment else ""
    which = "forward" if token.kind == "kv" else "backward"
    mine = j + 1 if token.kind == "kv" else j - 1
    where = ("which never runs on rank {rank}" if produced_at is None else
             f"which runs only later, at position {produced_at} "
             f"({plan.programs[rank][produced_at]})").format(rank=rank)
    message = (f"rank {rank} position {index}: {op} (chunk {mine} of sample {sample}) runs "
               f"before the {which} of chunk {j} of stage {seg}{token.stage} (microbatch "
               f"{token.mb}), {where}")
    return Finding(Violation("dependency", message, (rank,), (_op_ref(plan, rank, index),)),
                   ("input", rank, index))


# ---------------------------------------------------------------- matching


def matching(plan: Plan, pairing=None, collectives=None, table: OpTable | None = None
             ) -> tuple[list[Finding], None]:
    """FIFO pairing per ordered rank pair: equal counts and equal payloads, no token
    received twice on a rank; collectives well formed and called in the same order with
    the same kind, tag and root by every member. The kernel pairs by counting itself: no
    witness. With the plan's ``table`` a plan whose transfers all pair, stay in their
    pipelines and whose collective calls line up is read by columns; any other is paired
    op by op, which lists the findings."""
    if table is not None and _clean(plan, table, collectives):
        return Findings(), None
    pairing = pairing or pair_p2p(plan)
    collectives = collectives or pair_collectives(plan)
    findings = Findings()
    if plan.pipelines:
        _cross_pipeline(plan, findings)
    unmatched = _unmatched_by_channel(plan, pairing)
    for s_end, r_end in pairing.mismatched:
        findings.add(lambda: _mismatch(plan, s_end, r_end))
    for channel, counts in sorted(pairing.counts.items()):
        if counts[0] != counts[1]:
            for end, op in unmatched.get(channel, ()):
                findings.add(lambda: _leftover(plan, channel, counts, end, op))
    for end in pairing.repeated:
        findings.add(lambda: _received_again(plan, end))
    for positions, problem in collectives.problems:
        ranks = tuple(dict.fromkeys(r for r, _ in positions))
        findings.add(lambda: Finding(
            Violation("matching", problem, ranks, tuple(_op_ref(plan, r, i) for r, i in positions)),
            ("call",) + positions[-1]))
    return findings, None


def _clean(plan: Plan, table: OpTable, collectives=None) -> bool:
    """Nothing for ``matching`` to find, read by columns: every transfer pairs
    (``p2p_clean``), none leaves its pipeline (what a transfer carries is its class's),
    and the collective calls line up (``collectives``, the plan's ``pair_collectives``;
    default: paired over ``OpTable.calls``)."""
    chain = Chain.of(plan)
    collectives = collectives or pair_collectives(plan, table.calls())
    return (p2p_clean(table) and not any(type(op) in (Send, Recv) and chain.crosses(op.payload)
                                         for _, op, _ in table.classes)
            and not collectives.problems)


def _cross_pipeline(plan: Plan, findings: Findings) -> None:
    """Several pipelines: every transfer that leaves its pipeline (``Chain.crosses``)."""
    chain = Chain.of(plan)
    for rank, program in enumerate(plan.programs):
        for index, step in enumerate(program):
            for op in p2p_of(step):
                if chain.crosses(op.payload):
                    findings.add(lambda: Finding(Violation(
                        "matching", f"rank {rank} position {index}: {op} carries data out of "
                        f"its pipeline (pipelines {plan.pipelines})", (rank,),
                        (_op_ref(plan, rank, index),)), ("call", rank, index)))


def _mismatch(plan, s_end, r_end) -> Finding:
    send, recv = plan.programs[s_end[0]][s_end[1]], plan.programs[r_end[0]][r_end[1]]
    message = (f"send/recv mismatch on channel {s_end[0]}->{r_end[0]}: rank {s_end[0]} "
               f"position {s_end[1]} sends {send} but the matching receive at rank {r_end[0]} "
               f"position {r_end[1]} is {recv}")
    trace = (f"send end: rank {s_end[0]}, position {s_end[1]}, {send}",
             f"recv end: rank {r_end[0]}, position {r_end[1]}, {recv}")
    return Finding(Violation("matching", message, (s_end[0], r_end[0]),
                             (_op_ref(plan, *s_end[:2]), _op_ref(plan, *r_end[:2])), trace),
                   ("channel", s_end[0], r_end[0]))


def _received_again(plan, end) -> Finding:
    op = p2p_of(plan.programs[end[0]][end[1]])[end[2]]
    message = (f"rank {end[0]} position {end[1]}: {op} from rank {op.src} receives what rank "
               f"{end[0]} received before (a second buffer of the same "
               f"{op.payload.kind} of stage {op.payload.stage} microbatch {op.payload.mb})")
    return Finding(Violation("matching", message, (end[0],), (_op_ref(plan, end[0], end[1]),)),
                   ("received", end[0], end[1]))


def _unmatched_by_channel(plan, pairing) -> dict:
    """Channel -> its unmatched ends ``(endpoint, op)``, in ``pairing.unmatched`` order."""
    out: dict = {}
    for end in pairing.unmatched:
        op = p2p_of(plan.programs[end[0]][end[1]])[end[2]]
        channel = (end[0], op.dst) if isinstance(op, Send) else (op.src, end[0])
        out.setdefault(channel, []).append((end, op))
    return out


def _leftover(plan, channel, counts, end, op) -> Finding:
    src, dst = channel
    if isinstance(op, Send):
        message = (f"rank {src} position {end[1]}: {op} to rank {dst} has no matching "
                   f"receive ({counts[0]} sends, {counts[1]} receives on {src}->{dst})")
    else:
        message = (f"rank {dst} position {end[1]}: {op} from rank {src} has no matching "
                   f"send ({counts[0]} sends, {counts[1]} receives on {src}->{dst})")
    return Finding(Violation("matching", message, (end[0],),
                             (_op_ref(plan, end[0], end[1]),)), ("channel", src, dst))


# ---------------------------------------------------------------- deadlock

def _no_time(op) -> float:
    return 0.0


def _one_step(op) -> float:
    return 1.0


def deadlock(plan: Plan, comm_model: str, pairing=None, collectives=None,
             table: OpTable | None = None) -> tuple[list[Finding], tuple | None]:
    """Run the plan with compute free and every comm step taking one tick. If it
    completes, the hint is every comm step's completion tick (a comm step is posted when
    the one before it on its rank completes, and every meeting takes a tick, so each
    blocking end completes after its partner was posted). If not, the wait-for cycle, or the ends
    that have no partner, are the counterexample. With the plan's ``table`` a run that
    completes is timed by columns (``semantics.comm_ticks``); any other runs op by op,
    which names the findings."""
    ticks = None if table is None else comm_ticks(table, comm_model, calls=True)
    if ticks is not None:
        return [], ticks
    pairing = pairing or pair_p2p(plan)
    collectives = collectives or pair_collectives(plan)
    run = execute(plan, comm_model, _no_time, _one_step, pairing, collectives)
    if not run.completed:
        return _deadlock_findings(plan, run), None
    return [], tuple(tuple(map(int, [t for op, t in zip(prog, times) if type(op) in _COMM]))
                     for prog, times in zip(plan.programs, run.finish))


_COMM = frozenset(COMM_STEP)


def _deadlock_findings(plan, run) -> list[Finding]:
    cycle = wait_cycle(run)
    if cycle:
        trace = tuple(f"rank {w.rank}, position {w.index}: {plan.programs[w.rank][w.index]} "
                      f"waits for rank {w.on[0]} to reach position {w.on[1]} "
                      f"({plan.programs[w.on[0]][w.on[1]]})" for w in cycle)
        message = "wait-for cycle under rendezvous: " + " -> ".join(
            f"rank {w.rank}@{w.index} {plan.programs[w.rank][w.index]}" for w in cycle)
        violation = Violation("deadlock", message, tuple(w.rank for w in cycle),
                              tuple(_op_ref(plan, w.rank, w.index) for w in cycle), trace)
        return [Finding(violation, ("cycle", tuple((w.rank, w.index) for w in cycle)))]
    findings = []
    for w in run.waits:
        if w.on is None:
            violation = Violation("deadlock", f"rank {w.rank} position {w.index}: {w.reason}",
                                  (w.rank,), (_op_ref(plan, w.rank, w.index),), (w.reason,))
            findings.append(Finding(violation, ("stuck", w.rank, w.index)))
    return findings


# ---------------------------------------------------------------- memory

def memory(plan: Plan, model: MemoryModel, limits: tuple | None,
           table: OpTable | None = None) -> tuple[list[Finding], tuple | None, dict, object]:
    """Peak per rank within ``limits`` (one bound per rank, ``question.Question.limits``, or
    None). The levels are ``semantics.memory_levels``' (by columns, ``column_levels``),
    summed exactly (a float size is the rational it denotes, ``_exact``). The hint: per rank, the level before every step that allocates or frees
    something and after the last, the exact peak and the first step reaching it (-1 for
    an empty program). The reported
    peaks are the float sums, as ``semantics`` reports them; last, the highest peak
    exactly. With the plan's ``table``, a
    plan within its limits whose sizes are integers (and receive buffers free) is summed by
    columns; any other goes step by step, which lists the findings."""
    fast = None if table is None else _levels(table, model, limits)
    if fast is not None:
        hint, peaks = fast
        return [], hint, peaks, max(hint[1])
    findings = []
    peaks: dict[int, float] = {}
    exact: dict = {}  # size -> its exact value (sizes repeat)
    hint_levels, hint_peaks, hint_at = [], [], []
    def convert(x):
        return _exact(x, exact)

    for rank in range(plan.num_ranks):
        # the float levels for the report; a cost model's sizes are also summed exactly
        steps = list(memory_levels(plan, rank, model))
        sums = steps if model is UNIT_MEMORY else memory_levels(plan, rank, model,
                                                                 exact=convert)
        static = model.static_of(rank)
        reported = peak = None  # the highest step peak: as reported, and exactly
        levels, at = [_exact(static, exact)], -1
        for index, ((before, alloc, _, _), (level, a, f, after)) in enumerate(zip(steps,
                                                                               sums)):
            if reported is None or before + alloc > reported:
                reported = before + alloc
            level, a, f = convert(level), convert(a), convert(f)
            if peak is None or level + a > peak:
                peak, at = level + a, index
            if a or f:  # the hint lists the level at steps that move memory
                levels.append(convert(after))
        if peak is None:  # no steps: the static part is all there is
            peak, reported = levels[0], static
        peaks[rank] = reported
        hint_levels.append(tuple(levels))
        hint_peaks.append(peak)
        hint_at.append(at)
        if limits is not None and peak > _exact(limits[rank], exact):
            findings.append(_over_limit(plan, model, rank, at, peak,
                                        _exact(limits[rank], exact)))
    hint = None if findings else (tuple(hint_levels), tuple(hint_peaks), tuple(hint_at))
    return findings, hint, peaks, max(hint_peaks)


def _levels(table: OpTable, model: MemoryModel, limits) -> tuple | None:
    """``memory``'s hint and peaks by columns: each op's moves (``semantics.memory_moves``),
    levels by cumulative sums. None when the moves are not read by columns (a size, a
    static part or a limit is not an integer, buffers are not free, ...) or a rank is
    over its limit."""
    statics = [model.static_of(r) for r in range(table.plan.num_ranks)]
    moves = memory_moves(table, model, statics + list(limits or ()))
    if moves is None:
        return None
    alloc, freed = moves
    return _per_rank(table, alloc, freed, [int(x) for x in statics], statics, limits)


def _per_rank(table, alloc, freed, statics, given, limits) -> tuple | None:
    """The hint and the reported peaks from each op's moves (``semantics.column_levels``);
    None if over a limit."""
    levels, peaks, at, reported = [], [], [], {}
    for rank, (before, a, f, after) in enumerate(column_levels(table.counts, alloc, freed,
                                                               statics)):
        if len(a):
            top = before + a
            i = int(np.argmax(top))
            peak = int(top[i])
        else:
            i, peak = -1, int(statics[rank])
        if limits is not None and peak > limits[rank]:
            return None
        levels.append(tuple([int(statics[rank])] + after[(a != 0) | (f != 0)].tolist()))
        peaks.append(peak)
        at.append(i)
        reported[rank] = float(peak) if len(a) else given[rank]
    return (tuple(levels), tuple(peaks), tuple(at)), reported


def _exact(x, cache: dict):
    """``x`` exactly: an int or Fraction as it is, an integral float as an int (the unit
    model stays in fast int arithmetic), any other float as the Fraction it denotes."""
    v = cache.get(x)
    if v is None:
        if isinstance(x, (int, Fraction)):
            v = x
        else:
            x = float(x)
            if not math.isfinite(x):
                raise ValueError(f"memory sizes and limits must be finite, got {x}")
            v = int(x) if x.is_integer() else Fraction(x)
        cache[x] = v
    return v


def _over_limit(plan, model, rank, index, peak, bound) -> Finding:
    """``peak`` (exact) over ``bound`` (exact) at step ``index`` of ``rank``; the message
    prints them apart (``report.apart``), however close."""
    peak_text, bound_text = apart(peak, bound)
    if index == -1:  # an empty program: the static part alone is over (position -1,
        # as in semantics.peak_memory; no op to name)
        message = (f"rank {rank} position -1 (empty program): static memory "
                   f"{peak_text} exceeds the limit {bound_text}")
        return Finding(Violation("memory", message, (rank,)), ("peak", rank, -1))
    live = live_tensors(plan, rank, index, model)
    op = plan.programs[rank][index]
    message = (f"rank {rank} position {index} ({op}): memory peak {peak_text} exceeds the "
               f"limit {bound_text} with {len(live)} live tensors")
    trace = tuple(f"live: {name} ({size:g})" for name, size in live)
    return Finding(Violation("memory", message, (rank,), (_op_ref(plan, rank, index),), trace),
                   ("peak", rank, index))
