"""``fully_shard(block, shard_placement_fn=fn)`` where ``fn`` returns ``ShardPlacementResult``
(torch FSDP2's type, and hyperpar's): one block whose routed experts -- a 3-D parameter already
expert-parallel (``Shard(0)`` on an ``ep`` mesh) -- shard over their own ``efsdp`` mesh while
its dense parameters shard over the 4-rank ``dp_shard`` mesh, torchtitan 0.3.0's layout on a
2 x 2 grid (efsdp x ep). Trained 3 SGD steps and compared with the same block in one plain-torch
process on the whole batch.

The experts compute as expert parallelism does: each rank gathers the ep group's tokens
(``all_gather_tensor``), applies its local experts and reduce-scatters the sum back
(``reduce_scatter_tensor``), both differentiable. With ``set_gradient_divide_factor(4)`` (the
dp world, as torchtitan sets for experts) every gradient is the full batch's mean.

Tolerance 1e-5: fp32 sums of at most 32 products reordered (~1e-6); a gradient reduced over the
wrong mesh or scaled wrongly moves weights by ~1e-2 after one step.
"""

from __future__ import annotations

import torch
from torch import nn

STEPS, ROWS, D, E, TOL = 3, 8, 8, 4, 1e-5
CLIP = 0.5  # below the first steps' gradient norms (~1-3): clipping changes every step


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"dense.weight": torch.randn(D, D, generator=g) * 0.3,
            "dense.bias": torch.randn(D, generator=g) * 0.1,
            "experts": torch.randn(E, D, D, generator=g) * 0.3}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(10 + step))


class _Ref(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        w = _weights()
        self.dense = nn.Linear(D, D)
        self.dense.weight.data.copy_(w["dense.weight"])
        self.dense.bias.data.copy_(w["dense.bias"])
        self.experts = nn.Parameter(w["experts"].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("td,edf->tf", torch.tanh(self.dense(x)), self.experts)


def _reference(clip: bool = False) -> dict[str, torch.Tensor]:
    model = _Ref()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(step)).pow(2).sum(-1).mean().backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    out = {k: v.detach() for k, v in model.named_parameters()}
    if clip:
        out["norms"] = torch.tensor(norms)
    return out


class _Block(nn.Module):
    """The same block with its experts expert-parallel over ``ep``."""

    def __init__(self, ep_mesh) -> None:
        from hyperpar import Shard, distribute_tensor

        super().__init__()
        w = _weights()
        self.dense = nn.Linear(D, D)
        self.dense.weight.data.copy_(w["dense.weight"])
        self.dense.bias.data.copy_(w["dense.bias"])
        self.experts = nn.Parameter(distribute_tensor(w["experts"], ep_mesh, [Shard(0)]))
        self.ep = ep_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import hyperpar.dtensor.functional_collectives as funcol

        h = funcol.all_gather_tensor(torch.tanh(self.dense(x)), 0, self.ep)
        y = torch.einsum("td,edf->tf", h, self.experts.to_local())
        return funcol.reduce_scatter_tensor(y, "sum", 0, self.ep)


def _train(result_type: str, clip: bool = False) -> dict:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.fsdp import FSDPMeshInfo, ShardPlacementResult, clip_grad_norm_

    if result_type == "torch":   # torch's own dataclasses, with a hyperpar mesh inside
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )
    world = init_device_mesh((4,), mesh_dim_names=("dp_shard",))
    grid = init_device_mesh((2, 2), mesh_dim_names=("efsdp", "ep"))
    block = _Block(grid["ep"])
    experts = block.experts
    info = FSDPMeshInfo(grid["efsdp"], shard_mesh_dim=0)

    def placement(p):
        return ShardPlacementResult(None, info) if p is experts else None

    fully_shard(block, mesh=world, shard_placement_fn=placement)
    block.set_gradient_divide_factor(4)
    layout = {k: (p.device_mesh.mesh_dim_names, tuple(p.to_local().shape))
              for k, p in block.named_parameters()}
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    r = world.get_local_rank()
    rows = slice(2 * r, 2 * r + 2)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        block(_batch(step)[rows]).pow(2).sum(-1).mean().backward()
        if clip:   # experts' grads on (ep, efsdp), dense ones on dp_shard: one total norm
            norms.append(float(clip_grad_norm_(block.parameters(), CLIP)))
        opt.step()
    params = {k: p.full_tensor().detach() for k, p in block.named_parameters()}
    if clip:
        params["norms"] = torch.tensor(norms)
    return {"layout": layout, "params": params}


def _check(results, clip: bool = False) -> None:
    ref = _reference(clip)
    assert not clip or (ref["norms"] > CLIP).all(), "the reference must actually clip"
    for res in results:
        assert res["layout"]["experts"] == (("ep", "efsdp"), (1, D, D))
        assert res["layout"]["dense.weight"] == (("dp_shard",), (2, D))
        for k, want in ref.items():
            torch.testing.assert_close(res["params"][k], want, atol=TOL, rtol=TOL, msg=k)


def test_experts_on_their_own_fsdp_mesh_train_as_one_process(run_on_ranks):
    _check(run_on_ranks(4, _train, "hyperpar"))


def test_torch_shard_placement_result_is_accepted(run_on_ranks):
    _check(run_on_ranks(4, _train, "torch"))


def test_clip_grad_norm_over_expert_and_dense_meshes_matches_one_process(run_on_ranks):
    """hyperpar.fsdp.clip_grad_norm_ over parameters on two meshes: the one-process norm."""
    _check(run_on_ranks(4, _train, "hyperpar", True), True)


def _errors() -> dict[str, str]:
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    from hyperpar import Replicate, fully_shard, init_device_mesh
    from hyperpar.fsdp import FSDPMeshInfo, ShardPlacementResult

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    out = {}
    cases = {
        "placement": lambda p: Replicate(),
        "result_placement": lambda p: ShardPlacementResult(Replicate(), FSDPMeshInfo(mesh, 0)),
        "torch_mesh": lambda p: ShardPlacementResult(
            None, type("Info", (), {"mesh": TorchMesh.__new__(TorchMesh),
                                    "shard_mesh_dim": 0})()),
        "mesh_dim": lambda p: ShardPlacementResult(None, FSDPMeshInfo(mesh, 1)),
    }
    for name, fn in cases.items():
        try:
            fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=fn)
            out[name] = "no error"
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_bad_shard_placement_results_are_refused_clearly(run_on_ranks):
    for out in run_on_ranks(2, _errors):
        assert out["placement"].startswith("TypeError") and "ShardPlacementResult" in \
            out["placement"]
        assert out["result_placement"].startswith("TypeError")
        assert out["torch_mesh"].startswith("TypeError") and "hyperpar DeviceMesh" in \
            out["torch_mesh"]
        assert out["mesh_dim"].startswith("ValueError") and "shard_mesh_dim=1" in \
            out["mesh_dim"]
