"""What the installed package promises: its wheel carries the licence, ``py.typed`` and its
run-time dependencies; ``from hyperpar import *`` leaves the standard library alone; the pytest
plugin costs no torch import; ``hyperpar bench`` outside a checkout says what it needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_star_import_keeps_the_standard_library_inspect_and_platform(tmp_path: Path) -> None:
    code = (
        "import inspect, platform\n"
        "from hyperpar import *\n"
        "assert inspect.getsource is not None and inspect.__name__ == 'inspect', inspect\n"
        "assert platform.__name__ == 'platform' and platform.python_version(), platform\n"
        "assert 'init_device_mesh' in dir() and 'checkpoint' in dir()\n"
        "import hyperpar\n"
        "assert hyperpar.inspect.__name__ == 'hyperpar.inspect'\n"
        "assert hyperpar.platform.__name__ == 'hyperpar.platform'\n"
        "assert {'inspect', 'platform'} <= set(dir(hyperpar))\n"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_pytest_plugin_does_not_import_torch(tmp_path: Path) -> None:
    """The plugin (auto-loaded by the pytest11 entry point) is in every pytest session of the
    environment; a session that uses none of its fixtures must not pay for importing torch."""
    (tmp_path / "test_trivial.py").write_text(
        "import sys\n\n"
        "def test_no_torch(pytestconfig):\n"
        "    assert pytestconfig.pluginmanager.has_plugin('hyperpar'), 'plugin not loaded'\n"
        "    assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_trivial.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_outside_a_checkout_says_what_it_needs(tmp_path: Path) -> None:
    proc = _python("import sys; from hyperpar.cli import main; sys.exit(main(['bench']))",
                   tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not part of the installed package" in proc.stderr, proc.stderr
    assert "checkout" in proc.stderr and "--dir" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src")  # a copy: building writes build/ and *.egg-info
    shutil.copytree(ROOT / "hyperpar", src / "hyperpar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)], check=True, timeout=600, capture_output=True)
    (found,) = out.glob("hyperpar-*.whl")
    return found


def test_wheel_carries_license_py_typed_and_numpy(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
        licenses = [n for n in names if "/licenses/" in n and n.endswith("LICENSE")]
        assert licenses, names
        assert "Apache License" in zf.read(licenses[0]).decode()
    assert "hyperpar/py.typed" in names
    assert meta["License-Expression"] == "Apache-2.0"
    requires = [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") or []]
    assert any(r == "numpy" or r.startswith(("numpy>", "numpy=", "numpy<")) for r in requires), \
        requires


def test_description_tells_pip_users_the_scripts_need_a_checkout(wheel: Path) -> None:
    """The README is the package's long description; its script commands are for a checkout."""
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        body = Parser().parsestr(zf.read(meta_name).decode()).get_payload()
    first_script = body.index("bash scripts/")
    assert "checkout" in body[:first_script], body[:first_script]



def test_backend_wheels_carry_the_license(tmp_path: Path) -> None:
    backends = ["cpu", "cuda", "npu", "mindspore", "sim"]
    sources = []
    for backend in backends:  # copies: building writes build/ and *.egg-info
        src = tmp_path / "src" / backend
        shutil.copytree(ROOT / "backends" / f"hyperpar-{backend}", src,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        sources.append(str(src))
    out = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), *sources], check=True, timeout=600, capture_output=True)
    for backend in backends:
        (found,) = out.glob(f"hyperpar_{backend}-*.whl")
        with zipfile.ZipFile(found) as zf:
            licenses = [n for n in zf.namelist() if "/licenses/" in n and n.endswith("LICENSE")]
            assert licenses, (backend, zf.namelist())
            assert "Apache License" in zf.read(licenses[0]).decode()
