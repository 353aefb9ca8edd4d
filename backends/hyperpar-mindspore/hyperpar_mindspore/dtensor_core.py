"""The MindSpore DTensor itself: a ``Tensor._make_subclass`` subclass that holds this rank's shard
of one logical tensor, with torch's DTensor API (``placements``, ``device_mesh``, global
``shape``, ``to_local``, ``full_tensor``, ``redistribute``, ``from_local``,
``distribute_tensor``).

The tensor mechanics, below the op layer: every PyNative op on a DTensor reaches
:meth:`DTensor.__fallback__`, which hands it to the op dispatcher that
:mod:`hyperpar_mindspore.dtensor` installs (:func:`install_dispatch`) when it loads
(:mod:`.dispatch` imports this module, so this one cannot import it). A DTensor and its local
tensor are one autograd node (``_make_subclass`` shares it), so ``ms.grad`` differentiates
through the local ops and the custom-backward collectives. Import DTensors from
:mod:`hyperpar_mindspore.dtensor` (or ``hyperpar_mindspore``): this module alone has no ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mindspore import Tensor

from hyperpar.dtensor.api_core import (
    check_local_shape,
    distribute_target,
    from_local_layout,
    redistribute_target,
    refuse_dtensor_in_from_local,
)
from hyperpar.dtensor.layout import local_shape_and_offset
from hyperpar.dtensor.mesh import _require_mesh
from hyperpar.dtensor.placement import REPLICATE, Placement, grad_placements_of
from hyperpar.platform import get_platform

from .redistribute import redistribute
from .tensors import copy_tensor

Placements = tuple[Placement, ...]

#: The op layer's two entry points, ``dispatch(func, args, kwargs)`` and ``getitem(x, index)``,
#: set by :func:`install_dispatch` (the op layer sits above this module).
_OPS: dict[str, Callable[..., Any]] = {}


def install_dispatch(dispatch: Callable[..., Any], getitem: Callable[..., Any]) -> None:
    """Route DTensor ops (``__fallback__``) and basic indexing (``__getitem__``) to the op
    layer (:mod:`hyperpar_mindspore.dispatch`); :mod:`hyperpar_mindspore.dtensor` calls it."""
    _OPS["dispatch"], _OPS["getitem"] = dispatch, getitem


def _op_layer(what: str) -> Callable[..., Any]:
    try:
        return _OPS[what]
    except KeyError:
        raise RuntimeError("MindSpore DTensor ops need the op layer: import DTensor from "
                           "hyperpar_mindspore.dtensor (or hyperpar_mindspore), which "
                           "installs it") from None



def clear_grad_state() -> None:
    """Reset MindSpore's PyNative grad executor: an exception raised inside ``ms.grad`` leaves
    it broken for the next gradient call otherwise (called before hyperpar raises there)."""
    try:
        from mindspore.common.api import _pynative_executor

        _pynative_executor.clear_res()
    except Exception:  # noqa: BLE001 - best effort: the original error matters more
        pass


class DTensor(Tensor):
    """This rank's shard of a logical tensor laid out on ``device_mesh`` as ``placements``.

    Build one with :meth:`from_local` or :func:`distribute_tensor`; ``shape`` is the global
    shape, :meth:`to_local` the local shard."""

    _local: Tensor
    _mesh: Any
    _placements: Placements
    _gshape: tuple[int, ...]

    def __new__(cls, local: Tensor, mesh: Any, placements: Placements,
                shape: Sequence[int]) -> DTensor:
        t = Tensor._make_subclass(cls, local)
        t._local = local
        t._mesh = mesh
        t._placements = tuple(placements)
        t._gshape = tuple(int(s) for s in shape)
        return t

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Tensor.__init__ would re-initialise the data from these arguments
        pass

    # ------------------------------------------------------------------ the torch API
    @property
    def placements(self) -> Placements:
        """One placement per mesh dim."""
        return self._placements

    @property
    def device_mesh(self) -> Any:
        """The mesh the tensor is laid out on."""
        return self._mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The global (logical) shape."""
        return self._gshape

    @property
    def size(self) -> int:
        """Elements of the global tensor (MindSpore's ``Tensor.size`` is the element count)."""
        return math.prod(self._gshape)

    def to_local(self) -> Tensor:
        """This rank's shard, a plain MindSpore tensor (gradients flow through it)."""
        return self._local

    def redistribute(self, device_mesh: Any = None,
                     placements: Sequence[Placement] | None = None) -> DTensor:
        """This tensor laid out as ``placements`` (differentiable: the gradient is
        redistributed back)."""
        mesh = self._mesh
        dst = redistribute_target(mesh, self._placements, len(self._gshape), device_mesh,
                                  placements)
        if dst == self._placements:
            return self
        local = redistribute(self._local, mesh, self._placements, dst, self._gshape)
        return DTensor(local, mesh, dst, self._gshape)

    def full_tensor(self) -> Tensor:
        """The whole logical tensor on every rank (a plain tensor; differentiable)."""
        return redistribute(self._local, self._mesh, self._placements,
                            (REPLICATE,) * self._mesh.ndim, self._gshape)

    @staticmethod
    def from_local(local_tensor: Tensor, device_mesh: Any = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool = False,
                   shape: Sequence[int] | None = None,
                   stride: Sequence[int] | None = None) -> DTensor:
        """Wrap this rank's ``local_tensor`` (no communication unless ``run_check``).

        The global ``shape`` defaults to the local shape times the mesh size along every
        sharded dim (even shards); pass ``shape`` for uneven shards (this rank's piece of it is
        checked). ``run_check=True`` checks that every rank's local shape agrees (collectives;
        torch's rule: uneven shards need ``shape``). ``stride`` is accepted for torch's
        signature and ignored (MindSpore tensors here are contiguous)."""
        if isinstance(local_tensor, DTensor):
            refuse_dtensor_in_from_local("MindSpore Tensor")
        mesh = _require_mesh(device_mesh, "DTensor.from_local")
        local_shape = tuple(local_tensor.shape)
        pl, shape = from_local_layout(local_shape, mesh, placements, shape, run_check)
        check_local_shape(local_shape, local_shape_and_offset(shape, pl, mesh)[0], shape, pl,
                          mesh)
        return DTensor(local_tensor, mesh, pl, shape)

    # ------------------------------------------------------------------ guard rails
    def __repr__(self) -> str:
        return (f"DTensor(local={self._local!r}, device_mesh={self._mesh!r}, "
                f"placements={self._placements}, shape={self._gshape})")

    __str__ = __repr__

    def asnumpy(self) -> Any:
        """Refused: it would be this rank's shard only."""
        raise TypeError("DTensor.asnumpy() would return this rank's shard only; call "
                        ".to_local().asnumpy() for the shard or .full_tensor().asnumpy() for "
                        "the whole tensor")

    def __getitem__(self, index: Any) -> Any:
        """Basic indexing (ints, slices, None, ``...``): indexed dims gathered, others keep
        their shards. Other indices raise "no sharding rule"."""
        return _op_layer("getitem")(self, index)

    def __fallback__(self, func: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _op_layer("dispatch")(func, args, kwargs or {})


def distribute_tensor(tensor: Tensor, device_mesh: Any = None,
                      placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Lay out the whole ``tensor`` on ``device_mesh`` as ``placements`` (default: Replicate):
    each rank keeps its piece. ``src_data_rank``: the mesh-dim rank whose tensor counts
    (broadcast along every mesh dim first); ``None`` trusts every rank to hold the same tensor.
    A DTensor already laid out so is returned as it is (as torch does). Differentiable."""
    mesh = _require_mesh(device_mesh, "distribute_tensor")
    is_dtensor = isinstance(tensor, DTensor)
    pl = distribute_target(mesh, placements, len(tensor.shape), src_data_rank,
                           given=(tensor._mesh, tensor._placements) if is_dtensor else None)
    if pl is None:
        return tensor
    if src_data_rank is not None:
        tensor = _broadcast_from(tensor, mesh, src_data_rank)
    shape = tuple(tensor.shape)
    local = redistribute(tensor, mesh, (REPLICATE,) * mesh.ndim, pl, shape)
    return DTensor(local, mesh, pl, shape)


def _broadcast_from(tensor: Tensor, mesh: Any, src: int) -> Tensor:
    platform = get_platform()
    out = tensor
    for m in range(mesh.ndim):
        if mesh.size(m) == 1:
            continue
        group = mesh.get_group(m)
        if out is tensor:
            out = copy_tensor(tensor)
        platform.broadcast(out, platform.group_ranks(group)[src], group)
    return out

# ---------------------------------------------------------------------- gradients
# ms.grad returns plain local tensors: these re-wrap the gradients of DTensor arguments (used by
# hyperpar_mindspore.dtensor's grad / value_and_grad and by gradwrap's wrapping of ms.grad).
def _wrap_grad(g: Any, like: Any) -> Any:
    if isinstance(like, DTensor) and isinstance(g, Tensor) and not isinstance(g, DTensor):
        return DTensor(g, like._mesh, grad_placements_of(like._placements), like._gshape)
    return g


def _rewrap(grads: Any, args: Sequence[Any], grad_position: Any, weights: Any) -> Any:
    if grad_position is None:
        pos_grads, wgrads = None, grads
    elif weights is None:
        pos_grads, wgrads = grads, None
    else:
        pos_grads, wgrads = grads
    if pos_grads is not None:
        if isinstance(grad_position, int):
            pos_grads = _wrap_grad(pos_grads, args[grad_position])
        elif isinstance(pos_grads, Tensor):  # MindSpore unpacks a one-element grad_position
            pos_grads = _wrap_grad(pos_grads, args[tuple(grad_position)[0]])
        else:
            pos_grads = tuple(_wrap_grad(g, args[i]) for g, i in zip(pos_grads, grad_position,
                                                                     strict=True))
    if wgrads is not None:
        ws = list(weights) if isinstance(weights, list | tuple) else [weights]
        wgrads = (tuple(_wrap_grad(g, w) for g, w in zip(wgrads, ws, strict=True))
                  if isinstance(wgrads, tuple) else _wrap_grad(wgrads, ws[0]))
    if grad_position is None:
        return wgrads
    if weights is None:
        return pos_grads
    return pos_grads, wgrads
