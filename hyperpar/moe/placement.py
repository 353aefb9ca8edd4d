"""Which expert-parallel rank owns which experts, and how ``ep`` sits in the world mesh.

Framework-neutral: Python ints and lists only. The torch (and later MindSpore) mechanics ask
these functions *what* to do; they only do it.

* :class:`ExpertPlacement` -- ``num_experts`` experts over ``ep`` ranks in contiguous blocks
  (rank ``r`` owns experts ``r * n_local .. (r + 1) * n_local - 1``, the blocks
  ``Shard(0)`` of a ``(num_experts, ...)`` weight gives). Experts not divisible by ``ep`` are
  refused: ``Shard(0)``'s uneven chunks would give ranks different local expert counts, which
  the all-to-all's regrouping cannot describe.
* :func:`sparse_layout` -- torchtitan's ``ParallelDims`` sparse mesh: the world unflattened as
  ``(pp, dp_replicate, efsdp, ep)`` with ``ep`` carved out of ``dp_shard * cp * tp`` and
  ``efsdp = dp_shard * cp * tp // ep``; gives each rank its ``ep`` group and its ``efsdp`` group
  (the ranks holding the same experts, over which FSDP shards them).
* :func:`expert_weight_placements` -- the placements each style gives the grouped experts'
  3-D weights ``w1``/``w3`` ``(E, hidden, dim)`` and ``w2`` ``(E, dim, hidden)``.
* :func:`check_moe_config` -- the argument checks, run on every rank before any collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyperpar.dtensor.placement import Placement, Shard

from .errors import MoEConfigError

__all__ = [
    "ExpertPlacement",
    "SparseLayout",
    "check_moe_config",
    "expert_capacity",
    "expert_weight_placements",
    "mesh_dim_index",
    "sparse_layout",
]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MoEConfigError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class ExpertPlacement:
    """``num_experts`` experts in contiguous blocks over ``ep`` expert-parallel ranks.

    >>> p = ExpertPlacement(8, 4)
    >>> p.num_local, list(p.local_experts(1)), p.owner(5)
    (2, [2, 3], 2)
    """

    num_experts: int
    ep: int

    def __post_init__(self) -> None:
        _positive_int("num_experts", self.num_experts)
        _positive_int("the expert-parallel degree ep", self.ep)
        if self.num_experts % self.ep:
            raise MoEConfigError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel degree "
                f"ep={self.ep}: every ep rank must own the same number of experts. Use an ep "
                f"degree that divides {self.num_experts} (e.g. "
                f"{_divisors(self.num_experts)}) or change the expert count.")

    @property
    def num_local(self) -> int:
        """Experts each ep rank owns."""
        return self.num_experts // self.ep

    def local_experts(self, ep_rank: int) -> range:
        """The global ids of the experts ``ep_rank`` owns (a contiguous block)."""
        if not 0 <= ep_rank < self.ep:
            raise MoEConfigError(f"ep_rank must be in [0, {self.ep}), got {ep_rank}")
        return range(ep_rank * self.num_local, (ep_rank + 1) * self.num_local)

    def owner(self, expert: int) -> int:
        """The ep rank that owns global expert ``expert``."""
        if not 0 <= expert < self.num_experts:
            raise MoEConfigError(f"expert id must be in [0, {self.num_experts}), got {expert}")
        return expert // self.num_local


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_moe_config(num_experts: int, top_k: int, ep: int = 1, *,
                     capacity_factor: float | None = None,
                     world_size: int | None = None) -> ExpertPlacement:
    """Check an MoE configuration; return its :class:`ExpertPlacement`.

    Raises :class:`MoEConfigError` (naming the value and what would be accepted) for experts
    not divisible by ``ep``, ``top_k`` outside ``[1, num_experts]``, ``ep`` not dividing
    ``world_size``, or a ``capacity_factor`` <= 0 (``None`` means dropless).
    """
    placement = ExpertPlacement(num_experts, ep)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise MoEConfigError(
            f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]: a token cannot "
            f"be routed to more distinct experts than exist")
    if world_size is not None:
        _positive_int("world_size", world_size)
        if world_size % ep:
            raise MoEConfigError(
                f"the expert-parallel degree ep={ep} does not divide the world size "
                f"{world_size}; use one of {_divisors(world_size)}")
    if capacity_factor is not None:
        if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                or not math.isfinite(capacity_factor) or capacity_factor <= 0):
            raise MoEConfigError(
                f"capacity_factor must be a finite number > 0 (or None for dropless "
                f"routing), got {capacity_factor!r}")
    return placement


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                    min_capacity: int = 0) -> int:
    """Tokens each expert accepts from one rank's batch under a capacity factor.

    ``max(ceil(num_tokens * top_k * capacity_factor / num_experts), min_capacity)`` -- the
    DeepSpeed/GShard rule (an even share of the ``num_tokens * top_k`` assignments, scaled),
    capped at ``num_tokens`` (a token reaches one expert at most once).
    """
    check_moe_config(num_experts, top_k, capacity_factor=capacity_factor)
    if num_tokens < 0:
        raise MoEConfigError(f"num_tokens must be >= 0, got {num_tokens}")
    cap = math.ceil(num_tokens * top_k * capacity_factor / num_experts)
    return min(max(cap, min_capacity), num_tokens)


def mesh_dim_index(dim_names: tuple[str, ...] | None, name: str, what: str = "this style") -> int:
    """The index of the mesh dimension named ``name``; a clear error when the mesh has none."""
    names = tuple(dim_names or ())
    if name not in names:
        raise MoEConfigError(
            f"{what} needs a mesh dimension named {name!r}, but the mesh's dims are "
            f"{names or '(unnamed)'}; build it with init_device_mesh(..., mesh_dim_names="
            f"(..., {name!r}, ...)) or pass mesh[{name!r}]")
    return names.index(name)


@dataclass(frozen=True)
class SparseLayout:
    """One rank's view of torchtitan's sparse mesh ``(pp, dp_replicate, efsdp, ep)``.

    ``ep_group`` exchanges tokens (the all-to-all); ``efsdp_group`` holds the same experts and
    shards them (``fully_shard`` over it); ``expert_dp_group`` is every rank holding the same
    experts in this pipeline stage (efsdp x dp_replicate: where expert gradients are reduced).
    Groups are sorted global ranks.
    """

    shape: tuple[int, int, int, int]
    coords: tuple[int, int, int, int]
    ep_group: tuple[int, ...]
    efsdp_group: tuple[int, ...]
    expert_dp_group: tuple[int, ...]

    @property
    def ep_rank(self) -> int:
        return self.coords[3]


def sparse_layout(rank: int, world_size: int, *, ep: int, pp: int = 1, dp_replicate: int = 1,
                  dp_shard: int = -1, cp: int = 1, tp: int = 1) -> SparseLayout:
    """Where ``rank`` sits in torchtitan's sparse mesh, with ``ep`` carved out of
    ``dp_shard * cp * tp`` (``dp_shard=-1``: what is left of the world, as torchtitan does).

    The world is unflattened row-major as ``(pp, dp_replicate, efsdp, ep)``, so ``ep`` is the
    fastest-varying dim: ep groups are runs of ``ep`` consecutive ranks, and the ranks holding
    one expert block are ``ep`` apart.
    """
    for name, value in (("pp", pp), ("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp),
                        ("ep", ep), ("world_size", world_size)):
        _positive_int(name, value)
    if dp_shard == -1:
        rest = pp * dp_replicate * cp * tp
        if world_size % rest:
            raise MoEConfigError(
                f"pp*dp_replicate*cp*tp = {rest} does not divide the world size {world_size}")
        dp_shard = world_size // rest
    _positive_int("dp_shard", dp_shard)
    if pp * dp_replicate * dp_shard * cp * tp != world_size:
        raise MoEConfigError(
            f"pp({pp}) * dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * "
            f"tp({tp}) = {pp * dp_replicate * dp_shard * cp * tp} != world size {world_size}")
    region = dp_shard * cp * tp
    if region % ep:
        raise MoEConfigError(
            f"the expert-parallel degree ep={ep} must divide dp_shard * cp * tp = {region} "
            f"(ep borrows ranks from those dims); use one of {_divisors(region)}")
    if not 0 <= rank < world_size:
        raise MoEConfigError(f"rank must be in [0, {world_size}), got {rank}")
    shape = (pp, dp_replicate, region // ep, ep)
    strides = (dp_replicate * region, region, ep, 1)
    coords = tuple((rank // s) % n for s, n in zip(strides, shape, strict=True))

    def vary(*dims: int) -> tuple[int, ...]:
        base = rank - sum(coords[d] * strides[d] for d in dims)
        ranks = [base]
        for d in dims:
            ranks = [r + i * strides[d] for r in ranks for i in range(shape[d])]
        return tuple(sorted(ranks))

    return SparseLayout(shape, coords, vary(3), vary(2), vary(1, 2))  # type: ignore[arg-type]


#: The placements each expert style gives the grouped experts' weights, per mesh dim. Weights
#: follow torchtitan's GroupedExperts: ``w1``/``w3`` ``(E, hidden, dim)`` are column-parallel
#: (hidden = dim 1 over tp), ``w2`` ``(E, dim, hidden)`` row-parallel (hidden = dim 2 over tp).
_WEIGHT_PLACEMENTS: dict[str, dict[str, tuple[Placement, ...]]] = {
    "ExpertParallel": {"*": (Shard(0),)},
    "TensorParallel": {"w1": (Shard(1),), "w3": (Shard(1),), "w2": (Shard(2),)},
    "ExpertTensorParallel": {"w1": (Shard(0), Shard(1)), "w3": (Shard(0), Shard(1)),
                             "w2": (Shard(0), Shard(2))},
}


def expert_weight_placements(style: str, param_name: str, ndim: int) -> tuple[Placement, ...]:
    """The placements ``style`` gives the experts' parameter ``param_name`` (``ndim`` dims).

    ``ExpertParallel``: every parameter ``Shard(0)`` on the ep mesh (biases ``(E, n)`` too).
    ``TensorParallel`` (experts over tp, every expert local) and ``ExpertTensorParallel``
    (``(ep, tp)`` mesh) know ``w1``, ``w2``, ``w3`` only; any other name is refused, since
    guessing which of its dims is the hidden one could give a silently wrong result.
    """
    table = _WEIGHT_PLACEMENTS.get(style)
    if table is None:
        raise MoEConfigError(f"unknown expert style {style!r}; one of {sorted(_WEIGHT_PLACEMENTS)}")
    placements = table.get(param_name, table.get("*"))
    if placements is None:
        raise MoEConfigError(
            f"{style} shards grouped experts' w1/w3 (E, hidden, dim) and w2 (E, dim, hidden); "
            f"it does not know how to shard parameter {param_name!r}. Name the weights w1, w2, "
            f"w3, or use ExpertParallel() (Shard(0) on every parameter)")
    if ndim != 3 and param_name in ("w1", "w2", "w3"):
        raise MoEConfigError(
            f"{style}: grouped-expert weight {param_name!r} must be 3-D (num_experts, ...), "
            f"got {ndim}-D")
    if ndim < 1:
        raise MoEConfigError(f"{style}: parameter {param_name!r} is a scalar; experts' "
                             f"parameters need a leading num_experts dim")
    return placements
