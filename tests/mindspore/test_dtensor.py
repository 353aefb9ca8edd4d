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
    from hyperpar import init_device_mesh  # the MindSpore mesh under HYPERPAR_BACKEND=mindspore

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
    # torch's rule: run_check without shape= needs equal local shapes (these are uneven)
    try:
        inferred = DTensor.from_local(d.to_local(), mesh, placements, run_check=True).shape
    except ValueError as exc:
        inferred = str(exc)
    given = DTensor.from_local(d.to_local(), mesh, placements, shape=SHAPE).full_tensor()
    wrong = ""
    try:
        DTensor.from_local(d.to_local(), mesh, placements, shape=(5, 7))
    except ValueError as exc:
        wrong = str(exc)
    return {"local": d.to_local().asnumpy(), "coord": _coord(mesh), "full": back.asnumpy(),
            "type": type(d).__name__, "inferred": inferred, "wrong": wrong,
            "given": given.asnumpy(),
            "placements": placements}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_distribute_tensor_full_tensor_and_uneven_from_local(pool4, mesh_shape):
    x = np.arange(30, dtype=np.float32).reshape(SHAPE)
    for res in pool4.run(_distribute_and_full, mesh_shape):
        assert res["type"] == "DTensor"
        np.testing.assert_array_equal(res["local"],
                                      _piece(x, res["placements"], mesh_shape, res["coord"]))
        np.testing.assert_array_equal(res["full"], x)
        assert "local shapes disagree" in res["inferred"], res["inferred"]
        np.testing.assert_array_equal(res["given"], x)
        if mesh_shape == (4,):  # 6 columns on 4 ranks: 2, 2, 2, 0 -- (5, 7) gives 2, 2, 2, 1
            assert ("does not match" in res["wrong"]) == (res["coord"][0] == 3)


# --------------------------------------------------------------------------- ops
# Each case: a function of MindSpore tensors, its inputs as (shape, placements per mesh size,
# kind), written once and run twice on every rank: on DTensors laid out as given, and on the
# whole plain tensors (no hyperpar, no communication). Outputs and gradients (of
# sum(out * C) for a fixed C) must agree.
#
# Tolerance: only float32 summation order differs (sharded sums are added in another order,
# softmax's max and exp sums likewise). With inputs |x| <= ~4, at most K = 64 terms per sum and
# at most two chained reductions, the difference stays below ~2 * K * 2**-24 * scale, ~8e-6
# scale; we allow 5e-5 * scale (scale: the largest magnitude compared), far below a real error
# (a missing reduction or a double-counted term is O(scale)).
TOL = 5e-5

S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def _f_add(x, y):
    return x + y


def _f_sub_neg(x, y):
    return -(x - y)


def _f_mul_div(x, y, z):
    return (x * y) / (z * z + 1)


def _f_scalars(x):
    return (1 - x) * 2 + x / 4 + 3


def _f_nonlinear(x):
    from mindspore import mint

    return mint.exp(mint.tanh(x)) + mint.nn.functional.relu(x)


def _f_matmul(a, b):
    from mindspore import mint

    return mint.matmul(a, b)


def _f_bmm(a, b):
    from mindspore import mint

    return mint.bmm(a, b)


def _f_linear(x, w, b):
    from mindspore import mint

    return mint.nn.functional.linear(x, w, b)


def _f_sum_mean(x):
    return x.sum(1, keepdim=True) * 2 + x.mean(0) + x.sum()


def _f_mean(x):
    from mindspore import mint

    return mint.mean(x, dim=0) * 3


def _f_max(x):
    from mindspore import mint

    values, _ = mint.max(x, dim=1, keepdim=True)
    return mint.amax(x, 0) + values.sum() - mint.amin(x, -2) * 2


def _f_reshape(x):
    return x.reshape(2, -1).view(-1) * 2


def _f_views(x):
    from mindspore import mint

    y = mint.unsqueeze(x, 0).unsqueeze(-1)  # (1, 4, 6, 1): ExpandDimsView, ExpandDims
    return mint.flatten(y.squeeze(0), 1) * 2 + y.squeeze()  # Squeeze, FlattenExt


def _f_cat(a, b):
    from mindspore import mint

    # (mint.stack is not tested: MindSpore 2.10 has no CPU kernel for StackExt)
    return mint.cat([a, b], dim=1) * 2 + mint.cat((b, a * b), -1)


