"""The road ``check`` takes for a standard family instance (``check.parametric.road``):
op by op for a small plan, the family's laws from a cached proof, or proven now for a
big one; and the cache of law proofs: keyed by the package's content, in the user's
cache directory, ignoring every damaged entry."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mpipe_verified.cli import main
from mpipe_verified.proofs.covering import needed_laws
from mpipe_verified.check import parametric
from test_cli_check import check_json, family_argv

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
P48 = {"pp": 4, "microbatches": 8, "chunks": None}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty cache directory of the test's own, through ``XDG_CACHE_HOME``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "mpipe-verify" / "laws"


@pytest.fixture
def pinned(monkeypatch) -> str:
    """The package's digest, as it is now, for the whole test: another hand editing the
    tree meanwhile (a proof is not cached when the code changed while it ran) must not
    make the test flaky. ``test_the_package_digest_covers_every_file_and_nothing_else``
    tests the digest itself."""
    digest = parametric.package_digest()
    monkeypatch.setattr(parametric, "package_digest", lambda: digest)
    return digest


@pytest.fixture
def provers(monkeypatch) -> list:
    """Count the times the laws are proven now (``prove_laws``), proving them as usual."""
    calls: list = []
    real = parametric.prove_laws
    monkeypatch.setattr(parametric, "prove_laws",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def names(family="1f1b", params=P48) -> list[str]:
    return [law.name for law in needed_laws(family, params)]


# ---------------------------------------------------------------- the road


def test_a_small_plan_goes_op_by_op_and_never_loads_the_laws():
    """``check examples/zbv.toml`` is the op-by-op check, as ``--expand`` is: no prover is
    started and the laws are not even imported (what made it 10x slower than its plan)."""
    code = ("import sys; from mpipe_verified.cli import main; "
            "rc = main(['check', 'examples/zbv.toml', '-q']); "
            "print(rc, 'mpipe_verified.proofs.covering' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["0", "False"], proc.stderr[-2000:]


@pytest.mark.parametrize("spec", ["zbv", "dualpipev", "1f1b", "gpipe", "zb-h1", "zb-h2",
                                  "interleaved-1f1b"])
def test_every_standard_example_is_checked_as_its_expand_is(capsys, spec, provers):
    path = str(EXAMPLES / f"{spec}.toml")
    code, doc = check_json(capsys, path)
    _, expanded = check_json(capsys, path, "--expand")
    assert code == 0 and doc["proof"] == expanded["proof"] == {"kind": "instance"}
    assert doc["certificate"] == expanded["certificate"] and provers == []


def test_the_road_by_size_and_cache():
    big = {"pp": 1024, "microbatches": 4096, "chunks": None}
    mid = {"pp": 16, "microbatches": 64, "chunks": None}  # 3*16*64 + 4*15*64 ops: between
    assert parametric.estimated_ops("1f1b", P48) < parametric.EXPAND_BELOW
    assert (parametric.EXPAND_BELOW <= parametric.estimated_ops("1f1b", mid)
            <= parametric.PROVE_ABOVE < parametric.estimated_ops("1f1b", big))
    yes, no = (lambda: True), (lambda: False)
    assert parametric.road("1f1b", P48, cached=yes) == "instance"  # not even looked up
    assert parametric.road("1f1b", mid, cached=no) == "instance"
    assert parametric.road("1f1b", mid, cached=yes) == "cached"
    assert parametric.road("1f1b", big, cached=no) == "prove"
    assert parametric.road("1f1b", big, cached=yes) == "cached"
    assert parametric.road("1f1b", P48, "laws", cached=no) == "prove"
    assert parametric.road("1f1b", P48, "laws", cached=yes) == "cached"


def test_estimates_are_upper_bounds_close_to_the_plans():
    """The road is picked from the parameters alone: the estimate is at least the
    plan's op count and at most about 1.6 times it (DualPipeV overlaps steps)."""
    from mpipe_verified.algebra.families import family
    from mpipe_verified.algebra.transpose import transpose_family
    from mpipe_verified.lower import lower
    for name, p, m, v in [("zbv", 4, 8, None), ("1f1b", 8, 16, None), ("gpipe", 3, 5, None),
                          ("zb-h1", 4, 8, None), ("zb-h2", 4, 8, None),
                          ("interleaved-1f1b", 4, 8, 2), ("dualpipev", 4, 8, None)]:
        ops = lower(family(name, p, m, v).derive()).num_ops
        estimate = parametric.estimated_ops(name, {"pp": p, "microbatches": m, "chunks": v})
        assert ops <= estimate <= 1.6 * ops, (name, ops, estimate)
    for mode in ("recompute", "owner"):
        ops = lower(transpose_family(4, 8, body="1f1b", side="source", mode=mode,
                                     ownership="inline").derive()).num_ops
        estimate = parametric.estimated_ops("transpose", {"pp": 4, "microbatches": 8,
                                                          "chunks": None, "body": "1f1b"})
        assert ops <= estimate <= 1.6 * ops, (mode, ops, estimate)


