"""Token dispatch and combine on MindSpore: what :mod:`hyperpar.moe` decides, done to
MindSpore tensors (the torch twin is :mod:`hyperpar.torch.moe.dispatch`).

* :func:`all_to_all_single_autograd` -- the differentiable uneven dim-0 all-to-all
  (``MindSporePlatform.all_to_all_single_autograd``): a Cell whose ``construct`` runs the
  exchange and whose ``bprop`` runs it with the split lists swapped. MindSpore 2.10 has no CPU
  kernel for it (``mint.distributed.all_to_all_single`` with splits: "kernel
  DistCommAllToAllVSingle unregistered"; ``ops.AlltoAllV``: "Unsupported op"), so on CPU the
  exchange is the platform's composed ``all_to_all_single`` (one all-gather of the split
  table, one of the padded inputs, then each rank selects its rows).
* :func:`plan_dispatch` -- the local checks and the count exchange
  (:mod:`hyperpar.moe.exchange` decides the status word and the message), then
  :func:`hyperpar.moe.routing.dispatch_plan`.
* :func:`dispatch` / :func:`combine` -- the token all-to-alls and the rank-major <->
  expert-major regrouping (one ``gather`` with the plan's permutation).
* :func:`sort_by_expert`, :func:`capacity_keep_mask`, :func:`check_router_scores` -- the
  per-token routing helpers on Cells' tensors; the drop order is
  :func:`hyperpar.moe.routing.capacity_keep`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mindspore import Tensor, mint, nn, ops
from mindspore import dtype as mstype

from hyperpar.moe.errors import MoERoutingError
from hyperpar.moe.exchange import count_message, dispatch_status, read_count_message
from hyperpar.moe.placement import ExpertPlacement
from hyperpar.moe.routing import DispatchPlan, capacity_keep, dispatch_plan, raise_on_status
from hyperpar.platform import get_platform

__all__ = ["AllToAll", "all_to_all_single_autograd", "capacity_keep_mask",
           "check_router_scores", "combine", "dispatch", "exchange_counts", "plan_dispatch",
           "regroup", "sort_by_expert"]


def _exchange(platform: Any, x: Any, output_splits: list[int], input_splits: list[int],
              group: Any) -> Any:
    if platform.world_size(group) == 1:
        return x
    out = mint.zeros((sum(output_splits), *x.shape[1:]), dtype=x.dtype)
    platform.all_to_all_single(out, x, output_splits, input_splits, group)
    return out


class AllToAll(nn.Cell):
    """``input_splits[j]`` rows to group rank ``j``, ``output_splits[j]`` rows from it; the
    gradient goes back with the lists swapped (``bprop``: MindSpore's custom backward)."""

    def __init__(self, platform: Any, output_splits: Sequence[int],
                 input_splits: Sequence[int], group: Any) -> None:
        super().__init__()
        self.platform, self.group = platform, group
        self.output_splits = [int(s) for s in output_splits]
        self.input_splits = [int(s) for s in input_splits]

    def construct(self, x: Any) -> Any:
        return _exchange(self.platform, x, self.output_splits, self.input_splits, self.group)

    def bprop(self, x: Any, out: Any, dout: Any) -> tuple[Any]:
        return (_exchange(self.platform, dout, self.input_splits, self.output_splits,
                          self.group),)


def all_to_all_single_autograd(tensor: Any, output_split_sizes: Sequence[int] | None,
                               input_split_sizes: Sequence[int] | None,
                               group: Any = None) -> Any:
    """Differentiable uneven dim-0 all-to-all (the contract of
    ``Platform.all_to_all_single_autograd``; ``None``: equal pieces)."""
    platform = get_platform()
    n = platform.world_size(group)
    rows = int(tensor.shape[0])
    if input_split_sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all_single_autograd: {rows} rows do not split evenly over "
                             f"{n} ranks; pass input_split_sizes")
        input_split_sizes = [rows // n] * n
    if output_split_sizes is None:
        output_split_sizes = list(input_split_sizes)  # equal pieces both ways
    if len(input_split_sizes) != n or len(output_split_sizes) != n:
        raise ValueError(f"all_to_all_single_autograd: need {n} split sizes each way, got "
                         f"{len(input_split_sizes)} in and {len(output_split_sizes)} out")
    if sum(input_split_sizes) != rows:
        raise ValueError(f"all_to_all_single_autograd: input_split_sizes sum to "
                         f"{sum(input_split_sizes)}, but the tensor has {rows} rows")
    return AllToAll(platform, output_split_sizes, input_split_sizes, group)(tensor)


def exchange_counts(counts: list[int], status: int, placement: ExpertPlacement,
                    group: Any) -> tuple[list[int], list[int]]:
    """Send every ep rank ``[status, counts for its experts]``; return ``(statuses,
    recv_counts)`` (:func:`hyperpar.moe.exchange.read_count_message`)."""
    platform = get_platform()
    send = Tensor(np.asarray(count_message(status, counts, placement), dtype=np.int64))
    if platform.world_size(group) == 1:
        return read_count_message(send.asnumpy().tolist())
    recv = mint.zeros(tuple(send.shape), dtype=mstype.int64)
    platform.all_to_all_single(recv, send, group=group)
    return read_count_message(recv.asnumpy().tolist())  # the dispatch's one host sync


def plan_dispatch(routed_input: Any, num_tokens_per_expert: Any, placement: ExpertPlacement,
                  group: Any, *, dim: int | None = None,
                  check_finite: bool = True) -> DispatchPlan:
    """The local checks, the count exchange and the :class:`DispatchPlan` of one dispatch;
    raises :class:`MoERoutingError` on every ep rank if any rank's input is bad."""
    c = num_tokens_per_expert.asnumpy()
    counts = [int(v) for v in c.reshape(-1)] if c.ndim == 1 else None

    def finite() -> bool:
        return bool(np.isfinite(routed_input.asnumpy()).all())

    detail = _DEFERRED.pop() if _DEFERRED else ""
    status = 5 if detail else dispatch_status(
        counts, placement.num_experts, int(routed_input.shape[0]), tuple(routed_input.shape),
        dim, finite if check_finite else None)
    statuses, recv = exchange_counts(counts or [], status, placement, group)
    raise_on_status(statuses, detail=detail)
    return dispatch_plan(counts, recv, placement)  # type: ignore[arg-type]


def regroup(x: Any, permutation: Sequence[int]) -> Any:
    """The rows of ``x`` in ``permutation``'s order (differentiable; ``ops.gather``:
    ``mint.index_select`` has no CPU kernel in MindSpore 2.10)."""
    if len(permutation) <= 1 or list(permutation) == list(range(len(permutation))):
        return x
    return ops.gather(x, Tensor(np.asarray(permutation, dtype=np.int32)), 0)


def dispatch(routed_input: Any, plan: DispatchPlan, group: Any) -> Any:
    """Send each rank its tokens (rows sorted by global expert) and group what arrives by
    local expert (expert-major, source rank inner). Differentiable."""
    received = all_to_all_single_autograd(routed_input, plan.output_splits, plan.input_splits,
                                          group)
    return regroup(received, plan.permutation())


def combine(routed_output: Any, plan: DispatchPlan, group: Any) -> Any:
    """Undo :func:`dispatch`: back to rank-major, then every row to the rank it came from, in
    the order it was sent. Differentiable."""
    rank_major = regroup(routed_output, plan.inverse())
    return all_to_all_single_autograd(rank_major, plan.input_splits, plan.output_splits, group)


#: A router-score error found on this rank while expert-parallel dispatch is installed: kept
#: for the next count exchange, which carries it to every ep rank (as on torch).
_DEFERRED: list[str] = []
#: expert-parallel dispatches installed in this process (the styles count themselves)
_DISPATCHERS = [0]


def check_router_scores(scores: Any, what: str = "router scores") -> None:
    """Refuse NaN/inf router scores, naming how many and the first token holding one: at once
    in a process without expert-parallel dispatch; with one, the next dispatch raises it on
    every ep rank, before the token all-to-all."""
    a = scores.asnumpy()
    bad = ~np.isfinite(a)
    if bad.any():
        rows = np.flatnonzero(bad.reshape(-1, a.shape[-1]).any(axis=-1))
        msg = (f"{what} contain {int(bad.sum())} NaN/inf value(s), first at token "
               f"{int(rows[0])} (of {rows.size} bad tokens); check the router's input and "
               f"weights (a diverged step, an uninitialised gate) before routing")
        if _DISPATCHERS[0]:
            _DEFERRED[:] = [msg]
            return
        raise MoERoutingError(msg)


def sort_by_expert(expert_ids: Any, num_experts: int,
                   keep: Any = None) -> tuple[Any, Any]:
    """Flat assignment indices (``token * k + choice``) sorted by expert id, ties in token order
    (stable), and the tokens per expert; ``keep`` drops the ``False`` assignments. Host ints
    (the splits are host ints anyway), returned as int64 tensors."""
    flat = expert_ids.asnumpy().reshape(-1)
    idx = np.arange(flat.size)
    if keep is not None:
        idx = idx[keep.asnumpy().reshape(-1).astype(bool)]
    order = idx[np.argsort(flat[idx], kind="stable")]
    counts = np.bincount(flat[idx], minlength=num_experts)
    return (Tensor(order.astype(np.int64)), Tensor(counts.astype(np.int64)))


def capacity_keep_mask(expert_ids: Any, num_experts: int, capacity: int) -> Any:
    """The ``(tokens, k)`` bool mask of :func:`hyperpar.moe.routing.capacity_keep` (the core's
    drop order, computed by the core)."""
    ids = expert_ids.asnumpy().tolist()
    return Tensor(np.asarray(capacity_keep(ids, num_experts, capacity), dtype=np.bool_))
