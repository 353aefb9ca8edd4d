"""Layering: nothing above hyperpar/platform/ imports a backend, calls torch.distributed
directly, or names a device. Everything hardware-specific goes through get_platform()."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import hyperpar

PACKAGE = Path(hyperpar.__file__).parent
DEVICE_WORDS = {"cpu", "cuda", "npu", "xpu", "mps", "hpu", "nccl", "hccl", "gloo", "mccl"}
BACKEND_PACKAGES = ("hyperpar_cpu", "hyperpar_cuda", "hyperpar_npu", "hyperpar_mindspore")

# Modules allowed below the line, each for a stated reason.
EXEMPT = {
    "platform": "the platform layer is where torch.distributed is wrapped",
    "testing/emulation.py": "emulates a device module; device-specific by nature, test-only",
}

# Modules checked with a narrow allowance, each for a stated reason: {path: (why, torch
# modules it may import, whether it may name device words)}.
ALLOWED = {
    "launcher.py": (
        "wraps torchrun: it runs torchrun itself and reads its workers' error files, and passes "
        "torchrun's --nproc-per-node values ('cpu', 'gpu', 'xpu'); process groups are the "
        "platform's",
        ("torch.distributed.run", "torch.distributed.elastic"), True),
}


def _modules_above_platform() -> list[Path]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel == key or rel.startswith(key + "/") for key in EXEMPT):
            continue
        files.append(path)
    return files


def _violations(path: Path, allowed_imports: tuple[str, ...] = (),
                devices_allowed: bool = False) -> list[str]:
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
            if any(name == a or name.startswith(a + ".") for a in allowed_imports):
                continue
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                found.append(f"line {node.lineno}: imports {name}")
            if name.split(".")[0] in BACKEND_PACKAGES:
                found.append(f"line {node.lineno}: imports backend {name}")
        if isinstance(node, ast.Attribute) and node.attr == "distributed" and (
            isinstance(node.value, ast.Name) and node.value.id == "torch"
        ):
            found.append(f"line {node.lineno}: uses torch.distributed")
        if (not devices_allowed and isinstance(node, ast.Constant)
                and isinstance(node.value, str) and id(node) not in docstrings
                and node.value.split(":")[0].lower() in DEVICE_WORDS):
            found.append(f"line {node.lineno}: names device {node.value!r}")
    return found


def _checked(path: Path) -> list[str]:
    rel = path.relative_to(PACKAGE).as_posix()
    if rel in ALLOWED:
        _why, imports, devices = ALLOWED[rel]
        return _violations(path, imports, devices)
    return _violations(path)


def test_modules_above_platform_stay_hardware_agnostic():
    report = {
        str(path.relative_to(PACKAGE)): v
        for path in _modules_above_platform()
        if (v := _checked(path))
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


# --------------------------------------------------------------------------- a core without torch
# A MindSpore user installs hyperpar without torch. A fresh interpreter that cannot import torch
# and does not see the distributions that depend on it (the torch backends, the backend template)
# is the cheap stand-in for such a venv.
_BLOCK_TORCH = """
import importlib.abc, importlib.metadata, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
_all_distributions = importlib.metadata.distributions


def _needs_torch(dist):
    return dist.metadata["Name"] == "torch" or any(
        req.split(";")[0].strip().startswith("torch") for req in dist.requires or ())


def _installed_without_torch(**kwargs):
    return (d for d in _all_distributions(**kwargs)
            if not _needs_torch(d) or d.metadata["Name"] == "hyperpar")


