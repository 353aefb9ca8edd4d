"""The DTensor API's argument logic, written once for every framework (imports none).

``DTensor.from_local``, ``to_local`` / ``full_tensor(grad_placements=...)``, ``redistribute``
and ``distribute_tensor`` decide the same things on torch and on MindSpore: which placements and
global shape a call means, and which calls are mistakes. Those decisions are about layouts, not
tensors, so they live here, on tuples; each framework's DTensor calls them with its tensor's
shape and keeps only the tensor mechanics (wrapping, autograd, the collectives themselves).

Error types follow ``torch.distributed.tensor`` (2.13) for the same mistake, so code written
against torch catches the same exceptions on either framework:

========================================================  =====================
mistake                                                   raised
========================================================  =====================
``from_local`` of a DTensor                               ``RuntimeError``
``from_local(run_check=True)``: local shapes disagree     ``ValueError``
``redistribute(placements=None)``                         ``RuntimeError``
``redistribute`` to another mesh                          ``NotImplementedError``
``redistribute`` to a ``Partial('product')`` it is not    ``RuntimeError``
``distribute_tensor`` of a DTensor, other mesh/placements ``ValueError`` (same: returned as is)
``distribute_tensor`` to ``Partial('product')``           ``ValueError``
``distribute_tensor``: ``src_data_rank`` not in the mesh  ``ValueError``
========================================================  =====================

Where hyperpar accepts more than torch (``shape=`` without ``stride=``, a redistribution to
``Partial('sum')``), it is on both frameworks alike. Everything here is raised on every rank
before any collective, except the local-shape checks, which need the shapes of the other ranks
(``from_local(run_check=True)``) or hold on one rank only (``shape=`` given: see
:func:`check_local_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from hyperpar.dtensor.layout import even_global_shape
from hyperpar.dtensor.placement import (
    REPLICATE,
    Partial,
    Placement,
    grad_placements_of,
    normalize_placements,
)

__all__ = [
    "check_local_shape",
    "check_same_local_shape",
    "distribute_target",
    "from_local_layout",
    "grad_target",
    "inferred_uneven_message",
    "redistribute_target",
    "refuse_dtensor_in_from_local",
    "uneven_lengths",
]

Placements = tuple[Placement, ...]


# ------------------------------------------------------------------------ from_local
def refuse_dtensor_in_from_local(tensor_kind: str) -> NoReturn:
    """``from_local`` was given a DTensor (torch: ``RuntimeError``)."""
    raise RuntimeError(
        f"DTensor.from_local takes this rank's plain {tensor_kind}, got a DTensor; use "
        f"dtensor.redistribute(mesh, placements) to change its layout, or pass "
        f"dtensor.to_local()")


def from_local_layout(local_shape: tuple[int, ...], mesh: Any, placements: Any,
                      shape: Sequence[int] | None, run_check: bool
                      ) -> tuple[Placements, tuple[int, ...]]:
    """The placements and global shape ``DTensor.from_local(local, mesh, placements,
    shape=shape, run_check=run_check)`` means for a local piece of ``local_shape``.

    Placements default to Replicate on every mesh dim. The shape is ``shape`` when given;
    otherwise the local shape times the mesh size along every sharded dim (even shards, as
    torch assumes), and with ``run_check`` every rank's local shape must agree first (torch's
    rule; uneven shards need ``shape=``): a collective, raised on every rank alike."""
    pl = normalize_placements(placements if placements is not None
                              else (REPLICATE,) * mesh.ndim, mesh.ndim, len(local_shape),
                              "from_local placements")
    if shape is not None:  # a tuple (torch.Size is one) holds ints already: C-speed copy
        return pl, tuple(shape) if isinstance(shape, tuple) else tuple(int(s) for s in shape)
    if run_check:
        check_same_local_shape(local_shape, mesh, pl)
    return pl, even_global_shape(local_shape, pl, tuple(mesh.shape))


def check_same_local_shape(local_shape: tuple[int, ...], mesh: Any,
                           placements: Placements) -> None:
    """``from_local(run_check=True)`` without ``shape``: every rank of ``mesh`` must hold the
    same local shape. Object all-gathers along each mesh dim, then a second round that tells
    every rank whether any group disagreed, so the error is raised on every rank alike."""
    from hyperpar.platform import get_platform  # the platform's collectives, any framework

    platform = get_platform()
    dims = [m for m in range(mesh.ndim) if mesh.size(m) > 1]
    found = ""
    for m in dims:
        shapes = platform.all_gather_object(tuple(int(s) for s in local_shape),
                                            mesh.get_group(m))
        if len(set(shapes)) > 1 and not found:
            found = ", ".join(f"rank {r}: {s}"
                              for r, s in zip(mesh.group_ranks(m), shapes, strict=True))
    bad = bool(found)
    for m in dims:  # an OR along each mesh dim in turn reaches every rank of the mesh
        bad = any(platform.all_gather_object(bad, mesh.get_group(m)))
    if bad:
        raise ValueError(
            f"DTensor.from_local(run_check=True): the local shapes disagree across ranks "
            f"({found or 'in another group of the mesh'}) for placements {placements}; for "
            f"uneven shards pass the global shape= (and stride=) explicitly")


def check_local_shape(local_shape: tuple[int, ...], want: tuple[int, ...],
                      shape: tuple[int, ...], placements: Placements, mesh: Any) -> None:
    """``from_local(..., shape=shape)``: this rank's piece must be the ``want`` that
    ``placements`` give it of ``shape`` (a wrong piece would be read as a wrong tensor). Only
    this rank knows its piece, so only a rank whose piece is wrong raises."""
    if local_shape != want:
        raise ValueError(
            f"DTensor.from_local: the local shape {tuple(local_shape)} on rank "
            f"{mesh.get_rank()} does not match {want}, the piece of global shape {shape} that "
            f"placements {placements} give it (uneven shards follow torch.chunk: earlier "
            f"ranks hold ceil(size / n) rows); pass this rank's piece, or the global shape= "
            f"these pieces make")


def grad_target(grad_placements: Any, placements: Placements, mesh_ndim: int, ndim: int
                ) -> tuple[Placements, Placements]:
    """``grad_placements=`` of ``from_local`` / ``to_local`` / ``full_tensor`` for a DTensor
    laid out as ``placements``: ``(given, own)``, the layout the caller says the gradient
    takes and the layout this DTensor's gradient has (Partial read as Replicate). The
    gradient is redistributed between the two in backward when they differ."""
    given = normalize_placements(grad_placements, mesh_ndim, ndim, "grad_placements")
    return given, grad_placements_of(placements)


# ------------------------------------------------------------------------ redistribute
def _check_partial_target(p: Partial, what: str, error: type[Exception]) -> None:
    if p.reduce_op == "product":
        raise error(f"{what}: cannot make {p!r} from a whole value (it has no exact split into "
                    f"per-rank factors; torch refuses it too); use Partial('sum'), or "
                    f"Replicate and multiply after")


def redistribute_target(mesh: Any, src: Placements, ndim: int, device_mesh: Any,
                        placements: Any) -> Placements:
    """The checked, normalised target placements of ``redistribute(device_mesh, placements)``
    on a DTensor of ``ndim`` dims laid out as ``src`` on ``mesh``."""
    if device_mesh is not None and device_mesh is not mesh and device_mesh != mesh:
        raise NotImplementedError(
            f"redistribute across meshes is not supported: {mesh!r} -> {device_mesh!r}; pass "
            f"the DTensor's own device_mesh (or None)")
    if placements is None:
        raise RuntimeError("redistribute: placements= is required (one placement per mesh "
                           "dim, e.g. [Replicate()])")
    dst = normalize_placements(placements, mesh.ndim, ndim, "redistribute placements")
    for m, p in enumerate(dst):  # no call on the usual path: redistribute runs per step
        if type(p) is Partial and p.reduce_op == "product" and src[m] != p:
            _check_partial_target(p, "redistribute", RuntimeError)
    return dst


# ------------------------------------------------------------------------ distribute_tensor
def distribute_target(mesh: Any, placements: Any, ndim: int, src_data_rank: int | None, *,
                      given: tuple[Any, Placements] | None = None) -> Placements | None:
    """The checked, normalised placements of ``distribute_tensor(t, mesh, placements,
    src_data_rank=...)`` for a tensor of ``ndim`` dims; ``None`` when ``t`` is a DTensor
    (``given``: its mesh and placements) already laid out so, which torch returns as it is."""
    pl = normalize_placements(placements if placements is not None
                              else (REPLICATE,) * mesh.ndim, mesh.ndim, ndim,
                              "distribute_tensor placements")
    if given is not None:
        gmesh, gpl = given
        if gmesh is not mesh and gmesh != mesh:
            raise ValueError(
                f"distribute_tensor: the tensor is already a DTensor on {gmesh!r}, not on "
                f"{mesh!r}; a DTensor cannot move to another mesh")
        if tuple(gpl) != pl:
            raise ValueError(
                f"distribute_tensor: the tensor is already a DTensor laid out as {tuple(gpl)}, "
                f"not {pl}; use dtensor.redistribute(mesh, {list(pl)}) to change its layout")
        return None
    for p in pl:
        if type(p) is Partial:
            _check_partial_target(p, "distribute_tensor", ValueError)
    if src_data_rank is not None:
        if isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int):
            raise ValueError(f"distribute_tensor: src_data_rank must be an int or None, got "
                             f"{src_data_rank!r}")
        for m in range(mesh.ndim):
            n = mesh.size(m)
            if not 0 <= src_data_rank < n:
                raise ValueError(
                    f"distribute_tensor: src_data_rank={src_data_rank} is not a rank of mesh "
                    f"dim {m} (size {n}); it is the index, along every mesh dim, of the rank "
                    f"whose tensor is used: 0..{n - 1}, or None to use each rank's own")
    return pl


# ------------------------------------------------------------------------ inferred shapes
def uneven_lengths(placement: Placement, mesh_dim: int, ranks: Sequence[int],
                   lengths: Sequence[int]) -> str | None:
    """``"Shard(dim=0) over mesh dim 0: rank 0 holds 3, rank 1 holds 2"`` when the ranks of
    one mesh dim hold pieces of different ``lengths`` along ``placement``'s dim, else None."""
    if len(set(lengths)) < 2:
        return None
    return f"{placement} over mesh dim {mesh_dim}: " + ", ".join(
        f"rank {r} holds {v}" for r, v in zip(ranks, lengths, strict=True))


def inferred_uneven_message(source: str, found: Sequence[str], fix: str) -> str:
    """The error when pieces whose global shape ``source`` inferred assuming even shards turn
    out uneven (``found``: :func:`uneven_lengths` of this rank's groups, empty when only
    another group of the mesh disagreed)."""
    where = "; ".join(found) if found else "in another group of the mesh"
    return (f"{source}: the ranks hold pieces of different sizes ({where}), but the global "
            f"shape was inferred assuming even shards, so every rank has a different (wrong) "
            f"one. {fix}")
