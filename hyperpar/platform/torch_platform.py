"""TorchPlatform: the Platform contract implemented once for every PyTorch device backend.

A device backend (cpu, cuda, npu, ...) subclasses :class:`TorchPlatform` and sets only what
differs: ``name``, ``device_type``, ``dist_backend``, ``priority``, ``visible_devices_env``,
:meth:`device_module` and :meth:`is_available`. Everything else -- process groups, collectives
and their fallbacks -- lives here or in the :class:`Platform` defaults (hooks, module detection,
the differentiable collectives).

This module (and the backends) are the only places in hyperpar that call ``torch.distributed``.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from . import health, probes, traced
from .base import REDUCE_OPS, Availability, Group, P2POp, Work
from .timeout import default_timeout_s
from .torch_base import TorchPlatformBase

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")


class _DoneWork:
    """A completed Work handle, returned when a fallback ran synchronously."""

    def __init__(self, after: Callable[[], None] | None = None) -> None:
        self._after = after

    def wait(self) -> bool:
        if self._after is not None:
            self._after()
            self._after = None
        return True

    def is_completed(self) -> bool:
        return True


class _ThenWork:
    """Wraps a Work handle and runs ``after`` once it has completed (e.g. divide for avg)."""

    def __init__(self, work: Any, after: Callable[[], None]) -> None:
        self._work, self._after = work, after

    def wait(self) -> bool:
        self._work.wait()
        if self._after is not None:
            self._after()
            self._after = None
        return True


class TorchPlatform(TorchPlatformBase):
    """Shared PyTorch implementation of :class:`Platform` (abstract: no device of its own).

    Subclass attributes beyond the contract's:

    * ``native_reduce_ops`` -- reduce ops the collective library supports natively; others are
      emulated (``avg`` as ``sum`` then divide) and reported by :meth:`collective_fallbacks`.
    * ``traceable_collectives`` -- inside ``torch.compile`` the bulk collectives (all-reduce,
      all-gather, reduce-scatter, all-to-all, broadcast) run as torch's functional collectives
      (:mod:`hyperpar.platform.traced`), so a compiled region has no graph break at them. A
      backend whose collective library has no functional-collective support sets ``False``:
      each collective is then a graph break (correct, slower).

    Hooks, module detection and the differentiable collectives are the :class:`Platform`
    defaults; point-to-point and object collectives are overridden with torch's own calls.
    """

    native_reduce_ops: ClassVar[tuple[str, ...]] = REDUCE_OPS
    traceable_collectives: ClassVar[bool] = True

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Group] = {}
        self._runtime_fallbacks: dict[str, str] = {}

    # ------------------------------------------------------------------ device
    def device_module(self) -> ModuleType:
        """The ``torch.<device>`` module (``torch.cuda``, ``torch.npu``...)."""
        return getattr(torch, self.device_type)

    def device_count(self) -> int:
        return int(self.device_module().device_count())

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type, self.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        self.device_module().set_device(index)

    def current_device(self) -> int:
        return int(self.device_module().current_device())

    def synchronize(self) -> None:
        self.device_module().synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.device_module().manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return self.device_module().get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.device_module().set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        mod = self.device_module()
        return {
            "allocated": int(mod.memory_allocated()),
            "max_allocated": int(mod.max_memory_allocated()),
        }

    # ------------------------------------------------------------------ process groups
    def init_process_group(self, *, rank=None, world_size=None, init_method=None,
                           timeout_s=None) -> None:
        if dist.is_initialized():
            return
        if init_method is None:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            launched = any(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
            if missing and not launched and rank is None and world_size in (None, 1):
                # `python script.py` with no launcher: a world of one process, as torch's
                # init_device_mesh does for a lone process
                init_method, rank, world_size = f"tcp://127.0.0.1:{_free_port()}", 0, 1
            elif missing:
                raise RuntimeError(
                    f"cannot join the process group: {', '.join(missing)} not set. Launch with "
                    "`hyperpar run -n N script.py` (or torchrun), or pass init_method="
                )
            else:
                init_method = "env://"
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        # Refuse on every rank before the library would abort (NCCL: "Duplicate GPU detected").
        self.check_world_fits(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if self.device_type != "cpu" and self.device_count() > 0:
            local = int(os.environ.get("LOCAL_RANK", rank))
            self.set_device(local % self.device_count())
        timeout = timedelta(seconds=default_timeout_s() if timeout_s is None else timeout_s)
        dist.init_process_group(
            backend=self.dist_backend, init_method=init_method, rank=rank,
            world_size=world_size, timeout=timeout,
        )
        self._timeout = timeout
        _close_at_exit(self, owns_world=True)

    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._groups.clear()

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def new_group(self, ranks: Sequence[int]) -> Group:
        key = tuple(int(r) for r in ranks)
        if len(set(key)) != len(key):
            raise ValueError(f"new_group: duplicate ranks in {list(key)}")
        world = dist.get_world_size()
        bad = [r for r in key if not 0 <= r < world]
        if bad:
            raise ValueError(f"new_group: ranks {bad} outside the world (size {world})")
        if key not in self._groups:
            if key == tuple(range(world)):
                self._groups[key] = dist.group.WORLD
            else:
                timeout = getattr(self, "_timeout", None)
                self._groups[key] = dist.new_group(list(key), timeout=timeout)
                _close_at_exit(self, owns_world=False)
        return self._groups[key]

    def rank(self, group: Group = None) -> int:
        try:
            return dist.get_rank(group)
        except ValueError as err:
            raise _not_joined(err) from err

    def world_size(self, group: Group = None) -> int:
        try:
            return dist.get_world_size(group)
        except ValueError as err:
            raise _not_joined(err) from err

    def group_ranks(self, group: Group = None) -> list[int]:
        try:
            return list(dist.get_process_group_ranks(group or dist.group.WORLD))
        except ValueError as err:
            raise _not_joined(err) from err

    # ------------------------------------------------------------------ collectives
    def _native(self, op: str) -> bool:
        _check_op(op)
        return op in self.native_reduce_ops

    def _tracing(self) -> bool:
        """True inside a compiled region on a backend with traceable collectives."""
        return self.traceable_collectives and traced.compiling()

    def all_reduce(self, tensor, op="sum", group=None, async_op=False) -> Work | None:
        if self._tracing():
            traced.all_reduce(tensor, op, group, self._native(op))
            return _DoneWork() if async_op else None
        if self._native(op):
            return dist.all_reduce(tensor, _TORCH_OPS[op], group=group, async_op=async_op)
        if op != "avg":
            raise NotImplementedError(f"{self.name}: reduce op {op!r} has no fallback")
        n = self.world_size(group)
        work = dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group, async_op=async_op)
        if async_op:
            return _ThenWork(work, lambda: tensor.div_(n))
        tensor.div_(n)
        return None

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        if self._tracing():
            traced.all_gather_into_tensor(output, input, group)
            return _DoneWork() if async_op else None
        # Eager collectives are not autograd ops: hand the library detached tensors. gloo copies
        # into chunk views of ``output`` on its worker thread; with an input that requires grad
        # (a parameter) that copy could raise at wait() ("A view was created in no_grad mode
        # and is being modified inplace"), depending on thread timing.
        output, input = output.detach(), input.detach()
        if "all_gather_into_tensor" not in self._runtime_fallbacks:
            try:
                return _all_gather_single(output, input, group=group, async_op=async_op)
            except RuntimeError as exc:  # a library without the fused op
                if "support" not in str(exc).lower():
                    raise
                self._runtime_fallbacks["all_gather_into_tensor"] = (
                    f"list all_gather + copy ({exc.__class__.__name__}: native op unsupported)"
                )
        chunks = list(output.chunk(self.world_size(group)))
        dist.all_gather(chunks, input.contiguous(), group=group)
        return _DoneWork() if async_op else None

    def reduce_scatter_tensor(self, output, input, op="sum", group=None, async_op=False):
        if self._tracing():
            if self._native(op) and not probes.known_good(self.dist_backend, op):
                # not measured correct (probes.py): reduce everything, keep this rank's rows
                full = input.contiguous().clone()
                traced.all_reduce(full, op, group, True)
                output.copy_(full.chunk(self.world_size(group))[self.rank(group)]
                             .view(output.shape))
            else:
                traced.reduce_scatter_tensor(output, input, op, group, self._native(op))
            return _DoneWork() if async_op else None
        output, input = output.detach(), input.detach()  # see all_gather_into_tensor
        n = self.world_size(group)
        native = self._native(op)
        if not native and op != "avg":
            raise NotImplementedError(f"{self.name}: reduce op {op!r} has no fallback")
        torch_op = _TORCH_OPS[op if native else "sum"]
        after = None if native else (lambda: output.div_(n))
        if op in probes.PROBED_OPS and native and n > 1:  # measured once per process
            if probes.reduce_scatter_verdicts(self.dist_backend) is None:
                probes.probe_on_group(self.dist_backend, op, group, input.device)
        if ("reduce_scatter_tensor" not in self._runtime_fallbacks
                and probes.known_good(self.dist_backend, op)):
            try:
                work = _reduce_scatter_single(output, input, torch_op, group=group,
                                              async_op=async_op)
            except RuntimeError as exc:
                if "support" not in str(exc).lower():
                    raise
                self._runtime_fallbacks["reduce_scatter_tensor"] = (
                    "all_reduce + local slice (native reduce-scatter unsupported)"
                )
            else:
                if async_op:
                    return _ThenWork(work, after) if after else work
                if after:
                    after()
                return None
        full = input.clone()
        dist.all_reduce(full, torch_op, group=group)
        output.copy_(full.chunk(n)[self.rank(group)])
        if after:
            after()
        return _DoneWork() if async_op else None

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if self._tracing():
            traced.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)
            return _DoneWork() if async_op else None
        return dist.all_to_all_single(
            output.detach(), input.detach(),  # see all_gather_into_tensor
            list(output_split_sizes) if output_split_sizes is not None else None,
            list(input_split_sizes) if input_split_sizes is not None else None,
            group=group, async_op=async_op,
        )

    def broadcast(self, tensor, src, group=None, async_op=False):
        if self._tracing():
            traced.broadcast(tensor, src, group)
            return _DoneWork() if async_op else None
        return dist.broadcast(tensor, src, group=group, async_op=async_op)

    def send(self, tensor, dst, group=None, tag=0) -> None:
        dist.send(tensor, dst, group=group, tag=tag)

    def recv(self, tensor, src, group=None, tag=0) -> None:
        dist.recv(tensor, src, group=group, tag=tag)

    def isend(self, tensor, dst, group=None, tag=0) -> Work:
        return dist.isend(tensor, dst, group=group, tag=tag)

    def irecv(self, tensor, src, group=None, tag=0) -> Work:
        return dist.irecv(tensor, src, group=group, tag=tag)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        if not ops:
            return []
        # Individually posted isend/irecv are deadlock-free on every torch library (each is
        # queued without waiting for the peer); torch's batched API adds NCCL group semantics.
        if self.dist_backend == "gloo":
            return [
                (self.isend if op.kind == "send" else self.irecv)(op.tensor, op.peer, op.group,
                                                                   op.tag)
                for op in ops
            ]
        p2p = [
            dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, op.peer,
                       op.group, op.tag)
            for op in ops
        ]
        return list(dist.batch_isend_irecv(p2p))

    def barrier(self, group: Group = None) -> None:
        dist.barrier(group=group)

    def all_gather_object(self, obj: Any, group: Group = None) -> list[Any]:
        out: list[Any] = [None] * self.world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: Any, src: int, group: Group = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def collective_fallbacks(self) -> dict[str, str]:
        found = {
            f"reduce op {op!r}": "sum, then divide by the group size"
            for op in REDUCE_OPS if op not in self.native_reduce_ops and op == "avg"
        }
        found.update(self._runtime_fallbacks)
        if any(op in self.native_reduce_ops for op in probes.PROBED_OPS):
            found.update(probes.reduce_scatter_fallbacks(self.dist_backend))
        return found


# Count collectives and, when one fails, name the rank that did not reach it (health.py).
health.instrument(TorchPlatform)


class HostDevicePlatform(TorchPlatform):
    """A TorchPlatform whose tensors live on the host CPU: one "device", nothing to select or
    synchronise, the host random generator. Subclasses set ``name``, ``dist_backend`` and
    ``priority`` (and ``native_reduce_ops`` for their collective library)."""

    device_type = "cpu"
    ranks_share_device = True

    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type)

    def set_device(self, index: int) -> None:
        """Processes share the host; there is no device to select."""

    def current_device(self) -> int:
        return 0

    def synchronize(self) -> None:
        """Host kernels run synchronously."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        # Peak resident set size of the process (Linux reports KiB): the closest host analogue.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"allocated": 0, "max_allocated": int(peak)}


