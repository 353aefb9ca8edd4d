"""MindSpore's expert-parallel mechanics on real ranks (the parity tests are one body for both
frameworks in ``tests/both/test_moe.py``):

* ``all_to_all_single_autograd`` with uneven splits, zero-row pieces and a rank receiving
  nothing: the forward equals the exchange written out in numpy, and ``ms.grad`` of
  ``sum(out * g)`` equals ``g`` sent back with the split lists swapped (exact: no arithmetic);
* bad input on one rank (counts not summing to the rows) raises the same error on every rank,
  before the token all-to-all;
* ``ms.jit`` around a Cell holding an ``ExpertParallel`` Cell raises, naming the style and PyNative;
* ``checkpoint.save`` of an ``ExpertParallel`` Cell raises on every rank, naming the parameter,
  before anything is written (not supported yet on MindSpore).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)

#: rows rank s sends to rank d on 2 ranks: rank 1 sends nothing to itself, rank 0 one row to 1
SPLITS = [[3, 1], [2, 0]]


def _rows(rank: int, n: int) -> np.ndarray:
    return (np.arange(sum(SPLITS[rank]) * 3, dtype=np.float32).reshape(-1, 3) + 100 * rank)


def _all_to_all() -> dict:
    import mindspore as ms

    from hyperpar.platform import get_platform

    platform = get_platform()
    me, n = platform.rank(), platform.world_size()
    ins = SPLITS[me]
    outs = [SPLITS[s][me] for s in range(n)]
    x = ms.Tensor(_rows(me, n))
    g = ms.Tensor(np.random.default_rng(me).standard_normal((sum(outs), 3)).astype(np.float32))
    out = platform.all_to_all_single_autograd(x, outs, ins, None)
    grad = ms.grad(lambda t: (platform.all_to_all_single_autograd(t, outs, ins, None)
                              * g).sum())(x)
    return {"out": out.asnumpy(), "grad": grad.asnumpy(), "g": g.asnumpy()}


def test_all_to_all_single_autograd_uneven_and_empty(pool2):
    results = pool2.run(_all_to_all)
    n = 2
    for d in range(n):  # rank d receives, in source order, the rows each rank s sent it
        want = np.concatenate([_rows(s, n)[sum(SPLITS[s][:d]):sum(SPLITS[s][:d + 1])]
                               for s in range(n)])
        assert np.array_equal(results[d]["out"], want)
    for s in range(n):  # the gradient of rank s's rows: its rows' g, sent back
        want = np.concatenate([
            results[d]["g"][sum(SPLITS[r][d] for r in range(s)):][:SPLITS[s][d]]
            for d in range(n)])
        assert np.array_equal(results[s]["grad"], want)


def _experts() -> object:
    import mindspore as ms
    from mindspore import mint, nn

    rng = np.random.default_rng(0)

    class Experts(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = ms.Parameter(ms.Tensor(rng.standard_normal((4, 5, 6)).astype(np.float32)))
            self.w2 = ms.Parameter(ms.Tensor(rng.standard_normal((4, 6, 5)).astype(np.float32)))
            self.w3 = ms.Parameter(ms.Tensor(rng.standard_normal((4, 5, 6)).astype(np.float32)))

        def construct(self, x: object, counts: object) -> object:
            return mint.matmul(x, self.w1[0].T).sum() * 0 + x  # the dispatch is what is checked

    return Experts()


def _bad_counts() -> str:
    import mindspore as ms

    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.moe import MoERoutingError
    from hyperpar.platform import get_platform

    me = get_platform().rank()
    mesh = init_device_mesh((2,), mesh_dim_names=("ep",))
    experts = parallelize_module(_experts(), mesh, ExpertParallel())
    x = ms.Tensor(np.ones((3, 6), np.float32))
    counts = ms.Tensor(np.array([1, 1, 1, 1 if me == 1 else 0], np.int64))  # rank 1: 4 != 3
    try:
        experts(x, counts)
    except MoERoutingError as exc:
        return str(exc)
    return "no error"


def test_bad_counts_on_one_rank_raise_on_every_rank(pool2):
    for message in pool2.run(_bad_counts):
        assert "ep rank 1: num_tokens_per_expert does not sum" in message, message
        assert "before the token all-to-all" in message


def _jit_error() -> str:
    import mindspore as ms
    from mindspore import nn

    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module

    class Block(nn.Cell):  # the experts inside a model, as a plan meets them
        def __init__(self) -> None:
            super().__init__()
            self.experts = _experts()

        def construct(self, x: object, counts: object) -> object:
            return self.experts(x, counts)

    mesh = init_device_mesh((2,), mesh_dim_names=("ep",))
    experts = parallelize_module(Block(), mesh, {"experts": ExpertParallel()})
    x = ms.Tensor(np.ones((4, 6), np.float32))
    counts = ms.Tensor(np.array([1, 1, 1, 1], np.int64))
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # a failed compile writes rank_N/ folders into the working directory
        try:
            ms.jit(experts)(x, counts)
        except (NotImplementedError, ValueError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            os.chdir(here)
            ms.common.api._pynative_executor.clear_res()
    return "compiled"


def test_expert_parallel_refuses_graph_mode_by_name(pool2):
    for message in pool2.run(_jit_error):
        assert "ExpertParallel" in message and "PyNative" in message, message


def _checkpoint_error(path: str) -> dict:
    from hyperpar import ExpertParallel, checkpoint, init_device_mesh, parallelize_module
    from hyperpar.checkpoint import CheckpointError
    from hyperpar.platform import get_platform

    mesh = init_device_mesh((2,), mesh_dim_names=("ep",))
    experts = parallelize_module(_experts(), mesh, ExpertParallel())
    try:
        checkpoint.save(experts, path)
        message = ""
    except CheckpointError as exc:
        message = str(exc)
    # no rank was left inside a collective: the next one completes on both
    total = get_platform().all_gather_object(get_platform().rank())
    return {"message": message, "after": total, "written": sorted(os.listdir(path))
            if os.path.isdir(path) else []}


def test_expert_parallel_checkpoint_refused_on_every_rank_before_writing(pool2, tmp_path):
    """An ExpertParallel Parameter is this rank's experts only: saved as it is, each rank's
    piece would claim to be the whole tensor. Refused on every rank, naming the parameter."""
    path = str(tmp_path / "ep")
    for got in pool2.run(_checkpoint_error, path):
        assert "expert-parallel" in got["message"] and "'w1'" in got["message"], got
        assert "full_tensor()" in got["message"], got
        assert got["after"] == [0, 1]
        assert got["written"] == [], got
