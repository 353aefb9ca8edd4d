"""Data parallelism, one body for torch and MindSpore: ``data_parallel`` trained on real ranks,
each with its own part of the batch, against the same model trained in one process on the
whole (concatenated) batch.

* dp on 2 and 4 ranks (an MLP, hidden 7), 3 SGD steps and 3 Adam steps;
* dp x tp on 4 ranks (mesh (2, 2) named ("dp", "tp")): the MLP tensor-parallelised over "tp"
  with ``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}``, then ``data_parallel`` over
  "dp"; every parameter is gathered over tp and compared.

How gradients are averaged is the one real difference: torch averages during ``.backward()``;
MindSpore's ``value_and_grad`` returns a tuple that ``model.reduce_gradients(grads)`` averages
(see docs/mindspore.md).

Each rank's loss is the mean over its own equal share of the batch, so the average of the
ranks' gradients is the gradient of the mean over the whole batch. Tolerance: weights
normal(0, 0.5), inputs normal(0, 1), dims <= 8: values O(1-10). One process and dp differ only
in the order of float32 sums (the batch mean split into n partial means, summed): a sum of
<= 16 terms moves by <= 16 * 2^-24 ~ 1e-6 relative; 3 steps carry it with a gain below 2 each.
Adam divides by sqrt(v) + 1e-8, which keeps relative errors of the gradient relative in the
update. We allow 2e-5 * max(1, max|want|); a missing or doubled average is O(1) off.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyperpar import Replicate, Shard
from tests.both._frameworks import get
from tests.both._numpy_layout import close
from tests.both._training import PER_RANK, STEPS, D, H, data, mlp, trainer, weights

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
def _run(framework: str, n: int, opt: str, tp: int) -> dict:
    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        data_parallel,
        init_device_mesh,
        parallelize_module,
    )
    from hyperpar.platform import get_platform

    fw = get(framework)
    dp = n // tp
    mesh = init_device_mesh((dp, tp), mesh_dim_names=("dp", "tp"))
    me = get_platform().rank(mesh.get_group("dp"))
    w = weights()
    x_all, y_all = data(PER_RANK * dp)
    mine = slice(me * PER_RANK, (me + 1) * PER_RANK)

    model = mlp(fw, w)
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})
    model = data_parallel(model, mesh, "dp")
    step, _ = trainer(fw, model, opt, reduce_gradients=True)
    losses = [step(fw.tensor(x_all[mine]), fw.tensor(y_all[mine])) for _ in range(STEPS)]

    ref = mlp(fw, w)
    ref_step, _ = trainer(fw, ref, opt)
    ref_losses = [ref_step(fw.tensor(x_all), fw.tensor(y_all)) for _ in range(STEPS)]

    layout = {("fc1", "weight"): (Shard(0), (H, D)), ("fc1", "bias"): (Shard(0), (H,)),
              ("fc2", "weight"): (Shard(1), (D, H)), ("fc2", "bias"): (Replicate(), (D,))}
    params, ref_params = {}, {}
    for (mod, kind), (placement, shape) in layout.items():
        getter = fw.weight if kind == "weight" else fw.bias
        got = getter(getattr(model, mod))
        params[f"{mod}.{kind}"] = (fw.full_param(got, mesh["tp"], placement, shape) if tp > 1
                                   else fw.numpy(got))
        ref_params[f"{mod}.{kind}"] = fw.numpy(getter(getattr(ref, mod)))
    return {"losses": losses, "ref_losses": ref_losses, "params": params,
            "ref_params": ref_params, "dp_rank": me}


def _check(results: list[dict], dp: int) -> None:
    # the mean of the replicas' losses (equal shares) is the loss of the whole batch
    by_dp = {res["dp_rank"]: res["losses"] for res in results}
    assert sorted(by_dp) == list(range(dp)), sorted(by_dp)
    mean_losses = np.mean([by_dp[r] for r in range(dp)], axis=0)
    for rank, res in enumerate(results):
        close(f"rank {rank}: mean loss over replicas", mean_losses,
              np.array(res["ref_losses"]), RTOL)
        for name, want in res["ref_params"].items():
            close(f"rank {rank}: {name}", res["params"][name], want, RTOL)
        # training moved the weights: a model that trained nothing would fail the check above
        assert not np.array_equal(res["params"]["fc1.weight"], weights()["w1"])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_trains_like_one_process_on_the_whole_batch(framework, pool, n,
                                                                   opt) -> None:
    _check(pool(n).run(_run, framework, n, opt, 1), n)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_dp_times_tp_on_four_ranks_trains_like_one_process(framework, pool, opt) -> None:
    _check(pool(4).run(_run, framework, 4, opt, 2), 2)