def _f_stack_addn(a, b):
    from mindspore import ops

    # legacy primitives taking a list (Stack, AddN) never reach __fallback__: hyperpar routes
    # them through unsqueeze + cat and adds (hyperpar_mindspore.listops)
    stacked = ops.stack([a, b * 2], 1) * 3  # (4, 2, 3)
    last = ops.Stack(-1)((b, a)).sum(-1)  # (4, 3, 2) summed back to (4, 3)
    return stacked + ops.expand_dims(ops.addn([a, b, a * b]) + last, 1)


def _f_split(x):
    from mindspore import mint

    # Not mint.unbind (UnstackExtView) nor mint.split (SplitTensorView, SplitWithSizeView):
    # plain MindSpore 2.10 cannot differentiate the first and gets the others' gradients wrong.
    a, b, c = x.split(2, 1)  # SplitTensor
    d, e = x.split([2, 4], 1)  # SplitWithSize
    f, g = x.split(4, -1)  # SplitTensor
    h, i, j = mint.chunk(x, 3, -1)  # ChunkView
    small = a * 2 + b - c + d + g + h * i - j * 3
    return mint.cat([small, e * f], 1)


def _f_transpose(x):
    return x.transpose(0, 1).permute(1, 2, 0) * 2


def _f_softmax(x):
    from mindspore import mint, ops

    return mint.nn.functional.softmax(x, dim=-1) + ops.log_softmax(x, 0)


def _f_cross_entropy_weighted(logits, target, weight):
    from mindspore import ops

    # MindSpore differentiates the class weight too (through the mean's count)
    return ops.cross_entropy(logits, target, weight.abs() + 0.5, ignore_index=2)


def _f_layer_norm(x, g, b):
    from mindspore import ops

    # the legacy primitive (what nn.LayerNorm runs) with its mean and variance outputs
    y, mean, var = ops.LayerNorm(-1, -1, 1e-5)(x, g, b)
    return y * 2 + mean - var


