"""Compatibility cases: each is one script body ``case(api, n)`` written against the names of
``torch.distributed.tensor(.parallel)``; it runs once with torch's own API and once with
hyperpar's (see ``_apis.py``) on every rank, and returns what a user would look at (outputs,
every gradient, placements, or the fact that it raised). The test compares the two runs.

Modelled on the behaviours PyTorch's own tests check (test_parallelize_api.py, test_tp_style.py,
test_tp_examples.py, test_redistribute.py, loss_parallel tests) -- written afresh here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DEVICE = "cpu"  # the suite runs on gloo: torch's own DTensor runs there too
CASES: dict[str, Callable[[Any, int], Any]] = {}


def case(fn: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


# ----------------------------------------------------------------------------- helpers
def norm(x: Any) -> Any:
    """Placements and containers of them as comparable values (``S(0)``, ``R``, ``P(sum)``)."""
    kind = type(x).__name__
    if kind == "Shard" and hasattr(x, "dim"):
        return f"S({x.dim})"
    if kind == "Replicate":
        return "R"
    if kind == "Partial":
        return f"P({x.reduce_op})"
    if isinstance(x, tuple | list):
        return tuple(norm(v) for v in x)
    if isinstance(x, dict):
        return {k: norm(v) for k, v in x.items()}
    return x


def snap(x: Any) -> Any:
    """What a user sees of a result: a DTensor's placements, local shard and full value; a
    tensor's value (detached copies)."""
    if hasattr(x, "full_tensor"):
        return {"placements": norm(x.placements), "shape": tuple(x.shape),
                "local": x.to_local().detach().clone(),
                "full": x.full_tensor().detach().clone()}
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple | list):
        return tuple(snap(v) for v in x)
    return x


def full(x: Any) -> torch.Tensor:
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()


