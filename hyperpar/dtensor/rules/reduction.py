"""Reductions (``sum``, ``mean``, ``max``, ``min``, ``max_dim``, ``min_dim``), the reductions
computed on gathered dims (``prod``, ``var``, ``std``, ``argmax``, ...), the scans along a dim
(``cumsum``, ``cumprod``) and the ops that normalise along a dim (``softmax``, ``log_softmax``)."""

from __future__ import annotations

import math
from typing import Any

from ..placement import REPLICATE, Partial, Placement, Shard
from .base import OpSharding, Shape, TensorMeta, norm_dim, rule, unshard

# Partial inputs a reduction keeps pending (it commutes with their reduce op); max/min only
# when no gradient flows. Not the *_dim ops: their indices output has no Partial meaning.
_KEEPS = {"sum": ("sum", "avg"), "mean": ("sum", "avg"), "max": ("max",), "min": ("min",)}
_GATHERS = ("max", "min", "max_dim", "min_dim")
_OVER_SHARDS = {"sum": Partial("sum"), "mean": Partial("sum")}


def reduced_dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """``dim`` (None, an int or a sequence) as sorted non-negative dims; None is every dim."""
    if dim is None or dim == () or dim == []:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({norm_dim(d, ndim) for d in dims}))


def reduced_shape(shape: Shape, dims: tuple[int, ...], keepdim: bool) -> Shape:
    """``shape`` reduced over ``dims`` (kept as 1 with ``keepdim``)."""
    if keepdim:
        return tuple(1 if i in dims else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in dims)


def reduced_placements(placements: tuple[Placement, ...], dims: tuple[int, ...], keepdim: bool,
                       op: str) -> tuple[Placement, ...]:
    """The output placements of a reduction over ``dims`` computed on the local shards: a shard
    of a reduced dim becomes ``Partial(op)``, other shards are renumbered unless ``keepdim``."""
    out: list[Placement] = []
    for p in placements:
        if type(p) is Shard:
            if p.dim in dims:
                out.append(Partial(op))
            else:
                out.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in dims)))
        else:
            out.append(p)
    return tuple(out)


def _some_piece_empty(size: int, n: int) -> bool:
    """Whether torch.chunk's split of ``size`` into ``n`` leaves the last rank nothing."""
    step = -(-size // n)
    return step * (n - 1) >= size


@rule("sum", "mean", "max", "min", "max_dim", "min_dim")
def _reduce(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
            dim: Any = None, keepdim: bool = False, pending: bool = False,
            **_: Any) -> OpSharding:
    """Over a sharded dim: ``sum``/``mean`` give Partial("sum") (a mean is a local sum divided
    by the global count); ``max``/``min`` and ``*_dim`` gather the dim first (a Partial("max")
    output would send the gradient to every rank's local maximum) -- unless ``pending`` (the
    platform knows no gradient flows: torch's ``amax`` under no_grad), where ``max``/``min``
    give Partial("max"/"min") if no rank's piece is empty (an empty piece has no maximum).
    ``dim`` may be None, an int or several dims, negative or not. Partial inputs of the same
    algebra stay Partial (for ``max``/``min`` only when ``pending``); others reduce first
    (always for ``*_dim``: their indices cannot be combined across ranks)."""
    (x,) = metas
    nd = len(x.shape)
    dims = reduced_dims(dim, nd)
    keeps = _KEEPS.get(op, ()) if op in ("sum", "mean") or pending else ()
    target: list[Placement] = []
    outs: list[Placement] = []
    sharded_reduced = False
    for m, p in enumerate(x.placements):
        if type(p) is Shard and p.dim in dims:
            if op in ("max", "min") and pending and \
                    not _some_piece_empty(x.shape[p.dim], mesh_shape[m]):
                target.append(p)
                outs.append(Partial(op))
            elif op in _GATHERS:
                target.append(REPLICATE)
                outs.append(REPLICATE)
            else:
                target.append(p)
                outs.append(_OVER_SHARDS[op])
                sharded_reduced = True
        elif type(p) is Shard:
            target.append(p)
            outs.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
        elif type(p) is Partial and p.reduce_op in keeps:
            target.append(p)
            outs.append(p)
        else:
            target.append(REPLICATE)
            outs.append(REPLICATE)
    shape = reduced_shape(x.shape, dims, keepdim)
    divide_by = None
    if op == "mean" and sharded_reduced:
        divide_by = math.prod(x.shape[d] for d in dims)
    n_out = 2 if op.endswith("_dim") else 1
    return OpSharding((tuple(target),), (tuple(outs),) * n_out, (shape,) * n_out,
                      divide_by=divide_by)


@rule("softmax", "log_softmax")
def _softmax(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
             dim: int = -1, **_: Any) -> OpSharding:
    """Normalising along ``dim`` needs the whole of it: that dim (and any Partial) is gathered,
    other shards stay."""
    (x,) = metas
    d = norm_dim(dim, len(x.shape))
    pl = tuple(p if type(p) is Shard and p.dim != d else REPLICATE for p in x.placements)
    return OpSharding((pl,), (pl,), (tuple(x.shape),))


#: Reductions with no cheap Partial form (a product, a variance, an index, ...): computed on the
#: gathered reduced dims. ``*_mean`` give two outputs (the statistic and the mean).
GATHERED = ("prod", "var", "std", "var_mean", "std_mean", "argmax", "argmin", "logsumexp",
            "all", "any", "norm")


@rule(*GATHERED)
def _gathered_reduction(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                        dim: Any = None, keepdim: bool = False, **_: Any) -> OpSharding:
    """The reduced dims (``dim``: None -- every dim, as ``argmax`` of the flattened tensor --
    an int or several, negative or not) and any Partial are gathered; a shard of another dim
    stays, renumbered unless ``keepdim``. Other arguments (``correction``, ``p``, ``dtype``)
    do not change the layout."""
    (x,) = metas
    dims = reduced_dims(dim, len(x.shape))
    pl = unshard(x.placements, dims)
    out = reduced_placements(pl, dims, keepdim, "sum")  # no shard of dims left: no Partial
    shape = reduced_shape(x.shape, dims, keepdim)
    n = 2 if op.endswith("_mean") else 1
    return OpSharding((pl,), (out,) * n, (shape,) * n)


@rule("cumsum", "cumprod")
def _scan(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *, dim: int,
          **_: Any) -> OpSharding:
    """A running sum or product along ``dim`` needs the whole of it (and any Partial
    reduced); other shards stay; the shape is kept."""
    (x,) = metas
    pl = unshard(x.placements, (norm_dim(dim, len(x.shape)),))
    return OpSharding((pl,), (pl,), (tuple(x.shape),))
