"""The DTensor op registry: every table entry came through the one decorator, rules are
documented and live in their family file, the package has no import cycle, and the plan cache
is bounded."""

import ast
from pathlib import Path

import pytest
import torch

import hyperpar.torch.dtensor._ops as ops_pkg
from hyperpar.torch.dtensor._ops import OP_TABLE, OpEntry, OpOverlay, PlanCache, register_op

FAMILIES = {"pointwise", "matmul", "reduction", "view", "factory", "nn", "tensor", "complex",
            "foreach", "routing", "extra"}
# the order a module may import from: each imports only modules before it
LAYERS = ["registry", "neutral", "dispatch", "pointwise", "matmul", "reduction", "view",
          "factory", "nn", "tensor", "complex", "foreach", "routing", "extra"]


def test_every_table_entry_was_registered_by_the_decorator_in_a_family_with_a_docstring():
    assert len(OP_TABLE) > 500
    bad = {}
    for func, entry in OP_TABLE.items():
        if type(entry) is not OpEntry:
            bad[func] = f"not an OpEntry: {entry!r}"
        elif entry.family not in FAMILIES:
            bad[func] = f"rule {entry.name} defined in {entry.family}, not a family file"
        elif not entry.doc or entry.doc != (entry.rule.__doc__ or "").strip().split("\n")[0]:
            bad[func] = f"rule {entry.name} has no docstring"
    assert bad == {}


def test_a_rule_without_a_docstring_is_refused_at_registration():
    with pytest.raises(TypeError, match="needs a one-line docstring"):
        @register_op(torch.stft)
        def undocumented(call):
            return None
    assert torch.stft not in OP_TABLE


def test_an_overlay_replaces_entries_only_while_active_and_restores_them():
    overlay = OpOverlay("test")

    @register_op([torch.Tensor.view, torch.stft], overlay=overlay)
    def fake(func, args, kwargs, under):
        """A test overlay."""
        return under

    before = OP_TABLE[torch.Tensor.view]
    with overlay.active():
        assert OP_TABLE[torch.Tensor.view].rule(None, (), {}) is before
        assert OP_TABLE[torch.stft].rule(None, (), {}) is None  # covered nothing
    assert OP_TABLE[torch.Tensor.view] is before and torch.stft not in OP_TABLE


def test_the_op_package_has_no_import_cycle():
    root = Path(ops_pkg.__file__).parent
    for name in LAYERS:
        tree = ast.parse((root / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                dep = (node.module or "").split(".")[0]
                assert LAYERS.index(dep) < LAYERS.index(name), f"{name} imports {dep}"
    assert sorted(p.stem for p in root.glob("*.py")) == sorted(LAYERS + ["__init__"])


def test_the_plan_cache_evicts_the_oldest_entries_when_full():
    cache = PlanCache(maxsize=16)
    for i in range(100):
        cache.put(i, str(i))
        assert len(cache) <= 16
    assert 99 in cache and 0 not in cache and cache.get(99) == "99"


def _ops_over_many_shapes(n_shapes: int) -> tuple[int, int]:
    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyperpar.torch.dtensor._ops import PLAN_CACHE

    mesh = init_device_mesh((2,))
    PLAN_CACHE.maxsize = 32
    PLAN_CACHE.clear()
    peak = 0
    for n in range(2, 2 + n_shapes):
        a = distribute_tensor(torch.randn(2 * n, 4), mesh, [Shard(0)])
        b = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
        ((a @ b).sum(0) + 1.0).view(-1).t()
        a.reshape(n, 8).relu()
        peak = max(peak, len(PLAN_CACHE))
    return peak, PLAN_CACHE.maxsize


def test_the_plan_cache_stays_bounded_over_many_shapes(run_on_ranks):
    peak, cap = run_on_ranks(2, _ops_over_many_shapes, 60)[0]
    assert cap < peak * 2 and peak <= cap, (peak, cap)


_COUNT_OVERWRITES = """
import importlib.abc, importlib.util, pathlib, sys

class Recording(dict):
    overwritten = []
    def __setitem__(self, key, value):
        if key in self:
            Recording.overwritten.append((getattr(key, "__name__", repr(key)),
                                          dict.__getitem__(self, key).rule.__module__,
                                          value.rule.__module__))
        super().__setitem__(key, value)

class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "hyperpar.torch.dtensor._ops.registry":
            return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        path = pathlib.Path(sys.argv[1])
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
        module.OP_TABLE = Recording(module.OP_TABLE)

sys.meta_path.insert(0, Finder())
import hyperpar.torch.dtensor._ops
print(Recording.overwritten)
"""


def test_no_torch_function_is_registered_by_two_families():
    """Families are imported in any order: none may silently replace another's rule."""
    import subprocess
    import sys

    registry = Path(ops_pkg.__file__).parent / "registry.py"
    done = subprocess.run([sys.executable, "-c", _COUNT_OVERWRITES, str(registry)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"rules replaced (op, first, second): {done.stdout}"


def test_a_dim_out_of_range_raises_torchs_index_error_instead_of_wrapping():
    from hyperpar.dtensor.rules.reduction import reduced_dims

    for shape, dim in [((2, 3), 5), ((2, 3), -3), ((), 1), ((4,), (0, 2))]:
        with pytest.raises(IndexError) as torch_err:
            torch.zeros(shape).sum(dim)
        with pytest.raises(IndexError) as ours:
            reduced_dims(dim, len(shape))
        assert str(ours.value).startswith(str(torch_err.value)), (shape, dim)
    assert reduced_dims((-1, 0), 3) == (0, 2) and reduced_dims(-1, 0) == (0,)


def test_an_empty_dim_list_reduces_every_dim_as_torch_does():
    from hyperpar.dtensor.rules.reduction import reduced_dims, reduced_shape

    x = torch.zeros(2, 3, 4)
    for dim in (None, [], ()):
        want = torch.linalg.vector_norm(x, dim=dim).shape
        assert want == x.sum(dim if dim is not None else ()).shape == ()
        assert reduced_shape(x.shape, reduced_dims(dim, 3), False) == want, dim
