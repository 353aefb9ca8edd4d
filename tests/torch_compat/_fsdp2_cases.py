"""FSDP2 compatibility cases: each is one script body ``case(api, n)`` written against the names
of ``torch.distributed.fsdp`` / ``torch.distributed.tensor(.parallel)``; it runs once with torch's
own API and once with hyperpar's (only the imports differ) on every rank, and returns what a
user would look at: the loss of every step, every gradient before the first optimizer step
(the strict check: AdamW would amplify rounding), the parameters after the last step, and
placements. ``test_fsdp2_compat.py`` compares the two runs.

Modelled on behaviours PyTorch's own FSDP2 tests check (test_fully_shard_frozen.py,
test_fully_shard_init.py, test_fully_shard_training.py, test_fully_shard_comm.py) -- written
afresh here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DEVICE = "cpu"
STEPS, BATCH, LR = 3, 8, 1e-2
CASES: dict[str, Callable[[Any, int], Any]] = {}

FSDP_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
              "CPUOffloadPolicy", "register_fsdp_forward_method")


def fsdp2_api(name: str) -> SimpleNamespace:
    """The FSDP2 names plus the TP/DTensor ones, from torch or from hyperpar."""
    from _apis import api_named

    api = api_named(name)
    if name == "torch":
        mod = importlib.import_module("torch.distributed.fsdp")
        for n in FSDP_NAMES:
            setattr(api, n, getattr(mod, n))
    else:
        import hyperpar

        for n in FSDP_NAMES:
            setattr(api, n, getattr(hyperpar, n))
    return api


def case(fn: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


# ----------------------------------------------------------------------------- models
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(tokens))))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def seeded(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls()


# ----------------------------------------------------------------------------- helpers
def full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def placements(p: Any) -> Any:
    if not hasattr(p, "placements"):
        return None
    out = []
    for pl in p.placements:
        kind = type(pl).__name__
        out.append(f"S({pl.dim})" if kind == "Shard" else "R" if kind == "Replicate" else kind)
    return tuple(out)


def batch(step: int, tied: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if tied:
        return (torch.randint(0, 12, (BATCH, 3), generator=g),
                torch.randint(0, 12, (BATCH, 3), generator=g))
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 4, generator=g)


def train(model: nn.Module, dp_rank: int, dp_size: int, *, tied: bool = False) -> dict:
    """AdamW on this dp rank's rows: losses, grads before the first step, final params."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    per = BATCH // dp_size
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batch(step, tied)
        out = model(x[rows])
        loss = (F.cross_entropy(out.flatten(0, 1), y[rows].flatten()) if tied
                else F.mse_loss(out, y[rows]))
        loss.backward()
        losses.append(torch.tensor(loss.item()))
        if step == 0:
            grads = {n: None if p.grad is None else full(p.grad)
                     for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: full(p) for n, p in model.named_parameters()}}


def world_rank() -> int:
    return torch.distributed.get_rank()


# ----------------------------------------------------------------------------- cases
@case
def case_plain(api: Any, n: int) -> Any:
    model = seeded(Net)
    api.fully_shard(model.inp)
    api.fully_shard(model)
    return train(model, world_rank(), n)


@case
def case_list_group(api: Any, n: int) -> Any:
    model = seeded(Net)
    api.fully_shard([model.norm, model.out])
    api.fully_shard(model)
    return train(model, world_rank(), n)


@case
def case_shard_placement_fn(api: Any, n: int) -> Any:
    model = seeded(Net)
    # torch refuses uneven shards on a dim other than 0: dim 1 only where it divides
    api.fully_shard(model, shard_placement_fn=lambda p: (
        api.Shard(1) if p.ndim == 2 and p.shape[1] % n == 0 else None))
    res = train(model, world_rank(), n)
    res["placements"] = {k: placements(p) for k, p in model.named_parameters()}
    return res


@case
def case_ignored_params(api: Any, n: int) -> Any:
    model = seeded(Net)
    api.fully_shard(model, ignored_params={model.out.bias})
    res = train(model, world_rank(), n)
    res["placements"] = {k: placements(p) for k, p in model.named_parameters()}
    return res


