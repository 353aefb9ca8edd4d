"""``torch.distributed.checkpoint`` (DCP) metadata for tensors it does not know.

DCP asks a tensor it does not recognise for three methods (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``); hyperpar's DTensor answers them with
the builders here, so ``dcp.save`` / ``dcp.load`` of a state dict holding hyperpar DTensors
writes one chunk per distinct shard and loads into any other layout (DCP reshards by chunk
overlap). DCP's types live in ``torch.distributed``, which only the platform layer imports.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["chunk_list", "write_items"]


def chunk_list(local_shape: tuple[int, ...], offset: tuple[int, ...]
               ) -> list[ChunkStorageMetadata]:
    """The chunk this rank holds (none when its piece is empty: an uneven shard's last ranks)."""
    if 0 in local_shape:
        return []
    return [ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(local_shape))]


def write_items(fqn: str, global_shape: tuple[int, ...], local: torch.Tensor,
                offset: tuple[int, ...]) -> list[Any]:
    """One SHARD write item for this rank's piece. Replicas of a piece produce the same index
    (fqn, offset), which DCP's coordinator writes once."""
    if local.numel() == 0:
        return []
    return [WriteItem(
        index=MetadataIndex(fqn, torch.Size(offset)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=local.shape),
            properties=TensorProperties.create_from_tensor(local),
            size=torch.Size(global_shape),
        ),
    )]
