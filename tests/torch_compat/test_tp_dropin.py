"""Tensor-parallel drop-in behaviours (issue 19): each case is one script body run with torch's
imports and with hyperpar's (only the import lines differ), on 2 and 4 gloo ranks; hyperpar
must give what torch gives -- outputs, every gradient, placements, which objects are the same
object, and whether a result is a DTensor.

* ``SequenceParallel`` given a DTensor sharded on another dim re-lays it out to the sequence dim;
* a weight tied after ``parallelize_module`` is one parameter with one ``.grad`` object, also
  when the two holders' styles lay it out differently;
* under ``loss_parallel()``, ``cross_entropy(..., reduction="none")`` is a DTensor;
* ``distribute_module`` imported from ``hyperpar.dtensor`` (where torch's
  ``torch.distributed.tensor.distribute_module`` maps to).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _cases import TiedLM, inputs, norm, params_and_grads, run_side_by_side, seeded, snap
from test_compat import _older_torch_reason, differences
from torch import nn

WORLDS = (2, 4)
CASES: dict[str, Callable[[Any, int], Any]] = {}

#: name -> (torch module, hyperpar module) a script imports it from
_NAMES = {
    "init_device_mesh": ("torch.distributed.device_mesh", "hyperpar.dtensor"),
    **{n: ("torch.distributed.tensor", "hyperpar.dtensor") for n in (
        "DTensor", "Replicate", "Shard", "distribute_module", "distribute_tensor")},
    **{n: ("torch.distributed.tensor.parallel", "hyperpar.parallel") for n in (
        "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "loss_parallel",
        "parallelize_module")},
}


def _api(which: str) -> SimpleNamespace:
    index = 0 if which == "torch" else 1
    return SimpleNamespace(**{n: getattr(importlib.import_module(mods[index]), n)
                              for n, mods in _NAMES.items()})


def case(fn: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def _mesh(api: Any, n: int) -> Any:
    return api.init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))


# ----------------------------------------------------------------------------- sequence parallel
@case
def case_sequence_parallel_batch_sharded_dtensor_input(api: Any, n: int) -> Any:
    """A ``Shard(0)`` DTensor ``[4, 8, 12]`` into a SequenceParallel norm: torch re-lays it out
    to ``Shard(1)`` (all-to-all); output, its placements and the norm's gradients."""
    mesh = _mesh(api, n)
    norm_mod = seeded(lambda: nn.LayerNorm(12))
    api.parallelize_module(norm_mod, mesh, api.SequenceParallel())
    x = api.distribute_tensor(inputs(4, 8, 12), mesh, [api.Shard(0)])
    y = norm_mod(x)
    (y.full_tensor() * torch.arange(12.0)).sum().backward()
    return {"out": snap(y), "params": params_and_grads(norm_mod)}


@case
def case_sequence_parallel_uneven_sequence_dtensor_input(api: Any, n: int) -> Any:
    """A ``Shard(2)`` DTensor whose sequence dim (5) does not divide the mesh."""
    mesh = _mesh(api, n)
    norm_mod = seeded(lambda: nn.LayerNorm(8))
    api.parallelize_module(norm_mod, mesh, api.SequenceParallel())
    x = api.distribute_tensor(inputs(2, 5, 8), mesh, [api.Shard(2)])
    y = norm_mod(x)
    (y.full_tensor() * torch.arange(8.0)).sum().backward()
    return {"out": snap(y), "params": params_and_grads(norm_mod)}


# ----------------------------------------------------------------------------- tied weights
class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8, bias=False)
        self.l2 = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _tied_result(model: nn.Module, a: nn.Module, b: nn.Module, out: Any) -> dict[str, Any]:
    return {"one_param": a.weight is b.weight, "n_params": len(list(model.parameters())),
            "one_grad": a.weight.grad is b.weight.grad,
            "grad_is_stable": a.weight.grad is a.weight.grad,
            "out": snap(out), "params": params_and_grads(model)}


@case
def case_tie_after_parallelize_one_grad_object(api: Any, n: int) -> Any:
    """torch's own weight-tying test, strictly: after ``fc.weight = embedding.weight`` both
    modules hold one parameter and ``fc.weight.grad is embedding.weight.grad``."""
    model = seeded(TiedLM)
    api.parallelize_module(model, _mesh(api, n), {"embedding": api.ColwiseParallel(),
                                                   "fc": api.RowwiseParallel()})
    model.fc.weight = model.embedding.weight
    out = model(torch.tensor([1, 7, 3, 15, 0]))
    out.sum().backward()
    return _tied_result(model, model.embedding, model.fc, out)


@case
def case_tie_after_parallelize_same_style_accumulates(api: Any, n: int) -> Any:
    """Two column-parallel Linears tied after parallelize: both uses accumulate into one grad."""
    model = seeded(TwoLinear)
    style = api.ColwiseParallel(output_layouts=api.Replicate())
    api.parallelize_module(model, _mesh(api, n), {"l1": style, "l2": style})
    model.l2.weight = model.l1.weight
    out = model(inputs(4, 8))
    out.sum().backward()
    return _tied_result(model, model.l1, model.l2, out)


