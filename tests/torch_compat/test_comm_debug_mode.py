"""``CommDebugMode`` side by side with torch's: one script body, run with torch's imports
(``torch.distributed.tensor.debug.CommDebugMode`` over torch's TP) and with hyperpar's
(``hyperpar.dtensor.debug.CommDebugMode`` over hyperpar's TP), on 2 gloo ranks. The counts per
collective kind (torch's keys), the total and the per-module forward counts must be equal.

Where they differ by design: hyperpar files backward collectives under ``"Global"`` only (its
module tracking sees forwards, not torch's backward module hooks), so per-module counts are
compared for the forward pass; in the TP+SP block hyperpar all-reduces three replicated
parameters' gradients that torch leaves ``Partial`` or computes whole (the test names them);
torch's table lists DTensor operations at noise levels 2-3, which a count at the collective
layer does not see.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hyperpar.platform import get_platform

_NAMES = {
    "init_device_mesh": ("torch.distributed.device_mesh", "hyperpar.dtensor"),
    "CommDebugMode": ("torch.distributed.tensor.debug", "hyperpar.dtensor.debug"),
    **{n: ("torch.distributed.tensor", "hyperpar.dtensor") for n in ("Replicate", "Shard")},
    **{n: ("torch.distributed.tensor.parallel", "hyperpar.parallel") for n in (
        "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "parallelize_module")},
}


def _api(which: str) -> SimpleNamespace:
    index = 0 if which == "torch" else 1
    return SimpleNamespace(**{n: getattr(importlib.import_module(mods[index]), n)
                              for n, mods in _NAMES.items()})


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    """LayerNorm (sequence parallel) -> MLP (colwise in from Shard(1), rowwise out to
    Shard(1)) with a residual: torch's TP+SP pattern, fed and returning local sequence
    shards."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _summary(mode: Any) -> dict[str, Any]:
    per_module = {fqn: {str(k): n for k, n in phases["forward"].items() if n}
                  for fqn, phases in mode.comm_module_counts.items()}
    backward = {str(k): n for k, n in mode.comm_module_counts["Global"]["backward"].items() if n}
    return {"counts": {str(k): n for k, n in mode.get_comm_counts().items() if n},
            "backward": backward,
            "total": mode.get_total_counts(),
            "forward_per_module": {fqn: c for fqn, c in per_module.items() if c}}


def _mlp_counts(which: str) -> dict[str, Any]:
    api = _api(which)
    torch.manual_seed(0)
    model = MLP()
    mesh = api.init_device_mesh("cpu", (get_platform().world_size(),), mesh_dim_names=("tp",))
    api.parallelize_module(model, mesh, {"w1": api.ColwiseParallel(),
                                         "w2": api.RowwiseParallel()})
    x = torch.randn(4, 8, requires_grad=True)
    with api.CommDebugMode() as mode:
        model(x).sum().backward()
    out = _summary(mode)
    out["params"] = sorted(f"{fqn}.{p}" for fqn, ps in mode.get_parameter_info().items()
                           for p in ps)
    return out


def _block_counts(which: str) -> dict[str, Any]:
    api = _api(which)
    torch.manual_seed(0)
    model = Block()
    mesh = api.init_device_mesh("cpu", (get_platform().world_size(),), mesh_dim_names=("tp",))
    api.parallelize_module(model, mesh, {
        "norm": api.SequenceParallel(),
        "mlp.w1": api.ColwiseParallel(input_layouts=api.Shard(1)),
        "mlp.w2": api.RowwiseParallel(output_layouts=api.Shard(1)),
    })
    # this rank's sequence shard of [2, 4, 8], as a training loop feeds a TP+SP block
    full = torch.randn(2, 4, 8)
    rank, world = get_platform().rank(), get_platform().world_size()
    x = full.chunk(world, dim=1)[rank].contiguous()
    with api.CommDebugMode() as mode:
        model(x).sum().backward()
    out = _summary(mode)
    out["grad_placements"] = {n: str(tuple(p.grad.placements)) for n, p in
                              model.named_parameters()}
    return out


