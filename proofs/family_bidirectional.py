"""DualPipe and Chimera (``algebra.families.BIDIRECTIONAL``): two pipelines over one model
(docs/semantics.md §2.9), their five invariants **for all sizes**, by a reduction to a V
on ``n = p/2`` virtual ranks.

**The twin reduction.** With ``p = 2n``, pipeline 0 runs model stage ``d`` on rank ``d``,
pipeline 1 on rank ``p-1-d``. Model stage ``d`` is *virtual stage* ``d`` of a V on ``n``
virtual ranks: virtual rank ``hv(d) = min(d, 2n-1-d)``, chunk ``0`` for ``d < n``, else
``1``. Rank ``r`` holds model stage ``r`` of pipeline 0 and ``p-1-r`` of pipeline 1; both
sit on virtual rank ``h = min(r, p-1-r)``, one as chunk 0, one as chunk 1, so rank ``r``
runs virtual rank ``h``'s word (its chunks' local microbatches ``0..m/2-1`` being its
pipelines' ``i m/2 + x``), and so does its mirror ``p-1-r``, for the other pipeline
(``twin``; = the package's programs for even ``p <= 8``, ``m <= 24``,
tests/test_proofs_family_models.py). Every input of the two pipelines (model stage
``d-1`` to ``d`` of one microbatch, forward or gradient) is an input of the V: chunk 0
of ``h-1`` to chunk 0 of ``h``, chunk 1 of ``h+1`` to chunk 1 of ``h``, or the turn,
chunk 0 to chunk 1 of virtual rank ``n-1``, which here joins the two middle ranks (a
transfer, where DualPipeV turns on one rank). A clock that depends only on the virtual
rank, step and unit therefore ranks the two pipelines' data-flow graph as it ranks the
V's: DualPipe's word is DualPipeV's on ``n`` ranks with ``m/2`` microbatches (its laws
are DualPipeV's obligations, which hold for every ``p, m >= 2p``, so at ``n, m/2``),
Chimera's is ``proofs.family_chimera``'s.

**The replica tail.** Model stage ``J``'s replicas sit on ranks ``J`` and ``p-1-J``
(distinct, ``p`` even), so each rank ``r`` ends with ``replica:h`` then ``replica:p-1-h``,
both over ``{r, p-1-r}``, after all its work, and its mirror ends with the same two calls
in the same order: each all-reduce is called once by each rank of its group, after every
local weight gradient, the calls pair up in order, and completion times ``T + 1 + i``
(``T`` above every completion time of the body, ``i`` the call's place in the tail) meet
the deadlock rule, independently of the body (``seq_deadlock_free`` in spirit: the body's
point-to-point events are matched inside it, by ``proofs.lowered``).
"""

from __future__ import annotations

import dataclasses

import z3

from mpipe_verified.ir import Compute, Overlap

from . import family_chimera as chimera
from . import family_dualpipev as dualpipev
from .core import Obligation, all_sizes, law
from .lowered import deadlock_obligations, matching_obligations
from .shape import ite


def twin(p: int, m: int, word) -> tuple:
    """The real programs from a V word on ``p/2`` virtual ranks (``word(n, m/2)``: per
    virtual rank, ops on virtual stage ``h`` (chunk 0) or ``2n-1-h`` (chunk 1) and local
    microbatches): rank ``r`` runs virtual rank ``min(r, p-1-r)``'s, chunk 0 being pipeline
    0 on ranks ``< n`` and pipeline 1 on the others."""
    n, half = p // 2, m // 2
    words = word(n, half)

    def real(r, op):
        if isinstance(op, Overlap):
            return Overlap(tuple(real(r, o) for o in op.ops))
        down = (op.stage < n) == (r < n)  # chunk 0 on the upper half: pipeline 0
        return Compute(op.kind, r if down else 2 * p - 1 - r,
                       op.mb + (0 if down else half))
    return tuple(tuple(real(r, op) for op in words[min(r, p - 1 - r)]) for r in range(p))


# ---------------------------------------------------------------- the reduction

N, R, D, J, I, G, M2 = z3.Ints("N R D J I G M2")
REAL = (N >= 1, 0 <= R, R < 2 * N)
H = ite(R < N, R, 2 * N - 1 - R)


def hv(d):
    """Virtual rank of model stage ``d``."""
    return ite(d < N, d, 2 * N - 1 - d)


def cv(d):
    """Chunk of model stage ``d`` on its virtual rank."""
    return ite(d < N, 0, 1)


def owner(pipe, d):
    """Rank of model stage ``d`` of pipeline ``pipe``."""
    return ite(pipe == 0, d, 2 * N - 1 - d)


