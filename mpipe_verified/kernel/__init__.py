"""The verification kernel: the execution semantics read a second time, as rules over one
plan, and the proof obligations those rules generate, discharged by Z3.

Trusted base of a VERIFIED: this package, the reader that built the plan, and Z3. The
kernel imports nothing of the package but the IR's value types (``ir``), so a bug in the
semantics module, the fast passes or the lowering can make a verdict undecided but never
make a wrong plan verified. Its trusted surface is ``__all__``; its modules, each using
only those listed before it:

- ``columns``: exact numbers, one at a time and as integer columns, and row keys;
- ``rules``: the plan read once into columns (``Rules``), each rule an array expression;
- ``inputs``: what the checker is given besides the plan: ``Witness``, ``Sizes``;
- ``obligations``: the five properties' facts, generated from the rules alone;
- ``smt``: facts compressed exactly into affine runs, and Z3 deciding them;
- ``claims``: a claimed counterexample confirmed from the plan alone (``confirm``);
- ``certificates``: the portable certificate, written and read (the reader decides
  nothing);
- ``checker``: ``prove`` (the witness's obligations decided), ``violation`` (the same as
  one formula) and ``recheck`` (a certificate's claim, as read, proved again).

``prove(plan, witness, ...)`` generates every obligation from the plan alone; the
untrusted witness only supplies numbers. ``unsat`` proves a property, ``sat`` names a
violated fact, ``unknown`` is never success.
"""

from .certificates import certificate, digest, read_sizes
from .checker import prove, recheck, violation
from .claims import confirm
from .columns import exact
from .inputs import Sizes, Witness
from .rules import read
from .smt import QUERY_DECLS

__all__ = ["read", "prove", "recheck", "digest", "confirm", "violation", "certificate",
           "read_sizes", "Witness", "Sizes", "exact", "QUERY_DECLS"]
