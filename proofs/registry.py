"""Every law, in report order, and the deliberately false laws that show the harness can
fail. ``run(names)`` checks the named laws (default: ``LAWS``)."""

from __future__ import annotations

from typing import Sequence

from . import (families, family_bidirectional, family_bitpipe, family_dualpipev,
               family_interleaved, family_interleaved_zb, family_looped_bfs, family_seq1f1b,
               family_transpose, family_transpose_inline, family_zb, family_zbv, lowering,
               relabel, safety, sequences)
from .core import DEFAULT_BUDGET, Budget, Law, LawResult, run_all

LAWS: tuple[Law, ...] = (
    # sequences: seq, par, the empty term, split/merge
    sequences.seq_assoc,
    sequences.seq_identity,
    sequences.par_comm,
    sequences.par_assoc,
    sequences.par_identity,
    sequences.par_restrict_partition,
    sequences.seq_par_interchange,
    sequences.split_merge_identity,
    # microbatch relabelling
    relabel.relabel_par,
    relabel.relabel_restrict,
    relabel.relabel_seq,
    relabel.relabel_compose,
    relabel.relabel_split,
    relabel.relabel_merge,
    relabel.relabel_weave,
    # lowering
    lowering.lower_par,
    lowering.lower_work_conservation,
    # safety composition
    safety.par_deadlock_free,
    safety.seq_deadlock_free,
    # family invariants: one law per (family, property)
    families.gpipe_completeness,
    families.gpipe_dependency,
    families.gpipe_memory,
    families.gpipe_matching,
    families.gpipe_deadlock,
    families.one_f_one_b_completeness,
    families.one_f_one_b_dependency,
    families.one_f_one_b_peak_memory,
    families.one_f_one_b_matching,
    families.one_f_one_b_deadlock,
    families.closed_forms_match_package,
    family_interleaved.interleaved_completeness,
    family_interleaved.interleaved_dependency,
    family_interleaved.interleaved_memory,
    family_interleaved.interleaved_matching,
    family_interleaved.interleaved_deadlock,
    family_interleaved.interleaved_short_last_round,
    family_zb.zb_h1_completeness,
    family_zb.zb_h1_dependency,
    family_zb.zb_h1_memory,
    family_zb.zb_h1_matching,
    family_zb.zb_h1_deadlock,
    family_zb.zb_h1_few_microbatches,
    family_zb.zb_h2_completeness,
    family_zb.zb_h2_dependency,
    family_zb.zb_h2_memory,
    family_zb.zb_h2_matching,
    family_zb.zb_h2_deadlock,
    family_zb.zb_h2_few_microbatches,
    # family invariants: ZBV, DualPipeV, transpose (one law per property)
    family_zbv.zbv_completeness,
    family_zbv.zbv_dependency,
    family_zbv.zbv_matching,
    family_zbv.zbv_deadlock,
    family_zbv.zbv_peak_memory,
    family_dualpipev.dualpipev_completeness,
    family_dualpipev.dualpipev_dependency,
    family_dualpipev.dualpipev_matching,
    family_dualpipev.dualpipev_deadlock,
    family_dualpipev.dualpipev_peak_memory,
    family_transpose.transpose_completeness,
    family_transpose.transpose_dependency,
    family_transpose.transpose_matching,
    family_transpose.transpose_deadlock,
    family_transpose.transpose_peak_memory,
    # transpose, inline ownership over a 1F1B body: all sizes
    family_transpose_inline.transpose_inline_completeness,
    family_transpose_inline.transpose_inline_dependency,
    family_transpose_inline.transpose_inline_matching,
    family_transpose_inline.transpose_inline_deadlock,
    family_transpose_inline.transpose_inline_memory,
    # two pipelines over one model (DualPipe, Chimera): all sizes, by the twin reduction
    family_bidirectional.dualpipe_completeness,
    family_bidirectional.dualpipe_dependency,
    family_bidirectional.dualpipe_matching,
    family_bidirectional.dualpipe_deadlock,
    family_bidirectional.dualpipe_memory,
    family_bidirectional.chimera_completeness,
    family_bidirectional.chimera_dependency,
    family_bidirectional.chimera_matching,
    family_bidirectional.chimera_deadlock,
    family_bidirectional.chimera_memory,
    family_bidirectional.replica_tail,
    # BitPipe: bounded
    family_bitpipe.bitpipe_completeness,
    family_bitpipe.bitpipe_dependency,
    family_bitpipe.bitpipe_matching,
    family_bitpipe.bitpipe_deadlock,
    family_bitpipe.bitpipe_memory,
    # looped BFS and interleaved zero bubble: all sizes (interleaved ZB's rest bounded)
    family_looped_bfs.looped_bfs_completeness,
    family_looped_bfs.looped_bfs_dependency,
    family_looped_bfs.looped_bfs_matching,
    family_looped_bfs.looped_bfs_deadlock,
    family_looped_bfs.looped_bfs_memory,
    family_interleaved_zb.interleaved_zb_completeness,
    family_interleaved_zb.interleaved_zb_dependency,
    family_interleaved_zb.interleaved_zb_matching,
    family_interleaved_zb.interleaved_zb_deadlock,
    family_interleaved_zb.interleaved_zb_memory,
    family_interleaved_zb.interleaved_zb_outside_region,
    # seq1f1b (sequence chunks): bounded
    family_seq1f1b.seq1f1b_completeness,
    family_seq1f1b.seq1f1b_dependency,
    family_seq1f1b.seq1f1b_matching,
    family_seq1f1b.seq1f1b_deadlock,
    family_seq1f1b.seq1f1b_peak_memory,
)

# Stated on purpose wrongly: each must come out ``failed`` (with Z3's counterexample).
FALSE_LAWS: tuple[Law, ...] = (
    safety.false_par_exchanging,
    safety.false_seq_unshifted,
)

BY_NAME: dict[str, Law] = {law.name: law for law in LAWS + FALSE_LAWS}


def select(names: Sequence[str] | None = None) -> list[Law]:
    """The named laws (``LAWS`` when ``names`` is empty); ``KeyError`` names an unknown
    one."""
    if not names:
        return list(LAWS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise KeyError(unknown[0])
    return [BY_NAME[n] for n in names]


def run(names: Sequence[str] | None = None, budget: Budget = DEFAULT_BUDGET,
        jobs: int | None = None) -> list[LawResult]:
    """Check the named laws (``select``) within ``budget``, each in a fresh process
    (``core.run_all``)."""
    return run_all(select(names), budget, jobs)
