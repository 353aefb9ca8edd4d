"""The ops a Mixture-of-Experts router and token dispatcher call: ``sort_along`` (``topk``,
``sort``, ``argsort``: the sorted dim gathered, other shards stay), ``histogram`` (``histc``:
local counts of a shard summed as ``Partial("sum")``; ``bincount``: gathered, its length
depends on the values), ``scatter_d`` (``scatter``/``scatter_add`` along a dim: other dims
shard together, as ``gather_d``), ``index_add`` (the indexed dim whole, other dims shard
together) and ``grouped_mm`` (experts' grouped GEMM: the output features or the contracted dim
may be sharded; the expert and token dims are gathered). Imports no framework."""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE, Partial, Placement, Shard
from .base import OpSharding, Shape, TensorMeta, no_rule, norm_dim, rule, unshard

P_SUM = Partial("sum")


@rule("sort_along")
def _sort_along(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                dim: int = -1, k: int | None = None, outputs: int = 2, **_: Any) -> OpSharding:
    """``topk(x, k, dim)`` (``k`` given), ``sort`` / ``argsort`` along ``dim``: that dim and any
    Partial are gathered, every other shard stays (rows are sorted independently). ``outputs``:
    2 (values, indices) or 1 (argsort)."""
    (x,) = metas
    d = norm_dim(dim, len(x.shape)) if x.shape else 0
    pl = unshard(x.placements, (d,))
    shape = tuple(x.shape)
    if k is not None and shape:
        shape = (*shape[:d], k, *shape[d + 1:])
    return OpSharding((pl,), (pl,) * outputs, (shape,) * outputs)


@rule("histogram")
def _histogram(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
               bins: int, data_range: bool = False, **_: Any) -> OpSharding:
    """``histc(x, bins, min, max)`` counts every element: on a shard, local counts summed over
    the ranks (``Partial("sum")``). ``data_range`` (``min == max``: the range is the data's own)
    needs the whole tensor, as does ``bincount`` (``op == "bincount"``: its length is the
    largest value). A Partial input is reduced first."""
    (x,) = metas
    if data_range or op == "bincount":
        pl = tuple(REPLICATE for _ in x.placements)
        return OpSharding((pl,), (pl,), ((bins,),))
    pl = unshard(x.placements)
    out = tuple(P_SUM if type(p) is Shard else REPLICATE for p in pl)
    return OpSharding((pl,), (out,), ((bins,),))


def _together(metas: tuple[TensorMeta, ...], d: int) -> tuple[tuple[Placement, ...], ...]:
    """Per input, per mesh dim: a ``Shard(e)`` kept where every input is ``Shard(e)``, ``e``
    not ``d`` and the same size along ``e`` in all; else Replicate."""
    per_input: list[list[Placement]] = [[] for _ in metas]
    for i in range(len(metas[0].placements)):
        ps = [m.placements[i] for m in metas]
        first = ps[0]
        keep = (type(first) is Shard and first.dim != d and all(p == first for p in ps)
                and len({m.shape[first.dim] for m in metas}) == 1)
        for j in range(len(metas)):
            per_input[j].append(first if keep else REPLICATE)
    return tuple(tuple(p) for p in per_input)


@rule("scatter_d")
def _scatter_d(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
               dim: int, **_: Any) -> OpSharding:
    """``self.scatter(dim, index, src | value)`` / ``scatter_add``: ``self[i][index[i][j]] =
    src[i][j]`` along ``dim``. A mesh dim stays sharded where ``self``, ``index`` (and ``src``)
    are all ``Shard(e)``, ``e != dim``, of equal size along ``e``; else all are replicated
    (``dim`` itself is always whole). The output is laid out as ``self``."""
    self_ = metas[0]
    d = norm_dim(dim, len(self_.shape))
    targets = _together(metas, d)
    return OpSharding(targets, (targets[0],), (tuple(self_.shape),))


@rule("index_add")
def _index_add(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
               dim: int, **_: Any) -> OpSharding:
    """``self.index_add(dim, index, source)``: ``dim`` of ``self`` and ``source`` whole and
    ``index`` replicated; another dim stays sharded where ``self`` and ``source`` are both
    ``Shard(e)`` of equal size along ``e``. The output is laid out as ``self``."""
    self_, index, source = metas
    d = norm_dim(dim, len(self_.shape))
    ts, tsrc = _together((self_, source), d)
    ti = tuple(REPLICATE for _ in index.placements)
    return OpSharding((ts, ti, tsrc), (ts,), (tuple(self_.shape),))


@rule("grouped_mm")
def _grouped_mm(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
                **_: Any) -> OpSharding:
    """``_grouped_mm(a (tokens, K), b (experts, K, N), offs)``: tokens are grouped by expert
    through ``offs`` (global offsets), so the token and expert dims are gathered. ``b`` sharded
    on ``N`` gives an output sharded on its last dim (``a`` replicated); ``b`` sharded on ``K``
    with ``a`` sharded on ``K`` gives ``Partial("sum")``; anything else is gathered. Other
    shapes (3-D ``a``, 2-D ``b``) are refused."""
    if len(metas) != 3 or len(metas[0].shape) != 2 or len(metas[1].shape) != 3:
        raise no_rule(op, metas, "only a (tokens, K) x (experts, K, N) product with offs "
                                 "has a rule; call it on .to_local() per rank")
    a, b, offs = metas
    ta: list[Placement] = []
    tb: list[Placement] = []
    out: list[Placement] = []
    for pb in b.placements:
        if type(pb) is Shard and pb.dim == 2:
            ta.append(REPLICATE)
            tb.append(pb)
            out.append(Shard(1))
        elif type(pb) is Shard and pb.dim == 1:
            ta.append(Shard(1))
            tb.append(pb)
            out.append(P_SUM)
        else:
            ta.append(REPLICATE)
            tb.append(REPLICATE)
            out.append(REPLICATE)
    to = tuple(REPLICATE for _ in offs.placements)
    shape: Shape = (a.shape[0], b.shape[2])
    return OpSharding((tuple(ta), tuple(tb), to), (tuple(out),), (shape,))
