"""DTensors at tensor-parallel boundaries on MindSpore, against plain one-process MindSpore:
``use_local_output=False`` outputs, DTensor inputs converted to the layout a style wants,
``Partial`` output layouts, and ``loss_parallel`` (cross-entropy on vocabulary-sharded logits,
no gather of the vocabulary).

Tolerance, as in ``test_tensor_parallel.py``: only the order of float32 sums changes (inner dims
<= 16, values O(1), 3 SGD steps at lr 0.1; the loss-parallel sum of exponentials is split over
ranks, <= 11 terms): below ~6e-6 * scale; we allow 2e-5 * scale.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyperpar.dtensor.placement import Partial, Replicate, Shard
from tests.mindspore._cells import param_arrays, set_weights
from tests.mindspore.test_tp_options import _assert_close, _mesh

STEPS = 3
LR = 0.1
D, H, VOCAB = 8, 7, 11  # H and VOCAB split unevenly over 2 and 4 ranks


class MLP(nn.Cell):
    """fc1's DTensor output goes straight into fc2 (an activation between them would be an op
    on a DTensor: MindSpore DTensor op rules are another branch's work)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(D, H)
        self.fc2 = nn.Dense(H, D)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def _train(model: nn.Cell, x, y, out_of=lambda out: out) -> tuple[list[float], np.ndarray]:
    """SGD on the mean squared error of ``out_of(model(x))`` (a DTensor made plain)."""
    opt = nn.SGD(model.trainable_params(), learning_rate=LR)

    def loss_fn(inp, target):
        return ((out_of(model(inp)) - target) ** 2).mean()

    step = ms.value_and_grad(loss_fn, None, opt.parameters)
    losses = []
    for _ in range(STEPS):
        loss, grads = step(x, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, out_of(model(x)).asnumpy()


def _run_dtensor_outputs(variant: str) -> dict:
    from hyperpar_mindspore.dtensor import DTensor, distribute_tensor

    from hyperpar import ColwiseParallel, RowwiseParallel, parallelize_module

    rng = np.random.default_rng(5)
    x_np = rng.standard_normal((4, 3, D)).astype(np.float32)
    x, y = ms.Tensor(x_np), ms.Tensor(rng.standard_normal((4, 3, D)).astype(np.float32))
    reference, model = MLP(), MLP()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    out_layout = Partial() if variant == "partial" else Replicate()
    parallelize_module(model, mesh, {
        "fc1": ColwiseParallel(use_local_output=False),
        "fc2": RowwiseParallel(output_layouts=out_layout, use_local_output=False)})
    seen = {}
    inp = x
    if variant == "dtensor_input":  # a batch-sharded DTensor: fc1 gathers it to Replicate
        inp = distribute_tensor(x, mesh, [Shard(0)])
    hidden = model.fc1(inp)
    seen["hidden"] = (type(hidden).__name__, hidden.placements, tuple(hidden.shape))
    out = model(inp)
    seen["out"] = (isinstance(out, DTensor), out.placements, tuple(out.shape))

    def plain(o):
        return o.full_tensor() if isinstance(o, DTensor) else o

    ref_losses, ref_out = _train(reference, x, y)
    losses, out_np = _train(model, inp, y, plain)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "seen": seen,
            "ref_losses": ref_losses, "losses": losses, "ref_out": ref_out, "out": out_np,
            "ref": param_arrays(reference), "mine": param_arrays(model)}


# A Partial output (fc2's bias added once to the sum) trains in tests/both/test_tp.py, one
# body for both frameworks.
@pytest.mark.parametrize(("n", "variant"), [(2, "replicate"), (4, "replicate"),
                                            (2, "dtensor_input")])
def test_dtensor_outputs_carry_the_styles_layouts_and_train_like_one_process(
        pool2, pool4, n, variant):
    for res in (pool2 if n == 2 else pool4).run(_run_dtensor_outputs, variant):
        name, placements, shape = res["seen"]["hidden"]
        assert name == "DTensor" and placements == (Shard(2),) and shape == (4, 3, H)
        is_dt, placements, shape = res["seen"]["out"]
        want = Partial() if variant == "partial" else Replicate()
        assert is_dt and placements == (want,) and shape == (4, 3, D)
        _assert_close(res, {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None})


