"""torchtitan-style cases (issue 31 B): the DeviceMesh and DTensor calls torchtitan's llama3
path makes, each written once against torch's names and run with torch's own DTensor and with
hyperpar's (only the imports differ; see ``test_titan_compat.py``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from _cases import full, norm

CASES: dict[str, Callable[[Any, int], Any]] = {}


def case(fn: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def titan_api(name: str) -> SimpleNamespace:
    """torch's or hyperpar's: the mesh, DTensor basics, ``local_map`` and functional
    collectives, from where a torchtitan script imports them."""
    if name == "torch":
        tensor = importlib.import_module("torch.distributed.tensor")
        return SimpleNamespace(
            name="torch",
            init_device_mesh=importlib.import_module(
                "torch.distributed.device_mesh").init_device_mesh,
            distribute_tensor=tensor.distribute_tensor, Shard=tensor.Shard,
            Replicate=tensor.Replicate, Partial=tensor.Partial,
            local_map=importlib.import_module(
                "torch.distributed.tensor.experimental").local_map,
            distribute_module=tensor.distribute_module,
            funcol=importlib.import_module("torch.distributed._functional_collectives"))
    import hyperpar

    return SimpleNamespace(
        name="hyperpar", init_device_mesh=hyperpar.init_device_mesh,
        distribute_tensor=hyperpar.distribute_tensor, Shard=hyperpar.Shard,
        Replicate=hyperpar.Replicate, Partial=hyperpar.Partial,
        local_map=importlib.import_module("hyperpar.dtensor.experimental").local_map,
        distribute_module=hyperpar.distribute_module,
        funcol=importlib.import_module("hyperpar.dtensor.functional_collectives"))


def _world(api: Any, n: int) -> Any:
    return api.init_device_mesh("cpu", (n,), mesh_dim_names=("world",))


@case
def case_unflatten_meshes(api: Any, n: int) -> Any:
    """ParallelDims: several unflattenings of the world mesh, sliced and flattened."""
    world = _world(api, n)
    dense = world._unflatten(0, (n // 2, 2), ("dp", "tp"))
    loader = world._unflatten(0, (n // 2, 2), ("batch", "tp"))
    flat = dense["dp", "tp"]._flatten("dp_tp")
    torch.manual_seed(0)
    t = torch.randn(4, 6)
    a = api.distribute_tensor(t, dense["tp"], [api.Shard(0)])
    b = api.distribute_tensor(t, loader["tp"], [api.Shard(0)])
    return {"dense": (dense.mesh.tolist(), dense.mesh_dim_names, dense.get_coordinate()),
            "tp": dense["tp"].mesh.tolist(), "dp": dense["dp"].mesh.tolist(),
            "dp_tp": flat.mesh.tolist(), "same": dense["tp"] == loader["tp"],
            "sizes": (dense.size(), dense["tp"].size(), dense.get_local_rank("tp")),
            "sum": full(a + b)}


@case
def case_functional_all_reduce(api: Any, n: int) -> Any:
    """torchtitan's dist_max / dist_mean / dist_sum over a mesh."""
    mesh = _world(api, n)
    x = torch.tensor([1.0, 2.0]) * (mesh.get_rank() + 1)
    return {op: api.funcol.wait_tensor(api.funcol.all_reduce(x, op, group=mesh))
            for op in ("sum", "max", "min", "avg")}


