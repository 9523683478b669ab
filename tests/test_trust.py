"""docs/trust.md's table of what a VERIFIED rests on states each part's size; this
recounts it from the code, so the table stays true as the code changes."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpipe_verified"


def sizes(path: pathlib.Path) -> tuple[int, int]:
    """``(lines, code lines)``: code lines are those neither blank, comments nor
    docstrings."""
    text = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) \
                and ast.get_docstring(node, clean=False) is not None:
            first = node.body[0]
            docs.update(range(first.lineno, first.end_lineno + 1))
    lines = text.splitlines()
    code = sum(1 for number, line in enumerate(lines, 1)
               if line.strip() and not line.strip().startswith("#") and number not in docs)
    return len(lines), code


def table_rows(heading: str = "## What you trust") -> list[tuple[list[pathlib.Path], str]]:
    """Each row of the table under ``heading`` that states a size: the package files its
    first cell names (a package, ``mpipe_verified/kernel/``, names all its modules), and
    its size cell."""
    text = (ROOT / "docs" / "trust.md").read_text()
    table = text[text.index(heading):].split("\n\n")[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not cells[-1]:
            continue
        names = re.findall(r"`((?:mpipe_verified/)?[\w/]+(?:\.py|/))`", cells[0])
        files = [f for n in names for f in (
            sorted((PACKAGE / n.removeprefix("mpipe_verified/")).glob("*.py"))
            if n.endswith("/") else [PACKAGE / n.removeprefix("mpipe_verified/")])]
        rows.append((files, cells[-1]))
    return rows


def _as_large_as_said(rows: list) -> None:
    for files, cell in rows:
        assert files and all(f.is_file() for f in files), (files, cell)
        lines = sum(sizes(f)[0] for f in files)
        code = sum(sizes(f)[1] for f in files)
        assert cell == f"{lines:,} lines, {code:,} code", (files, cell, lines, code)


def test_the_trusted_parts_are_as_large_as_the_table_says():
    rows = table_rows()
    assert len(rows) == 4  # the kernel, the shell, the readers, the IR
    _as_large_as_said(rows)


def test_the_kernel_s_modules_are_as_large_as_their_table_says():
    """The kernel's own table lists each of its modules once, with its size."""
    rows = table_rows("### The kernel's trusted surface")
    listed = [f for files, _ in rows for f in files]
    assert sorted(listed) == sorted((PACKAGE / "kernel").glob("*.py"))
    _as_large_as_said(rows)


def test_the_shell_imports_only_the_ir_and_the_kernel():
    tree = ast.parse((PACKAGE / "question.py").read_text())
    local = {node.module for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.level}
    assert local <= {"ir", None}  # ``from . import kernel``: module None
    names = {alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.level and node.module is None
             for alias in node.names}
    assert names == {"kernel"}