def params_and_grads(model: nn.Module) -> dict[str, Any]:
    """Every parameter's placements, full value and full gradient."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = {"placements": norm(getattr(p, "placements", None)), "value": full(p),
                     "grad": None if p.grad is None else full(p.grad)}
    return out


def tp_mesh(api: Any, n: int) -> Any:
    return api.init_device_mesh(DEVICE, (n,), mesh_dim_names=("tp",))


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16, bias: bool = True) -> None:
        super().__init__()
        self.net1 = nn.Linear(dim, hidden, bias=bias)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class NormMLP(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.net1 = nn.Linear(dim, 16)
        self.net2 = nn.Linear(16, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(ids))


def train_step(api: Any, n: int, model: nn.Module, plan: Any, x: torch.Tensor,
               mesh: Any = None) -> dict[str, Any]:
    """Parallelize ``model`` (a copy of a seeded one), run forward and ``sum().backward()``;
    outputs and every gradient."""
    api.parallelize_module(model, mesh if mesh is not None else tp_mesh(api, n), plan)
    y = model(x)
    (y.full_tensor() if hasattr(y, "full_tensor") else y).sum().backward()
    return {"out": snap(y), "params": params_and_grads(model)}


def seeded(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def inputs(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


# ----------------------------------------------------------------------------- styles
@case
def case_style_defaults(api: Any, n: int) -> Any:
    out = {}
    for cls in ("ColwiseParallel", "RowwiseParallel"):
        s = getattr(api, cls)()
        out[cls] = norm((s.input_layouts, s.output_layouts, s.use_local_output))
    sp = api.SequenceParallel()
    out["SequenceParallel"] = norm((sp.sequence_sharding, sp.use_local_output))
    pin = api.PrepareModuleInput(input_layouts=api.Shard(0), desired_input_layouts=api.Replicate())
    out["PrepareModuleInput"] = norm((pin.input_layouts, pin.desired_input_layouts,
                                      pin.input_kwarg_layouts, pin.desired_input_kwarg_layouts,
                                      pin.use_local_output))
    pout = api.PrepareModuleOutput(output_layouts=api.Shard(0),
                                   desired_output_layouts=api.Replicate())
    out["PrepareModuleOutput"] = norm((pout.output_layouts, pout.desired_output_layouts,
                                       pout.use_local_output))
    pio = api.PrepareModuleInputOutput(output_layouts=api.Shard(0),
                                       desired_output_layouts=api.Replicate())
    out["PrepareModuleInputOutput"] = norm((
        pio.prepare_module_input.use_local_output, pio.prepare_module_output.use_local_output))
    return out


@case
def case_mlp_colwise_rowwise(api: Any, n: int) -> Any:
    plan = {"net1": api.ColwiseParallel(), "net2": api.RowwiseParallel()}
    return train_step(api, n, seeded(MLP), plan, inputs(4, 8))


@case
def case_mlp_without_bias(api: Any, n: int) -> Any:
    plan = {"net1": api.ColwiseParallel(), "net2": api.RowwiseParallel()}
    return train_step(api, n, seeded(lambda: MLP(bias=False)), plan, inputs(3, 5, 8))


@case
def case_colwise_dtensor_output_into_rowwise(api: Any, n: int) -> Any:
    plan = {"net1": api.ColwiseParallel(use_local_output=False),
            "net2": api.RowwiseParallel(use_local_output=False)}
    return train_step(api, n, seeded(MLP), plan, inputs(4, 8))


@case
def case_colwise_output_replicate(api: Any, n: int) -> Any:
    plan = {"net1": api.ColwiseParallel(output_layouts=api.Replicate())}
    return train_step(api, n, seeded(MLP), plan, inputs(4, 8))


@case
def case_rowwise_input_replicate(api: Any, n: int) -> Any:
    plan = {"net2": api.RowwiseParallel(input_layouts=api.Replicate())}
    return train_step(api, n, seeded(MLP), plan, inputs(4, 8))


@case
def case_rowwise_output_sharded(api: Any, n: int) -> Any:
    plan = {"net1": api.ColwiseParallel(),
            "net2": api.RowwiseParallel(output_layouts=api.Shard(0))}
    return train_step(api, n, seeded(MLP), plan, inputs(2 * n, 8))


@case
def case_whole_module_style(api: Any, n: int) -> Any:
    return train_step(api, n, seeded(lambda: nn.Linear(8, 16)), api.ColwiseParallel(),
                      inputs(4, 8))


@case
def case_sequence_parallel_block(api: Any, n: int) -> Any:
    plan = {"norm": api.SequenceParallel(),
            "net1": api.ColwiseParallel(input_layouts=api.Shard(1)),
            "net2": api.RowwiseParallel(output_layouts=api.Shard(1))}
    x = inputs(2, 2 * n, 8).chunk(n, dim=1)[torch.distributed.get_rank() % n]
    return train_step(api, n, seeded(NormMLP), plan, x)


@case
def case_sequence_parallel_local_output(api: Any, n: int) -> Any:
    plan = {"norm": api.SequenceParallel(use_local_output=True)}
    x = inputs(2, 2 * n, 8).chunk(n, dim=1)[torch.distributed.get_rank() % n]
    return train_step(api, n, seeded(NormMLP), plan, x)


@case
def case_sequence_parallel_dtensor_input(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    norm_mod = seeded(lambda: nn.LayerNorm(8))
    api.parallelize_module(norm_mod, mesh, api.SequenceParallel())
    x = api.distribute_tensor(inputs(2, 2 * n, 8), mesh, [api.Replicate()])
    y = norm_mod(x)
    y.full_tensor().sum().backward()
    return {"out": snap(y), "params": params_and_grads(norm_mod)}


@case
def case_embedding_rowwise(api: Any, n: int) -> Any:
    plan = {"embedding": api.RowwiseParallel(input_layouts=api.Replicate())}
    ids = torch.tensor([[0, 5, 15, 3], [8, 9, 1, 12]])
    return train_step(api, n, seeded(TiedLM), plan, ids)


@case
def case_embedding_colwise(api: Any, n: int) -> Any:
    plan = {"embedding": api.ColwiseParallel(output_layouts=api.Replicate())}
    ids = torch.tensor([[0, 5, 15, 3], [8, 9, 1, 12]])
    return train_step(api, n, seeded(TiedLM), plan, ids)


@case
def case_embedding_rowwise_sequence_sharded_output(api: Any, n: int) -> Any:
    plan = {"embedding": api.RowwiseParallel(input_layouts=api.Replicate(),
                                             output_layouts=api.Shard(1)),
            "fc": api.ColwiseParallel(input_layouts=api.Shard(1),
                                      output_layouts=api.Replicate())}
    ids = torch.arange(2 * 2 * n).reshape(2, 2 * n) % 16
    return train_step(api, n, seeded(TiedLM), plan, ids)


# ----------------------------------------------------------------------------- plans
@case
def case_nested_plan(api: Any, n: int) -> Any:
    plan = {"block": {"net1": api.ColwiseParallel(), "net2": api.RowwiseParallel()}}
    return train_step(api, n, seeded(Nested), plan, inputs(4, 8))


@case
def case_wildcard_plan(api: Any, n: int) -> Any:
    plan = {"layers.*.net1": api.ColwiseParallel(), "layers.*.net2": api.RowwiseParallel()}
    return train_step(api, n, seeded(Stack), plan, inputs(4, 8))


@case
def case_wildcard_partial_name(api: Any, n: int) -> Any:
    plan = {"layers.*.net*": api.ColwiseParallel(output_layouts=api.Replicate())}
    return train_step(api, n, seeded(Stack), plan, inputs(4, 8))


@case
def case_root_key(api: Any, n: int) -> Any:
    """Plan key ``""`` is the module itself."""
    plan = {"": api.PrepareModuleInput(input_layouts=api.Shard(0),
                                       desired_input_layouts=api.Replicate()),
            "net1": api.ColwiseParallel(), "net2": api.RowwiseParallel()}
    x = inputs(2 * n, 8).chunk(n)[torch.distributed.get_rank() % n]
    return train_step(api, n, seeded(MLP), plan, x)


@case
def case_src_data_rank_none(api: Any, n: int) -> Any:
    """``src_data_rank=None``: each rank slices its own copy (no broadcast)."""
    model = seeded(MLP, seed=10 + torch.distributed.get_rank())
    api.parallelize_module(model, tp_mesh(api, n), {"net1": api.ColwiseParallel()},
                           src_data_rank=None)
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()
            if hasattr(p, "to_local")}


@case
def case_mesh_2d(api: Any, n: int) -> Any:
    mesh = api.init_device_mesh(DEVICE, (2, n // 2), mesh_dim_names=("dp", "tp"))
    plan = {"net1": api.ColwiseParallel(), "net2": api.RowwiseParallel()}
    dp_rank = mesh.get_local_rank("dp")
    return train_step(api, n, seeded(MLP), plan, inputs(4, 8, seed=dp_rank), mesh=mesh["tp"])


@case
def case_mesh_2d_sizes_and_names(api: Any, n: int) -> Any:
    mesh = api.init_device_mesh(DEVICE, (2, n // 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    return {"shape": tuple(mesh.shape), "names": tuple(mesh.mesh_dim_names),
            "tp_size": tp.size(), "dp_rank": mesh.get_local_rank("dp"),
            "tp_rank": mesh.get_local_rank("tp"), "ndim": mesh.ndim}


# ----------------------------------------------------------------------------- prepare styles
class TwoInputs(nn.Module):
    def forward(self, x: Any, y: Any = None) -> Any:
        x = x.to_local() if hasattr(x, "to_local") else x
        y = y.to_local() if hasattr(y, "to_local") else y
        return x * 2 + (0 if y is None else y)


class KwInput(nn.Module):
    def forward(self, x: Any, *, y: Any) -> Any:
        x = x.to_local() if hasattr(x, "to_local") else x
        y = y.to_local() if hasattr(y, "to_local") else y
        return x + y


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


def _rank_chunk(t: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(n, dim)[torch.distributed.get_rank() % n]


@case
def case_prepare_input_positional(api: Any, n: int) -> Any:
    mod = TwoInputs()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleInput(
        input_layouts=(api.Shard(0), None), desired_input_layouts=(api.Replicate(), None)))
    x = inputs(2 * n, 3).requires_grad_()
    xs = _rank_chunk(x.detach(), n).requires_grad_()
    y = mod(xs, torch.ones(2 * n, 3))
    y.sum().backward()
    return {"out": y.detach(), "grad": xs.grad}


@case
def case_prepare_input_kwargs(api: Any, n: int) -> Any:
    mod = KwInput()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleInput(
        input_kwarg_layouts={"y": api.Shard(0)},
        desired_input_kwarg_layouts={"y": api.Replicate()}))
    y = _rank_chunk(inputs(2 * n, 3), n)
    return mod(torch.zeros(2 * n, 3), y=y)


@case
def case_prepare_input_use_local_output(api: Any, n: int) -> Any:
    seen = {}

    class Probe(nn.Module):
        def forward(self, x: Any) -> Any:
            seen["type"] = type(x).__name__
            return x

    mod = Probe()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleInput(
        input_layouts=api.Shard(0), desired_input_layouts=api.Replicate(),
        use_local_output=True))
    out = mod(_rank_chunk(inputs(2 * n, 3), n))
    return {"out": snap(out), "type": seen["type"]}


@case
def case_prepare_output_tuple_with_none(api: Any, n: int) -> Any:
    mod = TwoOutputs()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleOutput(
        output_layouts=(api.Replicate(), None), desired_output_layouts=(api.Shard(0), None)))
    return snap(mod(inputs(2 * n, 3)))


@case
def case_prepare_input_output(api: Any, n: int) -> Any:
    mod = TwoOutputs()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleInputOutput(
        input_layouts=api.Shard(0), desired_input_layouts=api.Replicate(),
        use_local_input=True,
        output_layouts=(api.Replicate(), api.Replicate()),
        desired_output_layouts=(api.Shard(0), api.Shard(0))))
    return snap(mod(_rank_chunk(inputs(2 * n, 3), n)))


# ----------------------------------------------------------------------------- custom styles
@case
def case_custom_style_overriding_apply_(api: Any, n: int) -> Any:
    class Double(api.ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            module.register_forward_hook(lambda mod, args, out: out * 2)
            return module

    model = seeded(MLP)
    api.parallelize_module(model, tp_mesh(api, n), {"net2": Double()})
    return model(inputs(4, 8)).detach()


# ----------------------------------------------------------------------------- ties
@case
def case_tie_after_parallelize(api: Any, n: int) -> Any:
    """torch's own weight-tying test: tie after parallelize_module; one parameter, one grad."""
    model = seeded(TiedLM)
    api.parallelize_module(model, tp_mesh(api, n), {"embedding": api.ColwiseParallel(),
                                                     "fc": api.RowwiseParallel()})
    model.fc.weight = model.embedding.weight
    ids = torch.tensor([1, 7, 3, 15, 0])
    model(ids).sum().backward()
    return {"same_param": model.fc.weight is model.embedding.weight,
            "n_params": len(list(model.parameters())),
            "same_grad": model.fc.weight.grad is model.embedding.weight.grad
            or torch.equal(full(model.fc.weight.grad), full(model.embedding.weight.grad)),
            "params": params_and_grads(model)}


