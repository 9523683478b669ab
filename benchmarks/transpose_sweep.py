"""Where the transpose schedule pays, and where it stops paying (docs/transpose.md).

Run:  python benchmarks/transpose_sweep.py            (every table, ~2 minutes)
      python benchmarks/transpose_sweep.py --quick    (8-rank tables only, seconds)

Every figure is ``sim.simulate`` of a lowered plan with the example specs' cost models
(``comparison.time_spec``); a baseline is the same model under ``1f1b`` or
``interleaved-1f1b`` with the encoder inline on rank 0 (``comparison.baseline_spec``).
Table 1 verifies every transposed plan (with the spec's memory limit) before timing it;
the sweeps only time.

1. step time of the shipped examples (8 and 64 ranks), trainable (recompute, owner) and
   frozen, against both inline baselines;
2. encoder share (8 ranks): the ViT's costs scaled so its mean forward is a given multiple
   of one body stage's forward;
3. collective cost (8 ranks, trainable): the ViT's parameter bytes (broadcast at the start,
   gradients all-reduced at the end) from 0.3B to 12B parameters;
4. microbatches (8 ranks): the same model with m = 8 .. 64 (per-sample tile counts cycled).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import attrs

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpipe_verified.algebra.families import family  # noqa: E402
from mpipe_verified.comparison import baseline_spec, time_spec  # noqa: E402
from mpipe_verified.formats.spec import load_spec  # noqa: E402
from mpipe_verified.spec import Spec  # noqa: E402

EXAMPLES = ROOT / "examples"
BASELINES = ("1f1b", "interleaved-1f1b")


def with_term(spec: Spec, **changes) -> Spec:
    """``spec`` with its transpose term changed (and re-derived)."""
    term = attrs.evolve(spec.term, **changes)
    return Spec(term, term.derive(), spec.cost, spec.memory_limit, spec.file)


def with_mode(spec: Spec, mode: str) -> Spec:
    return with_term(spec, mode=mode)


def scaled_encoder(spec: Spec, factor: float) -> Spec:
    """The ViT's durations times ``factor`` (the term's placement estimate too)."""
    seg = spec.cost.segment("vision")

    def times(v):
        if v is None:
            return None
        return tuple(x * factor for x in v) if isinstance(v, tuple) else v * factor
    cost = attrs.evolve(spec.cost, segments=(("vision", attrs.evolve(
        seg, F=times(seg.F), B=times(seg.B), R=times(seg.R))),))
    term = attrs.evolve(spec.term, costs=tuple(c * factor for c in spec.term.costs))
    return Spec(term, term.derive(), cost, spec.memory_limit, spec.file)


def with_microbatches(spec: Spec, m: int) -> Spec:
    """The same model with ``m`` microbatches (per-sample costs cycled); the example's
    body is interleaved-1f1b."""
    seg = spec.cost.segment("vision")

    def cycle(v):
        if not isinstance(v, tuple):
            return v
        return tuple(v[k % len(v)] for k in range(m))
    old = spec.term.body
    body = family("interleaved-1f1b", old.ranks, m, old.chunks)
    cost = attrs.evolve(spec.cost, segments=(("vision", attrs.evolve(
        seg, F=cycle(seg.F), B=cycle(seg.B), R=cycle(seg.R))),))
    term = attrs.evolve(spec.term, body=body, costs=cycle(spec.term.costs))
    return Spec(term, term.derive(), cost, spec.memory_limit, spec.file)


def mean(xs) -> float:
    return sum(xs) / len(xs)


def table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(out)


def ms(x: float) -> str:
    return f"{x:,.0f}"


def step_times(name: str, trainable: Spec, frozen: Spec) -> list[list]:
    """Per encoder kind: both inline baselines (the same plans for recompute and owner:
    inline, the home rank runs forward and backward), then each transposed variant."""
    rows = []
    groups = (("trainable", (("recompute", with_mode(trainable, "recompute")),
                             ("owner", with_mode(trainable, "owner")))),
              ("frozen", (("frozen", frozen),)))
    for kind, variants in groups:
        first = variants[0][1]
        bases = {f: time_spec(baseline_spec(first, f), check=False) for f in BASELINES}
        ref = bases["interleaved-1f1b"].run.makespan
        timed = [(f"{f}, encoder inline", t) for f, t in bases.items()]
        for label, spec in variants:
            mine = time_spec(spec)
            assert mine.report.verified, (name, label, mine.report.status)
            timed.append((f"transpose {label} (cost)", mine))
        for sched, t in timed:
            rows.append([name, kind, sched, ms(t.run.makespan), f"{t.run.bubble_fraction:.1%}",
                         f"{max(t.run.peak_memory.values()):.1f}",
                         "yes" if t.within_limit() else "no", f"{ref / t.run.makespan:.2f}x"])
    return rows


def share_sweep(trainable: Spec, frozen: Spec) -> list[list]:
    stage_f = trainable.cost.F
    base = mean(trainable.cost.segment("vision").F) / stage_f
    rows = []
    for share in (0.1, 0.25, 0.5, 1.0, round(base, 2), 2.0, 3.0, 4.0):
        row = [f"{share:g}"]
        for mode, spec in (("frozen", frozen), ("recompute", with_mode(trainable, "recompute")),
                           ("owner", trainable)):
            s = scaled_encoder(spec, share / base)
            mine = time_spec(s, check=False).run.makespan
            inline = time_spec(baseline_spec(s, "interleaved-1f1b"), check=False).run.makespan
            row.append(f"{ms(mine)} / {ms(inline)} = {inline / mine:.2f}x")
        body = attrs.evolve(trainable.term, mode="none", costs=())
        alone = Spec(body.body, body.body.derive(), trainable.cost, None, "")
        row.append(ms(time_spec(alone, check=False).run.makespan))
        rows.append(row)
    return rows


def collective_sweep(trainable: Spec) -> list[list]:
    rows = []
    for params, label in ((0.3e9, "0.3B (InternViT-300M)"), (1.0e9, "1B"), (3.0e9, "3B"),
                          (6.0e9, "6B (InternViT-6B)"), (12.0e9, "12B")):
        comm = attrs.evolve(trainable.cost.comm, parameter_bytes=2 * params)
        row = [label, f"{2 * params / 1e9:g} GB"]
        for mode in ("recompute", "owner"):
            s = with_mode(trainable, mode)
            s = attrs.evolve(s, cost=attrs.evolve(s.cost, comm=comm))
            mine = time_spec(s, check=False).run.makespan
            inline = time_spec(baseline_spec(s, "interleaved-1f1b"), check=False).run.makespan
            row.append(f"{inline / mine:.2f}x")
        rows.append(row)
    return rows


def microbatch_sweep(trainable: Spec, frozen: Spec) -> list[list]:
    rows = []
    for m in (4, 8, 16, 32, 64):
        row = [str(m)]
        for mode, spec in (("frozen", frozen), ("recompute", with_mode(trainable, "recompute")),
                           ("owner", trainable)):
            s = with_microbatches(spec, m)
            mine = time_spec(s, check=False).run.makespan
            inline = time_spec(baseline_spec(s, "interleaved-1f1b"), check=False).run.makespan
            row.append(f"{inline / mine:.2f}x")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 64-rank example")
    args = parser.parse_args(argv)
    t8 = load_spec(EXAMPLES / "mllm_transpose.toml")
    f8 = load_spec(EXAMPLES / "mllm_transpose_frozen.toml")
    rows = step_times("8 ranks", t8, f8)
    if not args.quick:
        rows += step_times("64 ranks", load_spec(EXAMPLES / "mllm_transpose_64.toml"),
                           load_spec(EXAMPLES / "mllm_transpose_64_frozen.toml"))
    print("## 1. Step time of the shipped examples (ms; memory limit 72 GB)\n")
    print(table(["config", "encoder", "schedule", "step time", "bubble", "peak memory",
                 "fits", "speedup vs interleaved-1f1b inline"], rows))
    print("\n## 2. Encoder share (8 ranks): transposed / inline interleaved-1f1b step time\n")
    print(table(["ViT fwd / stage fwd", "frozen", "trainable, recompute", "trainable, owner",
                 "body alone"], share_sweep(t8, f8)))
    print("\n## 3. Collective cost (8 ranks): speedup over inline interleaved-1f1b\n")
    print(table(["ViT parameters", "bf16 bytes", "recompute", "owner"],
                collective_sweep(t8)))
    print("\n## 4. Microbatches (8 ranks): speedup over inline interleaved-1f1b\n")
    print(table(["m", "frozen", "recompute", "owner"], microbatch_sweep(t8, f8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
