"""The dimensions ``tune`` searches beyond the classic families (``tune.TUNED`` and their
``defer_w`` variants), each where the spec's model makes it worth a try, and the words
that say why a plan won (docs/tune.md, "Several pipelines, sequence chunks, offload"):

- **bidirectional** families (``dualpipe``, ``chimera``: two pipelines, every rank a
  stage of both, so every rank holds two weight copies): tried when the spec declares
  ``[memory] weights`` and the static memory with both copies fits the limit on every
  rank (without ``weights`` their memory is unknown);
- **sequence chunks** (``seq1f1b`` with S in ``SEQ_CHUNKS``): tried when the spec's cost
  model describes a sequence (``[cost] attention`` > 0, the share of causal attention,
  which makes a later chunk cost more);
- **offload** (``offload(family)`` over each classic family as derived): tried when
  memory binds, i.e. the spec has a limit and some candidate timed before it does not
  fit.

A dimension not tried is reported with its reason (``Skipped``). Spec with a cut segment
(a transpose) keep the classic search: the transpose carries neither several pipelines
nor sequence chunks (``ir.Schedule`` refuses a cut with several pipelines).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import attrs

from .algebra import families, terms
from .comparison import samples
from .errors import ParameterError
from .spec import Spec

SEQ_CHUNKS = (2, 4)
BIDIRECTIONAL = ("dualpipe", "chimera")


@attrs.frozen
class Skipped:
    """A family or modifier ``tune`` did not try, and why."""

    what: str
    reason: str


def limit_text(limit) -> str:
    if isinstance(limit, tuple):
        return "[" + ", ".join(f"{x:.6g}" for x in limit) + "]"
    return f"{limit:.6g}"


def _fits(spec: Spec, static: tuple[float, ...]) -> str | None:
    """Why ``static`` (per rank) does not fit ``spec``'s limit, or None."""
    for rank, x in enumerate(static):
        lim = spec.limit_of(rank)
        if lim is not None and x > lim + 1e-9:
            return (f"two weight copies and the rest of the static memory need {x:.6g} on "
                    f"rank {rank}, over its limit {lim:.6g}")
    return None


def _weights(spec: Spec) -> tuple:
    if spec.cost is None:
        return ()
    w = spec.cost.weights
    return w if isinstance(w, tuple) else (w,)


def bidirectional(spec: Spec, on_body) -> Iterator[tuple[str, str, object] | Skipped]:
    """``(family, label, term)`` of each bidirectional family to try, or why not."""
    s = spec.schedule
    weights = _weights(spec)
    for name in BIDIRECTIONAL:
        try:
            body = families.family(name, s.num_ranks, samples(s))
        except ParameterError as e:
            yield Skipped(name, str(e))
            continue
        if not any(weights):
            yield Skipped(name, "the spec declares no [memory] weights, so whether two "
                                "weight copies fit is unknown")
            continue
        model = on_body(spec, body, name)
        why = _fits(spec, model.cost.static_memory(model.schedule.cut, s.num_ranks))
        if why:
            yield Skipped(name, why)
            continue
        yield name, name, body


def sequence_chunks(spec: Spec) -> Iterator[tuple[str, str, object] | Skipped]:
    """``seq1f1b`` with each S of ``SEQ_CHUNKS`` where the model has a sequence."""
    if spec.cost is None or not spec.cost.attention:
        yield Skipped("seq1f1b", "the spec gives no [cost] attention (the share of causal "
                                 "attention), so it describes no sequence to chunk")
        return
    s = spec.schedule
    for chunks in SEQ_CHUNKS:
        yield "seq1f1b", f"seq1f1b S={chunks}", families.seq1f1b(
            s.num_ranks, samples(s), chunks)


def offloaded(spec: Spec, classic: Iterable[tuple[str, str, object]],
              binds: Callable[[], bool]) -> Iterator[tuple[str, str, object] | Skipped]:
    """``offload`` over each classic family where memory binds (``binds``: some candidate
    timed so far does not fit)."""
    if spec.memory_limit is None:
        yield Skipped("offload", "the spec has no memory limit, so memory does not bind")
        return
    if not binds():
        yield Skipped("offload", "memory does not bind: every candidate tried fits the limit")
        return
    for name, label, body in classic:
        yield name, f"{label}+offload", terms.Offloaded(body)


def extra_size(spec: Spec, classic: int) -> int:
    """How many candidates the dimensions above may add (``classic``: the classic
    families that build), counted without deriving."""
    s = spec.schedule
    count = 0
    weights = _weights(spec)
    for name in BIDIRECTIONAL if any(weights) else ():
        try:
            families.family(name, s.num_ranks, samples(s))
            count += 1
        except ParameterError:
            pass
    if spec.cost is not None and spec.cost.attention:
        count += len(SEQ_CHUNKS)
    if spec.memory_limit is not None:
        count += classic
    return count


def why(best: dict | None, tried: list[dict], limit, skipped: Iterable[Skipped]) -> list[str]:
    """Why ``best`` won (the ``tune`` document's entries): the limit it fits, the faster
    candidates that do not, the classic families over the limit, and what was not tried."""
    out: list[str] = []
    named = set()  # the candidate already said to be faster but over the limit
    if best is not None:
        fits = ("no memory limit is given" if limit is None else
                f"fits the limit of {limit_text(limit)} (peak {best['peak_memory']:.6g})")
        out.append(f"{best['schedule']}: {fits}; the fastest verified candidate that fits")
        faster = [t for t in tried if not t["fits"] and t["makespan"] < best["makespan"]]
        if faster:
            t = min(faster, key=lambda t: t["makespan"])
            named.add(t["schedule"])
            out.append(f"{t['schedule']} is faster ({t['makespan']:.6g} against "
                       f"{best['makespan']:.6g}) but peaks at {t['peak_memory']:.6g} > "
                       f"{limit_text(limit)}")
    over = sorted((t for t in tried if t.get("classic") and not t["fits"]
                   and t["schedule"] not in named),
                  key=lambda t: t["makespan"])
    for t in over[:3]:
        out.append(f"{t['schedule']} peaks at {t['peak_memory']:.6g} > {limit_text(limit)}")
    for s in skipped:
        out.append(f"{s.what} not tried: {s.reason}")
    return out
