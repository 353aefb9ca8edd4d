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

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hyperpar import Replicate, Shard
from tests.both._frameworks import Framework, get
from tests.both._numpy_layout import close

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
STEPS = 3
LR = {"sgd": 0.1, "adam": 0.01}
D, H, PER_RANK = 8, 7, 3  # 3 rows per replica: the whole batch is 3 * dp rows


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"w1": (H, D), "b1": (H,), "w2": (D, H), "b2": (D,)}
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def _mlp(fw: Framework, w: dict[str, np.ndarray]) -> Any:
    return fw.container(lambda m, x: m.fc2(fw.relu(m.fc1(x))),
                        fc1=fw.linear(w["w1"], w["b1"]), fc2=fw.linear(w["w2"], w["b2"]))


def _trainer(fw: Framework, model: Any, opt: str, dp: bool) -> Callable[[Any, Any], float]:
    """``step(x, y)``: one optimizer step on the mean squared error; gradients averaged over
    the dp group when ``dp`` (torch: in backward; MindSpore: ``model.reduce_gradients``)."""
    lr = LR[opt]
    if fw.name == "torch":
        torch = fw.torch
        params = list(model.parameters())
        optim = (torch.optim.SGD(params, lr=lr) if opt == "sgd"
                 else torch.optim.Adam(params, lr=lr))

        def torch_step(x: Any, y: Any) -> float:
            optim.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optim.step()
            return float(loss.detach())

        return torch_step
    ms, nn = fw.ms, fw.nn
    optim = (nn.SGD(model.trainable_params(), learning_rate=lr) if opt == "sgd"
             else nn.Adam(model.trainable_params(), learning_rate=lr))

    def loss_fn(x: Any, y: Any) -> Any:
        return ((model(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, optim.parameters)

    def ms_step(x: Any, y: Any) -> float:
        loss, grads = grad_fn(x, y)
        optim(model.reduce_gradients(grads) if dp else grads)
        return float(loss.asnumpy())

    return ms_step


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
    w = _weights()
    rng = np.random.default_rng(1)
    x_all = rng.standard_normal((PER_RANK * dp, D)).astype(np.float32)
    y_all = rng.standard_normal((PER_RANK * dp, D)).astype(np.float32)
    mine = slice(me * PER_RANK, (me + 1) * PER_RANK)

    model = _mlp(fw, w)
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})
    model = data_parallel(model, mesh, "dp")
    step = _trainer(fw, model, opt, dp=True)
    losses = [step(fw.tensor(x_all[mine]), fw.tensor(y_all[mine])) for _ in range(STEPS)]

    ref = _mlp(fw, w)
    ref_step = _trainer(fw, ref, opt, dp=False)
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
        assert not np.array_equal(res["params"]["fc1.weight"], _weights()["w1"])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_trains_like_one_process_on_the_whole_batch(framework, pool, n,
                                                                   opt) -> None:
    _check(pool(n).run(_run, framework, n, opt, 1), n)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_dp_times_tp_on_four_ranks_trains_like_one_process(framework, pool, opt) -> None:
    _check(pool(4).run(_run, framework, 4, opt, 2), 2)