def _both(fn: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return fn("torch"), fn("hyperpar")


@pytest.fixture(scope="module")
def results(run_batch: Any) -> dict[str, Any]:
    mlp = run_batch(2, _both, _mlp_counts)
    block = run_batch(2, _both, _block_counts)
    return {"mlp": mlp, "block": block}


def test_counts_per_kind_and_total_equal_torch_for_a_colwise_rowwise_mlp(
        results: dict[str, Any]) -> None:
    """Forward: the row-parallel output's all-reduce; backward: the column-parallel input
    gradient's all-reduce. Both frameworks: 2 all-reduces."""
    for rank, (theirs, ours) in enumerate(results["mlp"]):
        assert ours["counts"] == theirs["counts"], (rank, theirs, ours)
        assert ours["total"] == theirs["total"] > 0, (rank, theirs, ours)


def test_tp_sp_block_counts_equal_torch_but_for_the_replicated_parameters_gradients(
        results: dict[str, Any]) -> None:
    """The all-gathers and reduce-scatters of sequence parallelism are the same, forward and
    backward. Two documented differences add backward all-reduces of replicated parameters'
    gradients, one each:

    * the norm's weight and bias (fed sequence-sharded activations): torch leaves their
      gradients ``Partial``, unreduced; hyperpar's gradient keeps the parameter's
      ``Replicate`` layout (docs/dtensor.md, "Autograd and parameters");
    * the row-parallel bias under a ``Shard(1)`` output: torch adds it before the
      reduce-scatter (its gradient whole on every rank), hyperpar after it, to the rank's own
      rows, so its gradient is a part to all-reduce (``hyperpar.parallel.spec.row_bias``).

    And one backward all-gather more where hyperpar's column-parallel input saves its sequence
    shard (``reshard_input_after_forward``, on by default; torch keeps the gathered input):
    ``mlp.w1``'s input is gathered again for its weight gradient.
    """
    from hyperpar.parallel.spec import RESHARD_INPUT_DEFAULT

    regather = {"c10d_functional.all_gather_into_tensor": 1} if RESHARD_INPUT_DEFAULT else {}
    for rank, (theirs, ours) in enumerate(results["block"]):
        partial_on_torch = [n for n, p in theirs["grad_placements"].items()
                            if "Partial" in p and ours["grad_placements"][n] == "(Replicate(),)"]
        assert partial_on_torch == ["norm.weight", "norm.bias"], (rank, theirs, ours)
        extra = len(partial_on_torch) + 1  # + mlp.w2.bias
        expected = dict(theirs["counts"])
        key = "c10d_functional.all_reduce"
        expected[key] = expected.get(key, 0) + extra
        backward = {**theirs["backward"], key: extra}
        for kind, more in regather.items():
            expected[kind] = expected.get(kind, 0) + more
            backward[kind] = backward.get(kind, 0) + more
        assert ours["counts"] == expected, (rank, theirs, ours)
        assert ours["total"] == theirs["total"] + extra + sum(regather.values()), (rank, theirs,
                                                                                  ours)
        assert ours["backward"] == backward, (rank, theirs, ours)


@pytest.mark.parametrize("case", ["mlp", "block"])
def test_forward_counts_per_module_equal_torch(results: dict[str, Any], case: str) -> None:
    for rank, (theirs, ours) in enumerate(results[case]):
        assert ours["forward_per_module"] == theirs["forward_per_module"], (rank, theirs, ours)


def test_parameter_info_names_the_same_parameters(results: dict[str, Any]) -> None:
    for theirs, ours in results["mlp"]:
        assert ours["params"] == theirs["params"] == [
            "MLP.w1.bias", "MLP.w1.weight", "MLP.w2.bias", "MLP.w2.weight"]
