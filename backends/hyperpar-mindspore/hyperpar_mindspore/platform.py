"""MindSporePlatform: the hyperpar Platform contract on MindSpore (CPU, Ascend, GPU targets).

Collectives run through ``mindspore.mint.distributed``. Where MindSpore has no kernel for the
target (on CPU: all-gather into one tensor, reduce-scatter, all-to-all) the platform composes the
operation from collectives that exist and :meth:`MindSporePlatform.collective_fallbacks` (shown by
``hyperpar info``) lists each composition. Three MindSpore traits are hidden here:

* only the member ranks of a group may create it -- :meth:`new_group` keeps hyperpar's contract
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

import atexit
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyperpar.platform import Availability
from hyperpar.platform.base import REDUCE_OPS, Group, P2POp, Platform, Work
from hyperpar.platform.dim_collectives import DimCollectives
from hyperpar.platform.timeout import default_timeout_s

from .launch_env import ranks_needed_here, read_launch_env

#: attribute a MindSpore parallel style sets on each Parameter it made: its placements.
SHARD_PLACEMENTS = "_hyperpar_placements"

#: Targets hyperpar knows, by the name MindSpore's ``set_device`` takes.
TARGETS = ("CPU", "Ascend", "GPU")
TARGET_ENV = "HYPERPAR_MS_DEVICE"
# How the library is called per target (MindSpore's own name on CPU is its "MCCL").
_LIBRARY = {"CPU": "mccl", "Ascend": "hccl", "GPU": "nccl"}
_NATIVE_OPS = ("sum", "max", "min", "product")

#: Collectives MindSpore has no CPU kernel for, and how the platform composes them.
CPU_COMPOSITIONS = {
    "all_gather_into_tensor": "list all_gather, then concatenate along dim 0",
    "reduce_scatter_tensor": "all_reduce of a copy, then this rank's slice",
    "all_to_all_single": "all_gather of the (padded) inputs, then select this rank's pieces",
    "reduce op 'avg'": "sum, then divide by the group size",
    "all_to_all_single_autograd": "the composed all_to_all_single in a Cell whose bprop runs "
                                  "it with the split lists swapped (no AlltoAllV CPU kernel)",
}


def _ms() -> Any:
    import mindspore

    return mindspore


def _dist() -> Any:
    import mindspore.mint.distributed as dist

    return dist


@dataclass(frozen=True)
class MSGroup:
    """A process group: its global ranks and, on member ranks, MindSpore's group name."""

    ranks: tuple[int, ...]
    name: str | None


