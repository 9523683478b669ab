"""The all-sizes laws of looped BFS and interleaved zero bubble
(``proofs/family_looped_bfs.py``, ``proofs/family_interleaved_zb.py``):

- their models are the package's programs (looped BFS with one chunk here, more in
  tests/test_proofs_expanded.py; interleaved zero bubble's word in its region, ``m >= p - 1``);
- the peak each memory law states is the verifier's, on every rank, inside and outside
  the region (the bounded law states the same formula);
- each law fails for a deliberately wrong statement: a wrong peak, a wrong word, a
  wrong stream order, a wrap without what is known of the round sizes; matching and
  deadlock rest on the same data-flow witness;
- the covering takes the all-sizes laws exactly where their scope holds, and the
  bounded law checks every instance left outside it.
"""

from __future__ import annotations

import pytest
import z3

from mpipe_verified.algebra.families import family
from mpipe_verified.lower import lower
from mpipe_verified.proofs import core
from mpipe_verified.proofs import family_interleaved_zb as izb
from mpipe_verified.proofs import family_looped_bfs as lb
from mpipe_verified.proofs.core import all_sizes, law
from mpipe_verified.proofs.covering import needed_laws
from mpipe_verified.ir import Compute
from mpipe_verified.semantics import needs, peak_memory, produces


def _triples(schedule):
    return tuple(tuple((op.kind, op.stage, op.mb) for op in prog) for prog in schedule.programs)


def _fails(obligations) -> bool:
    wrong = law("deliberately_wrong", "a deliberately wrong statement", all_sizes("test"))(
        lambda: list(obligations))
    return core.run_all([wrong], jobs=1)[0].status == core.FAILED


def test_looped_bfs_with_one_chunk_is_the_model():
    for p in range(1, 9):
        for m in range(1, 25):
            assert lb.programs(p, m, 1) == _triples(family("looped-bfs", p, m, 1).derive())


def test_the_interleaved_zb_word_is_the_package_in_its_region():
    for p in range(1, 9):
        for m in range(max(1, p - 1), 25):
            for v in (2, 3, 4):
                assert izb.model(p, m, v) == _triples(family("interleaved-zb", p, m, v)
                                                      .derive()), (p, m, v)
    # below the region the warmup and the held-back phase need more forwards than there
    # are (w + r > n on rank 0 at p = 6, m = 3: (v-1) g + p - 1 = 8 > 6): no such word
    assert (2 - 1) * 3 + 6 - 1 > 2 * 3 and not izb.in_region(6, 3)


def test_the_short_interleaved_zb_word_is_the_package_below_the_region():
    """Below m = p - 1 the pattern read whole (``phases_short``, letters past the stream
    absent) is the package's program, op for op."""
    for p in range(3, 9):
        for m in range(1, p - 1):
            for v in (2, 3, 4):
                assert not izb.in_region(p, m)
                assert izb.model(p, m, v) == _triples(family("interleaved-zb", p, m, v)
                                                      .derive()), (p, m, v)


def test_a_wrong_short_word_fails():
    def shifted(p_, n_, r_, g1_=izb.g1):  # phase 3 starts its W one number late
        phases = list(izb.phases_short(p_, n_, r_, g1_))
        count, (f_, i_, (kd, c, base)) = phases[2]
        phases[2] = (count, (f_, i_, (kd, c, base + 1)))
        return tuple(phases)
    assert _fails(izb._completeness(short=shifted))


def test_the_short_word_s_positions_are_no_timing():
    """Below the region the region's potential (position, r) fails on some instances
    (v = 3, m small against p): the short word's potential adds the chunk level."""
    assert not _potential_holds(8, 1, 3) and not _potential_holds(5, 1, 3)
    assert all(cell.proves({"pp": p, "microbatches": m, "chunks": v})
               for cell in (izb.interleaved_zb_completeness, izb.interleaved_zb_memory,
                            izb.interleaved_zb_dependency, izb.interleaved_zb_matching,
                            izb.interleaved_zb_deadlock)
               for p in (8, 1024) for m in (1, p - 2) for v in (2, 5))


