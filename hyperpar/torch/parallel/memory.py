"""Count the activation bytes an autograd graph saves for backward (a deterministic figure:
no allocator, no timing), for the tests and ``benchmarks/bench_sp_memory.py``.

:class:`SavedBytes` is a saved-tensor hook that only looks: each saved tensor is kept as it is
and its storage counted once (q, k and v saving one input count it once, as memory holds it
once). It is marked *transparent*, so a column-parallel linear that saves its gathered input as
the shard (:func:`hyperpar.torch.parallel._comm.reshard_scope`) still does so inside it and
reports the shard it keeps instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """``with SavedBytes(exclude=model.parameters()) as saved: loss = model(x)`` ->
    ``saved.nbytes``: the bytes of the distinct storages autograd saved during the block
    (``exclude``: tensors whose storages are not activations -- parameters, their local
    shards)."""

    transparent = True  # see the module docstring

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {_ptr(t) for t in exclude}
        self._storages: dict[int, int] = {}
        self._scope: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct saved storages (parameters excluded)."""
        return sum(self._storages.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its local piece
        ptr = local.untyped_storage().data_ptr()
        if ptr not in self._skip:
            self._storages[ptr] = local.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedBytes:
        self._scope = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)


def _ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()
