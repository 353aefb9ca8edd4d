"""Token dispatch and combine on torch: what :mod:`hyperpar.moe.routing` decides, done to
tensors.

* :func:`exchange_counts` -- the count all-to-all, carrying each rank's status word so a bad
  input on one rank makes every rank raise before the token all-to-all.
* :func:`dispatch` / :func:`combine` -- the token all-to-alls (differentiable, uneven:
  ``Platform.all_to_all_single_autograd``) and the rank-major <-> expert-major regrouping
  (``split`` + ``cat`` of segments: one op per segment, no per-token Python).
* :func:`sort_by_expert`, :func:`capacity_keep_mask`, :func:`check_router_scores` -- the
  per-token routing helpers an MoE block uses before calling its experts; the drop order is
  :func:`hyperpar.moe.routing.capacity_keep`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.moe.errors import MoERoutingError
from hyperpar.moe.placement import ExpertPlacement
from hyperpar.moe.routing import DispatchPlan, dispatch_plan, raise_on_status
from hyperpar.platform import get_platform

__all__ = ["capacity_keep_mask", "check_router_scores", "combine", "dispatch",
           "exchange_counts", "plan_dispatch", "regroup", "sort_by_expert"]


def exchange_counts(counts: torch.Tensor, status: int, placement: ExpertPlacement,
                    group: Any) -> tuple[list[int], list[int]]:
    """Send every ep rank ``[status, counts for its experts]``; return ``(statuses,
    recv_counts)`` (``recv_counts`` rank-major, :func:`~hyperpar.moe.routing.dispatch_plan`'s
    layout). ``counts`` holds one count per global expert; a ``status`` other than 0 marks this
    rank's input bad (the counts are then zeros)."""
    ep, n = placement.ep, placement.num_local
    send = torch.zeros(ep, n + 1, dtype=torch.int64, device=counts.device)
    send[:, 0] = status
    if not status:
        send[:, 1:] = counts.detach().reshape(ep, n).to(torch.int64)
    recv = torch.empty_like(send)
    get_platform().all_to_all_single(recv, send, group=group)
    rows = recv.tolist()  # the one host sync of a dispatch: the splits are host ints
    return [r[0] for r in rows], [c for r in rows for c in r[1:]]


def plan_dispatch(routed_input: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                  placement: ExpertPlacement, group: Any, *, dim: int | None = None,
                  check_finite: bool = True) -> DispatchPlan:
    """The local checks, the count exchange and the :class:`DispatchPlan` of one dispatch.

    Raises :class:`MoERoutingError` on every ep rank if any rank's input is bad (counts not
    matching the rows or the expert count, a feature size other than ``dim``, NaN/inf tokens
    with ``check_finite``)."""
    counts = num_tokens_per_expert.detach()
    status = 0
    send: list[int] = []
    detail = _DEFERRED.pop() if _DEFERRED else ""
    if detail:
        status = 5
    elif counts.dim() != 1 or counts.numel() != placement.num_experts:
        status = 3
    else:
        send = [int(c) for c in counts.tolist()]
        if min(send, default=0) < 0 or sum(send) != routed_input.shape[0]:
            status = 1
        elif dim is not None and (routed_input.dim() != 2 or routed_input.shape[-1] != dim):
            status = 4
        elif check_finite and routed_input.numel() and not bool(
                torch.isfinite(routed_input.detach().sum(dtype=torch.float32))):
            # one fp32 reduction, no per-element mask (measured: isfinite().all() cost ~2x
            # the token all-to-all on CPU); NaN or inf anywhere makes the sum non-finite (only
            # a finite sum above 3e38 would be a false alarm)
            status = 2
    statuses, recv = exchange_counts(counts if not status else routed_input.new_zeros(0),
                                     status, placement, group)
    raise_on_status(statuses, detail=detail)
    return dispatch_plan(send, recv, placement)


def regroup(x: torch.Tensor, sizes: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """``x`` split along dim 0 into ``sizes``, the pieces concatenated in ``order``."""
    if all(i == k for k, i in enumerate(order)):  # one local expert: already grouped
        return x
    pieces = torch.split(x, list(sizes), dim=0)
    return torch.cat([pieces[i] for i in order], dim=0)


def dispatch(routed_input: torch.Tensor, plan: DispatchPlan, group: Any) -> torch.Tensor:
    """Send each rank its tokens (rows sorted by global expert) and group what arrives by
    local expert (expert-major, source rank inner). Differentiable."""
    received = get_platform().all_to_all_single_autograd(
        routed_input, plan.output_splits, plan.input_splits, group)
    return regroup(received, plan.segment_sizes, plan.segment_order)


def combine(routed_output: torch.Tensor, plan: DispatchPlan, group: Any) -> torch.Tensor:
    """Undo :func:`dispatch`: back to rank-major, then every row to the rank it came from, in
    the order it was sent. Differentiable."""
    rank_major = regroup(routed_output, plan.expert_major_sizes, plan.inverse_segment_order)
    return get_platform().all_to_all_single_autograd(
        rank_major, plan.input_splits, plan.output_splits, group)


#: A router-score error found on this rank while expert-parallel dispatch is installed: kept
#: for the next count exchange, which carries it to every ep rank (raising here alone would
#: leave the other ranks waiting in the all-to-all).
_DEFERRED: list[str] = []
#: expert-parallel dispatches installed in this process (the styles count themselves)
_DISPATCHERS = [0]


def check_router_scores(scores: torch.Tensor, what: str = "router scores") -> None:
    """Refuse NaN/inf router scores (they make top-k pick arbitrary experts: a silently wrong
    result), naming how many and the first token holding one. Raises
    :class:`MoERoutingError` at once in a process without expert-parallel dispatch; with one,
    the next dispatch raises it on every ep rank, before the token all-to-all."""
    bad = ~torch.isfinite(scores.detach())
    if bool(bad.any()):
        rows = bad.reshape(-1, scores.shape[-1]).any(dim=-1).nonzero().flatten()
        msg = (f"{what} contain {int(bad.sum())} NaN/inf value(s), first at token "
               f"{int(rows[0])} (of {rows.numel()} bad tokens); check the router's input and "
               f"weights (a diverged step, an uninitialised gate) before routing")
        if _DISPATCHERS[0]:
            _DEFERRED[:] = [msg]
            return
        raise MoERoutingError(msg)


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat assignment indices (``token * k + choice``) sorted by expert id, ties in token
    order (stable), and the tokens per expert. ``keep`` (bool, like ``expert_ids``) drops the
    ``False`` assignments (capacity). The token of assignment ``a`` is ``a // k``."""
    flat = expert_ids.reshape(-1)
    if keep is not None:
        kept = keep.reshape(-1).nonzero().flatten()
        order = kept[torch.argsort(flat[kept], stable=True)]
        counts = torch.bincount(flat[kept], minlength=num_experts)
    else:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def capacity_keep_mask(expert_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The ``(tokens, k)`` bool mask :func:`hyperpar.moe.routing.capacity_keep` gives:
    choice-major, then token order; an assignment is kept while its expert has fewer than
    ``capacity`` kept."""
    if capacity < 0:
        raise MoERoutingError(f"capacity must be >= 0, got {capacity}")
    t, k = expert_ids.shape
    flat = expert_ids.t().reshape(-1)  # choice-major: every token's 1st choice, then 2nd, ...
    position = (F.one_hot(flat, num_experts).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return (position < capacity).reshape(k, t).t()
