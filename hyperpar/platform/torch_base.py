"""The Platform contract's PyTorch-bound defaults: what every torch backend gets for free.

:class:`~hyperpar.platform.base.Platform` is framework-neutral (it imports no framework).
:class:`TorchPlatformBase` adds, for ``torch.nn.Module`` models and ``torch.Tensor`` data:

* module detection by torch's classes (``nn.Linear``, ``nn.Embedding``, the norm layers),
  ``is_module_class`` and ``set_parameter``;
* hooks through ``nn.Module``'s own registration methods;
* object collectives built on the bulk tensor collectives;
* the differentiable collectives (:mod:`hyperpar.platform.autograd`) and the along-a-dim helpers
  of :class:`~hyperpar.platform.dim_collectives.DimCollectives`;
* the contract's tensor mechanics (``rank_tensor``, ``cat``, ``narrow``, ...) as direct torch
  calls: the neutral layers (DeviceMesh, DimCollectives) run on them.

Nothing here is abstract: a torch backend implements the neutral contract's abstract members
(usually by subclassing :class:`~hyperpar.platform.torch_platform.TorchPlatform`) and may
override any of these defaults; the conformance kit checks both kinds.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from . import autograd
from .base import Group, Platform, RemovableHandle
from .dim_collectives import DimCollectives

__all__ = ["TorchPlatformBase"]

_HOST = torch.device("cpu")
_FUNCOL_KEYS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single", "broadcast")


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class TorchPlatformBase(Platform, DimCollectives):
    """:class:`Platform` with the defaults every PyTorch backend shares (see module docs)."""

    framework: ClassVar[str] = "torch"
    linear_types: ClassVar[tuple[type, ...]] = (nn.Linear,)
    embedding_types: ClassVar[tuple[type, ...]] = (nn.Embedding,)
    norm_types: ClassVar[tuple[type, ...]] = tuple(
        t for t in (
            nn.LayerNorm, getattr(nn, "RMSNorm", None), nn.GroupNorm,
            nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
        ) if t is not None
    )

    # ------------------------------------------------------------------ module detection
    def is_module_class(self, obj: object) -> bool:
        """True if ``obj`` is a class whose instances are modules (for deferred construction)."""
        return isinstance(obj, type) and issubclass(obj, nn.Module)

    def named_parameters(self, module: nn.Module, *, recurse: bool = True
                         ) -> Iterable[tuple[str, torch.Tensor]]:
        if not recurse:  # every slot, even two names holding one parameter
            return [(n, p) for n, p in module._parameters.items() if p is not None]
        return module.named_parameters()

    def set_parameter(self, module: nn.Module, name: str, value: torch.Tensor) -> nn.Parameter:
        """Replace parameter ``name`` (a direct attribute of ``module``) by ``value``.

        ``value`` is wrapped in ``nn.Parameter`` keeping the old ``requires_grad``; the new
        parameter is registered and returned.
        """
        if "." in name:
            raise ValueError(f"set_parameter takes a direct attribute name, got {name!r}")
        old = module._parameters.get(name)
        requires_grad = old.requires_grad if old is not None else value.requires_grad
        param = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad)
        module.register_parameter(name, param)
        return param

    def tp_mechanics(self) -> Any:
        """PyTorch's tensor mechanics of the parallel styles
        (:data:`hyperpar.torch.parallel.prepare.MECHANICS`)."""
        from hyperpar.torch.parallel.prepare import MECHANICS  # torch's stack: loaded when used

        return MECHANICS

    # ------------------------------------------------------------------ hooks
    def register_forward_pre_hook(
        self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False,
        prepend: bool = False,
    ) -> RemovableHandle:
        """``hook(module, args[, kwargs])`` before forward; may return replacement inputs."""
        return module.register_forward_pre_hook(hook, with_kwargs=with_kwargs, prepend=prepend)

    def register_forward_hook(
        self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False,
        prepend: bool = False,
    ) -> RemovableHandle:
        """``hook(module, args, [kwargs,] output)`` after forward; may return a new output."""
        return module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=prepend)

    def register_full_backward_hook(
        self, module: nn.Module, hook: Callable[..., Any], *, prepend: bool = False
    ) -> RemovableHandle:
        """``hook(module, grad_input, grad_output)`` in backward; may return new grad_input."""
        return module.register_full_backward_hook(hook, prepend=prepend)

    # ------------------------------------------------------------------ object collectives
    def all_gather_object(self, obj: Any, group: Group = None) -> list[Any]:
        """Picklable ``obj`` from every rank of ``group``, in group-rank order (slow path).

        Default: pickled bytes padded to the longest and all-gathered as a ``uint8`` tensor."""
        n, dev = self.world_size(group), self.device()
        data = _to_bytes(obj, dev)
        sizes = torch.empty(n, dtype=torch.int64, device=dev)
        self.all_gather_into_tensor(
            sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev), group)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
        padded[: data.numel()] = data
        rows = torch.empty(n * longest, dtype=torch.uint8, device=dev)
        self.all_gather_into_tensor(rows, padded, group)
        rows = rows.view(n, longest)
        return [_from_bytes(rows[i, : int(sizes[i])]) for i in range(n)]

    def broadcast_object(self, obj: Any, src: int, group: Group = None) -> Any:
        """Picklable ``obj`` of global rank ``src``, returned on every rank (slow path).

        Default: the pickled length, then the bytes, broadcast as tensors."""
        dev = self.device()
        mine = self.rank() == src
        data = _to_bytes(obj, dev) if mine else None
        size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64, device=dev)
        self.broadcast(size, src, group)
        buf = data if mine else torch.empty(int(size), dtype=torch.uint8, device=dev)
        self.broadcast(buf, src, group)
        return obj if mine else _from_bytes(buf)

    # ------------------------------------------------------------------ autograd collectives
    def all_reduce_autograd(self, tensor: torch.Tensor, op: str = "sum",
                            group: Group = None) -> torch.Tensor:
        """Out of place, differentiable all-reduce (``sum`` or ``avg``).

        Backward is the adjoint: the gradient w.r.t. each rank's input is the all-reduce (same
        op) of every rank's output gradient.
        """
        return autograd.all_reduce(self, tensor, op, group)

    def all_gather_autograd(self, tensor: torch.Tensor, dim: int = 0,
                            group: Group = None) -> torch.Tensor:
        """Differentiable all-gather along ``dim`` (equal shapes). Backward: reduce-scatter
        (sum) of the output gradient along ``dim``."""
        return autograd.all_gather(self, tensor, dim, group)

    def reduce_scatter_autograd(self, tensor: torch.Tensor, dim: int = 0, op: str = "sum",
                                group: Group = None) -> torch.Tensor:
        """Differentiable reduce-scatter along ``dim`` (size divisible by the group size).
        Backward: all-gather of the output gradient along ``dim`` (divided by n for ``avg``)."""
        return autograd.reduce_scatter(self, tensor, dim, op, group)

    def all_to_all_autograd(self, tensor: torch.Tensor, split_dim: int, concat_dim: int,
                            group: Group = None) -> torch.Tensor:
        """Differentiable all-to-all: split ``tensor`` into n equal chunks along ``split_dim``,
        send chunk ``j`` to rank ``j``, concatenate received chunks along ``concat_dim``.
        Backward: the all-to-all with the two dims swapped."""
        return autograd.all_to_all(self, tensor, split_dim, concat_dim, group)

    def all_to_all_single_autograd(self, tensor: torch.Tensor,
                                   output_split_sizes: Sequence[int] | None,
                                   input_split_sizes: Sequence[int] | None,
                                   group: Group = None) -> torch.Tensor:
        """Differentiable uneven dim-0 all-to-all (the token dispatch/combine of expert
        parallelism): ``input_split_sizes[j]`` rows of ``tensor`` go to group rank ``j`` and
        ``output_split_sizes[j]`` rows arrive from it, concatenated in rank order (None: equal
        pieces). Backward: the same exchange with the split lists swapped."""
        return autograd.all_to_all_single(
            self, tensor, None if output_split_sizes is None else list(output_split_sizes),
            None if input_split_sizes is None else list(input_split_sizes), group)


    # ------------------------------------------------------------------ tensor mechanics
    # One torch call each: these sit on the tensor-parallel hot path (DimCollectives).
    def rank_tensor(self, ranks: list[Any]) -> torch.Tensor:
        """A mesh's rank grid as an int64 CPU tensor, like torch's ``DeviceMesh.mesh``."""
        return torch.tensor(ranks, dtype=torch.int64, device=_HOST)

    def cat(self, tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """``torch.cat(tensors, dim)``."""
        return torch.cat(tensors, dim)

    def split(self, tensor: torch.Tensor, sizes: Sequence[int], dim: int
              ) -> list[torch.Tensor]:
        """``tensor.split(sizes, dim)`` (views)."""
        first = sizes[0]
        equal = first > 0
        for size in sizes:  # a loop, not list.count: Dynamo 2.6 cannot trace count
            if size != first:
                equal = False
                break
        if equal:
            return list(tensor.chunk(len(sizes), dim))  # equal pieces: chunk is 2x faster
        return list(tensor.split(list(sizes), dim))

    # ---------------------------------------------------------------- CommDebugMode's pieces
    def comm_op_key(self, name: str) -> Any:
        """The key :class:`~hyperpar.dtensor.debug.CommDebugMode` files collective ``name``
        under: torch's legacy functional-collective op (the keys of torch's own
        ``CommDebugMode.get_comm_counts()``), else the name."""
        if name in _FUNCOL_KEYS:
            return getattr(torch.ops.c10d_functional, name)
        return name

    def track_module_calls(self, enter: Callable[[Any], None], leave: Callable[[Any], None]
                           ) -> RemovableHandle:
        """Call ``enter(module)`` before every module's forward (a global pre-hook: before the
        module's own pre-hooks, so a style's input redistribution counts in the module) and
        ``leave(module)`` after it (a hook added to each module when first seen: after the
        module's own hooks, so a style's output redistribution counts in it too, as torch's
        tracker does). The handle removes them all."""
        from torch.nn.modules.module import register_module_forward_pre_hook

        handles: list[Any] = []
        seen: set[int] = set()

        def pre(module: nn.Module, args: Any) -> None:
            if id(module) not in seen:
                seen.add(id(module))
                handles.append(module.register_forward_hook(lambda m, a, o: leave(m),
                                                            always_call=True))
            enter(module)

        handles.append(register_module_forward_pre_hook(pre))
        return _Handles(handles)

    def in_backward(self) -> bool:
        """True while autograd's engine runs a backward pass on this thread."""
        return torch._C._current_graph_task_id() != -1

    def narrow(self, tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        """``tensor.narrow(dim, start, length)`` (a view)."""
        return tensor.narrow(dim, start, length)

    def pad_zeros(self, tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        """``tensor`` extended with zeros along ``dim`` to ``length``."""
        missing = length - tensor.shape[dim]
        if missing <= 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)

    def reshape(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """``tensor.contiguous().view(shape)`` (no copy when already contiguous)."""
        # Sizes as separate arguments: torch parses them faster than one tuple.
        return tensor.contiguous().view(*shape) if shape else tensor.contiguous().view(())

    def new_empty(self, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """``like.new_empty(shape)``."""
        return like.new_empty(*shape) if shape else like.new_empty(())

    def int_tensor(self, values: Sequence[int]) -> torch.Tensor:
        """An int64 tensor of ``values`` on :meth:`device`."""
        return torch.tensor(list(values), dtype=torch.int64, device=self.device())

    def to_ints(self, tensor: torch.Tensor) -> list[int]:
        """``tensor``'s elements as Python ints."""
        return [int(v) for v in tensor.reshape(-1).tolist()]


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(bytes(data.cpu().tolist()))
