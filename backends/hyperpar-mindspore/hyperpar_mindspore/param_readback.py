"""``full_tensor()`` on the Parameters a MindSpore style shards: torch's read-back idiom.

On torch a parallelized module's parameters are DTensors, and ``p.full_tensor()`` reads one back
whole. On MindSpore they stay ``Parameter`` objects holding this rank's piece (so
``trainable_params()``, any ``nn.Optimizer`` and graph mode see ordinary parameters, and
``p.shape`` is the local shape). MindSpore's ``Parameter`` cannot be subclassed (its ``__new__``
builds a class of its own), so the method is bound on the instance. Only ``full_tensor`` is
given, not ``placements``/``to_local``/``device_mesh``: code on both sides recognises a DTensor by
those attributes and must keep treating a Parameter as a plain tensor
(``platform.parameter_placements(p)`` reads the layout).

MindSpore's ``Parameter.__deepcopy__`` builds a new Parameter from the data and name alone
(measured, 2.x: every instance attribute is dropped), so ``copy.deepcopy(cell)`` would lose
both ``full_tensor`` and the layout checkpoints read. :func:`keep_layout_on_deepcopy` wraps it
once: the copy keeps hyperpar's ``_hyperpar_*`` attributes (the mesh and group are shared
handles, as torch's DTensor copy shares its mesh) and gets ``full_tensor`` bound to itself.
"""

from __future__ import annotations

import functools
from types import MethodType
from typing import Any

from mindspore import Parameter, Tensor

from hyperpar.dtensor.placement import REPLICATE, Placement

from .redistribute import redistribute_local

#: attribute name of the read-back method (torch's DTensor method name)
FULL_TENSOR = "full_tensor"


def _full_tensor(param: Parameter) -> Tensor:
    """The whole parameter on every rank (a new plain tensor; collectives on the tp group)."""
    mesh, placements, shape = param._hyperpar_readback
    local = Tensor(param.asnumpy())  # a copy: the result must not alias the trained piece
    return redistribute_local(local, mesh, placements, (REPLICATE,) * len(placements), shape)


#: prefix of the attributes hyperpar sets on a Parameter (placements, group, read-back)
_PREFIX = "_hyperpar_"


def keep_layout_on_deepcopy() -> None:
    """Make ``copy.deepcopy`` of a Parameter keep hyperpar's attributes (once per process)."""
    original = Parameter.__deepcopy__
    if getattr(original, "_hyperpar_keeps_layout", False):
        return

    @functools.wraps(original)
    def deepcopy(self: Parameter, memodict: Any) -> Parameter:
        new = original(self, memodict)
        for name, value in vars(self).items():
            if name.startswith(_PREFIX):
                setattr(new, name, value)
        if hasattr(new, "_hyperpar_readback"):
            setattr(new, FULL_TENSOR, MethodType(_full_tensor, new))
        return new

    deepcopy._hyperpar_keeps_layout = True  # type: ignore[attr-defined]
    Parameter.__deepcopy__ = deepcopy  # type: ignore[method-assign]


def attach_full_tensor(param: Parameter, mesh: Any, placements: tuple[Placement, ...],
                       shape: tuple[int, ...]) -> Parameter:
    """Give ``param`` (this rank's piece of a tensor of global ``shape`` laid out on ``mesh``
    as ``placements``) a ``full_tensor()`` method; returns ``param``."""
    keep_layout_on_deepcopy()
    param._hyperpar_readback = (mesh, tuple(placements), tuple(int(s) for s in shape))
    setattr(param, FULL_TENSOR, MethodType(_full_tensor, param))
    return param
