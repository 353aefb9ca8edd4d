"""``from hyperpar import ColwiseParallel`` resolves through the platform's ``parallel_api()``:
hyperpar's PyTorch styles by default, a framework's own (MindSpore Cells) where its platform
returns one -- so one import line serves every framework and the core imports no backend."""

from __future__ import annotations

import types

import pytest
from hyperpar_cpu.platform import CPUPlatform

import hyperpar
from hyperpar.platform import get_platform, hookimpl, register_plugin, unregister_plugin


class _CellStyles:
    """Stands for a framework's ColwiseParallel."""


_API = types.ModuleType("other_framework_parallel")
_API.ColwiseParallel = _CellStyles


class OtherFrameworkPlatform(CPUPlatform):
    name = "other-framework"

    def parallel_api(self):
        return _API


class _Plugin:
    @hookimpl
    def hyperpar_backends(self):
        return [OtherFrameworkPlatform]


def test_torch_backends_give_hyperpars_own_styles():
    import hyperpar.parallel

    assert get_platform().parallel_api() is None
    assert hyperpar.ColwiseParallel is hyperpar.parallel.ColwiseParallel
    assert hyperpar.init_device_mesh is hyperpar.dtensor.init_device_mesh


def test_a_platform_with_its_own_api_supplies_the_names_and_switching_back_works():
    plugin = _Plugin()
    register_plugin(plugin, source="a test")
    try:
        hyperpar.set_backend("other-framework")
        from hyperpar import ColwiseParallel

        assert ColwiseParallel is _CellStyles
        with pytest.raises(AttributeError, match=r"hyperpar.SequenceParallel has no "
                                                 r"implementation on the 'other-framework'"):
            hyperpar.SequenceParallel  # noqa: B018
        hyperpar.set_backend("cpu")  # not cached: the torch styles come back
        assert hyperpar.ColwiseParallel is hyperpar.parallel.ColwiseParallel
    finally:
        hyperpar.set_backend(None)
        unregister_plugin(plugin)
