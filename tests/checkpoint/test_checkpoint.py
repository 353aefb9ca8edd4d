"""Sharded checkpoints: save on one layout, load on another (1, 2, 4 ranks; TP shards, replicas,
pipeline stages regrouped); full_state_dict gathers plain tensors on rank 0."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from torch import nn

from hyperpar.checkpoint import full_state_dict, load, read_index, save
from hyperpar.platform import get_platform


def _values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(6, 4, generator=g), "b": torch.randn(3, 5, generator=g),
            "c": torch.randn(4, generator=g), "d": torch.randn(5, generator=g),
            "buf": torch.randn(2, generator=g)}


class _Sharded(nn.Module):
    """``a`` Shard(0) (uneven on 4 ranks), ``b`` Shard(1), ``c`` Replicate, ``d`` a plain
    parameter, ``buf`` a plain buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
        v = _values(seed)
        self.a = nn.Parameter(distribute_tensor(v["a"], mesh, [Shard(0)]))
        self.b = nn.Parameter(distribute_tensor(v["b"], mesh, [Shard(1)]))
        self.c = nn.Parameter(distribute_tensor(v["c"], mesh, [Replicate()]))
        self.d = nn.Parameter(v["d"])
        self.register_buffer("buf", v["buf"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.a.full_tensor(), self.b.full_tensor(), self.c.full_tensor()
        return x @ a.T + b.sum() * c.mean() + self.d.sum() + self.buf.sum()


def _reference_output(v: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x @ v["a"].T + v["b"].sum() * v["c"].mean() + v["d"].sum() + v["buf"].sum()


X = torch.linspace(-1, 1, 12).reshape(3, 4)


def _save(path: str, file_format: str = "auto") -> None:
    save(_Sharded(seed=0), path, file_format=file_format)


def _load_and_run(path: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = _Sharded(seed=1)  # different values: load must overwrite them all
    load(model, path)
    with torch.no_grad():
        return full_state_dict(model), model(X)


@pytest.mark.parametrize("load_world", [1, 4])
def test_save_on_two_ranks_load_on_other_world_sizes(run_on_ranks, tmp_path, load_world):
    run_on_ranks(2, _save, str(tmp_path))
    results = run_on_ranks(load_world, _load_and_run, str(tmp_path))
    expected = _values(0)
    (state, out) = results[0]
    torch.testing.assert_close(state, expected, rtol=0, atol=0)
    for rank, (state, out) in enumerate(results):
        torch.testing.assert_close(out, _reference_output(expected, X), msg=f"rank {rank}")
        if rank:
            assert state == {}


def test_torch_save_format_round_trips(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), "torch")
    assert read_index(tmp_path)["file_format"] == "torch"
    save_id = read_index(tmp_path)["save_id"]
    assert sorted(os.listdir(tmp_path)) == [
        "index.json", f"shard-00000-of-00002-{save_id}.pt", f"shard-00001-of-00002-{save_id}.pt"]
    state, _ = run_on_ranks(2, _load_and_run, str(tmp_path))[0]
    torch.testing.assert_close(state, _values(0), rtol=0, atol=0)


def test_index_records_layout_and_writes_each_box_once(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path))
    index = json.loads((tmp_path / "index.json").read_text())
    has_safetensors = importlib.util.find_spec("safetensors") is not None
    assert index["file_format"] == ("safetensors" if has_safetensors else "torch")
    t = index["tensors"]
    assert t["a"]["shape"] == [6, 4] and t["a"]["dtype"] == "float32"
    assert t["a"]["placements"] == ["Shard(dim=0)"] and t["a"]["mesh_shape"] == [2]
    assert [(c["offset"], c["shape"], c["rank"]) for c in t["a"]["chunks"]] == [
        ([0, 0], [3, 4], 0), ([3, 0], [3, 4], 1)]
    assert [(c["offset"], c["shape"]) for c in t["b"]["chunks"]] == [
        ([0, 0], [3, 3]), ([0, 3], [3, 2])]
    for key in ("c", "d", "buf"):  # replicated on both ranks: written once, by rank 0
        assert [c["rank"] for c in t[key]["chunks"]] == [0], key


class _Stage(nn.Module):
    """A pipeline-like model: ``layers`` holds only the layers this stage owns (global
    names), plus a tied embedding present on every stage."""

    def __init__(self, owned: list[int], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        full = [nn.Linear(4, 4) for _ in range(4)]
        with torch.no_grad():
            for layer in full:
                layer.weight.copy_(torch.randn(4, 4, generator=g))
                layer.bias.copy_(torch.randn(4, generator=g))
            tied = torch.randn(4, 4, generator=g)
        self.layers = nn.ModuleDict({str(i): full[i] for i in owned})
        self.tied = nn.Parameter(tied)


def _save_pipeline(path: str) -> None:
    rank = get_platform().rank()
    save(_Stage([0, 1] if rank == 0 else [2, 3], seed=0), path)


def _load_regrouped(path: str) -> dict[str, torch.Tensor]:
    rank, world = get_platform().rank(), get_platform().world_size()
    owned = [i for i in range(4) if i * world // 4 == rank]
    model = _Stage(owned, seed=1)
    load(model, path)
    return full_state_dict(model)


@pytest.mark.parametrize("load_world", [1, 4])
def test_pipeline_stages_regroup_on_load(run_on_ranks, tmp_path, load_world):
    run_on_ranks(2, _save_pipeline, str(tmp_path))
    state = run_on_ranks(load_world, _load_regrouped, str(tmp_path))[0]
    expected = _Stage([0, 1, 2, 3], seed=0).state_dict()
    torch.testing.assert_close(state, dict(expected), rtol=0, atol=0)
    index = read_index(tmp_path)
    assert [c["rank"] for c in index["tensors"]["tied"]["chunks"]] == [0]


def _full_on_ranks() -> dict[str, torch.Tensor]:
    return full_state_dict(_Sharded(seed=0))


def test_full_state_dict_is_plain_on_rank_zero_and_empty_elsewhere(run_on_ranks):
    results = run_on_ranks(4, _full_on_ranks)
    assert all(r == {} for r in results[1:])
    assert list(results[0]) == ["a", "b", "c", "d", "buf"]
    assert all(type(t) is torch.Tensor for t in results[0].values())
    torch.testing.assert_close(results[0], _values(0), rtol=0, atol=0)


def _load_into(path: str, model_kind: str) -> str:
    if model_kind == "missing":
        model = nn.Linear(2, 2)
    else:
        model = _Sharded(seed=1)
        model.d = nn.Parameter(torch.zeros(7))
    try:
        load(model, path)
    except (KeyError, ValueError) as exc:
        return str(exc)
    return ""


def test_load_names_missing_keys_and_shape_mismatches(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path))
    missing = run_on_ranks(2, _load_into, str(tmp_path), "missing")[0]
    assert "'weight'" in missing and "not in" in missing
    shape = run_on_ranks(2, _load_into, str(tmp_path), "shape")[0]
    assert "'d'" in shape and "[7]" in shape and "[5]" in shape


# ------------------------------------------------------------------ real tensor parallelism
def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))


def _tp(model: nn.Module) -> nn.Module:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


XT = torch.linspace(-2, 2, 16).reshape(2, 8)


def _save_mlp(path: str, tensor_parallel: bool) -> torch.Tensor:
    model = _mlp(seed=0)
    if tensor_parallel:
        model = _tp(model)
    save(model, path)
    with torch.no_grad():
        return model(XT)


def _load_mlp(path: str, tensor_parallel: bool) -> torch.Tensor:
    model = _mlp(seed=1)
    if tensor_parallel:
        model = _tp(model)
    load(model, path)
    with torch.no_grad():
        return model(XT)


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2)])
def test_tensor_parallel_mlp_continues_with_identical_outputs(run_on_ranks, tmp_path,
                                                              save_world, load_world):
    saved = run_on_ranks(save_world, _save_mlp, str(tmp_path), save_world > 1)
    layout = read_index(tmp_path)["tensors"]["0.weight"]
    assert layout["placements"] == (["Shard(dim=0)"] if save_world > 1 else [])
    assert len(layout["chunks"]) == save_world
    loaded = run_on_ranks(load_world, _load_mlp, str(tmp_path), load_world > 1)
    for out in loaded:
        torch.testing.assert_close(out, saved[0])