@case
def case_frozen_submodule(api: Any, n: int) -> Any:
    model = seeded(Net)
    model.norm.requires_grad_(False)
    api.fully_shard(model.inp)
    api.fully_shard(model)
    return train(model, world_rank(), n)


@case
def case_frozen_unit(api: Any, n: int) -> Any:
    model = seeded(Net)
    model.norm.requires_grad_(False)
    api.fully_shard(model.norm)
    api.fully_shard(model.out)
    api.fully_shard(model)
    return train(model, world_rank(), n)


@case
def case_freeze_after_shard(api: Any, n: int) -> Any:
    """``requires_grad_(False)`` after fully_shard, before the optimizer is built."""
    model = seeded(Net)
    api.fully_shard(model.out)
    api.fully_shard(model)
    model.out.requires_grad_(False)
    return train(model, world_rank(), n)


@case
def case_tied_in_one_unit(api: Any, n: int) -> Any:
    model = seeded(Tied)
    api.fully_shard(model.mid)
    api.fully_shard(model)
    res = train(model, world_rank(), n, tied=True)
    res["still_tied"] = model.head.weight is model.emb.weight
    return res


@case
def case_meta_init(api: Any, n: int) -> Any:
    """torchtitan's path: meta, fully_shard, to_empty, reset_parameters. The values drawn
    differ by design (torch's CPU DTensor repeats one stream on every rank, hyperpar draws
    each rank's piece of the whole tensor), so the case checks the init ran and kept its
    bounds, then loads the same values in both and trains."""
    with torch.device("meta"):
        model = Net()
    api.fully_shard(model.inp)
    api.fully_shard(model)
    model.to_empty(device=DEVICE)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    in_bounds = {
        "inp.weight": bool(full(model.inp.weight).abs().max() <= 6 ** -0.5),
        "out.weight": bool(full(model.out.weight).abs().max() <= 12 ** -0.5),
        "norm.weight": bool((full(model.norm.weight) == 1).all())}
    ref = seeded(Net).state_dict()
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(api.distribute_tensor(ref[k], p.device_mesh, p.placements))
    res = train(model, world_rank(), n)
    res["in_bounds"] = in_bounds
    return res