importlib.metadata.distributions = _installed_without_torch
"""

# The framework-neutral modules: everything a MindSpore-only install reaches.
TORCH_FREE_MODULES = (
    "hyperpar", "hyperpar.platform", "hyperpar.platform.base", "hyperpar.platform.registry",
    "hyperpar.platform.hookspecs", "hyperpar.platform.info", "hyperpar.cli", "hyperpar.launcher",
    "hyperpar.log", "hyperpar.testing", "hyperpar.testing.harness",
    "hyperpar.testing.pytest_plugin", "hyperpar.parallel.spec", "hyperpar.plan",
    "hyperpar.plan.cli", "hyperpar.platform.timeout", "hyperpar.dtensor", "hyperpar.dtensor.mesh",
    "hyperpar.dtensor.placement", "hyperpar.platform.dim_collectives", "hyperpar.parallel.driver",
    "hyperpar.dtensor.layout", "hyperpar.dtensor.rules", "hyperpar.dtensor.api_core",
)

# The layers written once for both frameworks: they must import neither torch nor mindspore.
NEUTRAL_MODULES = ("hyperpar.dtensor.mesh", "hyperpar.dtensor.placement",
                   "hyperpar.dtensor.api_core",
                   "hyperpar.dtensor.layout", "hyperpar.dtensor.rules",
                   "hyperpar.platform.dim_collectives", "hyperpar.parallel.spec",
                   "hyperpar.parallel.driver", "hyperpar.parallel.styles",
                   "hyperpar.parallel.loss_plan", "hyperpar.parallel.easydel",
                   "hyperpar.dtensor.remesh", "hyperpar.parallel.prepare_plan",
                   "hyperpar.parallel.layer_plan",
                   "hyperpar.parallel.bucket_plan",
                   "hyperpar.parallel.shard_plan", "hyperpar.fsdp.policy",
                   "hyperpar.fsdp.sections",
                   "hyperpar.checkpoint", "hyperpar.checkpoint.arrays",
                   "hyperpar.checkpoint._commit", "hyperpar.checkpoint._replicas",
                   "hyperpar.checkpoint._async", "hyperpar.dtensor.debug",
                   "hyperpar.checkpoint.optim_map",
                   "hyperpar.pipeline.schedules", "hyperpar.pipeline.runner",
                   "hyperpar.pipeline.actions", "hyperpar.pipeline.plans",
                   "hyperpar.pipeline.lowering", "hyperpar.pipeline.checking",
                   "hyperpar.pipeline.spec", "hyperpar.pipeline.partition",
                   "hyperpar.pipeline._faults", "hyperpar.pipeline.topology",
                    "hyperpar.pipeline.layout", "hyperpar.plan.moe",
                    "hyperpar.plan.moe_plan", "hyperpar.plan.moe_report",
                    "hyperpar.plan.moe_layout", "hyperpar.plan.moe_memory",
                    "hyperpar.moe", "hyperpar.moe.errors", "hyperpar.moe.placement",
                    "hyperpar.moe.routing", "hyperpar.moe.exchange",
                    "hyperpar.moe.styles")

_BLOCK_MINDSPORE = """
class _NoMindSpore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mindspore" or name.startswith("mindspore."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoMindSpore())
"""


def _run_without_torch(body: str, *argv: str) -> subprocess.CompletedProcess:
    code = _BLOCK_TORCH + body
    env = {k: v for k, v in os.environ.items() if k != "HYPERPAR_BACKEND"}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_blocker_really_blocks_torch():
    done = _run_without_torch("import torch")
    assert done.returncode != 0 and "blocked by the test" in done.stderr


def test_the_blocker_can_block_mindspore_too():
    done = _run_without_torch(_BLOCK_MINDSPORE + "import mindspore")
    assert done.returncode != 0 and "blocked by the test" in done.stderr


def test_neutral_layers_import_and_work_without_any_framework():
    """The mesh, the placements, the collectives along a dim and the style specs are written
    once for PyTorch and MindSpore: they load, and the mesh's rank arithmetic runs, where
    neither framework can be imported."""
    body = _BLOCK_MINDSPORE + f"""
import importlib
for name in {NEUTRAL_MODULES!r}:
    importlib.import_module(name)
from hyperpar.dtensor import DeviceMesh, Shard, init_device_mesh
from hyperpar.dtensor.mesh import _grid, _nested, _slices, _unravel
from hyperpar.platform.dim_collectives import DimCollectives, chunk_sizes
shape, ranks = _grid([[0, 1, 2], [3, 4, 5]])
assert (shape, ranks) == ((2, 3), (0, 1, 2, 3, 4, 5))
assert _slices(shape, ranks, [0]) == [(0, 3), (1, 4), (2, 5)]
assert _slices(shape, ranks, [1]) == [(0, 1, 2), (3, 4, 5)]
assert _slices(shape, ranks, [1, 0]) == [(0, 3, 1, 4, 2, 5)]
assert _nested(ranks, shape) == [[0, 1, 2], [3, 4, 5]] and _unravel(4, shape) == [1, 1]
assert _grid(7) == ((1,), (7,))
for bad in ([[0, 1], [2]], [[0, 1], [2, 2.5]], []):
    try:
        _grid(bad)
    except (TypeError, ValueError) as exc:
        assert "DeviceMesh: mesh" in str(exc), exc
    else:
        raise AssertionError(f"{{bad!r}} accepted")
assert chunk_sizes(5, 2) == [3, 2] and Shard(0).dim == 0
assert callable(init_device_mesh) and hasattr(DimCollectives, "all_gather_along")
assert "torch" not in sys.modules and "mindspore" not in sys.modules
print("ok")
"""
    done = _run_without_torch(body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_core_modules_import_without_torch():
    body = ("import importlib, sys\n"
            f"for name in {TORCH_FREE_MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "assert 'torch' not in sys.modules\n"
            "print('ok')\n")
    done = _run_without_torch(body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_hyperpar_info_works_without_torch():
    body = "import sys\nfrom hyperpar.cli import main\nsys.exit(main(['info']))\n"
    done = _run_without_torch(body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hyperpar ")
    assert "none -- install one" in done.stdout and "hyperpar-mindspore" in done.stdout
    assert "selected: none" in done.stdout


def test_hyperpar_run_without_torch_explains_instead_of_crashing(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    body = "import sys\nfrom hyperpar.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    done = _run_without_torch(body, "run", "-n", "1", str(script))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "no hyperpar backend is available" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_launcher_may_import_torchrun_but_not_process_groups(tmp_path):
    """launcher.py is checked too: torchrun's own modules pass, ``torch.distributed`` does not
    (its worker teardown leaves the process group through the platform)."""
    assert (PACKAGE / "launcher.py") in _modules_above_platform()
    _why, imports, devices = ALLOWED["launcher.py"]
    fine = tmp_path / "fine.py"
    fine.write_text("from torch.distributed.run import parse_args, run\n"
                    "from torch.distributed.elastic.multiprocessing.errors import "
                    "ChildFailedError\n")
    assert _violations(fine, imports, devices) == []
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom torch.distributed import "
                   "destroy_process_group\nimport torch\ntorch.distributed.barrier()\n")
    found = _violations(bad, imports, devices)
    assert any("imports torch.distributed" in f for f in found)
    assert any("imports torch.distributed.destroy_process_group" in f for f in found)
    assert any("uses torch.distributed" in f for f in found)
