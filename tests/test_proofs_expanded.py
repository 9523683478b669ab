"""The models the family laws are proven about are what the package runs: each family's
closed form (``proofs.expanded.SCHEDULES``) expands to exactly the programs ``derive``
gives, and the lowering model (``proofs.lowered``, expanded by ``proofs.expanded.lowered``)
to exactly the plan ``lower`` gives, op for op, for every p <= 8, m <= 24 (DualPipeV: m >=
2p) and, for interleaved 1F1B, looped BFS and interleaved zero bubble, chunks 2 to 4. (ZBV's and DualPipeV's own models are
compared with ``derive`` in tests/test_proofs_family_models.py.)"""

from __future__ import annotations

import pytest

from mpipe_verified.algebra.families import FAMILIES, family
from mpipe_verified.ir import Compute, Placement
from mpipe_verified.lower import lower
from mpipe_verified.proofs import expanded

P_MAX, M_MAX, CHUNKS = 8, 24, (2, 3, 4)
PROVEN_HERE = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev",
               "looped-bfs", "interleaved-zb")
CHUNKED = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")


def _instances(name):
    for p in range(1, P_MAX + 1):
        for m in range(2 * p if name == "dualpipev" else 1, M_MAX + 1):
            for v in (CHUNKS if name in CHUNKED else (None,)):
                yield p, m, v


def _as_triples(programs):
    out = []
    for prog in programs:
        assert all(isinstance(op, Compute) and not op.segment for op in prog)
        out.append(tuple((op.kind, op.stage, op.mb) for op in prog))
    return tuple(out)


@pytest.mark.parametrize("name", sorted(expanded.SCHEDULES))
def test_each_closed_form_is_the_package_s_schedule(name):
    for p, m, v in _instances(name):
        schedule = family(name, p, m, v).derive()
        assert schedule.placement == Placement.looped(p, v or 1), (p, m, v)
        assert expanded.SCHEDULES[name](p, m, v) == _as_triples(schedule.programs), (p, m, v)


@pytest.mark.parametrize("name", PROVEN_HERE)
def test_the_lowering_model_is_lower(name):
    for p, m, v in _instances(name):
        schedule = family(name, p, m, v).derive()
        assert expanded.lowered(schedule) == lower(schedule).programs, (name, p, m, v)


def test_every_family_proven_here_is_modelled():
    assert set(expanded.SCHEDULES) <= set(FAMILIES)
    # bounded: the laws are about the package's own derived instances; ZBV and DualPipeV:
    # their models are programs of ops (V placement, overlapped steps), compared with
    # derive in tests/test_proofs_family_models.py, and so are the words of ZB-H1, ZB-H2
    # and interleaved zero bubble
    assert set(PROVEN_HERE) - set(expanded.SCHEDULES) == {"zb-h1", "zb-h2", "zbv", "dualpipev",
                                                          "interleaved-zb"}
