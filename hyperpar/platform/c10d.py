"""torch.distributed's in-place collectives that a hyperpar DTensor runs on its local tensor.

Code written for torch's DTensor unwraps it before a c10d collective with
``isinstance(x, torch.distributed.tensor.DTensor)`` (torchtitan's expert-bias update does, then
``torch.distributed.all_reduce`` over the tp group). A hyperpar DTensor is not an instance of
torch's class, so it reaches the collective still wrapped; the DTensor rule in
``hyperpar.torch.dtensor._ops.tensor`` runs these functions on its local tensor instead. The
functions live in ``torch.distributed``, which only the platform layer touches.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["IN_PLACE_COLLECTIVES"]


def _collectives() -> tuple[Any, ...]:
    if not torch.distributed.is_available():  # a torch build without distributed support
        return ()
    from torch.distributed import all_reduce
    return (all_reduce,)


#: The c10d functions a DTensor argument runs on as its local tensor (in place).
IN_PLACE_COLLECTIVES: tuple[Any, ...] = _collectives()
