"""DTensor ops, one body for torch and MindSpore: values and gradients against the same function
on the whole tensors in one process of that framework.

``x`` (7 x 5: uneven rows over 2 and 4 ranks), ``w`` (5 x 3), ``b`` (5,) and a Partial ``p``
(4 x 3, integer terms on each rank) go through ``x + b`` (broadcast), ``x @ w``, ``x @ b`` and
``b @ w`` (matrix-vector, as torch.matmul), ``sum(0)``,
``transpose(0, 1)``, ``reshape``, softmax over a whole and over a sharded dim, ops on the
Partial DTensor (``p + p``, ``p * 2``, ``p @ v``, ``relu(p)``, which must reduce first), basic
indexing (ints, slices with steps, None, ``...``), ``expand``/``broadcast_to``, the reductions
on gathered dims (``prod``, ``var``, ``std``, ``logsumexp``, ``norm``, over the sharded dim and
over the other one), ``var_mean``/``std_mean`` (both outputs), ``sum``/``mean``/``amax``
over an empty dim list (every dim, as both frameworks read it) and the scans
``cumsum``/``cumprod``. ``argmax`` gives integers: compared
exactly (``x`` is normal(0, 1): no ties) and left out of the loss. The loss
is ``sum_k sum(full_tensor(out_k) * C_k)``; its gradients for all four inputs are compared with
the one-process gradients.

Tolerance: float32 values O(1) (normal(0, 1) inputs, softmax <= 1). A distributed result differs
from the one-process one only in the order of float32 sums: a contraction or reduction of
K <= 7 terms (the largest inner dim; a product of K factors likewise changes by at most
~K * 2^-24 relative; the loss sums 21-35 terms per output, in a different order
too) changes by at most ~K * 2^-24 * sum|terms| <= 7 * 6e-8 * 7 * scale ~ 3e-6 * scale per op,
and the loss composes two such sums. We allow 2e-5 * max(1, max|want|): robust on any x86 CPU
(vectorized or not), while a missed reduction, a wrong piece or a doubled Partial is O(scale).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hyperpar import Partial, Replicate, Shard
from tests.both._frameworks import Framework, get
from tests.both._numpy_layout import close, piece, terms

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
R, P = Replicate(), Partial()

#: per mesh: the placements of x, w, b, p (2-D: x sharded on both dims, so ``x @ w`` contracts a
#: sharded dim into a Partial, and p mixes Partial with Shard)
LAYOUTS = {
    (2,): ((Shard(0),), (R,), (R,), (P,)),
    (4,): ((Shard(0),), (R,), (R,), (P,)),
    (2, 2): ((Shard(0), Shard(1)), (R, R), (R, R), (P, Shard(0))),
}


def _ops(fw: Framework, x: Any, w: Any, b: Any, p: Any, v: Any) -> dict[str, Any]:
    """The ops under test, written once: DTensors on the ranks, whole tensors in one process."""
    h = x + b
    y = h @ w
    return {
        "x + b": h,
        "x @ w": y,
        "x @ b": x @ b,                        # matrix @ vector
        "b @ w": b @ w,                        # vector @ matrix
        "sum(0)": y.sum(0),
        "transpose(0, 1)": y.transpose(0, 1),
        "reshape": y.reshape(7 * 3),
        "reshape 3-D": x.reshape(7, 5, 1),
        "softmax(-1)": fw.softmax(y, -1),
        "softmax(0)": fw.softmax(y, 0),        # over the sharded dim
        "p + p": p + p,
        "p * 2": p * 2.0,
        "p @ v": p @ v,
        "relu(p)": fw.relu(p),                 # nonlinear: the Partial sum is reduced first
        # view29b: basic indexing and expand/broadcast_to (rules/index.py)
        "x[1:5]": x[1:5],                      # a sharded dim sliced: gathered
        "x[:, 1:4:2]": x[:, 1:4:2],            # a step; (2, 2): dim 1 is sharded
        "x[None, ..., 2]": x[None, ..., 2],    # the row shard moves to dim 1
        "x[-1]": x[-1],
        "y[..., 0]": y[..., 0],                # (2, 2): y is Partial, which passes through
        "p[1:3, None]": p[1:3, None],
        "expand": x.reshape(7, 1, 5).expand(2, 7, 3, 5),   # a new leading dim, a size-1 grown
        "broadcast_to": fw.broadcast_to(b, (3, 5)),
        "p expand": p[:, None].expand(4, 2, 3),            # Partial passes through
        # red29: reductions on gathered dims (over dim 1 a row shard stays) and scans
        "prod(1)": x.prod(1),
        "prod(0)": x.prod(0),
        "prod(0, True)": x.prod(0, True),      # keepdim by position: a shard of dim 1 stays 1
        "var(1)": fw.var(x, 1, 1),
        "std(0, keepdim)": fw.std(x, 0, 0, True),
        "cumsum(0)": x.cumsum(0),
        "cumprod(1)": x.cumprod(1),
        "logsumexp(0)": x.logsumexp(0),
        "norm": x.norm(),
        "logsumexp(p)": p.logsumexp(1),        # the Partial sum is reduced first
        # fix29: an empty dim list reduces every dim (torch 2.13 and MindSpore 2.10 alike)
        "sum([])": x.sum([]),
        "mean(())": x.mean(()),
        "amax([])": x.amax([]),
        "p.sum([])": p.sum([]),                # stays Partial
        # fix29: var_mean / std_mean (MindSpore: ops.*, the legacy ReduceStd), two outputs
        "var_mean(1)": fw.var_mean(x, 1, 1)[0],
        "var_mean(1) mean": fw.var_mean(x, 1, 1)[1],
        "std_mean(0, keepdim)": fw.std_mean(x, 0, 0, True)[0],
        "std_mean(0, keepdim) mean": fw.std_mean(x, 0, 0, True)[1],
        "std_mean(p, ())": fw.std_mean(p, (), 1)[0],   # every dim; the Partial reduced first
        # integer outputs: compared exactly, left out of the loss (x has no ties)
        "argmax(1)": fw.argmax(x, 1, False),
        "argmax(0, keepdim)": fw.argmax(x, 0, True),
    }


def _run(framework: str, mesh_shape: tuple[int, ...]) -> dict:
    from hyperpar import DTensor, distribute_tensor, init_device_mesh
    from hyperpar.parallel import get_output_partition_spec, get_sharding

    fw = get(framework)
    mesh = init_device_mesh(mesh_shape)
    coord = tuple(mesh.get_local_rank(d) for d in range(mesh.ndim))
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.standard_normal((7, 5)).astype(np.float32),
        "w": rng.standard_normal((5, 3)).astype(np.float32),
        "b": rng.standard_normal((5,)).astype(np.float32),
        "p": rng.integers(-3, 4, (4, 3)).astype(np.float32),
    }
    v = fw.tensor(rng.standard_normal((3, 3)).astype(np.float32))  # a plain constant operand
    lx, lw, lb, lp = LAYOUTS[mesh_shape]
    x = distribute_tensor(fw.tensor(arrays["x"]), mesh, list(lx))
    w = distribute_tensor(fw.tensor(arrays["w"]), mesh, list(lw))
    b = distribute_tensor(fw.tensor(arrays["b"]), mesh, list(lb))
    p_local = terms(piece(arrays["p"], lp, mesh_shape, coord), lp, mesh_shape, coord, seed=1)
    p = DTensor.from_local(fw.tensor(p_local), mesh, list(lp), shape=(4, 3))
    v_d = distribute_tensor(v, mesh, [R] * len(mesh_shape))

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    outs = _ops(fw, x, w, b, p, v_d)
    names = [k for k, o in outs.items() if fw.numpy(full(o)).dtype.kind == "f"]  # differentiable
    coefs = {k: rng.standard_normal(tuple(full(outs[k]).shape)).astype(np.float32)
             for k in names}

    def loss(x: Any, w: Any, b: Any, p: Any, v: Any) -> Any:
        outs = _ops(fw, x, w, b, p, v)
        return sum((full(outs[k]) * fw.tensor(coefs[k])).sum() for k in names)

    dist_outs = {k: fw.numpy(full(o)) for k, o in _ops(fw, x, w, b, p, v_d).items()}
    value, grads = fw.value_and_grad(lambda *a: loss(*a, v_d), [x, w, b, p])
    whole = [fw.tensor(arrays[k]) for k in "xwbp"]
    ref_outs = {k: fw.numpy(o) for k, o in _ops(fw, *whole, v).items()}
    ref_value, ref_grads = fw.value_and_grad(lambda *a: loss(*a, v), whole)
    return {
        "outs": dist_outs, "ref_outs": ref_outs,
        "value": fw.numpy(full(value)), "ref_value": fw.numpy(ref_value),
        "grads": [fw.numpy(g.full_tensor()) for g in grads],
        "grad_types": [type(g).__name__ for g in grads],
        "ref_grads": [fw.numpy(g) for g in ref_grads],
        "y_placements": tuple((x + b).__matmul__(w).placements),
        # EasyDeL's helper predicts the layout the product really gets
        "spec": (get_output_partition_spec(x + b, w), get_sharding((x + b) @ w)),
    }


@pytest.mark.parametrize("mesh_shape", list(LAYOUTS), ids=str)
def test_ops_values_and_gradients_match_one_process(framework, pool, mesh_shape) -> None:
    for rank, res in enumerate(pool(int(np.prod(mesh_shape))).run(_run, framework, mesh_shape)):
        for name, want in res["ref_outs"].items():
            if want.dtype.kind in "iu":  # indices: exactly
                np.testing.assert_array_equal(res["outs"][name], want, f"rank {rank}: {name}")
            else:
                close(f"rank {rank}: {name}", res["outs"][name], want, RTOL)
        close(f"rank {rank}: loss", res["value"], res["ref_value"], RTOL)
        for name, got, want in zip("xwbp", res["grads"], res["ref_grads"], strict=True):
            close(f"rank {rank}: d loss / d {name}", got, want, RTOL)
        assert res["grad_types"] == ["DTensor"] * 4, res["grad_types"]
        predicted, real = res["spec"]
        assert predicted == real == ("0", None), res["spec"]
        if mesh_shape == (2, 2):
            # x sharded on the contraction dim 1 of x @ w: the product is a Partial sum there.
            assert res["y_placements"] == (Shard(0), Partial()), res["y_placements"]
        else:
            assert res["y_placements"] == (Shard(0),), res["y_placements"]
