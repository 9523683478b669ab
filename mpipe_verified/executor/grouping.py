"""``group_adjacent_comms``: post each run of consecutive point-to-point ops of a rank
as one ``Group`` (what torch's schedules do by hand with ``fwd_send + bwd_recv``).

A group posts its members at once and completes when all have matched, so a rank no
longer waits for one transfer before posting the next: their latencies overlap. This is
a plan transform like any other: verify the grouped plan (the certificate covers the
groups) before running it.
"""

from __future__ import annotations

import attrs

from ..ir import Group, Plan, Recv, Send


def group_adjacent_comms(plan: Plan) -> Plan:
    """``plan`` with every maximal run of adjacent ``SEND``/``RECV``/``Group`` steps of a
    rank merged into one ``Group`` (members in their order); single ops stay as they are."""
    programs = []
    for prog in plan.programs:
        out, run = [], []
        for op in (*prog, None):
            if isinstance(op, (Send, Recv)):
                run.append(op)
                continue
            if isinstance(op, Group):
                run.extend(op.ops)
                continue
            if len(run) > 1:
                out.append(Group(tuple(run)))
            else:
                out.extend(run)
            run = []
            if op is not None:
                out.append(op)
        programs.append(tuple(out))
    return attrs.evolve(plan, programs=tuple(programs))
