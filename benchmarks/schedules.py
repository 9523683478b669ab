"""Every published schedule on the shipped models: the table of docs/schedules.md.

    python benchmarks/schedules.py

For each model it runs what ``mpipe-verify simulate SPEC --compare FAMILY ...`` runs
(``comparison.simulation``: the spec's plan verified and timed, each family on the same
model, verified and timed) and prints one Markdown table: a row per schedule, a column
per model, each cell the makespan and peak memory (``over`` where the peak exceeds the
model's limit, ``-`` with the reason below where the family cannot run the model); the
fastest schedule that fits each model is in bold. Then ``tune``'s pick on each model
(``mpipe-verify tune SPEC``). Deterministic: the same numbers on
every machine (tests/test_sim_dimensions.py checks the doc holds this output).
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpipe_verified.comparison import simulation  # noqa: E402
from mpipe_verified.formats.spec import load_spec  # noqa: E402
from mpipe_verified.tune import tune  # noqa: E402

MODELS = ("1f1b.toml", "long_sequence.toml", "mllm_transpose.toml")
FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev",
            "looped-bfs", "interleaved-zb", "hanayo", "dualpipe", "chimera", "bitpipe",
            "seq1f1b")


def columns() -> list[tuple[str, dict]]:
    """Per model: its file name and its ``simulate --compare`` document."""
    out = []
    for name in MODELS:
        path = ROOT / "examples" / name
        doc, _, _ = simulation(load_spec(path), f"examples/{name}", FAMILIES)
        out.append((name, doc))
    return out


def _cell(entry: dict, best: bool) -> str:
    if "skipped" in entry:
        return "-"
    peak = max(entry["peak_memory"].values(), default=0.0)
    text = f"{entry['makespan']:,.2f} / {peak:,.4g}"
    if entry["within_limit"] is False:
        return text + " over"
    return f"**{text}**" if best else text


def table() -> str:
    cols = columns()
    rows = [("the spec's own schedule", [doc for _, doc in cols])] + [
        (family, [doc["compare"][family] for _, doc in cols]) for family in FAMILIES]
    bests = []
    for i in range(len(cols)):  # ties go to the earlier row
        fits = [(entries[i]["makespan"], k, name) for k, (name, entries) in enumerate(rows)
                if "skipped" not in entries[i] and entries[i]["within_limit"] is not False]
        bests.append(min(fits)[2])
    lines = ["| schedule | " + " | ".join(f"`{name}`" for name, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for name, entries in rows:
        lines.append(f"| {name} | " + " | ".join(
            _cell(e, bests[i] == name) for i, e in enumerate(entries)) + " |")
    lines.append("")
    lines.append("Fastest that fits: " + "; ".join(
        f"`{name}`: {best}" for (name, _), best in zip(cols, bests)) + ".")
    skipped = sorted({(family, e["skipped"]) for family, entries in rows[1:]
                      for e in entries if "skipped" in e})
    for family, reason in skipped:
        lines.append(f"- `{family}` skipped: {reason}")
    lines.append("")
    lines.append("`tune`'s pick (every family, modifier and variant it searches; verified):")
    for name, _ in cols:
        best = tune(load_spec(ROOT / "examples" / name)).best
        lines.append(f"- `{name}`: {best.tried.candidate.label}, {best.tried.makespan:,.2f} / "
                     f"{best.tried.peak:,.4g}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
