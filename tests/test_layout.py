"""The house's floors: no module of the package over 700 lines, no import cycle between
its modules (imports inside functions included), every import going to an entry above
in the README's Layout section, and that section naming every module and subpackage.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 700
SOURCES = {"mpipe_verified": ROOT / "mpipe_verified", "mpipe_verified.proofs": ROOT / "proofs"}


def modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file for every module of the installed package."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (the packages
    whose ``__init__`` such an import runs included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:  # a submodule by name, else a name of ``base``
                whole = re.sub(r"^proofs\b", "mpipe_verified.proofs", f"{base}.{alias.name}")
                targets.add(whole if whole in known else base)
    found = set()
    for target in targets:
        target = re.sub(r"^proofs\b", "mpipe_verified.proofs", target)
        while target and target not in known:
            target = target.rpartition(".")[0]
        # importing a.b.c runs the __init__ of a.b first, unless the importer is inside it
        while target and target != name and not name.startswith(target + "."):
            found.add(target)
            target = target.rpartition(".")[0]
            while target and target not in known:
                target = target.rpartition(".")[0]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_is_over_700_lines():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_import_cycle_between_modules():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_readme_layout_names_every_top_level_module_and_subpackage():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "mpipe_verified"
    top = [p.name for p in package.iterdir()
           if p.suffix == ".py" and p.name != "__init__.py"
           or p.is_dir() and (p / "__init__.py").exists()]
    missing = [name for name in sorted(top)
               if not re.search(rf"mpipe_verified/{re.escape(name)}", layout)]
    assert top and missing == []


def test_the_readme_layout_names_every_module_of_the_subpackages():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "mpipe_verified"
    missing = sorted(str(p.relative_to(package)) for p in package.glob("*/*.py")
                     if p.name != "__init__.py" and not re.search(rf"\b{p.stem}\b", layout))
    assert missing == []


def layout_floors() -> list[str]:
    """The README Layout's package entries, in its order (``mpipe_verified/ir.py`` ->
    ``mpipe_verified.ir``)."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^mpipe_verified/(\S+)", layout, flags=re.M)
    return ["mpipe_verified." + e.removesuffix("/").removesuffix(".py").replace("/", ".")
            for e in entries]


def test_every_import_goes_to_a_floor_above_in_the_layout():
    floors = layout_floors()

    def floor(module: str) -> int:
        return max(i for i, f in enumerate(floors) if module == f or module.startswith(f + "."))

    known = modules()
    upward = sorted((name, target) for name, path in known.items()
                    for target in imported(name, path, known)
                    if floor(target) > floor(name))
    assert upward == []
