"""``mpipe-verify simulate``: a spec's verified plan timed with its cost model, and the same
model under other families for comparison.

``simulation(spec, name, compare)`` checks the spec's schedule (``check.check``: lowered,
verified with the spec's memory model and limit, as the simulator only times certified
plans, and timed with ``sim.simulate``: durations, transfer costs and memory of the
spec's ``CostModel``) and, for each family in ``compare``, builds the *baseline* on the
same model and times it the same way:

- the baseline keeps the cut segment **inline** on its home rank
  (``Transpose(family(...), ownership="inline")`` with the spec's segment, side, mode and
  costs), so ``--compare interleaved-1f1b`` is Megatron's interleaved 1F1B with the
  encoder on the first stage, the schedule the HyperParallel-Mpipe paper (arXiv
  2607.03229) compares against; a spec without a cut compares with the bare family;
- the same model on another family's stage count: the cost model is ``rescaled`` (a stage
  of half the layers takes half the time and stores half the activations; boundary
  payloads, segments and static memory stay), ``interleaved-1f1b`` keeps the spec's
  chunks (2 when the spec's body has one stage per rank). A spec without ``[cost]`` is
  re-cut the same way from the standard costs (``CostModel()``: ``F`` 1, ``B`` 2, ``I``
  and ``W`` 1, activation 1 per stage of the spec's cut), so a comparison never sets a
  model against a larger one;
- each baseline's peak memory is compared with the same limit (``within_limit``) and its
  plan is verified too (``status``);
- a family of several pipelines or of sequence chunks that cannot run the model (an odd
  pp, microbatches not a multiple, a cut segment) is skipped with its reason
  (``not_comparable``; the document's entry is ``{"skipped": REASON}``); the chunked
  family runs the spec's samples, each cut into its chunks, with a chunk's share of the
  costs (``cost.CostModel.chunked``), and a family of several pipelines moves the weight
  copies with its stages (``CostModel.moved``).

The document (``--json``) holds ``makespan``, ``bubble_fraction``, ``peak_memory`` (per rank;
``host_peak_memory`` too where activations are offloaded),
per-rank ``busy`` and ``bubble``, and ``compare: {FAMILY: {makespan, bubble_fraction,
peak_memory, within_limit, status, speedup}}`` where ``speedup`` is *this spec's* speedup
over the family: the family's makespan over the spec's (above 1: the spec is faster; below
1: the family is faster), and ``inline_segment``: the cut segment the baselines keep on
its home rank (null for a spec without a cut: the baselines are the bare families). The
text form says it in words, from the family's side: ``zbv ... 1.294x faster`` (than this
spec) or ``1.294x slower``.
"""

from __future__ import annotations

import attrs

from .algebra import families
from .algebra.transpose import Transpose
from . import check as spine
from .cost import CostModel
from .errors import ParameterError
from .figures import figure, figures
from .ir import Plan, Schedule
from .question import Question
from .semantics import EAGER
from .sim import SimResult
from .spec import Spec
from .verify import Report


@attrs.frozen
class Timed:
    """One simulated plan: its term text, plan, verdict and run (None when the plan was
    checked and may not run to completion: a violation other than memory, or undecided)."""

    term: str
    plan: Plan
    report: Report | None
    run: SimResult | None
    memory_limit: float | tuple[float, ...] | None

    def within_limit(self) -> bool | None:
        lim = self.memory_limit
        if lim is None:
            return None
        return all(peak <= (lim[r] if isinstance(lim, tuple) else lim) + 1e-9
                   for r, peak in self.run.peak_memory.items())


def time_spec(spec: Spec, memory_limit=None, comm_model: str = EAGER,
              check: bool = True, target: Schedule | Plan | None = None,
              deadline: float | None = None) -> Timed:
    """Lower (a schedule), verify (with ``check``) and simulate ``spec`` with its costs
    (a checked plan only when it runs to completion: verified, or over its memory limit
    alone). ``deadline`` (a ``sim.now()`` value, ``tune --budget``): raise
    ``sim.DeadlinePassed`` between these steps, and inside the simulation, once it has
    passed."""
    target = spec.schedule if target is None else target
    limit = spec.memory_limit if memory_limit is None else memory_limit
    question = Question.of_spec(spec, memory_limit, source=target) if check else None
    checked = spine.check(target, question, spec.duration, timing=spine.Timing(
        spec.comm_cost, spec.memory_model, comm_model, deadline))
    if checked.failure is not None:
        raise checked.failure
    return Timed(str(spec.term), checked.plan, checked.report, checked.run, limit)


def chunks_of(term) -> int | None:
    """Stages per rank of a term's body (a transpose's body, else the term)."""
    body = term.body if isinstance(term, Transpose) else term
    schedule = body.derive()
    return schedule.placement.num_stages // schedule.num_ranks


def samples(schedule: Schedule) -> int:
    """The samples of a step: its microbatches, or with sequence chunks their samples
    (what every family compared or tuned runs, whatever its chunks)."""
    return schedule.num_microbatches // schedule.seq_chunks