class _DoneWork:
    """Handle of a collective that already completed (composed collectives run eagerly)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def detect_target() -> str:
    """The device target: ``HYPERPAR_MS_DEVICE`` if set, else Ascend or GPU when MindSpore sees
    one, else CPU."""
    wanted = os.environ.get(TARGET_ENV, "").strip()
    if wanted:
        match = [t for t in TARGETS if t.lower() == wanted.lower()]
        if not match:
            raise ValueError(f"{TARGET_ENV}={wanted!r} is not a MindSpore target; use one of "
                             f"{', '.join(TARGETS)}")
        return match[0]
    hal = _ms().hal
    for target in ("Ascend", "GPU"):
        try:
            if hal.is_available(target) and hal.device_count(target) > 0:
                return target
        except Exception:  # a target whose plugin cannot load is simply not there
            continue
    return "CPU"


class MindSporePlatform(Platform, DimCollectives):
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

    def new_group(self, ranks: Sequence[int]) -> MSGroup:
        """Group of ``ranks`` (every rank calls it; only members create MindSpore's group)."""
        key = tuple(int(r) for r in ranks)
        if key not in self._groups:
            if sorted(set(key)) != sorted(key) or any(not 0 <= r < self._world for r in key):
                raise ValueError(f"new_group: ranks {list(key)} must be distinct ranks of the "
                                 f"world 0..{self._world - 1}")
            name = None
            if key == tuple(range(self._world)):
                name = None if self._world == 1 else _world_group_name()
            elif self._rank in key:
                name = _dist().new_group(list(key))
            self._groups[key] = MSGroup(key, name)
        return self._groups[key]

    def _ranks(self, group: Group) -> tuple[int, ...]:
        if not self._initialized:  # a world size of 1 here would be silently wrong under a launcher
            raise RuntimeError("the MindSpore platform has not joined a process group: call "
                               "get_platform().init_process_group() (init_device_mesh does) "
                               "before asking for ranks or running collectives")
        return tuple(range(self._world)) if group is None else group.ranks

    def rank(self, group: Group = None) -> int:
        ranks = self._ranks(group)
        return ranks.index(self._rank) if self._rank in ranks else -1

    def world_size(self, group: Group = None) -> int:
        return len(self._ranks(group))

    def group_ranks(self, group: Group = None) -> list[int]:
        return list(self._ranks(group))

    def _name(self, group: Group, what: str) -> str | None:
        if group is None:
            return None
        if self._rank not in group.ranks:
            raise ValueError(f"{what}: rank {self._rank} is not a member of the group of ranks "
                             f"{list(group.ranks)}; only members may call its collectives")
        return group.name

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group = None,
                   async_op: bool = False) -> Work | None:
        _check_op(op)
        n = self.world_size(group)
        if n == 1:
            return _DoneWork() if async_op else None
        name = self._name(group, "all_reduce")
        from mindspore.ops import ReduceOp

        native = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX,
                  "min": ReduceOp.MIN, "product": ReduceOp.PROD}[op]
        work = _dist().all_reduce(tensor, native, group=name, async_op=async_op and op != "avg")
        if op == "avg":
            tensor.copy_(tensor / n)
            return _DoneWork() if async_op else None
        return work

    def gather_list(self, tensor: Any, group: Group, what: str) -> list[Any]:
        """Every rank's ``tensor`` (equal shapes), in group-rank order: MindSpore's native list
        all-gather, the building block of the composed collectives. ``what`` names the caller
        in errors."""
        n = self.world_size(group)
        if n == 1:
            return [tensor]
        name = self._name(group, what)
        out = [_ms().mint.empty_like(tensor) for _ in range(n)]
        _dist().all_gather(out, tensor, group=name)
        return out

    def all_gather_into_tensor(self, output: Any, input: Any, group: Group = None,
                               async_op: bool = False) -> Work | None:
        n = self.world_size(group)
        if tuple(output.shape) != (n * input.shape[0], *input.shape[1:]):
            raise ValueError(f"all_gather_into_tensor: output shape {tuple(output.shape)} must be "
                             f"({n} * {input.shape[0]}, *{tuple(input.shape[1:])})")
        output.copy_(_ms().mint.cat(self.gather_list(input, group, "all_gather_into_tensor")))
        return _DoneWork() if async_op else None

    def reduce_scatter_tensor(self, output: Any, input: Any, op: str = "sum",
                              group: Group = None, async_op: bool = False) -> Work | None:
        _check_op(op)
        n = self.world_size(group)
        rows = output.shape[0]
        if tuple(input.shape) != (n * rows, *output.shape[1:]):
            raise ValueError(f"reduce_scatter_tensor: input shape {tuple(input.shape)} must be "
                             f"({n} * {rows}, *{tuple(output.shape[1:])})")
        if n == 1:
            output.copy_(input)
        elif self.target == "CPU" and input.nbytes >= RING_MIN_BYTES * n * n:
            output.copy_(self._ring_reduce_scatter(input, rows, op, group))
        else:
            total = copy_tensor(input)
            self.all_reduce(total, op, group)
            output.copy_(_rows(total, self.rank(group) * rows, rows))
        return _DoneWork() if async_op else None

    def _ring_reduce_scatter(self, input: Any, rows: int, op: str, group: Group) -> Any:
        """This rank's reduced rows by a ring of point-to-point exchanges: ``n - 1`` steps,
        each sending one ``rows`` block to the next rank and adding the block received from
        the previous one, so a rank sends ``(n - 1) / n`` of the input. MindSpore's CPU build
        has no ReduceScatter kernel; the all-reduce composition it replaces moved the whole
        input and took 1.6-2x as long for 4-16 MiB on 2 ranks (measured, MindSpore 2.10)."""
        ranks = self._ranks(group)
        n, me = len(ranks), ranks.index(self._rank)
        nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]
        combine = {"sum": _ms().mint.add, "avg": _ms().mint.add,
                   "max": _ms().mint.maximum, "min": _ms().mint.minimum,
                   "product": _ms().mint.mul}[op]
        send = _rows(input, ((me - 1) % n) * rows, rows)
        for step in range(n - 1):
            recv = _ms().ops.zeros_like(send)
            ops = [P2POp("send", send, nxt, group), P2POp("recv", recv, prev, group)]
            # even ranks send first, odd ones receive first: no cycle of blocked sends
            for work in self.batch_isend_irecv(ops if me % 2 == 0 else ops[::-1]):
                work.wait()
            block = (me - step - 2) % n
            send = combine(recv, _rows(input, block * rows, rows))
        return send / n if op == "avg" else send

    def all_to_all_single(self, output: Any, input: Any,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: Group = None,
                          async_op: bool = False) -> Work | None:
        mint = _ms().mint
        n, me = self.world_size(group), self.rank(group)
        sends = _splits(input_split_sizes, input.shape[0], n, "input")
        _splits(output_split_sizes, output.shape[0], n, "output")
        # Every rank learns every rank's split table, pads its input to the longest, gathers.
        table = self.gather_list(_ms().Tensor(sends, _ms().int64), group, "all_to_all_single")
        table = [[int(v) for v in row.asnumpy()] for row in table]
        longest = max(sum(row) for row in table)
        padded = input
        if input.shape[0] < longest:
            pad = mint.zeros((longest - input.shape[0], *input.shape[1:]), dtype=input.dtype)
            padded = mint.cat([input, pad])
        pieces = []
        for src, data in enumerate(self.gather_list(padded, group, "all_to_all_single")):
            start = sum(table[src][:me])
            pieces.append(_rows(data, start, table[src][me]))
        got = mint.cat(pieces) if pieces else output
        if tuple(got.shape) != tuple(output.shape):
            raise ValueError(f"all_to_all_single: received {tuple(got.shape)} rows in total but "
                             f"output has shape {tuple(output.shape)}; check output_split_sizes")
        output.copy_(got)
        return _DoneWork() if async_op else None

    def all_to_all_single_autograd(self, tensor: Any, output_split_sizes: Sequence[int] | None,
                                   input_split_sizes: Sequence[int] | None,
                                   group: Group = None) -> Any:
        """Differentiable uneven dim-0 all-to-all (expert parallelism's dispatch and combine);
        backward: the same exchange with the split lists swapped
        (:func:`hyperpar_mindspore.moe.all_to_all_single_autograd`)."""
        from .moe import all_to_all_single_autograd

        return all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, group)

    def broadcast(self, tensor: Any, src: int, group: Group = None,
                  async_op: bool = False) -> Work | None:
        if self.world_size(group) == 1:
            return _DoneWork() if async_op else None
        return _dist().broadcast(tensor, src, group=self._name(group, "broadcast"),
                                 async_op=async_op)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        dist = _dist()
        works = []
        for op in ops:
            name = self._name(op.group, f"{op.kind} to/from rank {op.peer}")
            call = dist.isend if op.kind == "send" else dist.irecv
            works.append(call(op.tensor, op.peer, group=name, tag=op.tag))
        return works

    def barrier(self, group: Group = None) -> None:
        if self.world_size(group) > 1:
            _dist().barrier(group=self._name(group, "barrier"))

    # ------------------------------------------------------------------ object collectives
    def all_gather_object(self, obj: Any, group: Group = None) -> list[Any]:
        """Picklable ``obj`` from every rank of ``group``, in group-rank order."""
        if self.world_size(group) == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size(group)
        _dist().all_gather_object(out, obj, group=self._name(group, "all_gather_object"))
        return out

    def broadcast_object(self, obj: Any, src: int, group: Group = None) -> Any:
        """Picklable ``obj`` of global rank ``src``, returned on every rank."""
        if self.world_size(group) == 1:
            return obj
        box = [obj]
        _dist().broadcast_object_list(box, src, group=self._name(group, "broadcast_object"))
        return box[0]

    def parallel_api(self) -> Any:
        """:mod:`hyperpar_mindspore`: ``from hyperpar import ColwiseParallel`` (and the mesh,
        ``parallelize_module``, the other styles) resolves to the Cell implementations."""
        return importlib.import_module("hyperpar_mindspore")

    def tp_mechanics(self) -> Any:
        """The Cell mechanics of hyperpar's one set of parallel styles
        (:data:`hyperpar_mindspore.prepare.MECHANICS`)."""
        return importlib.import_module("hyperpar_mindspore.prepare").MECHANICS

    def collective_fallbacks(self) -> dict[str, str]:
        if self.target == "CPU":
            return dict(CPU_COMPOSITIONS)
        return {"reduce op 'avg'": CPU_COMPOSITIONS["reduce op 'avg'"]}

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