def reduction():
    """Each rank runs a virtual rank's word; every input of the two pipelines is an input
    of the V; local and global microbatches correspond one to one."""
    yield Obligation("twin: rank r and its mirror p-1-r are virtual rank h = min(r, p-1-r), "
                     "0 <= h < n", z3.And(H == ite(2 * N - 1 - R < N, 2 * N - 1 - R, R),
                                          0 <= H, H < N), REAL)
    stage = (0 <= D, D < 2 * N, z3.Or(I == 0, I == 1), N >= 1)
    r_ = owner(I, D)
    hr = ite(r_ < N, r_, 2 * N - 1 - r_)
    chunk0 = (I == 0) == (r_ < N)  # twin's chunk 0: pipeline 0 on ranks < n
    yield Obligation("twin: model stage d of pipeline i sits on a rank whose virtual rank "
                     "is hv(d), as chunk cv(d) (chunk 0 iff pipeline 0 on ranks < n), at "
                     "virtual stage d",
                     z3.And(0 <= r_, r_ < 2 * N, hr == hv(D), chunk0 == (cv(D) == 0),
                            ite(cv(D) == 0, hv(D), 2 * N - 1 - hv(D)) == D), stage)
    yield Obligation("twin: rank r holds model stage d (of one pipeline) iff d is r or "
                     "p-1-r, and the two are its two chunks",
                     z3.And((z3.Or(owner(0, D) == R, owner(1, D) == R))
                            == z3.Or(D == R, D == 2 * N - 1 - R),
                            hv(R) == H, hv(2 * N - 1 - R) == H, cv(R) != cv(2 * N - 1 - R)),
                     REAL + (0 <= D, D < 2 * N))
    yield Obligation("twin: each input, model stage d-1 to d (and back for gradients), is an "
                     "input of the V: chunk 0 of h-1 to h, chunk 1 of h+1 to h, or the turn "
                     "on virtual rank n-1",
                     z3.Or(z3.And(cv(D - 1) == 0, cv(D) == 0, hv(D - 1) == hv(D) - 1),
                           z3.And(cv(D - 1) == 1, cv(D) == 1, hv(D - 1) == hv(D) + 1),
                           z3.And(hv(D - 1) == N - 1, hv(D) == N - 1, cv(D - 1) == 0,
                                  cv(D) == 1)),
                     (N >= 1, 1 <= D, D < 2 * N))
    yield Obligation("twin: the first stage is chunk 0 of virtual rank 0 and the last (the "
                     "loss) chunk 1 of virtual rank 0, as in the V",
                     z3.And(hv(0) == 0, cv(0) == 0, hv(2 * N - 1) == 0, cv(2 * N - 1) == 1),
                     (N >= 1,))
    local = G - I * M2
    yield Obligation("twin: pipeline i's microbatches i m/2 + x, x < m/2, are its chunk's "
                     "local microbatches x, one to one",
                     z3.And(z3.Implies(z3.And(I * M2 <= G, G < I * M2 + M2),
                                       z3.And(0 <= local, local < M2)),
                            local + I * M2 == G), (z3.Or(I == 0, I == 1), M2 >= 1))


def tail():
    """The replica all-reduces: which, in which order, over which ranks; the deadlock
    witness of the tail."""
    yield Obligation("replica tail: model stage J's replicas sit on two distinct ranks, J "
                     "and p-1-J, so replica:J is required",
                     owner(0, J) != owner(1, J), (N >= 1, 0 <= J, J < 2 * N))
    calls = (H, 2 * N - 1 - H)
    yield Obligation("replica tail: rank r calls replica:J iff it holds a replica of J, "
                     "i.e. for J = h then J = p-1-h (ascending), each over {r, p-1-r}, and "
                     "its mirror p-1-r makes the same calls in the same order",
                     z3.And(calls[0] < calls[1], z3.Or(calls[0] == R, calls[0] == 2 * N - 1 - R),
                            z3.Or(calls[1] == R, calls[1] == 2 * N - 1 - R),
                            *[z3.Or(owner(0, c) == R, owner(1, c) == R) for c in calls],
                            *[z3.Or(owner(0, c) == 2 * N - 1 - R, owner(1, c) == 2 * N - 1 - R)
                              for c in calls],
                            ite(2 * N - 1 - R < N, 2 * N - 1 - R, R) == calls[0]), REAL)
    T, last, k = z3.Ints("T last k")
    fin = lambda i_: T + 1 + i_  # noqa: E731
    yield Obligation("replica tail: completion times T + 1 + i (T >= every body completion "
                     "time) increase along the rank after its body, partners (the i-th call "
                     "of r and of p-1-r) complete together, each posted before the other "
                     "completes", z3.And(fin(0) > last, fin(1) > fin(0),
                                         z3.Implies(z3.Or(k == 0, k == 1),
                                                    ite(k == 0, last, fin(k - 1)) <= fin(k))),
                     (last <= T,))


@law("replica_tail", "Two pipelines over one model on p = 2n ranks (DualPipe, Chimera): each "
     "rank r ends with replica:h then replica:p-1-h (h = min(r, p-1-r)), both over {r, p-1-r}, "
     "as its mirror does: each all-reduce once per rank of its group, paired in order, and "
     "completion times after the body's meet the deadlock rule, whatever the body",
     all_sizes("every even p >= 2, rank and model stage; the tail lower appends after all "
               "of a rank's work"))
