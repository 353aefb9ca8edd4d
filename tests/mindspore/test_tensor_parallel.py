"""Tensor parallelism on MindSpore Cells against the same Cell trained in one process.

Each rank builds two copies of one MLP from the same numpy weights: a plain MindSpore reference
(no hyperpar, no communication) and one parallelized with a torch-style plan. Both train several
SGD steps through ``ms.value_and_grad`` and ``nn.SGD``; outputs, losses and every parameter
(each rank's shard against the same slice of the reference) must agree.

Tolerance: float32 sums split over ranks change only the summation order; with inner dims <= 32,
values O(1) and 3 SGD steps at lr 0.1 the difference stays below ~32 * 2**-24 * 3 * scale, about
6e-6 * scale. We allow 2e-5 * scale (scale = the largest magnitude compared), robust yet far below
any real error (a missing all-reduce or a double-counted bias is O(scale)).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from hyperpar_mindspore import (
    ColwiseParallel,
    PlanKeyError,
    RowwiseParallel,
    UnsupportedModuleError,
    init_device_mesh,
    parallelize_module,
)
from mindspore import nn

from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.platform import get_platform
from tests.mindspore._cells import param_arrays, set_weights, train_sgd

STEPS = 3
LR = 0.1
D_IN, D_HID, VOCAB = 8, 16, 12


class MLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(D_IN, D_HID)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(D_HID, D_IN)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


class EmbedMLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_IN)
        self.mlp = MLP()

    def construct(self, ids):
        return self.mlp(self.emb(ids))


def _run_parity(model_kind: str, plan_name: str, mesh_shape: tuple[int, ...],
                names: tuple[str, ...]) -> dict:
    rng = np.random.default_rng(1)
    if model_kind == "mlp":
        make = MLP
        x = ms.Tensor(rng.standard_normal((4, 3, D_IN)).astype(np.float32))
    else:
        make = EmbedMLP
        x = ms.Tensor(rng.integers(0, VOCAB, (4, 5)).astype(np.int32))
    y = ms.Tensor(rng.standard_normal((*x.shape[:2], D_IN)).astype(np.float32))
    reference, model = make(), make()
    set_weights(reference)
    set_weights(model)
    plans = {
        "colrow": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
        "wildcard": {"fc*": ColwiseParallel(output_layouts=Replicate())},
        "replicated": {"fc1": ColwiseParallel(output_layouts=Replicate()),
                       "fc2": RowwiseParallel(input_layouts=Replicate())},
        "nested": {"mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
                   "emb": RowwiseParallel(input_layouts=Replicate())},
        "emb_col": {"emb": ColwiseParallel(output_layouts=Replicate()),
                    "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()},
    }
    mesh = init_device_mesh(mesh_shape, mesh_dim_names=names)
    parallelize_module(model, mesh, plans[plan_name])
    ref_losses, ref_out = train_sgd(reference, x, y, STEPS, LR)
    losses, out = train_sgd(model, x, y, STEPS, LR)
    tp = mesh["tp"] if len(mesh_shape) > 1 else mesh
    return {"tp_rank": tp.get_local_rank(), "tp_size": tp.size(), "ref_losses": ref_losses,
            "losses": losses, "ref_out": ref_out, "out": out, "ref": param_arrays(reference),
            "mine": param_arrays(model)}


# Which dim of each parameter a plan splits (None: whole), written out independently of the
# library's own spec so the test checks the layout rather than repeating it.
_SPLITS = {
    "colrow": {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None},
    "wildcard": {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 0, "fc2.bias": 0},
    "replicated": {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None},
    "nested": {"mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1,
               "mlp.fc2.bias": None, "emb.embedding_table": 0},
    "emb_col": {"mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1,
                "mlp.fc2.bias": None, "emb.embedding_table": 1},
}


def _assert_parity(results: list[dict], plan_name: str) -> None:
    for res in results:
        scale = max(1.0, float(np.abs(res["ref_out"]).max()))
        tol = 2e-5 * scale
        np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=2e-5, atol=tol)
        np.testing.assert_allclose(res["out"], res["ref_out"], rtol=0, atol=tol)
        assert set(res["mine"]) == set(res["ref"])
        for name, dim in _SPLITS[plan_name].items():
            want = res["ref"][name]
            if dim is not None:
                want = np.split(want, res["tp_size"], axis=dim)[res["tp_rank"]]
            pscale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(res["mine"][name], want, rtol=0, atol=2e-5 * pscale,
                                       err_msg=f"parameter {name}")


# --------------------------------------------------------------------------- parity
@pytest.mark.parametrize("n", [2, 4])
def test_colwise_then_rowwise_mlp_trains_like_one_process(pool2, pool4, n):
    pool = pool2 if n == 2 else pool4
    _assert_parity(pool.run(_run_parity, "mlp", "colrow", (n,), ("tp",)), "colrow")


def test_wildcard_keys_and_replicated_colwise_output(pool2):
    _assert_parity(pool2.run(_run_parity, "mlp", "wildcard", (2,), ("tp",)), "wildcard")


def test_replicated_between_colwise_and_rowwise(pool2):
    # fc1 gathers its output; fc2 keeps its own piece of the replicated input.
    _assert_parity(pool2.run(_run_parity, "mlp", "replicated", (2,), ("tp",)), "replicated")


@pytest.mark.parametrize("plan", ["nested", "emb_col"])
def test_embedding_row_and_colwise_in_a_nested_plan(pool2, plan):
    _assert_parity(pool2.run(_run_parity, "embed", plan, (2,), ("tp",)), plan)


def test_the_tp_slice_of_a_2d_dp_tp_mesh(pool4):
    results = pool4.run(_run_parity, "mlp", "colrow", (2, 2), ("dp", "tp"))
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    _assert_parity(results, "colrow")


def _run_sharded_output() -> dict:
    rng = np.random.default_rng(1)
    x = ms.Tensor(rng.standard_normal((4, 3, D_IN)).astype(np.float32))
    y = rng.standard_normal((4, 3, D_IN)).astype(np.float32)
    reference, model = MLP(), MLP()
    set_weights(reference)
    set_weights(model)
    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(),
                                     "fc2": RowwiseParallel(output_layouts=Shard(0))})
    n, r = mesh.size(), mesh.get_local_rank()

    def share_of_loss(out: ms.Tensor, target: ms.Tensor) -> ms.Tensor:
        # with a sharded output each rank's loss is its share; their sum is the one-process loss
        return ((out - target) ** 2).sum() / y.size

    ref_losses, ref_out = train_sgd(reference, x, ms.Tensor(y), STEPS, LR, share_of_loss)
    losses, out = train_sgd(model, x, ms.Tensor(np.split(y, n)[r]), STEPS, LR, share_of_loss)
    return {"tp_rank": r, "tp_size": n, "ref_losses": ref_losses, "losses": losses,
            "ref_out": ref_out, "out": out, "ref": param_arrays(reference),
            "mine": param_arrays(model)}


@pytest.mark.parametrize("n", [2, 4])
def test_rowwise_output_reduce_scattered_keeps_the_bias_replicated(pool2, pool4, n):
    results = (pool2 if n == 2 else pool4).run(_run_sharded_output)
    for res in results:  # each rank's output is its rows; its loss its share of the total
        res["ref_out"] = np.split(res["ref_out"], n)[res["tp_rank"]]
    total = np.sum([res["losses"] for res in results], axis=0)
    np.testing.assert_allclose(total, results[0]["ref_losses"], rtol=2e-5, atol=2e-5)
    for res in results:
        res["losses"] = res["ref_losses"]
    _assert_parity(results, "colrow")


# --------------------------------------------------------------------------- bad inputs
def _bad_plans() -> list[str]:
    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    errors = []
    for plan, make in (
        ({"fc3": ColwiseParallel()}, MLP),
        ({"fc1": ColwiseParallel(), "act": RowwiseParallel()}, MLP),
        ({"emb": ColwiseParallel()}, lambda: _Odd()),
    ):
        model = make()
        before = {n: p.shape for n, p in model.parameters_and_names()}
        try:
            parallelize_module(model, mesh, plan)
            errors.append(("", True))
        except (PlanKeyError, UnsupportedModuleError, ValueError) as exc:
            after = {n: p.shape for n, p in model.parameters_and_names()}
            errors.append((f"{type(exc).__name__}: {exc}", before == after))
    return errors


class _Odd(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 1)  # one column over 2 ranks: torch.chunk gives [1, 0]

    def construct(self, ids):
        return self.emb(ids)


def test_bad_plans_raise_on_every_rank_and_change_nothing(pool2):
    for (nothing, untouched1), (unsupported, untouched2), (odd, untouched3) in pool2.run(
            _bad_plans):
        assert ("PlanKeyError: plan key 'fc3' matched nothing in MLP; closest: 'fc2', 'fc1'"
                in nothing)
        assert "UnsupportedModuleError" in unsupported and "'act'" in unsupported
        assert "ReLU" in unsupported
        assert "ValueError" in odd and "size 1 (shape (12, 1)) over 2" in odd
        assert "leave a rank an empty piece" in odd
        assert untouched1 and untouched2 and untouched3


class _DenseRelu(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(D_HID, D_IN, activation="relu")

    def construct(self, x):
        return self.fc(x)


def _rowwise_dense_with_activation() -> tuple[str, bool]:
    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    model = _DenseRelu()
    before = {n: p.shape for n, p in model.parameters_and_names()}
    try:
        parallelize_module(model, mesh, {"fc": RowwiseParallel()})
    except ValueError as exc:
        return str(exc), before == {n: p.shape for n, p in model.parameters_and_names()}
    return "", False


def test_rowwise_dense_with_activation_is_refused_on_every_rank(pool2):
    # relu of each rank's partial sum, then the all-reduce, would be silently wrong
    for message, untouched in pool2.run(_rowwise_dense_with_activation):
        assert "'fc' (Dense with activation ReLU)" in message, message
        assert "partial sum" in message and untouched


def _plan_key_error_class() -> bool:
    import hyperpar_mindspore

    import hyperpar
    from hyperpar.parallel import driver, spec

    return (hyperpar.PlanKeyError is hyperpar_mindspore.PlanKeyError is spec.PlanKeyError
            and hyperpar.parallelize_module is hyperpar_mindspore.parallelize_module
            is driver.parallelize_module)


def test_plan_key_error_and_the_driver_are_the_ones_torch_uses(pool2):
    assert pool2.run(_plan_key_error_class) == [True, True]
