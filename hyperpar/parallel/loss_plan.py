"""``loss_parallel``'s plan, written once for every framework (imports no framework): which
logits layouts the vocabulary-parallel cross-entropy takes, which classes this rank holds, the
checks of the loss's arguments, and the flatten that keeps the class shard. Each framework's
``loss_parallel`` runs the kernel on its own tensors."""

from __future__ import annotations

from typing import NamedTuple

from hyperpar.dtensor.placement import Placement, Shard, chunk_bounds
from hyperpar.dtensor.rules.base import norm_dim
from hyperpar.dtensor.rules.view import flattened_shape

REDUCTIONS = ("mean", "sum", "none")


class ClassShard(NamedTuple):
    """Where the class dim of sharded logits lives: the mesh dim sharding it, the tensor dim
    (non-negative), and this rank's classes ``[start, start + length)``."""

    mesh_dim: int
    dim: int
    start: int
    length: int


def class_shard(placements: tuple[Placement, ...], shape: tuple[int, ...],
                mesh_shape: tuple[int, ...], coord: tuple[int, ...] | list[int],
                class_dim: int | None = None) -> ClassShard | None:
    """The :class:`ClassShard` of logits of global ``shape`` laid out as ``placements`` when
    exactly one mesh dim shards them (on ``class_dim`` when given) and every other mesh dim
    replicates them; ``None`` for any other layout (the caller falls back or refuses)."""
    shards = [(m, p) for m, p in enumerate(placements) if type(p) is Shard]
    if len(shards) != 1 or not all(p.is_replicate() for p in placements
                                   if type(p) is not Shard):
        return None
    mesh_dim, placement = shards[0]
    nd = len(shape)
    dim = placement.dim % nd
    if class_dim is not None and dim != class_dim % nd:
        return None
    start, length = chunk_bounds(shape[dim], mesh_shape[mesh_dim], coord[mesh_dim])
    return ClassShard(mesh_dim, dim, start, length)


def loss_parallel_shard(placements: tuple[Placement, ...], shape: tuple[int, ...],
                        mesh_shape: tuple[int, ...], coord: tuple[int, ...] | list[int]
                        ) -> ClassShard | None:
    """What ``loss_parallel`` does with ``cross_entropy`` on logits of global ``shape`` laid out
    as ``placements`` -- one decision for every framework, torch's
    (``torch.distributed.tensor.parallel.loss_parallel`` raises on the same layouts):

    * the class dim (dim 1; dim 0 of 1-D logits) sharded by one mesh dim, every other mesh dim
      replicating: its :class:`ClassShard` (the vocabulary-parallel kernel);
    * that, with other mesh dims sharding other dims (batch-sharded for data parallel):
      ``None`` -- the framework's per-op DTensor ``cross_entropy`` computes it;
    * anything else (class dim not sharded, sharded by two mesh dims, a pending ``Partial``):
      a ``ValueError`` naming the layout it needs, on every rank before any collective (the
      kernel would compute a wrong loss, and torch refuses it)."""
    nd = len(shape)
    c = 1 if nd >= 2 else 0
    placements = tuple(placements)
    sharding = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim % nd == c]
    others_ok = all(isinstance(p, Shard) or p.is_replicate()
                    for m, p in enumerate(placements) if m not in sharding)
    if len(sharding) != 1 or not others_ok:
        raise ValueError(
            f"loss_parallel: cross_entropy needs logits sharded on their class dim {c} by "
            f"exactly one mesh dim, other mesh dims Shard or Replicate (Shard(-1) of "
            f"(rows, classes) logits from ColwiseParallel(use_local_output=False)), got "
            f"placements {placements} for shape {tuple(shape)}; shard the classes, or compute "
            f"this loss outside loss_parallel()")
    return class_shard(placements, shape, mesh_shape, coord, class_dim=c)


def check_loss_args(reduction: str, label_smoothing: float = 0.0) -> None:
    """Raise on a ``reduction`` or ``label_smoothing`` cross-entropy does not take."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_loss_shapes(shape: tuple[int, ...], class_dim: int, target_shape: tuple[int, ...],
                      weight_shape: tuple[int, ...] | None) -> None:
    """Raise unless ``target`` has the logits' global ``shape`` without the class dim (one
    class id per row, as ``cross_entropy`` takes it) and ``weight`` (when given) one value per
    class -- before any collective, so every rank raises alike."""
    c = class_dim % len(shape)
    want = shape[:c] + shape[c + 1:]
    if tuple(target_shape) != want:
        raise ValueError(f"loss_parallel: target shape {tuple(target_shape)} must be the "
                         f"logits' global shape {tuple(shape)} without its sharded class dim "
                         f"{c}: {want}")
    if weight_shape is not None and tuple(weight_shape) != (shape[c],):
        raise ValueError(f"loss_parallel: weight must hold one value per class ({shape[c]}), "
                         f"got shape {tuple(weight_shape)}")


def flatten_outside_shard(placements: tuple[Placement, ...], shape: tuple[int, ...],
                          start_dim: int = 0, end_dim: int = -1
                          ) -> tuple[tuple[Placement, ...], tuple[int, ...]] | None:
    """``flatten(start_dim, end_dim)`` of a tensor sharded on a 1-D mesh on a dim outside the
    flattened range (``logits.flatten(0, 1)`` keeping the vocabulary shard): the placements
    (shard dim renumbered) and global shape after flattening the local shard; ``None`` when the
    shard is inside the range or the layout is not one ``Shard`` (flatten needs its own rule)."""
    if len(placements) != 1 or type(placements[0]) is not Shard or not shape:
        return None
    nd = len(shape)
    start, end = norm_dim(start_dim, nd), norm_dim(end_dim, nd)
    dim = placements[0].dim % nd
    if start <= dim <= end:
        return None
    new_dim = dim if dim < start else dim - (end - start)
    return (Shard(new_dim),), flattened_shape(shape, start, end)


__all__ = ["REDUCTIONS", "ClassShard", "check_loss_args", "check_loss_shapes", "class_shard",
           "flatten_outside_shard", "loss_parallel_shard"]