# ----------------------------------------------------------------------------- loss_parallel
def _loss_parallel(api: Any, n: int, *, classes: int = 16, rows: int = 6, extra: tuple = (),
                   **kwargs: Any) -> Any:
    mesh = tp_mesh(api, n)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, classes, *extra, generator=g)
    target = torch.randint(classes, (rows, *extra), generator=g)
    if "ignore_index" in kwargs:
        target[::3] = kwargs["ignore_index"]
    if kwargs.get("weight") is True:
        kwargs["weight"] = torch.rand(classes, generator=g) + 0.5
    dist_logits = api.distribute_tensor(logits, mesh, [api.Shard(1)]).requires_grad_()
    with api.loss_parallel():
        loss = F.cross_entropy(dist_logits, target, **kwargs)
        grad_out = torch.ones(loss.shape) if loss.dim() else None
        if grad_out is not None and hasattr(loss, "placements"):
            grad_out = api.distribute_tensor(grad_out, mesh, loss.placements)
        loss.backward(grad_out)
    return {"loss": full(loss), "grad": full(dist_logits.grad),
            "grad_placements": norm(dist_logits.grad.placements)}


@case
def case_loss_parallel_reduced_is_replicate_dtensor(api: Any, n: int) -> Any:
    """A 'mean'/'sum' loss is a Replicate DTensor scalar; a bare ``backward()`` seeds 1."""
    mesh = tp_mesh(api, n)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 16, generator=g)
    target = torch.randint(16, (6,), generator=g)
    out = {}
    for reduction in ("mean", "sum"):
        dist_logits = api.distribute_tensor(logits, mesh, [api.Shard(1)]).requires_grad_()
        with api.loss_parallel():
            loss = F.cross_entropy(dist_logits, target, reduction=reduction)
            loss.backward()
        out[reduction] = {"placements": norm(getattr(loss, "placements", None)),
                          "shape": tuple(loss.shape), "item": loss.item(),
                          "grad": full(dist_logits.grad)}
    return out