@case
def case_functional_collectives_autograd(api: Any, n: int) -> Any:
    """The gradient through each funcol collective torch differentiates on every supported
    version (torchtitan's token dispatch: ``all_to_all_single`` with uneven splits), and the
    backward error of one it does not (``max``). ``avg`` and ``broadcast`` are left out: torch
    2.13 raises on ``avg`` and torch's ``broadcast`` gradient is the local identity (see
    docs/dtensor.md); tests/dtensor/test_funcol_autograd.py checks hyperpar's adjoints."""
    mesh = _world(api, n)
    f = api.funcol
    r = mesh.get_rank()
    sends = [(r + j) % 3 + 1 for j in range(n)]     # rows this rank sends to rank j
    recvs = [(j + r) % 3 + 1 for j in range(n)]     # rows rank j sends here
    ops = {
        "all_reduce_sum": lambda x: f.all_reduce(x, "sum", mesh),
        "all_gather_tensor_0": lambda x: f.all_gather_tensor(x, 0, mesh),
        "all_gather_tensor_1": lambda x: f.all_gather_tensor(x, 1, mesh),
        "all_gather_tensor_autograd": lambda x: f.all_gather_tensor_autograd(x, 0, mesh),
        "reduce_scatter_tensor_0": lambda x: f.reduce_scatter_tensor(x[: 2 * n], "sum", 0, mesh),
        "reduce_scatter_tensor_1": lambda x: f.reduce_scatter_tensor(
            x[:, :2].repeat(1, n), "sum", 1, mesh),
        "reduce_scatter_tensor_autograd": lambda x: f.reduce_scatter_tensor_autograd(
            x[: 2 * n], "sum", 0, mesh),
        "all_to_all_single": lambda x: f.all_to_all_single(x[: sum(sends)], recvs, sends, mesh),
        "all_to_all_single_autograd": lambda x: f.all_to_all_single_autograd(
            x[: sum(sends)], recvs, sends, mesh),
        "all_to_all_single_even": lambda x: f.all_to_all_single(x[: 2 * n], None, None, mesh),
        "wait_tensor": lambda x: f.wait_tensor(x * 2),
        "all_reduce_max": lambda x: f.all_reduce(x, "max", mesh),
    }
    out = {}
    for name, op in ops.items():
        torch.manual_seed(r)
        x = torch.randn(3 * n, 3, requires_grad=True)
        y = f.wait_tensor(op(x))
        torch.manual_seed(50 + r)
        try:
            (torch.randn(y.shape) * y).sum().backward()
            out[name] = {"out": y.detach().clone(), "grad": x.grad}
        except RuntimeError:
            out[name] = {"out": y.detach().clone(), "backward": "raises RuntimeError"}
    return out


class _GroupedExperts(torch.nn.Module):
    """torchtitan's GroupedExperts in miniature: ``forward(x, num_tokens_per_expert)`` with the
    tokens sorted by (local) expert, a per-expert loop on the local weights."""

    def __init__(self, experts: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(experts, dim, dim) * 0.3)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w = self.w.to_local() if hasattr(self.w, "to_local") else self.w
        pieces = x.split(counts.tolist())
        return torch.cat([torch.tanh(p @ w[e]) for e, p in enumerate(pieces)])


def _expert_parallel(api: Any, module: torch.nn.Module, mesh: Any) -> None:
    """torchtitan's ``ExpertParallel._apply``: experts Shard(0), tokens dispatched before and
    combined after the module through funcol's uneven all-to-all."""
    f = api.funcol
    n = mesh.size()

    def partition(name: str, mod: torch.nn.Module, device_mesh: Any) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, torch.nn.Parameter(
                api.distribute_tensor(param, device_mesh, [api.Shard(0)])))

    def dispatch(mod: torch.nn.Module, inputs: Any, device_mesh: Any) -> Any:
        x, counts = inputs
        got = f.wait_tensor(f.all_to_all_single(counts, None, None, device_mesh))
        sends = counts.view(n, -1).sum(1).tolist()
        recvs = got.view(n, -1).sum(1).tolist()
        routed = f.all_to_all_single_autograd(x, recvs, sends, device_mesh)
        # arrived grouped by source rank, then local expert: regroup by local expert
        per = got.view(n, -1).tolist()
        starts, at = [], 0
        for row in per:
            starts.append([])
            for c in row:
                starts[-1].append(at)
                at += c
        order = [i for e in range(len(per[0])) for src in range(n)
                 for i in range(starts[src][e], starts[src][e] + per[src][e])]
        mod._ep = (sends, recvs, order)
        return routed[torch.tensor(order, dtype=torch.long)], got.view(n, -1).sum(0)

    def combine(mod: torch.nn.Module, out: torch.Tensor, device_mesh: Any) -> torch.Tensor:
        sends, recvs, order = mod._ep
        back = torch.empty_like(out)
        back[torch.tensor(order, dtype=torch.long)] = out
        return f.all_to_all_single_autograd(back, sends, recvs, device_mesh)

    api.distribute_module(module, mesh, partition, dispatch, combine)


