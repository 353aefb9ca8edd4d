"""The schedule of one fully-sharded unit, written once for every framework (no framework import).

A unit's parameters are split along dim 0 over the shard group by ``torch.chunk``'s rule
(:func:`hyperpar.dtensor.placement.chunk_bounds`: pieces of ``ceil(d0 / n)`` rows, the last ones
shorter or empty). Each rank stores its piece zero-padded to ``ceil(d0 / n)`` rows, so that every
rank's shards of a unit laid end to end make one flat buffer of the same length on every rank:
one all-gather before the unit's forward and one reduce-scatter of the gradient in backward.

The flat buffer of rank ``r`` holds, for each parameter in order, its padded piece flattened
(``rows_per_rank * row_numel`` elements at :attr:`ParamSlot.offset`). The gathered buffer is
``n`` such buffers in group-rank order; a parameter is read back from it as
``gathered.reshape(n, total)[:, off:off + shard_numel].reshape(n * rows, *rest)[:d0]``.

Frameworks supply the tensor mechanics (cat, all-gather, reduce-scatter, slicing);
:class:`UnitPlan` says which parameters, where, and over which groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyperpar.dtensor.placement import chunk_bounds

__all__ = ["ParamSlot", "UnitPlan", "plan_unit", "reshard_after"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter of a unit lives in the unit's flat shard buffer."""

    name: str
    shape: tuple[int, ...]
    rows_per_rank: int  # ceil(d0 / n): the padded piece's rows
    row_numel: int      # elements of one dim-0 row (1 for a vector)
    offset: int         # start in this rank's flat buffer (same on every rank)
    lengths: tuple[int, ...]  # torch.chunk rows held by each rank (unpadded)
    starts: tuple[int, ...]   # each rank's first global row

    @property
    def shard_numel(self) -> int:
        """Elements of the padded piece every rank stores."""
        return self.rows_per_rank * self.row_numel

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of the padded piece every rank stores."""
        return (self.rows_per_rank, *self.shape[1:])

    def padded_shape(self, n: int) -> tuple[int, ...]:
        """Shape of the gathered pieces before the padding is cut off."""
        return (n * self.rows_per_rank, *self.shape[1:])


@dataclass(frozen=True)
class UnitPlan:
    """What one unit gathers (all of ``slots``, as one flat buffer of ``flat_numel`` elements
    per rank, over the shard group) and how its gradient is reduced: reduce-scatter-averaged
    over the shard group, then averaged over the replicate group when ``replicate > 1``
    (HSDP)."""

    slots: tuple[ParamSlot, ...]
    shard_size: int
    replicate: int
    flat_numel: int

    @property
    def gathered_numel(self) -> int:
        """Elements of the all-gathered flat buffer."""
        return self.shard_size * self.flat_numel

    def grad_scale(self) -> float:
        """Factor on the summed gradient that gives the mean over every data-parallel rank."""
        return 1.0 / (self.shard_size * self.replicate)


def plan_unit(params: Sequence[tuple[str, Sequence[int]]], shard_size: int,
              replicate: int = 1, what: str = "fully_shard") -> UnitPlan:
    """The layout of a unit whose parameters are ``(name, shape)`` in order, sharded over
    ``shard_size`` ranks (and replicated over ``replicate``). Raises for a 0-d parameter (it
    has no dim 0 to split) and for a non-positive group size, naming the parameter."""
    if shard_size < 1 or replicate < 1:
        raise ValueError(f"{what}: group sizes must be positive, got shard={shard_size}, "
                         f"replicate={replicate}")
    slots = []
    offset = 0
    for name, shape in params:
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise ValueError(f"{what}: parameter {name!r} is a scalar (0-d); it cannot be split "
                             f"on dim 0 -- pass it in ignored_params to keep it replicated")
        rows = -(-shape[0] // shard_size)
        row_numel = 1
        for s in shape[1:]:
            row_numel *= s
        bounds = [chunk_bounds(shape[0], shard_size, k) for k in range(shard_size)]
        slot = ParamSlot(name, shape, rows, row_numel, offset,
                         tuple(b[1] for b in bounds), tuple(b[0] for b in bounds))
        slots.append(slot)
        offset += slot.shard_numel
    return UnitPlan(tuple(slots), shard_size, replicate, offset)


def reshard_after(reshard_after_forward: bool | int | None, is_root: bool) -> bool:
    """Whether a unit drops its gathered parameters after forward: FSDP2's rule (``None``:
    every unit but the root; an int ``k``: ``k != 1``)."""
    if reshard_after_forward is None:
        return not is_root
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    if isinstance(reshard_after_forward, int):
        return reshard_after_forward != 1
    raise TypeError(f"fully_shard: reshard_after_forward must be a bool, an int or None, got "
                    f"{type(reshard_after_forward).__name__}")
