"""Z3 proofs of the schedule algebra's laws and of the families' invariants (the terms of
``mpipe_verified.algebra.terms``); installed as ``mpipe_verified.proofs``.

Each law (``core.Law``) states one claim over a symbolic model of per-rank sequences
(``model``), names its scope (``all sizes ...`` or ``bounded: ...``) and is proven by Z3
refuting the negation of each of its obligations (``core``). Groups: ``sequences``
(``seq``, ``par``, empty term, ``split_bw``/``merge_bw``), ``relabel`` (microbatch
relabelling), ``lowering`` (``lower`` over ``par``, work conservation), ``safety``
(deadlock freedom under ``par`` and ``seq``), ``families`` (1F1B, GPipe, interleaved 1F1B,
ZB-H1, ZB-H2). ``registry.LAWS`` lists them; ``mpipe-verify laws`` runs them.
"""

from .core import FAILED, PROVED, UNKNOWN, Law, LawResult, check, exit_code
from .registry import BY_NAME, FALSE_LAWS, LAWS, run, select

__all__ = ["LAWS", "FALSE_LAWS", "BY_NAME", "Law", "LawResult", "check", "run", "select",
           "exit_code", "PROVED", "FAILED", "UNKNOWN"]