_INT = "int"
# name -> (function, [(shape, {mesh shape: placements}, kind)])
OP_CASES = {
    "add_bias": (_f_add, [((5, 6), {2: (S0,), 4: (S0,), (2, 2): (S0, S1)}, ""),
                          ((6,), {2: (R,), 4: (R,), (2, 2): (R, R)}, "")]),
    "add_partials": (_f_add, [((4, 6), {2: (P,), 4: (P,), (2, 2): (P, S0)}, ""),
                              ((4, 6), {2: (P,), 4: (S1,), (2, 2): (P, P)}, "")]),
    "sub_neg": (_f_sub_neg, [((4, 6), {2: (S1,), 4: (P,)}, ""),
                             ((4, 6), {2: (S0,), 4: (S0,)}, "")]),
    "mul_div": (_f_mul_div, [((4, 6), {2: (P,), 4: (P,), (2, 2): (S0, P)}, ""),
                             ((4, 6), {2: (R,), 4: (S1,), (2, 2): (R, R)}, ""),
                             ((6,), {2: (R,), 4: (S0,), (2, 2): (S0, R)}, "")]),
    "scalars": (_f_scalars, [((5, 6), {2: (P,), 4: (S0,), (2, 2): (P, S1)}, "")]),
    "nonlinear": (_f_nonlinear, [((4, 6), {2: (P,), 4: (S1,)}, "")]),
    "matmul_rows": (_f_matmul, [((5, 6), {2: (S0,), 4: (S0,), (2, 2): (S0, S1)}, ""),
                                ((6, 3), {2: (R,), 4: (R,), (2, 2): (R, S0)}, "")]),
    "matmul_inner": (_f_matmul, [((4, 8), {2: (S1,), 4: (S1,), (2, 2): (R, S1)}, ""),
                                 ((8, 3), {2: (S0,), 4: (S0,), (2, 2): (S1, S1)}, "")]),
    "matmul_partial_batched": (_f_matmul, [((2, 4, 6), {2: (P,), 4: (S0,)}, ""),
                                           ((6, 3), {2: (R,), 4: (S1,)}, "")]),
    "bmm": (_f_bmm, [((4, 3, 6), {2: (S0,), 4: (S0,)}, ""),
                     ((4, 6, 5), {2: (S2,), 4: (S0,)}, "")]),
    "linear_colwise": (_f_linear, [((4, 6), {2: (R,), 4: (R,), (2, 2): (S0, R)}, ""),
                                   ((8, 6), {2: (S0,), 4: (S0,), (2, 2): (R, S0)}, ""),
                                   ((8,), {2: (S0,), 4: (S0,), (2, 2): (R, S0)}, "")]),
    "linear_rowwise": (_f_linear, [((4, 8), {2: (S1,), 4: (S1,), (2, 2): (S0, S1)}, ""),
                                   ((6, 8), {2: (S1,), 4: (S1,), (2, 2): (R, S1)}, ""),
                                   ((6,), {2: (R,), 4: (R,), (2, 2): (R, R)}, "")]),
    "sum_mean": (_f_sum_mean, [((5, 6), {2: (S0,), 4: (S1,), (2, 2): (S0, S1)}, "")]),
    "mean_uneven": (_f_mean, [((5, 6), {2: (S0,), 4: (S0,), (2, 2): (S0, S0)}, "")]),
    "max": (_f_max, [((5, 6), {2: (S0,), 4: (S1,), (2, 2): (S1, S0)}, "")]),
    "reshape": (_f_reshape, [((4, 6), {2: (S0,), 4: (S0,), (2, 2): (S0, S1)}, "")]),
    "views": (_f_views, [((4, 6), {2: (S0,), 4: (S1,), (2, 2): (S1, S0)}, "")]),
    "cat": (_f_cat, [((4, 3), {2: (S0,), 4: (S1,), (2, 2): (S1, S0)}, ""),
                                 ((4, 3), {2: (S1,), 4: (P,), (2, 2): (S0, P)}, "")]),
    "stack_addn": (_f_stack_addn, [((4, 3), {2: (S0,), 4: (S1,), (2, 2): (S1, S0)}, ""),
                                   ((4, 3), {2: (S1,), 4: (S1,), (2, 2): (S0, R)}, "")]),
    "split": (_f_split, [((4, 6), {2: (S0,), 4: (S1,), (2, 2): (S1, S0)}, "")]),
    "transpose_permute": (_f_transpose, [((4, 3, 2), {2: (S0,), 4: (S1,), (2, 2): (S0, P)},
                                          "")]),
    "softmax": (_f_softmax, [((4, 6), {2: (S1,), 4: (S0,), (2, 2): (S0, S1)}, "")]),
    # Lookups, losses and norms are tested once for torch and MindSpore in
    # tests/both/test_nn_ops.py; MindSpore's own cases stay here. The legacy LayerNorm
    # primitive's mean and variance outputs (torch's F.layer_norm has none): gathered normalised
    # dims and Partial inputs and weights, batch shards kept (the weight's gradient summed over
    # them). Each row is normalised whole on one rank by the same kernel as the reference; only
    # the weight/bias gradients add rows across ranks (<= 12 terms) and a Partial input's terms
    # are summed first: within TOL's derivation above.
    "layer_norm": (_f_layer_norm, [((4, 3, 6), {2: (S0,), 4: (P,), (2, 2): (S1, S0)}, ""),
                                   ((6,), {2: (R,), 4: (S0,), (2, 2): (R, R)}, ""),
                                   ((6,), {2: (P,), 4: (R,), (2, 2): (R, P)}, "")]),
    # the class weight's gradient (through the mean's all-reduced count): torch has none
    "cross_entropy_weighted": (_f_cross_entropy_weighted, [
        ((8, 5), {2: (S0,), 4: (S0,), (2, 2): (S0, S0)}, ""),
        ((8,), {2: (R,), 4: (S0,), (2, 2): (R, R)}, _INT),
        ((5,), {2: (R,), 4: (R,), (2, 2): (R, R)}, "")]),
}


