"""DeepSpeed's Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``), ported above the Platform.

Same constructor (names, order, defaults), same gating (GShard top-1 / top-2 and DeepSpeed's
top-k with capacity, ``l_aux``, ``exp_counts``), same dense ``(experts, capacity, dim)`` dispatch
with one equal all-to-all each way over the expert-parallel group, same residual MoE. A DeepSpeed
script ports by changing ``from deepspeed.moe.layer import MoE`` to
``from hyperpar.moe.deepspeed import MoE``.

Groups follow DeepSpeed's rule (``groups._create_expert_and_data_parallel``): expert-parallel
groups of ``ep_size`` consecutive ranks, expert-data-parallel groups of the ranks ``ep_size``
apart (``use_data_before_expert_parallel_=True``: the transposed layout). DeepSpeed's engine
averages gradients; without it, call :func:`allreduce_gradients` after ``backward`` (dense
parameters averaged over the world, expert parameters summed over their expert-data-parallel
group and divided by the world size -- the engine's rule).

Random streams: ``use_rts`` (random token selection), ``noisy_gate_policy`` and
``top2_2nd_expert_sampling`` draw from torch's default generator with DeepSpeed's calls
(``torch.distributions`` ``Uniform`` / ``Gumbel`` ``rsample`` of the same shapes, in the same
order), so under the same seed they draw the same numbers DeepSpeed draws on that device.
Not ported: Tutel (``use_tutel=True`` falls back to the einsum path with a warning, as DeepSpeed
does when Tutel is not installed) and expert tensor parallelism
(``enable_expert_tensor_parallelism=True`` raises).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Experts", "MOELayer", "MoE", "TopKGate", "allreduce_gradients",
           "expert_parallel_ranks", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer", "top1gating", "top2gating",
           "topkgating"]

_log = logging.getLogger(__name__)

# group name -> (ep group, expert-data-parallel group, ep ranks, edp ranks); DeepSpeed keeps
# the same two dicts in deepspeed.utils.groups, keyed "ep_size_<n>".
_GROUPS: dict[str, tuple[Any, Any, list[int], list[int]]] = {}


def expert_parallel_ranks(world_size: int, ep_size: int,
                          use_data_before_expert_parallel_: bool = False
                          ) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's rank layout for ``ep_size`` (no tensor or pipeline parallelism): the
    expert-parallel groups and the expert-data-parallel groups, e.g. world 4, ep 2:
    ``[[0, 1], [2, 3]]`` and ``[[0, 2], [1, 3]]``."""
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world_size} "
                         "(DeepSpeed's rule); pick a divisor of the world size")
    stride = world_size // ep_size
    if use_data_before_expert_parallel_:
        edp = [list(range(i * stride, (i + 1) * stride)) for i in range(ep_size)]
        ep = [list(range(i, world_size, stride)) for i in range(stride)]
    else:
        edp = [list(range(i, world_size, ep_size)) for i in range(ep_size)]
        ep = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(stride)]
    return ep, edp


def _create_groups(ep_size: int, use_data_before_expert_parallel_: bool) -> str:
    from hyperpar.platform import get_platform

    name = f"ep_size_{ep_size}"
    if name in _GROUPS:
        return name
    platform = get_platform()
    world, rank = platform.world_size(), platform.rank()
    ep_lists, edp_lists = expert_parallel_ranks(world, ep_size, use_data_before_expert_parallel_)
    mine: dict[str, Any] = {}
    # every rank creates every group in the same order (new_group is collective)
    for kind, lists in (("edp", edp_lists), ("ep", ep_lists)):
        for ranks in lists:
            group = platform.new_group(ranks)
            if rank in ranks:
                mine[kind], mine[kind + "_ranks"] = group, ranks
    _GROUPS[name] = (mine["ep"], mine["edp"], mine["ep_ranks"], mine["edp_ranks"])
    return name


