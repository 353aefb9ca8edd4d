"""The expert compute of :class:`hyperpar.moe.MoE`: ``GroupedExperts`` (all routed experts as
three 3-D weights, one grouped GEMM per projection) and ``FeedForward`` (a SwiGLU MLP, the
shared experts).

``GroupedExperts`` is what a plan's ``ExpertParallel()`` entry shards: its weights are
``(num_experts, ...)`` tensors, sharded on dim 0 over the ``ep`` mesh, and it is called as
``experts(routed_input, num_tokens_per_expert)`` with the tokens sorted by expert -- the
calling convention torchtitan's ``GroupedExperts`` has, so its expert-parallel styles apply.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward", "GroupedExperts", "grouped_mm_available"]


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (torch >= 2.8; it runs on CPU in float32
    when every row stride is a multiple of 16 bytes)."""
    return hasattr(torch, "_grouped_mm")


def _local(w: torch.Tensor) -> torch.Tensor:
    # A DTensor weight (EP: Shard(0) on ep) computes on its local experts: the tokens arriving
    # after the dispatch are a ragged plain tensor that no DTensor layout describes.
    to_local = getattr(w, "to_local", None)
    return to_local() if callable(to_local) else w


def _counts(num_tokens_per_expert: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(num_tokens_per_expert, torch.Tensor):
        return [int(v) for v in num_tokens_per_expert.tolist()]
    return [int(v) for v in num_tokens_per_expert]


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts, ``out_e = w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``.

    Args:
        dim: token dimension ``D``.
        hidden_dim: each expert's hidden dimension ``H``.
        num_experts: ``E``.
        use_grouped_mm: ``True``: ``torch._grouped_mm`` (raises where this torch lacks it);
            ``False``: a loop over the experts; ``None`` (default): the grouped GEMM where torch
            has one and the shapes allow it (row strides of 16 bytes), the loop otherwise.

    Weights: ``w1``, ``w3`` of shape ``(E, H, D)``, ``w2`` of shape ``(E, D, H)``.

    ``forward(x, num_tokens_per_expert)``: ``x`` is ``(R, D)`` with its rows grouped by expert
    (``num_tokens_per_expert[e]`` rows for local expert ``e``, in expert order; a tensor or a
    list); rows past the sum (padding) come back as zeros. Under ``ExpertParallel`` the weights
    are DTensors and the forward uses their local experts.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int,
                 use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        if use_grouped_mm and not grouped_mm_available():
            raise RuntimeError(f"use_grouped_mm=True but torch {torch.__version__} has no "
                               "torch._grouped_mm; pass use_grouped_mm=None or False")
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, ``std``) weights (torchtitan uses a truncated normal of the same scale)."""
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=std)

    def forward(self, x: torch.Tensor,
                num_tokens_per_expert: torch.Tensor | Sequence[int]) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        counts = _counts(num_tokens_per_expert)
        if len(counts) != w1.shape[0]:
            raise ValueError(f"GroupedExperts: {len(counts)} token counts for {w1.shape[0]} "
                             "local experts; give one count per local expert")
        used = sum(counts)
        if used > x.shape[0]:
            raise ValueError(f"GroupedExperts: the counts add up to {used} tokens but the input "
                             f"has {x.shape[0]} rows")
        routed = x[:used]
        if self._grouped(w1, w2, x):
            out = self._grouped_mm(w1, w2, w3, routed, counts)
        else:
            out = self._loop(w1, w2, w3, routed, counts)
        if used < x.shape[0]:  # padding rows (an aligned dispatch): zeros, as torchtitan's
            out = torch.cat([out, out.new_zeros(x.shape[0] - used, out.shape[-1])])
        return out

    def _grouped(self, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        item = x.element_size()
        return (grouped_mm_available() and (w1.shape[-1] * item) % 16 == 0
                and (w1.shape[-2] * item) % 16 == 0 and w1.shape[0] > 0
                and w2.dtype == x.dtype)

    @staticmethod
    def _grouped_mm(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                    counts: list[int]) -> torch.Tensor:
        offs = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0,
                                                                               dtype=torch.int32)
        gmm = torch._grouped_mm
        h = F.silu(gmm(x, w1.transpose(-2, -1), offs=offs)) * gmm(x, w3.transpose(-2, -1),
                                                                 offs=offs)
        return gmm(h, w2.transpose(-2, -1), offs=offs)

    @staticmethod
    def _loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
              counts: list[int]) -> torch.Tensor:
        outs = []
        for e, xe in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(xe @ w1[e].transpose(0, 1)) * (xe @ w3[e].transpose(0, 1))
            outs.append(h @ w2[e].transpose(0, 1))
        if not outs:
            return x.new_zeros(0, w2.shape[1])
        return torch.cat(outs, dim=0)


class FeedForward(nn.Module):
    """A SwiGLU MLP ``w2(silu(w1(x)) * w3(x))`` (bias-free ``nn.Linear``\\ s): the shared
    experts of :class:`hyperpar.moe.MoE`, and a dense FFN; plain Linears, so the dense TP
    styles (``ColwiseParallel`` on ``w1``/``w3``, ``RowwiseParallel`` on ``w2``) apply."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
