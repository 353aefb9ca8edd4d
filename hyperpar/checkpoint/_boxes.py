"""Boxes: the part of a global tensor one rank holds (``offset`` per dim and ``shape``).

Works for any mesh: a DTensor's box comes from its spec (every ``Shard`` mesh dim narrows it,
in mesh-dim order, as ``distribute_tensor`` lays it out); a plain tensor is one box covering
the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hyperpar.platform import get_platform

from ._commit import Box, overlap, owners
from ._format import CheckpointError, dtype_name

__all__ = ["Box", "Piece", "copy_box", "host", "local_box", "overlap", "owned", "owners",
           "pieces"]


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_box(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """``(offset, shape, local tensor)`` of this rank's part of ``value``."""
    if not is_dtensor(value):
        return (0,) * value.ndim, tuple(value.shape), value
    shape, offset = value._spec.local_shape_and_offset()
    return tuple(offset), tuple(shape), value.to_local()


class Piece:
    """One box of one state-dict entry held by this rank."""

    __slots__ = ("key", "shape", "dtype", "offset", "local", "placements", "mesh_shape")

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                 offset: tuple[int, ...], local: torch.Tensor, placements: list[str],
                 mesh_shape: list[int]) -> None:
        self.key, self.shape, self.dtype, self.offset = key, shape, dtype, offset
        self.local, self.placements, self.mesh_shape = local, placements, mesh_shape

    def box(self) -> Box:
        return self.key, self.offset, tuple(self.local.shape)

    def meta(self) -> dict[str, Any]:
        return {"key": self.key, "shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "offset": list(self.offset), "local_shape": list(self.local.shape),
                "placements": self.placements, "mesh_shape": self.mesh_shape}


def _without_partial(t: Any) -> Any:
    if not any(p.is_partial() for p in t.placements):
        return t
    from hyperpar.dtensor.placement import Replicate

    return t.redistribute(t.device_mesh,
                          [Replicate() if p.is_partial() else p for p in t.placements])


def pieces(state: dict[str, Any]) -> list[Piece]:
    """This rank's boxes of every tensor in ``state`` (collective if a Partial is reduced)."""
    out = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if is_dtensor(value):
            value = _without_partial(value)
            offset, local_shape, local = local_box(value)
            if tuple(local.shape) != local_shape:
                raise CheckpointError(
                    f"checkpoint: {key!r} has local shape {tuple(local.shape)} but its layout "
                    f"{value.placements} over mesh {value.device_mesh.shape} gives "
                    f"{local_shape} (a padded local shard? unpad it first)")
            out.append(Piece(key, tuple(value.shape), local.dtype, offset, local.detach(),
                             [repr(p) for p in value.placements],
                             list(value.device_mesh.shape)))
        else:
            t = value.detach()
            out.append(Piece(key, tuple(t.shape), t.dtype, (0,) * t.ndim, t, [], []))
    return out


def owned(mine: list[Piece], extra: Any = None
          ) -> tuple[list[Piece], list[list[dict[str, Any]]], list[Any]]:
    """The pieces this rank writes, every rank's box metadata, and every rank's ``extra``
    (one collective)."""
    platform = get_platform()
    gathered = platform.all_gather_object(([p.meta() for p in mine], extra))
    metas = [g[0] for g in gathered]
    owner = owners(metas)
    rank = platform.rank()
    return [p for p in mine if owner[p.box()] == rank], metas, [g[1] for g in gathered]


def host(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous host copies, no two sharing storage (safetensors refuses shared storage)."""
    out, seen = [], set()
    for t in tensors:
        h = t.cpu().contiguous()
        ptr = h.untyped_storage().data_ptr()
        if ptr in seen or h.untyped_storage().nbytes() != h.numel() * h.element_size():
            h = h.clone()
        seen.add(h.untyped_storage().data_ptr())
        out.append(h)
    return out


def copy_box(value: torch.Tensor, box: torch.Tensor) -> None:
    """Copy ``box`` (this rank's part, read from a file) into model tensor ``value``."""
    target = value.to_local() if is_dtensor(value) else value
    target.copy_(box)
    # A Partial layout holds one term of a sum: the value goes to the first rank only.
    if is_dtensor(value) and any(p.is_partial() for p in value.placements):
        mesh = value.device_mesh
        if any(p.is_partial() and mesh.get_local_rank(m) != 0
               for m, p in enumerate(value.placements)):
            target.zero_()