#: What :func:`tune_threads` sets per target. CPU: MindSpore's defaults start many threads per
#: process, which on a shared host made every collective 5-10x slower. Ascend/GPU: nothing is
#: forced -- a blocking launch would make every kernel launch on the NPU/GPU synchronous.
TUNING = {
    "CPU": {"op threads": "1", "dispatch threads": "1", "kernel launches": "blocking"},
    "Ascend": {"kernel launches": "asynchronous (MindSpore's default)"},
    "GPU": {"kernel launches": "asynchronous (MindSpore's default)"},
}


def compiler_output_dir() -> str:
    """Where MindSpore's graph compiler writes ``rank_N/om/`` (``analyze_fail.ir`` after a
    failed ``ms.jit`` compile): ``MS_OM_PATH`` when the user set it, else a folder under the
    system's temporary directory -- never the user's working directory."""
    return os.environ.get("MS_OM_PATH") or os.path.join(tempfile.gettempdir(),
                                                        "hyperpar-mindspore")


def route_compiler_output() -> None:
    """Point ``MS_OM_PATH`` at :func:`compiler_output_dir` unless the user chose one (measured
    on MindSpore 2.10: read at the failure, so setting it after import works; the error
    message names the file's full path)."""
    os.environ.setdefault("MS_OM_PATH", compiler_output_dir())