@case
def case_loss_parallel_mean(api: Any, n: int) -> Any:
    return _loss_parallel(api, n)


@case
def case_loss_parallel_sum(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, reduction="sum")


@case
def case_loss_parallel_none(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, reduction="none")


@case
def case_loss_parallel_ignore_index(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, ignore_index=-100)


@case
def case_loss_parallel_ignore_index_custom(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, ignore_index=3, reduction="sum")


@case
def case_loss_parallel_weight(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, weight=True)


@case
def case_loss_parallel_weight_ignore_index(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, weight=True, ignore_index=-100)


@case
def case_loss_parallel_weight_none(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, weight=True, reduction="none")


@case
def case_loss_parallel_label_smoothing(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, label_smoothing=0.1)


@case
def case_loss_parallel_label_smoothing_weight_ignore(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, label_smoothing=0.2, weight=True, ignore_index=-100)


@case
def case_loss_parallel_label_smoothing_sum(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, label_smoothing=0.3, reduction="sum")


@case
def case_loss_parallel_3d(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, rows=2, extra=(3,))


@case
def case_loss_parallel_uneven_classes(api: Any, n: int) -> Any:
    return _loss_parallel(api, n, classes=10)


# ----------------------------------------------------------------------------- redistribute
def _placement_set(api: Any) -> list[Any]:
    return [api.Shard(0), api.Shard(1), api.Replicate(), api.Partial()]


