"""DTensor on MindSpore, on real ranks, against numpy / one-process MindSpore on whole tensors.

Redistribution: for a global array ``X`` and a coefficient array ``C``, each rank lays ``X`` out
as ``src``, redistributes to ``dst`` and takes the local loss ``sum(y_local * C_dst_local)``;
the local result must be ``X``'s ``dst`` piece and the gradient ``C``'s piece in the gradient
layout of ``src`` (Partial read as Replicate). Values are small integers held in float32, so
every sum and product is exact: the comparisons are exact too.
"""

from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np
import pytest

from hyperpar.dtensor.placement import Partial, Replicate, Shard
from hyperpar.platform import get_platform

R, P = Replicate(), Partial("sum")
SHAPE = (5, 6)  # 5 rows on 4 ranks: torch.chunk gives 2, 2, 1, 0


def _piece(full: np.ndarray, placements, mesh_shape, coord) -> np.ndarray:
    """The torch.chunk piece of ``full`` at ``coord`` (written independently of hyperpar)."""
    out = full
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            n, size = mesh_shape[m], out.shape[p.dim]
            step = -(-size // n)
            start = min(coord[m] * step, size)
            stop = min(start + step, size)
            out = np.take(out, range(start, stop), axis=p.dim)
    return out


def _terms(full: np.ndarray, placements, mesh_shape, coord, seed: int) -> np.ndarray:
    """This rank's term of ``full`` under Partial("sum") mesh dims: integer-valued random terms
    that sum to ``full`` exactly; rank 0 of each Partial dim keeps the remainder."""
    local = full
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            rng = np.random.default_rng(seed + 100 * m)
            extra = rng.integers(-3, 4, (mesh_shape[m], *full.shape)).astype(np.float32)
            extra[0] = 0
            extra[0] = local - extra.sum(0)
            local = extra[coord[m]]
    return local


def _mesh(shape):
    from hyperpar_mindspore.mesh import init_device_mesh

    return init_device_mesh(shape)


def _coord(mesh):
    return tuple(mesh.get_local_rank(d) for d in range(mesh.ndim))


def _redistribute_cases(mesh_shape, cases) -> list:
    from hyperpar_mindspore.dtensor import DTensor, grad

    mesh = _mesh(mesh_shape)
    coord = _coord(mesh)
    rng = np.random.default_rng(0)
    x = rng.integers(-4, 5, SHAPE).astype(np.float32)
    c = rng.integers(-4, 5, SHAPE).astype(np.float32)
    out = []
    for k, (src, dst) in enumerate(cases):
        local = _terms(_piece(x, src, mesh_shape, coord), src, mesh_shape, coord, k)
        d = DTensor.from_local(ms.Tensor(local), mesh, src, shape=SHAPE)
        c_local = ms.Tensor(_piece(c, dst, mesh_shape, coord))

        def loss(t, dst=dst, c_local=c_local):
            return (t.redistribute(mesh, dst).to_local() * c_local).sum()

        y = d.redistribute(mesh, dst)
        g = grad(loss)(d)
        out.append({"src": src, "dst": dst, "y": y.to_local().asnumpy(), "y_shape": y.shape,
                    "y_pl": y.placements, "g": g.to_local().asnumpy(), "g_pl": g.placements,
                    "g_type": type(g).__name__, "coord": coord})
    return out


def _check_redistribute(results, mesh_shape) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(-4, 5, SHAPE).astype(np.float32)
    c = rng.integers(-4, 5, SHAPE).astype(np.float32)
    for rank_res in results:
        for res in rank_res:
            src, dst, coord = res["src"], res["dst"], res["coord"]
            what = f"{src} -> {dst} at {coord}"
            assert res["y_shape"] == SHAPE and res["y_pl"] == dst, what
            want = _piece(x, dst, mesh_shape, coord)
            if any(isinstance(p, Partial) for p in dst):
                continue  # the terms are checked by summing below
            np.testing.assert_array_equal(res["y"], want, err_msg=what)
            assert res["g_type"] == "DTensor", what
            gpl = tuple(R if isinstance(p, Partial) else p for p in src)
            assert res["g_pl"] == gpl, what
            np.testing.assert_array_equal(res["g"], _piece(c, gpl, mesh_shape, coord),
                                          err_msg=what)
    # Partial destinations: the terms over the Partial mesh dims sum to the piece.
    cases = [(r["src"], r["dst"]) for r in results[0]]
    for k, (src, dst) in enumerate(cases):
        if not any(isinstance(p, Partial) for p in dst):
            continue
        total: dict = {}
        for rank_res in results:
            res = rank_res[k]
            key = tuple(cc if not isinstance(p, Partial) else 0
                        for cc, p in zip(res["coord"], dst, strict=True))
            total[key] = total.get(key, 0) + res["y"]
        for key, got in total.items():
            np.testing.assert_array_equal(got, _piece(x, dst, mesh_shape, key),
                                          err_msg=f"{src} -> {dst}")


PLACEMENTS_1D = [(Shard(0),), (Shard(1),), (R,), (P,)]


@pytest.mark.parametrize("n", [2, 4])
def test_every_1d_redistribution_values_and_gradients(pool2, pool4, n):
    cases = [(a, b) for a, b in itertools.product(PLACEMENTS_1D, repeat=2)]
    results = (pool2 if n == 2 else pool4).run(_redistribute_cases, (n,), cases)
    _check_redistribute(results, (n,))


CASES_2D = [
    ((Shard(0), Shard(1)), (R, R)), ((R, R), (Shard(0), Shard(1))),
    ((Shard(0), Shard(0)), (R, R)), ((R, R), (Shard(0), Shard(0))),
    ((Shard(0), Shard(0)), (Shard(1), Shard(1))), ((Shard(0), Shard(1)), (Shard(1), Shard(0))),
    ((Shard(0), Shard(0)), (Shard(0), R)), ((Shard(0), R), (Shard(0), Shard(0))),
    ((P, P), (R, R)), ((P, Shard(1)), (Shard(0), Shard(1))), ((P, P), (Shard(0), Shard(0))),
    ((R, Shard(0)), (P, R)), ((Shard(1), P), (R, Shard(1))), ((R, R), (R, P)),
]


def test_2d_mesh_redistributions_values_and_gradients(pool4):
    _check_redistribute(pool4.run(_redistribute_cases, (2, 2), CASES_2D), (2, 2))


def _distribute_and_full(mesh_shape) -> dict:
    from hyperpar import DTensor, distribute_tensor  # the public names on this backend

    mesh = _mesh(mesh_shape)
    rank = get_platform().rank()
    x = np.arange(30, dtype=np.float32).reshape(SHAPE)
    # only src_data_rank's tensor counts: the others hold garbage
    mine = ms.Tensor(x if rank == 0 else -x)
    placements = (Shard(1),) * len(mesh_shape) if len(mesh_shape) == 1 else (Shard(1), Shard(0))
    d = distribute_tensor(mine, mesh, placements)
    back = d.full_tensor()
    inferred = DTensor.from_local(d.to_local(), mesh, placements, run_check=True)
    wrong = ""
    try:
        DTensor.from_local(d.to_local(), mesh, placements, shape=(5, 7))
    except ValueError as exc:
        wrong = str(exc)
    return {"local": d.to_local().asnumpy(), "coord": _coord(mesh), "full": back.asnumpy(),
            "type": type(d).__name__, "inferred": inferred.shape, "wrong": wrong,
            "placements": placements}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_distribute_tensor_full_tensor_and_uneven_from_local(pool4, mesh_shape):
    x = np.arange(30, dtype=np.float32).reshape(SHAPE)
    for res in pool4.run(_distribute_and_full, mesh_shape):
        assert res["type"] == "DTensor"
        np.testing.assert_array_equal(res["local"],
                                      _piece(x, res["placements"], mesh_shape, res["coord"]))
        np.testing.assert_array_equal(res["full"], x)
        assert res["inferred"] == SHAPE
        if mesh_shape == (4,):  # 6 columns on 4 ranks: 2, 2, 2, 0 -- (5, 7) gives 2, 2, 2, 1
            assert ("does not match" in res["wrong"]) == (res["coord"][0] == 3)
