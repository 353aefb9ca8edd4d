"""Plain-torch MoE written token by token: the one-process reference of the MoE tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference_moe(x, gate_w, w1, w2, w3, shared, top_k, score_func="softmax", before=True):
    """Every token through its top-k experts (ties: lower id), one token at a time."""
    out = []
    for t in range(x.shape[0]):
        logits = x[t] @ gate_w.T
        scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        chosen = sorted(range(len(scores)), key=lambda e: -float(scores[e].detach()))[:top_k]
        y = torch.zeros(x.shape[1])
        for e in chosen:
            if before:
                y = y + swiglu(scores[e] * x[t:t + 1], w1[e], w2[e], w3[e])[0]
            else:
                y = y + scores[e] * swiglu(x[t:t + 1], w1[e], w2[e], w3[e])[0]
        if shared is not None:
            y = y + swiglu(x[t:t + 1], *shared)[0]
        out.append(y)
    return torch.stack(out)


def reference_moe_params(p: dict, x: torch.Tensor, prefix: str, top_k: int) -> torch.Tensor:
    """``reference_moe`` over the weights of a ``hyperpar.moe.MoE`` named ``prefix`` in ``p``
    (softmax scores, weighted before the experts, one shared expert)."""
    shared = [p[f"{prefix}shared_experts.{w}.weight"] for w in ("w1", "w2", "w3")]
    return reference_moe(x, p[f"{prefix}router.gate.weight"], p[f"{prefix}experts.w1"],
                         p[f"{prefix}experts.w2"], p[f"{prefix}experts.w3"], shared, top_k)
