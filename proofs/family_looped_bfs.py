"""Looped BFS (``algebra.families.looped_bfs``, torch's ``ScheduleLoopedBFS``): every
forward of a rank's chunk 0, then of chunk 1, ...; then the backwards, chunks descending,
microbatches descending.

**Bounded** (``proofs.instances.chunked_family_laws``): every property of the package's
derived and lowered plans for ``p <= P_MAX``, ``m <= M_MAX``, chunks 2 and 3, checked by
the verification kernel's obligations. The unit-model peak is ``v m`` on every rank
(every forward is stored before the first backward). All sizes would need a closed form
of the order across chunks (a chunk's forwards on rank 0 wait for the previous chunk's
to leave rank ``p - 1`` when ``m < p``); it is not derived here.
"""

from __future__ import annotations

from .instances import chunked_family_laws

P_MAX, M_MAX, CHUNKS = 4, 8, (2, 3)


def peak(p: int, m: int, v: int, r: int) -> int:
    return v * m


(looped_bfs_completeness, looped_bfs_dependency, looped_bfs_matching, looped_bfs_deadlock,
 looped_bfs_memory) = chunked_family_laws("looped-bfs", "looped BFS", peak, "v m", P_MAX,
                                          M_MAX, CHUNKS)
