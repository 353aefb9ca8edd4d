"""fully_shard on MindSpore Cells, real ranks against plain MindSpore in this process.

An MLP Cell (Dense 5 -> 7 -> 7 -> 3, so dims 7 and 3 split unevenly over 2 and 4 ranks, and
the 3-row parameters leave rank 3 of 4 an empty, all-padding piece) is trained for 3 steps of
SGD, Momentum and Adam with ``fully_shard`` per layer and then on the root (nested units), each
rank on its own 2 rows of the batch; the reference is the same Cell trained here on the whole
(concatenated) batch. Checked: the mean of the ranks' losses, every parameter gathered whole,
the first step's gradient shard against the reference gradient's rows (zero in the padding),
and that each rank stores 1/N of the parameter bytes (+ padding to ceil(d0 / N) rows) and
optimizer state of exactly its shards' size.

Tolerance: weights normal(0, 0.5), inputs normal(0, 1), dims <= 8: values O(1-10). The ranks
and the one process differ only in the order of float32 sums (a batch mean split into N partial
means, summed; the reduce-scatter's sum of N terms): <= 16 terms, <= 16 * 2^-24 ~ 1e-6
relative, carried by 3 steps with a gain below 2 each; Adam divides by sqrt(v) + 1e-8, which
keeps relative gradient errors relative. We allow 2e-5 * max(1, max|want|); a missing or
doubled average, or a shard read from the wrong rows, is O(1) off.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(900)

D, H, OUT, PER_RANK, STEPS = 5, 7, 3, 2, 3
LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}
RTOL = 2e-5


def _net():
    import mindspore as ms
    from mindspore import nn, ops

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Dense(D, H)
            self.fc2 = nn.Dense(H, H)
            self.out = nn.Dense(H, OUT)

        def construct(self, x):
            return self.out(ops.relu(self.fc2(ops.relu(self.fc1(x)))))

    net = Net()
    rng = np.random.default_rng(0)
    for _name, p in sorted(net.parameters_and_names()):
        p.set_data(ms.Tensor((rng.standard_normal(p.shape) * 0.5).astype(np.float32)))
    return net


def _data(n: int):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n * PER_RANK, D)).astype(np.float32)
    y = rng.standard_normal((n * PER_RANK, OUT)).astype(np.float32)
    return x, y


def _optimizer(name: str, params):
    from mindspore import nn

    if name == "sgd":
        return nn.SGD(params, learning_rate=LR[name])
    if name == "momentum":
        return nn.Momentum(params, learning_rate=LR[name], momentum=0.9)
    return nn.Adam(params, learning_rate=LR[name])


def _state_bytes(opt) -> int:
    """Bytes of the optimizer's per-parameter state (moments), not counting the parameters."""
    total = 0
    for attr in ("moments", "moment1", "moment2", "accum"):
        for p in getattr(opt, attr, None) or ():
            total += p.nbytes
    return total


def _train(net, opt_name: str, x, y) -> tuple[list[float], list[np.ndarray], object]:
    import mindspore as ms

    opt = _optimizer(opt_name, net.trainable_params())

    def loss_fn(inp, target):
        return ((net(inp) - target) ** 2).mean()

    step = ms.value_and_grad(loss_fn, None, opt.parameters)
    losses, first = [], []
    for i in range(STEPS):
        loss, grads = step(ms.Tensor(x), ms.Tensor(y))
        if i == 0:
            first = [g.asnumpy() for g in grads]
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, first, opt


