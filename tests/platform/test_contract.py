"""The Platform contract stays small, documented, and cheap for device backends."""

from __future__ import annotations

import inspect
from pathlib import Path

import hyperpar_cpu
import hyperpar_cuda
import hyperpar_npu

from hyperpar.platform import Platform, abstract_members
from hyperpar.platform.torch_base import TorchPlatformBase


def test_contract_has_at_most_30_abstract_members():
    assert len(abstract_members()) <= 30, abstract_members()


def _public_members(cls: type = TorchPlatformBase) -> list[str]:
    """Public callables of ``cls`` and of the contract classes it builds on."""
    owners = [c for c in cls.__mro__ if c is Platform or issubclass(c, Platform)]
    return sorted({n for c in owners for n, v in vars(c).items()
                   if not n.startswith("_") and callable(getattr(cls, n)) and
                   not isinstance(v, (type, tuple))})


def test_every_member_abstract_or_default_has_a_docstring():
    undocumented = [n for n in _public_members()
                    if not inspect.getdoc(getattr(TorchPlatformBase, n))]
    assert not undocumented, f"document these Platform members: {undocumented}"


def test_the_neutral_contract_names_no_framework():
    source = Path(inspect.getfile(Platform)).read_text()
    assert "import torch" not in source and "from torch" not in source
    assert set(abstract_members()) <= set(_public_members(Platform))


def test_hooks_detection_and_autograd_collectives_are_defaults_not_obligations():
    defaults = {"register_forward_pre_hook", "register_forward_hook",
                "register_full_backward_hook", "is_module_class", "is_linear", "is_embedding",
                "is_norm", "set_parameter", "all_reduce_autograd", "all_gather_autograd",
                "reduce_scatter_autograd", "all_to_all_autograd", "all_gather_object",
                "broadcast_object", "send", "recv", "isend", "irecv", "current_device",
                "memory_stats", "collective_fallbacks", "max_local_ranks", "check_world_fits"}
    assert defaults <= set(_public_members())
    assert not defaults & set(abstract_members())
    assert not defaults & set(TorchPlatformBase.__abstractmethods__)


def test_device_backends_stay_well_under_100_lines():
    for package in (hyperpar_cpu, hyperpar_cuda, hyperpar_npu):
        source = Path(package.__file__).with_name("platform.py")
        lines = len(source.read_text().splitlines())
        assert lines < 100, f"{source}: {lines} lines"


def test_in_tree_backends_implement_the_whole_contract():
    for package in (hyperpar_cpu, hyperpar_cuda, hyperpar_npu):
        cls = next(v for k, v in vars(package).items() if k.endswith("Platform"))
        assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)
