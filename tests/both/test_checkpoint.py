"""Checkpoints that reshard, one body for torch and MindSpore: an MLP trained 2 Adam steps
under tensor parallelism on 2 ranks is saved with its optimizer, then loaded (parameters and
Adam state) into ``fully_shard`` on 2 ranks and into one process, and each trains 2 more steps.

Checked, on each framework with its own optimizer:
* right after the load, every parameter read back whole is bit-equal to what the tp ranks held
  when they saved (a load copies stored bytes; nothing is recomputed);
* after the 2 further steps (fully_shard: each rank its half of the batch, gradients averaged;
  one process: the whole batch), the parameters equal those of the same MLP trained 4 steps
  straight in one process -- so the Adam moments and step count came through the reshard too
  (restarting Adam's moments changes the third step's update by O(lr)).

Tolerance: as tests/both/test_data_parallel.py -- the runs differ from the reference only in the
order of float32 sums (tp's partial products of 7 terms summed over 2 ranks, the batch mean
split in 2): ~1e-6 relative, carried by 4 steps with a gain below 2 each; Adam keeps relative
gradient errors relative. We allow 2e-5 * max(1, max|want|).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.both._frameworks import Framework, get
from tests.both._numpy_layout import close
from tests.both._training import PER_RANK, H, data, full_params, mlp, trainer, weights

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
ROWS = 2 * PER_RANK  # the whole batch; fully_shard's 2 ranks take half each


def _tp_full(fw: Framework, model: Any, mesh: Any) -> dict[str, np.ndarray]:
    from hyperpar import Replicate, Shard

    layout = {"fc1.weight": (Shard(0), (H, 8)), "fc1.bias": (Shard(0), (H,)),
              "fc2.weight": (Shard(1), (8, H)), "fc2.bias": (Replicate(), (8,))}
    out = {}
    for name, (placement, shape) in layout.items():
        mod, kind = name.split(".")
        getter = fw.weight if kind == "weight" else fw.bias
        out[name] = fw.full_param(getter(getattr(model, mod)), mesh, placement, shape)
    return out


def _train_tp_and_save(framework: str, path: str) -> dict[str, np.ndarray]:
    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        checkpoint,
        init_device_mesh,
        parallelize_module,
    )

    fw = get(framework)
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    model = mlp(fw, weights())
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    step, optim = trainer(fw, model, "adam")
    x, y = data(ROWS)
    for _ in range(2):
        step(fw.tensor(x), fw.tensor(y))  # tp: both ranks see the whole batch
    checkpoint.save(model, path, optimizer=optim)
    return _tp_full(fw, model, mesh)


def _load_and_continue(framework: str, path: str, sharded: bool) -> dict:
    from hyperpar import checkpoint, fully_shard, init_device_mesh
    from hyperpar.platform import get_platform

    fw = get(framework)
    rows = slice(None)
    w = {k: np.zeros_like(v) for k, v in weights().items()}  # other weights before the load
    model = mlp(fw, w)
    if sharded:
        mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
        me = get_platform().rank()
        rows = slice(me * PER_RANK, (me + 1) * PER_RANK)
    step, optim = trainer(fw, model, "adam")
    checkpoint.load(model, path, optimizer=optim)
    loaded = full_params(fw, model, sharded)
    x, y = data(ROWS)
    for _ in range(2):
        step(fw.tensor(x[rows]), fw.tensor(y[rows]))
    return {"loaded": loaded, "trained": full_params(fw, model, sharded)}


def _reference(framework: str) -> dict[str, np.ndarray]:
    fw = get(framework)
    model = mlp(fw, weights())
    step, _ = trainer(fw, model, "adam")
    x, y = data(ROWS)
    for _ in range(4):
        step(fw.tensor(x), fw.tensor(y))
    return full_params(fw, model, False)


def test_tp2_checkpoint_resumes_under_fully_shard_and_in_one_process(
        framework, pool, tmp_path: Path) -> None:
    path = str(tmp_path / "tp2")
    saved = pool(2).run(_train_tp_and_save, framework, path)
    assert all(set(s) == set(saved[0]) for s in saved)
    runs = {"fully_shard on 2 ranks": pool(2).run(_load_and_continue, framework, path, True),
            "one process": pool(1).run(_load_and_continue, framework, path, False)}
    want = pool(1).run(_reference, framework)[0]
    start = weights()
    for what, results in runs.items():
        for rank, res in enumerate(results):
            for name, value in saved[0].items():
                np.testing.assert_array_equal(res["loaded"][name], value,
                                              err_msg=f"{what}, rank {rank}: {name} as loaded")
            for name, value in want.items():
                close(f"{what}, rank {rank}: {name} after 2 + 2 steps", res["trained"][name],
                      value, RTOL)
    # the saved weights moved from the start: a load that kept the initial weights would fail
    assert not np.allclose(saved[0]["fc1.weight"], start["w1"])
