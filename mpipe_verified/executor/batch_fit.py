"""Whether a batch fits a certified plan's payloads, found before any of the plan's
communication.

A plan's payload layouts (every sent tensor's shape and dtype) are part of what was
certified, so a batch of other shapes (the smaller last batch of an epoch, another
sequence length) or a model run under another autocast than the one the layouts were
inferred under cannot run on it: its first send would be refused mid-step, with the
peers already waiting. ``first_mismatch`` runs, on this rank, what of the pipeline's
first step it can from the batch alone (a source segment's forward, the body's first
stage) under ``torch.no_grad`` on the microbatches of each distinct shape, leaving the
modules and the random generators as they were (``partition.model_state_kept``), and
compares each value this rank would send with the plan's payload. The executor does
this once per batch signature and lets every rank agree before the plan starts.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Sequence

import attrs
import torch
from torch import nn

from ..ir import ACT, INPUT, SOURCE, Send, p2p_of
from .batch import Batch
from .errors import PayloadMismatchError
from .partition import model_state_kept, signature

Check = Callable[[object, object, str], None]  # check_outgoing(value, payload, where)
_CHECKING = [False]


def checking() -> bool:
    """Whether the forward now running is the executor's fit check (no step's work: a
    module that logs or counts its calls can leave this one out)."""
    return _CHECKING[0]


@contextlib.contextmanager
def _check_running():
    _CHECKING[0] = True
    try:
        yield
    finally:
        _CHECKING[0] = False


def first_sends(program: Sequence, cut, firsts=frozenset({0})) -> dict[tuple, object]:
    """``(segment, mb) -> payload`` of every value this rank sends that the batch alone
    determines: a source segment's raw input (``input``) or output, the body's first
    stage's output (segment ``""``; ``firsts``: each pipeline's first stage), by the first
    op that sends it."""
    sources = {s.name for s in cut.segments if s.side == SOURCE}
    out: dict[tuple, object] = {}
    for op in program:
        for c in p2p_of(op):
            p = c.payload
            if type(c) is not Send or p.stage not in (firsts if not p.segment else (0,)):
                continue
            if p.kind == INPUT or (p.kind == ACT and (not p.segment or p.segment in sources)):
                out.setdefault((p.kind, p.segment, p.mb), p)
    return out


def first_mismatch(mbs: Sequence[Batch], sends: Mapping[tuple, object],
                   stage0: nn.Module | None, segments: Mapping[str, nn.Module],
                   source_names: Sequence[str], check: Check) -> str | None:
    """The first payload of ``sends`` the microbatches ``mbs`` would not fill as the plan
    says (a one-line description), or None. ``stage0``: the body's first stage if this
    rank holds it; ``segments``: the source segments this rank holds, ``source_names``
    every source in cut order (the first stage takes their outputs first)."""
    if not sends:
        return None
    modules = [m for m in (stage0, *segments.values()) if m is not None]
    seen: set = set()
    with torch.no_grad(), model_state_kept(modules, list(mbs)), _check_running():
        for mb, data in enumerate(mbs):  # one microbatch of each shape this rank sends
            key = signature(attrs.evolve(data, target=None))
            if key in seen or not any(k[2] == mb for k in sends):
                continue
            seen.add(key)
            try:
                _check_microbatch(mb, data, sends, stage0, segments, source_names, check)
            except PayloadMismatchError as err:
                return str(err)
    return None


def _check_microbatch(mb: int, data: Batch, sends, stage0, segments, source_names,
                      check: Check) -> None:
    outputs = {}
    for name in source_names:
        raw = data.segments.get(name)
        payload = sends.get((INPUT, name, mb))
        if payload is not None and raw is not None:
            check(raw, payload, f"microbatch {mb}")
        module = segments.get(name)
        if module is None or raw is None:
            continue
        outputs[name] = module(raw)
        payload = sends.get((ACT, name, mb))
        if payload is not None:
            check(outputs[name], payload, f"microbatch {mb}")
    payload = sends.get((ACT, "", mb))
    if payload is None or stage0 is None or len(outputs) < len(source_names):
        return
    body = data.body if isinstance(data.body, tuple) else (
        () if data.body is None else (data.body,))
    y = stage0(*(outputs[n] for n in source_names), *body, **dict(data.kwargs))
    check(y, payload, f"microbatch {mb}")


def refusal(rank: int, detail: str) -> str:
    """The one-line error for a batch that does not fit (``detail`` from
    ``first_mismatch``)."""
    detail = detail.removeprefix(f"rank {rank}: ")
    return (f"rank {rank}: the batch does not fit the plan: {detail}. Payload shapes and "
            "dtypes are part of the certified plan, so a batch of other shapes (an epoch's "
            "smaller last batch, another sequence length) needs a plan of its own: train "
            "through ShapeCache (one certified plan per batch shape), or annotate and "
            "certify a plan for it; and infer the payload shapes under the autocast the "
            "model trains under (autocast changes the dtypes)")
