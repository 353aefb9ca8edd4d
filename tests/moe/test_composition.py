"""Expert parallelism composed with pipeline stages, fully_shard, clip_grad_norm_ and checkpoints,
each against the same model computed in one plain-torch process (every token through its top-k
experts, :mod:`tests.moe._reference`).

The model: ``Block = proj (Linear) -> h + MoE(h)`` (4 or 8 experts, top-2, one shared expert).
The world's loss is the mean of the ranks' losses, so the reference differentiates
``mean_r loss(batch_r)``: dense gradients are averaged over the data-parallel ranks, an expert's
gradient (which the combine's backward already summed over its ep group) summed over the
experts' data-parallel group and divided by the world's data-parallel size.

Tolerance: float32, sums of at most ~40 products of O(1) values reordered, compounded over two
blocks and one SGD step: ~1e-6 relative; 1e-5 leaves margin, and any token routed or reduced
wrongly moves values by >= 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ._reference import reference_moe_params

TOL = 1e-5
DIM, HID, ROWS = 8, 16, 4  # ROWS: tokens per data-parallel rank


class Block(nn.Module):
    def __init__(self, n_experts: int) -> None:
        super().__init__()
        from hyperpar.moe import MoE

        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.moe = MoE(DIM, HID, num_experts=n_experts, top_k=2, num_shared_experts=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h + self.moe(h)


def _model(n_blocks: int, n_experts: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(n_experts) for _ in range(n_blocks)])
    for name, p in model.named_parameters():  # O(1) activations, decisive routing
        nn.init.normal_(p, std=1.0 if "gate" in name else 0.3)
    return model


def _tokens(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def _reference_forward(p: dict, x: torch.Tensor, n_blocks: int) -> torch.Tensor:
    for b in range(n_blocks):
        h = x @ p[f"{b}.proj.weight"].T
        x = h + reference_moe_params(p, h, f"{b}.moe.", 2)
    return x


def _reference_grads(n_blocks: int, n_experts: int, n_dp: int) -> tuple[dict, dict]:
    model = _model(n_blocks, n_experts)
    p = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    loss = sum(_reference_forward(p, _tokens(r), n_blocks).square().mean() for r in range(n_dp))
    (loss / n_dp).backward()
    return p, {k: v.grad for k, v in p.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient tensor this rank holds for ``p`` (a DTensor's local piece)."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.grad if local.grad is not None else p.grad.to_local()


# ------------------------------------------------------------------ EP inside pipeline stages
def _pp_ep() -> dict:
    import hyperpar.pipelining as pipelining
    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    mesh = init_device_mesh((2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    block = _model(2, 4)[pp]
    parallelize_module(block, mesh["ep"], {"moe.experts": ExpertParallel()})
    stage = pipelining.PipelineStage(block, pp, 2, None, group=mesh["pp"].get_group())

    def mse(out, target):
        return out.square().mean()

    sched = pipelining.Schedule1F1B(stage, n_microbatches=2, loss_fn=mse)
    x = _tokens(ep)
    losses = []
    sched.step(*((x,) if pp == 0 else ()), target=x if pp == 1 else None,
               losses=losses if pp == 1 else None)
    platform = get_platform()
    grads = {}
    for name, p in block.named_parameters():
        g = _local_grad(p).clone()
        if name.startswith("moe.experts."):
            g = g / 2  # summed over the ep pair's two pipelines by the combine's backward
            full = torch.empty((2 * g.shape[0], *g.shape[1:]))
            platform.all_gather_into_tensor(full, g.contiguous(), mesh["ep"].get_group())
            g = full
        else:  # the dense part is data-parallel over ep: average
            platform.all_reduce(g, "avg", mesh["ep"].get_group())
        grads[f"{pp}.{name}"] = g
    return {"grads": grads, "losses": [float(v) for v in losses]}


def test_ep_inside_1f1b_pipeline_stages_matches_one_process(run_on_ranks):
    """4 ranks, mesh (pp 2, ep 2): each stage's block holds its MoE's experts split over the ep
    pair; the two ep ranks are two pipelines on their own tokens (2 microbatches each, 1F1B)."""
    results = run_on_ranks(4, _pp_ep, timeout_s=120)
    p, grads = _reference_grads(2, 4, 2)
    for rank, res in enumerate(results):
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, grads[name], atol=TOL, rtol=TOL, msg=f"{rank} {name}")
    ref_losses = [_reference_forward(p, _tokens(r)[m * 2:(m + 1) * 2], 2).square().mean().item()
                  for r in range(2) for m in range(2)]
    got = results[2]["losses"] + results[3]["losses"]
    assert got == pytest.approx(ref_losses, abs=TOL)


# ------------------------------------------------------------------ EP x fully_shard x clip
def _fsdp_ep(steps: int, mode: str) -> dict:
    from hyperpar import (
        ExpertParallel,
        clip_grad_norm_,
        fully_shard,
        init_device_mesh,
        parallelize_module,
    )
    from hyperpar.platform import get_platform

    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    sparse = init_device_mesh((2, world // 2), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh((world,), mesh_dim_names=("dp",))
    model = _model(1, 4)
    parallelize_module(model, sparse["ep"], {"0.moe.experts": ExpertParallel()})
    experts = list(model[0].moe.experts.parameters())
    if mode == "efsdp":  # torchtitan's layout: the experts fully_shard over their own mesh
        from hyperpar.fsdp import FSDPMeshInfo, ShardPlacementResult

        info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
        ids = {id(p) for p in experts}

        def placement(p):
            return ShardPlacementResult(None, info) if id(p) in ids else None

        fully_shard(model[0], mesh=dense["dp"], shard_placement_fn=placement)
        model[0].set_gradient_divide_factor(world)  # every gradient: the world batch's mean
    else:  # dense parameters sharded over every rank; the experts kept out of fully_shard
        for name in ("0.proj", "0.moe.router", "0.moe.shared_experts"):
            fully_shard(model.get_submodule(name), mesh=dense["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        model(_tokens(rank, step)).square().mean().backward()
        for p in experts if mode == "excluded" else ():
            g = _local_grad(p)  # averaged over efsdp by hand
            platform.all_reduce(g, "sum", sparse["efsdp"].get_group())
            g.div_(world)  # the combine summed the ep group: sum over efsdp, over the world
        norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
    placements = {n: (p.device_mesh.mesh_dim_names, tuple(p.to_local().shape))
                  for n, p in model.named_parameters()}
    return {"norms": norms, "params": {n: _full(p).detach() for n, p in model.named_parameters()},
            "placements": placements}


@pytest.mark.parametrize("mode", ["efsdp", "excluded"])
def test_ep_with_fully_shard_and_clip_grad_norm_matches_one_process(run_on_ranks, mode):
    """4 ranks: dense weights fully_shard over all 4, experts 2 per rank over ep (2) and, over
    efsdp (2), either fully_shard through ``shard_placement_fn`` returning
    ``ShardPlacementResult`` (``"efsdp"``, torchtitan's layout) or kept out of fully_shard and
    all-reduced by hand (``"excluded"``); 2 SGD steps, each after clip_grad_norm_ over every
    parameter (two meshes) at max norm 1 (which clips): the norms and the weights equal one
    process."""
    results = run_on_ranks(4, _fsdp_ep, 2, mode, timeout_s=120)
    model = _model(1, 4)
    p = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(list(p.values()), lr=0.1)
    norms = []
    for step in range(2):
        opt.zero_grad()
        loss = sum(_reference_forward(p, _tokens(r, step), 1).square().mean() for r in range(4))
        (loss / 4).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)))
        opt.step()
    assert norms[0] > 1.0, "the case must clip"
    for res in results:
        assert res["norms"] == pytest.approx(norms, rel=TOL)
        for name, want in p.items():
            torch.testing.assert_close(res["params"][name], want.detach(), atol=TOL, rtol=TOL,
                                       msg=name)
        experts = (("ep", "efsdp"), (1, HID, DIM)) if mode == "efsdp" else (("ep",),
                                                                            (2, HID, DIM))
        assert res["placements"]["0.moe.experts.w1"] == experts
        assert res["placements"]["0.proj.weight"] == (("dp",), (DIM // 4, DIM))


# ------------------------------------------------------------------ checkpoints across EP degrees
def _save_at_ep(path: str) -> dict:
    from hyperpar import ExpertParallel, checkpoint, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    rank, world = get_platform().rank(), get_platform().world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("ep",))
    model = _model(1, 4)
    parallelize_module(model, mesh, {"0.moe.experts": ExpertParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(_tokens(rank)).square().mean().backward()  # one step: the saved weights are trained
    for p in model.parameters():
        if not hasattr(p, "to_local"):  # dense: average over the data-parallel ranks
            get_platform().all_reduce(p.grad, "avg")
        else:
            _local_grad(p).div_(world)
    opt.step()
    checkpoint.save(model, path)
    return {n: _full(p).detach() for n, p in model.named_parameters()}


def _load_and_step(path: str) -> dict:
    from hyperpar import ExpertParallel, checkpoint, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    rank, world = get_platform().rank(), get_platform().world_size()
    model = _model(1, 4)
    for p in model.parameters():  # other values than the saved ones
        nn.init.zeros_(p)
    if world > 1:
        mesh = init_device_mesh((world,), mesh_dim_names=("ep",))
        parallelize_module(model, mesh, {"0.moe.experts": ExpertParallel()})
    checkpoint.load(model, path)
    per = 4 // world  # the same 4 data-parallel batches, split over this world
    loss = sum(model(_tokens(r, 1)).square().mean() for r in range(rank * per, (rank + 1) * per))
    total = loss.detach().clone()
    if world > 1:
        get_platform().all_reduce(total, "sum")
    return {"loss": float(total) / 4, "local": tuple(_full(model[0].moe.experts.w1).shape),
            "params": {n: _full(p).detach() for n, p in model.named_parameters()}}


def test_checkpoint_saved_at_ep2_loads_at_ep4_and_in_one_process(run_on_ranks, tmp_path):
    path = str(tmp_path / "moe")
    saved = run_on_ranks(2, _save_at_ep, path)[0]
    ep4 = run_on_ranks(4, _load_and_step, path)
    one = run_on_ranks(1, _load_and_step, path)
    want = sum(_reference_forward(saved, _tokens(r, 1), 1).square().mean()
               for r in range(4)).item() / 4
    for res in ep4 + one:
        assert res["loss"] == pytest.approx(want, rel=TOL)
        for name, value in saved.items():
            torch.testing.assert_close(res["params"][name], value, atol=0, rtol=0, msg=name)
