"""``torch.distributed.checkpoint`` (DCP) on hyperpar DTensors: torch's own ``dcp.save`` /
``dcp.load`` (what torchtitan's checkpointer calls) writes each distinct shard once and loads
into another layout or world size, values equal to the last bit; a fully_shard model's state
dict round-trips from 2 ranks to 4 (uneven and empty pieces). Placements that hold no piece
of the value (Partial) are refused on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

dcp = pytest.importorskip("torch.distributed.checkpoint")

SHAPES = {"a": (7, 6), "b": (7, 6), "c": (3, 4), "d": (3, 4)}


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(ord(name))
    return torch.randn(*SHAPES[name], generator=g)


def _placements(spec: str) -> list:
    from hyperpar.dtensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in spec.split(",")]


def _state(mesh_shape: tuple[int, ...], specs: dict[str, str], fill: bool) -> dict:
    from hyperpar.dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    return {k: distribute_tensor(_full(k) if fill else torch.zeros(SHAPES[k]), mesh,
                                 _placements(v)) for k, v in specs.items()}


def _save(path: str, mesh_shape: tuple[int, ...], specs: dict[str, str]) -> None:
    state = _state(mesh_shape, specs, fill=True)
    state["plain"] = torch.arange(5.0)
    state["step"] = 17
    dcp.save(state, checkpoint_id=path)


def _load(path: str, mesh_shape: tuple[int, ...], specs: dict[str, str]) -> dict:
    state = _state(mesh_shape, specs, fill=False)
    state["plain"] = torch.zeros(5)
    state["step"] = 0
    dcp.load(state, checkpoint_id=path)
    out = {k: torch.equal(state[k].full_tensor(), _full(k)) for k in specs}
    out["plain"] = torch.equal(state["plain"], torch.arange(5.0))
    out["step"] = state["step"] == 17
    return out


SAVED = {"a": "S0,S1", "b": "R,S0", "c": "S1,R", "d": "R,R"}  # on a 2x2 mesh


@pytest.mark.parametrize("target", [
    ((2,), {"a": "S1", "b": "S0", "c": "R", "d": "S0"}),
    ((4,), {"a": "S0", "b": "S1", "c": "S0", "d": "S0"}),  # c, d: 3 rows, rank 3 empty
    ((2, 2), {"a": "R,S0", "b": "S1,S0", "c": "S0,S1", "d": "S1,S1"}),
], ids=["on-2-ranks", "on-4-ranks-uneven", "other-2d"])
def test_dcp_save_on_a_2d_mesh_loads_into_other_layouts(run_on_ranks, tmp_path, target):
    run_on_ranks(4, _save, str(tmp_path), (2, 2), SAVED)
    mesh_shape, specs = target
    world = 1
    for n in mesh_shape:
        world *= n
    for rank, same in enumerate(run_on_ranks(world, _load, str(tmp_path), mesh_shape, specs)):
        assert all(same.values()), (rank, same)


def _save_partial(path: str) -> str:
    from hyperpar.dtensor import DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    d = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
    try:
        dcp.save({"p": d}, checkpoint_id=path)
    except BaseException as exc:  # DCP wraps errors in CheckpointException, a BaseException
        return str(exc)
    return "saved"


def test_a_partial_dtensor_is_refused_on_every_rank(run_on_ranks, tmp_path):
    for rank, message in enumerate(run_on_ranks(2, _save_partial, str(tmp_path))):
        assert "holds no piece of its value" in message, (rank, message)
        assert "redistribute it to Shard/Replicate" in message, (rank, message)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _sharded_model(seed: int) -> nn.Module:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _model()
    mesh = init_device_mesh("cpu", (_world(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _world() -> int:
    from hyperpar.platform import get_platform

    return get_platform().world_size()


def _save_fsdp(path: str) -> None:
    dcp.save(_sharded_model(seed=0).state_dict(), checkpoint_id=path)


def _load_fsdp(path: str) -> dict:
    model = _sharded_model(seed=1)  # other values: the load must overwrite every shard
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    torch.manual_seed(0)
    reference = _model()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    same = {k: torch.equal(v.full_tensor(), reference.state_dict()[k]) for k, v in state.items()}
    with torch.no_grad():
        same["forward"] = torch.allclose(model(x), reference(x), rtol=1e-6, atol=1e-6)
    return same


def test_a_fully_sharded_model_saved_on_2_ranks_loads_on_4(run_on_ranks, tmp_path):
    run_on_ranks(2, _save_fsdp, str(tmp_path))
    for rank, same in enumerate(run_on_ranks(4, _load_fsdp, str(tmp_path))):
        assert all(same.values()), (rank, same)


def _async_save_then_overwrite(path: str, mesh_shape: tuple[int, ...], specs: dict[str, str]
                               ) -> bool:
    """torch's ``dcp.async_save`` (torchtitan's ``checkpoint.async_mode``) of hyperpar
    DTensors: the state is staged before the call returns, so overwriting the local pieces
    right after it must not reach the files. Waited on before the next collective: DCP's
    background thread runs its own collectives on the default group (give it a group of its
    own to overlap a training step; see docs/checkpoint.md)."""
    state = _state(mesh_shape, specs, fill=True)
    state["plain"] = torch.arange(5.0)
    state["step"] = 17
    future = dcp.async_save(state, checkpoint_id=path)
    for key in specs:
        state[key].to_local().fill_(-1.0)
    state["plain"].fill_(-1.0)
    future.result()
    return True


@pytest.mark.xfail(strict=True, raises=Exception, reason=(
    "known gap (docs/checkpoint.md): DCP's default stager copies a tensor's storage when "
    "data_ptr() != 0; hyperpar's DTensor answers its local piece's pointer (torch's wrapper "
    "answers 0), so the stager copies the wrapper's empty storage and fails. "
    "hyperpar.checkpoint.async_save is the asynchronous save of hyperpar DTensors meanwhile"))
def test_dcp_async_save_of_hyperpar_dtensors_loads_into_another_layout(run_on_ranks, tmp_path):
    if not hasattr(dcp, "async_save"):
        pytest.skip("this torch's DCP has no async_save")
    run_on_ranks(4, _async_save_then_overwrite, str(tmp_path), (2, 2), SAVED)
    target = {"a": "S1", "b": "S0", "c": "R", "d": "S0"}
    for rank, same in enumerate(run_on_ranks(2, _load, str(tmp_path), (2,), target)):
        assert all(same.values()), (rank, same)
