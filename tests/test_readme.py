"""Every command in README.md runs as written, and every picture it shows is what the
command beside it draws.

Commands are the lines of the README's fenced ``sh`` blocks (and the ``$ `` lines of
``console`` blocks), in document order, run with bash in a temporary copy of the
repository (so ``out/`` and ``docs/gallery/`` are written there, never here), with this
environment's ``mpipe-verify`` and ``python`` first on ``PATH``. A command's expected exit
code is 0 unless its trailing comment says ``# exit N``. Skipped: ``make demo`` and ``make
test`` (they are the suite itself) and commands that need the network (``pip``, ``git``,
``curl``, ``wget``, ``pre-commit``); the PyTorch commands when torch is not installed.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP = re.compile(r"^(make (demo|test)\b|pip\b|git\b|curl\b|wget\b|pre-commit\b)")
NEEDS_TORCH = re.compile(r"torch_schedule\.py|out/torch-")
HAS_TORCH = importlib.util.find_spec("torch") is not None
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "out", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "*.egg-info", "build")


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of every fenced code block, in order."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*([\w+-]*)\s*$", line)
        if fence and lang is None:
            lang, lines = fence.group(1), []
        elif fence:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def readme_commands(text: str) -> list[str]:
    """The shell commands of the ``sh``/``console`` blocks (continuations joined)."""
    out = []
    for lang, lines in fenced_blocks(text):
        if lang not in ("sh", "console"):
            continue
        pending = ""
        for raw in lines:
            line = raw.strip()
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not pending and (not line or line.startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            out.append(pending + line)
            pending = ""
    return out


def expected_code(command: str) -> int:
    m = re.search(r"#\s*exit (\d+)", command)
    return int(m.group(1)) if m else 0


TEXT = README.read_text(encoding="utf-8")
COMMANDS = readme_commands(TEXT)
RUN = [c for c in COMMANDS if not SKIP.match(c)]
PICTURES = sorted(set(re.findall(r"!\[[^\]]*\]\(([^)\s]+\.svg)\)", TEXT)))


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Run every README command once, in order, in a copy of the repository."""
    work = tmp_path_factory.mktemp("readme") / "repo"
    shutil.copytree(ROOT, work, ignore=COPY_IGNORE)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""), COLUMNS="100")

    def run_all(commands: list[str]) -> dict:
        return {c: subprocess.run(["bash", "-c", c], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=300, stdin=subprocess.DEVNULL)
                for c in commands}
    # The PyTorch commands only read what they write (out/torch-*): they run beside the
    # others, which run in README order.
    torch_part = [c for c in RUN if NEEDS_TORCH.search(c)] if HAS_TORCH else []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        side = pool.submit(run_all, torch_part)
        results = run_all([c for c in RUN if not NEEDS_TORCH.search(c)])
        results.update(side.result())
    results["__root__"] = work
    return results


def test_quickstart_is_exactly_make_demo_and_make_test():
    section = TEXT.split("## Quickstart", 1)[1]
    first = fenced_blocks(section)[0][1]
    assert [line.strip() for line in first if line.strip()] == ["make demo", "make test"]


def test_the_readme_has_commands_for_every_subcommand():
    from mpipe_verified.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    used = {m.group(1) for c in COMMANDS for m in re.finditer(r"mpipe-verify (\w+)", c)}
    assert set(sub.choices) <= used, f"README shows no command for {set(sub.choices) - used}"
    assert any(expected_code(c) == 1 for c in RUN), "no intentionally failing example"


@pytest.mark.parametrize("command", RUN)
def test_readme_command_runs(ran, command):
    if command not in ran:
        pytest.skip("needs torch")
    proc = ran[command]
    assert proc.returncode == expected_code(command), (
        f"{command!r} exited {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\n"
        f"stderr:\n{proc.stderr[-2000:]}")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("picture", PICTURES)
def test_picture_is_drawn_by_the_command_beside_it(ran, picture):
    drawers = [c for c in RUN if re.search(rf"(^|\s){re.escape(picture)}(\s|$)", c)]
    assert drawers, f"no README command writes {picture}"
    committed = ROOT / picture
    assert committed.is_file(), f"{picture} is shown but not committed"
    drawn = ran["__root__"] / picture
    assert drawn.read_bytes() == committed.read_bytes(), (
        f"{picture} differs from what {drawers[-1]!r} draws; rerun that command")


def test_readme_parsing():
    text = ("x\n```sh\n# comment\nmpipe-verify a \\\n  --b   # exit 1\n\n```\n"
            "```console\n$ mpipe-verify c\noutput line\n```\n```\nmake demo\n```\n")
    assert readme_commands(text) == ["mpipe-verify a --b   # exit 1", "mpipe-verify c"]
    assert expected_code(readme_commands(text)[0]) == 1


def _demo_commands() -> list[str]:
    """The ``mpipe-verify`` lines of the Makefile's ``demo`` target, as shell commands
    (``$(BIN)/`` dropped: this environment's command is first on ``PATH``)."""
    text = (ROOT / "Makefile").read_text()
    body = text.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    return [line.strip().replace("$(BIN)/", "") for line in body.splitlines()
            if "mpipe-verify " in line]


def test_make_demo_and_the_readme_recheck_do_not_share_a_certificate(tmp_path):
    """``make demo`` certifies out/zb-h1.csv and the README's recheck block out/zb-h1.json:
    each writes its own certificate, so either runs again after the other (they used to
    share out/zb-h1.cert.json, and a recheck then met the other plan's certificate)."""
    demo = _demo_commands()
    block = [c for c in COMMANDS if "zb-h1.json" in c and expected_code(c) == 0]
    written = lambda cmds: {m.group(1) for c in cmds
                            for m in re.finditer(r"--certificate-out (\S+)", c)}
    assert written(demo) and written(block) and not written(demo) & written(block)
    for cmds in (demo, block):
        for cert in written(cmds):  # each recheck reads the certificate its check wrote
            assert any(c.startswith("mpipe-verify recheck") and c.endswith(cert)
                       for c in cmds), (cert, cmds)
    work = tmp_path / "repo"
    shutil.copytree(ROOT / "examples", work / "examples")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    steps = [c for c in demo if not c.startswith("mpipe-verify show")]
    for command in [*steps, *block, *steps, *block]:
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