def not_comparable(spec: Spec, name: str) -> str | None:
    """Why the family ``name`` cannot run ``spec``'s model (a family of several
    pipelines or of sequence chunks: it needs an even pp, a multiple of microbatches, or
    a model without a cut segment), or None. The classic families answer with a usage
    error instead, as they always have."""
    if name not in families.BIDIRECTIONAL and name not in families.SEQ_FAMILIES:
        return None
    if isinstance(spec.term, Transpose):
        what = ("several pipelines" if name in families.BIDIRECTIONAL
                else "sequence chunks (the encoder runs once per sample)")
        return f"the cut segment {spec.term.segment!r} (a transpose) does not run over {what}"
    try:
        baseline_spec(spec, name)
    except ParameterError as e:
        return str(e)
    return None


def baseline_spec(spec: Spec, name: str) -> Spec:
    """``name`` on ``spec``'s model with the segment inline (see the module docstring)."""
    schedule = spec.schedule
    p, m = schedule.num_ranks, samples(schedule)
    chunks = None
    if name == "interleaved-1f1b":
        own = chunks_of(spec.term)
        chunks = own if own and own >= 2 else 2
    return on_body(spec, families.family(name, p, m, chunks), f"{name} (inline)",
                   ownership="inline")


def model_stages(schedule: Schedule) -> int:
    """The model's stage count: a schedule of K pipelines holds K replicas of each."""
    return schedule.placement.num_stages // max(1, len(schedule.pipelines))


def on_body(spec: Spec, body, name: str, **changes) -> Spec:
    """``spec``'s model with ``body`` as its body (a transpose's body, else the whole
    term), ``changes`` (e.g. ``ownership``, ``mode``) applied to a transpose: the cost
    model is re-cut to ``body``'s stage count (see the module docstring). One model for
    ``--compare`` and ``tune``."""
    schedule, derived = spec.schedule, body.derive()
    stages, own = model_stages(derived), model_stages(schedule)
    ratio = own / stages
    term = spec.term
    if isinstance(term, Transpose):
        term = attrs.evolve(term, body=body, body_forward=term.body_forward * ratio,
                            body_backward=term.body_backward * ratio, **changes)
    else:
        term = body
    cost = spec.cost
    if cost is None and (stages != own or isinstance(term, Transpose)
                         or derived.seq_chunks > 1 or derived.pipelines):
        cost = CostModel()  # the standard costs written out, so they can be re-cut
    if cost:
        cost = cost.untiled(len(schedule.pipelines))
        recut = cost.rescaled(own, stages)
        cost = cost.moved(schedule.placement, len(schedule.pipelines) or 1,
                          derived.placement, len(derived.pipelines) or 1, recut.weights)
        cost = attrs.evolve(recut, static=cost.static).chunked(derived.seq_chunks).tiled(
            len(derived.pipelines))
    return Spec(term, term.derive(), cost, spec.memory_limit, name)


def simulation(spec: Spec, name: str, compare=(), memory_limit=None,
               comm_model: str = EAGER, target: Schedule | Plan | None = None
               ) -> tuple[dict, Timed, dict[str, Timed]]:
    """The ``simulate`` document, the spec's timed plan and each baseline's. The spec's
    plan is verified first; when it is not, the document says so and nothing is timed
    (``makespan`` None)."""
    mine = time_spec(spec, memory_limit, comm_model, target=target)
    doc = _doc(mine, name)
    if not mine.report.verified:
        return doc, mine, {}
    out: dict[str, Timed] = {}
    doc["compare"] = {}
    if compare:
        doc["inline_segment"] = (spec.term.segment if isinstance(spec.term, Transpose)
                                 else None)
    for family in compare:
        skip = not_comparable(spec, family)
        if skip is not None:
            doc["compare"][family] = {"skipped": skip}
            continue
        try:
            base = baseline_spec(spec, family)
        except ParameterError as e:
            raise ParameterError(f"--compare {family}: {e}") from None
        timed = time_spec(base, memory_limit, comm_model)
        out[family] = timed
        entry = _figures(timed)
        entry["speedup"] = (round(timed.run.makespan / mine.run.makespan, 6)
                            if mine.run.makespan else None)
        doc["compare"][family] = entry
    return doc, mine, out


def _figures(t: Timed) -> dict:
    run = t.run
    out = {"term": t.term, "makespan": figure(run.makespan),
           "bubble_fraction": round(run.bubble_fraction, 6),
           "peak_memory": figures(run.peak_memory),
           "within_limit": t.within_limit()}
    if t.report is not None:
        out["status"] = t.report.status
    return out


