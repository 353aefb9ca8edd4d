"""Every redistribution, one body for torch and MindSpore, on real ranks.

For a whole array ``X`` (7 x 10: 7 rows over 4 ranks are 2, 2, 2, 1; over 2, 4 and 3) each rank
lays ``X`` out as ``src`` (``DTensor.from_local`` of its numpy piece, or of integer terms that
sum to it under ``Partial``), redistributes to ``dst`` and checks its local piece against
numpy's ``torch.chunk`` piece and ``full_tensor()`` against ``X``. The gradient of
``sum(full_tensor(redistribute(x)) ** 2 * C)`` is compared with the same function's gradient
on the whole tensor in one process of that framework (``2 X C``).

Tolerance: none. The values are small integers held in float32 (|X|, |C| <= 4, Partial terms
<= 3 plus a remainder), so every sum, product and the R -> P split (halves or quarters at
most) is exact in float32 whatever the summation order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hyperpar import Partial, Replicate, Shard
from tests.both._frameworks import get
from tests.both._numpy_layout import piece, terms

pytestmark = pytest.mark.timeout(900)

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
SHAPE = (7, 10)

CASES_1D = [
    ((S0,), (R,)),    # S -> R: all-gather of uneven rows
    ((S1,), (R,)),
    ((P,), (R,)),     # P -> R: all-reduce
    ((P,), (S0,)),    # P -> S: reduce-scatter, uneven rows
    ((P,), (S1,)),
    ((R,), (S0,)),    # R -> S: local chunk
    ((R,), (S1,)),
    ((S0,), (S1,)),   # S(i) -> S(j): all-to-all
    ((S1,), (S0,)),
    ((R,), (P,)),     # R -> P
    ((S0,), (S0,)),   # no-op
]
CASES_2D = [
    ((S0, S1), (R, R)),
    ((S0, S0), (R, R)),     # nested uneven rows: 7 -> 4, 3 -> 2, 2 / 2, 1
    ((P, S0), (R, S0)),
    ((R, P), (R, S1)),
    ((P, P), (S0, R)),
    ((R, R), (S0, S1)),
    ((S0, R), (S0, S0)),
    ((S0, S1), (S1, S0)),
    ((R, S1), (S0, S1)),
    ((R, R), (P, R)),
    ((R, S1), (R, P)),
]


def _redistribute(framework: str, mesh_shape: tuple[int, ...], cases: list) -> list[dict]:
    """On every rank: each case's local piece, full tensor and gradients, and the reference."""
    from hyperpar import DTensor, init_device_mesh

    fw = get(framework)
    mesh = init_device_mesh(mesh_shape)
    coord = tuple(mesh.get_local_rank(d) for d in range(mesh.ndim))
    out = []
    for k, (src, dst) in enumerate(cases):
        rng = np.random.default_rng(k)
        x = rng.integers(-4, 5, SHAPE).astype(np.float32)
        c = fw.tensor(rng.integers(-4, 5, SHAPE).astype(np.float32))
        local = terms(piece(x, src, mesh_shape, coord), src, mesh_shape, coord, seed=k)
        d = DTensor.from_local(fw.tensor(local), mesh, list(src), shape=SHAPE)
        y = d.redistribute(mesh, list(dst))

        def loss(t: Any, dst: tuple = dst, c: Any = c) -> Any:
            return ((t.redistribute(mesh, list(dst)).full_tensor() ** 2) * c).sum()

        value, (g,) = fw.value_and_grad(loss, [d])
        ref_value, (ref_g,) = fw.value_and_grad(lambda t, c=c: ((t ** 2) * c).sum(),
                                                [fw.tensor(x)])
        out.append({
            "case": f"{src} -> {dst}", "x": x, "coord": coord,
            "placements": tuple(y.placements), "shape": tuple(y.shape),
            "local": fw.numpy(y.to_local()), "full": fw.numpy(y.full_tensor()),
            "value": fw.numpy(value), "ref_value": fw.numpy(ref_value),
            "grad_placements": tuple(g.placements), "grad_local": fw.numpy(g.to_local()),
            "grad_full": fw.numpy(g.full_tensor()), "ref_grad": fw.numpy(ref_g),
        })
    return out


def _check(results: list[list[dict]], mesh_shape: tuple[int, ...], cases: list) -> None:
    for rank_results in results:
        for res, (_src, dst) in zip(rank_results, cases, strict=True):
            what = f"{res['case']} at {res['coord']}"
            assert res["placements"] == dst, (what, res["placements"])
            assert res["shape"] == SHAPE, (what, res["shape"])
            np.testing.assert_array_equal(res["full"], res["x"], err_msg=what)
            if not any(isinstance(p, Partial) for p in dst):
                want = piece(res["x"], dst, mesh_shape, res["coord"])
                np.testing.assert_array_equal(res["local"], want, err_msg=what)
            np.testing.assert_array_equal(res["value"], res["ref_value"], err_msg=what)
            np.testing.assert_array_equal(res["grad_full"], res["ref_grad"], err_msg=what)
            # The gradient's local piece is the reference gradient's piece in the layout it
            # reports (a Partial gradient's pieces are terms: only its sum is defined).
            if not any(isinstance(p, Partial) for p in res["grad_placements"]):
                want = piece(res["ref_grad"], res["grad_placements"], mesh_shape, res["coord"])
                np.testing.assert_array_equal(res["grad_local"], want, err_msg=what)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_every_redistribution_values_and_gradients(framework, pool, mesh_shape) -> None:
    cases = CASES_2D if len(mesh_shape) == 2 else CASES_1D
    n = int(np.prod(mesh_shape))
    _check(pool(n).run(_redistribute, framework, mesh_shape, cases), mesh_shape, cases)