def test_a_cached_proof_answers_a_mid_size_instance_and_a_fresh_proof_a_big_one(
        capsys, cache, provers, monkeypatch, pinned):
    """Without a cached proof a mid-size instance goes op by op; ``--laws`` proves the
    laws now and caches them; then the same family answers from the cache, at any size,
    without proving again; ``--no-cache`` proves them again and ``--expand`` asks none."""
    monkeypatch.setattr(parametric, "EXPAND_BELOW", 0)  # every instance is "mid-size"
    argv = family_argv("1f1b", 3, 5)
    code, doc = check_json(capsys, *argv)
    assert code == 0 and doc["proof"] == {"kind": "instance"} and provers == []
    assert not cache.exists()
    code, doc = check_json(capsys, *argv, "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric" and len(provers) == 1
    assert len(list(cache.glob("*.json"))) == 1
    for other in (argv, family_argv("1f1b", 7, 9), family_argv("1f1b", 7, 9) + ["--laws"]):
        code, doc = check_json(capsys, *other)
        assert code == 0 and doc["proof"]["kind"] == "parametric", other
    assert len(provers) == 1  # all from the cache
    code, out, _ = _check(capsys, *family_argv("1f1b", 7, 9))
    assert code == 0 and len(out.splitlines()) <= 2
    assert out.startswith("--family 1f1b: VERIFIED (7 ranks, 9 microbatches, by the 1f1b "
                          "laws for all sizes (cached proof), peak memory 7, ")
    code, out, _ = _check(capsys, *family_argv("1f1b", 7, 9), "--verbose")
    assert "proven by Z3 earlier by this same package (cached proof)" in out
    code, doc = check_json(capsys, *argv, "--no-cache")
    assert code == 0 and doc["proof"] == {"kind": "instance"} and len(provers) == 1
    code, doc = check_json(capsys, *argv, "--no-cache", "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric" and len(provers) == 2
    code, doc = check_json(capsys, *argv, "--expand")
    assert code == 0 and doc["proof"] == {"kind": "instance"}
    monkeypatch.setattr(parametric, "PROVE_ABOVE", 0)  # every instance is "big"
    code, doc = check_json(capsys, *family_argv("gpipe", 3, 5))
    assert code == 0 and doc["proof"]["kind"] == "parametric" and len(provers) == 3
    assert len(list(cache.glob("*.json"))) == 2


def _check(capsys, *argv):
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_laws_and_expand_together_are_refused(capsys):
    code, out, err = _check(capsys, *family_argv("1f1b", 2, 2), "--laws", "--expand")
    assert (code, out) == (2, "") and err.count("\n") == 1 and "--expand" in err


def test_a_proof_that_fails_is_never_cached(capsys, cache, monkeypatch):
    monkeypatch.setattr(parametric, "prove_laws", lambda *a, **k: (False, 0))
    code, doc = check_json(capsys, *family_argv("1f1b", 3, 5), "--laws")
    assert code == 0 and doc["proof"] == {"kind": "instance"}
    assert not cache.exists() or list(cache.iterdir()) == []


# ---------------------------------------------------------------- the cache


def test_the_cache_lives_in_xdg_cache_home_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert parametric.cache_dir() == str(tmp_path / "x" / "mpipe-verify" / "laws")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored (XDG)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parametric.cache_dir() == str(tmp_path / "home" / ".cache" / "mpipe-verify" / "laws")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert parametric.cache_dir() == str(tmp_path / "home" / ".cache" / "mpipe-verify" / "laws")


def test_an_entry_round_trips_and_names_this_package(cache, pinned):
    store = parametric.Cache()
    assert store.proved("1f1b", names()) is None
    store.store("1f1b", names(), 47)
    assert store.proved("1f1b", names()) == 47
    assert parametric.Cache().proved("1f1b", names()) == 47
    assert parametric.Cache().proved("gpipe", names()) is None  # another family's key
    assert parametric.Cache().proved("1f1b", names()[:4]) is None  # other laws
    entry = json.loads(next(cache.glob("*.json")).read_text())
    assert entry["key"]["package"] == pinned
    assert entry["key"]["family"] == "1f1b" and entry["key"]["laws"] == names()


def _damage(path: pathlib.Path, how: str) -> None:
    text = path.read_text()
    entry = json.loads(text)
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
    elif how == "not json":
        path.write_bytes(b"\xff\xfe garbage")
    elif how == "a list":
        path.write_text("[]")
    elif how == "obligations changed":
        entry["obligations"] += 1
        path.write_text(json.dumps(entry))
    elif how == "proved false":
        entry["proved"] = False
        path.write_text(json.dumps(entry))
    elif how == "another package, checksum redone":
        entry["key"]["package"] = "0" * 64
        entry["check"] = parametric._checksum(entry)
        path.write_text(json.dumps(entry))
    elif how == "obligations 0, checksum redone":
        entry["obligations"] = 0
        entry["check"] = parametric._checksum(entry)
        path.write_text(json.dumps(entry))
    elif how == "an extra field":
        entry["extra"] = 1
        path.write_text(json.dumps(entry))
    elif how == "huge":
        path.write_text(" " * (parametric.CACHE_MAX_BYTES + 1) + text)
    elif how == "deeply nested":
        path.write_text("[" * 100000 + "]" * 100000)
    elif how == "a directory":
        path.unlink()
        path.mkdir()


DAMAGE = ["truncated", "not json", "a list", "obligations changed", "proved false",
          "another package, checksum redone", "obligations 0, checksum redone",
          "an extra field", "huge", "deeply nested", "a directory"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_entry_is_ignored_and_proven_over(capsys, cache, provers, how, pinned):
    """A bad entry is never trusted: the laws are proven again (and the entry rewritten,
    where it is a file)."""
    assert check_json(capsys, *family_argv("1f1b", 3, 5), "--laws")[0] == 0
    assert len(provers) == 1
    path = next(cache.glob("*.json"))
    _damage(path, how)
    assert parametric.Cache().proved("1f1b", names()) is None
    code, doc = check_json(capsys, *family_argv("1f1b", 3, 5), "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric" and len(provers) == 2
    if how != "a directory":
        assert parametric.Cache().proved("1f1b", names()) == doc["stats"]["obligations"]


def test_any_change_to_the_package_is_another_key(cache, monkeypatch, pinned):
    parametric.Cache().store("1f1b", names(), 47)
    assert parametric.Cache().proved("1f1b", names()) == 47
    monkeypatch.setattr(parametric, "package_digest", lambda: "f" * 64)
    assert parametric.Cache().proved("1f1b", names()) is None


def test_the_package_digest_covers_every_file_and_nothing_else(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    (root / "data.txt").write_text("z")
    digest = lambda: parametric.tree_digest([("pkg", str(root))])
    first = digest()
    assert digest() == first
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (root / "sub" / "c.pyc").write_bytes(b"\0")
    assert digest() == first  # compiled bytecode is not the source
    seen = {first}
    for edit in (lambda: (root / "a.py").write_text("x = 2\n"),       # one byte
                 lambda: (root / "sub" / "b.py").write_text("y = 2\n\n"),
                 lambda: (root / "data.txt").write_text("zz"),
                 lambda: (root / "new.py").write_text(""),            # a file added
                 lambda: (root / "new.py").rename(root / "sub" / "new.py")):  # moved
        edit()
        assert digest() not in seen
        seen.add(digest())
    assert parametric.package_digest() == parametric.package_digest()


def test_a_cache_that_cannot_be_written_is_left_alone(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    code, doc = check_json(capsys, *family_argv("1f1b", 3, 5), "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"
    assert parametric.Cache().proved("1f1b", names()) is None


def test_no_cache_neither_reads_nor_writes(capsys, cache, provers):
    code, doc = check_json(capsys, *family_argv("1f1b", 3, 5), "--laws", "--no-cache")
    assert code == 0 and doc["proof"]["kind"] == "parametric" and len(provers) == 1
    assert not cache.exists()


def test_a_console_run_fills_and_reads_the_cache(tmp_path):
    """The installed command, twice, with its own ``XDG_CACHE_HOME``: the first run
    proves the laws (of a 1024-rank instance: the laws' road) and keeps the proof, the
    second answers from it."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "c"))
    script = pathlib.Path(sys.executable).with_name("mpipe-verify")
    argv = [str(script), "check", *family_argv("zb-h1", 1024, 4096)]
    outs = [subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
            for _ in range(2)]
    assert [o.returncode for o in outs] == [0, 0], outs[0].stderr
    assert "by the zb-h1 laws for all sizes" in outs[0].stdout
    assert "(cached proof)" not in outs[0].stdout and "(cached proof)" in outs[1].stdout
    assert len(list((tmp_path / "c" / "mpipe-verify" / "laws").glob("*.json"))) == 1