#: CPU reduce-scatter takes the point-to-point ring from ``RING_MIN_BYTES * n**2`` input bytes
#: on: each of its ``n - 1`` steps costs a round trip, so small inputs are faster through the
#: all-reduce composition. Measured (MindSpore 2.10, 2 cores), ring / all-reduce time: n=2
#: 1.51 at 16 KiB, 0.88 at 256 KiB, 0.73 at 4 MiB; n=4 1.68 at 256 KiB, 0.98 at 4 MiB, 0.73 at
#: 16 MiB.
RING_MIN_BYTES = 256 * 1024


def quiet_cpu_synchronize() -> None:
    """MindSpore 2.10's ``runtime.synchronize()`` (which its own ``barrier`` calls) logs "CPU
    device is not supported" as an ERROR on its first call on CPU and skips that call; the C
    function it wraps works on CPU (measured), so mark the first call as made: no false ERROR
    line on every rank, and that first call synchronizes too."""
    try:
        from mindspore.runtime import stream
        stream.function_stream_status["synchronize"] = True
    except (ImportError, AttributeError, TypeError):  # another MindSpore version: leave it
        pass


def tune_threads(ms: Any, target: str = "CPU") -> None:
    """Apply :data:`TUNING` for ``target`` (CPU only: one op thread, one dispatch thread,
    blocking launches). ``HYPERPAR_MS_KEEP_THREADS=1`` keeps MindSpore's defaults."""
    if os.environ.get("HYPERPAR_MS_KEEP_THREADS") or target != "CPU":
        return
    try:
        ms.device_context.cpu.op_tuning.threads_num(1)
        ms.runtime.dispatch_threads_num(1)
        ms.runtime.launch_blocking()
    except RuntimeError:  # already set in this process (they may be set once)
        pass


def start_scheduler(host: str, port: int, world: int, target: str) -> subprocess.Popen:
    """Start MindSpore's scheduler process for a world of ``world`` workers."""
    env = dict(os.environ, MS_ROLE="MS_SCHED", MS_WORKER_NUM=str(world), MS_SCHED_HOST=host,
               MS_SCHED_PORT=str(port), HYPERPAR_MS_DEVICE=target,
               HYPERPAR_MS_PARENT=str(os.getpid()))
    env.pop("MS_NODE_ID", None)
    env.setdefault("GLOG_v", "3")
    proc = subprocess.Popen([sys.executable, "-m", "hyperpar_mindspore.scheduler"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _address(init_method: str | None) -> tuple[str, int]:
    if init_method and init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://"):].rpartition(":")
        return host, int(port)
    try:
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    except KeyError:
        raise ValueError("init_process_group: a world of more than one process needs "
                         "MASTER_PORT (or init_method='tcp://host:port'), or start it with "
                         "`hyperpar run -n N script.py`") from None


def _world_group_name() -> str:
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def _point_p2p_at_world_group() -> None:
    # mint.distributed binds the world group's name as a default argument at import time, before
    # init() knows the real one; point-to-point calls then look up a group that does not exist.
    module = sys.modules.get("mindspore.mint.distributed.distributed")
    if module is None:
        import mindspore.mint.distributed.distributed as module
    world = _world_group_name()
    for fn_name in ("get_cache_group_size", "get_cache_group_rank"):
        fn = getattr(module, fn_name, None)
        if fn is not None and fn.__defaults__:
            fn.__defaults__ = (world,)


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")


def _splits(sizes: Sequence[int] | None, rows: int, n: int, what: str) -> list[int]:
    if sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all_single: {what} has {rows} rows, not divisible by the "
                             f"group size {n}; pass {what}_split_sizes")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"all_to_all_single: {what}_split_sizes {sizes} must be {n} "
                         f"non-negative counts summing to the {rows} rows of {what}")
    return sizes


def copy_tensor(tensor: Any) -> Any:
    """A copy of ``tensor`` with storage of its own (differentiable). ``Tensor.copy()`` casts to
    float32, divides by 1.0 and casts back: 7-9 ms for 2 MiB of float32 on CPU, against 0.19 ms
    for the Identity kernel (measured, MindSpore 2.10) -- fully_shard's reduce-scatter paid it
    twice per unit per step. Identity has no bfloat16 CPU kernel; that dtype keeps ``copy()``."""
    ms = _ms()
    if tensor.dtype == ms.bfloat16:
        return tensor.copy()
    return ms.ops.deepcopy(tensor)


def _rows(tensor: Any, start: int, count: int) -> Any:
    # A slice of a MindSpore tensor is a view that in-place copies misread (they see the whole
    # storage); the copy makes it a tensor of its own.
    return copy_tensor(_ms().mint.narrow(tensor, 0, start, count))