def _redistribute_pairs(api: Any, mesh: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    full_t = inputs(*shape, seed=7)
    weight = inputs(*shape, seed=8)
    combos = list(itertools.product(_placement_set(api), repeat=mesh.ndim))
    out: dict[str, Any] = {}
    for src in combos:
        # the source laid out by hand: Partial dims hold an equal share of the value
        partial = [m for m, p in enumerate(src) if type(p).__name__ == "Partial"]
        laid = [api.Replicate() if m in partial else p for m, p in enumerate(src)]
        base = api.distribute_tensor(full_t, mesh, laid).to_local()
        for m in partial:
            base = base / mesh.size(m)
        for dst in combos:
            key = f"{norm(src)}->{norm(dst)}"
            try:
                leaf = base.detach().clone().requires_grad_()
                x = api.DTensor.from_local(leaf, mesh, list(src), shape=full_t.shape,
                                           stride=full_t.stride())
                y = x.redistribute(mesh, list(dst))
                res = {"full": y.full_tensor().detach().clone(), "shape": tuple(y.shape),
                       "placements": norm(y.placements)}
                if not any(type(p).__name__ == "Partial" for p in dst):
                    res["local"] = y.to_local().detach().clone()
                (y.full_tensor() * weight).sum().backward()
                res["grad"] = leaf.grad.clone()
                out[key] = res
            except Exception as exc:  # noqa: BLE001
                out[key] = f"raised {type(exc).__name__}"
    return out


@case
def case_redistribute_pairs_1d(api: Any, n: int) -> Any:
    return _redistribute_pairs(api, tp_mesh(api, n), (2 * n, 6))


@case
def case_redistribute_pairs_1d_uneven(api: Any, n: int) -> Any:
    return _redistribute_pairs(api, tp_mesh(api, n), (n + 1, 3))


@case
def case_redistribute_pairs_2d(api: Any, n: int) -> Any:
    mesh = api.init_device_mesh(DEVICE, (2, n // 2), mesh_dim_names=("a", "b"))
    return _redistribute_pairs(api, mesh, (4, 6))


@case
def case_partial_reduce_ops(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    rank = torch.distributed.get_rank()
    local = inputs(3, 4, seed=20 + rank).abs() + 0.5
    out = {}
    for op in ("sum", "avg", "max", "min", "product"):
        x = api.DTensor.from_local(local, mesh, [api.Partial(op)])
        out[op] = x.full_tensor()
        out[f"{op}->S(0)"] = x.redistribute(mesh, [api.Shard(0)]).to_local()
    return out


@case
def case_uneven_distribute_tensor(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    out = {}
    for shape, p in (((5, 3), api.Shard(0)), ((2, 3), api.Shard(1)), ((n - 1, 2), api.Shard(0))):
        dt = api.distribute_tensor(inputs(*shape), mesh, [p])
        out[f"{shape}{norm(p)}"] = snap(dt)
    return out


@case
def case_uneven_colwise_linear(api: Any, n: int) -> Any:
    plan = {"net1": api.ColwiseParallel(output_layouts=api.Replicate())}
    return train_step(api, n, seeded(lambda: MLP(hidden=2 * n + 1)), plan, inputs(4, 8))


# ----------------------------------------------------------------------------- DTensor API
@case
def case_from_local_grad_placements(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    t = inputs(2, 3, seed=30 + torch.distributed.get_rank()).requires_grad_()
    x = api.DTensor.from_local(t, mesh, [api.Replicate()], grad_placements=[api.Partial()])
    (x.to_local() * 3).sum().backward()
    # a Partial gradient's split between ranks is the implementation's choice; its sum is not
    total = t.grad.clone()
    torch.distributed.all_reduce(total)
    return {"grad_sum": total}


@case
def case_to_local_grad_placements(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    leaf = api.distribute_tensor(inputs(2 * n, 3), mesh, [api.Shard(0)]).requires_grad_()
    y = leaf.redistribute(mesh, [api.Replicate()]).to_local(grad_placements=[api.Partial()])
    (y * 2).sum().backward()
    return {"grad": full(leaf.grad)}


@case
def case_redistribute_forward_dtype(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    leaf = api.distribute_tensor(inputs(2 * n, 3), mesh, [api.Shard(0)]).requires_grad_()
    y = leaf.redistribute(mesh, [api.Replicate()], forward_dtype=torch.float64)
    y.to_local().sum().backward()
    return {"dtype": str(y.dtype), "out": snap(y), "grad_dtype": str(leaf.grad.dtype),
            "grad": full(leaf.grad)}


@case
def case_from_local_run_check_replicate_broadcasts(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    t = torch.full((2, 2), float(torch.distributed.get_rank()))
    return api.DTensor.from_local(t, mesh, [api.Replicate()], run_check=True).to_local()


@case
def case_distribute_module_default_replicates(api: Any, n: int) -> Any:
    model = seeded(MLP)
    api.distribute_module(model, tp_mesh(api, n))
    return {name: norm(p.placements) for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- errors
@case
def case_error_prepare_input_more_inputs_than_layouts(api: Any, n: int) -> Any:
    mod = TwoInputs()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleInput(
        input_layouts=(api.Shard(0),), desired_input_layouts=(api.Replicate(),)))
    return mod(torch.ones(2, 3), torch.ones(2, 3))


@case
def case_error_prepare_input_layout_lengths(api: Any, n: int) -> Any:
    return api.PrepareModuleInput(input_layouts=(api.Shard(0), api.Replicate()),
                                  desired_input_layouts=(api.Replicate(),))


@case
def case_error_prepare_input_kwarg_layout_lengths(api: Any, n: int) -> Any:
    return api.PrepareModuleInput(input_kwarg_layouts={"a": api.Shard(0), "b": api.Shard(0)},
                                  desired_input_kwarg_layouts={"a": api.Replicate()})


@case
def case_error_prepare_output_layout_lengths(api: Any, n: int) -> Any:
    return api.PrepareModuleOutput(output_layouts=(api.Shard(0), api.Shard(0)),
                                   desired_output_layouts=(api.Replicate(),))


@case
def case_error_prepare_output_more_outputs(api: Any, n: int) -> Any:
    mod = TwoOutputs()
    api.parallelize_module(mod, tp_mesh(api, n), api.PrepareModuleOutput(
        output_layouts=(api.Replicate(),), desired_output_layouts=(api.Shard(0),)))
    return mod(torch.ones(2 * n, 3))


@case
def case_error_from_local_run_check_shapes_disagree(api: Any, n: int) -> Any:
    rows = 2 + torch.distributed.get_rank() % 2
    return api.DTensor.from_local(torch.ones(rows, 3), tp_mesh(api, n), [api.Shard(0)],
                                  run_check=True).shape


@case
def case_error_from_local_of_dtensor(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    x = api.distribute_tensor(torch.ones(2 * n, 2), mesh, [api.Shard(0)])
    return api.DTensor.from_local(x, mesh, [api.Shard(0)])


@case
def case_error_colwise_on_unsupported_module(api: Any, n: int) -> Any:
    return api.parallelize_module(nn.LayerNorm(8), tp_mesh(api, n), api.ColwiseParallel())


@case
def case_error_rowwise_on_unsupported_module(api: Any, n: int) -> Any:
    return api.parallelize_module(nn.Conv1d(2, 2, 1), tp_mesh(api, n), api.RowwiseParallel())


@case
def case_error_plan_value_not_a_style(api: Any, n: int) -> Any:
    return api.parallelize_module(MLP(), tp_mesh(api, n), {"net1": "colwise"})


@case
def case_error_redistribute_without_placements(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    return api.distribute_tensor(torch.ones(2, 2), mesh, [api.Replicate()]).redistribute(mesh)


@case
def case_error_replicate_to_partial_product(api: Any, n: int) -> Any:
    mesh = tp_mesh(api, n)
    x = api.distribute_tensor(torch.ones(2, 2), mesh, [api.Replicate()])
    return x.redistribute(mesh, [api.Partial("product")]).to_local()


@case
def case_error_parallelize_on_2d_mesh_needs_1d(api: Any, n: int) -> Any:
    """torch takes a 1-D mesh; a 2-D mesh without a "tp" dim is an error in both."""
    mesh = api.init_device_mesh(DEVICE, (2, n // 2), mesh_dim_names=("a", "b"))
    model = seeded(MLP)
    api.parallelize_module(model, mesh, {"net1": api.ColwiseParallel()})
    return model(inputs(4, 8))


@case
def case_unmatched_plan_key(api: Any, n: int) -> Any:
    model = seeded(MLP)
    api.parallelize_module(model, tp_mesh(api, n), {"net9": api.ColwiseParallel()})
    return model(inputs(4, 8)).detach()


# ----------------------------------------------------------------------------- runner
def _plain(x: Any) -> Any:
    """A picklable copy of a case's result (no collectives: a DTensor left in a result shows
    its placements and local shard; any other object its type)."""
    if hasattr(x, "to_local") and hasattr(x, "placements"):
        return {"placements": norm(x.placements), "local": _plain(x.to_local().detach())}
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return tuple(_plain(v) for v in x)
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return f"<{type(x).__name__}>"


def run_side_by_side(cases: dict[str, Callable[[Any, int], Any]], apis: dict[str, Any],
                     names: list[str], n: int | None = None,
                     plain: Callable[[Any], Any] = _plain) -> dict[str, dict[str, Any]]:
    """On every rank: run each named case once per API (``{"torch": api, "hyperpar": api}``);
    ``{case: {api: ("ok", plain(value)) | ("raised", "Type: message")}}``. The shared runner of
    every side-by-side file in this folder (TP, TP drop-in, FSDP2)."""
    import warnings

    n = n or torch.distributed.get_world_size()
    # Keep ranks in step on a group of its own: barrier() on the world also waits on the world's
    # earlier works and can re-raise, on one rank only, a failure a case already reported (torch
    # 2.6's gloo 'avg': "Cannot use ReduceOp.AVG with Gloo"), leaving the ranks out of step.
    in_step = torch.distributed.new_group()
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        results[name] = {}
        for label, api in apis.items():
            torch.manual_seed(0)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    results[name][label] = ("ok", plain(cases[name](api, n)))
            except Exception as exc:  # noqa: BLE001 -- the comparison decides
                results[name][label] = ("raised", f"{type(exc).__name__}: {exc}")
            torch.distributed.barrier(group=in_step)
    torch.distributed.destroy_process_group(in_step)
    return results


def run_cases(names: list[str], n: int | None = None) -> dict[str, dict[str, Any]]:
    """On every rank: run each case with both APIs (see :func:`run_side_by_side`)."""
    from _apis import api_named

    apis = {name: api_named(name) for name in ("torch", "hyperpar")}
    return run_side_by_side(CASES, apis, names, n)
