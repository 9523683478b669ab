"""The five properties of docs/semantics.md §3, each as: a linear pass over the plan (through the
shared ``semantics``) that finds violations or builds the certificate's facts.

Every function returns ``(findings, obligations)`` (``memory`` adds the peaks):
``findings`` pair each violation with the ground fact (or small core) Z3 must confirm
before it is reported; ``obligations`` are the facts Z3 must prove when nothing was found.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Callable

import attrs

from ..ir import COMM_STEP, Collective, Compute, Plan, Send, p2p_of
from ..semantics import (EAGER, Chain, MemoryModel, Token, execute, live_tensors, memory_steps,
                         pair_collectives, pair_p2p, produces, required_work, wait_cycle,
                         work_table)
from .obligations import Obligations
from .report import Violation


@attrs.frozen
class Finding:
    """A violation and how Z3 confirms it: ``(template, fact)`` must violate its
    template, or ``core`` (a callable building a Z3 formula) must be unsatisfiable."""

    violation: Violation
    fact: tuple[str, tuple] | None = None
    core: Callable | None = None


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


def completeness(plan: Plan) -> tuple[list[Finding], Obligations]:
    chain = Chain.of(plan)
    table = work_table(plan, chain)
    obligations = Obligations()
    facts = {}
    for (seg, stage, mb), row in table.counts.items():
        fact = tuple(row) + tuple(int(x) for x in chain.expected_backward(seg, mb))
        facts[(seg, stage, mb)] = fact
        obligations.add("unit", seg, stage, fact)
    obligations.add("le", "stray", 0, (len(table.stray), 0))
    findings = []
    for issue in required_work(plan, table, limit=MAX_FINDINGS):
        c = issue.op
        ops = (_op_ref(plan, *issue.where),) if issue.where else ()
        rank = issue.where[0] if issue.where else (chain.expected_rank(c) or 0)
        key = (c.segment, c.stage, c.mb)
        fact = ("unit", facts[key]) if key in facts else ("le", (len(table.stray), 0))
        findings.append(Finding(Violation("completeness", issue.detail, (rank,), ops), fact))
    return findings, obligations


# ---------------------------------------------------------------- dependency

def dependency(plan: Plan) -> tuple[list[Finding], Obligations]:
    """Every op's inputs (§2.5) are on its rank before it runs: the witness is, for each
    input, the position that produced or received it."""
    chain = Chain.of(plan)
    obligations = Obligations()
    findings = Findings()
    for rank, program in enumerate(plan.programs):
        have: dict = {}
        lanes: dict = {}
        missing = []  # (index, token) listed, explained once the rank is read
        for index, op in enumerate(program):
            for token in chain.needs(op, rank):
                pos = have.get(token)
                if pos is None:
                    if len(findings) + len(missing) < MAX_FINDINGS:
                        missing.append((index, token))
                    else:
                        findings.unlisted += 1
                    continue
                cls = (_kind_of(op), token[0])
                facts = lanes.get(cls)
                if facts is None:
                    facts = lanes[cls] = obligations.lane("lt", cls, rank)
                facts.append((pos, index))
            for token in produces(op):
                if token not in have:
                    have[token] = index
        # ``have`` now holds where each token first appears on this rank: a missing
        # input's token, if at all, appears only there (at or after its use)
        findings.extend(_missing_input(plan, rank, index, Token(*token), have.get(token))
                        for index, token in missing)
    return findings, obligations


def _kind_of(op) -> str:
    return op.kind if type(op) is Compute else type(op).__name__


def _missing_input(plan, rank, index, token, produced_at) -> Finding:
    what = {"out": "activation", "stored": "stored forward", "grad": "gradient",
            "wgrad_ready": "input-gradient step", "input": "shipped input",
            "params": "broadcast parameters", "wdone": "weight gradient"}[token.kind]
    seg = f"{token.segment}:" if token.segment else ""
    name = f"{what} of stage {seg}{token.stage} microbatch {token.mb}"
    op = plan.programs[rank][index]
    if produced_at is None:
        message = f"rank {rank} position {index}: {op} needs the {name}, which is never " \
                  f"computed or received on rank {rank}"
        position = len(plan.programs[rank])
    else:
        message = f"rank {rank} position {index}: {op} needs the {name}, which arrives only " \
                  f"later, at position {produced_at} ({plan.programs[rank][produced_at]})"
        position = produced_at
    return Finding(Violation("dependency", message, (rank,), (_op_ref(plan, rank, index),)),
                   ("lt", (position, index)))


# ---------------------------------------------------------------- matching

_PAYLOAD_KINDS = {"act": 0, "grad": 1, "input": 2}


def _payload_code(codes: dict, p, cache: dict) -> tuple:
    """The payload as integers ``(kind, stage, mb, rest)``, where ``rest`` numbers the
    distinct ``(segment, shape, dtype, to_segment)`` values: equal codes iff equal
    payloads. Cached per payload object (both ends of a pair usually share one)."""
    code = cache.get(id(p))
    if code is None:
        rest = (p.segment, p.shape, p.dtype, p.to_segment)
        code = cache[id(p)] = (_PAYLOAD_KINDS[p.kind], p.stage, p.mb,
                               codes.setdefault(rest, len(codes)))
    return code


def matching(plan: Plan, pairing=None, collectives=None) -> tuple[list[Finding], Obligations]:
    """FIFO pairing per ordered rank pair: equal counts and equal payloads; collectives
    called in the same order with the same kind, tag and root by every member."""
    pairing = pairing or pair_p2p(plan)
    collectives = collectives or pair_collectives(plan)
    codes: dict = {}
    cache: dict = {}
    obligations = Obligations()
    findings = Findings()
    mismatched = set(pairing.mismatched)
    programs = plan.programs
    unmatched = _unmatched_by_channel(plan, pairing)
    for lane, (channel, pairs) in enumerate(sorted(pairing.channels.items())):
        counts = pairing.counts[channel]
        obligations.add("eq", "count", lane, counts)
        facts = obligations.lane("eq", "payload", lane)
        for s_end, r_end in pairs:
            send = p2p_of(programs[s_end[0]][s_end[1]])[s_end[2]].payload
            recv = p2p_of(programs[r_end[0]][r_end[1]])[r_end[2]].payload
            fact = _payload_code(codes, send, cache) + _payload_code(codes, recv, cache)
            if mismatched and (s_end, r_end) in mismatched:
                findings.add(lambda: _mismatch(plan, s_end, r_end, fact))
            else:
                facts.append(fact)
        if counts[0] != counts[1]:
            for end, op in unmatched.get(channel, ()):
                findings.add(lambda: _leftover(plan, channel, counts, end, op))
    calls: dict = {}  # (field, value) -> code, for _call_code
    for positions, problem in collectives.problems:
        if len(findings) >= MAX_FINDINGS:
            findings.unlisted += 1
            continue
        ranks = tuple(dict.fromkeys(r for r, _ in positions))
        if len(positions) == 2:  # two members disagree on kind, tag or root
            (ra, ia), (rb, ib) = positions
            fact = ("eq", _call_code(programs[ra][ia], calls) + _call_code(programs[rb][ib],
                                                                           calls))
        else:  # a member missing, or a call by a non-member
            fact = _instance_fact(plan, *positions[0], collectives)
        findings.append(Finding(Violation("matching", problem, ranks,
                                          tuple(_op_ref(plan, r, i) for r, i in positions)),
                                fact))
    agree = obligations.lane("eq", "collective_calls", 0)
    for key, where in collectives.members.items():
        group, _ = key
        obligations.add("eq", "collective_members", 0, (len(where), len(group)))
        first = min(where)  # every member calls what the lowest member calls
        ref = _call_code(programs[first][where[first]], calls)
        for r, i in where.items():
            if r != first:
                agree.append(ref + _call_code(programs[r][i], calls))
    return findings, obligations


def _call_code(op: Collective, codes: dict) -> tuple[int, int, int]:
    """A collective call's ``(kind, tag, root)`` as integers (root None as -1): equal
    codes iff the calls agree."""
    return (codes.setdefault(("kind", op.kind), len(codes)),
            codes.setdefault(("tag", op.tag), len(codes)),
            -1 if op.root is None else op.root)


def _instance_fact(plan, rank, index, collectives) -> tuple[str, tuple]:
    """Why the collective at ``(rank, index)`` cannot complete, as a plan fact: its
    instance has fewer callers than its group has members, or ``rank`` is not a member
    of the group it calls (it occurs 0 times in it, not once)."""
    key = collectives.instance_of.get((rank, index))
    if key is None:
        return ("eq", (tuple(plan.programs[rank][index].ranks).count(rank), 1))
    return ("eq", (len(collectives.members[key]), len(key[0])))


def _mismatch(plan, s_end, r_end, fact) -> Finding:
    send, recv = plan.programs[s_end[0]][s_end[1]], plan.programs[r_end[0]][r_end[1]]
    message = (f"send/recv mismatch on channel {s_end[0]}->{r_end[0]}: rank {s_end[0]} "
               f"position {s_end[1]} sends {send} but the matching receive at rank {r_end[0]} "
               f"position {r_end[1]} is {recv}")
    trace = (f"send end: rank {s_end[0]}, position {s_end[1]}, {send}",
             f"recv end: rank {r_end[0]}, position {r_end[1]}, {recv}")
    return Finding(Violation("matching", message, (s_end[0], r_end[0]),
                             (_op_ref(plan, *s_end[:2]), _op_ref(plan, *r_end[:2])), trace),
                   ("eq", fact))


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
                             (_op_ref(plan, end[0], end[1]),)), ("eq", counts))


# ---------------------------------------------------------------- deadlock

def _no_time(op) -> float:
    return 0.0


def _one_step(op) -> float:
    return 1.0


def deadlock(plan: Plan, comm_model: str, pairing=None, collectives=None
             ) -> tuple[list[Finding], Obligations]:
    """Run the plan with compute free and every comm step taking one tick (compute never
    blocks, so only the order of comm steps matters). If it completes, those ticks are the
    witness: each meeting happens after both ends were posted and no end finishes before
    its meeting. If not, the wait-for cycle is the counterexample."""
    pairing = pairing or pair_p2p(plan)
    collectives = collectives or pair_collectives(plan)
    run = execute(plan, comm_model, _no_time, _one_step, pairing, collectives)
    if not run.completed:
        return _deadlock_findings(plan, run, comm_model, pairing, collectives), Obligations()
    return [], _deadlock_witness(plan, comm_model, run, pairing, collectives)


def _deadlock_witness(plan, comm_model, run, pairing, collectives) -> Obligations:
    """Facts, one per matched pair and one per collective member: each end was posted no
    earlier than the previous comm step on its rank finished (program order: compute
    never blocks, so only comm steps are ordered), the meeting comes after both ends were
    posted and before either end finishes, and a collective meets after all members
    posted it. Every comm step of a completed run is an end of some pair or collective,
    or an unmatched send under eager (it never blocks), whose program order is a fact of
    its own."""
    obligations = Obligations()
    start, finish = run.start, run.finish
    ready = _program_order(plan, finish)
    chunk = _chunk_index(plan.placement)
    eager = comm_model == EAGER
    programs = plan.programs
    for lane, (_, pairs) in enumerate(sorted(pairing.channels.items())):
        facts: dict = {}  # class -> this lane's fact list
        for (sr, si, sm), (rr, ri, _) in pairs:
            payload = p2p_of(programs[sr][si])[sm].payload
            post_s, post_r = start[sr][si], start[rr][ri]
            cls = (payload.kind, chunk.get(payload.stage, -1))
            meet = (post_s if post_s > post_r else post_r) + 1
            if eager:  # the send returns at once: it finishes after it was posted
                obligations.lane("lt", ("eager_send",) + cls, lane).append(
                    (post_s, finish[sr][si]))
            lane_facts = facts.get(cls)
            if lane_facts is None:
                lane_facts = facts[cls] = obligations.lane("rendezvous", cls, lane)
            lane_facts.append((ready[sr][si], ready[rr][ri], post_s, post_r, meet,
                               meet if eager else finish[sr][si], finish[rr][ri]))
    for r, i, _ in pairing.unmatched:
        obligations.add("le", "unmatched_send", r, (ready[r][i], start[r][i]))
    for (group, _), where in collectives.members.items():
        meet = max(start[r][i] for r, i in where.items()) + 1
        for r, i in where.items():
            obligations.add("collective", "collective", r,
                            (ready[r][i], start[r][i], meet, finish[r][i]))
    return obligations


def _program_order(plan, finish) -> list[dict[int, float]]:
    """Per rank, comm step position -> when the previous comm step on that rank finished
    (0 for the first)."""
    ready = []
    for rank, program in enumerate(plan.programs):
        previous, out = 0.0, {}
        fin = finish[rank]
        for index, op in enumerate(program):
            if type(op) in _COMM_TYPES:  # a hash lookup: this loop visits every op
                out[index] = previous
                previous = fin[index]
        ready.append(out)
    return ready


_COMM_TYPES = frozenset(COMM_STEP)


def _chunk_index(placement) -> dict[int, int]:
    """Stage -> its index among the stages of its rank (the local chunk)."""
    return {s: placement.stages_of(r).index(s) for r in range(placement.num_ranks)
            for s in placement.stages_of(r)}


def _deadlock_findings(plan, run, comm_model, pairing, collectives) -> list[Finding]:
    cycle = wait_cycle(run)
    if cycle:
        trace = tuple(f"rank {w.rank}, position {w.index}: {plan.programs[w.rank][w.index]} "
                      f"waits for rank {w.on[0]} to reach position {w.on[1]} "
                      f"({plan.programs[w.on[0]][w.on[1]]})" for w in cycle)
        message = "wait-for cycle under rendezvous: " + " -> ".join(
            f"rank {w.rank}@{w.index} {plan.programs[w.rank][w.index]}" for w in cycle)
        violation = Violation("deadlock", message, tuple(w.rank for w in cycle),
                              tuple(_op_ref(plan, w.rank, w.index) for w in cycle), trace)
        return [Finding(violation, core=lambda: _cycle_core(cycle))]
    findings = []
    for w in run.waits:
        if w.on is None:
            violation = Violation("deadlock", f"rank {w.rank} position {w.index}: {w.reason}",
                                  (w.rank,), (_op_ref(plan, w.rank, w.index),), (w.reason,))
            findings.append(Finding(violation, _no_partner_fact(
                plan, w.rank, w.index, comm_model, pairing, collectives)))
    return findings


def _no_partner_fact(plan, rank, index, comm_model, pairing, collectives
                     ) -> tuple[str, tuple]:
    """The plan fact behind "no matching partner": a collective instance short of members
    (or a non-member's call), or an end without a partner on a channel whose send and
    receive counts differ (FIFO pairs the first ``min`` of each)."""
    op = plan.programs[rank][index]
    if type(op) is Collective:
        return _instance_fact(plan, rank, index, collectives)
    for member, c in enumerate(p2p_of(op)):
        if comm_model == EAGER and type(c) is Send:
            continue  # buffered: never waits for a partner
        if (rank, index, member) not in pairing.partner:
            channel = (rank, c.dst) if type(c) is Send else (c.src, rank)
            return ("eq", pairing.counts[channel])
    return ("eq", (0, 0))  # no such fact: Z3 rejects it and the verdict is unknown


def _cycle_core(cycle):
    """Rank r stuck at position i waits for rank q to reach j > (where q is stuck): the
    meeting comes after q posts position j, which is after q finishes its stuck op, and
    r's op finishes no earlier than the meeting. Around the cycle: t > t."""
    import z3
    fin = {w.rank: z3.Int(f"fin_{w.rank}_{w.index}") for w in cycle}
    at = {w.rank: w.index for w in cycle}
    constraints = []
    for w in cycle:
        q, j = w.on
        post = z3.Int(f"post_{q}_{j}")
        meet = z3.Int(f"meet_{w.rank}_{w.index}")
        constraints += [meet > post, fin[w.rank] >= meet]
        # program order on q: posting j happens after q's stuck op at at[q] < j finished
        constraints.append(post >= fin[q] if j > at[q] else post > fin[q] - 1)
    return z3.And(constraints)


# ---------------------------------------------------------------- memory

def memory(plan: Plan, model: MemoryModel, limits: tuple | None
           ) -> tuple[list[Finding], Obligations, dict]:
    """Peak of §2.6 per rank within ``limits`` (one bound per rank, see ``memory_limits``,
    or None). Without a limit the proven bound is the peak itself. Levels are summed and compared
    exactly (a float size is the rational it denotes, ``_exact``): the facts are then the
    ones Z3 checks. The reported peaks are the float sums, as ``semantics`` reports them."""
    obligations = Obligations()
    findings = []
    peaks: dict[int, float] = {}
    exact: dict = {}  # size -> its exact value (sizes repeat)
    for rank in range(plan.num_ranks):
        steps, _ = memory_steps(plan, rank, model)
        static = model.static_of(rank)
        level = start = _exact(static, exact)
        float_level = static  # summed as semantics.memory_trace sums it, for the report
        reported = peak = None  # the highest step peak: as reported, and exactly
        levels = []
        append, get = levels.append, exact.get
        for alloc, freed in steps:
            if not (alloc or freed):  # most steps: the level stays
                if peak is None or level > peak:
                    peak = level
                if reported is None or float_level > reported:
                    reported = float_level
                append((level, 0, 0, level))
                continue
            at = float_level + alloc
            if reported is None or at > reported:
                reported = at
            float_level += alloc - freed
            a, f = get(alloc), get(freed)
            if a is None:
                a = _exact(alloc, exact)
            if f is None:
                f = _exact(freed, exact)
            top = level + a
            if peak is None or top > peak:
                peak = top
            after = top - f
            append((level, a, f, after))
            level = after
        if peak is None:  # no steps: the static part is all there is
            peak, reported = start, static
        peaks[rank] = reported
        bound = peak if limits is None else _exact(limits[rank], exact)
        program = plan.programs[rank]
        obligations.add("memory", "static", rank, (start, 0, 0, start, bound))
        for index, (before, alloc, freed, after) in enumerate(levels):
            if alloc or freed:
                obligations.lane("memory", _kind_of(program[index]), rank).append(
                    (before, alloc, freed, after, bound))
        if peak > bound:
            findings.append(_over_limit(plan, model, rank, levels, peak, bound))
    return findings, obligations, peaks


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


def memory_limits(limit, ranks: int) -> tuple | None:
    """``limit`` (None, a number, or a sequence of one number per rank) as one bound per
    rank. A sequence of another length, or a bound that is not a finite number, is
    refused with ``ValueError``: a missing rank must never go unchecked."""
    if limit is None:
        return None
    if isinstance(limit, numbers.Real):
        bounds = (limit,) * ranks
    else:
        bounds = tuple(limit)
        if len(bounds) != ranks:
            raise ValueError(f"memory limit lists {len(bounds)} per-rank values but the "
                             f"plan has {ranks} ranks: give one value per rank, or a number")
    for x in bounds:
        if not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise ValueError(f"memory limit must be a finite number per rank, got {x!r}")
    return bounds


def _over_limit(plan, model, rank, levels, peak, bound) -> Finding:
    index = next((i for i, (b, a, _, _) in enumerate(levels) if b + a == peak), -1)
    if index == -1:  # an empty program: the static part alone is over (position -1,
        # as in semantics.peak_memory; no op to name)
        message = (f"rank {rank} position -1 (empty program): static memory "
                   f"{float(peak):g} exceeds the limit {float(bound):g}")
        return Finding(Violation("memory", message, (rank,)),
                       ("memory", (peak, 0, 0, peak, bound)))
    live = live_tensors(plan, rank, index, model)
    op = plan.programs[rank][index]
    message = (f"rank {rank} position {index} ({op}): memory peak {float(peak):g} exceeds the "
               f"limit {float(bound):g} with {len(live)} live tensors")
    trace = tuple(f"live: {name} ({size:g})" for name, size in live)
    fact = levels[index] + (bound,)
    return Finding(Violation("memory", message, (rank,), (_op_ref(plan, rank, index),), trace),
                   ("memory", fact))
