"""hyperpar checkpoints of MindSpore Cells, on real ranks: the folder format of
``hyperpar.checkpoint`` (docs/checkpoint.md) written from numpy through safetensors.

* saved on 2 tensor-parallel ranks, loaded in one process, and the reverse (resharding);
* ★ cross-framework: a checkpoint saved by a PyTorch model (the torch venv, as a subprocess)
  loads into the same architecture written as a MindSpore Cell through
  ``name_map=torch_name_map(cell)``, and a Cell's checkpoint (saved on 2 tp ranks) loads into
  the torch model;
* ★ optimizer state across frameworks: torch Adam / SGD trained, saved, resumed by
  nn.Adam / nn.Momentum / nn.SGD (and back) -- the resumed step equals the other framework's.
  Every torch step runs in one torch-venv process (the ``torch_runs`` fixture).

The model: LayerNorm(8) -> Dense(8, 7) -> ReLU -> Dense(7, 8), tp plan
``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}`` (7 rows: 4 + 3 on 2 ranks). A checkpoint
moves bytes: loaded parameters must equal the saved ones to the last bit (``array_equal``). The
losses on one batch are computed by different kernels (torch / MindSpore, 1 or 2 ranks: the
row-parallel sum is split), so they agree to float32 rounding of sums of <= 8 O(1) terms:
rtol 1e-5; a wrong or transposed tensor is O(1) off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.mindspore._ckpt_model import SHAPES, weights
from tests.mindspore.conftest import _pool

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5
#: (placement, global shape) of each parameter under the tp plan, by torch's names
TP_LAYOUT = {"fc1.weight": ("shard0", SHAPES["fc1.weight"]), "fc1.bias": ("shard0", (7,)),
             "fc2.weight": ("shard1", SHAPES["fc2.weight"])}


@pytest.fixture
def pool1(ms_pools):
    return _pool(ms_pools, 1)


def _net(seed: int, tp: int):
    """The Cell with weights from ``seed``, tensor-parallel over ``tp`` ranks when > 1."""
    import mindspore as ms
    from hyperpar_mindspore.checkpoint import torch_name_map
    from mindspore import nn, ops

    from hyperpar import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            # torch.nn.LayerNorm's eps (MindSpore's default is 1e-7): the same architecture
            self.norm = nn.LayerNorm((8,), epsilon=1e-5)
            self.fc1, self.fc2 = nn.Dense(8, 7), nn.Dense(7, 8)

        def construct(self, x):
            return self.fc2(ops.relu(self.fc1(self.norm(x))))

    net = Net()
    names = torch_name_map(net)
    w = weights(seed)
    for name, p in net.parameters_and_names():
        p.set_data(ms.Tensor(w[names.get(name, name)]))
    mesh = None
    if tp > 1:
        mesh = init_device_mesh((tp,), mesh_dim_names=("tp",))
        parallelize_module(net, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return net, names, mesh


def _report(net, names, mesh) -> dict:
    """Loss on the fixed batch and every parameter, whole (gathered over tp), by torch's
    names."""
    import mindspore as ms

    from hyperpar import DTensor, Shard
    from tests.mindspore._ckpt_model import batch

    x, y = (ms.Tensor(a) for a in batch())
    loss = float(((net(x) - y) ** 2).mean().asnumpy())
    params = {}
    for name, p in net.parameters_and_names():
        key = names.get(name, name)
        local = p.asnumpy()
        if mesh is not None and key in TP_LAYOUT:
            placement, shape = TP_LAYOUT[key]
            d = int(placement[-1])
            local = DTensor.from_local(ms.Tensor(local), mesh, [Shard(d)],
                                       shape=shape).full_tensor().asnumpy()
        params[key] = local
    return {"loss": loss, "params": params}


def _save(folder: str, tp: int, seed: int) -> dict:
    from hyperpar import checkpoint

    net, names, mesh = _net(seed, tp)
    checkpoint.save(net, folder, name_map=names)
    return _report(net, names, mesh)


def _load(folder: str, tp: int, seed: int) -> dict:
    from hyperpar import checkpoint

    net, names, mesh = _net(seed, tp)
    result = checkpoint.load(net, folder, name_map=names)
    assert tuple(result) == ([], []), result
    return _report(net, names, mesh)


def _same_params(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for key in want:
        assert got[key].dtype == np.float32 and np.array_equal(got[key], want[key]), (
            f"{what}: {key} differs (max |diff| "
            f"{np.max(np.abs(got[key] - want[key]))})")


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= RTOL * max(1.0, abs(want)), f"{what}: {got} vs {want}"


def test_tp2_checkpoint_loads_in_one_process_and_one_process_checkpoint_loads_on_tp2(
        pool1, pool2, tmp_path) -> None:
    tp2, one = str(tmp_path / "tp2"), str(tmp_path / "one")
    saved = pool2.run(_save, tp2, 2, 0)
    index = json.loads((tmp_path / "tp2" / "index.json").read_text())
    fc1 = index["tensors"]["fc1.weight"]
    assert fc1["shape"] == [7, 8] and fc1["placements"] == ["Shard(dim=0)"], fc1
    assert sorted(c["shape"][0] for c in fc1["chunks"]) == [3, 4], fc1["chunks"]
    _same_params(saved[0]["params"], weights(0), "saved on tp2")
    loaded = pool1.run(_load, tp2, 1, 3)[0]  # other weights before the load
    _same_params(loaded["params"], weights(0), "tp2 -> one process")
    _close(loaded["loss"], saved[0]["loss"], "loss, tp2 -> one process")

    saved1 = pool1.run(_save, one, 1, 5)[0]
    for rank, res in enumerate(pool2.run(_load, one, 2, 3)):
        _same_params(res["params"], weights(5), f"rank {rank}: one process -> tp2")
        _close(res["loss"], saved1["loss"], f"rank {rank}: loss, one process -> tp2")


def _torch_python() -> Path:
    """The torch venv's python: $HYPERPAR_TORCH_PYTHON, else the checkout's .venv (where
    scripts/test.sh builds it)."""
    given = os.environ.get("HYPERPAR_TORCH_PYTHON")
    return Path(given) if given else ROOT / ".venv" / "bin" / "python"


def _decode(params: dict) -> dict:
    return {k: np.frombuffer(bytes.fromhex(v), np.float32).reshape(SHAPES[k])
            for k, v in params.items()}


@pytest.fixture(scope="module")
def torch_runs(ms_pools, tmp_path_factory) -> dict:
    """Every torch step of the cross-framework tests in ONE torch-venv process
    (tests/mindspore/_torch_side.py; torch's start-up is ~10 s here): MindSpore saves first --
    the Cell of weights(9) on 2 tp ranks, each optimizer pair trained 2 steps on fsdp2 --
    then torch saves, loads those and trains. The tests check what each side got."""
    if not _torch_python().exists():
        if os.environ.get("CI") == "true":  # CI builds the torch venv first: its absence is a bug
            pytest.fail(f"no torch venv at {_torch_python()} under CI (set HYPERPAR_TORCH_PYTHON)")
        pytest.skip(f"no torch venv at {_torch_python()} (set HYPERPAR_TORCH_PYTHON): the "
                    "torch side of this test runs there")
    folder = tmp_path_factory.mktemp("cross")
    pool2 = _pool(ms_pools, 2)
    ms_model = pool2.run(_save, str(folder / "ms"), 2, 9)[0]
    ms_optim = pool2.run(_ms_optim_train_save, str(folder))
    env = {**os.environ, "HYPERPAR_BACKEND": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends" / "hyperpar-cpu")])}
    done = subprocess.run(
        [str(_torch_python()), "-m", "hyperpar.cli", "run", "-n", "1",
         str(ROOT / "tests" / "mindspore" / "_torch_side.py"), str(folder),
         str(folder / "torch.json")], env=env, capture_output=True, text=True, timeout=600,
        cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((folder / "torch.json").read_text())
    for part in ("save", "load"):
        report[part]["params"] = _decode(report[part]["params"])
    return {"folder": folder, "ms_model": ms_model, "ms_optim": ms_optim, **report}


def test_torch_checkpoint_loads_into_the_mindspore_cell_and_back(pool2, torch_runs) -> None:
    folder = torch_runs["folder"]
    # torch (one process) -> MindSpore (2 tp ranks: resharded on the way)
    from_torch = torch_runs["save"]
    _same_params(from_torch["params"], weights(0), "torch model before saving")
    for rank, res in enumerate(pool2.run(_load, str(folder / "torch"), 2, 3)):
        _same_params(res["params"], weights(0), f"rank {rank}: torch -> MindSpore")
        _close(res["loss"], from_torch["loss"], f"rank {rank}: loss, torch -> MindSpore")
    # MindSpore (2 tp ranks) -> torch (one process)
    from_ms, in_torch = torch_runs["ms_model"], torch_runs["load"]
    _same_params(in_torch["params"], weights(9), "MindSpore -> torch")
    _close(in_torch["loss"], from_ms["loss"], "loss, MindSpore -> torch")
    assert sys.modules.get("torch") is None  # this process stayed torch-free


def _load_without_name_map(folder: str) -> str:
    from hyperpar import checkpoint

    net, _names, _mesh = _net(1, 1)
    try:
        checkpoint.load(net, folder)
    except Exception as exc:  # every rank must raise, naming the fix
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_torch_names_without_name_map_are_refused_on_every_rank(pool2, tmp_path) -> None:
    folder = str(tmp_path / "torch-names")
    pool2.run(_save, folder, 2, 0)  # saved under torch's names (name_map=torch_name_map)
    for rank, err in enumerate(pool2.run(_load_without_name_map, folder)):
        assert err.startswith("CheckpointError") and "name_map=" in err, (rank, err)
        assert "'norm.gamma'" in err and "'norm.weight'" in err, (rank, err)


# ------------------------------------------------------------------ fully_shard (FSDP2) Cells
def _fsdp_net(seed: int, hsdp: bool = False):
    """The Cell with weights from ``seed``, fully sharded over every rank (``hsdp``: on a
    (replicate, shard) = (2, 2) mesh): fc1, fc2, then the root (which holds the norm). fc1's 7
    rows split 4 + 3 over 2 shard ranks: the second's shard has a padding row."""
    from hyperpar import fully_shard, init_device_mesh

    net, names, _mesh = _net(seed, 1)
    mesh = init_device_mesh((2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    for cell in (net.fc1, net.fc2, net):
        fully_shard(cell, mesh=mesh)
    return net, names


def _fsdp_report(net, names) -> dict:
    """Loss on the fixed batch, every parameter gathered whole, this rank's shards as stored
    (padded) and where they sit, by torch's names."""
    import mindspore as ms

    from tests.mindspore._ckpt_model import batch

    x, y = (ms.Tensor(a) for a in batch())
    loss = float(((net(x) - y) ** 2).mean().asnumpy())
    full = {names.get(k, k): v.asnumpy() for k, v in net.full_parameters().items()}
    shards = {names.get(k, k): p.asnumpy() for k, p in net.parameters_and_names()}
    layout = {}
    for cell in (net.fc1, net.fc2, net):
        layout.update({names.get(k, k): v for k, v in cell.shard_layout().items()})
    return {"loss": loss, "params": full, "shards": shards, "layout": layout}


def _load_fsdp(folder: str, seed: int) -> dict:
    from hyperpar import checkpoint

    net, names = _fsdp_net(seed)
    result = checkpoint.load(net, folder, name_map=names)
    assert tuple(result) == ([], []), result
    return _fsdp_report(net, names)


def _train_save_fsdp(folder: str, seed: int, hsdp: bool = False) -> dict:
    """Two SGD steps on this rank's own data (so the saved values are no seed's weights), then
    save."""
    import mindspore as ms
    from mindspore import nn

    from hyperpar import checkpoint
    from hyperpar.platform import get_platform

    net, names = _fsdp_net(seed, hsdp)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    step = ms.value_and_grad(lambda a, b: ((net(a) - b) ** 2).mean(), None, opt.parameters)
    rng = np.random.default_rng(100 + get_platform().rank())
    x, y = (ms.Tensor(rng.standard_normal((4, 8)).astype(np.float32)) for _ in range(2))
    for _ in range(2):
        _loss, grads = step(x, y)
        opt(grads)
    checkpoint.save(net, folder, name_map=names)
    return _fsdp_report(net, names)


def _check_shards(res: dict, want: dict, what: str) -> None:
    """Each shard holds its torch.chunk rows of ``want`` bit for bit, its padding zero."""
    for key, (start, held, padded) in res["layout"].items():
        shard = res["shards"][key]
        assert shard.shape[0] == padded, (what, key, shard.shape, padded)
        assert np.array_equal(shard[:held], want[key][start:start + held]), (what, key)
        assert not shard[held:].any(), f"{what}: {key}: padding rows are not zero"


def test_tp2_checkpoint_loads_as_fsdp2_and_an_fsdp2_checkpoint_loads_in_one_process(
        pool1, pool2, tmp_path) -> None:
    """Resharding through fully_shard: tp2 -> fsdp2 (each rank reads its dim-0 rows, padding
    kept zero), and fsdp2 (after two SGD steps) -> one process, bit for bit."""
    tp2, fsdp2 = str(tmp_path / "tp2"), str(tmp_path / "fsdp2")
    saved = pool2.run(_save, tp2, 2, 0)
    for rank, res in enumerate(pool2.run(_load_fsdp, tp2, 3)):
        _same_params(res["params"], weights(0), f"rank {rank}: tp2 -> fsdp2")
        _check_shards(res, weights(0), f"rank {rank}: tp2 -> fsdp2")
        assert res["layout"]["fc1.weight"] == ((0, 4, 4), (4, 3, 4))[rank], res["layout"]
        _close(res["loss"], saved[0]["loss"], f"rank {rank}: loss, tp2 -> fsdp2")

    trained = pool2.run(_train_save_fsdp, fsdp2, 5)
    for res in trained[1:]:  # a fully-sharded model is one model: every rank gathers the same
        _same_params(res["params"], trained[0]["params"], "fsdp2 ranks agree")
    assert not any(np.array_equal(trained[0]["params"][k], v) for k, v in weights(5).items())
    index = json.loads((tmp_path / "fsdp2" / "index.json").read_text())
    fc1 = index["tensors"]["fc1.weight"]
    assert fc1["shape"] == [7, 8] and fc1["placements"] == ["Shard(dim=0)"], fc1
    assert sorted((c["offset"][0], c["shape"][0]) for c in fc1["chunks"]) == [(0, 4), (4, 3)]
    loaded = pool1.run(_load, fsdp2, 1, 3)[0]
    _same_params(loaded["params"], trained[0]["params"], "fsdp2 -> one process")
    _close(loaded["loss"], trained[0]["loss"], "loss, fsdp2 -> one process")


def _dp_tp_net(seed: int):
    """The Cell with weights from ``seed`` on a (dp, tp) = (2, 2) mesh: tensor-parallel over
    "tp" (fc1's 7 rows split 4 + 3, fc2's 7 columns), then fully_shard over "dp" (fc1, fc2, the
    root): each shard is rows of a tp piece -- tp rank 1's 3 rows of fc1 split 2 + 1, so its dp
    rank 1 holds a padding row; fc2.bias and the norm are whole over tp, rows over dp."""
    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        init_device_mesh,
        parallelize_module,
    )

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    net, names, _ = _net(seed, 1)
    parallelize_module(net, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for cell in (net.fc1, net.fc2, net):
        fully_shard(cell, mesh=mesh["dp"])
    return net, names, mesh


def _dp_tp_report(net, names, mesh, opt) -> dict:
    """Loss on the fixed batch, every parameter whole (gathered over dp, then tp), and this
    rank's shards of the parameters and Adam moments as stored (padded)."""
    import mindspore as ms

    from hyperpar import DTensor, Shard
    from tests.mindspore._ckpt_model import batch

    x, y = (ms.Tensor(a) for a in batch())
    loss = float(((net(x) - y) ** 2).mean().asnumpy())
    params = {}
    for name, value in net.full_parameters().items():
        key = names.get(name, name)
        if key in TP_LAYOUT:
            placement, shape = TP_LAYOUT[key]
            value = DTensor.from_local(value, mesh["tp"], [Shard(int(placement[-1]))],
                                       shape=shape).full_tensor()
        params[key] = value.asnumpy()
    stored = {names.get(k, k): p.asnumpy() for k, p in net.parameters_and_names()}
    stored.update({s.name: s.asnumpy() for s in list(opt.moment1) + list(opt.moment2)})
    return {"loss": loss, "params": params, "stored": stored,
            "beta1_power": float(opt.beta1_power.asnumpy())}


def _train_save_dp_tp(folder: str, seed: int) -> dict:
    """Two Adam steps on dp x tp, each dp replica on its own data (the tp pair on the same),
    then save with the optimizer."""
    import mindspore as ms
    from mindspore import nn

    from hyperpar import checkpoint

    net, names, mesh = _dp_tp_net(seed)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    step = ms.value_and_grad(lambda a, b: ((net(a) - b) ** 2).mean(), None, opt.parameters)
    rng = np.random.default_rng(100 + mesh["dp"].get_local_rank())
    x, y = (ms.Tensor(rng.standard_normal((4, 8)).astype(np.float32)) for _ in range(2))
    for _ in range(2):
        _loss, grads = step(x, y)
        opt(grads)
    checkpoint.save(net, folder, name_map=names, optimizer=opt)
    return {**_dp_tp_report(net, names, mesh, opt), "dp": mesh["dp"].get_local_rank(),
            "tp": mesh["tp"].get_local_rank()}


def _load_dp_tp(folder: str, seed: int) -> dict:
    from mindspore import nn

    from hyperpar import checkpoint

    net, names, mesh = _dp_tp_net(seed)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    result = checkpoint.load(net, folder, name_map=names, optimizer=opt)
    assert tuple(result) == ([], []), result
    return _dp_tp_report(net, names, mesh, opt)


def _load_save_one_process(src: str, dst: str, seed: int) -> dict:
    """One process: load ``src`` with an Adam over the whole Cell, then save it to ``dst``."""
    from mindspore import nn

    from hyperpar import checkpoint

    net, names, _mesh = _net(seed, 1)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    result = checkpoint.load(net, src, name_map=names, optimizer=opt)
    assert tuple(result) == ([], []), result
    checkpoint.save(net, dst, name_map=names, optimizer=opt)
    return {**_report(net, names, None), "beta1_power": float(opt.beta1_power.asnumpy())}


def test_dp2_x_tp2_checkpoint_loads_in_one_process_and_back(pool1, pool4, tmp_path) -> None:
    """fully_shard over mesh["dp"] of a tensor-parallel Cell: each parameter's box is its tp
    box composed with the dp rows. Trained 2 Adam steps on (dp, tp) = (2, 2) and saved with the
    optimizer; loaded in one process (every parameter bit-equal to the 4 ranks' gathered
    values), saved there, loaded back on (2, 2) into a Cell of other weights: every rank's
    stored shards of the parameters and both Adam moments bit-equal to those saved, padding
    rows zero."""
    dp_tp, one = str(tmp_path / "dp2-tp2"), str(tmp_path / "one")
    trained = pool4.run(_train_save_dp_tp, dp_tp, 5)
    for res in trained[1:]:  # one model: every rank gathers the same
        _same_params(res["params"], trained[0]["params"], "dp x tp ranks agree")
    assert not any(np.array_equal(trained[0]["params"][k], v) for k, v in weights(5).items())
    index = json.loads((tmp_path / "dp2-tp2" / "index.json").read_text())
    fc1 = index["tensors"]["fc1.weight"]   # 7 rows: tp 4 + 3, each split over dp 2 + 2, 2 + 1
    assert fc1["shape"] == [7, 8] and fc1["mesh_shape"] == [2, 2], fc1
    assert index["tensors"]["fc2.weight"]["placements"] == ["Shard(dim=1)", "Shard(dim=0)"]
    assert sorted((c["offset"][0], c["shape"][0]) for c in fc1["chunks"]) == [
        (0, 2), (2, 2), (4, 2), (6, 1)], fc1
    fc2 = index["tensors"]["fc2.weight"]   # (8, 7): tp columns 4 + 3, dp rows 4 + 4
    assert sorted((tuple(c["offset"]), tuple(c["shape"])) for c in fc2["chunks"]) == [
        ((0, 0), (4, 4)), ((0, 4), (4, 3)), ((4, 0), (4, 4)), ((4, 4), (4, 3))], fc2
    # whole over tp: the tp pair's identical rows are written once
    assert len(index["tensors"]["fc2.bias"]["chunks"]) == 2, index["tensors"]["fc2.bias"]

    loaded = pool1.run(_load_save_one_process, dp_tp, one, 3)[0]
    _same_params(loaded["params"], trained[0]["params"], "dp x tp -> one process")
    _close(loaded["loss"], trained[0]["loss"], "loss, dp x tp -> one process")
    assert loaded["beta1_power"] == trained[0]["beta1_power"] != 1.0

    back = pool4.run(_load_dp_tp, one, 7)
    for rank, (got, want) in enumerate(zip(back, trained, strict=True)):
        _same_params(got["params"], want["params"], f"rank {rank}: one process -> dp x tp")
        assert sorted(got["stored"]) == sorted(want["stored"]), rank
        for key, arr in want["stored"].items():   # padded shards: padding zero on both sides
            assert np.array_equal(got["stored"][key], arr), (rank, key)
        assert any(k.startswith("moment1.") and v.any() for k, v in got["stored"].items())
        _close(got["loss"], want["loss"], f"rank {rank}: loss, one process -> dp x tp")

    # tp rank 1's copy of a parameter whole over tp (fc2.bias: rows over dp) made to differ,
    # as a hand split or diverged replicas would: refused on every rank, nothing written
    refused = pool4.run(_save_with_one_replica_changed, str(tmp_path / "differ"))
    for msg in refused:
        assert msg.startswith("CheckpointError") and "'fc2.bias' (ranks 0 vs 1)" in msg and (
            "'fc2.bias' (ranks 2 vs 3)" in msg), msg
    assert not (tmp_path / "differ" / "index.json").exists()


def _save_with_one_replica_changed(folder: str) -> str:
    from hyperpar import checkpoint

    net, names, mesh = _dp_tp_net(5)
    changed = [p for p in net.trainable_params() if p.name.endswith("fc2.bias")]
    assert len(changed) == 1, [p.name for p in net.trainable_params()]
    if mesh["tp"].get_local_rank() == 1:
        changed[0].set_data(changed[0] + 1)
    try:
        checkpoint.save(net, folder, name_map=names)
    except Exception as exc:  # noqa: BLE001 -- the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.fixture
def pool4(ms_pools):
    return _pool(ms_pools, 4)


def test_hsdp_checkpoint_writes_each_box_once_and_loads_in_one_process(
        pool1, pool4, tmp_path) -> None:
    """HSDP (replicate 2 x shard 2), 2 SGD steps on different data per rank, saved: the two
    replicas' identical rows are written once; loaded in one process, bit for bit."""
    folder = str(tmp_path / "hsdp")
    trained = pool4.run(_train_save_fsdp, folder, 5, True)
    for res in trained[1:]:
        _same_params(res["params"], trained[0]["params"], "hsdp ranks agree")
    index = json.loads((tmp_path / "hsdp" / "index.json").read_text())
    fc1 = index["tensors"]["fc1.weight"]
    assert fc1["placements"] == ["Replicate()", "Shard(dim=0)"], fc1
    assert fc1["mesh_shape"] == [2, 2], fc1
    assert sorted((c["offset"][0], c["shape"][0]) for c in fc1["chunks"]) == [(0, 4), (4, 3)]
    loaded = pool1.run(_load, folder, 1, 3)[0]
    _same_params(loaded["params"], trained[0]["params"], "hsdp -> one process")
    _close(loaded["loss"], trained[0]["loss"], "loss, hsdp -> one process")


# ------------------------------------------------------------------ optimizer state
def _train_save_fsdp_adam(folder: str, seed: int) -> dict:
    """Two Adam steps on fsdp2 with this rank's own data, then save model and optimizer.
    Returns this rank's unpadded rows of every moment and the optimizer's scalars."""
    import mindspore as ms
    from mindspore import nn

    from hyperpar import checkpoint
    from hyperpar.platform import get_platform

    net, names = _fsdp_net(seed)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    step = ms.value_and_grad(lambda a, b: ((net(a) - b) ** 2).mean(), None, opt.parameters)
    rng = np.random.default_rng(100 + get_platform().rank())
    x, y = (ms.Tensor(rng.standard_normal((4, 8)).astype(np.float32)) for _ in range(2))
    for _ in range(2):
        _loss, grads = step(x, y)
        opt(grads)
    checkpoint.save(net, folder, name_map=names, optimizer=opt)
    layout = {}
    for cell in (net.fc1, net.fc2, net):
        layout.update(cell.shard_layout())
    moments = {}
    for state in list(opt.moment1) + list(opt.moment2):
        prefix, _, param = state.name.partition(".")
        start, held, _padded = layout[param]
        moments[(prefix, names.get(param, param))] = (start, state.asnumpy()[:held])
    return {"moments": moments, "beta1_power": float(opt.beta1_power.asnumpy())}


def _load_adam_one_process(folder: str, seed: int) -> dict:
    from mindspore import nn

    from hyperpar import checkpoint

    net, names, _mesh = _net(seed, 1)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    result = checkpoint.load(net, folder, name_map=names, optimizer=opt)
    assert tuple(result) == ([], []), result
    moments = {}
    for state in list(opt.moment1) + list(opt.moment2):
        prefix, _, param = state.name.partition(".")
        moments[(prefix, names.get(param, param))] = state.asnumpy()
    refused = ""
    try:   # another optimizer's state is refused, before any tensor is read
        checkpoint.load(net, folder, name_map=names,
                        optimizer=nn.SGD(net.trainable_params(), learning_rate=0.1))
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"
    return {"moments": moments, "beta1_power": float(opt.beta1_power.asnumpy()),
            "refused": refused, "report": _report(net, names, None)}


def test_adam_state_saved_on_fsdp2_resumes_in_one_process(pool1, pool2, tmp_path) -> None:
    """Optimizer state is laid out as its parameter: Adam's moments saved from fully_shard
    shards (fc1's 7 rows split 4 + 3) load whole in one process, bit for bit, with the
    model; the scalars (beta powers) come back too; an SGD is refused that state."""
    folder = str(tmp_path / "fsdp2-adam")
    trained = pool2.run(_train_save_fsdp_adam, folder, 5)
    loaded = pool1.run(_load_adam_one_process, folder, 3)[0]
    assert sorted(loaded["moments"]) == sorted(trained[0]["moments"])
    for key, whole in loaded["moments"].items():
        pieces = sorted(r["moments"][key] for r in trained)   # (start row, rows) per rank
        assert [start for start, _ in pieces] == [0, pieces[1][0]]
        assert np.array_equal(whole, np.concatenate([rows for _, rows in pieces])), key
        assert whole.any(), f"{key}: the moments were never written"
    assert loaded["beta1_power"] == trained[0]["beta1_power"] != 1.0
    assert loaded["refused"].startswith("CheckpointError: load(optimizer=...)"), loaded["refused"]
    assert "mindspore.nn.optim.sgd.SGD" in loaded["refused"], loaded["refused"]


# ------------------------------------------------ optimizer state, torch <-> MindSpore
#: the MindSpore half of each optimizer pair (tests/mindspore/_torch_side.py has torch's):
#: torch Adam <-> nn.Adam, SGD(momentum) <-> nn.Momentum, SGD(momentum, nesterov) <-> nn.SGD
OPTIM_KINDS = ("adam", "momentum", "sgd")
#: A resumed step starts from the same weights and optimizer state (bytes of the checkpoint,
#: the bias-correction powers recomputed in float32: relative 1e-7) and differs only by the
#: gradient, summed by other kernels in float32 (relative ~1e-6 of <= 32 O(1) products), and
#: for Adam by MindSpore adding eps to sqrt(v) before the bias correction (eps / sqrt(1 -
#: beta2**3) = 1.8e-7 next to sqrt(v_hat) ~ 0.1: relative 2e-6 of the update). An update is
#: <= lr = 0.1 per element, so the parameters agree to ~1e-7 absolute; allowed 1e-6 + 1e-5 |w|.
#: A lost buffer or a wrong step count moves them by O(lr) = 1e-3..1e-1.
OPTIM_ATOL, OPTIM_RTOL = 1e-6, 1e-5


def _ms_optimizer(kind: str, params, lr: float | None = None):
    from mindspore import nn

    if kind == "adam":
        return nn.Adam(params, learning_rate=lr or 0.01)
    if kind == "momentum":
        return nn.Momentum(params, learning_rate=lr or 0.1, momentum=0.9)
    return nn.SGD(params, learning_rate=lr or 0.1, momentum=0.9, nesterov=True)


def _ms_steps(net, opt, steps: tuple[int, ...]) -> None:
    """The training steps of _torch_side.py: mean squared error on train_batch(i), every rank
    on the same batch (so fully_shard's averaged gradient is one process's)."""
    import mindspore as ms

    from tests.mindspore._ckpt_model import train_batch

    grad = ms.value_and_grad(lambda a, b: ((net(a) - b) ** 2).mean(), None, opt.parameters)
    for i in steps:
        x, y = (ms.Tensor(a) for a in train_batch(i))
        _loss, grads = grad(x, y)
        opt(grads)


def _whole(net, names, fsdp: bool) -> dict:
    if fsdp:
        return {names.get(k, k): v.asnumpy() for k, v in net.full_parameters().items()}
    return {names.get(k, k): p.asnumpy() for k, p in net.parameters_and_names()}


def _ms_optim_train_save(folder: str) -> dict:
    """fsdp2, every pair: 2 steps from weights(0), saved with the optimizer to ms-<kind>, then
    the 3rd step (what torch, resuming from that folder, must reach)."""
    from hyperpar import checkpoint

    out = {}
    for kind in OPTIM_KINDS:
        net, names = _fsdp_net(0)
        opt = _ms_optimizer(kind, net.trainable_params())
        _ms_steps(net, opt, (0, 1))
        checkpoint.save(net, os.path.join(folder, f"ms-{kind}"), name_map=names, optimizer=opt)
        _ms_steps(net, opt, (2,))
        out[kind] = _whole(net, names, True)
    return out


def _ms_optim_resume(folder: str, fsdp: bool, kinds: tuple[str, ...]) -> dict:
    """Each torch optimizer's checkpoint (torch-<kind>) loaded into the Cell of other weights
    with its MindSpore pair (fully_shard on every rank, or one process), then the 3rd step."""
    from hyperpar import checkpoint

    out = {}
    for kind in kinds:
        net, names = _fsdp_net(3) if fsdp else _net(3, 1)[:2]
        opt = _ms_optimizer(kind, net.trainable_params())
        result = checkpoint.load(net, os.path.join(folder, f"torch-{kind}"), name_map=names,
                                 optimizer=opt)
        assert tuple(result) == ([], []), result
        if kind == "adam":
            out["powers"] = [float(opt.beta1_power.asnumpy()), float(opt.beta2_power.asnumpy()),
                             int(opt.global_step.asnumpy()[0])]
        _ms_steps(net, opt, (2,))
        out[kind] = _whole(net, names, fsdp)
    return out


def _ms_optim_refusals(folder: str) -> dict:
    """Loads that must not translate, each refused before a tensor is read; and a learning
    rate set differently from the saved run's: kept, with a warning."""
    import warnings

    from mindspore import nn

    from hyperpar import checkpoint

    net, names, _mesh = _net(3, 1)
    out = {}
    for label, src, make in (
            ("adamw", "torch-adamw", lambda ps: nn.AdamWeightDecay(ps, learning_rate=0.01)),
            ("unknown", "torch-adam", lambda ps: nn.SGD(ps, momentum=0.9)),
            ("nesterov", "torch-sgd", lambda ps: nn.Momentum(ps, 0.1, 0.9))):
        try:
            checkpoint.load(net, os.path.join(folder, src), name_map=names,
                            optimizer=make(net.trainable_params()))
            out[label] = "loaded"
        except Exception as exc:  # noqa: BLE001 -- the message is what the test checks
            out[label] = f"{type(exc).__name__}: {exc}"
    opt = _ms_optimizer("adam", net.trainable_params(), lr=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(net, os.path.join(folder, "torch-adam"), name_map=names, optimizer=opt)
    out["warnings"] = [str(w.message) for w in caught]
    out["lr"] = float(opt.learning_rate.asnumpy())
    return out


def _near(got: dict, want: dict, what: str) -> float:
    """Every parameter within OPTIM_ATOL + OPTIM_RTOL |want|; returns the largest error."""
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    worst = 0.0
    for key, w in want.items():
        err = np.abs(got[key] - w)
        assert np.all(err <= OPTIM_ATOL + OPTIM_RTOL * np.abs(w)), (
            f"{what}: {key} differs by up to {err.max():.2e}")
        worst = max(worst, float(err.max()))
    return worst


def test_optimizer_state_moves_between_torch_and_mindspore_mid_training(
        pool1, pool2, torch_runs) -> None:
    """★ A run moves frameworks mid-training: torch Adam / SGD(momentum) / SGD(nesterov)
    trained 2 steps and saved with the optimizer; MindSpore (fully_shard on 2 ranks; Adam also
    in one process) loads it into nn.Adam / nn.Momentum / nn.SGD and takes the 3rd step: the
    same parameters as torch's own 3rd step. And back: the MindSpore optimizers trained 2 steps
    on fsdp2 and saved; torch loads (one process) and its 3rd step equals MindSpore's. AdamW ->
    AdamWeightDecay (no bias correction), an unknown pair and Momentum's other Nesterov are
    refused on every rank; a differing learning rate is kept, with a warning."""
    folder = str(torch_runs["folder"])
    ms_ref, torch_report = torch_runs["ms_optim"], torch_runs["optim"]
    for res in ms_ref[1:]:
        for kind in OPTIM_KINDS:
            _same_params(res[kind], ms_ref[0][kind], "fsdp2 ranks agree")
    worst = {}
    for kind in OPTIM_KINDS:   # MindSpore -> torch
        got = _decode(torch_report[f"from-ms-{kind}"])
        worst[f"ms->torch {kind}"] = _near(got, ms_ref[0][kind], f"MindSpore {kind} -> torch")
        assert not np.allclose(got["fc1.weight"], weights(3)["fc1.weight"])
    assert torch_report["refused"].startswith("CheckpointError"), torch_report["refused"]
    assert "mindspore.nn.optim.adam.Adam" in torch_report["refused"] and (
        "torch.optim.sgd.SGD" in torch_report["refused"]), torch_report["refused"]

    # torch -> MindSpore: every pair on fsdp2, Adam also in one process (a compile per
    # optimizer: each costs ~1 s here)
    for fsdp, pool, kinds in ((True, pool2, OPTIM_KINDS), (False, pool1, ("adam",))):
        for rank, res in enumerate(pool.run(_ms_optim_resume, folder, fsdp, kinds)):
            assert res["powers"][2] == 2, res["powers"]   # torch's step, as global_step
            assert np.isclose(res["powers"][0], 0.9 ** 2, rtol=1e-6), res["powers"]
            for kind in kinds:
                want = _decode(torch_report[f"torch-{kind}"])
                worst[f"torch->ms {kind} {'fsdp2' if fsdp else '1 process'} r{rank}"] = _near(
                    res[kind], want, f"torch {kind} -> MindSpore (fsdp={fsdp}, rank {rank})")

    for rank, res in enumerate(pool2.run(_ms_optim_refusals, folder)):
        assert "no bias correction" in res["adamw"] and "AdamWeightDecay" in res["adamw"], res
        assert "torch.optim.adam.Adam" in res["unknown"] and (
            "mindspore.nn.optim.sgd.SGD" in res["unknown"]) and (
            "torch.optim.sgd.SGD <-> mindspore.nn.optim.momentum.Momentum" in res["unknown"]), res
        assert "nesterov=True" in res["nesterov"] and "Momentum" in res["nesterov"], res
        assert all(res[k].startswith("CheckpointError") for k in ("adamw", "unknown",
                                                                   "nesterov")), (rank, res)
        assert res["lr"] == np.float32(0.02), res["lr"]
        assert any("lr: saved 0.01" in w for w in res["warnings"]), res["warnings"]
    print("largest |difference| per direction:", worst)


def _async_save_then_train(folder: str, seed: int, other: int) -> str:
    """async_save on tp2, then overwrite every parameter while the write may be in flight:
    the folder must hold the values at the call (staged before it returned)."""
    import mindspore as ms

    from hyperpar import checkpoint

    net, names, _mesh = _net(seed, 2)
    future = checkpoint.async_save(net, folder, name_map=names)
    from hyperpar.platform import get_platform

    w, rank = weights(other), get_platform().rank()
    for name, p in net.parameters_and_names():   # the next "step" changes the parameters
        key = names.get(name, name)
        whole = w[key]
        if key in TP_LAYOUT:   # this rank's tp shard of the new values: 7 = 4 + 3
            d = int(TP_LAYOUT[key][0][-1])
            whole = np.take(whole, range(4 * rank, 4 * rank + p.shape[d]), axis=d)
        p.set_data(ms.Tensor(np.ascontiguousarray(whole)))
    return future.result(timeout=300)


def test_async_save_stages_before_returning_and_loads_in_one_process(pool1, pool2,
                                                                      tmp_path) -> None:
    folder = str(tmp_path / "async")
    for index in pool2.run(_async_save_then_train, folder, 0, 7):
        assert index == os.path.join(folder, "index.json"), index
    # the ranks' notes are gone; rank 0's outcome note stays for the others to read
    notes = [n for n in os.listdir(folder) if n.startswith(".hyperpar-async")]
    assert len(notes) == 1 and notes[0].endswith("-outcome.json"), os.listdir(folder)
    loaded = pool1.run(_load, folder, 1, 3)[0]
    _same_params(loaded["params"], weights(0), "async_save on tp2, loaded in one process")
