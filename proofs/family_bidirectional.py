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
tests/test_proofs_bidirectional.py). Every input of the two pipelines (model stage
``d-1`` to ``d`` of one microbatch, forward or gradient) is an input of the V: chunk 0
of ``h-1`` to chunk 0 of ``h``, chunk 1 of ``h+1`` to chunk 1 of ``h``, or the turn,
chunk 0 to chunk 1 of virtual rank ``n-1``, which here joins the two middle ranks (a
transfer, where DualPipeV turns on one rank).

**The substitution** (``at_real_ranks``, ``stage_map``). The V's obligations are proven
again as statements about real rank ``R``: ``sigma`` maps the V's size symbols
(DualPipeV's ``p, m, r``; Chimera's word's ``n, h``) to ``n``, ``m/2`` and
``HV = h(R) = min(R, p-1-R)``, in every goal, hypothesis and lemma. The V's size
hypotheses (``p >= 1, m >= 2p, 0 <= r < p``) become lemmas that a first obligation
proves from the real sizes (``p = 2n >= 2``, ``m/2 >= 2n``, ``0 <= R < p``). Rank ``R``'s
chunk ``c``, the V's stage ``stage(n, HV, c)``, is model stage ``D`` of pipeline ``I``
(0 iff ``D < n`` and ``R < n`` agree), owned by ``R``, at virtual rank ``hv(D) = HV``,
chunk ``cv(D) = c``, and every stage ``R`` owns is one of them; for DualPipe every real
input, forward or gradient, is a row of DualPipeV's own input table
(``family_dualpipev._edges``) at the consumer's virtual rank, the producer at the row's
virtual rank and chunk. So the V's clock read at ``h(R)`` is a timing of the real ranks
(each real input's producer is where the V's row puts it) and the V's level bounds the
real rank's memory: DualPipe's laws are DualPipeV's obligations at ``n, m/2, h(R)``,
Chimera's ``proofs.family_chimera``'s at ``n, h(R)``, each proven by Z3 as such. What
rests on tests is the model (``twin`` of the V word is the package's programs).

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
import functools

import z3

from mpipe_verified.ir import Compute, Overlap

from . import family_chimera as chimera
from . import family_dualpipev as dualpipev
from .core import Obligation, all_sizes, law
from .family_zbv import stage as v_stage
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

@dataclasses.dataclass(frozen=True)
class Symbols:
    """The real side's symbols: ``N`` (``n = p/2``), rank ``R``, model stage ``D``,
    replica stage ``J``, pipeline ``I``, global microbatch ``G``, ``M2`` (``m/2``), and
    ``HV``, the virtual rank a substitution gives rank ``R`` (``HV = h(R)``)."""

    N: z3.ArithRef
    R: z3.ArithRef
    D: z3.ArithRef
    J: z3.ArithRef
    I: z3.ArithRef
    G: z3.ArithRef
    M2: z3.ArithRef
    HV: z3.ArithRef

    @property
    def sizes(self) -> tuple:
        """``p = 2n >= 2`` ranks, ``0 <= R < p``."""
        return (self.N >= 1, 0 <= self.R, self.R < 2 * self.N)

    @property
    def h(self):
        """Rank ``R``'s virtual rank ``min(R, p-1-R)``."""
        return ite(self.R < self.N, self.R, 2 * self.N - 1 - self.R)


@functools.cache
def symbols() -> Symbols:
    """The symbols, made when a law first reads them (never at import)."""
    return Symbols(*z3.Ints("N R D J I G M2 HV"))


def hv(d):
    """Virtual rank of model stage ``d``."""
    n = symbols().N
    return ite(d < n, d, 2 * n - 1 - d)


def cv(d):
    """Chunk of model stage ``d`` on its virtual rank."""
    return ite(d < symbols().N, 0, 1)


def owner(pipe, d):
    """Rank of model stage ``d`` of pipeline ``pipe``."""
    return ite(pipe == 0, d, 2 * symbols().N - 1 - d)


def reduction():
    """Each rank runs a virtual rank's word; every input of the two pipelines is an input
    of the V; local and global microbatches correspond one to one."""
    s = symbols()
    N, R, D, I, G, M2, H = s.N, s.R, s.D, s.I, s.G, s.M2, s.h
    yield Obligation("twin: rank r and its mirror p-1-r are virtual rank h = min(r, p-1-r), "
                     "0 <= h < n", z3.And(H == ite(2 * N - 1 - R < N, 2 * N - 1 - R, R),
                                          0 <= H, H < N), s.sizes)
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
                     s.sizes + (0 <= D, D < 2 * N))
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


# ---------------------------------------------------------------- the substitution

def at_real_ranks(title: str, obligations, sigma: tuple, v_sizes: tuple, real_sizes: tuple):
    """The V's obligations as statements about real rank ``R``: ``sigma`` (the V's size
    symbols to the real side's: its rank ``r`` to ``HV``, ``HV = h(R)`` being one of
    ``real_sizes``) applied to each goal, hypothesis and lemma. The V's size hypotheses
    ``v_sizes`` become lemmas, which the first obligation proves from ``real_sizes`` (the
    real sizes give the V's sizes at the substitution); each obligation then holds, as
    the V's own, for every real rank."""
    def sub(e):
        return z3.substitute(e, *sigma)
    sized = [sub(h_) for h_ in v_sizes]
    yield Obligation(f"{title}the real sizes give the V's at the substitution",
                     z3.And(*sized), real_sizes)
    for ob in obligations:
        assert ob.smt is None and ob.goal is not None
        rest = tuple(sub(h_) for h_ in ob.hypotheses
                     if not any(h_.eq(v) for v in v_sizes))
        example = tuple((dict((a.get_id(), b) for a, b in sigma).get(c.get_id(), c), v)
                        for c, v in ob.example)
        yield dataclasses.replace(ob, name=f"{title}{ob.name}", goal=sub(ob.goal),
                                  hypotheses=real_sizes + rest, example=example,
                                  lemmas=tuple(sub(lm) for lm in ob.lemmas) + tuple(sized))


def stage_map(title: str, stage_of, edges=None):
    """The substitution's stages: rank ``R``'s chunk ``c`` (virtual stage
    ``stage_of(N, HV, c)``) is model stage ``D`` of pipeline ``I`` (0 iff ``D < n`` and
    ``R < n`` agree, as ``twin`` maps it), owned by ``R``, at virtual rank ``hv(D) = HV``
    and chunk ``cv(D) = c``; every model stage ``R`` owns is one of its chunks. ``edges``,
    the V's input table ``(r, p, forward, gradient)`` (rows ``(name, condition on r,
    consumer chunk, (producer's rank offset, chunk))``): every real input, forward
    (stage ``d-1`` to ``d``) or gradient (``d`` to ``d-1``), is a row at the consumer's
    virtual rank."""
    s = symbols()
    N, R, D, I, HV = s.N, s.R, s.D, s.I, s.HV
    sized = s.sizes + (HV == s.h,)

    def pipe(d):
        return ite((d < N) == (R < N), 0, 1)
    for c in (0, 1):
        d = stage_of(N, HV, c)
        yield Obligation(f"{title}rank r's chunk {c} is model stage D of pipeline I, owned "
                         f"by r, at virtual rank hv(D) = h(r), chunk cv(D) = {c}",
                         z3.And(0 <= d, d < 2 * N, owner(pipe(d), d) == R, hv(d) == HV,
                                cv(d) == c), sized)
    yield Obligation(f"{title}every model stage D that rank r owns (of pipeline I) is one "
                     f"of its chunks, pipeline I as twin maps it",
                     z3.Implies(z3.And(z3.Or(I == 0, I == 1), 0 <= D, D < 2 * N,
                                       owner(I, D) == R),
                                z3.Or(*[z3.And(D == stage_of(N, HV, c), I == pipe(D))
                                        for c in (0, 1)])), sized)
    if edges is None:
        return
    r_v, p_v, forward, gradient = edges

    def at(cond, rank):
        return z3.BoolVal(cond) if isinstance(cond, bool) else z3.substitute(
            cond, (r_v, rank), (p_v, N))
    for label, rows, made, needs in (("forward", forward, D - 1, D),
                                     ("gradient", gradient, D, D - 1)):
        yield Obligation(f"{title}each {label} input between model stages of one pipeline "
                         f"is a row of the V's input table at the consumer's virtual rank",
                         z3.Or(*[z3.And(at(cond, hv(needs)), cv(needs) == c,
                                        hv(made) == hv(needs) + dr, cv(made) == pc)
                                 for _, cond, c, (dr, pc) in rows]),
                         (N >= 1, 1 <= D, D < 2 * N))


def tail():
    """The replica all-reduces: which, in which order, over which ranks; the deadlock
    witness of the tail."""
    s = symbols()
    N, R, J, H = s.N, s.R, s.J, s.h
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
                            ite(2 * N - 1 - R < N, 2 * N - 1 - R, R) == calls[0]), s.sizes)
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


