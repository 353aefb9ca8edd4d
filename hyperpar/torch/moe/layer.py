"""``MoE``: a Mixture-of-Experts feed-forward layer for models written by hand, in torchtitan's
shape (router -> tokens sorted by expert -> ``experts(routed_input, num_tokens_per_expert)`` ->
unsort and weight -> plus the shared experts).

The model code holds no parallelism: expert parallelism is a plan entry on the ``experts``
submodule (``{"layers.*.moe.experts": ExpertParallel()}`` on an ``ep`` mesh), whose input and
output functions are the token dispatch and combine; the router and the shared experts stay
replicated (or take the dense styles).
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import FeedForward, GroupedExperts
from .router import ScoreFunc, TokenChoiceTopKRouter, load_balancing_loss

__all__ = ["MoE"]


class MoE(nn.Module):
    """Token-choice top-k MoE over ``num_experts`` SwiGLU experts plus optional shared experts.

    Args:
        dim: token dimension.
        hidden_dim: each routed expert's hidden size (the shared experts have
            ``hidden_dim * num_shared_experts``).
        num_experts: routed experts.
        top_k: experts per token.
        num_shared_experts: ``0`` for none; otherwise one ``FeedForward`` of that many experts'
            width that every token passes through.
        score_func, route_norm, route_scale, gate_bias: the router's (see
            :class:`TokenChoiceTopKRouter`); ``score_func`` defaults to softmax.
        score_before_experts: weight each routed token by its score before the expert (``True``,
            torchtitan's default) or the expert's output after it.
        load_balance_coeff: DeepSeek-V3's auxiliary-loss-free balancing: a persistent
            ``expert_bias`` buffer that shifts the choice, updated by
            :func:`hyperpar.moe.update_expert_bias` from the ``tokens_per_expert`` counted in
            training forwards. ``None`` (default): no bias.
        use_grouped_mm: passed to :class:`GroupedExperts`.

    ``forward(x)`` takes ``(..., dim)`` and returns the same shape. After each forward
    ``self.aux_loss`` is the switch load-balancing loss of its tokens (differentiable; add
    ``coeff * moe.aux_loss`` to the training loss to use it).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int = 8, top_k: int = 1,
                 num_shared_experts: int = 0, score_func: ScoreFunc = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0, gate_bias: bool = False,
                 score_before_experts: bool = True, load_balance_coeff: float | None = None,
                 use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        if load_balance_coeff is not None and load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff must be > 0 or None, got {load_balance_coeff}")
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, score_func, route_norm,
                                            route_scale, gate_bias)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm)
        self.shared_experts = (FeedForward(dim, hidden_dim * num_shared_experts)
                               if num_shared_experts > 0 else None)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_before_experts = score_before_experts
        self.load_balance_coeff = load_balance_coeff
        self.register_buffer("expert_bias", torch.zeros(num_experts) if load_balance_coeff
                             is not None else None, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_scores, selected, counts, scores = self.router(x, self.expert_bias)
        self.aux_loss = load_balancing_loss(scores, selected, self.num_experts)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        # Group the tokens by expert; stable, so within an expert tokens keep their order
        # (the order the one-process reference and every EP rank agree on).
        order = torch.argsort(selected.reshape(-1), stable=True)
        sorted_scores = top_scores.reshape(-1)[order]
        routed = x[order // self.top_k]
        if self.score_before_experts:
            routed = (routed.float() * sorted_scores.unsqueeze(-1)).to(x.dtype)
        routed_out = self.experts(routed, counts)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        unsorted = torch.zeros_like(routed_out).index_copy(0, order, routed_out)
        unsorted = unsorted.reshape(-1, self.top_k, shape[-1])
        if self.score_before_experts:
            out = unsorted.sum(dim=1)
        else:
            out = torch.einsum("tk,tkd->td", top_scores, unsorted.float()).to(x.dtype)
        if shared is not None:
            out = out + shared
        return out.reshape(shape)
