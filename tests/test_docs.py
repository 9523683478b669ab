"""The project's docs stand on their own: nothing cites notes a clone does not have,
every ``docs/semantics.md §N`` citation names a section or rule that exists there, the
help texts' README references name real sections, user docs carry no internal history,
and the paper the transpose comes from is cited by its arXiv number wherever it is named.
"""

from __future__ import annotations

import pathlib
import re

from mpipe_verified.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEMANTICS = ROOT / "docs" / "semantics.md"
NOTES = re.compile("DES" + "IGN|" + r"\.\./" + "shared")  # spelt apart: this file is scanned too
SKIP = {".git", ".venv", "out", "__pycache__", ".pytest_cache", ".hypothesis", "build"}


def project_files() -> list[pathlib.Path]:
    return [p for p in ROOT.rglob("*") if p.is_file() and not SKIP & set(p.parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
            and p.suffix in (".py", ".md", ".toml", ".txt", ".yaml", ".csv", "")]


def test_nothing_cites_notes_outside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in project_files()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if NOTES.search(line)]
    assert hits == []


def semantics_anchors() -> set[str]:
    """``N`` for each ``## N.`` section and ``N.K`` for each numbered rule under it."""
    anchors, section = set(), None
    for line in SEMANTICS.read_text().splitlines():
        if m := re.match(r"## (\d+)\. ", line):
            section = m.group(1)
            anchors.add(section)
        elif section and (m := re.match(r"(\d+)\. \S", line)):
            anchors.add(f"{section}.{m.group(1)}")
    return anchors


def test_every_semantics_citation_names_an_existing_section_or_rule():
    anchors = semantics_anchors()
    assert {"1", "2", "3", "4", "5", "6", "2.1", "2.8"} <= anchors
    cited = set()
    for p in project_files():
        for a, _, b in re.findall(r"§(\d+(?:\.\d+)?)(?:([–-])(\d+(?:\.\d+)?))?",
                                  p.read_text(errors="replace")):
            cited.add((str(p.relative_to(ROOT)), a))
            if b:
                cited.add((str(p.relative_to(ROOT)), b))
    missing = sorted(c for c in cited if c[1] not in anchors)
    assert cited and missing == [], missing


def test_the_readme_links_the_semantics_and_help_cites_real_sections():
    readme = (ROOT / "README.md").read_text()
    assert "](docs/semantics.md)" in readme
    headings = re.findall(r"^#+ (.+)$", readme, re.M)
    texts = []
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for cmd in sub.choices.values():
        texts.append(cmd.description or "")
        texts.extend(a.help or "" for a in cmd._actions)
    sections = [s for t in texts for s in re.findall(r"README, section (\w[\w-]*)", t)]
    assert sections, "the help texts cite no README section"
    for name in sections:
        assert any(re.search(rf"\b{re.escape(name)}\b", h) for h in headings), name


def test_user_docs_hold_no_internal_history():
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
    for p in docs:
        text = p.read_text()
        for phrase in (r"\bissue \d+", r"Targets met", r"that code is gone"):
            assert not re.search(phrase, text), (p.name, phrase)


def test_the_paper_is_cited_where_it_is_named():
    for p in project_files():
        text = p.read_text(errors="replace")
        if "HyperParallel" in text:
            assert "2607.03229" in text, p.relative_to(ROOT)