@case
def case_hsdp(api: Any, n: int) -> Any:
    mesh = api.init_device_mesh(DEVICE, (2, n // 2), mesh_dim_names=("replicate", "shard"))
    model = seeded(Net)
    api.fully_shard(model.inp, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    res = train(model, world_rank(), n)
    res["placements"] = {k: placements(p) for k, p in model.named_parameters()}
    return res


@case
def case_dp_tp(api: Any, n: int) -> Any:
    mesh = api.init_device_mesh(DEVICE, (2, n // 2), mesh_dim_names=("dp", "tp"))
    model = seeded(MLP)
    api.parallelize_module(model, mesh["tp"], {"up": api.ColwiseParallel(),
                                               "down": api.RowwiseParallel()})
    api.fully_shard(model, mesh=mesh["dp"])
    res = train(model, mesh["dp"].get_local_rank(), 2)
    # a colwise weight is split twice on dim 0 (torch: _StridedShard): compared by value only
    w = model.down.weight
    res["rowwise"] = {"placements": placements(w), "mesh": tuple(w.device_mesh.mesh_dim_names)}
    return res


def _dp_tp_clip(api: Any, dp_mesh: Any, tp_mesh: Any) -> Any:
    """FSDP2 x TP as torchtitan does it: every parameter on the one (dp, tp) mesh, so
    ``clip_grad_norm_`` stacks the per-parameter norms; trains with clipping each step."""
    model = seeded(MLP)
    api.parallelize_module(model, tp_mesh, {"up": api.ColwiseParallel(),
                                            "down": api.RowwiseParallel()})
    api.fully_shard(model, mesh=dp_mesh)
    # torch writes a colwise weight split twice on dim 0 as _StridedShard on ("dp", "tp"):
    # its local shapes and values are compared, its mesh is a known difference
    layout = {k: {"mesh": tuple(p.device_mesh.mesh_dim_names),
                  "ranks": p.device_mesh.mesh.tolist(),
                  "placements": placements(p)}
              for k, p in model.named_parameters() if k.startswith("down.")}
    local_shapes = {k: tuple(p.to_local().shape) for k, p in model.named_parameters()}
    colwise_mesh = {k: tuple(p.device_mesh.mesh_dim_names)
                    for k, p in model.named_parameters() if k.startswith("up.")}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    per = BATCH // dp_size
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        losses.append(torch.tensor(loss.item()))
        if step == 0:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        norms.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "layout": layout, "local_shapes": local_shapes,
            "colwise_mesh": colwise_mesh, "grads": grads,
            "params": {k: full(p) for k, p in model.named_parameters()}}


@case
def case_dp_tp_clip_grad_norm(api: Any, n: int) -> Any:
    mesh = api.init_device_mesh(DEVICE, (n // 2, 2), mesh_dim_names=("dp", "tp"))
    return _dp_tp_clip(api, mesh["dp"], mesh["tp"])


@case
def case_root_reshard_true(api: Any, n: int) -> Any:
    model = seeded(Net)
    api.fully_shard(model.inp)
    api.fully_shard(model, reshard_after_forward=True)
    model(torch.randn(2, 6)).sum().backward()
    out = model(torch.randn(2, 6))
    sharded = hasattr(model.out.weight, "placements")
    out.sum().backward()
    return sharded


@case
def case_root_reshard_default(api: Any, n: int) -> Any:
    model = seeded(Net)
    api.fully_shard(model.inp)
    api.fully_shard(model)
    model(torch.randn(2, 6)).sum().backward()
    out = model(torch.randn(2, 6))
    sharded = hasattr(model.out.weight, "placements")
    out.sum().backward()
    return sharded


@case
def case_forward_method(api: Any, n: int) -> Any:
    class WithGenerate(Net):
        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.norm(self.inp(x)))) * 2

    torch.manual_seed(0)
    model = WithGenerate()
    api.fully_shard(model)
    api.register_fsdp_forward_method(model, "generate")
    with torch.no_grad():
        y = model.generate(torch.ones(2, 6))
    return {"y": y, "sharded_after": hasattr(model.out.weight, "placements")}


@case
def case_unused_param_grad_none(api: Any, n: int) -> Any:
    """A parameter the unit's forward method never used keeps grad None (AdamW's weight decay
    then leaves it alone; a zero gradient would move it)."""
    class WithExtra(Net):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(4, 4)

        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.norm(self.inp(x))))

    torch.manual_seed(0)
    model = WithExtra()
    api.fully_shard(model.inp)
    api.fully_shard(model)
    api.register_fsdp_forward_method(model, "generate")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    per = BATCH // n
    rows = slice(world_rank() * per, (world_rank() + 1) * per)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model.generate(x[rows]), y[rows])
        loss.backward()
        losses.append(torch.tensor(loss.item()))
        if step == 0:
            grads = {k: None if p.grad is None else full(p.grad)
                     for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {k: full(p) for k, p in model.named_parameters()}}


@case
def case_fsdp_module_methods(api: Any, n: int) -> Any:
    """Every public method of torch's FSDPModule exists (hyperpar's also has nn.Module's,
    ``sync_gradients`` and ``set_implicit_prefetch``)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    return {m: hasattr(api.FSDPModule, m) for m in dir(TorchFSDPModule)
            if not m.startswith("_")}


@case
def case_error_reshard_after_forward_string(api: Any, n: int) -> Any:
    return api.fully_shard(seeded(Net), reshard_after_forward="no")


@case
def case_error_fully_shard_twice(api: Any, n: int) -> Any:
    model = seeded(Net)
    api.fully_shard(model)
    return api.fully_shard(model)


# ----------------------------------------------------------------------------- runner
def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return tuple(_plain(v) for v in x)
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return f"<{type(x).__name__}>"


def run_fsdp2_cases(names: list[str], n: int | None = None) -> dict[str, dict[str, Any]]:
    """On every rank: each case with both APIs (see ``_cases.run_side_by_side``)."""
    from _cases import run_side_by_side

    apis = {name: fsdp2_api(name) for name in ("torch", "hyperpar")}
    return run_side_by_side(CASES, apis, names, n, plain=_plain)