def _pipeline_mlp(seed: int) -> nn.Module:
    from hyperpar.pipeline import PipelineModule

    torch.manual_seed(seed)
    layers = [nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)]  # names "0", "2" as in _mlp
    return PipelineModule(layers, num_stages=get_platform().world_size(),
                          partition_method="uniform", loss_fn=nn.functional.mse_loss)


def _load_pipeline(path: str) -> torch.Tensor | None:
    from hyperpar.pipeline import ScheduleGPipe

    model = _pipeline_mlp(seed=1)
    load(model, path)
    out = ScheduleGPipe(model, n_microbatches=2).step(
        XT, target=torch.zeros(2, 8), return_outputs=True)
    return None if out is None else out[1]


def test_save_on_tp2_load_on_pp2_continues_with_identical_outputs(run_on_ranks, tmp_path):
    saved = run_on_ranks(2, _save_mlp, str(tmp_path), True)[0]
    loaded = run_on_ranks(2, _load_pipeline, str(tmp_path))
    assert loaded[0] is None  # the first stage returns nothing; the last one the outputs
    torch.testing.assert_close(loaded[1], saved)


def _full_everywhere() -> dict[str, torch.Tensor]:
    return full_state_dict(_Sharded(seed=0), rank0_only=False)


def test_full_state_dict_can_be_given_to_every_rank(run_on_ranks):
    for state in run_on_ranks(2, _full_everywhere):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)


