"""Layering: nothing above hyperpar/platform/ imports a backend, calls torch.distributed
directly, or names a device. Everything hardware-specific goes through get_platform()."""

from __future__ import annotations

import ast
from pathlib import Path

import hyperpar

PACKAGE = Path(hyperpar.__file__).parent
DEVICE_WORDS = {"cpu", "cuda", "npu", "xpu", "mps", "hpu", "nccl", "hccl", "gloo", "mccl"}
BACKEND_PACKAGES = ("hyperpar_cpu", "hyperpar_cuda", "hyperpar_npu")

# Modules allowed below the line, each for a stated reason.
EXEMPT = {
    "platform": "the platform layer is where torch.distributed is wrapped",
    "testing/emulation.py": "emulates a device module; device-specific by nature, test-only",
    "launcher.py": "wraps torchrun (torch.distributed.run), the process launcher",
}


def _modules_above_platform() -> list[Path]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel == key or rel.startswith(key + "/") for key in EXEMPT):
            continue
        files.append(path)
    return files


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                found.append(f"line {node.lineno}: imports {name}")
            if name.split(".")[0] in BACKEND_PACKAGES:
                found.append(f"line {node.lineno}: imports backend {name}")
        if isinstance(node, ast.Attribute) and node.attr == "distributed" and (
            isinstance(node.value, ast.Name) and node.value.id == "torch"
        ):
            found.append(f"line {node.lineno}: uses torch.distributed")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings
                and node.value.split(":")[0].lower() in DEVICE_WORDS):
            found.append(f"line {node.lineno}: names device {node.value!r}")
    return found


def test_modules_above_platform_stay_hardware_agnostic():
    report = {
        str(path.relative_to(PACKAGE)): v
        for path in _modules_above_platform()
        if (v := _violations(path))
    }
    assert not report, (
        "these modules reach below the platform layer (use hyperpar.platform.get_platform()):\n"
        + "\n".join(f"  {f}: {'; '.join(v)}" for f, v in report.items())
    )


def test_the_check_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch.distributed as dist\nfrom hyperpar_cuda import CUDAPlatform\n"
        "x = torch.ones(1, device='cuda')\n"
    )
    found = _violations(bad)
    assert any("torch.distributed" in f for f in found)
    assert any("hyperpar_cuda" in f for f in found)
    assert any("'cuda'" in f for f in found)