def _inputs(name: str, key, seed: int) -> list[tuple[np.ndarray, tuple, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for shape, layouts, kind in OP_CASES[name][1]:
        if kind == _INT:
            arr = rng.integers(0, 5, shape).astype(np.int32)  # class targets of 5 classes
        else:
            arr = rng.uniform(-2, 2, shape).astype(np.float32)
        out.append((arr, layouts[key], kind))
    return out


def _run_ops(mesh_shape, names) -> dict:
    mesh = _mesh(mesh_shape)
    key = mesh_shape[0] if len(mesh_shape) == 1 else mesh_shape
    results = {}
    for seed, name in enumerate(names):
        try:
            results[name] = _run_op(mesh, key, seed, name)
        except Exception as exc:
            raise RuntimeError(f"op case {name!r} on mesh {mesh_shape} failed: {exc}") from exc
    return results


def _run_op(mesh, key, seed: int, name: str) -> dict:
    from hyperpar_mindspore.dtensor import distribute_tensor, value_and_grad

    fn = OP_CASES[name][0]
    inputs = _inputs(name, key, seed)
    floats = tuple(i for i, (_, _, kind) in enumerate(inputs) if kind != _INT)
    plain = [ms.Tensor(a) for a, _, _ in inputs]
    ref_out = fn(*plain)
    c = ms.Tensor(np.random.default_rng(99).uniform(-1, 1, tuple(ref_out.shape))
                  .astype(np.float32))

    def ref_loss(*xs, fn=fn, c=c):
        return (fn(*xs) * c).sum()

    _, ref_grads = ms.value_and_grad(ref_loss, floats)(*plain)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    dts = []
    for arr, placements, _ in inputs:
        # Partial inputs: this rank holds a term; rank-dependent terms summing to arr
        pl_r = tuple(R if isinstance(p, Partial) else p for p in placements)
        d = distribute_tensor(ms.Tensor(arr), mesh, pl_r)
        if pl_r != placements:
            d = d.redistribute(mesh, placements)
        dts.append(d)

    def loss(*xs, fn=fn, c=c):
        return (fn(*xs).full_tensor() * c).sum()

    out = fn(*dts)
    _, grads = value_and_grad(loss, floats)(*dts)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return {
        "out": out.full_tensor().asnumpy(), "out_type": type(out).__name__,
        "out_shape": tuple(out.shape), "ref": ref_out.asnumpy(),
        "grads": [g.full_tensor().asnumpy() for g in grads],
        "grad_types": [type(g).__name__ for g in grads],
        "ref_grads": [g.asnumpy() for g in ref_grads]}


def _check_ops(results) -> None:
    for rank_res in results:
        for name, res in rank_res.items():
            assert res["out_type"] == "DTensor", name
            assert res["out_shape"] == res["ref"].shape, name
            scale = max(1.0, float(np.abs(res["ref"]).max()))
            np.testing.assert_allclose(res["out"], res["ref"], rtol=0, atol=TOL * scale,
                                       err_msg=name)
            assert res["grad_types"] == ["DTensor"] * len(res["ref_grads"]), name
            for k, (g, want) in enumerate(zip(res["grads"], res["ref_grads"], strict=True)):
                gscale = max(1.0, float(np.abs(want).max()))
                np.testing.assert_allclose(g, want, rtol=0, atol=TOL * gscale,
                                           err_msg=f"{name}: gradient of input {k}")


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_ops_values_and_gradients_match_one_process(pool2, pool4, mesh_shape):
    key = mesh_shape[0] if len(mesh_shape) == 1 else mesh_shape
    names = [n for n, (_, specs) in OP_CASES.items() if all(key in s[1] for s in specs)]
    pool = pool2 if mesh_shape == (2,) else pool4
    _check_ops(pool.run(_run_ops, mesh_shape, names))


# --------------------------------------------------------------------------- errors
def _errors_and_recovery() -> dict:
    from hyperpar_mindspore.dtensor import distribute_tensor, grad
    from mindspore import mint, nn

    from hyperpar.dtensor.rules import ShardingError

    mesh = _mesh((get_platform().world_size(),))
    arr = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
    x = distribute_tensor(ms.Tensor(arr), mesh, (Shard(0),))
    out = {}
    try:  # LinalgVectorNorm: not mapped (no CPU kernel in MindSpore 2.10)
        mint.linalg.vector_norm(x, 2, 0)
    except ShardingError as exc:
        out["no_rule"] = str(exc)
    out["no_kernel"] = []
    for call in (lambda: mint.var_mean(x, 0), lambda: mint.std_mean(x, 1)):
        try:  # VarMean / StdMean: no CPU kernel, not mapped; the error names the mapped spelling
            call()
        except ShardingError as exc:
            out["no_kernel"].append(str(exc))
    # dims out of range raise torch's IndexError (they used to wrap round silently: flatten
    # (0, 2) of a 2-D tensor flattened dims 0..0, unsqueeze(3) inserted at 0)
    out["bad_dims"] = []
    for call in (lambda: mint.flatten(x, 0, 2), lambda: x.unsqueeze(3),
                 lambda: mint.unsqueeze(x, -4), lambda: x.squeeze(2)):
        try:
            call()
        except IndexError as exc:
            out["bad_dims"].append(str(exc))

    # MindSpore's executor is left broken by an exception inside a gradient call that
    # recorded a Cell with weights (the next call fails in LayerNormGrad) unless it is reset
    norm = nn.LayerNorm((6,))
    try:  # its gamma/beta are plain Parameters: refused (their gradient would miss rows)
        norm(x)
    except ValueError as exc:
        out["norm_plain"] = str(exc)

    def bad(t):
        y = norm(t.to_local()).sum()  # recorded, then the DTensor op without a rule raises
        return mint.linalg.vector_norm(t * 2, 2, 0).sum() + y

    def good(t):
        return (t * t).sum() + norm(t.to_local()).sum()  # a Partial("sum") DTensor loss

    try:
        grad(bad, 0, norm.trainable_params())(x)
    except ShardingError as exc:
        out["in_grad"] = str(exc)
    g, _ = grad(good, 0, norm.trainable_params())(x)  # the next gradient call works
    out["grad_type"], out["grad_pl"] = type(g).__name__, g.placements
    out["grad"] = g.full_tensor().asnumpy()
    # MindSpore's own ms.grad, not hyperpar's wrapper: a DTensor gradient too (gradwrap.py)
    out["raw"] = type(ms.grad(good)(x)).__name__
    out["norm_grad"] = ms.grad(lambda t: norm(t).sum())(ms.Tensor(arr)).asnumpy()

    # a legacy list primitive with no DTensor route returns a plain Tensor of local pieces:
    # refused (shown with AddN's route taken away), and the next gradient call still works
    from hyperpar_mindspore import listops
    from mindspore import ops

    addn = listops.EXPRESSED.pop("AddN")
    try:
        grad(lambda t: ops.addn([t, t]).sum(), 0)(x)
    except ShardingError as exc:
        out["list_refused"] = str(exc)
    finally:
        listops.EXPRESSED["AddN"] = addn
    out["after_refusal"] = grad(lambda t: ops.addn([t, t * t]).sum(), 0)(x).full_tensor().asnumpy()
    # a DTensor loss input with a plain target is refused before any collective
    from hyperpar_mindspore.dispatch import MixedTensorError

    try:
        ops.cross_entropy(x, ms.Tensor(np.zeros(4, np.int32)))
    except MixedTensorError as exc:
        out["plain_target"] = str(exc)
    # advanced indexing has no rule (MindSpore would run it on the local shard): refused
    out["advanced_index"] = []
    for index in ([0, 1], ms.Tensor(np.array([0, 1], np.int32)), True):
        try:
            x[index]
        except ShardingError as exc:
            out["advanced_index"].append(str(exc))
    return out


def test_an_op_without_a_rule_raises_and_the_next_gradient_call_works(pool2):
    arr = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
    for res in pool2.run(_errors_and_recovery):
        for key in ("no_rule", "in_grad"):
            assert "LinalgVectorNorm" in res[key] and "[Shard(dim=0)]" in res[key], res[key]
        assert len(res["no_kernel"]) == 2, res["no_kernel"]
        for msg, prim, fix in zip(res["no_kernel"], ("VarMean", "StdMean"),
                                  ("ops.var_mean", "ops.std_mean"), strict=True):
            assert f"'{prim}'" in msg and fix in msg and "[Shard(dim=0)]" in msg, msg
        assert len(res["bad_dims"]) == 4, res["bad_dims"]
        for msg, got in zip(res["bad_dims"], (2, 3, -4, 2), strict=True):
            assert "Dimension out of range" in msg and f"but got {got})" in msg, msg
        assert res["grad_type"] == "DTensor" and res["grad_pl"] == (Shard(0),)
        # d/dx of sum(x^2) + sum(layernorm(x)): 2x + (d/dx sum(layernorm), from plain MindSpore)
        np.testing.assert_allclose(res["grad"], 2 * arr + res["norm_grad"], rtol=0, atol=1e-5)
        assert res["raw"] == "DTensor"
        assert "LayerNorm on a DTensor" in res["norm_plain"] and "(6,)" in res["norm_plain"]
        assert "'AddN'" in res["list_refused"] and "full_tensor" in res["list_refused"]
        np.testing.assert_allclose(res["after_refusal"], 1 + 2 * arr, rtol=0, atol=1e-6)
        assert "ops.cross_entropy" in res["plain_target"] and "distribute_tensor" in \
            res["plain_target"], res["plain_target"]
        assert len(res["advanced_index"]) == 3, res["advanced_index"]
        for msg in res["advanced_index"]:
            assert "'getitem'" in msg and "basic indexing" in msg, msg