def test_a_colwise_partial_output_is_refused_when_the_style_is_made():
    from hyperpar_mindspore import ColwiseParallel

    with pytest.raises(ValueError, match=r"ColwiseParallel\(output_layouts=Partial.*Partial"):
        ColwiseParallel(output_layouts=Partial())


# --------------------------------------------------------------------------- loss_parallel
class LM(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc = nn.Dense(D, D)
        self.head = nn.Dense(D, VOCAB)

    def construct(self, ids):
        return self.head(ops.tanh(self.fc(self.emb(ids))))


def _run_loss_parallel() -> dict:
    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    rng = np.random.default_rng(6)
    ids = ms.Tensor(rng.integers(0, VOCAB, (12,)).astype(np.int32))
    target_np = rng.integers(0, VOCAB, (12,)).astype(np.int32)
    target_np[[2, 7]] = -100  # ignored positions: left out of the mean, as in one process
    target = ms.Tensor(target_np)
    reference, model = LM(), LM()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    parallelize_module(model, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(use_local_output=False)})  # logits: Shard(-1), never gathered

    def train(m: nn.Cell, parallel: bool) -> tuple[list[float], list[np.ndarray]]:
        opt = nn.SGD(m.trainable_params(), learning_rate=LR)
        step = ms.value_and_grad(lambda i, t: ops.cross_entropy(m(i), t), None, opt.parameters)
        losses = []
        for _ in range(STEPS):
            if parallel:
                with loss_parallel():  # around the whole value_and_grad call
                    loss, grads = step(ids, target)
            else:
                loss, grads = step(ids, target)
            opt(grads)
            losses.append(float(loss.asnumpy()))
        return losses, [g.asnumpy() for g in grads]

    ref_losses, _ = train(reference, False)
    losses, _ = train(model, True)
    logits = model(ids)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "ref_losses": ref_losses,
            "losses": losses, "placements": logits.placements,
            "local_cols": logits.to_local().shape[-1],
            "ref_out": reference(ids).asnumpy(), "out": logits.full_tensor().asnumpy(),
            "ref": param_arrays(reference), "mine": param_arrays(model),
            "restored": ops.cross_entropy.__module__}


@pytest.mark.parametrize("n", [2, 4])
def test_loss_parallel_cross_entropy_on_sharded_logits_trains_like_one_process(
        pool2, pool4, n):
    for res in (pool2 if n == 2 else pool4).run(_run_loss_parallel):
        assert res["placements"] == (Shard(1),)
        step = -(-VOCAB // n)  # torch.chunk: 6, 5 on 2 ranks; 3, 3, 3, 2 on 4
        assert res["local_cols"] == min(step, VOCAB - res["r"] * step)
        assert res["restored"].startswith("mindspore")  # the context put ops back
        _assert_close(res, {"emb.embedding_table": 0, "fc.weight": None, "fc.bias": None,
                            "head.weight": 0, "head.bias": 0})




def _run_prepare_dtensor() -> dict:
    from hyperpar_mindspore.dtensor import DTensor

    from hyperpar import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

    rng = np.random.default_rng(7)
    x = ms.Tensor(rng.standard_normal((4, 3, D)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((4, 3, D)).astype(np.float32))
    reference, model = MLP(), MLP()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    seen = []
    # the root slices the sequence (3 positions: uneven) into a DTensor; fc1 gathers it back
    parallelize_module(model, mesh, {
        "": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                               use_local_output=False),
        "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel()})
    model.fc1.register_forward_pre_hook(
        lambda cell, args: seen.append((isinstance(args[0], DTensor), args[0].placements,
                                        tuple(args[0].shape))) if not seen else None,
        prepend=True)
    ref_losses, ref_out = _train(reference, x, y)
    losses, out = _train(model, x, y)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "seen": seen[0],
            "ref_losses": ref_losses, "losses": losses, "ref_out": ref_out, "out": out,
            "ref": param_arrays(reference), "mine": param_arrays(model)}


def test_prepare_module_input_can_hand_dtensors_to_the_next_style(pool2):
    for res in pool2.run(_run_prepare_dtensor):
        assert res["seen"] == (True, (Shard(1),), (4, 3, D))  # the global shape, uneven slices
        _assert_close(res, {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None})
