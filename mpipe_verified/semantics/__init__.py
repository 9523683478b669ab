"""The execution semantics of docs/semantics.md §2, shared by lowering, verifier, simulator
and executor, one module per concern, each rule stated once:

- ``rules``: what each op needs and produces on its rank (§2.5), what a transfer carries,
  the collectives a cut requires, and the chain of body and cut (``Chain``);
- ``table``: a plan as integer columns (``op_table``), the flat form the column passes
  read, each rule evaluated once per class of ops;
- ``work``: the work a plan must contain (``required_work``; by columns,
  ``work_complete``) and the collectives its cut requires;
- ``pairing``: FIFO pairing of sends and receives (§2.3) and collective instances (§2.4);
- ``run``: one runner for execution (rendezvous or eager, with durations), the deadlock
  run's ticks, and the data-flow timing of compute-only schedules;
- ``memory``: what each step allocates and frees (§2.6), levels and peaks.

docs/semantics.md ("Index of rules") names the function that states each rule. This
module states the package's public surface; the modules import from one another.
"""

from .memory import (BIG, UNIT_MEMORY, MemoryModel, column_levels, integral, live_tensors,
                     host_peaks, memory_levels, memory_moves, memory_steps, memory_trace,
                     peak_memory, step_effects)
from .pairing import (CollectivePairing, Endpoint, P2PColumns, P2PPairing, collective_instances,
                      p2p_at, p2p_clean, p2p_columns, pair_collectives, pair_p2p)
from .rules import (GRADS, PARAMS, REPLICA, TRANSFER_TOKENS, Chain, Token, collective_segment,
                    collective_tag, consumers_of_output, needs, offloads, payload_token,
                    plan_offloads, produces)
from .run import (COMM_MODELS, EAGER, RENDEZVOUS, STANDARD_DURATIONS, Execution,
                  ScheduleTiming, Wait, comm_ticks, execute, schedule_times, standard_duration,
                  unit_duration, wait_cycle)
from .table import OpTable, op_table
from .work import (MISPLACED, WORK_KINDS, CollectiveIssue, MoveIssue, WorkIssue, WorkTable,
                   collective_issues, move_issues, required_work, unit_ok, work_complete,
                   work_table)

__all__ = [
    # rules
    "Token", "payload_token", "TRANSFER_TOKENS", "PARAMS", "GRADS", "REPLICA", "collective_tag",
    "collective_segment", "needs", "produces", "consumers_of_output", "Chain", "offloads",
    "plan_offloads",
    # table
    "OpTable", "op_table",
    # work
    "WorkIssue", "WORK_KINDS", "MISPLACED", "WorkTable", "work_table", "unit_ok",
    "required_work", "work_complete", "CollectiveIssue", "collective_issues", "MoveIssue",
    "move_issues",
    # pairing
    "Endpoint", "P2PPairing", "p2p_at", "pair_p2p", "CollectivePairing", "pair_collectives",
    "collective_instances", "P2PColumns", "p2p_columns", "p2p_clean",
    # run
    "RENDEZVOUS", "EAGER", "COMM_MODELS", "Wait", "Execution", "unit_duration", "execute",
    "wait_cycle", "comm_ticks", "STANDARD_DURATIONS", "standard_duration", "ScheduleTiming",
    "schedule_times",
    # memory
    "MemoryModel", "UNIT_MEMORY", "memory_steps", "step_effects", "BIG", "memory_moves",
    "integral", "memory_levels", "column_levels", "memory_trace", "live_tensors",
    "peak_memory", "host_peaks",
]