def accelerator_availability(platform_cls: type[TorchPlatform], module: ModuleType | None,
                             import_error: str | None = None) -> Availability:
    """Shared probe for device backends: explain precisely why the device is unusable."""
    if import_error:
        return Availability(False, import_error)
    if module is None or not hasattr(module, "is_available"):
        return Availability(False, f"torch has no '{platform_cls.device_type}' device module")
    try:
        if not module.is_available():
            env = platform_cls.visible_devices_env
            shown = f" ({env}={os.environ[env]!r})" if env and env in os.environ else ""
            return Availability(False, f"no {platform_cls.device_type} device visible{shown}")
        if module.device_count() < 1:
            return Availability(False, f"{platform_cls.device_type} device_count() is 0")
    except Exception as exc:  # a broken driver must not crash selection
        return Availability(False, f"{platform_cls.device_type} probe raised {exc!r}")
    return Availability(True)


# id(platform) -> (the platform, whether it joined the world itself), for the exit hook
_TO_CLOSE: dict[int, tuple[TorchPlatform, bool]] = {}


def _close_at_exit(platform: TorchPlatform, *, owns_world: bool) -> None:
    """Close ``platform``'s process groups before the interpreter shuts down.

    Why: a collective library's worker thread (gloo's ``runLoop``) may drop the last reference
    to a finished work whose tensors own a Python object *after* the main thread has entered
    ``Py_FinalizeEx``; taking the GIL then ends that thread through a noexcept destructor and
    the process aborts (``terminate called without an active exception``, SIGABRT) although
    the script succeeded. Destroying the groups first joins those threads while Python is
    still whole. Registered once per process (``atexit`` runs it after the script's own exit
    handlers, which may still use the groups). A world joined through hyperpar is destroyed
    whole; in a world the script joined itself, only the groups hyperpar created are.
    """
    first = not _TO_CLOSE
    previous = _TO_CLOSE.get(id(platform), (platform, False))[1]
    _TO_CLOSE[id(platform)] = (platform, previous or owns_world)
    if first:
        import atexit

        atexit.register(_close_all, os.getpid())


def _close_all(pid: int) -> None:
    if os.getpid() != pid:  # a forked child inherited the hook, not the groups' threads
        return
    import gc

    gc.collect()  # graphs and meshes in the script's globals hold works and groups
    for platform, owns_world in list(_TO_CLOSE.values()):
        groups = [None] if owns_world else [
            g for g in platform._groups.values() if g is not dist.group.WORLD]
        for group in groups:
            try:  # a group the script destroyed already is gone: nothing to close
                if dist.is_initialized():
                    dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 -- never turn a finished run into a failure
                pass
        platform._groups.clear()
    _TO_CLOSE.clear()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _not_joined(err: ValueError) -> Exception:
    """torch's "default process group has not been initialized" as the platform's error (the
    MindSpore platform raises the same); any other ValueError (a bad group) passes unchanged."""
    if dist.is_initialized():
        return err
    return RuntimeError(
        "this process has not joined a process group: call "
        "get_platform().init_process_group() (init_device_mesh does) before asking for ranks "
        "or running collectives")
