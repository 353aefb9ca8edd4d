"""Generic DTensor state dicts on n-D meshes: saved on one layout, loaded into another (4 -> 2
ranks, Shard(0) -> Shard(1), a 2-D (dp, tp) mesh -> one process); full safetensors files (a
Hugging Face ``model.safetensors``) loaded into a sharded model, each rank reading its slices."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from hyperpar.checkpoint import full_state_dict, load, load_safetensors, read_index, save
from hyperpar.platform import get_platform

ROWS, COLS = 7, 6  # uneven on 2 and 4 ranks


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn(ROWS, COLS, generator=g)


def _placements(spec: str) -> list:
    from hyperpar.dtensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in spec.split(",")]


def _state(mesh_shape: tuple[int, ...], specs: dict[str, str], zero: bool = False
           ) -> dict[str, torch.Tensor]:
    """``{name: distribute_tensor(full, mesh, placements)}`` (or zeros with that layout)."""
    from hyperpar.dtensor import distribute_tensor, init_device_mesh

    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = init_device_mesh(mesh_shape, mesh_dim_names=names)
    return {k: distribute_tensor(torch.zeros(ROWS, COLS) if zero else _full(k), mesh,
                                 _placements(spec))
            for k, spec in specs.items()}


class _Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in tensors.items():
            self.register_parameter(k, nn.Parameter(v))


def _save_state(path: str, mesh_shape: tuple[int, ...], specs: dict[str, str]) -> None:
    save(_state(mesh_shape, specs), path)


def _load_into(path: str, mesh_shape: tuple[int, ...], specs: dict[str, str],
               verify: bool = True) -> dict[str, bool]:
    """Load into zeros laid out as ``specs``; per tensor: does the local shard equal what
    ``distribute_tensor`` gives this rank?"""
    model = _Holder(_state(mesh_shape, specs, zero=True))
    load(model, path, verify=verify)
    expected = _state(mesh_shape, specs)
    return {k: torch.equal(getattr(model, k).to_local(), expected[k].to_local())
            for k in specs}


def _load_plain(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    model = _Holder({k: torch.zeros(ROWS, COLS) for k in names})
    load(model, path)
    return {k: getattr(model, k).detach() for k in names}


ONE_D = {"a": "S0", "b": "S1", "c": "R"}


@pytest.mark.parametrize("target", [
    ((2,), {"a": "S0", "b": "S1", "c": "R"}),   # same placements, fewer ranks
    ((2,), {"a": "S1", "b": "S0", "c": "S0"}),   # a TP layout: other dims
    ((2, 2), {"a": "S0,S1", "b": "R,S0", "c": "S1,S1"}),  # 1-D save into a 2-D mesh
    ((2,), {"a": "S1", "b": "S0", "c": "S0"}, False),   # slices only, no digests
], ids=["shard0-on-2", "tp-on-2", "2d-on-4", "tp-on-2-unverified"])
def test_shard0_on_4_ranks_loads_into_other_layouts(run_on_ranks, tmp_path, target):
    run_on_ranks(4, _save_state, str(tmp_path), (4,), ONE_D)
    chunks = read_index(tmp_path)["tensors"]["a"]["chunks"]
    assert [(c["offset"][0], c["shape"][0]) for c in chunks] == [(0, 2), (2, 2), (4, 2),
                                                                  (6, 1)]
    mesh_shape = target[0]
    world = math.prod(mesh_shape)
    for rank, same in enumerate(run_on_ranks(world, _load_into, str(tmp_path), *target)):
        assert all(same.values()), (rank, same)


TWO_D = {"a": "S0,S0", "b": "S0,S1", "c": "R,S1"}


def test_2d_mesh_save_loads_into_one_process(run_on_ranks, tmp_path):
    run_on_ranks(4, _save_state, str(tmp_path), (2, 2), TWO_D)
    index = read_index(tmp_path)
    # (Shard(0), Shard(0)): dp splits 7 rows 4/3, tp splits each again: rows 0,2 | 4,6
    assert [(c["offset"], c["shape"]) for c in index["tensors"]["a"]["chunks"]] == [
        ([0, 0], [2, 6]), ([2, 0], [2, 6]), ([4, 0], [2, 6]), ([6, 0], [1, 6])]
    assert len(index["tensors"]["c"]["chunks"]) == 2  # the dp replica wrote nothing
    (state,) = run_on_ranks(1, _load_plain, str(tmp_path), list(TWO_D))
    for k in TWO_D:
        torch.testing.assert_close(state[k], _full(k), rtol=0, atol=0)


def test_2d_mesh_save_loads_into_another_2d_layout(run_on_ranks, tmp_path):
    run_on_ranks(4, _save_state, str(tmp_path), (2, 2), TWO_D)
    target = {"a": "S1,S0", "b": "R,R", "c": "S0,S0"}
    for rank, same in enumerate(run_on_ranks(4, _load_into, str(tmp_path), (2, 2), target)):
        assert all(same.values()), (rank, same)


def _gather_2d() -> dict[str, torch.Tensor]:
    return full_state_dict(_state((2, 2), TWO_D))


def test_full_state_dict_of_a_2d_mesh(run_on_ranks):
    state = run_on_ranks(4, _gather_2d)[0]
    for k in TWO_D:
        torch.testing.assert_close(state[k], _full(k), rtol=0, atol=0)


# ------------------------------------------------------------------ full safetensors files
HF = {"embed.weight": (10, 4), "layers.0.weight": (6, 4), "norm.weight": (4,)}
HF_LAYOUT = {"embed.weight": "S0", "layers.0.weight": "S1", "norm.weight": "R"}


def _hf_tensor(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn(*HF[name], generator=g)


def _write_hf(folder, layout: str, extra: bool = False) -> str:
    from safetensors.torch import save_file

    tensors = {k: _hf_tensor(k).to(torch.bfloat16) for k in HF}  # cast to the model's fp32
    if extra:
        tensors["lm_head.weight"] = torch.ones(3, 4, dtype=torch.bfloat16)
    if layout == "file":
        save_file(tensors, str(folder / "model.safetensors"))
        return str(folder / "model.safetensors")
    names = list(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:1],
             "model-00002-of-00002.safetensors": names[1:]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


class _HFModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from hyperpar.dtensor import distribute_tensor, init_device_mesh

        mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("dp",))
        self.embed = nn.Module()
        self.layers = nn.ModuleList([nn.Module()])
        self.norm = nn.Module()
        for mod, name in ((self.embed, "embed.weight"), (self.layers[0], "layers.0.weight"),
                          (self.norm, "norm.weight")):
            mod.weight = nn.Parameter(distribute_tensor(torch.zeros(HF[name]), mesh,
                                                        _placements(HF_LAYOUT[name])))
        self.head = nn.Module()
        self.head.weight = self.embed.weight  # tied: the file holds it as embed.weight only


def _load_hf(path: str) -> tuple[dict[str, bool], int, int]:
    """Per tensor: local shard equals the bf16 file's value; elements read vs held."""
    import hyperpar.checkpoint.hf as hf

    real, read = hf.read_region, []

    def spy(*args):
        out = real(*args)
        read.append(out.numel())
        return out

    hf.read_region = spy
    try:
        model = _HFModel()
        load_safetensors(model, path)
    finally:
        hf.read_region = real  # the worker process serves later tests
    from hyperpar.dtensor import distribute_tensor

    ok = {}
    for name, p in model.named_parameters():
        want = _hf_tensor(name).to(torch.bfloat16).float()
        ok[name] = torch.equal(p.to_local(),
                               distribute_tensor(want, p.device_mesh, p.placements).to_local())
    held = sum(p.to_local().numel() for p in model.parameters())
    return ok, sum(read), held


@pytest.mark.parametrize("layout", ["file", "hf-index-folder"])
def test_full_safetensors_loads_into_sharded_model_reading_only_local_slices(
        run_on_ranks, tmp_path, layout):
    path = _write_hf(tmp_path, layout)
    for rank, (ok, read, held) in enumerate(run_on_ranks(2, _load_hf, path)):
        assert all(ok.values()), (rank, ok)
        assert read == held, (rank, read, held)  # 5*4 + 6*2 + 4, not the 10*4 + 6*4 + 4


def _load_hf_error(path: str, strict: bool) -> str:
    try:
        result = load_safetensors(_HFModel(), path, strict=strict)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return repr(result)


def test_load_safetensors_strict_names_keys_the_model_lacks(run_on_ranks, tmp_path):
    path = _write_hf(tmp_path, "file", extra=True)
    for error in run_on_ranks(2, _load_hf_error, path, True):
        assert "CheckpointError" in error and "'lm_head.weight'" in error, error
    for result in run_on_ranks(2, _load_hf_error, path, False):
        assert result == "LoadResult(missing_keys=[], unexpected_keys=['lm_head.weight'])"