def _world(join: bool = False) -> tuple[int, int]:
    from hyperpar.dtensor.mesh import ensure_world
    from hyperpar.platform import get_platform

    platform = get_platform()
    if join:  # ep_size > 1: join the launcher's world, as meshes and PipelineModule do
        ensure_world(platform)
    if not platform.is_initialized():
        return 1, 0
    return platform.world_size(), platform.rank()


# ------------------------------------------------------------------ gating (DeepSpeed's math)
def _capacity(num_tokens: int, num_experts: int, capacity_factor: float,
              min_capacity: int) -> int:
    # DeepSpeed's float expression, ceil((tokens / experts) * factor), then the floor
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    return max(capacity, min_capacity)


def _uniform(shape: torch.Size, device: torch.device, low: float, high: float) -> Tensor:
    dist = torch.distributions.uniform.Uniform(torch.tensor(low, device=device),
                                               torch.tensor(high, device=device))
    return dist.rsample(shape)


def _gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    dist = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                             torch.tensor(1.0, device=device))
    return dist.rsample(shape)


def _max_over(value: Tensor, group: Any) -> Tensor:
    if group is None:
        return value
    from hyperpar.platform import get_platform

    out = value.clone()
    get_platform().all_reduce(out, "max", group)
    return out


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int,
               used_token: Tensor | None = None, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
               use_tutel: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GShard top-1 gating as DeepSpeed computes it; returns ``(l_aux, combine_weights (S, E,
    C), dispatch_mask (S, E, C), exp_counts (E,))``. Kept tokens per expert: the ``capacity``
    largest of ``mask * uniform`` (``use_rts``, DeepSpeed's draw) or, without it, the
    ``capacity`` earliest (DeepSpeed leaves that choice to ``topk`` among ties)."""
    if noisy_gate_policy == "RSample":
        noisy = logits + _gumbel(logits.shape, logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    indices1 = torch.argmax(noisy if noisy_gate_policy == "RSample" else gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=num_experts)
    if used_token is not None:
        mask1 = torch.einsum("s,se->se", used_token, mask1)
    exp_counts = mask1.sum(dim=0).detach()
    if not drop_tokens:
        biggest = _max_over(exp_counts.max(), ep_group)
        capacity = min(int(biggest), num_tokens)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if num_tokens < min_capacity:
        raise ValueError(f"{num_tokens} tokens but min_capacity={min_capacity}: DeepSpeed needs "
                         "at least min_capacity tokens; set min_capacity=0 or raise the batch")
    if use_rts:  # DeepSpeed's draw: the capacity largest of mask * uniform, per expert
        ranked = mask1 * _uniform(mask1.shape, logits.device, 0.0, 1.0)
        keep = torch.topk(ranked, k=capacity, dim=0)[1]
        mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, keep, 1)
    else:
        # DeepSpeed takes topk of the 0/1 mask, leaving the choice among tied tokens to the
        # kernel (on CPU not the earliest); here the earliest tokens are kept, a stated order.
        mask1 = mask1 * torch.lt(torch.cumsum(mask1, dim=0) - 1, capacity)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.float()
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None,
               top2_2nd_expert_sampling: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GShard top-2 gating as DeepSpeed computes it (capacity ``2 * capacity_factor``; first
    choices take the earliest slots of each expert, second choices the slots after all first
    choices, in token order; tokens past capacity dropped; the two kept gates renormalised)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    indices1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    indices2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = int(_max_over(exp_counts.max(), ep_group))
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    m1, m2 = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, m1)
    gates2_s = torch.einsum("se,se->s", gates, m2)
    denom = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1 = torch.einsum("s,se->se", gates1_s / denom, m1)
    gates2 = torch.einsum("s,se->se", gates2_s / denom, m2)
    combine = (torch.einsum("se,sc->sec", gates1, F.one_hot(locations1_s, capacity).float())
               + torch.einsum("se,sc->sec", gates2, F.one_hot(locations2_s, capacity).float()))
    return l_aux, combine, combine.bool(), exp_counts


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None, drop_policy: str = "probs"
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's top-k gating for ``k > 2`` (capacity ``k * capacity_factor``; ``"probs"``:
    each expert keeps its ``capacity`` highest-gate tokens, ``"position"``: the earliest)."""
    top_gate, top_idx = torch.topk(logits, k=k, dim=1)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    masked_gates = torch.zeros_like(logits).scatter(1, top_idx, top_gate)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = mask.sum(dim=0).detach()
    me = gates.mean(dim=0)
    ce = mask.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            _, keep = torch.topk(masked_gates, k=capacity, dim=0, sorted=False)
            mask = torch.logical_and(mask, torch.zeros_like(logits).scatter(0, keep, 1))
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask = mask * torch.lt(locations, capacity)
        else:
            raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    else:
        capacity = int(_max_over(exp_counts.max(), ep_group))
        locations = torch.cumsum(mask, dim=0) - 1
    gates_masked = gates * mask
    denom = torch.clamp(gates_masked.sum(dim=-1, keepdim=True),
                        min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom
    locations_sc = F.one_hot((locations * mask).long(), capacity).float()
    combine = torch.einsum("se,sec->sec", gates_masked, locations_sc)
    return l_aux, combine, combine.bool(), exp_counts


class TopKGate(nn.Module):
    """DeepSpeed's gate: a bias-free ``wg`` Linear in float32 and the gating above
    (``capacity_factor`` in training, ``eval_capacity_factor`` in eval; noise only in
    training)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group, self.k = ep_group, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown, self.gate_time = False, 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Tensor | None = None,
                use_tutel: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * _uniform(x.shape, x.device, 1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None,
                              self.drop_tokens, self.use_rts, self.ep_group, use_tutel)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens,
                              self.ep_group, self.top2_2nd_expert_sampling)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens,
                          self.ep_group)


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``; input ``(ep, local, C, M)``, each copy
    sees its ``(ep, 1, C, M)`` chunk (DeepSpeed's ``Experts``). Parameters carry DeepSpeed's
    marks ``allreduce = False`` and ``group_name``."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert)
                                               for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False
                p.group_name = expert_group_name

    def forward(self, inputs: Tensor) -> Tensor:
        outs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1),
                                 self.deepspeed_experts, strict=True):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """Gate -> ``(E, C, M)`` dispatch by einsum -> all-to-all over the ep group -> local experts
    -> all-to-all back -> combine by einsum (DeepSpeed's ``MOELayer``; GShard's algorithm 2)."""

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group, self.ep_size, self.ep_group_name = None, ep_size, ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        if use_tutel:
            _log.warning("Tutel optimization requested but not available in hyperpar. "
                         "Proceeding without Tutel.")

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _all_to_all(self, x: Tensor) -> Tensor:
        if self.ep_size == 1:
            return x
        from hyperpar.platform import get_platform

        # equal pieces along the expert dim: rank j gets experts j*local .. (j+1)*local
        return get_platform().all_to_all_single_autograd(x.contiguous(), None, None,
                                                         self.ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        d_model = input[0].shape[-1]
        tokens = input[0].reshape(-1, d_model)
        used = input[1] if len(input) > 1 else None
        self.l_aux, combine, dispatch_mask, self.exp_counts = self.gate(tokens, used)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(input[0]), tokens)
        dispatched = self._all_to_all(dispatched)
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        out = self.experts(dispatched)
        out = out.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        out = self._all_to_all(out)
        combined = torch.einsum("sec,ecm->sm", combine.type_as(input[0]), out)
        return combined.reshape(input[0].shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``, same arguments and defaults.

    Args:
        hidden_size: input and output dimension.
        expert: the module each expert copies (e.g. an MLP).
        num_experts: experts in the layer (divisible by ``ep_size``).
        ep_size: ranks in one expert-parallel group (divides the world size).
        k: experts per token (1 and 2: GShard gating; more: DeepSpeed's top-k gating).
        capacity_factor, eval_capacity_factor, min_capacity: expert capacity
            ``max(ceil(tokens / experts * factor * (k if k > 1)), min_capacity)`` per rank.
        use_residual: Residual MoE (the dense ``expert`` plus a learned 2-way mix).
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"`` (top-1 only, training only).
        drop_tokens: drop tokens past capacity (``False``: capacity = the largest expert count
            over the ep group).
        use_rts: random token selection (top-1).
        use_tutel: accepted; hyperpar has no Tutel path (a warning, as DeepSpeed without it).
        enable_expert_tensor_parallelism: not supported here (raises).
        top2_2nd_expert_sampling: Gumbel noise on the second choice (top-2).

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``.
    The expert-parallel groups are created on the first forward (or by
    :meth:`set_deepspeed_parallelism`, DeepSpeed's engine hook).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"Number of experts ({num_experts}) should be divisible by expert "
                             f"parallel size ({ep_size})")
        if k < 1 or k > num_experts:
            raise ValueError(f"k={k} must lie in 1..num_experts={num_experts}")
        if capacity_factor <= 0 or eval_capacity_factor <= 0:
            raise ValueError(f"capacity_factor ({capacity_factor}) and eval_capacity_factor "
                             f"({eval_capacity_factor}) must be > 0; use drop_tokens=False "
                             "for no capacity limit")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy}")
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "enable_expert_tensor_parallelism=True is not supported by hyperpar's DeepSpeed "
                "MoE; shard experts over tp with hyperpar.moe.MoE and ExpertTensorParallel()")
        world, _ = _world(join=ep_size > 1)
        if world % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide the world size {world} "
                             "(DeepSpeed's rule); pick a divisor of the world size")
        self.use_residual, self.enable_expert_tensor_parallelism = use_residual, False
        self.ep_size, self.expert_group_name = ep_size, f"ep_size_{ep_size}"
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        _log.info("Creating MoE layer with num_experts: %d | num_local_experts: %d | "
                  "expert_parallel_size: %d", num_experts, self.num_local_experts, ep_size)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                        min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                        top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size,
                                      self.num_local_experts, use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (once per ``ep_size``) and attach the expert-parallel groups."""
        self._create_process_groups(use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.ep_size == 1 and _world()[0] == 1:
            self.deepspeed_moe._set_ep_group(None)
            return
        name = _create_groups(self.ep_size, use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(_GROUPS[name][0] if self.ep_size > 1 else None)
        self._groups_ready = True

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        if not getattr(self, "_groups_ready", False) and (self.ep_size > 1 or _world()[0] > 1):
            self._create_process_groups()
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def is_moe_param(param: Tensor) -> bool:
    """DeepSpeed's test: an expert parameter carries ``allreduce = False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict | list, max_group_size: int | None = None) -> list[dict]:
    """DeepSpeed's helper: every param group split into its dense parameters and one group per
    expert group name (``"moe": True``, ``"name": <group name>``)."""
    del max_group_size  # DeepSpeed's bucket limit; one group per name here
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    out: list[dict] = []
    for group in groups:
        params = list(group["params"])
        dense = dict(group, params=[p for p in params if not is_moe_param(p)])
        out.append(dense)
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        for name, ps in by_name.items():
            out.append(dict(group, params=ps, moe=True, name=name))
    return out


@torch.no_grad()
def allreduce_gradients(model: nn.Module) -> None:
    """What DeepSpeed's engine does after ``backward``: dense gradients averaged over the world,
    expert gradients summed over their expert-data-parallel group and divided by the world
    size (so an expert's gradient does not depend on ``ep_size``)."""
    from hyperpar.platform import get_platform

    platform = get_platform()
    world = platform.world_size() if platform.is_initialized() else 1
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is None:
            continue
        if is_moe_param(p):
            platform.all_reduce(p.grad, "sum", _GROUPS[p.group_name][1])
            p.grad.div_(world)
        else:
            platform.all_reduce(p.grad, "avg", None)