@case
def case_tie_after_parallelize_layouts_differ(api: Any, n: int) -> Any:
    """Colwise ``l1`` (weight ``Shard(0)``) tied into rowwise ``l2`` (expects ``Shard(1)``):
    torch re-lays the shared weight out for ``l2``; two steps accumulate into one grad."""
    model = seeded(TwoLinear)
    api.parallelize_module(model, _mesh(api, n), {"l1": api.ColwiseParallel(),
                                                   "l2": api.RowwiseParallel()})
    model.l2.weight = model.l1.weight
    model(inputs(4, 8)).sum().backward()
    out = model(inputs(4, 8, seed=5))
    out.sum().backward()
    return _tied_result(model, model.l1, model.l2, out)


# ----------------------------------------------------------------------------- loss_parallel
@case
def case_loss_parallel_reduction_none_is_a_dtensor(api: Any, n: int) -> Any:
    """Per-element losses are a (replicated) DTensor; ``backward`` with a DTensor gradient."""
    mesh = _mesh(api, n)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 16, generator=g)
    target = torch.randint(16, (6,), generator=g)
    dist_logits = api.distribute_tensor(logits, mesh, [api.Shard(1)]).requires_grad_()
    with api.loss_parallel():
        loss = F.cross_entropy(dist_logits, target, reduction="none")
        loss.backward(api.distribute_tensor(torch.linspace(0.5, 2.0, 6), mesh, loss.placements))
    return {"is_dtensor": isinstance(loss, api.DTensor), "loss": snap(loss),
            "grad": dist_logits.grad.full_tensor()}


# ----------------------------------------------------------------------------- distribute_module
class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


@case
def case_distribute_module_replicates_parameters_and_buffers(api: Any, n: int) -> Any:
    model = seeded(WithBuffer)
    mesh = _mesh(api, n)
    api.distribute_module(model, mesh)
    out = model(api.distribute_tensor(inputs(3, 8), mesh, [api.Replicate()]))
    out.sum().backward()
    return {"buffer": {"dtensor": isinstance(model.offset, api.DTensor),
                       "placements": norm(model.offset.placements)},
            "out": snap(out), "params": params_and_grads(model)}


def _shard_linears(name: str, module: nn.Module, mesh: Any) -> None:
    from hyperpar.dtensor import Shard as HShard
    from hyperpar.dtensor import distribute_tensor as h_distribute

    torch_side = type(mesh).__module__.startswith("torch")
    if torch_side:
        from torch.distributed.tensor import Shard, distribute_tensor
    else:
        Shard, distribute_tensor = HShard, h_distribute
    if isinstance(module, nn.Linear):
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))


@case
def case_distribute_module_partition_input_output_fns(api: Any, n: int) -> Any:
    """A partition_fn that shards each Linear's rows, an input_fn that wraps the inputs as
    replicated DTensors and an output_fn that gathers the output (torch's documented use)."""
    model = seeded(WithBuffer)

    def input_fn(module: nn.Module, args: tuple, mesh: Any) -> tuple:
        return tuple(api.DTensor.from_local(a, mesh, [api.Replicate()]) for a in args)

    def output_fn(module: nn.Module, out: Any, mesh: Any) -> torch.Tensor:
        return out.full_tensor()

    api.distribute_module(model, _mesh(api, n), _shard_linears, input_fn, output_fn)
    out = model(inputs(3, 8))
    (out * torch.arange(4.0)).sum().backward()
    return {"out_is_plain": type(out) is torch.Tensor, "out": out.detach(),
            "params": params_and_grads(model)}


@case
def case_distribute_module_two_argument_input_fn(api: Any, n: int) -> Any:
    """The older ``input_fn(inputs, mesh)`` form (torch still accepts it, with a warning)."""
    model = seeded(WithBuffer)

    def input_fn(args: tuple, mesh: Any) -> tuple:
        return tuple(api.distribute_tensor(a, mesh, [api.Replicate()]) for a in args)

    api.distribute_module(model, _mesh(api, n), input_fn=input_fn)
    return snap(model(inputs(3, 8)))


@case
def case_error_distribute_module_twice(api: Any, n: int) -> Any:
    model = seeded(WithBuffer)
    mesh = _mesh(api, n)
    api.distribute_module(model, mesh)
    api.distribute_module(model, mesh)
    return "no error"


# ----------------------------------------------------------------------------- runner
def run_dropin_cases(names: list[str]) -> dict[str, dict[str, Any]]:
    """On every rank: each case with torch's and with hyperpar's imports (see
    ``_cases.run_side_by_side``)."""
    return run_side_by_side(CASES, {label: _api(label) for label in ("torch", "hyperpar")}, names)


@pytest.fixture(scope="module")
def results(run_batch: Any) -> Callable[[int], list[dict[str, Any]]]:
    cache: dict[int, Any] = {}

    def get(n: int) -> list[dict[str, Any]]:
        if n not in cache:
            cache[n] = run_batch(n, run_dropin_cases, sorted(CASES))
        return cache[n]

    return get


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_as_torch(results: Any, name: str, n: int) -> None:
    if _older_torch_reason(name):
        pytest.skip(_older_torch_reason(name))
    for rank, res in enumerate(results(n)):
        (t_status, t_value), (h_status, h_value) = res[name]["torch"], res[name]["hyperpar"]
        if name.startswith("error_"):
            assert t_status == "raised", f"torch no longer raises in {name}: {t_value!r}"
            assert h_status == "raised", f"rank {rank}: torch raises ({t_value}), hyperpar not"
            continue
        assert t_status == "ok", f"torch fails this case: {t_value}"
        assert h_status == "ok", f"rank {rank}: torch passes, hyperpar raised {h_value}"
        diffs = differences(t_value, h_value, name)
        assert not diffs, f"rank {rank}:\n" + "\n".join(diffs[:20])