def replica_tail():
    yield from tail()


def _renamed(prefix: str, obligations):
    return [dataclasses.replace(ob, name=f"{prefix}{ob.name}") for ob in obligations]


V_DUALPIPE = "DualPipe's word is DualPipeV's on n = p/2 ranks, m/2 microbatches: "
V_CHIMERA = "Chimera, virtual rank h: "


def _dualpipe(prop: str) -> list:
    word = {"completeness": lambda: dualpipev.dualpipev_completeness.obligations(),
            "memory": lambda: dualpipev.dualpipev_peak_memory.obligations()}
    body = word[prop]() if prop in word else list(dualpipev.flow())
    return _renamed(V_DUALPIPE, body)


def _chimera(prop: str) -> list:
    word = {"completeness": chimera.completeness, "memory": chimera.memory}
    return _renamed(V_CHIMERA, (word.get(prop, chimera.dependency))())


def _obligations(name: str, prop: str):
    yield from reduction()
    yield from (_dualpipe if name == "dualpipe" else _chimera)(prop)
    if prop != "memory":
        yield from tail()
    if prop == "matching":
        yield from matching_obligations()
    if prop == "deadlock":
        yield from deadlock_obligations()


# ---------------------------------------------------------------- the laws

def _covers_dualpipe(params) -> bool:
    pp, mm = params["pp"], params["microbatches"]
    return pp % 2 == 0 and mm % 2 == 0 and mm >= 2 * pp >= 2


def _covers_chimera(params) -> bool:
    pp, mm = params["pp"], params["microbatches"]
    return pp % 2 == 0 and pp >= 2 and mm >= pp and mm % pp == 0


def peak_of(name: str, pp: int, r_: int) -> int:
    """The proven unit-model peak of rank ``r_``."""
    return pp + 1 if name == "dualpipe" else pp // 2 + 1 + min(r_, pp - 1 - r_)


def _peaks(name: str):
    return lambda params: tuple(peak_of(name, params["pp"], r_)
                                for r_ in range(params["pp"]))


STATEMENTS = {
    "completeness": "F and B (or I and W) once each per stage and microbatch of its "
                    "pipeline, on the rank owning the stage, each replica all-reduce "
                    "once on every rank holding a replica, and nothing else",
    "dependency": "a data-flow timing exists (every input made before its consumer), each "
                  "replica all-reduce after all the rank's work",
    "matching": "the lowered plan pairs each send with its receive, FIFO per channel, "
                "none leaves its pipeline, and the replica all-reduces pair up in order",
    "deadlock": "the lowered plan runs to completion under rendezvous (completion-time "
                "witness: each op's place in lowering's event order, then the tail's)",
    "memory": "the unit-model peak of rank r is",
}
HOW = {
    "dualpipe": "DualPipeV's model, clock and level on n = p/2 virtual ranks, m/2 "
                "microbatches a chunk (= the package's programs through twin for even "
                "p <= 8, m <= 24, tests/test_proofs_family_models.py)",
    "chimera": "Chimera's unit word on n = p/2 virtual ranks, its clock u (6n-2) + d + 2x "
               "(F) or 4n-1-d+2x (B) (= the package's programs through twin for even "
               "p <= 8, m <= 24, tests/test_proofs_family_models.py)",
}
LOWERED = ("; the lowering model of proofs.lowered for the point-to-point body, the "
           "replica tail after it (= lower for even p <= 8, "
           "tests/test_proofs_bidirectional.py)")


def _law(name: str, title: str, prop: str, peak_text: str, allowed: str):
    said = STATEMENTS[prop] if name == "dualpipe" else STATEMENTS[prop].replace(
        " (or I and W)", "")
    statement = f"{title}: {said}" + (f" {peak_text}" if prop == "memory" else "")
    scope = all_sizes(f"every {allowed}, rank, step and microbatch; the twin reduction "
                      f"to a V on p/2 virtual ranks; {HOW[name]}"
                      + (LOWERED if prop in ("matching", "deadlock") else ""))
    covers = _covers_dualpipe if name == "dualpipe" else _covers_chimera
    return law(f"{name}_{prop}", statement, scope, weight=2, family=name, property=prop,
               covers=covers, peak=_peaks(name) if prop == "memory" else None)(
                   lambda: list(_obligations(name, prop)))


PROPERTIES = ("completeness", "dependency", "matching", "deadlock", "memory")
(dualpipe_completeness, dualpipe_dependency, dualpipe_matching, dualpipe_deadlock,
 dualpipe_memory) = (_law("dualpipe", "DualPipe", prop, "p + 1", "even p >= 2, even m >= 2p")
                     for prop in PROPERTIES)
(chimera_completeness, chimera_dependency, chimera_matching, chimera_deadlock,
 chimera_memory) = (_law("chimera", "Chimera", prop, "p/2 + 1 + min(r, p-1-r)",
                         "even p >= 2, m a multiple of p")
                    for prop in PROPERTIES)
