"""MindSpore-only behaviour of ``data_parallel`` (the training parity of dp and dp x tp is in
tests/both/test_data_parallel.py): replicas start from rank 0's weights, and a gradient tuple
that does not match the Cell's trainable parameters is refused on every rank before any
collective."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)


def _cell(seed: int):
    import mindspore as ms
    from mindspore import nn

    net = nn.Dense(4, 3)
    rng = np.random.default_rng(seed)
    for _name, p in net.parameters_and_names():
        p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)))
    return net


def _broadcast_and_bad_grads() -> dict:
    import mindspore as ms

    from hyperpar import data_parallel
    from hyperpar.platform import get_platform

    rank = get_platform().rank()
    net = data_parallel(_cell(seed=rank))  # different weights per rank before the wrap
    out = {"weight": net.weight.asnumpy(), "rank0": _cell(seed=0).weight.asnumpy()}
    grads = tuple(ms.Tensor(np.ones(p.shape, np.float32)) for p in net.trainable_params())
    out["avg"] = [g.asnumpy() for g in net.reduce_gradients(grads)]
    for name, bad in (("short", grads[:1]), ("swapped", grads[::-1])):
        try:
            net.reduce_gradients(bad)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    try:
        data_parallel(net)
        out["twice"] = "accepted"
    except ValueError as exc:
        out["twice"] = str(exc)
    return out


def test_replicas_start_equal_and_bad_gradient_tuples_are_refused(pool2) -> None:
    for rank, res in enumerate(pool2.run(_broadcast_and_bad_grads)):
        assert np.array_equal(res["weight"], res["rank0"]), rank
        for g in res["avg"]:  # the average of ones over 2 ranks (sum of 0.5s, exactly 1)
            assert np.array_equal(g, np.ones_like(g)), rank
        assert "got 1 gradients for the 2 trainable parameters" in res["short"], res["short"]
        assert "in the order of model.trainable_params()" in res["swapped"], res["swapped"]
        assert "already data-parallel" in res["twice"], res["twice"]