V_DUALPIPE = "DualPipe's word is DualPipeV's on n = p/2 ranks, m/2 microbatches: "
V_CHIMERA = "Chimera, virtual rank h: "


def _dualpipev_edges() -> tuple:
    """DualPipeV's inputs between stages (``family_dualpipev._edges``): forward (an ``F``
    from an ``F``) and gradient (a backward from the next stage's), as ``stage_map``
    reads them."""
    rows = [(name, cond, c, (dr, pc), pk) for name, cond, kinds, c, (dr, pk, pc)
            in dualpipev._edges() if kinds == ("F",) and pk == "F" or pk == "grad"]
    return (dualpipev.r, dualpipev.p, [row[:4] for row in rows if row[4] == "F"],
            [row[:4] for row in rows if row[4] == "grad"])


def _dualpipe(prop: str) -> list:
    word = {"completeness": lambda: dualpipev.dualpipev_completeness.obligations(),
            "memory": lambda: dualpipev.dualpipev_peak_memory.obligations()}
    body = word[prop]() if prop in word else list(dualpipev.flow())
    s = symbols()
    real_sizes = s.sizes + (s.M2 >= 2 * s.N, s.HV == s.h)
    return [*stage_map(V_DUALPIPE, v_stage, _dualpipev_edges()),
            *at_real_ranks(V_DUALPIPE, body, dualpipe_sigma(s), dualpipev.SIZES, real_sizes)]


