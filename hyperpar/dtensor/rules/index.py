"""Basic indexing (``x[i]``: ints, slices, ``None``, ``Ellipsis``) and ``expand`` /
``broadcast_to``. Partial placements pass through (both are linear). Imports no framework."""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE, Shard
from .base import OpSharding, Shape, TensorMeta, no_rule, rule


def is_basic(item: Any) -> bool:
    """Whether ``item`` is one entry of a basic index: an int (not a bool: ``x[True]`` adds a
    dim, as a mask), a slice, ``None`` or ``Ellipsis``."""
    return item is None or item is Ellipsis or type(item) is slice or \
        (isinstance(item, int) and not isinstance(item, bool))


def basic_index(index: Any, shape: Shape) -> tuple[set[int], dict[int, int], Shape]:
    """Read a basic ``index`` of a tensor of ``shape``: the input dims it touches (an int or a
    slice other than ``:``), the output dim of each input dim that survives, and the output
    shape. Raises torch's IndexError / ValueError for an index out of range, too many indices,
    two ellipses or a slice step that is not positive."""
    items = index if type(index) is tuple else (index,)
    ndim = len(shape)
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if n_real > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim}")
    touched: set[int] = set()
    dim_map: dict[int, int] = {}
    out: list[int] = []
    d_in = 0
    for i in items:
        if i is Ellipsis:
            for _ in range(ndim - n_real):
                dim_map[d_in] = len(out)
                out.append(shape[d_in])
                d_in += 1
        elif i is None:
            out.append(1)
        elif type(i) is slice:
            if i.step is not None and i.step <= 0:
                raise ValueError(f"index {i}: the slice step must be greater than zero (as in "
                                 "torch); flip the result instead")
            if i != slice(None):
                touched.add(d_in)
            dim_map[d_in] = len(out)
            out.append(len(range(*i.indices(shape[d_in]))))
            d_in += 1
        else:
            n = shape[d_in]
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {d_in} with size "
                                 f"{n}")
            touched.add(d_in)
            d_in += 1
    for d in range(d_in, ndim):
        dim_map[d] = len(out)
        out.append(shape[d])
    return touched, dim_map, tuple(out)


@rule("getitem")
def _getitem(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
             index: Any, **_: Any) -> OpSharding:
    """``x[index]`` for a basic ``index`` (see :func:`basic_index`): the dims it touches are
    gathered on every mesh dim sharding them; the other shards follow their dim to its output
    position; Partial passes through. An advanced index (a tensor, a list, a bool) has no rule
    here."""
    (x,) = metas
    items = index if type(index) is tuple else (index,)
    bad = [i for i in items if not is_basic(i)]
    if bad:
        raise no_rule(op, metas, f"the index holds {type(bad[0]).__name__} {bad[0]!r}; only "
                                 "basic indexing (ints, slices, None, ...) keeps shards")
    touched, dim_map, shape = basic_index(index, tuple(x.shape))
    target = tuple(REPLICATE if type(p) is Shard and p.dim in touched else p
                   for p in x.placements)
    out = tuple(Shard(dim_map[p.dim]) if type(p) is Shard else p for p in target)
    return OpSharding((target,), (out,), (shape,))


def expanded_shape(src: Shape, shape: Any) -> Shape:
    """``shape`` of ``expand`` / ``broadcast_to`` with its ``-1`` entries resolved against
    ``src`` (only for dims that exist in ``src``); a dim of ``src`` that is neither 1 nor equal
    to its target raises torch's RuntimeError message as a ValueError."""
    shape = tuple(int(s) for s in shape)
    lead = len(shape) - len(src)
    if lead < 0:
        raise ValueError(f"expand: the target shape {shape} has fewer dims than the tensor "
                         f"{tuple(src)}")
    out = []
    for i, s in enumerate(shape):
        if i < lead:
            if s < 0:
                raise ValueError(f"expand: -1 is not allowed in a new leading dim ({shape})")
            out.append(s)
            continue
        have = src[i - lead]
        s = have if s == -1 else s
        if have != 1 and have != s:
            raise ValueError(f"expand: the size of dim {i - lead} ({have}) must match the "
                             f"target size {s} (target shape {shape}) or be 1")
        out.append(s)
    return tuple(out)


@rule("expand")
def _expand(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
            shape: Any, **_: Any) -> OpSharding:
    """``expand`` / ``broadcast_to`` to ``shape`` (``-1`` keeps a dim): a sharded dim that
    grows (size 1 to more) is gathered first; new leading dims are replicated; the other shards
    move with their dim; Partial passes through."""
    (x,) = metas
    out_shape = expanded_shape(tuple(x.shape), shape)
    lead = len(out_shape) - len(x.shape)
    target = tuple(REPLICATE if type(p) is Shard and x.shape[p.dim] != out_shape[p.dim + lead]
                   else p for p in x.placements)
    out = tuple(Shard(p.dim + lead) if type(p) is Shard else p for p in target)
    return OpSharding((target,), (out,), (out_shape,))
