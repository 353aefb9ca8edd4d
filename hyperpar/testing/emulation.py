"""CPU emulations of accelerator device modules, for running a backend's own code paths on a
machine without the hardware. **Test-only**: never imported by a backend.

``install_npu_emulation()`` makes the ``hyperpar-npu`` backend usable on a CPU machine:

* a fake ``torch_npu`` package is placed in ``sys.modules`` (so the backend's lazy
  ``import torch_npu`` succeeds) and ``torch.npu`` is registered as a device module with the
  calls the backend uses (``is_available``, ``device_count``, ``set_device``, ``current_device``,
  ``synchronize``, ``manual_seed``, RNG state, memory counters); ``device_count`` honours
  ``ASCEND_RT_VISIBLE_DEVICES`` like the real runtime;
* the PrivateUse1 device is renamed ``npu`` as torch_npu does;
* a collective backend named ``hccl`` is registered whose process groups are gloo groups, so
  ``init_process_group("hccl")`` and every collective run for real over gloo;
* tensors live on the host: ``NPUPlatform.device()`` answers ``cpu`` while the emulation is on
  (there is no NPU memory to allocate from). This is the one place the emulation steps into
  the backend's class, and it is undone by :func:`uninstall_npu_emulation`.

What this does *not* exercise: real NPU kernels, HCCL itself, device memory, streams.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable

import torch

_EMULATED_DEVICES = 8
_state: dict[str, object] = {}


def _visible_count() -> int:
    env = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if env is None:
        return _EMULATED_DEVICES
    return len([d for d in env.split(",") if d.strip()])


def _host_only_hooks() -> object | None:
    """PrivateUse1 hooks answering "no accelerator here", or None on a torch without the Python
    hooks API (``torch._C._acc``, torch >= 2.13; older releases do not ask the hooks on the
    host-side paths the emulation uses)."""
    acc = getattr(torch._C, "_acc", None)
    if acc is None or not hasattr(acc, "PrivateUse1Hooks"):
        return None

    class _HostOnlyHooks(acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return False

        def has_primary_context(self, dev_id: int) -> bool:
            return False

        def is_built(self) -> bool:
            return True

    return _HostOnlyHooks()


def _make_device_module() -> types.ModuleType:
    npu = types.ModuleType("torch_npu.npu")
    current = {"index": 0}
    peak = {"bytes": 0}

    def set_device(index: int | torch.device) -> None:
        index = index.index if isinstance(index, torch.device) else int(index)
        if not 0 <= index < _visible_count():
            raise RuntimeError(f"emulated npu: invalid device index {index}")
        current["index"] = index

    npu.is_available = lambda: _visible_count() > 0
    npu.device_count = _visible_count
    npu.set_device = set_device
    npu.current_device = lambda: current["index"]
    npu.synchronize = lambda device=None: None
    # Emulated tensors live on the host, whose generator torch.manual_seed already seeds (and
    # torch.manual_seed calls these back: they must not call it again).
    npu.manual_seed = lambda seed: None
    npu.manual_seed_all = lambda seed: None
    npu.get_rng_state = lambda device=None: torch.get_rng_state()
    npu.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    npu.memory_allocated = lambda device=None: 0
    npu.max_memory_allocated = lambda device=None: peak["bytes"]
    npu.is_initialized = lambda: True
    npu._is_in_bad_fork = lambda: False
    npu._is_hyperpar_emulation = True
    return npu


def _register_hccl_as_gloo() -> None:
    import torch.distributed as dist

    if "hccl" in dist.Backend.backend_list:
        return

    def create(opts, backend_options=None):  # signature of an extended-API creator
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)

    dist.Backend.register_backend("hccl", create, extended_api=True, devices=["cpu"])


def install_npu_emulation() -> None:
    """Install the emulation in this process (idempotent). See the module docstring."""
    if _state.get("npu"):
        return
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
        # torch asks the PrivateUse1 hooks which accelerator exists (barrier does); answer
        # "none" so torch keeps its host-side paths, as there is no NPU memory to use.
        hooks = _host_only_hooks()
        if hooks is not None:
            torch._C._acc.register_python_privateuseone_hook(hooks)
    npu = _make_device_module()
    pkg = types.ModuleType("torch_npu")
    pkg.npu = npu
    pkg.__version__ = "0.0+hyperpar.emulation"
    sys.modules["torch_npu"] = pkg
    sys.modules["torch_npu.npu"] = npu
    if not hasattr(torch, "npu"):
        torch._register_device_module("npu", npu)
    _register_hccl_as_gloo()

    from hyperpar_npu.platform import NPUPlatform

    _state["npu_device"] = NPUPlatform.__dict__.get("device")
    NPUPlatform.device = lambda self, index=None: torch.device("cpu")
    _state["npu"] = True
    from hyperpar.platform import registry

    registry.reset()  # availability was probed without the emulation


def uninstall_npu_emulation() -> None:
    """Remove what :func:`install_npu_emulation` changed that can be removed (torch's device
    rename and device-module registration are permanent for the process)."""
    if not _state.get("npu"):
        return
    from hyperpar_npu.platform import NPUPlatform

    original = _state.pop("npu_device")
    if original is None:
        del NPUPlatform.device
    else:
        NPUPlatform.device = original
    sys.modules.pop("torch_npu", None)
    sys.modules.pop("torch_npu.npu", None)
    _state["npu"] = False
    from hyperpar.platform import registry

    registry.reset()


_EMULATIONS: dict[str, Callable[[], None]] = {"npu": install_npu_emulation}


def emulation_for(backend: str) -> Callable[[], None]:
    """The installer of ``backend``'s emulation; clear error when there is none."""
    try:
        return _EMULATIONS[backend]
    except KeyError:
        raise ValueError(
            f"no device emulation for backend {backend!r}; available: {', '.join(_EMULATIONS)}"
        ) from None