def _short_potential_holds(p, m, v) -> bool:
    """The potential of the short word's dependency obligations, computed on the word:
    ``(level, position, r)`` for F, ``(level, position)`` for I and W, ``level`` as
    ``izb.level`` with ``Lam(u) = min(u // m, v - 1)``."""
    n, g1 = v * m, (v - 1) * m
    lam = lambda t: min(t // m, v - 1)  # noqa: E731
    units = dict(zip(((kd, s, x) for prog in izb.model(p, m, v) for kd, s, x in prog),
                     range(10 ** 9)))
    at, order = {}, []
    for r in range(p):
        w, k, prog = g1 + p - 1 - r, 0, []
        for count, body in izb.phases_short(p, n, r, g1):
            for jj in range(count):
                for kd, _, base in body:
                    if base + jj < n:
                        reached = (k - w) // 2 if k < w + 2 * r else r + (k - w - 2 * r) // 3
                        level = lam(k) if k < w else v - 1 + lam(reached)
                        prog.append((level, k, r if kd == "F" else -1))
                    k += 1
        order.append(prog)
        for (kd, s, x), pot in zip(izb.model(p, m, v)[r], prog):
            at[(kd, s, x)] = pot
    assert len(at) == len(units)
    if any(a >= b for prog in order for a, b in zip(prog, prog[1:])):
        return False
    return all(at[(pk, s + ds, x)] < here for (kd, s, x), here in at.items()
               for pk, ds in izb.EDGES[kd] if (pk, s + ds, x) in at)


def test_the_short_potential_holds_on_the_word_below_the_region():
    """Below m = p - 1 the (level, position) potential goes up along each rank's program
    and every input of the expanded model (where the position alone fails, v = 3)."""
    for p in range(3, 9):
        for m in range(1, p - 1):
            for v in (2, 3, 4):
                assert _short_potential_holds(p, m, v), (p, m, v)


def test_the_short_potential_needs_its_levels(monkeypatch):
    right = izb._lam_facts
    monkeypatch.setattr(izb, "_lam_facts", lambda *terms, wraps=(): right(*terms))
    assert _fails(izb._potential_short())  # the wraps need the level's step
    monkeypatch.setattr(izb, "_lam_facts", right)
    flat = izb.level
    monkeypatch.setattr(izb, "level", lambda wd, k_: 0 * flat(wd, k_))
    assert _fails(izb._potential_short())  # the position alone is no potential there


@pytest.mark.parametrize("name, module, chunks", [("looped-bfs", lb, (1, 2, 3)),
                                                  ("interleaved-zb", izb, (2, 3))])
def test_the_stated_peak_is_the_verifier_s(name, module, chunks):
    for p in range(1, 7):
        for m in range(1, 17):
            for v in chunks:
                plan = lower(family(name, p, m, v).derive())
                measured = [peak_memory(plan)[r][0] for r in range(p)]
                assert measured == [module.peak_of(p, m, v, r) for r in range(p)], (p, m, v)


@pytest.mark.parametrize("off", [-1, 1])
def test_a_wrong_peak_fails(off):
    assert _fails(lb._memory(lb.n_ + off))
    right = z3.If(izb.g1 + izb.p <= izb.n, izb.g1 + izb.p, izb.n)
    assert _fails(izb._memory(right + off))


def test_a_wrong_word_fails():
    def shifted(p_, n_, r_, g1_=izb.g1):  # phase 3 starts its W one number late
        phases = list(izb.phases(p_, n_, r_, g1_))
        count, body = phases[2]
        phases[2] = (count, body[:2] + (("W", 0, 1),))
        return tuple(phases)
    assert _fails(izb._completeness(shifted))


def test_a_wrong_stream_order_fails(monkeypatch):
    monkeypatch.setattr(lb, "u_f", lambda c_, x_, m_: c_ * (m_ - 1) + x_)  # chunks overlap
    assert _fails(lb._streams())


def test_the_wrap_needs_what_is_known_of_the_rounds():
    assert _fails(lb._potential(lambda r_: 0))  # no warmup: a backward before its forward
    assert _fails(izb._potential(rounds=z3.BoolVal(True)))  # short rounds: not acyclic so


def test_matching_and_deadlock_rest_on_the_data_flow_witness():
    for module, cells, flow in ((lb, (lb.looped_bfs_matching, lb.looped_bfs_deadlock), lb._flow),
                                (izb, (izb.interleaved_zb_matching,
                                       izb.interleaved_zb_deadlock), izb._flow)):
        witness = {ob.name for ob in flow()}
        for cell in cells:
            assert witness <= {ob.name for ob in cell.obligations()}, cell.name


def _covered(name, p, m, v) -> bool:
    return needed_laws(name, {"pp": p, "microbatches": m, "chunks": v}) is not None


def test_the_covering():
    assert all(_covered("looped-bfs", p, m, v) for p in (1, 3, 64) for m in (1, 2, 100)
               for v in (1, 2, 5))
    assert not _covered("looped-bfs", 4, 8, None)
    assert _covered("interleaved-zb", 8, 7, 2)  # m = p - 1, one round
    assert _covered("interleaved-zb", 3, 12, 3)
    assert _covered("interleaved-zb", 8, 6, 2)  # m < p - 1: the short word
    assert _covered("interleaved-zb", 3, 10, 2)  # a last round of 2 >= 3 / 2
    assert not _covered("interleaved-zb", 3, 13, 2)  # a last round of 1 < 3 / 2: bounded
    assert not _covered("interleaved-zb", 4, 8, 1)
    # completeness and memory hold on short last rounds too; the flow cells do not
    laws = {law_.property: law_ for law_ in (izb.interleaved_zb_completeness,
                                              izb.interleaved_zb_memory,
                                              izb.interleaved_zb_dependency)}
    params = {"pp": 3, "microbatches": 13, "chunks": 2}
    assert laws["completeness"].proves(params) and laws["memory"].proves(params)
    assert not laws["dependency"].proves(params)


def test_the_bounded_law_checks_every_instance_the_all_sizes_cells_leave():
    for p in range(1, izb.P_MAX + 1):
        for m in range(1, izb.M_MAX + 1):
            covered = {prop for prop, held in (("completeness", lambda p_, m_: True),
                                               ("dependency", izb.flows)) if held(p, m)}
            params = {"pp": p, "microbatches": m, "chunks": 2}
            assert izb.interleaved_zb_completeness.proves(params) == ("completeness" in covered)
            assert izb.interleaved_zb_dependency.proves(params) == ("dependency" in covered)


@pytest.mark.parametrize("module", [lb, izb], ids=["looped-bfs", "interleaved-zb"])
def test_the_potential_s_edges_are_the_semantics_inputs(module):
    """Each unit's inputs the potential checks (``EDGES``: the stage before's ``F``, the
    own ``F``, the stage after's gradient, the own ``I``) are exactly what
    ``semantics.needs`` asks of it and which unit ``semantics.produces`` it."""
    kinds = tuple(module.EDGES)
    for stages in range(1, 10):
        units = {(kd, s) for kd in kinds for s in range(stages)}
        for kd, s in units:
            wanted = set(needs(Compute(kd, s, 0), stages))
            makers = {(uk, us) for uk, us in units
                      if wanted & set(produces(Compute(uk, us, 0)))}
            # the first stage reads no activation, the last (the loss) no gradient
            stated = {(pk, s + ds) for pk, ds in module.EDGES[kd] if 0 <= s + ds < stages}
            assert makers == stated, (kd, s, stages)


def _potential_holds(p, m, v) -> bool:
    """The lexicographic potential of the dependency law, on the model's programs: every
    input of every op comes before it ((position, r) for F, (position, -r) for I, the
    position on the op's own rank)."""
    at = {}
    for r, prog in enumerate(izb.model(p, m, v)):
        for k, (kd, s, x) in enumerate(prog):
            at[(kd, s, x)] = (k, r if kd == "F" else -r)
    for (kd, s, x), here in at.items():
        for pk, ds in izb.EDGES[kd]:
            there = at.get((pk, s + ds, x))
            if there is None:
                continue
            if not (there < here if ds else there[0] < here[0]):
                return False
    return True


def test_the_potential_holds_on_the_model_exactly_where_the_laws_say():
    """Where the flow cells' scope holds the potential goes up along every input of the
    expanded model, and in the region it fails everywhere else (a last round h < p / 2):
    the scope is as wide as the potential argument can be."""
    for p in range(1, 9):
        for m in range(max(1, p - 1), 41):
            for v in (2, 3):
                assert _potential_holds(p, m, v) == izb.flows(p, m), (p, m, v)
