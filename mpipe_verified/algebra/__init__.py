"""The schedule algebra: terms (``terms``), weave patterns (``pattern``) and the standard
families written as short terms (``families``)."""

from .families import FAMILIES, family
from .terms import DeferW, ForwardOnly, MergeBW, Par, Relabel, Restrict, Seq, SplitBW, Weave
from .transpose import Transpose

__all__ = ["FAMILIES", "family", "Weave", "Seq", "Par", "Restrict", "SplitBW", "MergeBW",
           "DeferW", "Relabel", "ForwardOnly", "Transpose"]
