"""What a sharding rule is: a pure function of the op's neutral name, its tensor inputs'
placements and global shapes, and its non-tensor arguments. Imports no framework."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..layout import shard_shape_and_offset
from ..placement import REPLICATE, Partial, Placement, Replicate, Shard

Placements = tuple[Placement, ...]
Shape = tuple[int, ...]
P_SUM = Partial("sum")


class ShardingError(NotImplementedError):
    """No sharding rule for an op with these input placements."""


@dataclass(frozen=True)
class TensorMeta:
    """A tensor input as a rule sees it: its placements (one per mesh dim) and global shape."""

    placements: Placements
    shape: Shape


@dataclass(frozen=True)
class MaskedLookup:
    """The local computation of a vocabulary-parallel lookup (``embedding`` with a row-sharded
    table): the rank holding rows ``[lo, hi)`` (:meth:`rows`) looks up ``id - lo`` for the ids
    in that range and gives zeros for the others, so the output is Partial("sum") over the mesh
    dims ``dims``. ``padding_idx`` (global, non-negative, or None) is the row whose lookups get
    no gradient; only the rank holding it passes it (shifted by ``lo``) to its local lookup."""

    dims: tuple[int, ...]
    table: Placements
    vocab: int
    padding_idx: int | None = None

    def rows(self, mesh_shape: tuple[int, ...], coord: tuple[int, ...] | list[int] | None
             ) -> tuple[int, int]:
        """This rank's row range ``[lo, hi)`` of the table (from its Shard(0) placements)."""
        pl = tuple(p if type(p) is Shard and p.dim == 0 else REPLICATE for p in self.table)
        (n,), (lo,) = shard_shape_and_offset((self.vocab,), pl, mesh_shape, coord)
        return lo, lo + n

    def local_padding(self, lo: int, hi: int) -> int | None:
        """``padding_idx`` as a row of this rank's piece, or None where another rank holds it."""
        p = self.padding_idx
        return p - lo if p is not None and lo <= p < hi else None


@dataclass(frozen=True)
class GlobalMean:
    """The local computation of a mean loss over a sharded batch (``cross_entropy`` with
    ``reduction="mean"``): each rank computes its local *sum* of the per-sample losses and
    divides it by the global count of targets not equal to ``ignore_index`` -- each counted as
    its class weight when ``weighted`` -- summed (all-reduced) over the mesh dims ``dims``. The
    output is Partial("sum") over ``dims``. ``count``: when set, the global count is known
    without communication (probability targets: every sample counts once) and is used as it
    is."""

    dims: tuple[int, ...]
    ignore_index: int = -100
    weighted: bool = False
    count: int | None = None


@dataclass(frozen=True)
class OpSharding:
    """A rule's answer.

    ``inputs``: the placements each tensor input must have (the platform redistributes them);
    ``outputs`` / ``shapes``: placements and global shape of each output; ``grad_sum``: per
    input, the mesh dims where its gradient must be summed (a replicated input that fed a sharded
    or Partial output holds only this rank's term of it); ``divide_by``: when set, the op runs
    as a sum on the local shard and the platform divides by this global count (a mean over a
    sharded dim); ``local``: when set, the local computation is not the op itself on the local
    pieces but the one it describes (:class:`MaskedLookup`, :class:`GlobalMean`), which each
    platform implements with its own ops."""

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    shapes: tuple[Shape, ...]
    grad_sum: tuple[tuple[int, ...], ...] = field(default=())
    divide_by: int | None = None
    local: MaskedLookup | GlobalMean | None = None


Rule = Callable[..., OpSharding]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Register ``fn(op, metas, mesh_shape, **args)`` as the rule of the neutral ops ``names``."""

    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn

    return register


def propagate(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
              **args: Any) -> OpSharding:
    """The sharding of neutral op ``op`` on inputs ``metas`` (see :class:`OpSharding`).

    Raises :class:`ShardingError` naming the op and the placements where no rule applies --
    never a silently wrong layout."""
    fn = RULES.get(op)
    if fn is None:
        raise no_rule(op, metas, "no sharding rule is registered for it")
    result = fn(op, metas, mesh_shape, **args)
    if not result.grad_sum:
        sums = tuple(grad_sum_dims(t, result.outputs) for t in result.inputs)
        result = replace(result, grad_sum=sums)
    return result


def no_rule(op: str, metas: tuple[TensorMeta, ...], why: str) -> ShardingError:
    """The error for an op without a rule for these inputs."""
    layouts = ", ".join(f"{list(m.placements)} shape {tuple(m.shape)}" for m in metas)
    return ShardingError(f"DTensor op {op!r} on inputs ({layouts}): {why}; redistribute the "
                         "inputs (e.g. to Replicate) or compute on .full_tensor()")


def grad_sum_dims(target: Placements, outputs: tuple[Placements, ...]) -> tuple[int, ...]:
    """Mesh dims where a replicated input feeds a sharded or Partial("sum") output."""
    return tuple(m for m, t in enumerate(target)
                 if type(t) is Replicate and any(type(o[m]) is Shard or o[m] == P_SUM
                                                 for o in outputs))


def norm_dim(d: int, ndim: int) -> int:
    """``d`` made non-negative for a tensor of ``ndim`` dims (a 0-d tensor takes 0 and -1, as
    in torch); out of range raises torch's IndexError, never wraps."""
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {d}): dim {d} is out of range for a tensor with {ndim} "
                         "dim(s)")
    return d % n


def spelled_dims(rest: Any) -> tuple:
    """Sizes or dims spelled inline or as one sequence, as ``permute``/``view``/``new_zeros``
    take them: ``(1, 0)``, ``((1, 0),)`` and ``([1, 0],)`` all give ``(1, 0)``."""
    if len(rest) == 1 and isinstance(rest[0], list | tuple):  # torch.Size is a tuple
        return tuple(rest[0])
    return tuple(rest)


def refuse_partial(placements: Placements, what: str,
                   fix: str = "redistribute it to Replicate or Shard first") -> None:
    """Raise for ``what`` (an op that writes values) on a tensor with a pending reduction: each
    rank holds one term, not a piece of the value."""
    if any(type(p) is Partial for p in placements):
        raise ShardingError(f"{what} on a Partial DTensor; {fix}")


def unshard(placements: Placements, dims: Any = (), *, partial_ok: bool = False) -> Placements:
    """``placements`` with the shards of tensor ``dims`` and (unless ``partial_ok``) every
    Partial replaced by Replicate: the layout an op needs that reads those dims whole."""
    return tuple(
        REPLICATE if (type(p) is Shard and p.dim in dims) or (type(p) is Partial
                                                              and not partial_ok)
        else p
        for p in placements
    )