def dualpipe_sigma(s: Symbols) -> tuple:
    """DualPipeV's ``p``, ``m``, ``r`` to ``n``, ``m/2`` and rank ``R``'s virtual rank."""
    return (dualpipev.p, s.N), (dualpipev.m, s.M2), (dualpipev.r, s.HV)


def _chimera(prop: str) -> list:
    word = {"completeness": chimera.completeness, "memory": chimera.memory}
    body = list((word.get(prop, chimera.dependency))())
    s, n, h = symbols(), chimera.n, chimera.h
    v_sizes = (n >= 1, 0 <= h, h < n)
    return [*stage_map(V_CHIMERA, chimera.virtual_stage),
            *at_real_ranks(V_CHIMERA, body, ((n, s.N), (h, s.HV)), v_sizes,
                           s.sizes + (s.HV == s.h,))]


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
                "microbatches a chunk, substituted onto real rank r (p, m, r to n, m/2, "
                "min(r, p-1-r)) with its stages, pipelines and input table (= the "
                "package's programs through twin for even p <= 8, m <= 24, "
                "tests/test_proofs_bidirectional.py)",
    "chimera": "Chimera's unit word on n = p/2 virtual ranks, the units chained as its "
               "generator chains them, its clock 4n u + d + 2x (F) or 4n u + 4n-1-d+2x "
               "(B), substituted onto real rank r (n, h to p/2, min(r, p-1-r)) with its "
               "stages and pipelines (= the package's programs through twin for even "
               "p <= 8, m <= 24, tests/test_proofs_bidirectional.py)",
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
