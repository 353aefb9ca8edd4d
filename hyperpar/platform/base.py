r"""The Platform contract: the only thing a hyperpar backend implements. Framework-neutral.

Everything above ``hyperpar/platform/`` talks to hardware exclusively through an instance of
:class:`Platform`, obtained with :func:`hyperpar.platform.get_platform`. This module imports no
framework: the registry, ``hyperpar info`` and ``hyperpar run`` use it in a venv that has
MindSpore and no torch (or neither). Tensors, modules and devices are typed loosely here
(:data:`Tensor`, :data:`Module`, :data:`Device`); each framework fixes them:

* PyTorch: :class:`hyperpar.platform.torch_base.TorchPlatformBase` adds the torch-bound defaults
  (hooks on ``nn.Module``, ``nn.Linear``/``nn.Embedding`` detection, object collectives, the
  differentiable collectives) and :class:`~hyperpar.platform.torch_platform.TorchPlatform`
  implements the abstract members once for the cpu, cuda and npu backends;
* MindSpore: the ``hyperpar-mindspore`` backend implements the same members on ``mindspore``
  tensors and ``nn.Cell``\ s.

The contract has five facets:

1. identity & device    -- which device, which collective library, how many devices, RNG;
2. module detection     -- which modules are Linear / Embedding / norm layers (by the classes
                           each framework lists in ``linear_types`` ...);
3. hooks                -- forward-pre / forward / backward hooks with removable handles
                           (framework-bound: supplied by each framework's base class);
4. collectives & groups -- process groups and the collectives a parallel runtime needs;
5. tensor mechanics     -- the few tensor operations the framework-neutral layers need (a mesh's
                           rank tensor; cat, split, narrow, zero padding, reshape, empty tensors
                           for the along-a-dim collectives), so those layers import no framework.
                           Framework-bound: each framework's base class supplies them; the
                           neutral default raises ``NotImplementedError`` naming the member.

Only what a backend must decide is abstract: the device, process groups and seven collectives.
The rest (blocking and single point-to-point calls, capacity checks, module detection by type,
memory counters) is a concrete, documented default built on those members, which a backend may
override; the conformance kit checks both kinds.

Conventions used by every collective below:

* ``group=None`` means the default (world) group. A group is an opaque handle returned by
  :meth:`Platform.new_group`; callers never look inside it.
* Peers (``src``, ``dst``, ``peer``) are *global* ranks, as in ``torch.distributed``.
* ``op`` is one of :data:`REDUCE_OPS` (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``).
* A tensor exposes ``.shape`` (a sequence of ints): the one attribute the neutral layers read
  directly; every other tensor operation they need is a tensor-mechanics member.
* ``async_op=True`` returns a :class:`Work` handle whose ``wait()`` completes the operation;
  otherwise the call blocks and returns ``None`` (in-place collectives) or the result tensor.
* Collectives honour the timeout given to :meth:`Platform.init_process_group`: a peer that never
  arrives makes the call raise instead of hanging.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

#: Reduction names accepted by every reducing collective.
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")

#: An opaque process-group handle (``None`` means the world group).
Group = Any
#: A framework tensor (``torch.Tensor``, ``mindspore.Tensor``...); the contract does not care which.
Tensor = Any
#: A framework module (``torch.nn.Module``, ``mindspore.nn.Cell``...).
Module = Any
#: A framework device handle (``torch.device``; a device string where the framework has no type).
Device = Any


class Work(Protocol):
    """Handle of an asynchronous collective; ``wait()`` blocks until it has completed."""

    def wait(self) -> Any: ...


class RemovableHandle(Protocol):
    """Handle returned by hook registration; ``remove()`` unregisters the hook."""

    def remove(self) -> None: ...


class BackendError(RuntimeError):
    """A backend cannot be found, loaded, validated or used."""


class DeviceCapacityError(BackendError):
    """More ranks were asked for on this host than the backend's devices can hold."""


