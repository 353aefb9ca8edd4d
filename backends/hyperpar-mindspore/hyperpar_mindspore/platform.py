"""MindSporePlatform: the hyperpar Platform contract on MindSpore (CPU, Ascend, GPU targets).

The class is assembled from the platform's parts, each with one job and each below this module
(none imports it): :mod:`.runtime` (the target, thread and launch settings, compiler output,
MindSpore's scheduler process, the world group's cached name), :mod:`.collectives` (groups and
collectives over ``mindspore.mint.distributed``, composed where the target has no kernel:
:data:`CPU_COMPOSITIONS`, shown by ``hyperpar info``) and :mod:`.tensors` (owned copies, the
shard-placements attribute). Here: joining the world, devices, Cell detection and hooks, the
tensor mechanics the neutral layers ask for, and what the platform hands out from the layers
above -- the styles' mechanics (:meth:`MindSporePlatform.tp_mechanics`), the parallel API, the
differentiable all-to-all, the launcher -- imported when asked for, as the torch platform does,
so the import graph has no circle (``tests/test_import_cycles.py``). MindSpore traits hidden
here and in the parts:

* only the member ranks of a group may create it -- ``new_group`` keeps hyperpar's contract
  (every rank calls it with the same ranks) and creates the MindSpore group on the members only;
* ``mint.distributed`` caches the name of the world group at import, which breaks point-to-point
  calls on CPU until the cache is pointed at the real world group after ``init()``;
* the default thread settings oversubscribe the cores (collectives 5-10x slower): on CPU the
  platform sets one op thread, one dispatch thread and blocking launches before joining the
  group (on Ascend/GPU launches stay asynchronous);
* launchers name ranks and devices differently (msrun sets ``DEVICE_ID``, not ``LOCAL_RANK``):
  :mod:`hyperpar_mindspore.launch_env` reads each.

This module imports MindSpore lazily: the backend is listed (and probed) without the import.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from hyperpar.platform import Availability
from hyperpar.platform.base import Group, Platform
from hyperpar.platform.dim_collectives import DimCollectives
from hyperpar.platform.timeout import default_timeout_s

# The platform's parts, one job each (below this module: none of them imports it); the public
# names stay importable from here.
from .collectives import CPU_COMPOSITIONS, RING_MIN_BYTES, MindSporeCollectives, MSGroup
from .launch_env import ranks_needed_here, read_launch_env
from .runtime import (
    _LIBRARY,
    TARGET_ENV,
    TARGETS,
    TUNING,
    _address,
    _point_p2p_at_world_group,
    _stop,
    compiler_output_dir,
    detect_target,
    quiet_cpu_synchronize,
    route_compiler_output,
    start_scheduler,
    tune_threads,
)
from .runtime import load_dist as _dist
from .runtime import load_mindspore as _ms
from .tensors import SHARD_PLACEMENTS, copy_tensor

__all__ = ["CPU_COMPOSITIONS", "RING_MIN_BYTES", "SHARD_PLACEMENTS", "TARGETS", "TARGET_ENV",
           "TUNING", "MSGroup", "MindSporePlatform", "compiler_output_dir", "copy_tensor",
           "detect_target", "quiet_cpu_synchronize", "route_compiler_output", "start_scheduler",
           "tune_threads"]


class MindSporePlatform(MindSporeCollectives, Platform, DimCollectives):
    """hyperpar on MindSpore. Lowest auto-detect priority: chosen when no torch backend is
    installed, or by ``HYPERPAR_BACKEND=mindspore``. The collectives along a dim
    (``all_gather_along``, ``reduce_scatter_along``, ...) are hyperpar's framework-neutral
    :class:`~hyperpar.platform.dim_collectives.DimCollectives` over this platform's collectives
    and tensor mechanics."""

    name = "mindspore"
    framework = "mindspore"
    device_type = "cpu|ascend|gpu"  # the instance says which target it runs on
    dist_backend = "mccl|hccl|nccl"  # the instance: mccl (CPU), hccl (Ascend), nccl (GPU)
    priority = -10
    ranks_share_device = True

    def __init__(self) -> None:
        self.target = detect_target()
        self.device_type = self.target.lower()
        self.dist_backend = _LIBRARY[self.target]
        self.ranks_share_device = self.target == "CPU"
        from mindspore import mint, nn

        self.linear_types = (nn.Dense, mint.nn.Linear)
        self.embedding_types = (nn.Embedding, mint.nn.Embedding)
        self.norm_types = (nn.LayerNorm, mint.nn.LayerNorm)
        self._initialized = False
        self._rank, self._world = 0, 1
        self._groups: dict[tuple[int, ...], MSGroup] = {}
        self._scheduler: subprocess.Popen | None = None

    # ------------------------------------------------------------------ identity & device
    @classmethod
    def is_available(cls) -> Availability:
        if importlib.util.find_spec("mindspore") is None:
            return Availability(False, "mindspore is not installed (pip install 'numpy<2' "
                                       "mindspore==2.10.0)")
        return Availability(True)

    def device_count(self) -> int:
        if self.target == "CPU":
            return 1
        return int(_ms().hal.device_count(self.target))

    def device(self, index: int | None = None) -> str:
        """``"CPU"``, or ``"Ascend:i"`` / ``"GPU:i"`` (MindSpore has no device objects)."""
        if self.target == "CPU":
            return "CPU"
        return f"{self.target}:{self.current_device() if index is None else index}"

    def set_device(self, index: int) -> None:
        ms = _ms()
        if self.target == "CPU":
            ms.set_device("CPU")
        else:
            ms.set_device(self.target, index)

    def pin_device(self, index: int) -> None:
        """``set_device`` for this rank, unless a kernel already ran and the runtime is on
        ``index`` of this target: then that device is left alone (scripts may run MindSpore ops
        before ``init_device_mesh``, as on torch). Any other device in use is an error."""
        ms = _ms()
        try:
            self.set_device(index)
            return
        except RuntimeError as exc:
            if "runtime has been initialized" not in str(exc):
                raise
        target = ms.get_context("device_target")
        used = int(ms.get_context("device_id") or 0)
        if target == self.target and (self.target == "CPU" or used == index):
            return
        raise RuntimeError(
            f"MindSpore already runs kernels on {target}:{used}, but this rank must use "
            f"{self.target}:{index} (from the launcher's DEVICE_ID/LOCAL_RANK). Call "
            f"init_device_mesh (or get_platform().init_process_group()) before the first "
            f"MindSpore op, or call ms.set_device({self.target!r}, {index}) first")

    def current_device(self) -> int:
        if self.target == "CPU":
            return 0
        return read_launch_env(os.environ).device_id

    def runtime_settings(self) -> dict[str, str]:
        """The thread and launch settings :func:`tune_threads` applies on this target."""
        compiler = {"compiler output (MS_OM_PATH)": compiler_output_dir()}
        if os.environ.get("HYPERPAR_MS_KEEP_THREADS"):
            return {"tuning": "off (HYPERPAR_MS_KEEP_THREADS is set): MindSpore's defaults",
                    **compiler}
        return {**TUNING[self.target], **compiler}

    def synchronize(self) -> None:
        _ms().runtime.synchronize()

    def manual_seed(self, seed: int) -> None:
        ms = _ms()
        ms.set_seed(seed)
        ms.manual_seed(seed)

    def get_rng_state(self) -> Any:
        return _ms().get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        _ms().set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        if self.target == "CPU":
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return {"allocated": 0, "max_allocated": int(peak)}
        rt = _ms().runtime
        return {"allocated": int(rt.memory_allocated()),
                "max_allocated": int(rt.max_memory_allocated())}

    # ------------------------------------------------------------------ module detection
    def named_children(self, module: Any) -> list[tuple[str, Any]]:
        """The Cell's direct sub-Cells, ``(attribute name, cell)``."""
        return list(module.name_cells().items())

    def named_modules(self, module: Any) -> list[tuple[str, Any]]:
        """``(path, cell)`` for the Cell itself (``""``) and every sub-Cell, each once."""
        return list(module.cells_and_names())

    def named_parameters(self, module: Any, *, recurse: bool = True) -> list[tuple[str, Any]]:
        """``recurse=False``: the Cell's own parameter slots by attribute name (every slot);
        else every Parameter under it once, by path."""
        if not recurse:
            return [(n, p) for n, p in module._params.items() if p is not None]
        return list(module.parameters_and_names())

    def set_parameter(self, module: Any, name: str, value: Any) -> Any:
        """Make ``value`` the Cell's parameter ``name``: a Parameter as it is (one object may
        sit in several slots: a tie), a tensor wrapped keeping the old name and
        ``requires_grad``."""
        from mindspore import Parameter

        if "." in name:
            raise ValueError(f"set_parameter takes a direct attribute name, got {name!r}")
        old = module._params.get(name)
        if not isinstance(value, Parameter):
            value = Parameter(value, name=old.name if old is not None else name,
                              requires_grad=old.requires_grad if old is not None else True)
        module._params[name] = value
        return value

    def parameter_placements(self, param: Any) -> tuple[Any, ...] | None:
        """A DTensor's placements, or those a MindSpore style recorded on the shard it made."""
        placements = getattr(param, "placements", None)
        if placements is None:
            placements = getattr(param, SHARD_PLACEMENTS, None)
        return None if placements is None else tuple(placements)

    # ------------------------------------------------------------------ hooks
    def register_forward_pre_hook(self, module: Any, hook: Any, *, with_kwargs: bool = False,
                                  prepend: bool = False) -> Any:
        """``hook(cell, args[, kwargs])`` before ``construct``; may return replacement inputs."""
        return module.register_forward_pre_hook(hook, with_kwargs=with_kwargs, prepend=prepend)

    def register_forward_hook(self, module: Any, hook: Any, *, with_kwargs: bool = False,
                              prepend: bool = False) -> Any:
        """``hook(cell, args, [kwargs,] output)`` after ``construct``; may return a new output."""
        return module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=prepend)

    def register_full_backward_hook(self, module: Any, hook: Any, *,
                                    prepend: bool = False) -> Any:
        """``hook(cell, grad_input, grad_output)`` in backward (MindSpore's backward hook)."""
        if prepend:
            raise ValueError("MindSpore backward hooks cannot be prepended; pass prepend=False")
        return module.register_backward_hook(hook)

    # ------------------------------------------------------------------ process groups
    def init_process_group(self, *, rank: int | None = None, world_size: int | None = None,
                           init_method: str | None = None,
                           timeout_s: float | None = None) -> None:
        """Join the world group.

        Under ``hyperpar run`` (or ``msrun``) the ``MS_*`` variables are set and this calls
        ``mindspore.communication.init()``. With torchrun-style variables (``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, as hyperpar's test harness sets) rank 0
        first starts MindSpore's scheduler process on ``MASTER_PORT``. A process started alone
        (``python script.py``) is a world of one: no communication service is started and every
        collective returns its input.
        """
        if self._initialized:
            return
        env = os.environ
        route_compiler_output()
        launch = read_launch_env(env)
        if world_size is not None:
            launch = dataclasses.replace(launch, world_size=int(world_size))
        if rank is not None:
            launch = dataclasses.replace(launch, rank=int(rank))
        if launch.world_size > 1:  # refuse before the device or any peer is touched
            self.check_world_fits(ranks_needed_here(launch))
        tune_threads(_ms(), self.target)
        if self.target == "CPU":
            quiet_cpu_synchronize()
        if self.target == "CPU":
            # MindSpore's CPU collectives (compiled and PyNative) wait 30 s for a late peer,
            # whatever timeout_s says (measured): a rank still compiling its graph, or starved
            # on a loaded host, failed its peer's collective. Give them the timeout asked for.
            seconds = timeout_s if timeout_s is not None else default_timeout_s()
            env.setdefault("MS_CPU_COMM_OP_TIMEOUT", str(max(1, int(seconds + 0.999))))
        self.pin_device(launch.device_id)
        world = launch.world_size
        if "MS_ROLE" not in env and world == 1:
            self._rank, self._world, self._initialized = 0, 1, True
            return
        if "MS_ROLE" not in env:
            me = launch.rank
            host, port = _address(init_method)
            env.update({"MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(me),
                        "MS_WORKER_NUM": str(world), "MS_SCHED_HOST": host,
                        "MS_SCHED_PORT": str(port)})
            if me == 0:
                self._scheduler = start_scheduler(host, port, world, self.target)
        from mindspore.communication import get_group_size, get_rank, init

        init()
        _point_p2p_at_world_group()
        self._rank, self._world = int(get_rank()), int(get_group_size())
        self._initialized = True

    def destroy_process_group(self) -> None:
        if not self._initialized:
            return
        self._initialized = False
        if self._world > 1:
            try:
                _dist().destroy_process_group()
            except Exception:  # already torn down by MindSpore's own exit handler
                pass
        self._groups.clear()
        if self._scheduler is not None:
            _stop(self._scheduler)
            self._scheduler = None

    def is_initialized(self) -> bool:
        return self._initialized

    # ------------------------------------------------------------------ handed out from above
    # Built in the layers above this module's parts, imported when asked for (as torch_base's
    # tp_mechanics does): nothing below imports this module, so no import circle.
    def all_to_all_single_autograd(self, tensor: Any, output_split_sizes: Sequence[int] | None,
                                   input_split_sizes: Sequence[int] | None,
                                   group: Group = None) -> Any:
        """Differentiable uneven dim-0 all-to-all (expert parallelism's dispatch and combine);
        backward: the same exchange with the split lists swapped
        (:func:`hyperpar_mindspore.moe.all_to_all_single_autograd`)."""
        from .moe import all_to_all_single_autograd

        return all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, group)

    def parallel_api(self) -> Any:
        """:mod:`hyperpar_mindspore`: ``from hyperpar import ColwiseParallel`` (and the mesh,
        ``parallelize_module``, the other styles) resolves to the Cell implementations."""
        return importlib.import_module("hyperpar_mindspore")

    def tp_mechanics(self) -> Any:
        """The Cell mechanics of hyperpar's one set of parallel styles
        (:data:`hyperpar_mindspore.prepare.MECHANICS`)."""
        return importlib.import_module("hyperpar_mindspore.prepare").MECHANICS

    # ------------------------------------------------------------------ tensor mechanics
    def rank_tensor(self, ranks: list[Any]) -> Any:
        """A mesh's rank grid as an int64 ``mindspore.Tensor``."""
        ms = _ms()
        return ms.Tensor(ranks, ms.int64)

    def cat(self, tensors: Sequence[Any], dim: int) -> Any:
        """``mint.cat(tensors, dim)``."""
        return _ms().mint.cat(list(tensors), dim)

    def split(self, tensor: Any, sizes: Sequence[int], dim: int) -> list[Any]:
        """The pieces as tensors of their own (see :meth:`narrow`)."""
        pieces = _ms().mint.split(tensor, [int(s) for s in sizes], dim)
        return [copy_tensor(p) for p in pieces]

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        """The piece as a tensor of its own: MindSpore's in-place copies misread slice views."""
        return copy_tensor(_ms().mint.narrow(tensor, dim, start, length))

    def pad_zeros(self, tensor: Any, dim: int, length: int) -> Any:
        """``tensor`` extended with zeros along ``dim`` to ``length`` (``mint.zeros``:
        ``zeros_like`` has no CPU kernel)."""
        missing = length - tensor.shape[dim]
        if missing <= 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        mint = _ms().mint
        return mint.cat([tensor, mint.zeros(tuple(shape), dtype=tensor.dtype)], dim)

    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        """``tensor`` made contiguous, then reshaped."""
        return _ms().mint.reshape(tensor.contiguous(), tuple(shape))

    def new_empty(self, like: Any, shape: Sequence[int]) -> Any:
        """``mint.empty(shape, dtype=like.dtype)`` (MindSpore places it on the set device)."""
        return _ms().mint.empty(tuple(shape), dtype=like.dtype)

    def int_tensor(self, values: Sequence[int]) -> Any:
        """A 1-D int64 ``mindspore.Tensor`` of ``values``."""
        ms = _ms()
        return ms.Tensor([int(v) for v in values], ms.int64)

    def to_ints(self, tensor: Any) -> list[int]:
        """``tensor``'s elements as Python ints."""
        return [int(v) for v in tensor.asnumpy().reshape(-1)]

    # ------------------------------------------------------------------ launching
    @classmethod
    def launch_workers(cls, opts: Any, env: dict[str, str], out: Any) -> int | None:
        """``hyperpar run``: MindSpore's scheduler plus one worker per rank (no torchrun)."""
        from .launch import run

        return run(opts, env, out)