def _fsdp_rank(opt_name: str, mesh_shape: tuple[int, ...] | None) -> dict:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.platform import get_platform

    platform = get_platform()
    n, rank = platform.world_size(), platform.rank()
    mesh = None
    if mesh_shape is not None:
        names = ("replicate", "shard")[-len(mesh_shape):]
        mesh = init_device_mesh(mesh_shape, mesh_dim_names=names)
    net = _net()
    for layer in (net.fc1, net.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x, y = _data(n)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    names = [p.name for p in net.trainable_params()]
    layout = {}
    for cell in (net.fc1, net.fc2, net):
        layout.update(cell.shard_layout())
    param_bytes = sum(p.nbytes for p in net.trainable_params())
    losses, first, opt = _train(net, opt_name, x[rows], y[rows])
    full = {name: v.asnumpy() for name, v in net.full_parameters().items()}
    return {"losses": losses, "grads": dict(zip(names, first, strict=True)), "layout": layout,
            "param_bytes": param_bytes, "state_bytes": _state_bytes(opt), "full": full,
            "shapes": {p.name: tuple(p.shape) for p in net.trainable_params()}}


def _reference(opt_name: str, n: int) -> dict:
    net = _net()
    x, y = _data(n)
    names = [p.name for p in net.trainable_params()]
    losses, first, _opt = _train(net, opt_name, x, y)
    return {"losses": losses, "grads": dict(zip(names, first, strict=True)),
            "full": {name: p.asnumpy() for name, p in net.parameters_and_names()},
            "bytes": sum(p.nbytes for p in net.trainable_params())}


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = RTOL * max(1.0, float(np.abs(want).max(initial=0.0)))
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


def _check(results: list[dict], ref: dict, n_shard: int, state_per_param: int) -> None:
    n = len(results)
    mean_loss = np.mean([r["losses"] for r in results], axis=0)
    _close(mean_loss, np.array(ref["losses"]), "mean loss per step")
    for rank, res in enumerate(results):
        for name, want in ref["full"].items():
            _close(res["full"][name], want, f"rank {rank} {name} after {STEPS} steps")
        padded_bytes = 0
        for name, (start, length, rows) in res["layout"].items():
            want = ref["grads"][name]
            got = res["grads"][name]
            assert got.shape == (rows, *want.shape[1:]), (rank, name, got.shape)
            _close(got[:length], want[start:start + length], f"rank {rank} grad {name}")
            assert not np.any(got[length:]), f"rank {rank} {name}: padding got a gradient"
            padded_bytes += rows * int(np.prod(want.shape[1:], dtype=np.int64)) * 4
        assert res["param_bytes"] == padded_bytes, (rank, res["param_bytes"], padded_bytes)
        # 1/N of the bytes, plus at most one padding row per parameter
        rows_bytes = sum(int(np.prod(v.shape[1:], dtype=np.int64)) * 4
                         for v in ref["full"].values())
        assert res["param_bytes"] <= ref["bytes"] / n_shard + rows_bytes, rank
        assert res["state_bytes"] == state_per_param * res["param_bytes"], rank
    assert n % n_shard == 0


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_fully_shard_2_ranks_matches_one_process(pool2, opt_name: str) -> None:
    results = pool2.run(_fsdp_rank, opt_name, None)
    _check(results, _reference(opt_name, 2), 2, {"sgd": 1, "adam": 2}[opt_name])  # SGD: `accum`


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_fully_shard_4_ranks_matches_one_process(pool4, opt_name: str) -> None:
    results = pool4.run(_fsdp_rank, opt_name, (4,))
    _check(results, _reference(opt_name, 4), 4, {"momentum": 1, "adam": 2}[opt_name])


def test_hsdp_replicate_2_shard_2_matches_one_process(pool4) -> None:
    """HSDP on a (replicate, shard) = (2, 2) mesh: shards over 2 ranks, gradients
    reduce-scattered over the shard pair and summed over the replicas, mean over all 4."""
    results = pool4.run(_fsdp_rank, "adam", (2, 2))
    _check(results, _reference("adam", 4), 2, 2)


def _errors_rank() -> dict:
    import mindspore as ms
    from mindspore import Parameter, nn

    from hyperpar import fully_shard

    out = {}
    net = fully_shard(nn.Dense(3, 2))
    for name, call in (
        ("twice", lambda: fully_shard(net)),
        ("not_cell", lambda: fully_shard(object())),
        ("reshard", lambda: fully_shard(nn.Dense(3, 2), reshard_after_forward="yes")),
    ):
        try:
            call()
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)

    class Scalar(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.scale = Parameter(ms.Tensor(2.0, ms.float32), name="scale")

        def construct(self, x):
            return x * self.scale

    try:
        fully_shard(Scalar())
        out["scalar"] = "accepted"
    except ValueError as exc:
        out["scalar"] = str(exc)
    class Tied(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Dense(3, 3)
            self.outer = nn.Dense(3, 3)
            self.outer.weight = self.inner.weight

        def construct(self, x):
            return self.outer(self.inner(x))

    tied = Tied()
    fully_shard(tied.inner)
    try:
        fully_shard(tied)
        out["tied"] = "accepted"
    except ValueError as exc:
        out["tied"] = str(exc)
    cell = Scalar()
    fully_shard(cell, ignored_params={cell.scale})  # left whole: no parameter to shard
    out["ignored"] = float(cell(ms.Tensor(np.ones(2, np.float32))).asnumpy().sum())
    return out


def test_bad_input_is_refused_on_every_rank_before_any_collective(pool2) -> None:
    for rank, res in enumerate(pool2.run(_errors_rank)):
        assert "already fully sharded" in res["twice"], (rank, res["twice"])
        assert "expected a mindspore.nn.Cell" in res["not_cell"], (rank, res["not_cell"])
        assert "reshard_after_forward must be" in res["reshard"], (rank, res["reshard"])
        assert "is a scalar (0-d)" in res["scalar"] and "ignored_params" in res["scalar"], rank
        assert res["ignored"] == 4.0, rank
        assert "is tied between the fully-sharded" in res["tied"], (rank, res["tied"])


def _dp_tp_rank() -> dict:
    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        init_device_mesh,
        parallelize_module,
    )

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    net = _net()
    parallelize_module(net, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for cell in (net.fc1, net.fc2, net):
        fully_shard(cell, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    x, y = _data(2)
    rows = slice(dp * PER_RANK, (dp + 1) * PER_RANK)
    losses, _first, _opt = _train(net, "adam", x[rows], y[rows])
    return {"dp": dp, "tp": mesh["tp"].get_local_rank(), "losses": losses,
            "full": {name: v.asnumpy() for name, v in net.full_parameters().items()}}


# the dim tensor parallelism splits each parameter on (None: whole), written out here
_TP_SPLITS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None,
              "out.weight": None, "out.bias": None}


def test_dp2_x_tp2_fully_shard_over_dp_matches_one_process(pool4) -> None:
    """Tensor parallelism over "tp" (fc1 colwise, fc2 rowwise; 7 rows split 4 + 3), then
    fully_shard of the tp-local pieces over "dp": each (dp, tp) rank's gathered pieces equal
    the one-process parameters' tp slice after 3 Adam steps."""
    results = pool4.run(_dp_tp_rank)
    ref = _reference("adam", 2)
    by_dp = {r["dp"]: r["losses"] for r in results}
    _close(np.mean([by_dp[0], by_dp[1]], axis=0), np.array(ref["losses"]), "mean loss")
    for res in results:
        for name, want in ref["full"].items():
            dim = _TP_SPLITS[name]
            if dim is not None:
                step = -(-want.shape[dim] // 2)
                want = np.take(want, range(res["tp"] * step,
                                           min(want.shape[dim], (res["tp"] + 1) * step)), dim)
            _close(res["full"][name], want, f"dp {res['dp']} tp {res['tp']} {name}")


def _checkpoint_refused_rank(path: str) -> str:
    from mindspore import nn

    from hyperpar import checkpoint, fully_shard

    net = fully_shard(nn.Dense(3, 2))
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-3)
    try:
        checkpoint.save(net, path, optimizer=opt)
    except NotImplementedError as exc:
        return str(exc)
    return "accepted"


def test_checkpoint_of_a_fully_sharded_cell_with_its_optimizer_is_refused_not_saved_wrong(
        pool2, tmp_path) -> None:
    """The parameters of a fully_shard Cell save and reshard (tests/mindspore/
    test_checkpoint.py); optimizer state does not yet: refused on every rank, nothing
    written."""
    for msg in pool2.run(_checkpoint_refused_rank, str(tmp_path / "ckpt")):
        assert "optimizer=" in msg and "not implemented for MindSpore" in msg, msg
    assert not (tmp_path / "ckpt").exists()
