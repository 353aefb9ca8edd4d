"""A torch backend that implements only the abstract members gets working defaults for the
rest: point-to-point calls (neutral contract), object collectives, the differentiable
collectives, hooks and module detection (TorchPlatformBase). Checked with the conformance
kit's own checks on 2 real processes."""

from __future__ import annotations

import abc

import pytest
import torch
from hyperpar_cpu.platform import CPUPlatform
from torch import nn

from hyperpar.platform import (
    Availability,
    Platform,
    abstract_members,
    hookimpl,
    register_plugin,
)
from hyperpar.platform.torch_base import TorchPlatformBase
from hyperpar.testing import WorkerPool
from hyperpar.testing.conformance import test_autograd, test_collectives


class MinimalPlatform(TorchPlatformBase):
    """Forwards exactly the abstract members to the cpu backend; everything else is the
    Platform's default."""

    name = "minimal"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -100
    ranks_share_device = True

    def __init__(self) -> None:
        self._inner = CPUPlatform()

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True)


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in abstract_members():
    if _name != "is_available":
        setattr(MinimalPlatform, _name, _forward(_name))
abc.update_abstractmethods(MinimalPlatform)


class _Plugin:
    @hookimpl
    def hyperpar_backends(self):
        return [MinimalPlatform]


def _register() -> None:
    register_plugin(_Plugin(), source="tests/platform/test_defaults.py")


def _inherits_the_defaults() -> list[str]:
    return [n for n in ("send", "recv", "isend", "irecv", "all_gather_object",
                        "broadcast_object", "all_gather_autograd", "register_forward_hook",
                        "is_linear", "memory_stats", "current_device")
            if getattr(MinimalPlatform, n) is not getattr(TorchPlatformBase, n)]


def test_the_torch_defaults_add_no_abstract_member():
    assert set(TorchPlatformBase.__abstractmethods__) == set(Platform.__abstractmethods__)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, backend="minimal", setup=_register) as workers:
        yield workers


def test_minimal_backend_implements_only_the_abstract_members():
    assert not MinimalPlatform.__abstractmethods__
    assert _inherits_the_defaults() == []


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "batched"])
def test_point_to_point_defaults_pass_a_ring(pool, mode):
    pool.run(test_collectives._ring, mode)


def test_object_collective_defaults_round_trip(pool):
    pool.run(test_collectives._objects)


@pytest.mark.parametrize("name", ["all_reduce_avg", "all_gather_dim1", "reduce_scatter_dim1",
                                  "all_to_all_1_0"])
def test_autograd_defaults_have_analytic_gradients(pool, name):
    pool.run(test_autograd._check, name)


def test_detection_hooks_and_device_defaults_in_process():
    p = MinimalPlatform()
    assert p.is_linear(nn.Linear(2, 2)) and p.is_norm(nn.LayerNorm(2))
    assert p.is_module_class(nn.Linear) and not p.is_embedding(nn.Linear(2, 2))
    assert p.current_device() == 0
    assert p.memory_stats() == {"allocated": 0, "max_allocated": 0}
    assert p.collective_fallbacks() == {}
    lin = nn.Linear(2, 2)
    handle = p.register_forward_hook(lin, lambda m, a, out: out * 0)
    assert torch.count_nonzero(lin(torch.ones(1, 2))) == 0
    handle.remove()


def test_autograd_defaults_refuse_uneven_pieces():
    p = CPUPlatform()  # the check runs before any collective: no process group needed
    p.world_size = lambda group=None: 2
    with pytest.raises(ValueError, match="size 3 is not divisible by the group size 2"):
        p.reduce_scatter_autograd(torch.ones(3, 2), dim=0)
    with pytest.raises(ValueError, match="all_to_all_autograd along dim 1"):
        p.all_to_all_autograd(torch.ones(2, 3), split_dim=1, concat_dim=0)


def test_ranks_asked_before_joining_a_group_name_the_fix() -> None:
    """torch's "Default process group has not been initialized" ValueError becomes the
    platform's RuntimeError naming the call to make, as on the MindSpore platform."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already joined a group")
    platform = CPUPlatform()
    for ask in (platform.rank, platform.world_size, platform.group_ranks):
        with pytest.raises(RuntimeError, match=r"has not joined a process group.*"
                                               r"init_process_group\(\)"):
            ask()
