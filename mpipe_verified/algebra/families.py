"""The standard families, each a short algebra term (a weave pattern plus placement; the
greedy V families ``v-half`` and ``v-min``: the literal term of the order ``v_greedy``
builds, since their orders follow no count pattern).

Pattern variables: ``p`` ranks, ``r`` rank, ``m`` microbatches (samples), ``v`` chunks,
``g`` microbatches per round, ``s`` sequence chunks per sample, ``n = m·v·s`` (see
``pattern``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from ..errors import ParameterError
from ..errors import require as _need
from ..ir import Placement, Schedule
from . import v_greedy
from .literal import Program, literal
from .terms import ForwardOnly, Weave

GPIPE = "F* B*"
ONE_F_ONE_B = "F^{p-1-r} (F B)*"
# Megatron's interleaved warmup: finish the other chunks of the first round, plus two
# forwards per downstream rank.
INTERLEAVED_1F1B = "F^{(v-1)*g + 2*(p-1-r)} (F B)*"
ZB_H1 = "F^{p-1-r} (F I)^{r} (F I W)* (I W)* W*"
ZB_H2 = "F^{2*(p-1-r)+1} (I F)^{2*r} (I W F)* (I W)* W*"


def gpipe(pp: int, microbatches: int) -> Weave:
    """All forwards, then all backwards."""
    return Weave(pp, microbatches, GPIPE)


def one_f_one_b(pp: int, microbatches: int) -> Weave:
    """1F1B: ``p-1-r`` warmup forwards, then alternate forward/backward."""
    return Weave(pp, microbatches, ONE_F_ONE_B)


def _rounds(pp: int, microbatches: int) -> int:
    """Microbatches per round of the looped families: ``max(1, m // p)`` rounds of
    ``ceil(m / rounds)`` (the last may be shorter, so any ``m`` works; PyTorch instead
    requires ``m % rounds == 0``)."""
    rounds = max(1, microbatches // pp)
    return -(-microbatches // rounds)


def _short_last(pp: int, microbatches: int) -> bool:
    """Whether ``_rounds``' last round would be shorter than ``p`` (with ``m >= p``): such
    a round's wrap from rank ``p-1`` back to rank 0 comes later than the steady state's
    backwards of the round before allow, a cycle (``m = 37, p = 6``: rounds 7,...,7,2).
    The families even such rounds out instead (``Weave(even=True)``: the same number of
    rounds, sizes ``g`` and ``g-1``, all ``>= p``); whole rounds are unchanged."""
    g = _rounds(pp, microbatches)
    return microbatches >= pp and microbatches - (-(-microbatches // g) - 1) * g < pp


def interleaved_1f1b(pp: int, microbatches: int, chunks: int = 2) -> Weave:
    """Interleaved (looped, depth-first) 1F1B over ``chunks`` stages per rank, in rounds
    of ``_rounds(p, m)`` microbatches, evened out where the last would be shorter than
    ``p`` (``_short_last``)."""
    _need(isinstance(chunks, int) and chunks >= 2,
          f"interleaved-1f1b needs chunks >= 2, got chunks={chunks!r}")
    return Weave(pp, microbatches, INTERLEAVED_1F1B, chunks=chunks, group=_rounds(pp, microbatches),
                 even=_short_last(pp, microbatches))


def zb_h1(pp: int, microbatches: int) -> Weave:
    """ZB-H1: 1F1B with split backward; rank ``r`` runs each ``W`` ``r`` steady steps
    after its ``I`` so the input-gradient wave returns faster."""
    return Weave(pp, microbatches, ZB_H1)


def zb_h2(pp: int, microbatches: int) -> Weave:
    """ZB-H2: ``2(p-1-r)+1`` warmup forwards fill the start; rank ``r`` holds back its
    first ``2r`` weight gradients (``I F`` steps) so every rank runs without a gap once
    ``m >= 2p``; at most ``2p-1`` stored activations (unit model)."""
    return Weave(pp, microbatches, ZB_H2)


ZBV = ("F0^{2*(p-r)-1} (F1 F0)^{r} (F1 I1 W1)^{p-r} (F0 I0 W0 F1 I1 W1)^{max(m, 2*p-1)-p} "
       "(I0 I1)^{r} (I0 W0)^{p-r} W1* W0*")


def zbv(pp: int, microbatches: int) -> Weave:
    """ZB-V: V placement (two chunks per rank), zero bubble when F = I = W."""
    return Weave(pp, microbatches, ZBV, chunks=2, placement="v")


# Seq1F1B (sail-sg/Seq1F1B, Megatron's schedules.py patched): 1F1B counted in sequence
# chunks, forwards chunk-ascending and backwards chunk-descending per sample; warmup
# p - r + s - 2 chunk forwards (1F1B's p - 1 - r plus the rest of the first sample).
SEQ1F1B = "F^{p-r+s-2} (F B)*"


MAX_SEQ_CHUNKS = 1_000_000  # as plan-json reads at most


def seq1f1b(pp: int, microbatches: int, seq_chunks: int = 2) -> Weave:
    """Seq1F1B: each of ``microbatches`` samples cut into ``seq_chunks`` sequence chunks
    (microbatch ``sample * S + j``), run 1F1B-wise chunk by chunk."""
    _need(isinstance(seq_chunks, int) and 1 <= seq_chunks <= MAX_SEQ_CHUNKS,
          f"seq1f1b needs 1 <= seq_chunks <= {MAX_SEQ_CHUNKS:,}, got seq_chunks={seq_chunks!r}")
    return Weave(pp, microbatches, SEQ1F1B, seq_chunks=seq_chunks)


# DeepSeek's eight steps; the last rank runs its first main step's F0 and B1 apart, and
# the cooldown splits the backward of chunk 0 from the middle pair on (of chunk 1 too on
# odd ranks).
DUALPIPEV = ("F0^{2*(p-r-1)} (F0 F1)^{r+1} (I1 W F1)^{p-r-1} (F0 B1 <F1 B0>)^{r+2-p} "
             "(<F0 B1> <F1 B0>)^{m-2*p+r+1-max(0, r+2-p)} (B1 <F1 B0>)^{p-r-1} "
             "(B1 B0)^{(r+1)//2} (B1 I0)^{r+1-2*((r+1)//2)} (I1 I0)^{(r+1)//2} "
             "(W I0)^{p-r-1} W*")


def dualpipev(pp: int, microbatches: int) -> Weave:
    """DualPipeV: V placement; the steady state overlaps a forward of one chunk with a
    backward of the other in one step (``OVERLAP_F_B``)."""
    _need(microbatches >= 2 * pp, f"dualpipev needs microbatches >= 2*pp ({2 * pp}), "
                                  f"got {microbatches}")
    return Weave(pp, microbatches, DUALPIPEV, chunks=2, placement="v")


# DualPipe (DeepSeek): two pipelines in opposite directions on the V placement's ranks;
# chunk 0 of rank r is its stage nearer its pipeline's start, h = min(r, p-1-r) its depth
# there, p//2 - h - 1 the ranks between it and the middle; m//2 microbatches per pipeline.
_H, _E = "min(r, p-1-r)", "(1 - min(r, p-1-r) + 2*(min(r, p-1-r)//2))"  # h, [h is even]
DUALPIPE = (f"F0^{{2*(p//2-{_H}-1)}} (F0 F1)^{{{_H}+1}} (I1 W F1)^{{p//2-{_H}-1}} "
            f"(F0 B1)^{{{_H}+2-p//2}} (<F0 B1>)^{{min(1, p//2-1-{_H})}} <F1 B0> "
            f"(<F0 B1> <F1 B0>)^{{m//2-p+{_H}}} (B1 <F1 B0>)^{{p//2-{_H}-1}} "
            f"(B1 B0)^{{({_H}+1)//2}} (B1 I0)^{{{_E}}} (I1 I0)^{{{_H}+1-({_H}+1)//2-{_E}}} "
            f"(W I0)^{{p//2-{_H}-1}} W*")


def dualpipe(pp: int, microbatches: int) -> Weave:
    """DualPipe: microbatches ``0..m/2-1`` flow down ranks ``0..p-1`` and ``m/2..m-1`` up
    them (two pipelines, each rank a stage of both); the steady state overlaps a forward
    of one direction with a backward of the other (``OVERLAP_F_B``); the middle ranks run
    their first such pair apart. p and m even, ``m >= 2p``."""
    _need(pp % 2 == 0 and microbatches % 2 == 0 and microbatches >= 2 * pp,
          f"dualpipe needs an even pp, an even microbatches >= 2*pp, got pp={pp}, "
          f"microbatches={microbatches}")
    return Weave(pp, microbatches, DUALPIPE, placement="looped", pipelines=2)


# Chimera (Li & Hoefler): two pipelines, down and up, each rank a stage of both; one basic
# unit runs p/2 microbatches each way (a microbatch enters every other step and turns at
# the last stage). Units chain as Chimera's generator chains its pipelines: unit u+1
# enters when unit u's first microbatch is back, so unit u's last backwards of the rank's
# first stage alternate with unit u+1's first forwards, (B0 F0)^{p/2-h}.
_UNIT = f"(F1 F0)^{{{_H}}} (F1 B1)^{{p//2-{_H}}} (B0 B1)^{{{_H}}}"
CHIMERA = (f"F0^{{p//2-{_H}}} {_UNIT} ((B0 F0)^{{p//2-{_H}}} {_UNIT})^{{m//p-1}} "
           f"B0^{{p//2-{_H}}}")


def chimera(pp: int, microbatches: int) -> Weave:
    """Chimera: microbatches ``0..m/2-1`` down ranks ``0..p-1`` and ``m/2..m-1`` up them;
    p even, m a multiple of p (p/2 each way per basic unit, ``m/p`` units chained)."""
    _need(pp % 2 == 0 and microbatches % pp == 0,
          f"chimera needs an even pp and microbatches a multiple of pp, got pp={pp}, "
          f"microbatches={microbatches}")
    return Weave(pp, microbatches, CHIMERA, pipelines=2)


# BitPipe (Wu et al.): two V pipelines in opposite directions, each rank a V stage pair of
# both. Chunks by depth (``pipeline_streams``): 0 and 3 the rank's own pipeline (the one it
# enters nearer the start), 1 and 2 the other's; h = min(r, p-1-r). A unit of p/2
# microbatches per pipeline runs forwards 0^{p/2-h} (1 0)^h (1 2)^{p/2-h} (3 2)^h 3^{p/2-h},
# backwards the reverse word (3 for 0, 2 for 1); the steady 1F1B rounds and the cooldown
# are one body (the last round's forwards are exhausted).
_U = f"p//2-{_H}"
BITPIPE = (f"F0^{{{_U}}} (F1 F0)^{{{_H}}} (F1 F2)^{{{_U}}} (F3 F2)^{{{_H}}} "
           f"((F3 B3)^{{{_U}}} (B2 B3)^{{{_H}}} (B2 B1)^{{{_U}}} (B0 B1)^{{{_H}}} B0 "
           f"(F0 B0)^{{{_U}-1}} F0 (F1 F0)^{{{_H}}} (F1 F2)^{{{_U}}} (F3 F2)^{{{_H}}})*")


def bitpipe(pp: int, microbatches: int) -> Weave:
    """BitPipe: microbatches ``0..m/2-1`` down a V pipeline from rank 0 and ``m/2..m-1``
    down its mirror from rank ``p-1`` (four stages a rank); 1F1B in units of ``p/2``
    microbatches each way. p even, m a multiple of p."""
    _need(pp % 2 == 0 and microbatches % pp == 0,
          f"bitpipe needs an even pp and microbatches a multiple of pp, got pp={pp}, "
          f"microbatches={microbatches}")
    return Weave(pp, microbatches, BITPIPE, chunks=2, placement="v", pipelines=2)


@lru_cache(maxsize=64)
def _v_greedy(kind: str, pp: int, microbatches: int) -> Program:
    orders = v_greedy.orders(kind, pp, microbatches)
    return literal(Schedule(Placement.vshape(pp), microbatches,
                            tuple(tuple(o) for o in orders)))


def v_half(pp: int, microbatches: int) -> Program:
    """V-Half (zero-bubble's greedy V schedule at about half of 1F1B's activation
    memory): V placement, the order ``v_greedy`` builds from the V-Half stable pattern."""
    return _v_greedy("half", pp, microbatches)


def v_min(pp: int, microbatches: int) -> Program:
    """V-Min (the same greedy from the V-Min stable pattern: about a third of 1F1B's
    activation memory)."""
    return _v_greedy("min", pp, microbatches)


LOOPED_BFS = "F* B*"


def looped_bfs(pp: int, microbatches: int, chunks: int = 2) -> Weave:
    """Looped BFS (torch's ``ScheduleLoopedBFS``): every forward of chunk 0, then of chunk
    1, ...; then the backwards, chunks descending, microbatches descending."""
    _need(isinstance(chunks, int) and chunks >= 1,
          f"looped-bfs needs chunks >= 1, got chunks={chunks!r}")
    return Weave(pp, microbatches, LOOPED_BFS, chunks=chunks, order="bfs", backward="desc")


INTERLEAVED_ZB = "F^{(v-1)*g + p-1-r} (F I)^{r} (F I W)* W*"


def interleaved_zb(pp: int, microbatches: int, chunks: int = 2) -> Weave:
    """Interleaved zero bubble (torch's ``ScheduleInterleavedZeroBubble``): interleaved
    1F1B's rounds with split backwards, one warmup forward per downstream rank, and
    rank ``r`` holding back its first ``r`` weight gradients (ZB-H1's lever). Its rounds
    are ``_rounds``' as they come, a short last one included: it never closes interleaved
    1F1B's cycle (three letters a steady step; checked by tests/test_rounds_sweep.py), and
    its laws (proofs/family_interleaved_zb.py) model those rounds."""
    _need(isinstance(chunks, int) and chunks >= 2,
          f"interleaved-zb needs chunks >= 2, got chunks={chunks!r}")
    return Weave(pp, microbatches, INTERLEAVED_ZB, chunks=chunks, group=_rounds(pp, microbatches))


HANAYO = "F^{(v-1)*g + p-1} (F B)*"


def hanayo(pp: int, microbatches: int, waves: int = 2) -> Weave:
    """Hanayo: ``waves`` waves, each down and back up the ranks (``zigzag`` placement,
    ``2·waves`` chunks; the last stage and the loss on rank 0), run depth first as
    interleaved 1F1B in rounds (evened out as its), every rank warming up with the forwards of a round's
    first ``2W-1`` chunks and ``p-1`` more. No public generator to compare with (the
    authors published no code; Colossal-AI has no Hanayo schedule): a term from the
    paper's description, checked valid (not exact)."""
    _need(isinstance(waves, int) and waves >= 1, f"hanayo needs waves >= 1, got waves={waves!r}")
    return Weave(pp, microbatches, HANAYO, chunks=2 * waves, placement="zigzag",
                 group=_rounds(pp, microbatches), even=_short_last(pp, microbatches))


FAMILIES: dict[str, Callable[..., Weave | Program]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "v-half": v_half,
    "v-min": v_min,
    "looped-bfs": looped_bfs,
    "interleaved-zb": interleaved_zb,
    "hanayo": hanayo,
}
# the families of several pipelines over one model (docs/semantics.md §2.9): each needs an
# even pp, so they are kept apart from the families every size of which exists
BIDIRECTIONAL: dict[str, Callable[..., Weave]] = {
    "dualpipe": dualpipe,
    "chimera": chimera,
    "bitpipe": bitpipe,
}

# the families whose term is a literal (no laws; tune's search leaves them out)
LITERAL_FAMILIES = ("v-half", "v-min")
CHUNKED = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")  # take --chunks (default 2)
WAVED = ("hanayo",)  # takes --waves (default 2)
# Families of sequence chunks (a plan's ``seq_chunks`` > 1). Kept apart from ``FAMILIES``,
# whose plans are plain microbatches that every file format carries: a torch CSV says
# nothing of chunks, so theirs read back only with ``--seq-chunks S``.
SEQ_FAMILIES: dict[str, Callable[..., Weave]] = {"seq1f1b": seq1f1b}
FAMILY_NAMES = (*FAMILIES, *BIDIRECTIONAL, *SEQ_FAMILIES)  # every name ``family`` takes
# the chunks each other family always uses (read off its term)
_FIXED_CHUNKS = {name: make(1, 2).chunks for name, make in FAMILIES.items()
                 if name not in CHUNKED + WAVED} | {name: make(2, 4).chunks
                                                  for name, make in BIDIRECTIONAL.items()}


def family(name: str, pp: int, microbatches: int, chunks: int | None = None,
           forward_only: bool = False, waves: int | None = None,
           seq_chunks: int | None = None) -> Weave | Program | ForwardOnly:
    """The family term for ``name``; ``chunks`` only for the ``CHUNKED`` families,
    ``waves`` only for ``hanayo``, ``seq_chunks`` only for ``seq1f1b`` (default 2). With ``forward_only``, its evaluation run:
    ``ForwardOnly`` of the term (the same forwards in the same places, no backward)."""
    if forward_only:
        return ForwardOnly(family(name, pp, microbatches, chunks, waves=waves,
                                  seq_chunks=seq_chunks))
    if name not in FAMILY_NAMES:
        raise ParameterError(f"unknown family {name!r}; expected one of "
                             f"{', '.join(FAMILY_NAMES)}")
    _need(isinstance(pp, int) and pp >= 1, f"pp must be an integer >= 1, got {pp!r}")
    _need(isinstance(microbatches, int) and microbatches >= 1,
          f"microbatches must be an integer >= 1, got {microbatches!r}")
    _need(waves is None or name in WAVED, f"{name} takes no --waves (hanayo does)")
    if name in SEQ_FAMILIES:
        _need(chunks is None or chunks == 1, f"{name} takes no --chunks (it uses 1)")
        return SEQ_FAMILIES[name](pp, microbatches, 2 if seq_chunks is None else seq_chunks)
    _need(seq_chunks is None, f"{name} takes no --seq-chunks (only "
                              f"{', '.join(SEQ_FAMILIES)} does)")
    if name in CHUNKED:
        return FAMILIES[name](pp, microbatches, 2 if chunks is None else chunks)
    if name in WAVED:
        _need(chunks is None, f"{name} takes --waves, not --chunks")
        return FAMILIES[name](pp, microbatches, 2 if waves is None else waves)
    _need(chunks is None or chunks == _FIXED_CHUNKS[name],
          f"{name} takes no --chunks (it uses {_FIXED_CHUNKS[name]})")
    return {**FAMILIES, **BIDIRECTIONAL}[name](pp, microbatches)