def _save_dp_tp(path: str) -> torch.Tensor:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_mlp(seed=0), mesh["tp"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    save(model, path)
    with torch.no_grad():
        return model(XT)


def test_dp2_tp2_replicas_are_written_once_and_load_on_one_rank(run_on_ranks, tmp_path):
    saved = run_on_ranks(4, _save_dp_tp, str(tmp_path))[0]
    chunks = read_index(tmp_path)["tensors"]["0.weight"]["chunks"]
    assert [c["rank"] for c in chunks] == [0, 1]  # dp replica {2, 3} wrote nothing
    torch.testing.assert_close(run_on_ranks(1, _load_mlp, str(tmp_path), False)[0], saved)


# ------------------------------------------------------------------ optimizer state
def _adam_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> torch.Tensor:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model(XT)


def _train_and_save(path: str, tensor_parallel: bool) -> None:
    model = _tp(_mlp(seed=0)) if tensor_parallel else _mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _adam_steps(model, opt, range(2))
    save(model, path, optimizer=opt)


def _resume(path: str, tensor_parallel: bool) -> torch.Tensor:
    model = _tp(_mlp(seed=1)) if tensor_parallel else _mlp(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)  # lr comes back from the checkpoint
    load(model, path, optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.05
    return _adam_steps(model, opt, range(2, 4))


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2)])
def test_adam_state_reshards_so_training_resumes_exactly(run_on_ranks, tmp_path, save_world,
                                                         load_world):
    run_on_ranks(save_world, _train_and_save, str(tmp_path), save_world > 1)
    index = read_index(tmp_path)
    assert "optimizer.0.weight.exp_avg" in index["tensors"]
    assert "optimizer.0.weight.step" in index["tensors"]  # Adam keeps its step as a tensor
    assert index["optimizer"]["param_groups"][0]["lr"] == 0.05
    resumed = run_on_ranks(load_world, _resume, str(tmp_path), load_world > 1)
    model = _mlp(seed=0)
    uninterrupted = _adam_steps(model, torch.optim.Adam(model.parameters(), lr=0.05), range(4))
    for out in resumed:
        torch.testing.assert_close(out, uninterrupted)
