"""hyperpar.checkpoint with fully_shard models: a fsdp4 checkpoint (parameters + AdamW state)
loads into a tp2 layout and into one process; fsdp2 x tp2 loads into one process; a model built
on the meta device, sharded and materialised with ``to_empty`` gets the saved values (each rank
only ever holds its shards); a full safetensors file loads into a fully_shard model, each rank
reading only its rows. Values are compared exactly: a load copies, it does not compute."""

from __future__ import annotations

import torch
from torch import nn

from ._common import ARGS, BATCH, llama, loss_of, plans, rank_rows, shard_blocks

# AdamW state keys compared after a load (``step`` is a scalar tensor, not laid out)
MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _one_step(model: nn.Module, dp_rank: int, dp_size: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=0)
    rows = rank_rows(dp_rank, dp_size)
    loss_of(model, tokens[rows], labels[rows]).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full parameters and AdamW moments, by name (collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p)
        for k in MOMENTS:
            out[f"{name}:{k}"] = _full(opt.state[p][k])
    return out


def _save_fsdp(path: str, tp: int = 1) -> dict[str, torch.Tensor] | None:
    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.checkpoint import save
    from hyperpar.platform import get_platform

    pf = get_platform()
    dp = pf.world_size() // tp
    mesh = init_device_mesh((dp, tp), mesh_dim_names=("dp", "tp"))
    model = llama.build(ARGS, seed=0)
    if tp > 1:
        parallelize_module(model, mesh["tp"], plans.tp_plan())
    shard_blocks(model, mesh=mesh["dp"])
    opt = _one_step(model, mesh.get_local_rank("dp"), dp)
    save(model, path, optimizer=opt)
    snap = _snapshot(model, opt)
    return snap if pf.rank() == 0 else None


def _load_into(path: str, layout: str) -> dict[str, torch.Tensor]:
    """Load into a fresh model (other seed) laid out as ``layout``: "tp", "plain" or
    "fsdp"; returns its full parameters and AdamW moments."""
    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.checkpoint import load
    from hyperpar.platform import get_platform

    model = llama.build(ARGS, seed=1)
    if layout == "tp":
        mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, plans.tp_plan())
    elif layout == "fsdp":
        shard_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    load(model, path, optimizer=opt)
    assert opt.param_groups[0]["lr"] == 1e-2  # hyperparameters come from the checkpoint
    return _snapshot(model, opt)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str):
    assert set(got) == set(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=f"{what}: {k}")


def test_fsdp4_with_adamw_loads_into_tp2_and_into_one_process(run_on_ranks, tmp_path):
    saved = run_on_ranks(4, _save_fsdp, str(tmp_path))[0]
    fresh = llama.build(ARGS, seed=1).output.weight.detach()
    assert not torch.equal(fresh, saved["output.weight"])  # the load has work to do
    for rank, got in enumerate(run_on_ranks(2, _load_into, str(tmp_path), "tp")):
        _assert_same(got, saved, f"fsdp4 -> tp2, rank {rank}")
    (got,) = run_on_ranks(1, _load_into, str(tmp_path), "plain")
    _assert_same(got, saved, "fsdp4 -> one process")


def test_fsdp2_x_tp2_loads_into_one_process(run_on_ranks, tmp_path):
    saved = run_on_ranks(4, _save_fsdp, str(tmp_path), 2)[0]
    (got,) = run_on_ranks(1, _load_into, str(tmp_path), "plain")
    _assert_same(got, saved, "fsdp2 x tp2 -> one process")


def _meta_load(path: str) -> tuple[int, int, dict[str, torch.Tensor]]:
    from hyperpar.checkpoint import load
    from hyperpar.platform import get_platform

    with torch.device("meta"):
        model = llama.build(ARGS, seed=1)
    shard_blocks(model)
    model.to_empty(device=get_platform().device())
    held = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    load(model, path)
    return held, full, {n: _full(p) for n, p in model.named_parameters()}


def test_meta_built_fully_shard_model_loads_the_saved_values(run_on_ranks, tmp_path):
    saved = run_on_ranks(4, _save_fsdp, str(tmp_path))[0]
    for rank, (held, full, got) in enumerate(run_on_ranks(2, _meta_load, str(tmp_path))):
        assert held < 0.6 * full, (rank, held, full)  # its shards only, never the model
        _assert_same(got, {k: v for k, v in saved.items() if ":" not in k},
                     f"meta -> fsdp2, rank {rank}")


def _load_hf(path: str) -> tuple[int, int, dict[str, torch.Tensor]]:
    import hyperpar.checkpoint.hf as hf
    from hyperpar.checkpoint import load_safetensors

    real, read = hf.read_region, []

    def spy(*args):
        out = real(*args)
        read.append(out.numel())
        return out

    model = shard_blocks(llama.build(ARGS, seed=1))
    hf.read_region = spy
    try:
        load_safetensors(model, path)
    finally:
        hf.read_region = real  # the worker process serves later tests
    held = sum(p.to_local().numel() for p in model.parameters())
    return sum(read), held, {n: _full(p) for n, p in model.named_parameters()}


def test_full_safetensors_into_fully_shard_reads_only_each_ranks_rows(run_on_ranks, tmp_path):
    from safetensors.torch import save_file

    ref = llama.build(ARGS, seed=0)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    save_file(want, str(tmp_path / "model.safetensors"))
    full = sum(v.numel() for v in want.values())
    for rank, (read, held, got) in enumerate(run_on_ranks(2, _load_hf,
                                                          str(tmp_path / "model.safetensors"))):
        assert read == held < 0.6 * full, (rank, read, held, full)
        _assert_same(got, want, f"safetensors -> fsdp2, rank {rank}")
