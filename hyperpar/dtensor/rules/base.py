"""What a sharding rule is: a pure function of the op's neutral name, its tensor inputs'
placements and global shapes, and its non-tensor arguments. Imports no framework."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..placement import Partial, Placement, Replicate, Shard

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
class OpSharding:
    """A rule's answer.

    ``inputs``: the placements each tensor input must have (the platform redistributes them);
    ``outputs`` / ``shapes``: placements and global shape of each output; ``grad_sum``: per
    input, the mesh dims where its gradient must be summed (a replicated input that fed a sharded
    or Partial output holds only this rank's term of it); ``divide_by``: when set, the op runs
    as a sum on the local shard and the platform divides by this global count (a mean over a
    sharded dim)."""

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    shapes: tuple[Shape, ...]
    grad_sum: tuple[tuple[int, ...], ...] = field(default=())
    divide_by: int | None = None


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
        result = OpSharding(result.inputs, result.outputs, result.shapes, sums,
                            result.divide_by)
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
