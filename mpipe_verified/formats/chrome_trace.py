"""Chrome / Perfetto trace JSON of a timed plan (open it in ui.perfetto.dev or
chrome://tracing).

``chrome_trace(timeline, name)`` returns the trace as a dict in the Trace Event Format's
JSON object form:

- one process per rank (``pid = rank``, named ``rank r``), with two threads: ``compute``
  (``tid 0``) and ``comm`` (``tid 1``);
- one complete event (``ph: "X"``) per compute step on the compute thread, named by its
  action text (``2F0``; an overlapped step ``0F7;7B3``) with stage, microbatch, kind and
  position in ``args``, and one per comm step on the comm thread (``2SEND_F1``), timed by
  the cost model (``timeline``: compute ops take the spec's durations, transfers are free,
  so a receive's slice spans from its posting to the arrival of its send);
- one flow per matched send/receive pair (``semantics.pair_p2p``): a flow start
  (``ph: "s"``) at the send and a flow end (``ph: "f"``, ``bp: "e"``) at the receive,
  with the same ``id``, so the viewers draw an arrow from every send to its receive.

Time: one schedule time unit (the cost model's unit; 1 per forward by default) is shown as
1 ms (``ts``/``dur`` are in µs). Transfers take no time in the cost model; so that every
flow binds to its slice, a comm slice lasts at least ``MIN_COMM_US`` and consecutive comm
slices of a rank never overlap (shifted by at most a few µs). ``args`` keep the exact
model times (``start``, ``finish``). With ``compute_only`` the comm thread and the flows
are left out.
"""

from __future__ import annotations

import json

from ..ir import Collective, Group, Idle, Marker, Op, Recv, Send, computes_of, p2p_of
from ..semantics import pair_p2p
from ..sim import Timeline

US_PER_UNIT = 1000.0
MIN_COMM_US = 1.0
COMPUTE_TID, COMM_TID = 0, 1


def chrome_trace(tl: Timeline, name: str = "", compute_only: bool = False) -> dict:
    """The trace of ``tl`` (see the module docstring)."""
    plan = tl.plan
    events: list[dict] = []
    for rank in range(plan.num_ranks):
        events.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        events.append(_meta("thread_name", rank, COMPUTE_TID, {"name": "compute"}))
        events.append(_meta("thread_sort_index", rank, COMPUTE_TID, {"sort_index": 0}))
        if not compute_only:
            events.append(_meta("thread_name", rank, COMM_TID, {"name": "comm"}))
            events.append(_meta("thread_sort_index", rank, COMM_TID, {"sort_index": 1}))
    shown: dict[tuple[int, int], float] = {}  # comm step -> its slice's ts (µs)
    for rank in range(plan.num_ranks):
        program = plan.programs[rank]
        comm_free = 0.0
        for index in range(tl.executed(rank)):
            op = program[index]
            t0, t1 = tl.start[rank][index], tl.finish[rank][index]
            base = {"position": index, "start": t0, "finish": t1}
            subs = computes_of(op)
            if subs:
                args = dict(base, ops=[{"kind": c.kind, "stage": c.stage, "mb": c.mb,
                                        **({"segment": c.segment} if c.segment else {})}
                                       for c in subs])
                events.append(_slice(";".join(map(str, subs)), "compute," + "".join(
                    c.kind for c in subs), rank, COMPUTE_TID, _us(t0), _us(t1) - _us(t0),
                    args))
            elif not compute_only and not isinstance(op, (Idle, Marker)):
                ts = max(_us(t0), comm_free)
                dur = max(_us(t1) - ts, MIN_COMM_US)
                comm_free = ts + dur
                shown[(rank, index)] = ts
                events.append(_slice(str(op), _comm_category(op), rank, COMM_TID, ts, dur,
                                     dict(base, **_comm_args(op))))
    if not compute_only:
        flow = 0
        for (src, dst), pairs in sorted(pair_p2p(plan).channels.items()):
            for (sr, si, sm), (rr, ri, _) in pairs:
                if (sr, si) not in shown or (rr, ri) not in shown:
                    continue  # an end never ran (the plan stops before it)
                flow += 1
                payload = p2p_of(plan.programs[sr][si])[sm].payload
                label = (f"{payload.kind} {payload.segment + ':' if payload.segment else ''}"
                         f"{payload.stage}/{payload.mb} {src}->{dst}")
                events.append({"name": label, "cat": "p2p", "ph": "s", "id": flow,
                               "pid": sr, "tid": COMM_TID, "ts": shown[(sr, si)]})
                events.append({"name": label, "cat": "p2p", "ph": "f", "bp": "e", "id": flow,
                               "pid": rr, "tid": COMM_TID, "ts": shown[(rr, ri)]})
    meta = {"source": name, "ranks": plan.num_ranks, "microbatches": plan.num_microbatches,
            "makespan": tl.makespan, "completed": tl.completed,
            "time_unit": f"1 schedule time unit = {US_PER_UNIT:g} us",
            "comm_model": tl.comm_model}
    if not tl.completed:
        meta["blocked"] = [{"rank": w.rank, "position": w.index, "reason": w.reason}
                           for w in tl.waits]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def dumps(trace: dict) -> str:
    """The trace's JSON text: one event per line (diffs well, loads fast)."""
    events = ",\n".join(json.dumps(e, separators=(",", ":")) for e in trace["traceEvents"])
    rest = {k: v for k, v in trace.items() if k != "traceEvents"}
    tail = json.dumps(rest, separators=(",", ":"))[1:]
    return '{"traceEvents":[\n' + events + "\n]," + tail + "\n"


def _us(t: float) -> float:
    return round(t * US_PER_UNIT, 3)


def _meta(what: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _slice(name: str, cat: str, pid: int, tid: int, ts: float, dur: float, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts,
            "dur": round(dur, 3), "args": args}


def _comm_category(op: Op) -> str:
    if isinstance(op, Send):
        return "comm,send"
    if isinstance(op, Recv):
        return "comm,recv"
    if isinstance(op, Group):
        return "comm,group"
    return "comm,collective"


def _comm_args(op: Op) -> dict:
    if isinstance(op, Collective):
        return {"collective": op.kind, "ranks": list(op.ranks), "tag": op.tag}
    return {"p2p": [{"dir": "send" if isinstance(m, Send) else "recv", "peer": m.peer,
                     "payload": m.payload.kind, "stage": m.payload.stage,
                     "mb": m.payload.mb} for m in p2p_of(op)]}
