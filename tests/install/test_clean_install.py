"""A clean install works: a venv with only torch (no numpy), then a non-editable
``pip install . backends/hyperpar-cpu`` (numpy must arrive as a declared dependency), then TP,
checkpoint save/load and DTensor random init on 2 ranks from a folder outside the checkout.

The venv (torch, about 1 GB) is made once and kept under the temporary folder, keyed by the
Python and the torch version; every run removes numpy and hyperpar from it first, so each run
checks the install from torch alone. It needs the package index for numpy and setuptools (and
takes ``torch==2.13.*`` from the local wheel folder when pip is configured with one)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("clean_install_script.py")
TORCH = torch.__version__.split("+")[0]


def _venv_dir() -> Path:
    key = hashlib.sha256(f"{sys.version}|{TORCH}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"hyperpar-clean-install-{key}"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def _torch_only_venv() -> Path:
    """A venv holding torch (and what torch depends on) but neither numpy nor hyperpar."""
    venv = _venv_dir()
    py = venv / "bin" / "python"
    ready = venv / ".torch-installed"
    if not ready.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        proc = _run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}"], timeout=1800)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ready.touch()
    _run([str(py), "-m", "pip", "uninstall", "-y", "-q", "numpy", "hyperpar", "hyperpar-cpu"],
         timeout=300)
    return py


@pytest.mark.timeout(2400)
def test_non_editable_install_from_torch_alone_runs_on_two_ranks(tmp_path: Path) -> None:
    py = _torch_only_venv()
    probe = _run([str(py), "-c", "import numpy"], cwd=tmp_path, timeout=60)
    assert probe.returncode != 0, "numpy must not be in the venv before hyperpar is installed"

    # Copy the sources so the build never writes into the checkout (build/, *.egg-info).
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                    "site", "bench-results")
    shutil.copytree(ROOT / "hyperpar", src / "hyperpar", ignore=ignore)
    shutil.copytree(ROOT / "backends" / "hyperpar-cpu", src / "backends" / "hyperpar-cpu",
                    ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    proc = _run([str(py), "-m", "pip", "install", "-q", str(src), str(src / "backends" /
                                                                      "hyperpar-cpu")],
                cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(SCRIPT, work / "check.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HYPERPAR_BACKEND"] = "cpu"
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
    proc = _run([str(py.parent / "hyperpar"), "run", "-n", "2", "check.py",
                 str(tmp_path / "ckpt")], cwd=work, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0: clean-install checks OK" in out, out
    assert "rank 1: clean-install checks OK" in out, out
    assert "Numpy is not available" not in out, out
    probe = _run([str(py), "-c", "import numpy"], cwd=tmp_path, timeout=60)
    assert probe.returncode == 0, "numpy was not installed as a dependency of hyperpar"
