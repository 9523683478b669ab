"""The all-sizes laws of seq1f1b (``proofs/family_seq1f1b.py``):

- the model (the shape ``F^{p-r+S-2} (F B)*`` over the chunk streams) is, op for op, what
  ``derive`` gives, and the lowering model (``proofs.expanded.lowered``) what ``lower``
  gives, for every p <= 8, m <= 8 samples, S <= 4;
- the peak the memory law states is the verifier's on every rank;
- the inputs the potential checks (``EDGES``) are the shared semantics' (``Chain.needs``
  with the chunk rules), and the potential goes up along each of them on the model;
- each law fails for a deliberately wrong statement (a wrong peak, a warmup without the
  rest of the first sample, a wrong stream order); matching and deadlock rest on the same
  data-flow witness;
- the laws cover every instance with ``seq_chunks >= 1``, and none without it.
"""

from __future__ import annotations

import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.ir import Compute, Placement
from mpipe_verified.lower import lower
from mpipe_verified.proofs import expanded
from mpipe_verified.proofs import family_seq1f1b as sq
from mpipe_verified.proofs.covering import needed_laws
from mpipe_verified.semantics import Chain, peak_memory
from test_proofs_loop_families import _fails, _triples

P_MAX, M_MAX, S_MAX = 8, 8, 4


def _instances():
    for p in range(1, P_MAX + 1):
        for m in range(1, M_MAX + 1):
            for s in range(1, S_MAX + 1):
                yield p, m, s


def test_the_model_is_the_package_s_schedule_and_lowering():
    for p, m, s in _instances():
        schedule = family("seq1f1b", p, m, seq_chunks=s).derive()
        assert schedule.placement == Placement.looped(p, 1) and schedule.seq_chunks == s
        assert sq.programs(p, m, s) == _triples(schedule), (p, m, s)
        assert expanded.lowered(schedule) == lower(schedule).programs, (p, m, s)


def test_the_stated_peak_is_the_verifier_s():
    for p in range(1, 7):
        for m in range(1, 7):
            for s in range(1, S_MAX + 1):
                plan = lower(family("seq1f1b", p, m, seq_chunks=s).derive())
                measured = tuple(peak_memory(plan)[r][0] for r in range(p))
                params = {"pp": p, "microbatches": m, "chunks": None, "seq_chunks": s}
                assert measured == sq.peaks(params), (p, m, s)


def test_the_potential_s_edges_are_the_semantics_inputs():
    """Each chunk's inputs the potential checks (``EDGES``: the stage before's ``F``, the
    previous chunk's ``F``, the own ``F``, the stage after's gradient, the next chunk's
    ``B``) are exactly what ``Chain.needs`` asks of it in a plan of sequence chunks, and
    which unit ``Chain.produces`` makes each."""
    for stages in range(1, 6):
        for s in range(1, 5):
            chain = Chain(Placement.looped(stages, 1), seq_chunks=s)
            units = {(kd, st, j) for kd in sq.EDGES for st in range(stages) for j in range(s)}
            for kd, st, j in units:
                mb = s + j  # sample 1, chunk j
                wanted = set(chain.needs(Compute(kd, st, mb), st))
                makers = {(uk, us, uj) for uk, us, uj in units
                          if wanted & set(chain.produces(Compute(uk, us, s + uj)))}
                stated = {(pk, st + ds, j + dj) for pk, ds, dj in sq.EDGES[kd]
                          if 0 <= st + ds < stages and 0 <= j + dj < s}
                assert makers == stated, (kd, st, j, stages, s)


def test_the_potential_goes_up_along_every_input_of_the_model():
    for p, m, s in _instances():
        at = {}
        for r, prog in enumerate(sq.programs(p, m, s)):
            for k, (kd, st, mb) in enumerate(prog):
                at[(kd, st, mb)] = (k, r if kd == "F" else -r)
        for (kd, st, mb), here in at.items():
            for pk, ds, dj in sq.EDGES[kd]:
                j = mb % s + dj
                there = at.get((pk, st + ds, mb + dj)) if 0 <= j < s else None
                if there is not None:
                    assert (there < here if ds else there[0] < here[0]), (p, m, s, kd, st, mb)


@pytest.mark.parametrize("off", [-1, 1])
def test_a_wrong_peak_fails(off):
    s_ = sq._symbols()[0]
    assert _fails(sq._memory(sq.shape.mn(sq.p - sq.r + s_ - 1, sq.n_) + off))


def test_a_warmup_without_the_rest_of_the_first_sample_fails():
    # 1F1B's warmup p - 1 - r: a chunk's backward could come before its forward
    assert _fails(sq._potential(lambda r_: sq.shape.mn(sq.p - 1 - r_, sq.n_)))


def test_a_wrong_stream_order_fails(monkeypatch):
    monkeypatch.setattr(sq, "u_b", lambda x_, j_, s_: x_ * s_ + j_)  # chunks ascending
    assert _fails(sq._streams())


def test_matching_and_deadlock_rest_on_the_data_flow_witness():
    witness = {ob.name for ob in sq._flow()}
    for cell in (sq.seq1f1b_matching, sq.seq1f1b_deadlock):
        assert witness <= {ob.name for ob in cell.obligations()}, cell.name


def test_the_laws_cover_every_instance_with_sequence_chunks():
    for p in (1, 3, 1024):
        for m in (1, 2, 4096):
            for s in (1, 2, 7):
                params = {"pp": p, "microbatches": m, "chunks": None, "seq_chunks": s}
                laws = needed_laws("seq1f1b", params)
                assert laws is not None and all(law_.for_all_sizes() for law_ in laws)
                assert [law_.name for law_ in laws] == [
                    "seq1f1b_completeness", "seq1f1b_dependency", "seq1f1b_matching",
                    "seq1f1b_deadlock", "seq1f1b_peak_memory"]
    assert needed_laws("seq1f1b", {"pp": 4, "microbatches": 4, "chunks": None}) is None
    assert needed_laws("seq1f1b", {"pp": 4, "microbatches": 4, "chunks": None,
                                   "seq_chunks": 0}) is None
