"""MindSpore idioms with tensor parallelism, each against the same Cell trained in one process.

Each rank builds two copies of one model from the same numpy weights: a plain MindSpore reference
(no hyperpar) and one parallelized with ``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}``
(plus the embedding row-wise where there is one). Both train with the idiom under test; losses
and final outputs must agree.

Tolerances: float32 as in test_tensor_parallel (a sum split over 2 ranks differs in rounding only,
< ~6e-6 * scale after 3 steps; 2e-5 * scale allowed). fp16 compute: each matmul's partial sums are
rounded to fp16 (unit roundoff 2**-11 ~ 4.9e-4) before the all-reduce, so after 3 steps a few
roundings of O(scale) values, ~5 * 4.9e-4 * scale; 5e-3 * scale allowed. A missing all-reduce or
a wrong shard changes the output by O(scale).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from hyperpar_mindspore import (
    ColwiseParallel,
    RowwiseParallel,
    init_device_mesh,
    parallelize_module,
)
from mindspore import mint, nn

from hyperpar.dtensor.placement import Replicate
from tests.mindspore._cells import set_weights, train_sgd

STEPS = 3
D_IN, D_HID, VOCAB = 8, 16, 12


class Net(nn.Cell):
    """Embedding (optional) + MLP, from nn or mint.nn layers, with or without biases."""

    def __init__(self, layers: str = "nn", bias: bool = True, embed: bool = False) -> None:
        super().__init__()
        if layers == "mint":
            self.fc1 = mint.nn.Linear(D_IN, D_HID, bias=bias)
            self.fc2 = mint.nn.Linear(D_HID, D_IN, bias=bias)
            self.emb = mint.nn.Embedding(VOCAB, D_IN) if embed else None
        else:
            self.fc1 = nn.Dense(D_IN, D_HID, has_bias=bias)
            self.fc2 = nn.Dense(D_HID, D_IN, has_bias=bias)
            self.emb = nn.Embedding(VOCAB, D_IN) if embed else None
        self.act = nn.ReLU()

    def construct(self, x):
        if self.emb is not None:
            x = self.emb(x)
        return self.fc2(self.act(self.fc1(x)))


def _train_one_step(model: nn.Cell, x: ms.Tensor, y: ms.Tensor, optimizer: str):
    params = model.trainable_params()
    opt = (nn.Momentum(params, learning_rate=0.1, momentum=0.9) if optimizer == "momentum"
           else nn.Adam(params, learning_rate=0.01))
    net = nn.TrainOneStepCell(nn.WithLossCell(model, nn.MSELoss()), opt)
    net.set_train()
    losses = [float(net(x, y).asnumpy()) for _ in range(STEPS)]
    return losses, model(x).asnumpy().astype(np.float32)


def _run_idiom(idiom: str) -> dict:
    rng = np.random.default_rng(1)
    opts = {"bias_free": {"bias": False}, "mint": {"layers": "mint"},
            "embedding": {"embed": True}}.get(idiom, {})
    if opts.get("embed"):
        x = ms.Tensor(rng.integers(0, VOCAB, (4, 5)).astype(np.int32))
        y = ms.Tensor(rng.standard_normal((4, 5, D_IN)).astype(np.float32))
    else:
        x = ms.Tensor(rng.standard_normal((4, 3, D_IN)).astype(np.float32))
        y = ms.Tensor(rng.standard_normal((4, 3, D_IN)).astype(np.float32))
    reference, model = Net(**opts), Net(**opts)
    set_weights(reference)
    set_weights(model)
    for net in (reference, model):
        if idiom == "fp16":
            net.to_float(ms.float16)
        if idiom == "recompute" and net is reference:
            net.fc1.recompute()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if opts.get("embed"):
        plan["emb"] = RowwiseParallel(input_layouts=Replicate())
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, plan)
    if idiom == "recompute":  # after parallelize_module: recompute() captures the parameters
        model.fc1.recompute()
    if idiom in ("momentum", "adam"):
        ref_losses, ref_out = _train_one_step(reference, x, y, idiom)
        losses, out = _train_one_step(model, x, y, idiom)
    else:
        ref_losses, ref_out = train_sgd(reference, x, y, STEPS, 0.1)
        losses, out = train_sgd(model, x, y, STEPS, 0.1)
    return {"ref_losses": ref_losses, "losses": losses, "ref_out": ref_out.astype(np.float32),
            "out": out.astype(np.float32), "fc1": tuple(model.fc1.weight.shape)}


def _recompute_before_parallelize() -> str:
    model = Net()
    model.fc1.recompute()
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    try:
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    except ValueError as exc:
        return str(exc) + f" | fc1 still {tuple(model.fc1.weight.shape)}"
    return "no error"


def test_recompute_before_parallelize_is_refused_on_every_rank(pool2):
    # Measured before this check: the shards trained silently wrong from the second step on.
    for text in pool2.run(_recompute_before_parallelize):
        assert "'fc1' (Dense) was set to recompute() before parallelize_module" in text
        assert text.endswith(f"fc1 still {(D_HID, D_IN)}")  # the model was left untouched


@pytest.mark.parametrize("idiom", ["momentum", "adam", "fp16", "bias_free", "mint", "embedding",
                                   "recompute"])
def test_idiom_with_tp_trains_like_one_process(pool2, idiom):
    results = pool2.run(_run_idiom, idiom)
    rel = 5e-3 if idiom == "fp16" else 2e-5
    for res in results:
        assert res["fc1"] == (D_HID // 2, D_IN)  # really sharded
        scale = max(1.0, float(np.abs(res["ref_out"]).max()))
        np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=rel, atol=rel * scale)
        np.testing.assert_allclose(res["out"], res["ref_out"], rtol=0, atol=rel * scale)
