"""fully_shard, one body for torch and MindSpore: FSDP2 semantics on real ranks, each rank on its
own rows of the batch, against the same MLP trained in one process on the whole (concatenated)
batch.

* ``fully_shard`` on each layer, then on the root (nested units), on 2 and 4 ranks (hidden 7:
  rows split 4 + 3 and 2 + 2 + 2 + 1), 3 SGD and 3 Adam steps;
* HSDP on 4 ranks: a ``(replicate, shard) = (2, 2)`` mesh.

Checked: the mean of the ranks' losses (equal shares: the loss of the whole batch), every
parameter gathered whole, and that each rank holds 1/N of every parameter's rows (torch.chunk's
rows, ceil(d0 / N) at most) and optimizer state only for its shards.

What differs between the frameworks, and only this: reading back (torch: ``p.full_tensor()`` of
the DTensor parameters; MindSpore: ``model.full_parameters()``, since a Cell's Parameters are
the shards themselves) and storage (torch holds torch.chunk's piece; MindSpore pads each piece
to ceil(d0 / N) rows with zeros, so its collectives see equal sizes).

Tolerance: as tests/both/test_data_parallel.py -- ranks and one process differ only in the
order of float32 sums (the batch mean split into N partial means; the reduce-scatter's sum of N
terms): <= 16 terms, ~1e-6 relative, carried by 3 steps with a gain below 2 each; Adam keeps
relative gradient errors relative. We allow 2e-5 * max(1, max|want|); a missing or doubled
average, or a shard read from the wrong rows, is O(1) off.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tests.both._frameworks import Framework, get
from tests.both._numpy_layout import close
from tests.both._training import PER_RANK, STEPS, data, full_params, mlp, trainer, weights

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
#: whether a rank stores its piece padded to ceil(d0 / N) rows (see the module docstring)
PADS = {"torch": False, "mindspore": True}


def _held(fw: Framework, model: Any, optim: Any) -> tuple[dict[str, int], int, int]:
    """``(rows stored per parameter, parameter bytes, optimizer state bytes)`` on this rank."""
    if fw.name == "torch":
        local = {name: p.to_local() for name, p in model.named_parameters()}
        from hyperpar import DTensor

        # a DTensor's nbytes is its global size: count the local pieces; Adam's scalar `step`
        # is not per-parameter state
        state = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
                    for s in optim.state.values() for t in s.values()
                    if fw.torch.is_tensor(t) and t.dim() > 0)
    else:
        local = {p.name: p for p in model.trainable_params()}
        state = sum(p.nbytes for attr in ("moment1", "moment2", "accum")
                    for p in getattr(optim, attr, None) or ())
    rows = {name: int(t.shape[0]) for name, t in local.items()}
    return rows, sum(int(t.nbytes) for t in local.values()), int(state)


def _run(framework: str, n: int, opt: str, mesh_shape: tuple[int, ...]) -> dict:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.platform import get_platform

    fw = get(framework)
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh(mesh_shape, mesh_dim_names=names)
    rank = get_platform().rank()
    x_all, y_all = data(PER_RANK * n)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    model = mlp(fw, weights())
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step, optim = trainer(fw, model, opt)
    losses = [step(fw.tensor(x_all[mine]), fw.tensor(y_all[mine])) for _ in range(STEPS)]
    rows, param_bytes, state_bytes = _held(fw, model, optim)

    ref = mlp(fw, weights())
    ref_step, _ = trainer(fw, ref, opt)
    ref_losses = [ref_step(fw.tensor(x_all), fw.tensor(y_all)) for _ in range(STEPS)]
    shard_rank = mesh["shard"].get_local_rank() if len(mesh_shape) == 2 else rank
    return {"losses": losses, "ref_losses": ref_losses, "full": full_params(fw, model, True),
            "ref_full": full_params(fw, ref, False),
            "rows": rows, "param_bytes": param_bytes, "state_bytes": state_bytes,
            "shard_rank": shard_rank}


def _check(framework: str, results: list[dict], n_shard: int, opt: str) -> None:
    mean_losses = np.mean([r["losses"] for r in results], axis=0)
    start = weights()
    for rank, res in enumerate(results):
        close(f"rank {rank}: mean loss over ranks", mean_losses, np.array(res["ref_losses"]),
              RTOL)
        assert sorted(res["full"]) == sorted(res["ref_full"]), (res["full"].keys(),)
        for name, want in res["ref_full"].items():
            close(f"rank {rank}: {name} after {STEPS} steps", res["full"][name], want, RTOL)
        # training moved the weights: a model that trained nothing fails the checks above
        assert not np.allclose(res["full"]["fc1.weight"], start["w1"])

        # 1/N of every parameter's rows (the shard's rows of torch.chunk; padded on MindSpore)
        param_bytes = 0
        for name, want in res["ref_full"].items():
            d0, row_bytes = want.shape[0], want[0].nbytes
            ceil_rows = math.ceil(d0 / n_shard)
            k = res["shard_rank"]
            chunk_rows = max(0, min(ceil_rows, d0 - k * ceil_rows))
            expect = ceil_rows if PADS[framework] else chunk_rows
            assert res["rows"][name] == expect, (rank, name, res["rows"][name], expect)
            param_bytes += expect * row_bytes
        assert res["param_bytes"] == param_bytes, (rank, res["param_bytes"], param_bytes)
        # optimizer state for the shards only: Adam 2 moments, plain SGD none (torch) or
        # MindSpore SGD's one `accum` buffer, each the size of the shards
        per_param = {"adam": 2, "sgd": 0 if framework == "torch" else 1}[opt]
        assert res["state_bytes"] == per_param * param_bytes, (rank, res["state_bytes"])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 4])
def test_fully_shard_trains_like_one_process_holding_1_over_n(framework, pool, n, opt) -> None:
    _check(framework, pool(n).run(_run, framework, n, opt, (n,)), n, opt)


def test_hsdp_replicate_2_shard_2_trains_like_one_process(framework, pool) -> None:
    _check(framework, pool(4).run(_run, framework, 4, "adam", (2, 2)), 2, "adam")
