"""Placements: how one logical tensor is laid out over one dimension of a device mesh.

* :class:`Shard` ``(dim)`` -- split along tensor dim ``dim`` with ``torch.chunk`` semantics
  (earlier ranks get the larger piece; trailing ranks may hold an empty piece).
* :class:`Replicate` ``()`` -- every rank holds the whole tensor.
* :class:`Partial` ``(reduce_op)`` -- every rank holds a piece of a pending reduction
  (``sum``, ``avg``, ``max`` or ``min``); the logical value is the reduction over ranks.

Placements are small frozen values: hashable, compared by value, printed as code.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Reductions a :class:`Partial` placement may stand for.
PARTIAL_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")


class Placement:
    """Base class of :class:`Shard`, :class:`Replicate` and :class:`Partial`."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


class _TorchAware(type):
    """``isinstance(torch's Shard(d), Shard)`` is True, as ``==`` already is: code written
    against torch (torchtitan's ``check_dtensor_placements_match``, ``resolve_placements``)
    tests placements from ``spmd_types`` -- torch's classes -- with the names its imports now
    give hyperpar's. Only the concrete classes (not :class:`Placement`, so ``as_placement``
    still converts torch's); hyperpar's hot paths test ``type(p) is Shard``, which this does
    not touch."""

    def __instancecheck__(cls, obj: object) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        if not type(obj).__module__.startswith("torch.distributed"):
            return False
        mine = _from_torch(obj)
        return mine is not obj and type.__instancecheck__(cls, mine)


@dataclass(frozen=True, slots=True)
class Shard(Placement, metaclass=_TorchAware):
    """Split along tensor dimension ``dim`` (negative values count from the end)."""

    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim=...) takes an int, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __eq__(self, other: object) -> bool:
        # Fast paths first: dispatch compares placements on every op.
        if type(other) is Shard:
            return other.dim == self.dim  # type: ignore[attr-defined]
        if isinstance(other, Placement):
            return False
        other = _from_torch(other)  # torch's own placement of the same kind is equal
        return type(other) is Shard and other.dim == self.dim  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(("Shard", self.dim))

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement, metaclass=_TorchAware):
    """Every rank of the mesh dimension holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Placement):
            return type(other) is Replicate
        return type(_from_torch(other)) is Replicate

    def __hash__(self) -> int:
        return hash("Replicate")

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial(Placement, metaclass=_TorchAware):
    """Each rank holds one term of a pending reduction ``reduce_op`` over the mesh dimension."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_OPS:
            raise ValueError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; expected one of "
                f"{', '.join(repr(op) for op in PARTIAL_OPS)}"
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __eq__(self, other: object) -> bool:
        # Fast paths first: dispatch compares placements on every op.
        if type(other) is Partial:
            return other.reduce_op == self.reduce_op  # type: ignore[attr-defined]
        if isinstance(other, Placement):
            return False
        other = _from_torch(other)  # torch's own placement of the same kind is equal
        return type(other) is Partial and other.reduce_op == self.reduce_op  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(("Partial", self.reduce_op))

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})"


REPLICATE = Replicate()


@dataclass(frozen=True, slots=True)
class _StridedShard(Placement):
    """torch's strided shard (its FSDP2 x TP layout of colwise weights), named so that code
    testing ``isinstance(p, _StridedShard)`` imports; hyperpar never produces one and
    :func:`normalize_placements` rejects it (hyperpar keeps such weights on a re-ordered mesh,
    see ``hyperpar.torch.dtensor._remesh``)."""

    dim: int = 0
    split_factor: int = 1

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, split_factor={self.split_factor})"


def chunk_bounds(size: int, n: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of piece ``index`` when ``size`` elements are split into ``n``
    pieces with ``torch.chunk`` semantics (pieces of ``ceil(size / n)``; the tail may be
    shorter or empty)."""
    step = -(-size // n)
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def _from_torch(p: object) -> object:
    """torch's own ``Shard``/``Replicate``/``Partial`` (made by libraries written against
    ``torch.distributed.tensor``, e.g. torchtitan's ``spmd_types``) as hyperpar's; anything
    else unchanged. By name, so this module stays framework-free."""
    cls = type(p)
    if isinstance(p, Placement) or not cls.__module__.startswith("torch.distributed"):
        return p
    name = cls.__name__
    if name == "Shard":
        return Shard(p.dim)  # type: ignore[attr-defined]
    if name == "Replicate":
        return REPLICATE
    if name == "Partial":
        return Partial(str(getattr(p, "reduce_op", "sum")))
    if name == "_StridedShard":
        return _StridedShard(p.dim, p.split_factor)  # type: ignore[attr-defined]
    return p


def normalize_placements(placements: object, ndim_mesh: int, ndim_tensor: int,
                         what: str = "placements") -> tuple[Placement, ...]:
    """Validate ``placements`` for a mesh of ``ndim_mesh`` dims and a tensor of ``ndim_tensor``
    dims; negative shard dims are made non-negative."""
    if isinstance(placements, Placement):
        placements = (placements,)
    try:
        placements = tuple(placements)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be a sequence of Placement, got {placements!r}") from None
    if len(placements) != ndim_mesh:
        raise ValueError(
            f"{what} {list(placements)} has {len(placements)} entries but the mesh has "
            f"{ndim_mesh} dimension(s); give one placement per mesh dimension"
        )
    out = []
    for p in placements:
        p = _from_torch(p)
        if type(p) is _StridedShard:
            raise NotImplementedError(
                f"{what}: {p!r} is not supported by hyperpar (it has no strided shard); lay "
                f"the tensor out with Shard/Replicate/Partial")
        if type(p) is Shard:
            d = p.dim
            if not -ndim_tensor <= d < ndim_tensor:
                raise ValueError(
                    f"{what}: {p!r} is out of range for a tensor with {ndim_tensor} dim(s)"
                )
            out.append(p if d >= 0 else Shard(d + ndim_tensor))
        elif isinstance(p, Placement):
            out.append(p)
        else:
            raise TypeError(f"{what}: {p!r} is not a Placement (Shard, Replicate, Partial)")
    return tuple(out)


def grad_placements_of(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Placements of the gradient of a tensor laid out as ``placements``: the gradient of a
    pending reduction is replicated."""
    return tuple(REPLICATE if type(p) is Partial else p for p in placements)
