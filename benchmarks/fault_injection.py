"""Fault injection: a VERIFIED comes only from the verification kernel, about the plan
the user asked about.

    python benchmarks/fault_injection.py [--faults NAME...] [--jobs J] [--list]

Each *fault* is one plausible bug: an exact source edit (``old`` -> ``new``, which must
occur exactly once, so the benchmark fails loudly when the code moves) outside the
trusted base. Two groups, each with its own table:

- the semantics, the passes, the hand-over and the lowering's order (``PASS_FAULTS``):
  the shared semantics (``semantics/``: needs/produces, the cut rules, the sequence-chunk
  order, required
  collectives, completeness counting, FIFO and collective pairing, execution, memory
  accounting), the fast passes and their hints (``verify/passes.py``), how findings
  and hints reach the kernel (``verify/__init__.py``) and the lowering's transfers
  (``lower.py``);
- the shell around the kernel (``SHELL_FAULTS``, ``shell_faults=N``): what the question
  is and how the verdict is assembled: the per-rank limits as the passes use them, the
  memory sizes the passes sum (``semantics.MemoryModel``, ``verify._passes_memory``), the
  spec's cost model (``cost.py``: the defaults a spec's ``CostModel`` value takes, and the
  simulator's own sizes), the plan judged (``lower.py`` and its ``as_plan``,
  ``declared.py``, ``cli.targets.as_read`` and the target ``cli.verdicts`` checks,
  ``simulate``'s in ``comparison.py``), the limit ``check`` and ``simulate`` hand over
  (``cli.targets.model_of``,
  ``comparison.time_spec``), the verdict assembly (``verify/__init__.py``: ``_asked``,
  ``_report``, ``_Judge``, ``_witness``), and the canonical text of ``ir.py``
  (``_canonical_row``, ``_canonical``: ``CANONICAL``). The canonical text makes only the
  plan's digest, which ``check`` compares with nothing, so its faults change output but
  can change no verdict; they are counted with the shell's.

Left out on purpose, as the trusted base: ``kernel/``; ``question.py`` (the question
formed from the user's words, the check that the plan judged is the question's, and the
verdict from the kernel's answers); the plan readers (``formats/plan_json.py``,
``formats/torch_csv.py`` with ``torch_csv_fast.py`` and ``torch_actions.py``, and
``formats/spec.py``'s reading of the TOML into a ``Spec`` and ``CostModel`` value, with
``spec.py``'s expression language); the IR itself (but for its canonical text). Also
left out: the plumbing that prints the verdict's status (``verify/report.py``'s
``Report.status`` and ``exit_code``, ``cli.main``'s return), and the CLI's argument
definitions (what ``--memory-limit``, ``--comm-model`` and ``--stages`` mean): they are
the statement, not a judgement of it.

The *corpus* (``build_corpus``) is written into a temporary directory from a fixed seed:
broken plans, each rejected by the pristine package (asserted: exit 1 from ``check``),
as plan-json files (transpose plans of every mode, source and sink, bodies 1f1b and
interleaved-1f1b on 2 and 4 ranks; plans with groups and collectives; plain family
plans; plans of sequence chunks out of chunk order, read with ``--seq-chunks``), torch
CSVs and specs, spanning all five properties (memory through a
``--memory-limit`` below the plan's peak), plus the collective false accepts of
``tests/fixtures/false_accept_*.json``; for the shell (``shell_entries``): compute-only
files that ``check`` lowers, with a repeated, missing or stuck compute, FSDP markers, or
declared forward-only; files complete on their own terms but not for the sizes declared
with ``--stages``/``--microbatches``/``--ranks`` (lowered and as written), a spec
declaring more microbatches than its term derives; transpose specs whose memory sizes
are their cost tables' defaults, each with one rank's ``[memory] limit`` just below its
peak; and ``simulate`` (which verifies before it times) on such specs and on a broken
CSV; and a few valid plans (pristine: exit 0), among them compute-only and declared
ones and two ``simulate`` runs.

For each fault: the ``mpipe_verified`` package is copied into a temporary directory, the
edit applied, and one subprocess (``sys.executable``, ``PYTHONPATH`` at the copy; it
asserts ``mpipe_verified.__file__`` lies in the copy) runs ``mpipe_verified.cli.main``
(``check --json``, or the entry's ``simulate --json``) on every entry, output captured,
recording each exit code. Per
(fault, broken plan): exit 0 is *false_verified*, 1 *caught_violated*, 3
*caught_undecided*, anything else (2, a crash, a timeout) an *error*, listed with the
first line of its stderr (for a crash, the exception's last line). Per fault the table
also shows *changed*, the broken plans whose exit code is not the pristine 1,
*unaided*, those on which the faulty passes found no violation at all, so that only the
kernel's refusal of their witness, or the question's refusal of the plan judged, kept
the answer from VERIFIED (a property whose pass found nothing is one the kernel was
asked to prove: only then does its report list ``facts``), the valid plans judged 1
(``valid:rej``, false_rejected) or 3 (``valid:und``, undecided on valid input), and
*output*, the entries (broken or valid) whose exit code or JSON document (timings
aside) differs from the pristine run's: a fault with output 0 did nothing this corpus
can see. The line before the last is ``shell_faults=N shell_false_verified=F`` over
the shell's faults; the last is exactly ``faults=N false_verified=F caught_violated=A
caught_undecided=U`` over all (fault, broken plan) pairs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import attrs  # noqa: E402

import strategies as S  # noqa: E402
from mpipe_verified.algebra.families import family  # noqa: E402
from mpipe_verified.algebra.terms import ForwardOnly, Offloaded, Weave  # noqa: E402
from mpipe_verified.algebra.transpose import transpose_family  # noqa: E402
from mpipe_verified.formats.plan_json import read_plan_json, write_plan_json  # noqa: E402
from mpipe_verified.formats.ranges import beyond  # noqa: E402
from mpipe_verified.formats.torch_csv import format_torch_csv, write_torch_csv  # noqa: E402
from mpipe_verified.ir import (LEND, RETURN, Collective, Compute, Group,  # noqa: E402
                               Marker, Offload, Overlap, Payload, Placement, Plan, Recv,
                               Reload, Schedule, Send)
from mpipe_verified.lower import lower  # noqa: E402
from mpipe_verified.semantics import peak_memory  # noqa: E402
from mpipe_verified.verify import PROPERTIES, verify  # noqa: E402

PACKAGE = os.path.join(ROOT, "mpipe_verified")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SEED = "fault-injection-1"
ENTRY_SECONDS = 60  # per check inside a driver: a fault that hangs is an error, not a hang


class Fault(NamedTuple):
    name: str
    path: str  # relative to the package
    old: str
    new: str
    description: str


RULES, TABLE, WORK, PAIRING, RUN, MEMORY = (f"semantics/{name}.py" for name in (
    "rules", "table", "work", "pairing", "run", "memory"))
PASSES, VERIFY, LOWER = "verify/passes.py", "verify/__init__.py", "lower.py"

PASS_FAULTS = (
    # ---- needs / produces (semantics.needs, Chain.needs)
    Fault("w_without_i", RULES,
          'return (("wgrad_ready", seg, s, mb),)\n        if op.kind == RECOMPUTE',
          'return ()\n        if op.kind == RECOMPUTE',
          "W no longer needs its I"),
    Fault("forward_off_by_one", RULES,
          'return (("out", seg, s - 1, mb),) if s > 0 else ()',
          'return (("out", seg, s - 1, mb),) if s > 1 else ()',
          "the forward of stage 1 does not need stage 0's activation"),
    Fault("backward_without_grad", RULES,
          "        if s < num_stages - 1:\n",
          "        if s < num_stages - 2:\n",
          "the backward of the second-to-last stage does not need the last stage's gradient"),
    Fault("last_backward_without_stored", RULES,
          '        return (("stored", seg, s, mb),)\n    if kind is Send:',
          '        return ()\n    if kind is Send:',
          "the last stage's backward does not need its stored forward"),
    Fault("recompute_without_input", RULES,
          'return (("input", seg, s, mb),)',
          "return ()",
          "a recompute does not need its shipped input"),
    Fault("send_needs_nothing", RULES,
          "    if kind is Send:\n        return (sent_token(op.payload),)",
          "    if kind is Send:\n        return ()",
          "a send does not need the value it sends"),
    Fault("group_needs_first_member", RULES,
          "        if kind is Overlap or kind is Group:\n"
          "            ops = op.ops\n"
          "            if len(ops) == 2:  # the common overlapped pair\n"
          "                return self.needs(ops[0], rank) + self.needs(ops[1], rank)\n"
          "            return sum([self.needs(c, rank) for c in ops], ())",
          "        if kind is Overlap or kind is Group:\n"
          "            return self.needs(op.ops[0], rank)",
          "an overlap's or group's needs are taken from its first member only"),
    # ---- the sequence-chunk rules (Chain.needs, Chain.produces, the table's classes)
    Fault("chunk_forward_needs_nothing", RULES,
          "if c.kind == FORWARD and j > 0:",
          "if c.kind == FORWARD and j > 1:",
          "the forward of a sample's second chunk does not need the first chunk's"),
    Fault("chunk_backward_needs_nothing", RULES,
          "if (c.kind == BACKWARD or c.kind == INPUT_GRAD) and j < last:",
          "if (c.kind == BACKWARD or c.kind == INPUT_GRAD) and j < last - 1:",
          "the backward of a sample's second-to-last chunk does not need the last chunk's"),
    Fault("kv_grad_made_by_any_compute", RULES,
          "            elif c.kind == BACKWARD or c.kind == INPUT_GRAD:\n"
          '                base += (("kv_grad"',
          "            if True:\n"
          '                base += (("kv_grad"',
          "every compute (a forward too) stands for its chunk's backward"),
    Fault("chunk_classes_merged", TABLE,
          "    if chunks == 1 or not len(cls):",
          "    if True:",
          "the column form classes a sample's chunks together (first, last and middle)"),
    Fault("body_forward_without_encoder", RULES,
          'base += tuple(("out", src.name, 0, op.mb) for src in self._sources)',
          "base += ()",
          "the body's first forward does not need the encoder output"),
    Fault("params_not_needed_off_home", RULES,
          'extra = (("params", seg.name, 0, 0),)',
          "extra = ()",
          "a segment's forward off its home rank does not need the broadcast parameters"),
    Fault("sink_without_body_output", RULES,
          "return extra + ((body_out,) if seg.side == SINK else ()) + added",
          "return extra + added",
          "a sink's forward does not need the body's last output"),
    Fault("source_backward_without_body_grad", RULES,
          'return ((stored, ("grad", BODY, 0, op.mb)) if seg.side == SOURCE',
          'return ((stored,) if seg.side == SOURCE',
          "a source segment's backward does not need the body's gradient"),
    Fault("all_reduce_without_wgrads", RULES,
          "        if kind is Collective:\n            return self._collective_needs(op, rank)",
          "        if kind is Collective:\n            return ()",
          "the all-reduce does not need the local weight gradients"),
    # ---- completeness (work_table, unit_ok, required_work, collectives)
    Fault("repeat_counted_once", WORK,
          "row[column[c.kind]] += 1",
          "row[column[c.kind]] = 1",
          "a repeated op is counted once"),
    Fault("mixed_backward_allowed", WORK,
          "back = (b, i, w) in ((1, 0, 0), (0, 1, 1)) if need_backward",
          "back = (b == 1 or (i, w) == (1, 1)) if need_backward",
          "a unit with both B and I/W counts as complete"),
    Fault("misplaced_ignored", WORK,
          "return f == 1 and back and r == int(need_recompute) and wrong == 0",
          "return f == 1 and back and r == int(need_recompute)",
          "work on the wrong rank is not a completeness issue"),
    Fault("stray_ignored", WORK,
          "for c, rank, index in table.stray]",
          "for c, rank, index in table.stray[:0]]",
          "ops outside the chain's stages or microbatches are not reported"),
    Fault("recompute_not_required", RULES,
          "return seg.trainable, seg.needs_recompute(mb)",
          "return seg.trainable, False",
          "a due recompute is not required"),
    Fault("all_reduce_not_required", RULES,
          "            if back - {seg.home}:\n",
          "            if False:\n",
          "the required all-reduce of a segment's gradients is not required"),
    Fault("tagged_root_unchecked", WORK,
          "if op.kind != kind or op.root != root:",
          "if op.kind != kind:",
          "a required collective's root is not checked"),
    Fault("tagged_members_unchecked", WORK,
          "left_out = sorted(ranks - set(op.ranks))",
          "left_out = []",
          "a required collective may leave out ranks that must take part"),
    Fault("collective_once_unchecked", WORK,
          "elif len(where) > 1:",
          "elif len(where) > 2:",
          "a required collective called twice on a rank is accepted"),
    # ---- matching (pair_p2p, pair_collectives, _malformed)
    Fault("group_members_reversed", PAIRING,
          "                for member, c in enumerate(op.ops):",
          "                for member, c in reversed(list(enumerate(op.ops))):",
          "a group's members are paired in reverse order"),
    Fault("recv_paired_by_payload", PAIRING,
          "    s_end, r_end = fifo_pairs(channel, send)\n",
          "    s_end, r_end = fifo_pairs(channel, send)\n"
          "    r_end = np.array(sorted(r_end.tolist(), key=lambda e: (channel[e], next((\n"
          "        k for k, s in enumerate(s_end.tolist()) if channel[s] == channel[e] and\n"
          "        ops[s].payload == ops[e].payload), len(s_end)))), dtype=np.int64)\n",
          "receives are paired with the send of the same payload, not in FIFO order"),
    Fault("unmatched_recv_unreported", PAIRING,
          "    lonely[s_end] = lonely[r_end] = False\n",
          "    lonely[s_end] = lonely[r_end] = False\n    lonely &= send\n",
          "an unmatched receive is not reported"),
    Fault("unmatched_send_unreported", PAIRING,
          "    lonely[s_end] = lonely[r_end] = False\n",
          "    lonely[s_end] = lonely[r_end] = False\n    lonely &= ~send\n",
          "an unmatched send is not reported"),
    Fault("mismatch_mb_ignored", PAIRING,
          "if sent is not received and sent != received]",
          "if sent is not received and (sent.kind, sent.stage) != "
          "(received.kind, received.stage)]",
          "a mismatched payload (another microbatch) is not reported"),
    Fault("collective_disagreement_unchecked", PAIRING,
          "elif (ops[r].kind, ops[r].tag, ops[r].root) != (ref.kind, ref.tag, ref.root):",
          "elif ops[r].tag != ref.tag:",
          "members calling a collective with another kind or root are not reported"),
    Fault("collective_last_member_unchecked", PAIRING,
          "        for r in group:\n            if r not in ops:",
          "        for r in group[:-1]:\n            if r not in ops:",
          "a collective's last member is not checked (missing, or calling another one)"),
    Fault("malformed_root_unchecked", PAIRING,
          'if op.kind != "all_reduce" and op.root not in op.ranks:',
          'if op.kind != "all_reduce" and op.root is None:',
          "a broadcast rooted outside its members is well formed"),
    # ---- execution (execute, _comm_completion)
    Fault("rendezvous_send_buffered", RUN,
          "FREE if eager and kind is Send else",
          "FREE if kind is Send else",
          "a send completes without its receive under rendezvous"),
    Fault("group_send_buffered", RUN,
          "if eager and isinstance(c, Send):",
          "if isinstance(c, Send):",
          "a group's send completes without its receive under rendezvous"),
    Fault("collective_without_all_members", RUN,
          "if r in where else NEVER for r in key[0]]",
          "if r in where else NEVER for r in key[0][:1]]",
          "a collective completes without all members having reached it"),
    Fault("meeting_at_own_post", RUN,
          "                if seen > t:\n                    t = seen\n            elif",
          "            elif",
          "a send or receive completes at its own post time, not its partner's"),
    Fault("group_meeting_at_own_post", RUN,
          "        if seen > t:\n            t = seen\n    return FREE, t",
          "    return FREE, t",
          "a group or collective completes at its own post time, not its partners'"),
    # ---- the column forms (comm_ticks, p2p_columns, work_complete; plans with a table)
    Fault("column_send_buffered", RUN,
          "    if comm_model == EAGER:\n        wait[place[:k]] = np.where(pairs.send, FREE,",
          "    if True:\n        wait[place[:k]] = np.where(pairs.send, FREE,",
          "the column run lets a send complete without its receive under rendezvous"),
    Fault("column_channel_reversed", PAIRING,
          "channel_keys(table.rank[rows], peers[cls], send)",
          "channel_keys(table.rank[rows], peers[cls], np.ones_like(send))",
          "the column pairing keys a receive by (its rank, its source): the reversed channel"),
    Fault("column_repeat_counted_once", WORK,
          "np.add.at(rows, (at.reshape(-1), kind), 1)",
          "rows[at.reshape(-1), kind] = 1",
          "the column completeness counts a repeated op once"),
    Fault("column_limit_off_by_one", PASSES,
          "if limits is not None and peak > limits[rank]:",
          "if limits is not None and peak > limits[rank] + 1:",
          "the column memory pass lets a peak one over the limit through"),
    # ---- memory (memory_steps, memory_levels, passes.memory)
    Fault("split_freed_at_i", MEMORY,
          "elif c.kind in (BACKWARD, WEIGHT_GRAD):",
          "elif c.kind in (BACKWARD, \"I\"):",  # INPUT_GRAD's letter: not imported there
          "a split backward frees its activation at I instead of W"),
    Fault("recv_buffers_not_allocated", MEMORY,
          "size = buffer(r.payload)",
          "size = 0",
          "receive buffers are never allocated"),
    Fault("activation_size_of_stage_0", MEMORY,
          "size = stored(c.stage, c.segment)",
          "size = stored(0, c.segment)",
          "every stage's activation is sized as stage 0's"),
    Fault("memory_level_not_carried", MEMORY,
          "        level = after\n",
          "        level = static if exact is None else exact(static)\n",
          "the memory level is not carried from step to step"),
    Fault("static_memory_dropped", MEMORY,
          "    level = static if exact is None else exact(static)\n",
          "    level = 0\n",
          "the static memory part is dropped"),
    Fault("frees_before_allocations", PASSES,
          "if peak is None or level + a > peak:",
          "if peak is None or level + a - f > peak:",
          "a step's frees count before its allocations"),
    # ---- the passes and their hints (passes)
    Fault("dependency_skips_last_rank", PASSES,
          "    for rank, program in enumerate(plan.programs):\n        have: dict = {}",
          "    for rank, program in enumerate(plan.programs[:-1]):\n        have: dict = {}",
          "the dependency pass skips the last rank"),
    Fault("produced_before_needed", PASSES,
          "            for token in sorted(chain.needs(op, rank)):\n",
          "            for token in produces(op):\n"
          "                have.setdefault(token, index)\n"
          "            for token in sorted(chain.needs(op, rank)):\n",
          "an op's outputs count as present for its own inputs"),
    Fault("stuck_without_cycle_completes", PASSES,
          "    if not run.completed:\n",
          "    if not run.completed and wait_cycle(run):\n",
          "a run stuck only on missing partners is reported as complete"),
    # ---- how findings and hints reach the kernel (verify/__init__)
    Fault("witness_fields_swapped", VERIFY,
          'return kernel.Witness(hints.get("deadlock"), hints.get("dependency"), levels',
          'return kernel.Witness(hints.get("dependency"), hints.get("deadlock"), levels',
          "the deadlock and dependency hints are handed to the kernel swapped"),
    Fault("hints_not_handed_over", VERIFY,
          "_witness({name: self.hints[name]})",
          "_witness({})",
          "the passes' hints are not handed to the kernel"),
    Fault("deadlock_hint_under_eager", VERIFY,
          "passes.deadlock(plan, comm_model, pairing,",
          'passes.deadlock(plan, "eager", pairing,',
          "the deadlock pass runs under eager whatever the comm model"),
    Fault("memory_pass_without_limit", VERIFY,
          "asked.limits, table)",
          "None, table)",
          "the memory pass is not given the memory limit"),
    # ---- lowering (spec and family inputs)
    Fault("lower_transfers_after_computes", LOWER,
          "moved.append(((finishes[index], 0, _send_first(payload)",
          "moved.append(((finishes[index], 2, _send_first(payload)",
          "lowering places a transfer after the computes that start when it is produced"),
    Fault("lower_first_destination_only", LOWER,
          "enumerate(chain.destinations(c, rank)):",
          "enumerate(chain.destinations(c, rank)[:1]):",
          "lowering serves only the first destination of each op"),
    # ---- the column forms' inputs (payload comparison, frees, the op classes)
    Fault("column_payloads_unchecked", PAIRING,
          "    if not (np.array_equal(sig[table.cls[s_rows]], sig[table.cls[r_rows]])\n"
          "            and np.array_equal(table.mb[s_rows], table.mb[r_rows])):\n"
          "        return False\n",
          "",
          "the column pairing calls every paired transfer's payloads equal"),
    Fault("received_twice_ignored", PAIRING,
          "            if key in seen:\n                out.append(end)",
          "            if key in seen and False:\n                out.append(end)",
          "a rank's second receive of a token it received before is not reported"),
    Fault("column_received_twice_ignored", PAIRING,
          "        return not (key[1:] == key[:-1]).any()",
          "        return True",
          "the column pairing calls a token received twice on a rank clean"),
    Fault("column_free_of_any_key", MEMORY,
          "lifetimes(free, (table.rank[rows], name, mb), (rows, free))",
          "lifetimes(free, (table.rank[rows], mb), (rows, free))",
          "the column memory pass lets a free release another key's allocation"),
    Fault("table_class_last_is_first", TABLE,
          "op(a), op(b)) for a, b in zip",
          "op(a), op(a)) for a, b in zip",
          "the op table names each class's first op as its last (no check that they agree)"),
    Fault("cell_classes_without_stage", TABLE,
          "np.where(kind >= 0, stage, 0)",
          "np.where(kind >= 0, 0, 0)",
          "the op classes of a torch CSV's cells ignore the stage (ops of two stages share "
          "a class)"),
    # ---- activation moves (docs/semantics.md §2.10)
    Fault("backward_without_reload", RULES,
          'for t in ("reloaded", "returned")',
          'for t in ()',
          "a backward of an offloaded or lent activation does not need it back"),
    Fault("reload_needs_nothing", RULES,
          'return (("offloaded", op.segment, op.stage, op.mb),)',
          "return ()",
          "a reload does not need its offload"),
    Fault("offload_needs_nothing", RULES,
          '        return (("stored", op.segment, op.stage, op.mb),)\n    if kind is Reload:',
          '        return ()\n    if kind is Reload:',
          "an offload does not need the stored activation"),
    Fault("return_needs_nothing", RULES,
          '{LEND: "stored", RETURN: "held"}',
          '{LEND: "stored", RETURN: "out"}',
          "a return's send needs the forward's output, not the lent activation held"),
    Fault("moves_uncounted", WORK,
          "if off > 1 or rel != off:",
          "if False:",
          "offloads without their reload (or repeated) are not counted as incomplete"),
    Fault("lends_uncounted", WORK,
          "if lent > 1 or back != lent or gave != held:",
          "if False:",
          "lends without their return are not counted as incomplete"),
    Fault("reload_allocates_nothing", MEMORY,
          'return [(key, ("reloaded activation of", op, stored(op.stage, op.segment)))], []',
          "return [], []",
          "a reload puts nothing back on the device"),
    Fault("holder_keeps_nothing", MEMORY,
          'allocs.append((key, ("moved activation of", r, stored(p.stage, p.segment))))',
          "pass",
          "a lent (or returned) activation takes no memory on the rank that receives it"),
    Fault("table_keeps_lends", TABLE,
          "                if p.kind in RANK_MOVES:\n                    return None  # a lent "
          "activation's backward needs more than its class",
          "",
          "plans with rank moves get an op table (a lent backward's need read from its class)"),
    # ---- several pipelines (docs/semantics.md §2.9)
    Fault("pipeline_second_stage_needs_nothing", RULES,
          "if op.kind == FORWARD and at == 0:",
          "if op.kind == FORWARD and at <= 1:",
          "the forward of a pipeline's second stage needs no activation either"),
    Fault("pipeline_last_two_backwards_without_grad", RULES,
          "if op.kind in (BACKWARD, INPUT_GRAD) and at == self.per_pipeline - 1:",
          "if op.kind in (BACKWARD, INPUT_GRAD) and at >= self.per_pipeline - 2:",
          "the backward of a pipeline's second-to-last stage needs no gradient"),
    Fault("replica_sum_without_wgrads", RULES,
          "if not name.isdigit() or int(name) not in self.replica_ranks():",
          "if True:",
          "the replica all-reduce does not need the local weight gradients"),
    Fault("replica_sum_not_required", RULES,
          "        for j, ranks in self.replica_ranks().items():\n",
          "        for j, ranks in ():\n",
          "no replica all-reduce is required"),
    Fault("other_pipelines_work_counted", RULES,
          "return not self.pipelines or (self._pipe_of_mb.get(mb, -1)",
          "return True or (self._pipe_of_mb.get(mb, -1)",
          "a stage owes the work of every microbatch, of any pipeline"),
    Fault("cross_pipeline_transfer_unreported", PASSES,
          "if chain.crosses(op.payload):",
          "if False:",
          "a transfer out of its pipeline is not reported"),
    Fault("lower_without_replica_sums", LOWER,
          "    _append_replica_sums(out, chain)\n    return Plan(",
          "    return Plan(",
          "the lowering appends no replica all-reduce"),
)
# ---- the shell around the kernel: what the question is, and how the verdict is assembled
# (the per-rank limits, the memory sizes, the lowering and the declarations that make the
# plan judged, the verdict assembly, the spec's cost model, the CLI's choice of the plan,
# the canonical text). question.py itself, kernel/, the readers and the IR stay trusted.
DECLARED, COST, COMPARISON, IR = ("declared.py", "cost.py", "comparison.py", "ir.py")
CLI_TARGETS, CLI_VERDICTS = "cli/targets.py", "cli/verdicts.py"

SHELL_FAULTS = (
    # ---- the per-rank limits, as the passes use them
    Fault("limit_of_rank_0_for_all", PASSES,
          "if limits is not None and peak > _exact(limits[rank], exact):",
          "if limits is not None and peak > _exact(limits[0], exact):",
          "the step-by-step memory pass compares every rank with rank 0's limit"),
    Fault("column_pass_without_limit", PASSES,
          "fast = None if table is None else _levels(table, model, limits)",
          "fast = None if table is None else _levels(table, model, None)",
          "the column memory pass is not given the limits (a plan over them is summed "
          "by columns and reported within)"),
    # ---- the memory sizes the passes sum (semantics' models, verify._passes_memory)
    Fault("unit_activation_half", MEMORY,
          "stored: Callable[[int, str], float] = lambda stage, segment: 1.0",
          "stored: Callable[[int, str], float] = lambda stage, segment: 0.5",
          "the unit model's stored activation is half a unit"),
    Fault("static_of_last_rank_dropped", MEMORY,
          "return self.static[rank] if rank < len(self.static) else 0.0",
          "return self.static[rank] if rank + 1 < len(self.static) else 0.0",
          "a memory model gives the last rank no static part"),
    Fault("received_without_buffer", MEMORY,
          "return self.buffer(payload) + (self.rng_state if payload.kind == INPUT else 0.0)",
          "return self.rng_state if payload.kind == INPUT else 0.0",
          "a receive buffer counts only the RNG state, not the payload"),
    Fault("passes_stored_key_swapped", VERIFY,
          "stored.get((segment, stage), 1.0)",
          "stored.get((stage, segment), 1.0)",
          "the passes look a spec's activation sizes up by (stage, segment): every one 1"),
    Fault("passes_static_dropped", VERIFY,
          "static=sizes.static, **kw)",
          "**kw)",
          "the passes sum a spec's sizes without the static parts"),
    Fault("passes_buffers_free", VERIFY,
          'kw = {"buffer": lambda p: buffer.get(p, 0.0)} if buffer else {}',
          "kw = {}",
          "the passes sum a spec's sizes with every receive buffer free"),
    # ---- the spec's cost model (cost.py): the defaults a spec's CostModel value takes, and
    # the simulator's own sizes (no longer what check sums)
    Fault("cost_activation_default_free", COST,
          "activation: float | tuple[float, ...] = 1.0",
          "activation: float | tuple[float, ...] = 0.0",
          "a spec's body activation defaults to 0, not 1, when [cost] does not give it"),
    Fault("segment_activation_default_free", COST,
          "    activation: float = 1.0\n    output: float = 0.0",
          "    activation: float = 0.0\n    output: float = 0.0",
          "a segment's activation defaults to 0, not 1"),
    Fault("segment_replica_default_free", COST,
          "replica: float | None = None",
          "replica: float | None = 0.0",
          "a segment's forward-only copy defaults to free, not to its static size"),
    Fault("sim_stored_ignores_segment", COST,
          "            return self.segment(segment).activation",
          "            return _at(self.activation, stage)",
          "the simulator sizes a segment's activation as the body's"),
    Fault("sim_static_without_segments", COST,
          "                    out[r] += cost.static",
          "                    out[r] += 0.0",
          "the simulator's static memory leaves out the segments' copies"),
    Fault("sim_memory_model_without_static", COST,
          "static=self.static_memory(cut, num_ranks))",
          "static=())",
          "the simulator's memory model drops the static parts"),
    # ---- the lowering (lower.py, its as_plan): the plan judged
    Fault("lower_drops_repeats", LOWER,
          "out.append([event[6] for event in mine])",
          "out.append(list(dict.fromkeys(event[6] for event in mine)))",
          "lowering drops a repeated op (a duplicated forward, a second identical send)"),
    Fault("lower_drops_last_op", LOWER,
          "        for index in range(len(starts)):",
          "        for index in range(len(starts) - 1):",
          "lowering leaves out each rank's last timed op"),
    Fault("lower_stuck_repeats_last_run", LOWER,
          "for index in range(len(timing.start[rank]), len(program)):\n"
          "            if isinstance(program[index], Idle):",
          "for index in range(len(timing.start[rank]) - 1, len(program)):\n"
          "            if isinstance(program[index], Idle):",
          "lowering a stuck schedule appends each rank's last op that ran once more"),
    Fault("lower_stuck_reversed", LOWER,
          "for index in range(len(timing.start[rank]), len(program)):\n"
          "            if isinstance(program[index], Idle):",
          "for index in reversed(range(len(timing.start[rank]), len(program))):\n"
          "            if isinstance(program[index], Idle):",
          "lowering a stuck schedule appends the ops after the stuck point in reverse"),
    Fault("lower_keeps_computes_only", LOWER,
          "            if type(op) is Idle:\n                continue",
          "            if not computes_of(op):\n                continue",
          "lowering drops every step without compute (markers and collectives too)"),
    Fault("lower_compute_at_finish", LOWER,
          "mine((starts[index], 1, _NO_TIE, rank, index, 0, op))",
          "mine((finishes[index], 1, _NO_TIE, rank, index, 0, op))",
          "lowering places each compute at its finish time (after its own sends)"),
    Fault("lower_without_forward_only", LOWER,
          "schedule.cut,\n                schedule.forward_only)",
          "schedule.cut)",
          "the lowered plan loses the forward-only declaration"),
    Fault("lower_without_cut", LOWER,
          "tuple(map(tuple, out)), schedule.cut,\n                schedule.forward_only)",
          "tuple(map(tuple, out)),\n                forward_only=schedule.forward_only)",
          "the lowered plan loses the cut (its segments)"),
    Fault("lower_microbatches_from_ops", LOWER,
          "return Plan(placement, schedule.num_microbatches, tuple(map(tuple, out)),",
          "return Plan(placement, 1 + max((c.mb for prog in out for op in prog for c in "
          "computes_of(op)), default=0), tuple(map(tuple, out)),",
          "the lowered plan's microbatch count is read off its ops, not the schedule's"),
    Fault("lower_placement_looped", LOWER,
          "    placement = schedule.placement\n",
          "    placement = type(schedule.placement).looped(schedule.num_ranks, "
          "schedule.placement.num_stages // schedule.num_ranks)\n",
          "lowering rebuilds the placement as looped (a V-shape's stages move)"),
    Fault("as_plan_not_lowered", LOWER,
          "return lower(target, duration) if isinstance(target, Schedule) else target",
          "return Plan.from_schedule(target) if isinstance(target, Schedule) else target",
          "a compute-only schedule is judged as written, not lowered"),
    # ---- the declarations (declared.py)
    Fault("declare_ignores_microbatches", DECLARED,
          "m = target.num_microbatches if microbatches is None else microbatches",
          "m = target.num_microbatches",
          "a declared microbatch count is ignored"),
    Fault("declare_ignores_stages", DECLARED,
          "num_stages = have.num_stages if stages is None else stages",
          "num_stages = have.num_stages",
          "a declared stage count is ignored"),
    Fault("declare_ignores_ranks", DECLARED,
          "num_ranks = have.num_ranks if ranks is None else ranks",
          "num_ranks = have.num_ranks",
          "a declared rank count is ignored"),
    Fault("declare_places_all_looped", DECLARED,
          "placement = Placement(have.stage_to_rank + tuple(\n"
          "        s % num_ranks for s in range(have.num_stages, num_stages)), num_ranks)",
          "placement = Placement(tuple(\n"
          "        s % num_ranks for s in range(num_stages)), num_ranks)",
          "declaring stages places every stage looped, the input's own too"),
    # ---- the verdict assembly (verify/__init__: _asked, _report, _Judge, _witness)
    Fault("asked_ignores_question", VERIFY,
          "return Asked(plan, question or question_of(memory_limit, comm_model, memory_model))",
          "return Asked(plan, question_of(memory_limit, comm_model, memory_model))",
          "verify asks the question its keyword arguments form, not the one it is given"),
    Fault("report_lists_first_violation_only", VERIFY,
          "violations.extend(found)",
          "violations.extend(found[:1])",
          "the report lists only each violated property's first counterexample"),
    Fault("report_drops_undecided_reasons", VERIFY,
          'if answer.status == "unknown":',
          'if answer.status == "unknown" and answer.facts is None:',
          "the report leaves out why a proof was not found"),
    Fault("report_certificate_unless_undecided", VERIFY,
          'if verdict.status == "verified":\n        certificate',
          'if verdict.status != "undecided":\n        certificate',
          "a violated report gets a certificate too"),
    Fault("report_without_peaks", VERIFY,
          'peaks, highest, hints = decided.pop("peaks"), decided.pop("highest"), '
          'decided.pop("hints")',
          'peaks, highest, hints = {}, decided.pop("highest"), decided.pop("hints")',
          "the report leaves out the peaks the passes summed"),
    Fault("judge_skips_first_claim", VERIFY,
          "[f.claim for f in findings]",
          "[f.claim for f in findings[1:]]",
          "the first finding's counterexample is not handed to the kernel"),
    Fault("memory_hint_parts_swapped", VERIFY,
          'levels, peaks, peak_at = hints.get("memory") or (None, None, None)',
          'levels, peak_at, peaks = hints.get("memory") or (None, None, None)',
          "the memory hint's peaks and peak positions are handed over swapped"),
    # ---- the CLI's and simulate's choice of the plan and its limit
    Fault("as_read_has_comms_uncalled", CLI_TARGETS,
          "if isinstance(plan, Schedule) or plan.has_comms():",
          "if isinstance(plan, Schedule) or plan.has_comms:",
          "a compute-only file is judged as written (has_comms not called: always true)"),
    Fault("check_judges_undeclared", CLI_VERDICTS,
          "checked = _checked(target, question, model.duration,",
          "checked = _checked(read, question, model.duration,",
          "check judges the input as read, without the declared sizes"),
    Fault("model_of_ignores_spec_limit", CLI_TARGETS,
          "spec.memory_limit if memory_limit is None else memory_limit)",
          "memory_limit)",
          "check forgets a spec's own memory limit (only --memory-limit counts)"),
    Fault("simulate_ignores_spec_limit", COMPARISON,
          "limit = spec.memory_limit if memory_limit is None else memory_limit",
          "limit = memory_limit",
          "simulate verifies a spec without its own memory limit"),
    Fault("simulate_lowers_written_plan", COMPARISON,
          "checked = spine.check(target, question,",
          "checked = spine.check(spec.schedule, question,",
          "simulate judges a written plan's schedule lowered anew, not the plan as written"),
    # ---- sequence chunks: the plan judged keeps them, the reader applies --seq-chunks
    Fault("lowering_drops_seq_chunks", LOWER,
          "return plan if schedule.seq_chunks == 1 else attrs.evolve(plan, "
          "seq_chunks=schedule.seq_chunks)",
          "return plan",
          "the lowered plan forgets its sequence chunks (judged as plain microbatches)"),
    Fault("file_ignores_seq_chunks", CLI_TARGETS,
          "return with_seq_chunks(target, chunks, name, args.format), spec, name",
          "return target, spec, name",
          "a file is read without the --seq-chunks the user named"),
    Fault("seq_chunks_ignored_by_the_family", CLI_TARGETS,
          'waves=getattr(args, "waves", None), seq_chunks=chunks)',
          'waves=getattr(args, "waves", None))',
          "--family seq1f1b is built with its default chunks, not the ones named"),
    # ---- the canonical text (ir.py): digests only; check compares none
    Fault("canonical_send_without_peer", IR,
          'add(f"{p.stage}SEND_{_LETTERS[p.kind]}{p.mb}<{op.dst}>")',
          'add(f"{p.stage}SEND_{_LETTERS[p.kind]}{p.mb}")',
          "the canonical text (the digest) leaves out a plain send's peer"),
    Fault("canonical_group_without_peers", IR,
          'return "[" + ";".join(map(_canonical, op.ops)) + "]GROUP"',
          'return "[" + ";".join(map(str, op.ops)) + "]GROUP"',
          "the canonical text (the digest) leaves out the peers of a group's members"),
)

FAULTS = PASS_FAULTS + SHELL_FAULTS
SHELL = frozenset(f.name for f in SHELL_FAULTS)
CANONICAL = frozenset(f.name for f in SHELL_FAULTS if f.path == IR)
FAULTS_BY_NAME = {f.name: f for f in FAULTS}


def apply_fault(text: str, fault: Fault) -> str:
    count = text.count(fault.old)
    if count != 1:
        raise SystemExit(f"fault {fault.name}: its snippet occurs {count} times in "
                         f"{fault.path} (expected exactly once): {fault.old!r}")
    return text.replace(fault.old, fault.new)


def mutated_copy(fault: Fault | None, where: str) -> str:
    """Copy the package to ``where/mpipe_verified`` with ``fault`` applied; returns
    ``where`` (the directory to put on ``PYTHONPATH``)."""
    target = os.path.join(where, "mpipe_verified")
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    if fault is not None:
        path = os.path.join(target, fault.path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(apply_fault(text, fault))
    return where


# ---------------------------------------------------------------- the driver

DRIVER = r'''
import contextlib, hashlib, io, json, os, signal, sys, traceback
root, entries = sys.argv[1], json.load(open(sys.argv[2]))
import mpipe_verified, mpipe_verified.cli as cli
here = os.path.realpath(mpipe_verified.__file__)
assert here.startswith(os.path.realpath(root) + os.sep), here
def timeout(*_): raise TimeoutError("check ran past %d s" % int(sys.argv[3]))
signal.signal(signal.SIGALRM, timeout)
def timeless(x):
    if isinstance(x, dict):
        return {k: timeless(v) for k, v in x.items()
                if k not in ("seconds", "cached") and not k.endswith("_seconds")}
    return [timeless(v) for v in x] if isinstance(x, list) else x
def read(text):
    # (the passes found nothing anywhere: every property went to the kernel's proof,
    #  the properties found violated, a fingerprint of the document without timings)
    try:
        doc = json.loads(text)
    except ValueError:
        return False, [], hashlib.sha256(text.encode()).hexdigest()[:16]
    shown = hashlib.sha256(json.dumps(timeless(doc), sort_keys=True).encode()).hexdigest()
    try:
        alone = all("facts" in p for p in doc["stats"]["properties"].values())
        return alone, sorted({v["property"] for v in doc["violations"]}), shown[:16]
    except (KeyError, TypeError, AttributeError):
        return False, [], shown[:16]
out = []
for name, args in entries:
    err, report = io.StringIO(), io.StringIO()
    signal.alarm(int(sys.argv[3]))
    try:
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(err):
            code = cli.main([args[0], "--json", *args[1:]])
        line = (err.getvalue().strip().splitlines() or [""])[0]
    except BaseException as e:
        code, line = "crash", traceback.format_exception_only(type(e), e)[-1].strip()
    finally:
        signal.alarm(0)
    out.append([name, code, line, *(read(report.getvalue()) if code in (0, 1, 3)
                                    else (False, [], line))])
print(json.dumps(out))
'''


def run_entries(root: str, entries: list, workdir: str) -> dict[str, tuple]:
    """``{entry name: (exit code, first stderr line, unaided, violated properties,
    output)}`` of ``check --json`` (or the entry's own command) on every entry, in one
    subprocess importing the package under ``root``. ``unaided``: the fast passes found
    nothing on any property (each property went to the kernel's proof, whose report
    alone records ``facts``), so without the kernel checking their witness the tool would
    have said VERIFIED. ``output``: a fingerprint of the JSON document without its
    timings (or of the crash), to tell whether a fault changed anything at all."""
    listing = os.path.join(workdir, "entries.json")
    with open(listing, "w", encoding="utf-8") as f:
        json.dump([[e.name, list(e.args)] for e in entries], f)
    env = {**os.environ, "PYTHONPATH": root}
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER, root, listing,
                               str(ENTRY_SECONDS)], capture_output=True, text=True, env=env,
                              cwd=workdir, timeout=ENTRY_SECONDS * (len(entries) + 2))
    except subprocess.TimeoutExpired:
        return {e.name: ("crash", "driver timed out", False, [], "") for e in entries}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {e.name: ("crash", f"driver failed: {tail}", False, [], "") for e in entries}
    return {row[0]: tuple(row[1:]) for row in json.loads(done.stdout)}


def run_fault(fault: Fault | None, entries: list) -> dict[str, tuple]:
    with tempfile.TemporaryDirectory(prefix="mpipe-fault-") as where:
        return run_entries(mutated_copy(fault, where), entries, where)


# ---------------------------------------------------------------- the corpus


class Entry(NamedTuple):
    name: str
    args: tuple[str, ...]  # the ``check`` command line


class Corpus(NamedTuple):
    broken: list
    valid: list


def _at(plan: Plan, rank: int, text: str) -> int:
    """The one position on ``rank`` whose op prints as ``text``."""
    hits = [i for i, op in enumerate(plan.programs[rank]) if str(op) == text]
    assert len(hits) == 1, (rank, text, [str(op) for op in plan.programs[rank]])
    return hits[0]


def _program(plan: Plan, rank: int, ops) -> Plan:
    programs = list(plan.programs)
    programs[rank] = tuple(ops)
    return attrs.evolve(plan, programs=tuple(programs))


def _move_before(plan: Plan, rank: int, what: str, before: str) -> Plan:
    """``what`` moved to just before ``before`` on ``rank``."""
    prog = list(plan.programs[rank])
    op = prog.pop(_at(plan, rank, what))
    prog.insert(prog.index(next(o for o in prog if str(o) == before)), op)
    return _program(plan, rank, prog)


def _insert_after(plan: Plan, rank: int, after: str, op) -> Plan:
    prog = list(plan.programs[rank])
    prog.insert(_at(plan, rank, after) + 1, op)
    return _program(plan, rank, prog)


def _drop(plan: Plan, rank: int, what: str) -> Plan:
    prog = list(plan.programs[rank])
    del prog[_at(plan, rank, what)]
    return _program(plan, rank, prog)


def _map_ops(plan: Plan, edit) -> Plan:
    return attrs.evolve(plan, programs=tuple(tuple(edit(r, op) for op in prog)
                                             for r, prog in enumerate(plan.programs)))


def _lowered(name, p, m, v=None) -> Plan:
    return lower(family(name, p, m, v).derive())


def _transpose(p, m, mode, side="source", body="1f1b", chunks=None) -> Plan:
    return lower(transpose_family(p, m, chunks, body=body, side=side, mode=mode).derive())


def _everywhere(plan: Plan, head, tail) -> Plan:
    """``plan`` with collectives ``head(rank)`` first and ``tail(rank)`` last on each rank."""
    return attrs.evolve(plan, programs=tuple(tuple(head(r)) + prog + tuple(tail(r))
                                             for r, prog in enumerate(plan.programs)))


EVERYONE3 = (0, 1, 2)


def _with_coll(plan: Plan) -> Plan:
    """A 3-rank plan with a parameter broadcast first and a gradient all-reduce last."""
    return _everywhere(plan, lambda r: (Collective("broadcast", EVERYONE3, "params", 0),),
                       lambda r: (Collective("all_reduce", EVERYONE3, "grads"),))


def hand_edits() -> list[tuple[str, Plan, tuple[str, ...]]]:
    """``(name, broken plan, extra check arguments)``: one aimed edit per rule."""
    out: list = []

    def add(name, plan, *extra):
        out.append((name, plan, tuple(extra)))
    for edits in (_body_edits, _cut_edits, _collective_edits, _comm_edits, _move_edits,
                  _pipeline_edits, _seq_edits):
        edits(add)
    return out


def _offloaded(name: str, p: int, m: int) -> Plan:
    return lower(Offloaded(family(name, p, m), 1, 0).derive())


def _lent(plan: Plan, rank: int, to: int, stage: int, mb: int) -> Plan:
    """``plan`` with rank ``rank`` lending the activation of ``(stage, mb)`` to rank ``to``
    right after its forward; ``to`` receives it first and gives it back just before its
    first send to ``rank``, where ``rank`` receives it just before its first receive from
    ``to`` (so both channels keep their FIFO order; that receive must come before the
    activation's backward)."""
    lend, back = Payload(LEND, stage, mb), Payload(RETURN, stage, mb)
    prog = list(plan.programs[rank])
    prog.insert(prog.index(Compute("F", stage, mb)) + 1, Send(to, lend))
    prog.insert(next(i for i, op in enumerate(prog) if isinstance(op, Recv) and op.src == to),
                Recv(to, back))
    held = [Recv(rank, lend), *plan.programs[to]]
    held.insert(next(i for i, op in enumerate(held) if isinstance(op, Send) and op.dst == rank),
                Send(rank, back))
    return _program(_program(plan, rank, prog), to, held)


def _move_edits(add) -> None:
    """Activation moves: offloads and reloads, lends and returns."""
    off = _offloaded("1f1b", 2, 4)
    add("reload_after_backward", _move_before(off, 0, "0B0", "0RELOAD0"))
    add("reload_dropped", _drop(off, 0, "0RELOAD1"))
    add("offload_repeated", _insert_after(off, 0, "0OFFLOAD2", Offload(0, 2)))  # dropped,
    # its reload would be a reload of nothing: bad input (exit 2), not judged
    add("reload_before_offload", _move_before(off, 0, "0RELOAD0", "0OFFLOAD0"))
    peak = max(x for x, _ in peak_memory(off).values())
    add("offloaded-1f1b-p2-below-peak", off, "--memory-limit", f"{peak - 1:g}")
    lent = _lent(_lowered("gpipe", 2, 2), 0, 1, 0, 0)
    add("return_after_backward", _move_before(lent, 0, "0B0", "0RECV_RETURN0"))
    add("return_dropped", _drop(_drop(lent, 0, "0RECV_RETURN0"), 1, "0SEND_RETURN0"))
    peak = max(x for x, _ in peak_memory(lent).values())
    add("lent-gpipe-p2-below-peak", lent, "--memory-limit", f"{peak - 1:g}")


def _body_edits(add) -> None:
    """Needs, completeness and pairing of the body's ops."""
    zb = _lowered("zb-h1", 2, 3)
    add("w_before_its_i", _move_before(zb, 1, "1W0", "1I0"))
    f3 = _lowered("1f1b", 3, 3)
    add("last_rank_b_before_f", _move_before(f3, 2, "2B0", "2F0"))
    add("mid_rank_b_before_grad", _move_before(f3, 1, "1B0", "1RECV_B0"))
    add("f_before_its_recv", _move_before(f3, 1, "1F0", "1RECV_F0"))
    add("send_before_compute", _move_before(f3, 0, "0SEND_F0", "0F0"))
    one = _lowered("gpipe", 1, 1)
    add("overlap_f_with_its_b", _program(one, 0, (Overlap(tuple(one.programs[0])),)))
    g2 = _lowered("gpipe", 2, 2)
    sends = [op for op in g2.programs[0] if isinstance(op, Send)]
    rank0 = [op for op in g2.programs[0] if not isinstance(op, Send)]
    rank0.insert(2, Group(tuple(reversed(sends))))
    add("group_sends_reversed", _program(g2, 0, rank0))
    recvs = [op for op in g2.programs[1] if str(op).startswith("1RECV_F")]
    rank1 = [op for op in g2.programs[1] if op not in recvs]
    swapped = _program(g2, 1, list(reversed(recvs)) + rank1)
    add("recvs_swapped", swapped)
    add("recvs_swapped_eager", swapped, "--comm-model", "eager")
    mixed = _insert_after(_lowered("zb-h1", 2, 2), 0, "0W0", Compute("B", 0, 0))
    add("b_and_i_w_both", mixed)
    add("stray_segment", _insert_after(_lowered("1f1b", 2, 2), 0, "0B1",  # a microbatch
                                       Compute("F", 0, 1, "audio")))  # beyond is bad input
    add("duplicate_forward", _insert_after(_lowered("1f1b", 2, 2), 0, "0B1",
                                           Compute("F", 0, 1)))


def _cut_edits(add) -> None:
    """The rules at the cut: transpose plans of every mode and side."""
    rec, own = _transpose(2, 2, "recompute"), _transpose(2, 2, "owner")
    add("encoder_b_before_body_b", _move_before(rec, 0, "vision:0B0", "0B0"))
    add("encoder_b_before_its_grad", _move_before(own, 1, "vision:0B0", "vision:0RECV_B0"))
    add("body_f_before_encoder_out", _move_before(rec, 0, "0F1", "0RECV_F1"))
    bcast = str(own.programs[1][0])
    add("encoder_f_before_params", _move_before(own, 1, "vision:0F0", bcast))
    reduce = str(own.programs[0][-1])
    add("all_reduce_before_encoder_b", _move_before(own, 0, reduce, "vision:0B1"))
    add("recompute_dropped", _drop(rec, 0, "vision:0R1"))
    add("recompute_before_input", _move_before(rec, 0, "vision:0R1", "vision:0RECV_IN1"))
    sink = _transpose(2, 2, "owner", side="sink")
    add("sink_f_before_body_out", _move_before(sink, 0, "vision:0F0", "vision:0RECV_F0"))
    frozen = _transpose(2, 2, "frozen")
    add("frozen_encoder_backward", _insert_after(frozen, 0, "0B0",
                                                 Compute("B", 0, 0, "vision")))
    seg = own.cut.segments[0]
    moved = attrs.evolve(seg, forward_rank=tuple(reversed(seg.forward_rank)))
    add("encoder_f_on_wrong_rank", attrs.evolve(own, cut=attrs.evolve(own.cut,
                                                                      segments=(moved,))))
    add("params_rooted_off_home", _map_ops(own, lambda r, op: attrs.evolve(op, root=1)
                                           if isinstance(op, Collective)
                                           and op.kind == "broadcast" else op))
    add("all_reduce_twice", _everywhere(own, lambda r: (), lambda r: (own.programs[r][-1],)))
    own4, narrow = _transpose(4, 4, "owner"), (0, 1, 2)
    add("all_reduce_split_in_two", _map_ops(own4, lambda r, op: attrs.evolve(
        op, ranks=narrow if r in narrow else (r,)) if isinstance(op, Collective)
        and op.kind == "all_reduce" else op))


def _collective_edits(add) -> None:
    g3 = _lowered("gpipe", 3, 2)
    coll = _with_coll(g3)
    add("broadcast_root_disagrees", _map_ops(coll, lambda r, op: attrs.evolve(op, root=1)
                                             if r == 2 and isinstance(op, Collective)
                                             and op.kind == "broadcast" else op))
    add("broadcast_root_outside", _map_ops(coll, lambda r, op: attrs.evolve(op, root=5)
                                           if isinstance(op, Collective)
                                           and op.kind == "broadcast" else op))
    tied, grads = Collective("all_reduce", (0, 1), "tied"), Collective("all_reduce",
                                                                        EVERYONE3, "grads")
    order = {0: (tied, grads), 1: (grads, tied), 2: (grads,)}
    add("collectives_crossed", _everywhere(g3, lambda r: (), lambda r: order[r]))
    add("collective_last_member_missing", _program(coll, 2, coll.programs[2][:-1]))


def _pipeline_edits(add) -> None:
    """Several pipelines: the replica sums, the flow inside a pipeline, whose work."""
    dual = _lowered("dualpipe", 2, 4)
    add("replica_sum_missing", _program(dual, 1, (op for op in dual.programs[1] if not (
        isinstance(op, Collective) and op.tag == "replica:0"))))
    prog = list(dual.programs[0])
    call = prog.pop(next(i for i, op in enumerate(prog) if getattr(op, "tag", "") == "replica:0"))
    prog.insert(0, call)
    add("replica_sum_before_w", _program(dual, 0, prog))
    add("pipeline_f_before_its_recv", _move_before(dual, 0, "3F2", "3RECV_F2"))
    pair = lower(Weave(2, 4, "F* B*", pipelines=2).derive())  # looped: stage 1 -> 2 crosses
    payload = Payload("act", 1, 0)
    add("act_across_pipelines", attrs.evolve(pair, programs=(
        pair.programs[0] + (Recv(1, payload),), pair.programs[1] + (Send(0, payload),))))
    add("work_of_another_pipeline", attrs.evolve(pair, pipelines=((0, 2), (1, 3))))


def _comm_edits(add) -> None:
    """Blocking and unmatched point-to-point ops."""
    first_sends = read_plan_json(os.path.join(FIXTURES, "steady_exchange_ungrouped.json"))
    for r in (0, 1):
        prog = list(first_sends.programs[r])
        i = next(i for i, op in enumerate(prog) if isinstance(op, Send)
                 and str(op) in ("0SEND_F1", "1SEND_B0"))
        prog[i] = Group((prog[i],))
        first_sends = _program(first_sends, r, prog)
    add("group_sends_facing", first_sends)
    add("unmatched_recv", _drop(_lowered("1f1b", 3, 3), 0, "0SEND_F2"))
    g1 = _lowered("gpipe", 2, 1)  # rank 1 receives its activation twice (sent twice)
    add("received_twice", _insert_after(_insert_after(g1, 0, "0SEND_F0", g1.programs[0][1]),
                                        1, "1RECV_F0", g1.programs[1][0]))
    g2 = _lowered("gpipe", 2, 2)
    add("extra_send_eager", _program(g2, 0, g2.programs[0] + (g2.programs[0][1],)),
        "--comm-model", "eager")


def _chunked(order: str, seq_chunks: int = 2) -> Plan:
    """One rank, one stage, one sample of two chunks run in ``order`` (``"F1 F0 B1 B0"``)."""
    ops = tuple(Compute(x[0], 0, int(x[1:])) for x in order.split())
    return Plan(Placement((0,), 1), 2, (ops,), seq_chunks=seq_chunks)


def _seq_edits(add) -> None:
    """The chunk order: a chunk's forward before its predecessor's, a chunk's backward
    before its successor's; each otherwise valid (as plain microbatches it verifies)."""
    chunks = ("--seq-chunks", "2")
    add("chunk_1_forward_first", _chunked("F1 F0 B1 B0"), *chunks)
    add("chunk_0_backward_first", _chunked("F0 F1 B0 B1"), *chunks)
    plain = _lowered("1f1b", 2, 4)  # 1F1B's order: each sample's chunk 0 backward first
    add("chunks_of_1f1b", attrs.evolve(plain, seq_chunks=2), *chunks)
    add("chunks_of_1f1b_compute_only", Plan.from_schedule(attrs.evolve(
        family("1f1b", 2, 4).derive(), seq_chunks=2)), *chunks)
    seq = _lowered("seq1f1b", 2, 2)
    add("seq1f1b_backwards_swapped", _move_before(seq, 1, "1B0", "1B1"), *chunks)


def _fixture_entries() -> list[Entry]:
    out = []
    for name in sorted(os.listdir(FIXTURES)):
        if name.startswith("false_accept_") or name in ("recv_first_deadlock.json",
                                                        "steady_exchange_ungrouped.json"):
            out.append(Entry(f"fixture:{name[:-5]}", ("check", os.path.join(FIXTURES, name))))
    eager = os.path.join(FIXTURES, "eager_extra_send.json")
    out.append(Entry("fixture:eager_extra_send", ("check", "--comm-model", "eager", eager)))
    return out


def mutant_bases() -> list[tuple[str, Plan]]:
    """Valid plans the random one-edit mutants start from (every family, every transpose
    mode and side, both bodies, 2 and 4 ranks, with groups and collectives)."""
    ch = S.RandomChooser(random.Random(SEED))
    out = []
    for name in S.FAMILY_NAMES:
        out.append((f"{name}-p2", _lowered(name, 2, 4, 2 if "interleaved" in name else None)))
    out.append(("1f1b-p4-groups", S.with_groups(_lowered("1f1b", 4, 4), ch)))
    out.append(("zb-h2-p3-collectives", S.with_collectives(_lowered("zb-h2", 3, 3), ch)))
    for mode in ("recompute", "owner", "frozen", "none"):
        for side in ("source", "sink"):
            if (mode, side) == ("recompute", "sink"):
                continue
            for p, body, chunks in ((2, "1f1b", None), (4, "interleaved-1f1b", 2)):
                if side == "sink" and p == 4 and mode in ("frozen", "none"):
                    continue  # enough p = 4 sinks (owner) already
                out.append((f"transpose-{mode}-{side}-{body}-p{p}",
                            _transpose(p, p, mode, side, body, chunks)))
    return out


def random_mutants(per_base: int) -> list[tuple[str, Plan]]:
    """Seeded one-edit mutants (``strategies.mutate``) the pristine verifier rejects."""
    out = []
    for base_name, base in mutant_bases():
        ch = S.RandomChooser(random.Random(f"{SEED}:{base_name}"))
        kinds, tries = [k for k in S.MUTATIONS if k in S.applicable(base)], 0
        kept = 0
        while kept < per_base and tries < 20 * per_base:
            tries += 1
            mutant, edit = S.mutate(base, ch.pick(kinds), ch)
            if verify(mutant).status == "violated" and beyond(mutant) is None:  # a file
                # naming a microbatch beyond its plan is bad input (exit 2), not judged
                out.append((f"{base_name}: {edit}", mutant))
                kept += 1
    return out


SPEC_STATIC = """[schedule]
family = "transpose"
pp = 2
microbatches = 4

[transpose]
mode = "owner"

[cost]
activation = [1, 3]

[cost.segments.vision]
activation = 1
output = 0.5
input = 0.5
static = 2

[memory]
static = [3, 1]
limit = {limit}
"""


def _spec_entries(directory: str) -> list[Entry]:
    from mpipe_verified.formats.spec import load_spec
    probe = os.path.join(directory, "probe.toml")
    with open(probe, "w", encoding="utf-8") as f:
        f.write(SPEC_STATIC.format(limit=1000))
    spec = load_spec(probe)
    plan = lower(spec.schedule, spec.duration)
    peaks = [peak for peak, _ in peak_memory(plan, spec.memory_model).values()]
    os.remove(probe)
    broken = os.path.join(ROOT, "examples", "broken.toml")
    out = [Entry("spec:examples/broken.toml", ("check", broken))]
    for rank in range(len(peaks)):  # one rank just over its limit, the others well under
        path = os.path.join(directory, f"transpose_sizes_rank{rank}.toml")
        limits = [peak - 0.25 if r == rank else 2 * peak for r, peak in enumerate(peaks)]
        with open(path, "w", encoding="utf-8") as f:
            f.write(SPEC_STATIC.format(limit=limits))
        out.append(Entry(f"spec:transpose_sizes_rank{rank}", ("check", path)))
    return out


def _memory_entries() -> list[tuple[str, Plan, tuple[str, ...]]]:
    """Plans checked with a limit one below their unit-model peak."""
    out = []
    for name, p, m, v in (("zb-h1", 4, 8, None), ("zb-h2", 2, 4, None),
                          ("dualpipev", 2, 4, None), ("interleaved-1f1b", 2, 4, 2),
                          ("zbv", 2, 4, None)):
        plan = _lowered(name, p, m, v)
        peak = max(x for x, _ in peak_memory(plan).values())
        out.append((f"{name}-p{p}-below-peak", plan, ("--memory-limit", f"{peak - 1:g}")))
    deferred = lower(Weave(2, 4, "F^{p-1-r} (F I)* W*").derive())
    peak = max(x for x, _ in peak_memory(deferred).values())
    out.append(("deferred-w-p2-below-peak", deferred, ("--memory-limit", f"{peak - 1:g}")))
    own = _transpose(4, 4, "owner", body="interleaved-1f1b", chunks=2)
    peak = max(x for x, _ in peak_memory(own).values())
    out.append(("transpose-owner-p4-below-peak", own, ("--memory-limit", f"{peak - 1:g}")))
    return out


# ---------------------------------------------------------------- the shell's corpus
# Inputs that exercise what the trusted shell asks: compute-only files that check
# lowers (a duplicated, missing or stuck compute; markers; a forward-only schedule),
# declared sizes (--stages/--microbatches/--ranks, and a spec's own), specs whose memory
# sizes come from their cost tables' defaults with a limit just below one rank's peak,
# and simulate, which verifies before it times.


def _schedule_of(plan: Plan) -> Schedule:
    """``plan`` without its sends and receives: a compute-only input, lowered by check."""
    return Schedule(plan.placement, plan.num_microbatches,
                    tuple(tuple(op for op in prog if not isinstance(op, (Send, Recv)))
                          for prog in plan.programs), plan.cut, plan.forward_only)


def _without_mb(plan: Plan, mb: int) -> Plan:
    """``plan`` with every op of microbatch ``mb`` (computes and transfers) left out."""
    def keep(op) -> bool:
        carried = op.payload.mb if isinstance(op, (Send, Recv)) else op.mb
        return carried != mb
    return attrs.evolve(plan, programs=tuple(tuple(filter(keep, prog))
                                             for prog in plan.programs))


def _with_markers(plan: Plan) -> Plan:
    """Each rank's first stage unsharded first and resharded last (FSDP markers)."""
    first = {r: plan.placement.stages_of(r)[0] for r in range(plan.num_ranks)}
    return _everywhere(plan, lambda r: (Marker(first[r], "UNSHARD"),),
                       lambda r: (Marker(first[r], "RESHARD"),))


SPEC_DECLARED = """[schedule]
expression = "one_f_one_b(pp=2, microbatches=4)"
microbatches = 5
"""

SPEC_DEFAULT_SIZES = """[schedule]
family = "transpose"
pp = 2
microbatches = 4

[transpose]
mode = "{mode}"

[cost]
F = 1

[cost.segments.vision]
static = 4

[memory]
limit = {limit}
"""


def _lowered_entries(directory: str) -> tuple[list, list]:
    """Compute-only files (torch CSV, plan-json schedules) with a repeated, missing or
    stuck compute (one with FSDP markers, one forward-only), and valid ones with markers
    and forward-only."""
    broken, valid = [], []

    def add(out, name, schedule, extra=(), as_csv=True):
        path = os.path.join(directory, f"lowered-{len(broken) + len(valid):03d}."
                                       + ("csv" if as_csv else "json"))
        (write_torch_csv if as_csv else write_plan_json)(schedule, path)
        out.append(Entry(name, ("check", *extra, path)))
    f2, f3 = _lowered("1f1b", 2, 4), _lowered("1f1b", 3, 3)
    add(broken, "lowered:1f1b-p2-forward-twice",
        _schedule_of(_insert_after(f2, 0, "0F1", Compute("F", 0, 1))))
    zb = _lowered("zb-h1", 2, 3)
    add(broken, "lowered:zb-h1-p2-last-w-twice",
        _schedule_of(_program(zb, 1, zb.programs[1] + (zb.programs[1][-1],))))
    add(broken, "lowered:1f1b-p3-b-missing", _schedule_of(_drop(f3, 1, "1B2")))
    add(broken, "lowered:1f1b-p3-stuck-b-before-f",
        _schedule_of(_move_before(f3, 2, "2B0", "2F0")))
    dual = _lowered("dualpipev", 2, 4)
    add(broken, "lowered:dualpipev-p2-w-missing", _schedule_of(_drop(dual, 1, "2W3")))
    add(broken, "lowered:markers-1f1b-p2-b-missing",
        _schedule_of(_with_markers(_drop(f2, 0, "0B3"))))
    fwd = lower(ForwardOnly(family("1f1b", 2, 3)).derive())
    add(broken, "lowered:forward-only-p2-f-missing", _schedule_of(_drop(fwd, 1, "1F2")),
        as_csv=False)
    add(valid, "valid:lowered-markers-1f1b-p2", _schedule_of(_with_markers(f2)))
    add(valid, "valid:lowered-forward-only-p2", _schedule_of(fwd), as_csv=False)
    return broken, valid


def _declared_entries(directory: str) -> tuple[list, list]:
    """Files complete on their own terms that miss work their declared sizes call for
    (a microbatch, a rank's row), a spec declaring more microbatches than its term
    derives, and files whose declarations they meet."""
    broken, valid = [], []

    def add(out, name, target, *extra):
        path = os.path.join(directory, f"declared-{len(broken) + len(valid):03d}.csv")
        write_torch_csv(target, path)
        out.append(Entry(name, ("check", *extra, path)))
    f2, f3 = _lowered("1f1b", 2, 4), _lowered("1f1b", 3, 3)
    add(broken, "declared:1f1b-p2-last-mb-missing [lowered]",
        _schedule_of(_without_mb(f2, 3)), "--microbatches", "4")
    add(broken, "declared:1f1b-p2-last-mb-missing [as written]", _without_mb(f2, 3),
        "--microbatches", "4", "--stages", "2")
    rows = _schedule_of(f3)
    add(broken, "declared:1f1b-p3-last-rank-missing",
        Schedule(Placement((0, 1), 2), 3, rows.programs[:2]), "--stages", "3", "--ranks", "3")
    dual = _schedule_of(_lowered("dualpipev", 2, 4))
    add(broken, "declared:dualpipev-p2-i-missing",
        _schedule_of(_drop(_lowered("dualpipev", 2, 4), 0, "0I3")), "--stages", "4",
        "--ranks", "2")
    add(valid, "valid:declared-1f1b-p2", _schedule_of(f2), "--stages", "2",
        "--microbatches", "4", "--ranks", "2")
    add(valid, "valid:declared-dualpipev-p2", dual, "--stages", "4", "--microbatches", "4")
    path = os.path.join(directory, "declared-spec.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(SPEC_DECLARED)
    broken.append(Entry("spec:declared-microbatches-5", ("check", path)))
    return broken, valid


def _default_sizes_entries(directory: str) -> list[Entry]:
    """Transpose specs whose sizes are their cost tables' defaults (body and segment
    activations 1, a forward-only copy as large as the segment's static part), each with
    one rank's limit just below its peak (as the simulator sums it; the pristine check
    must agree: exit 1), checked and simulated."""
    from mpipe_verified.formats.spec import load_spec
    out = []
    for mode in ("recompute", "frozen"):
        probe = os.path.join(directory, f"probe-{mode}.toml")
        with open(probe, "w", encoding="utf-8") as f:
            f.write(SPEC_DEFAULT_SIZES.format(mode=mode, limit=1000))
        spec = load_spec(probe)
        plan = lower(spec.schedule, spec.duration)
        peaks = [peak for peak, _ in peak_memory(plan, spec.memory_model).values()]
        os.remove(probe)
        for rank in range(len(peaks)):
            path = os.path.join(directory, f"default_sizes_{mode}_rank{rank}.toml")
            limits = [peak - 0.5 if r == rank else 2 * peak for r, peak in enumerate(peaks)]
            with open(path, "w", encoding="utf-8") as f:
                f.write(SPEC_DEFAULT_SIZES.format(mode=mode, limit=limits))
            out.append(Entry(f"spec:default-sizes-{mode}-rank{rank}", ("check", path)))
            out.append(Entry(f"simulate:default-sizes-{mode}-rank{rank}", ("simulate", path)))
    return out


def shell_entries(directory: str) -> Corpus:
    """The broken and valid entries that exercise the shell (see above)."""
    broken, valid = [], []
    for make in (_lowered_entries, _declared_entries):
        b, v = make(directory)
        broken += b
        valid += v
    broken += _default_sizes_entries(directory)
    broken.append(Entry("simulate:examples/broken.toml",
                        ("simulate", os.path.join(ROOT, "examples", "broken.toml"))))
    csv = os.path.join(directory, "simulate-recvs-swapped.csv")
    g2 = _lowered("gpipe", 2, 2)
    recvs = [op for op in g2.programs[1] if str(op).startswith("1RECV_F")]
    write_torch_csv(_program(g2, 1, list(reversed(recvs))
                             + [op for op in g2.programs[1] if op not in recvs]), csv)
    broken.append(Entry("simulate:recvs-swapped [csv]", ("simulate", csv)))
    for name in ("zb-h1", "mllm_transpose"):  # timed with the simulator's sizes
        valid.append(Entry(f"valid:simulate-{name}",
                           ("simulate", os.path.join(ROOT, "examples", f"{name}.toml"))))
    return Corpus(broken, valid)


def _write(directory: str, index: int, name: str, plan: Plan, extra: tuple,
           as_csv: bool = False) -> Entry:
    path = os.path.join(directory, f"{index:03d}.{'csv' if as_csv else 'json'}")
    (write_torch_csv if as_csv else write_plan_json)(plan, path)
    return Entry(name + (" [csv]" if as_csv else ""), ("check", *extra, path))


def _csv_ok(plan: Plan) -> bool:
    """Plain plans (no cut, pipelines, group, collective or activation move) also go out
    as torch CSV, where the format can say them (a transfer whose peer is not its stage's
    rank it cannot)."""
    if plan.cut.segments or plan.pipelines or any(
            isinstance(op, (Group, Collective, Offload, Reload))
            or (isinstance(op, (Send, Recv)) and op.payload.kind in (LEND, RETURN))
            for prog in plan.programs for op in prog):
        return False
    try:
        format_torch_csv(plan)
    except ValueError:
        return False
    return True


SMALL_SHELL = ("lowered:1f1b-p2-forward-twice", "valid:declared-1f1b-p2")


def build_corpus(directory: str, small: bool = False) -> Corpus:
    """Write the broken and valid plans under ``directory``; ``small``: a few of each
    kind (for the test)."""
    planned = hand_edits() + _memory_entries()
    if small:
        keep = ("w_before_its_i", "recvs_swapped_eager", "encoder_b_before_body_b",
                "collectives_crossed", "zb-h1-p4-below-peak", "last_rank_b_before_f",
                "chunks_of_1f1b")
        planned = [e for e in planned if e[0] in keep]
    else:
        planned += [(name, plan, ()) for name, plan in random_mutants(per_base=2)]
    broken, index = [], 0
    for name, plan, extra in planned:
        broken.append(_write(directory, index, name, plan, extra))
        index += 1
        if _csv_ok(plan):
            broken.append(_write(directory, index, name, plan, extra, as_csv=True))
            index += 1
    if not small:
        broken += _fixture_entries() + _spec_entries(directory)
        broken.append(Entry("family:zb-h2-p4-limit-4",
                            ("check", "--family", "zb-h2", "--pp", "4",
                             "--microbatches", "8", "--memory-limit", "4")))
    valid = [
        _write(directory, 900, "valid:zb-h1-p3", _lowered("zb-h1", 3, 4), ()),
        _write(directory, 901, "valid:dualpipev-p2", _lowered("dualpipev", 2, 4), (), True),
        _write(directory, 906, "valid:dualpipe-p2", _lowered("dualpipe", 2, 4), ()),
        _write(directory, 907, "valid:dualpipe-p2-bidirectional", _lowered("dualpipe", 2, 4),
               ("--bidirectional",), True),
        Entry("valid:family-chimera-p2", ("check", "--family", "chimera", "--pp", "2",
                                          "--microbatches", "2", "--expand")),
        _write(directory, 908, "valid:seq1f1b-p3", _lowered("seq1f1b", 3, 3),
               ("--seq-chunks", "2"), True),
        Entry("valid:family-seq1f1b", ("check", "--family", "seq1f1b", "--pp", "3",
                                       "--microbatches", "3", "--seq-chunks", "3")),
    ]
    shell = shell_entries(directory)
    if small:
        return Corpus(broken + [e for e in shell.broken if e.name in SMALL_SHELL],
                      valid + [e for e in shell.valid if e.name in SMALL_SHELL])
    broken += shell.broken
    valid += shell.valid
    valid += [
        _write(directory, 902, "valid:transpose-owner-p2", _transpose(2, 2, "owner"), ()),
        Entry("valid:family-transpose-recompute", ("check", "--family", "transpose",
                                                   "--pp", "2", "--microbatches", "4")),
        Entry("valid:spec-zb-h1", ("check", os.path.join(ROOT, "examples",
                                                              "zb-h1.toml"))),
        _write(directory, 903, "valid:1f1b-p3-groups",
               S.with_groups(_lowered("1f1b", 3, 4), S.RandomChooser(random.Random(SEED))), ()),
        _write(directory, 904, "valid:gpipe-p3-collectives", _with_coll(_lowered("gpipe", 3, 2)),
               ()),
        _write(directory, 906, "valid:offloaded-1f1b-p2", _offloaded("1f1b", 2, 4), ()),
        _write(directory, 907, "valid:lent-gpipe-p2", _lent(_lowered("gpipe", 2, 2), 0, 1, 0, 0),
               ()),
        _write(directory, 905, "valid:steady-exchange-eager",
               read_plan_json(os.path.join(FIXTURES, "steady_exchange_ungrouped.json")),
               ("--comm-model", "eager")),
        Entry("valid:spec-mllm-transpose-frozen",
              ("check", os.path.join(ROOT, "examples", "mllm_transpose_frozen.toml"))),
    ]
    return Corpus(broken, valid)


# ---------------------------------------------------------------- the run

VERDICTS = {0: "false_verified", 1: "caught_violated", 3: "caught_undecided"}


def classify(code) -> str:
    return VERDICTS.get(code, "error")


def check_pristine(corpus: Corpus) -> dict[str, tuple]:
    """Run the unedited package on the corpus; assert that every broken entry exits 1 and
    every valid one 0. Returns its results (``run_fault``'s form)."""
    got = run_fault(None, corpus.broken + corpus.valid)
    wrong = [(e.name, got[e.name][:2]) for e in corpus.broken if got[e.name][0] != 1]
    wrong += [(e.name, got[e.name][:2]) for e in corpus.valid if got[e.name][0] != 0]
    if wrong:
        raise SystemExit(f"the pristine package misjudges {len(wrong)} corpus entries: "
                         f"{wrong[:5]}")
    return got


def violating(corpus: Corpus, pristine: dict) -> dict[str, int]:
    """How many broken entries violate each property, with the unedited package."""
    return {prop: sum(prop in pristine[e.name][3] for e in corpus.broken)
            for prop in PROPERTIES}


def judge_fault(fault: Fault, corpus: Corpus, pristine: dict) -> dict:
    """Per broken entry its class, the valid entries not judged 0, the errors, and the
    entries whose output differs from the ``pristine`` run's."""
    got = run_fault(fault, corpus.broken + corpus.valid)
    entries = corpus.broken + corpus.valid
    classes = {e.name: classify(got[e.name][0]) for e in corpus.broken}
    return {"fault": fault, "classes": classes,
            "changed": sum(got[e.name][0] != 1 for e in corpus.broken),
            "output": sum(got[e.name][0] != pristine[e.name][0]
                          or got[e.name][4] != pristine[e.name][4] for e in entries),
            "valid_bad": [(e.name, got[e.name][0]) for e in corpus.valid
                          if got[e.name][0] != 0],
            "errors": [(e.name, got[e.name][:2]) for e in entries
                       if classify(got[e.name][0]) == "error"],
            "unaided": [e.name for e in corpus.broken if got[e.name][2]],
            "false_verified": [e.name for e in corpus.broken if got[e.name][0] == 0]}


def run(faults, corpus: Corpus, jobs: int, pristine: dict | None = None) -> list[dict]:
    """Judge each fault on ``corpus`` (``pristine``: the unedited package's results,
    ``check_pristine``; run here when not given)."""
    if pristine is None:
        pristine = run_fault(None, corpus.broken + corpus.valid)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda f: judge_fault(f, corpus, pristine), faults))


def totals(results: list[dict]) -> dict[str, int]:
    out = {name: 0 for name in (*VERDICTS.values(), "error")}
    for result in results:
        for verdict in result["classes"].values():
            out[verdict] += 1
    return out


def _row(r: dict) -> str:
    counts = {v: 0 for v in (*VERDICTS.values(), "error")}
    for verdict in r["classes"].values():
        counts[verdict] += 1
    return (f"{r['fault'].name:36} {counts['false_verified']:>8} "
            f"{counts['caught_violated']:>8} {counts['caught_undecided']:>9} "
            f"{counts['error']:>5} {r['changed']:>7} {len(r['unaided']):>7} "
            f"{sum(code == 1 for _, code in r['valid_bad']):>9} "
            f"{sum(code == 3 for _, code in r['valid_bad']):>9} {r['output']:>6}  "
            f"{r['fault'].description}")


def report(results: list[dict], corpus: Corpus, violating: dict | None = None) -> str:
    spread = "" if violating is None else " (violating " + ", ".join(
        f"{prop} {n}" for prop, n in violating.items()) + ")"
    head = (f"{'fault':36} {'verified':>8} {'violated':>8} {'undecided':>9} {'error':>5} "
            f"{'changed':>7} {'unaided':>7} {'valid:rej':>9} {'valid:und':>9} "
            f"{'output':>6}  description")
    passes = [r for r in results if r["fault"].name not in SHELL]
    shell = [r for r in results if r["fault"].name in SHELL]
    lines = [f"corpus: {len(corpus.broken)} broken plans{spread}, {len(corpus.valid)} valid "
             "plans", ""]
    for title, part in (("the semantics, the passes, the hand-over, the lowering's order",
                         passes), ("the shell around the kernel", shell)):
        if part:
            lines += [f"{title}:", head, *map(_row, part), ""]
    details = [f"  {r['fault'].name}: {name}: {code} {line}"
               for r in results for name, (code, line) in r["errors"]]
    if details:
        lines += ["errors (exit 2 or a crash; the first line of stderr):"] + details + [""]
    holes = [f"  {r['fault'].name}: {name}" for r in results for name in r["false_verified"]]
    if holes:
        lines += ["FALSE VERIFIED (a fault outside the trusted base made a broken plan "
                  "VERIFIED):"] + holes + [""]
    def some(code):
        return sum(any(c == code for _, c in r["valid_bad"]) for r in results)
    lines += [f"on valid plans: {some(1)} of {len(results)} faults make the tool reject "
              f"some (false_rejected), {some(3)} leave some undecided; "
              f"{sum(r['changed'] > 0 for r in results)} of {len(results)} faults change "
              f"some verdict on a broken plan, "
              f"{sum(r['output'] > 0 for r in results)} some output",
              f"unaided: {sum(len(r['unaided']) for r in results)} (fault, broken plan) pairs "
              f"where the faulty passes found nothing at all (VERIFIED without the kernel), "
              f"over {sum(bool(r['unaided']) for r in results)} faults"]
    canonical = [r for r in shell if r["fault"].name in CANONICAL]
    if canonical:
        lines.append(f"canonical text: {len(canonical)} faults change digests only (check "
                     f"compares none): {sum(r['changed'] > 0 for r in canonical)} change a "
                     "verdict")
    t = totals(results)
    lines.append(f"shell_faults={len(shell)} shell_false_verified="
                 f"{sum(len(r['false_verified']) for r in shell)}")
    lines.append(f"faults={len(results)} false_verified={t['false_verified']} "
                 f"caught_violated={t['caught_violated']} "
                 f"caught_undecided={t['caught_undecided']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", metavar="NAME", choices=list(FAULTS_BY_NAME))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    args = parser.parse_args(argv)
    faults = [FAULTS_BY_NAME[n] for n in args.faults] if args.faults else list(FAULTS)
    for fault in faults:  # every edit applies, before anything runs
        with open(os.path.join(PACKAGE, fault.path), encoding="utf-8") as f:
            apply_fault(f.read(), fault)
    if args.list:
        for fault in faults:
            print(f"{fault.name:36} {fault.path:22} {fault.description}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mpipe-corpus-") as directory:
        corpus = build_corpus(directory)
        pristine = check_pristine(corpus)
        results = run(faults, corpus, args.jobs, pristine)
        print(report(results, corpus, violating(corpus, pristine)))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