@dataclass(frozen=True)
class Availability:
    """Result of a backend's availability probe: ``ok`` and, when not ok, the reason why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class P2POp:
    """One point-to-point operation for :meth:`Platform.batch_isend_irecv`.

    ``kind`` is ``"send"`` or ``"recv"``; ``peer`` is the global rank of the other side.
    """

    kind: Literal["send", "recv"]
    tensor: Tensor
    peer: int
    group: Group = None
    tag: int = 0


class Platform(abc.ABC):
    """Abstract hardware platform. Subclasses must implement every abstract member and may
    override any concrete one.

    Class attributes every backend sets:

    * ``name`` -- the backend name users select (``HYPERPAR_BACKEND=name``).
    * ``device_type`` -- type of device tensors live on (``"cpu"``, ``"cuda"``, ...).
    * ``dist_backend`` -- the collective library name (``"gloo"``, ``"nccl"``, ``"hccl"``).
    * ``priority`` -- auto-detection order; the highest available backend wins (cpu is 0).
    * ``visible_devices_env`` -- environment variable restricting visible devices, or ``None``.
    * ``ranks_share_device`` -- whether several ranks of one host may use the same device
      (host tensors: yes; NCCL and HCCL need one device per rank: no, the default).
    * ``framework`` -- the tensor framework the backend runs (``"torch"``, ``"mindspore"``).
    * ``linear_types`` / ``embedding_types`` / ``norm_types`` -- module classes recognised by
      the module-detection facet; extend them for fused device-specific layers.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    dist_backend: ClassVar[str]
    priority: ClassVar[int] = 0
    visible_devices_env: ClassVar[str | None] = None
    ranks_share_device: ClassVar[bool] = False
    framework: ClassVar[str] = ""
    linear_types: ClassVar[tuple[type, ...]] = ()
    embedding_types: ClassVar[tuple[type, ...]] = ()
    norm_types: ClassVar[tuple[type, ...]] = ()

    # ------------------------------------------------------------------ identity & device
    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> Availability:
        """Probe whether this backend can run here; never raises. ``reason`` explains a no."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices of ``device_type`` visible to this process (cpu: 1)."""

    @abc.abstractmethod
    def device(self, index: int | None = None) -> Device:
        """The ``Device`` for ``index`` (default: this process's current device)."""

    @abc.abstractmethod
    def set_device(self, index: int) -> None:
        """Make device ``index`` current for this process (no-op where meaningless)."""

    def current_device(self) -> int:
        """Index of this process's current device (default: the index of :meth:`device`)."""
        index = getattr(self.device(), "index", None)
        return 0 if index is None else int(index)

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all queued work on the current device has finished."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the host and current-device random generators."""

    @abc.abstractmethod
    def get_rng_state(self) -> Tensor:
        """Snapshot of the current device's random generator state (a byte tensor)."""

    @abc.abstractmethod
    def set_rng_state(self, state: Tensor) -> None:
        """Restore a state returned by :meth:`get_rng_state`."""

    def memory_stats(self) -> dict[str, int]:
        """Memory counters in bytes; at least ``allocated`` and ``max_allocated`` (0 if unknown,
        which is the default)."""
        return {"allocated": 0, "max_allocated": 0}

    def max_local_ranks(self) -> int | None:
        """Most ranks this host can run: ``None`` (no limit) when ranks share a device, else
        :meth:`device_count` -- one device per rank."""
        return None if self.ranks_share_device else self.device_count()

    def check_world_fits(self, local_ranks: int) -> None:
        """Raise :class:`DeviceCapacityError` (before any process group exists) when
        ``local_ranks`` ranks on this host need more devices than are visible."""
        limit = self.max_local_ranks()
        if limit is None or local_ranks <= limit:
            return
        env = self.visible_devices_env
        shown = f" ({env}={os.environ[env]!r})" if env and env in os.environ else ""
        devices = f"{limit} {self.device_type} device{'' if limit == 1 else 's'}"
        fix = f"run with -n {limit}, make" if limit else "make"
        raise DeviceCapacityError(
            f"{local_ranks} ranks but {devices} visible{shown}: {self.dist_backend.upper()} "
            f"needs one device per rank; {fix} more devices visible, or use the cpu backend"
        )

    # ------------------------------------------------------------------ module detection
    def is_linear(self, module: Module) -> bool:
        """True for an affine layer ``y = x W^T + b`` with ``weight`` of shape (out, in)."""
        return isinstance(module, self.linear_types)

    def is_embedding(self, module: Module) -> bool:
        """True for a lookup table with ``weight`` of shape (num_embeddings, embedding_dim)."""
        return isinstance(module, self.embedding_types)

    def is_norm(self, module: Module) -> bool:
        """True for a normalisation layer (LayerNorm, RMSNorm, BatchNorm, GroupNorm...)."""
        # User-defined RMSNorm classes are common (Llama); recognise them by name too.
        return isinstance(module, self.norm_types) or bool(
            _NORM_NAME.search(type(module).__name__)
        )

    def named_children(self, module: Module) -> Iterable[tuple[str, Module]]:
        """``(name, child)`` for each direct submodule, in definition order (default: the
        module's ``named_children()``, PyTorch's spelling)."""
        return module.named_children()

    def named_modules(self, module: Module) -> Iterable[tuple[str, Module]]:
        """``(dotted path, submodule)`` for ``module`` itself (path ``""``) and every submodule,
        each once (default: the module's ``named_modules()``)."""
        return module.named_modules()

    def named_parameters(self, module: Module, *, recurse: bool = True
                         ) -> Iterable[tuple[str, Tensor]]:
        """``(name, parameter)`` of ``module``: with ``recurse=False`` the ones it holds itself
        (attribute names, every slot even when two hold one parameter), else every parameter
        under it once, by dotted path (default: PyTorch's ``named_parameters``)."""
        return module.named_parameters(recurse=recurse)

    def set_parameter(self, module: Module, name: str, value: Tensor) -> Tensor:
        """Make ``value`` parameter ``name`` (a direct attribute) of ``module`` and return the
        parameter now registered (a framework wraps a plain tensor, keeping ``requires_grad``)."""
        raise NotImplementedError(f"the {self.name} platform cannot replace parameters")

    def parameter_placements(self, param: Tensor) -> tuple[Any, ...] | None:
        """The placements of a distributed parameter (a DTensor, or a shard a parallel style
        made), ``None`` for a plain one (default: its ``placements`` attribute, if any)."""
        placements = getattr(param, "placements", None)
        return None if placements is None else tuple(placements)

    # ------------------------------------------------------------------ process groups
    @abc.abstractmethod
    def init_process_group(
        self, *, rank: int | None = None, world_size: int | None = None,
        init_method: str | None = None, timeout_s: float | None = None,
    ) -> None:
        """Join the world group with this backend's collective library.

        Missing arguments come from the torchrun environment (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``). ``timeout_s`` bounds every later collective
        (default: ``HYPERPAR_TIMEOUT`` seconds, else 300). Idempotent. Calls
        :meth:`check_world_fits` with the ranks on this host (``LOCAL_WORLD_SIZE``, else the
        world size) first, so too many ranks fail clearly on every rank.
        """

    @abc.abstractmethod
    def destroy_process_group(self) -> None:
        """Leave the world group and free every group created by :meth:`new_group`."""

    @abc.abstractmethod
    def is_initialized(self) -> bool:
        """True between :meth:`init_process_group` and :meth:`destroy_process_group`."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Group:
        """Group of the given global ranks. Collective: every rank of the world must call it
        with the same ``ranks`` in the same order. Cached: the same rank tuple gives the same
        handle."""

    @abc.abstractmethod
    def rank(self, group: Group = None) -> int:
        """This process's rank within ``group`` (-1 if it is not a member)."""

    @abc.abstractmethod
    def world_size(self, group: Group = None) -> int:
        """Number of ranks in ``group``."""

    @abc.abstractmethod
    def group_ranks(self, group: Group = None) -> list[int]:
        """Global ranks of ``group``'s members, in group-rank order."""

    # ------------------------------------------------------------------ collectives
    @abc.abstractmethod
    def all_reduce(
        self, tensor: Tensor, op: str = "sum", group: Group = None, async_op: bool = False
    ) -> Work | None:
        """In place: ``tensor`` becomes the reduction of every rank's ``tensor`` (same shape)."""

    @abc.abstractmethod
    def all_gather_into_tensor(
        self, output: Tensor, input: Tensor, group: Group = None,
        async_op: bool = False,
    ) -> Work | None:
        """``output`` (shape ``[n * d0, *rest]``) receives every rank's ``input`` (``[d0, *rest]``)
        concatenated along dim 0 in group-rank order. Inputs must have equal shapes."""

    @abc.abstractmethod
    def reduce_scatter_tensor(
        self, output: Tensor, input: Tensor, op: str = "sum", group: Group = None,
        async_op: bool = False,
    ) -> Work | None:
        """``input`` (``[n * d0, *rest]``) is reduced across ranks; rank ``i`` receives rows
        ``[i*d0, (i+1)*d0)`` of the result in ``output`` (``[d0, *rest]``)."""

    @abc.abstractmethod
    def all_to_all_single(
        self, output: Tensor, input: Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None, group: Group = None,
        async_op: bool = False,
    ) -> Work | None:
        """Rank ``i`` sends dim-0 slice ``j`` of ``input`` to rank ``j`` and receives rank ``j``'s
        slice ``i`` into dim-0 slice ``j`` of ``output``. Splits default to equal sizes; uneven
        splits are given as lists of row counts (one per rank)."""

    @abc.abstractmethod
    def broadcast(
        self, tensor: Tensor, src: int, group: Group = None, async_op: bool = False
    ) -> Work | None:
        """In place: every rank's ``tensor`` becomes global rank ``src``'s ``tensor``."""

    @abc.abstractmethod
    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Start every send/recv in ``ops`` together (deadlock-free regardless of order on the
        two sides) and return their handles. The point-to-point primitive: the default
        :meth:`isend`, :meth:`irecv`, :meth:`send` and :meth:`recv` call it, so implement it
        without them (or override them too)."""

    @abc.abstractmethod
    def barrier(self, group: Group = None) -> None:
        """Block until every rank of ``group`` has reached the barrier."""

    def isend(self, tensor: Tensor, dst: int, group: Group = None, tag: int = 0) -> Work:
        """Non-blocking send of ``tensor`` to global rank ``dst``."""
        return self.batch_isend_irecv([P2POp("send", tensor, dst, group, tag)])[0]

    def irecv(self, tensor: Tensor, src: int, group: Group = None, tag: int = 0) -> Work:
        """Non-blocking receive from global rank ``src`` into ``tensor``."""
        return self.batch_isend_irecv([P2POp("recv", tensor, src, group, tag)])[0]

    def send(self, tensor: Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
        """Blocking send of ``tensor`` to global rank ``dst``."""
        self.isend(tensor, dst, group, tag).wait()

    def recv(self, tensor: Tensor, src: int, group: Group = None, tag: int = 0) -> None:
        """Blocking receive from global rank ``src`` into ``tensor`` (shape/dtype must match)."""
        self.irecv(tensor, src, group, tag).wait()

    def collective_fallbacks(self) -> dict[str, str]:
        """Collectives emulated on this backend, name -> how (shown by ``hyperpar info``);
        default: none."""
        return {}

    # ------------------------------------------------------------------ tensor mechanics
    # What the framework-neutral layers (DeviceMesh, DimCollectives) need of a tensor. Each
    # framework's base class implements them; a neutral default says which member is missing.
    def _no_mechanics(self, member: str, needed_by: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} ({self.name!r} backend) does not implement the tensor-"
            f"mechanics member Platform.{member}, which {needed_by} needs; implement it in the "
            f"backend's Platform class (TorchPlatformBase does for PyTorch, MindSporePlatform "
            f"for MindSpore)"
        )

    def rank_tensor(self, ranks: list[Any]) -> Tensor:
        """A mesh's rank grid (a nested list of ints) as an int64 host tensor of the same shape:
        what ``DeviceMesh.mesh`` returns (torch's own ``DeviceMesh.mesh`` is such a tensor)."""
        raise self._no_mechanics("rank_tensor", "DeviceMesh.mesh")

    def cat(self, tensors: Sequence[Tensor], dim: int) -> Tensor:
        """``tensors`` (equal shapes except along ``dim``) concatenated along ``dim``."""
        raise self._no_mechanics("cat", "the along-a-dim collectives (DimCollectives)")

    def split(self, tensor: Tensor, sizes: Sequence[int], dim: int) -> list[Tensor]:
        """``tensor`` cut along ``dim`` into consecutive pieces of ``sizes`` (summing to the
        dim's size), as :meth:`narrow` would give them one by one."""
        raise self._no_mechanics("split", "the along-a-dim collectives (DimCollectives)")

    def narrow(self, tensor: Tensor, dim: int, start: int, length: int) -> Tensor:
        """Elements ``[start, start + length)`` of ``tensor`` along ``dim`` (a view where the
        framework has views that collectives read correctly, else a copy)."""
        raise self._no_mechanics("narrow", "the along-a-dim collectives (DimCollectives)")

    def pad_zeros(self, tensor: Tensor, dim: int, length: int) -> Tensor:
        """``tensor`` extended with zeros at the end of ``dim`` to ``length`` elements
        (``tensor`` itself when it is already that long)."""
        raise self._no_mechanics("pad_zeros", "the along-a-dim collectives (DimCollectives)")

    def reshape(self, tensor: Tensor, shape: Sequence[int]) -> Tensor:
        """``tensor``'s elements in row-major order, as a dense (contiguous) tensor of ``shape``
        (``-1`` allowed once): what a collective can read or write directly."""
        raise self._no_mechanics("reshape", "the along-a-dim collectives (DimCollectives)")

    def new_empty(self, like: Tensor, shape: Sequence[int]) -> Tensor:
        """An uninitialised dense tensor of ``shape`` with ``like``'s dtype and device."""
        raise self._no_mechanics("new_empty", "the along-a-dim collectives (DimCollectives)")

    def int_tensor(self, values: Sequence[int]) -> Tensor:
        """A 1-D int64 tensor of ``values`` on this process's device, ready for a collective."""
        raise self._no_mechanics("int_tensor", "DimCollectives.all_gather_sizes")

    def to_ints(self, tensor: Tensor) -> list[int]:
        """The elements of an integer ``tensor`` as Python ints (row-major)."""
        raise self._no_mechanics("to_ints", "DimCollectives.all_gather_sizes")

    # ------------------------------------------------------------------ launching
    @classmethod
    def launch_workers(cls, opts: Any, env: dict[str, str], out: Any) -> int | None:
        """Start ``hyperpar run``'s worker processes when the framework has its own launcher
        (``opts``: :class:`hyperpar.launcher.LaunchOptions`; ``env``: variables every worker
        gets; ``out``: where failures are reported). Return the exit status, or ``None`` (the
        default) to let ``hyperpar run`` use torchrun."""
        return None

    def runtime_settings(self) -> dict[str, str]:
        """Process-wide settings the platform applies when joining a group (threads, launch
        mode), by name; ``hyperpar info`` shows them. Default: none."""
        return {}

    # ------------------------------------------------------------------ framework API
    def parallel_api(self) -> Any:
        """The module implementing hyperpar's parallel API (``init_device_mesh``,
        ``parallelize_module``, the styles) on this platform's framework, or ``None`` (the
        default) for hyperpar's own PyTorch implementation. ``from hyperpar import
        ColwiseParallel`` asks this, so one import line serves every framework."""
        return None

    def tp_mechanics(self) -> Any:
        """The tensor mechanics behind hyperpar's one set of parallel styles
        (:mod:`hyperpar.parallel.styles`; the members are its ``Mechanics`` protocol):
        parameter sharding, boundary hooks, the local forward, DTensor outputs, on this
        platform's framework. Default: none (a :class:`BackendError`)."""
        raise BackendError(f"the {self.name!r} platform supplies no tensor-parallel mechanics")

    # ------------------------------------------------------------------ conveniences
    def describe(self) -> str:
        """One line naming this platform, for logs and errors."""
        return f"{self.name} (device={self.device_type}, collectives={self.dist_backend})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


_NORM_NAME = re.compile(r"(RMS|Layer|Group|Batch|Instance)Norm", re.IGNORECASE)


def abstract_members() -> list[str]:
    """Names of the abstract members of :class:`Platform` (the contract's size)."""
    return sorted(Platform.__abstractmethods__)
