"""The standard families, each a short algebra term (a weave pattern plus placement).

Pattern variables: ``p`` ranks, ``r`` rank, ``m`` microbatches (samples), ``v`` chunks,
``g`` microbatches per round, ``s`` sequence chunks per sample, ``n = m·v·s`` (see
``pattern``).
"""

from __future__ import annotations

from typing import Callable

from ..errors import ParameterError
from ..errors import require as _need
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


def interleaved_1f1b(pp: int, microbatches: int, chunks: int = 2) -> Weave:
    """Interleaved (looped, depth-first) 1F1B over ``chunks`` stages per rank. The
    microbatches form ``max(1, m // p)`` rounds of ``ceil(m / rounds)`` (the last may be
    shorter, so any ``m`` works; PyTorch instead requires ``m % rounds == 0``)."""
    _need(isinstance(chunks, int) and chunks >= 2,
          f"interleaved-1f1b needs chunks >= 2, got chunks={chunks!r}")
    rounds = max(1, microbatches // pp)
    per_round = -(-microbatches // rounds)
    return Weave(pp, microbatches, INTERLEAVED_1F1B, chunks=chunks, group=per_round)


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


def seq1f1b(pp: int, microbatches: int, seq_chunks: int = 2) -> Weave:
    """Seq1F1B: each of ``microbatches`` samples cut into ``seq_chunks`` sequence chunks
    (microbatch ``sample * S + j``), run 1F1B-wise chunk by chunk."""
    _need(isinstance(seq_chunks, int) and seq_chunks >= 1,
          f"seq1f1b needs seq_chunks >= 1, got seq_chunks={seq_chunks!r}")
    return Weave(pp, microbatches, SEQ1F1B, seq_chunks=seq_chunks)


DUALPIPEV = ("F0^{2*(p-r-1)} (F0 F1)^{r+1} (I1 W F1)^{p-r-1} (<F0 B1> <F1 B0>)^{m-2*p+r+1} "
             "(B1 <F1 B0>)^{p-r-1} (B1 B0)^{(r+1)//2} (I1 I0)^{r+1-(r+1)//2} (W I0)^{p-r-1} W*")


def dualpipev(pp: int, microbatches: int) -> Weave:
    """DualPipeV: V placement; the steady state overlaps a forward of one chunk with a
    backward of the other in one step (``OVERLAP_F_B``)."""
    _need(microbatches >= 2 * pp, f"dualpipev needs microbatches >= 2*pp ({2 * pp}), "
                                  f"got {microbatches}")
    return Weave(pp, microbatches, DUALPIPEV, chunks=2, placement="v")


FAMILIES: dict[str, Callable[..., Weave]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
}
# Families of sequence chunks (a plan's ``seq_chunks`` > 1). Kept apart from ``FAMILIES``,
# whose plans are plain microbatches that every file format carries: a torch CSV says
# nothing of chunks, so theirs read back only with ``--seq-chunks S``.
SEQ_FAMILIES: dict[str, Callable[..., Weave]] = {"seq1f1b": seq1f1b}
FAMILY_NAMES = (*FAMILIES, *SEQ_FAMILIES)  # every name ``family`` takes
# the chunks each family other than interleaved-1f1b always uses (read off its term)
_FIXED_CHUNKS = {name: make(1, 2).chunks for name, make in FAMILIES.items()
                 if name != "interleaved-1f1b"}


def family(name: str, pp: int, microbatches: int, chunks: int | None = None,
           forward_only: bool = False, seq_chunks: int | None = None) -> Weave | ForwardOnly:
    """The family term for ``name``; ``chunks`` only for ``interleaved-1f1b``,
    ``seq_chunks`` only for ``seq1f1b`` (default 2). With ``forward_only``, its evaluation
    run: ``ForwardOnly`` of the term (the same forwards in the same places, no
    backward)."""
    if forward_only:
        return ForwardOnly(family(name, pp, microbatches, chunks, seq_chunks=seq_chunks))
    if name not in FAMILY_NAMES:
        raise ParameterError(f"unknown family {name!r}; expected one of "
                             f"{', '.join(FAMILY_NAMES)}")
    _need(isinstance(pp, int) and pp >= 1, f"pp must be an integer >= 1, got {pp!r}")
    _need(isinstance(microbatches, int) and microbatches >= 1,
          f"microbatches must be an integer >= 1, got {microbatches!r}")
    if name == "interleaved-1f1b":
        return interleaved_1f1b(pp, microbatches, 2 if chunks is None else chunks)
    if name in SEQ_FAMILIES:
        _need(chunks is None or chunks == 1, f"{name} takes no --chunks (it uses 1)")
        return SEQ_FAMILIES[name](pp, microbatches, 2 if seq_chunks is None else seq_chunks)
    _need(chunks is None or chunks == _FIXED_CHUNKS[name],
          f"{name} takes no --chunks (it uses {_FIXED_CHUNKS[name]})")
    _need(seq_chunks is None, f"{name} takes no --seq-chunks (only "
                              f"{', '.join(SEQ_FAMILIES)} does)")
    return FAMILIES[name](pp, microbatches)
