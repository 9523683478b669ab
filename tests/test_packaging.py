"""What the installed distribution holds: one version, the proofs under the package's
namespace (no top-level ``proofs`` module), the ``py.typed`` marker, every subpackage."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib

from mpipe_verified.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_is_the_distribution_s(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"mpipe-verify {importlib.metadata.version('mpipe_verified')}"
    import mpipe_verified
    assert mpipe_verified.__version__ == importlib.metadata.version("mpipe_verified")


def test_proofs_install_inside_the_package_only():
    probe = ("import importlib.util, mpipe_verified.proofs as p; "
             "print(importlib.util.find_spec('proofs') is None, len(p.LAWS) > 0)")
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_py_typed_and_every_subpackage_ship():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in config["package-data"]["mpipe_verified"]
    assert (ROOT / "mpipe_verified" / "py.typed").is_file()
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "mpipe_verified").rglob("__init__.py")}
    assert set(config["packages"]) == on_disk | {"mpipe_verified.proofs"}
    assert config["package-dir"]["mpipe_verified.proofs"] == "proofs"


def test_torch_imports_without_the_numpy_warning():
    """The torch extra brings numpy: without it every ``import torch`` warns and torch's
    ``PipelineStage`` shape inference fails."""
    import pytest
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", "import torch; torch.zeros(2).numpy()"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "NumPy" not in out.stderr, out.stderr