@case
def case_distribute_module_expert_parallel(api: Any, n: int) -> Any:
    """torchtitan's expert_parallel.py pattern: distribute_module with partition_fn (experts
    Shard(0) on ep), input_fn (token dispatch) and output_fn (combine); outputs and the
    gradients of the tokens and of every expert."""
    mesh = _world(api, n)
    r = mesh.get_rank()
    experts = 2 * n
    module = _GroupedExperts(experts, 4)
    _expert_parallel(api, module, mesh)
    counts = torch.tensor([(r + 2 * e) % 3 for e in range(experts)], dtype=torch.int64)
    torch.manual_seed(10 + r)
    x = torch.randn(int(counts.sum()), 4, requires_grad=True)
    y = module(x, counts)
    torch.manual_seed(20 + r)
    (torch.randn(y.shape) * y).sum().backward()
    return {"out": y.detach().clone(), "x_grad": x.grad, "w_grad": full(module.w.grad),
            "w_placements": norm(module.w.placements)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _steps(api: Any, n: int, **opt_kwargs: Any) -> Any:
    mesh = _world(api, n)
    model = _model()
    for mod in (model[0], model[2]):
        mod.weight = torch.nn.Parameter(api.distribute_tensor(mod.weight.detach(), mesh,
                                                              [api.Shard(0)]))
        mod.bias = torch.nn.Parameter(api.distribute_tensor(mod.bias.detach(), mesh,
                                                            [api.Replicate()]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **opt_kwargs)
    torch.manual_seed(1)
    norms = []
    for _ in range(2):
        x = api.distribute_tensor(torch.randn(5, 6), mesh, [api.Replicate()])
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        norms.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5,
                                                         foreach=True)))
        opt.step()
    return {"norms": norms, "params": [full(p) for p in model.parameters()]}


@case
def case_adamw_foreach_clip(api: Any, n: int) -> Any:
    """Default (foreach) AdamW after foreach gradient clipping, on sharded parameters."""
    return _steps(api, n, foreach=True)


@case
def case_adamw_fused_clip(api: Any, n: int) -> Any:
    """AdamW(fused=True) after foreach gradient clipping."""
    return _steps(api, n, fused=True)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@case
def case_local_map(api: Any, n: int) -> Any:
    """A local kernel on row shards; the replicated weight's gradient comes back Partial."""
    mesh = _world(api, n)
    torch.manual_seed(0)
    x = api.distribute_tensor(torch.randn(4, 6), mesh, [api.Shard(0)]).requires_grad_()
    w = api.distribute_tensor(torch.randn(6), mesh, [api.Replicate()]).requires_grad_()
    fn = api.local_map(_rms, out_placements=[api.Shard(0)],
                       in_placements=([api.Shard(0)], [api.Replicate()]),
                       in_grad_placements=([api.Shard(0)], [api.Partial()]), device_mesh=mesh)
    y = fn(x, w)
    y.sum().backward()
    return {"y": full(y), "gx": full(x.grad), "gw": full(w.grad)}


@case
def case_rope_complex_gather(api: Any, n: int) -> Any:
    """Rotary embedding through view_as_complex / view_as_real, then gather."""
    mesh = _world(api, n)
    torch.manual_seed(0)
    x = api.distribute_tensor(torch.randn(4, 8), mesh, [api.Shard(0)]).requires_grad_()
    freqs = api.distribute_tensor(torch.polar(torch.ones(4, 4), torch.randn(4, 4)), mesh,
                                  [api.Shard(0)])
    idx = api.distribute_tensor(torch.randint(0, 8, (4, 5)), mesh, [api.Shard(0)])
    xc = torch.view_as_complex(x.reshape(4, 4, 2))
    y = torch.gather(torch.view_as_real(xc * freqs).flatten(-2), 1, idx)
    (y * y).sum().backward()
    return {"y": full(y), "gx": full(x.grad)}


@case
def case_to_empty(api: Any, n: int) -> Any:
    """Meta-device init: DTensor parameters materialised by Module.to_empty."""
    mesh = _world(api, n)
    with torch.device("meta"):
        model = torch.nn.Linear(6, 4)
    model.weight = torch.nn.Parameter(api.distribute_tensor(model.weight, mesh,
                                                            [api.Shard(0)]))
    model.bias = torch.nn.Parameter(api.distribute_tensor(model.bias, mesh,
                                                          [api.Replicate()]))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.weight.fill_(0.25)
        model.bias.fill_(0.5)
    x = api.distribute_tensor(torch.ones(3, 6), mesh, [api.Replicate()])
    model(x).sum().backward()
    return {"device": (model.weight.device.type, model.weight.to_local().device.type),
            "grad": full(model.weight.grad)}


def run_titan_cases(names: list[str], n: int | None = None) -> dict[str, dict[str, Any]]:
    """On every rank: each case with torch's API and with hyperpar's."""
    from _cases import run_side_by_side

    apis = {name: titan_api(name) for name in ("torch", "hyperpar")}
    return run_side_by_side(CASES, apis, names, n)