def _doc(t: Timed, name: str) -> dict:
    report = t.report
    doc = {"source": name, "term": t.term, "verified": report.verified,
           "status": report.status, "exit_code": report.exit_code,
           "memory_limit": ([figure(x) for x in t.memory_limit]
                            if isinstance(t.memory_limit, tuple) else figure(t.memory_limit))}
    if not report.verified:
        doc.update(makespan=None, bubble_fraction=None, peak_memory=figures(
            report.peak_memory),
            violations=[{"property": v.property, "message": v.message}
                        for v in report.violations], undecided=list(report.undecided))
        return doc
    del doc["status"]  # _figures puts it after the figures, as in each compare entry
    doc.update(_figures(t))
    run = t.run
    doc["busy"] = figures(dict(enumerate(run.busy)))
    doc["bubble"] = {str(r): round(b, 6) for r, b in enumerate(run.bubble)}
    doc["ranks"] = t.plan.num_ranks
    doc["microbatches"] = t.plan.num_microbatches
    doc["certificate"] = report.certificate.digest if report.certificate else None
    if "host_peak_memory" in report.stats:  # offloaded activations (docs/semantics.md §2.10)
        doc["host_peak_memory"] = report.stats["host_peak_memory"]
    return doc


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:.6g}"


def render_simulation(doc: dict) -> str:
    """The text form of a ``simulation`` document."""
    lines = [f"{doc['source']}: {doc['status'].upper()}; {doc['term']}"]
    if not doc["verified"]:
        lines.append("refusing to simulate a plan that is not verified "
                     "(mpipe-verify check says why):")
        lines.extend(f"  {v['property']}: {v['message']}" for v in doc.get("violations", ()))
        lines.extend(f"  undecided: {u}" for u in doc.get("undecided", ()))
        return "\n".join(lines) + "\n"
    limit = doc["memory_limit"]
    lines.append(f"  makespan {_num(doc['makespan'])}, bubble fraction "
                 f"{doc['bubble_fraction']:.1%}, memory limit "
                 f"{'none' if limit is None else limit}")
    lines.append(f"  {'rank':>4}  {'busy':>10}  {'bubble':>7}  {'peak memory':>11}")
    for r in sorted(doc["busy"], key=int):
        lines.append(f"  {r:>4}  {_num(doc['busy'][r]):>10}  {doc['bubble'][r]:>7.1%}  "
                     f"{_num(doc['peak_memory'][r]):>11}")
    if doc.get("host_peak_memory"):
        lines.append("  host peak memory: " + ", ".join(
            f"{r}: {_num(x)}" for r, x in sorted(doc["host_peak_memory"].items(),
                                                  key=lambda kv: int(kv[0]))))
    if doc.get("compare"):
        segment = doc.get("inline_segment")
        lines.append("compared on the same model and costs" + (
            f" (the segment {segment!r} inline on its home rank):" if segment else ":"))
        lines.append(f"  {'family':<18} {'makespan':>10}  {'bubble':>7}  {'peak memory':>11}  "
                     f"{'fits limit':>10}  {'than this spec':>15}")
        for fam, e in doc["compare"].items():
            if "skipped" in e:
                lines.append(f"  {fam:<18} skipped: {e['skipped']}")
                continue
            peak = max(e["peak_memory"].values(), default=0.0)
            fits = {None: "-", True: "yes", False: "NO"}[e["within_limit"]]
            lines.append(f"  {fam:<18} {_num(e['makespan']):>10}  {e['bubble_fraction']:>7.1%}  "
                         f"{_num(peak):>11}  {fits:>10}  "
                         f"{faster(e['makespan'], doc['makespan']):>15}")
        lines.append(f"  (than this spec: each family's makespan against this spec's "
                     f"{_num(doc['makespan'])})")
        lines.append("  ranked by makespan: " + ranking(doc))
    return "\n".join(lines) + "\n"


def ranking(doc: dict) -> str:
    """The spec and the families compared, fastest first, those over the limit marked."""
    rows = [("this spec", doc["makespan"], True)] + [
        (fam, e["makespan"], e["within_limit"] is not False)
        for fam, e in doc["compare"].items() if "skipped" not in e]
    rows.sort(key=lambda r: r[1])
    return ", ".join(f"{name} {_num(ms)}" + ("" if fits else " (over the limit)")
                     for name, ms, fits in rows)


def faster(makespan: float | None, than: float | None) -> str:
    """A run of ``makespan`` against one of ``than``, in words from the first one's side:
    ``1.294x faster`` (``than / makespan``), ``1.294x slower`` (``makespan / than``) or
    ``as fast`` (equal to the printed precision); ``-`` without both figures."""
    if not makespan or not than:
        return "-"
    ratio = than / makespan
    if f"{max(ratio, 1 / ratio):.3f}" == "1.000":
        return "as fast"
    return f"{ratio:.3f}x faster" if ratio > 1 else f"{1 / ratio:.3f}x slower"


class ScheduleTerm:
    """A schedule read from a file (a torch CSV) standing in for a term."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def derive(self) -> Schedule:
        return self.schedule

    def __str__(self) -> str:
        return "the file's schedule (no term)"
