"""Token-choice top-k routing for :class:`hyperpar.moe.MoE`, the switch load-balancing loss and
DeepSeek-V3's auxiliary-loss-free expert-bias update.

The router is a replicated ``nn.Linear`` gate: under expert parallelism every rank routes its
own tokens, so nothing here communicates except :func:`update_expert_bias` (one all-reduce of
the token counts over the data-parallel group, when one is given).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

ScoreFunc = Literal["softmax", "sigmoid"]


class RouterNaNError(ValueError):
    """The router's scores contain NaN (the gate's input or weights are NaN): routing on them
    would send tokens to arbitrary experts, so the forward stops here instead."""


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts by ``score_func(gate(x))``.

    Args:
        dim: the token (model) dimension.
        num_experts: routed experts in the layer.
        top_k: experts per token (``1 <= top_k <= num_experts``).
        score_func: ``"softmax"`` over the experts or an independent ``"sigmoid"`` per expert
            (DeepSeek-V3), computed in float32.
        route_norm: divide each token's ``top_k`` scores by their sum.
        route_scale: multiply the final scores by this constant.
        gate_bias: give the gate ``nn.Linear`` a bias.

    ``forward(x, expert_bias=None)`` takes ``x`` of shape ``(tokens, dim)`` and returns
    ``(top_scores, selected_experts, num_tokens_per_expert, scores)``: ``(tokens, top_k)``
    float32 scores and int64 expert ids, the ``(num_experts,)`` histogram of the ids (float32,
    as torchtitan's ``histc``) and the full ``(tokens, num_experts)`` scores (for the
    load-balancing loss). ``expert_bias`` (DeepSeek-V3) shifts the choice only; the returned
    scores are the unbiased ones. Ties between equal scores go to the lower expert id.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int = 1,
                 score_func: ScoreFunc = "softmax", route_norm: bool = False,
                 route_scale: float = 1.0, gate_bias: bool = False) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must lie in 1..num_experts={num_experts}: a token "
                             "cannot choose more experts than the layer has")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()  # float32 routing: small score gaps decide the expert
        if self.score_func == "softmax":
            scores = F.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        if bool(torch.isnan(scores).any()):
            raise RouterNaNError(
                f"router scores contain NaN ({int(torch.isnan(scores).any(-1).sum())} of "
                f"{scores.shape[0]} tokens): the gate's input or weight is NaN; check the layer "
                "before the MoE and the learning rate")
        choice = scores if expert_bias is None else scores + expert_bias
        # sorted topk: the same ids in the same order on every rank and in the reference
        _, selected = torch.topk(choice, k=self.top_k, dim=-1, sorted=True)
        top_scores = scores.gather(-1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = torch.histc(selected.reshape(-1).float(), bins=self.num_experts,
                             min=0, max=self.num_experts)
        return top_scores, selected, counts, scores

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, ``std``) gate weight, zero bias."""
        nn.init.normal_(self.gate.weight, std=std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)


def load_balancing_loss(scores: torch.Tensor, selected_experts: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """The Switch Transformer auxiliary loss, generalised to top-k:
    ``num_experts * sum_e f_e * P_e`` with ``f_e`` the share of the ``tokens * top_k``
    assignments that went to expert ``e`` and ``P_e`` the mean score of ``e`` over the tokens.
    It is 1 for perfectly uniform routing. Computed on the tokens given (one rank's, under data
    or expert parallelism, as DeepSpeed and torchtitan do); differentiable through ``scores``."""
    counts = torch.bincount(selected_experts.reshape(-1), minlength=num_experts)
    f = counts.to(scores.dtype) / selected_experts.numel()
    p = scores.mean(dim=0)
    return num_experts * torch.sum(f * p)


@torch.no_grad()
def update_expert_bias(modules: nn.Module | Iterable[nn.Module], group: Any = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, torchtitan's rule: for every MoE layer
    with ``load_balance_coeff`` set, sum its ``tokens_per_expert`` over ``group`` (the
    data-parallel ranks: pass ``mesh.get_group("dp")`` or a process group; ``None``: local
    counts only), then ``expert_bias += coeff * sign(mean - counts)`` centred to mean zero,
    and reset the counts. Call it once per optimizer step (e.g. as a step pre-hook:
    ``opt.register_step_pre_hook(lambda *_: update_expert_bias(model, group))``), so gradient
    accumulation counts every microbatch."""
    from hyperpar.platform import get_platform

    layers = modules.modules() if isinstance(modules, nn.Module) else modules
    for layer in layers:
        coeff = getattr(layer, "load_balance_coeff", None)
        bias = getattr(layer, "expert_bias", None)
        if coeff is None or bias is None:
            continue
        counts = layer.tokens_per_expert
        if group is not None:
            get_platform().all_reduce(counts, "sum", group)
        delta = coeff * torch.sign(counts.mean() - counts)
        bias.add_(delta - delta.mean())
        counts.zero_()
