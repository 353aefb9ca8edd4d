"""Embedding lookups, losses and norms on DTensors, one body for torch and MindSpore: values,
output placements and gradients against the same function on the whole tensors in one process
of that framework, on meshes (2,), (4,) and (2, 2).

Each case is a function of the adapter and its inputs, each input a (shape, placements per mesh,
kind): "f" a float input whose gradient is checked, "c" a float constant (a class weight: torch
has no gradient for it), "i<n>" integer ids / class targets below n. A Partial input is laid out
Replicate and redistributed to Partial inside the function (each rank then holds a term). Cases
only one framework has stay in that framework's file: torch's padding row and ``rms_norm``
(tests/dtensor/test_ops.py: MindSpore's ``Embedding`` and ``RmsNorm`` have no CPU kernel),
MindSpore's legacy ``LayerNorm`` mean/variance outputs and its class-weight gradient
(tests/mindspore/test_dtensor.py).

Tolerance: float32 inputs uniform in [-2, 2]; a distributed result differs from the one-process
one only in the order of float32 sums (a loss's local sums and all-reduced count, a norm's
weight-gradient summed over <= 4 ranks, a Partial input's terms added first): at most K <= 64
terms per sum and two chained sums change a result by <= 2 * K * 2^-24 * scale ~ 8e-6 * scale.
We allow 5e-5 * max(1, max|want|), far below a real error (a missed or doubled term is O(scale)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hyperpar import Partial, Replicate, Shard
from tests.both._frameworks import Framework, get
from tests.both._numpy_layout import close

pytestmark = pytest.mark.timeout(900)

RTOL = 5e-5
R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
Spec = tuple[tuple[int, ...], dict[Any, tuple], str]




#: name -> (function of the adapter and the inputs, input specs); the mesh key is the world size
#: for a 1-D mesh, the shape for (2, 2). A case runs on the meshes all its inputs name.
CASES: dict[str, tuple[Callable[..., Any], list[Spec]]] = {
    "embedding, ids sharded": (lambda fw, ids, t: fw.lookup(ids, t), [
        ((4, 6), {2: (S0,), 4: (S0,), (2, 2): (S0, S1)}, "i10"),
        ((10, 8), {2: (R,), 4: (R,), (2, 2): (R, R)}, "f")]),
    "embedding, table columns sharded": (lambda fw, ids, t: fw.lookup(ids, t), [
        ((4, 6), {2: (R,), 4: (S0,), (2, 2): (R, R)}, "i10"),
        ((10, 8), {2: (S1,), 4: (S1,), (2, 2): (S1, S0)}, "f")]),
    "embedding, ids and table columns sharded": (lambda fw, ids, t: fw.lookup(ids, t), [
        ((3, 5), {2: (S0,), (2, 2): (R, S1)}, "i7"),
        ((7, 4), {2: (S1,), (2, 2): (S1, R)}, "f")]),
    # vocabulary-parallel: a masked lookup on each rank's rows, Partial output (10 rows over 4
    # ranks: 3, 3, 3, 1)
    "embedding, vocabulary sharded": (lambda fw, ids, t: fw.lookup(ids, t), [
        ((3, 5), {2: (R,), 4: (R,), (2, 2): (R, R)}, "i10"),
        ((10, 8), {2: (S0,), 4: (S0,), (2, 2): (S0, S0)}, "f")]),
    "embedding, vocabulary and ids sharded": (lambda fw, ids, t: fw.lookup(ids, t), [
        ((3, 8), {4: (S1,), (2, 2): (R, S1)}, "i7"),
        ((7, 4), {4: (S0,), (2, 2): (S0, R)}, "f")]),
    "embedding, vocabulary on one mesh dim, ids on the other": (
        lambda fw, ids, t: fw.lookup(ids, t), [
            ((4, 6), {(2, 2): (S0, R)}, "i10"),
            ((10, 8), {(2, 2): (R, S0)}, "f")]),
    "cross_entropy, batch sharded": (lambda fw, x, t: fw.cross_entropy(x, t), [
        ((8, 10), {2: (S0,), 4: (S0,), (2, 2): (S0, R)}, "f"),
        ((8,), {2: (S0,), 4: (S0,), (2, 2): (S0, R)}, "i10")]),
    "cross_entropy, batch and classes sharded": (lambda fw, x, t: fw.cross_entropy(x, t), [
        ((6, 5), {2: (S0,), 4: (S1,), (2, 2): (S0, S1)}, "f"),
        ((6,), {2: (S0,), 4: (R,), (2, 2): (S0, R)}, "i5")]),
    "cross_entropy, classes sharded": (lambda fw, x, t: fw.cross_entropy(x, t), [
        ((7, 10), {2: (S1,), 4: (S1,), (2, 2): (S1, S0)}, "f"),
        ((7,), {2: (R,), 4: (R,), (2, 2): (R, S0)}, "i10")]),
    "cross_entropy, ignore_index": (lambda fw, x, t: fw.cross_entropy(x, t, ignore_index=0), [
        ((7, 10), {2: (S0,), 4: (S0,), (2, 2): (S0, S0)}, "f"),
        ((7,), {2: (S0,), 4: (S0,), (2, 2): (R, R)}, "i3")]),
    "cross_entropy, reduction none": (
        lambda fw, x, t: fw.cross_entropy(x, t, reduction="none"), [
            ((8, 10), {2: (S0,), 4: (S0,), (2, 2): (S0, S1)}, "f"),
            ((8,), {2: (S0,), 4: (S0,), (2, 2): (S0, R)}, "i10")]),
    # class weights 0.5..2.5, a constant; the mean divides by the all-reduced weighted count
    "cross_entropy, weighted": (
        lambda fw, x, t, w: fw.cross_entropy(x, t, w, ignore_index=2), [
            ((8, 5), {2: (S0,), 4: (S0,), (2, 2): (S0, S0)}, "f"),
            ((8,), {2: (R,), 4: (S0,), (2, 2): (R, R)}, "i5"),
            ((5,), {2: (R,), 4: (R,), (2, 2): (R, R)}, "c")]),
    "nll_loss, ignore_index": (
        lambda fw, x, t: fw.nll_loss(fw.log_softmax(x, 1), t, ignore_index=1), [
            ((7, 5), {2: (S0,), 4: (S0,), (2, 2): (R, S0)}, "f"),
            ((7,), {2: (S0,), 4: (R,), (2, 2): (R, R)}, "i3")]),
    # probability targets (a softmax of a float input: its gradient is checked too); the mean
    # divides by the known number of samples
    "cross_entropy, probabilities": (
        lambda fw, x, p: fw.cross_entropy(x, fw.softmax(p, -1)), [
            ((8, 5), {2: (S0,), 4: (S0,), (2, 2): (S0, R)}, "f"),
            ((8, 5), {2: (S0,), 4: (R,), (2, 2): (S0, R)}, "f")]),
    # norms: batch shards kept (weight gradients summed over them), the normalised dims
    # gathered, Partial inputs and weights reduced first, uneven pieces (6 over 4: 2, 2, 2, 0)
    "layer_norm": (lambda fw, x, w, b: fw.layer_norm_op(x, 1, w, b), [
        ((4, 6, 8), {2: (S0,), 4: (P,), (2, 2): (S0, S1)}, "f"),
        ((8,), {2: (R,), 4: (S0,), (2, 2): (R, R)}, "f"),
        ((8,), {2: (P,), 4: (R,), (2, 2): (R, P)}, "f")]),
    "layer_norm, normalised dim sharded": (lambda fw, x, w, b: fw.layer_norm_op(x, 1, w, b), [
        ((4, 6, 8), {2: (S2,), 4: (S2,), (2, 2): (S2, R)}, "f"),
        ((8,), {2: (S0,), 4: (R,), (2, 2): (R, S0)}, "f"),
        ((8,), {2: (R,), 4: (R,), (2, 2): (R, R)}, "f")]),
    "layer_norm over two dims": (lambda fw, x, w, b: fw.layer_norm_op(x, 2, w, b), [
        ((4, 3, 6), {2: (S1,), 4: (S0,), (2, 2): (S0, S1)}, "f"),
        ((3, 6), {2: (R,), 4: (S1,), (2, 2): (R, R)}, "f"),
        ((3, 6), {2: (S0,), 4: (R,), (2, 2): (P, R)}, "f")]),
    "group_norm": (lambda fw, x, w, b: fw.group_norm(x, 3, w, b), [
        ((4, 6, 3), {2: (S0,), 4: (S1,), (2, 2): (S0, S2)}, "f"),
        ((6,), {2: (S0,), 4: (R,), (2, 2): (R, R)}, "f"),
        ((6,), {2: (R,), 4: (P,), (2, 2): (P, R)}, "f")]),
}

#: Output placements decided by the one neutral rule: a vocabulary-sharded table gives a Partial
#: lookup (masked), a mean loss over a sharded batch a Partial one (local sum / global count).
OUT_PLACEMENTS = {
    "embedding, vocabulary sharded": {2: (P,), 4: (P,), (2, 2): (P, P)},
    "embedding, vocabulary and ids sharded": {4: (S1,), (2, 2): (P, S1)},
    "embedding, vocabulary on one mesh dim, ids on the other": {(2, 2): (S0, P)},
    "cross_entropy, batch sharded": {2: (P,), 4: (P,), (2, 2): (P, R)},
    "cross_entropy, weighted": {2: (P,), 4: (P,), (2, 2): (P, P)},
    "nll_loss, ignore_index": {2: (P,), 4: (P,), (2, 2): (R, P)},
    "cross_entropy, probabilities": {2: (P,), 4: (P,), (2, 2): (P, R)},
}


def _key(mesh_shape: tuple[int, ...]) -> Any:
    return mesh_shape[0] if len(mesh_shape) == 1 else mesh_shape


def _names(mesh_shape: tuple[int, ...]) -> list[str]:
    key = _key(mesh_shape)
    return [n for n, (_, specs) in CASES.items() if all(key in s[1] for s in specs)]


def _arrays(seed: int, specs: list[Spec]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for shape, _, kind in specs:
        if kind.startswith("i"):
            out.append(rng.integers(0, int(kind[1:]), shape))
        elif kind == "c":
            out.append(rng.integers(0, 5, shape).astype(np.float32) / 2 + 0.5)
        else:
            out.append(rng.uniform(-2, 2, shape).astype(np.float32))
    return out


def _case(fw: Framework, mesh: Any, key: Any, seed: int, name: str) -> dict:
    from hyperpar import DTensor, distribute_tensor

    fn, specs = CASES[name]
    arrays = _arrays(seed, specs)
    plain = [fw.index(a) if kind.startswith("i") else fw.tensor(a)
             for a, (_, _, kind) in zip(arrays, specs, strict=True)]
    floats = [i for i, (_, _, kind) in enumerate(specs) if kind == "f"]
    layouts = [s[1][key] for s in specs]
    leaves = [distribute_tensor(t, mesh, [R if isinstance(p, Partial) else p for p in pl])
              for t, pl in zip(plain, layouts, strict=True)]

    def call(inputs: list[Any], distributed: bool) -> Any:
        if distributed:  # Partial inputs: each rank holds a term of the whole
            inputs = [t.redistribute(mesh, list(pl)) if any(isinstance(p, Partial) for p in pl)
                      else t for t, pl in zip(inputs, layouts, strict=True)]
        return fn(fw, *inputs)

    def loss_of(inputs: list[Any], distributed: bool, coef: Any) -> Callable[..., Any]:
        def loss(*xs: Any) -> Any:
            args = list(inputs)
            for i, x in zip(floats, xs, strict=True):
                args[i] = x
            out = call(args, distributed)
            return ((out.full_tensor() if distributed else out) * coef).sum()

        return loss

    ref = call(plain, False)
    coef = fw.tensor(np.random.default_rng(99).uniform(-1, 1, tuple(ref.shape))
                     .astype(np.float32))
    _, ref_grads = fw.value_and_grad(loss_of(plain, False, coef), [plain[i] for i in floats])
    out = call(leaves, True)
    assert isinstance(out, DTensor), (name, type(out))
    _, grads = fw.value_and_grad(loss_of(leaves, True, coef), [leaves[i] for i in floats])
    return {"out": fw.numpy(out.full_tensor()), "ref": fw.numpy(ref),
            "placements": tuple(out.placements),
            "grads": [fw.numpy(g.full_tensor()) for g in grads],
            "grad_types": [type(g).__name__ for g in grads],
            "ref_grads": [fw.numpy(g) for g in ref_grads]}


def _run(framework: str, mesh_shape: tuple[int, ...]) -> dict:
    from hyperpar import init_device_mesh

    fw = get(framework)
    mesh = init_device_mesh(mesh_shape)
    out = {}
    for seed, name in enumerate(_names(mesh_shape)):
        try:
            out[name] = _case(fw, mesh, _key(mesh_shape), seed, name)
        except Exception as exc:
            raise RuntimeError(f"case {name!r} on mesh {mesh_shape} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_lookups_losses_and_norms_match_one_process(framework, pool, mesh_shape) -> None:
    key = _key(mesh_shape)
    names = _names(mesh_shape)
    for rank, res in enumerate(pool(int(np.prod(mesh_shape))).run(_run, framework, mesh_shape)):
        assert list(res) == names, (list(res), names)
        for name, r in res.items():
            what = f"rank {rank}: {name}"
            close(f"{what}: value", r["out"], r["ref"], RTOL)
            assert r["grad_types"] == ["DTensor"] * len(r["ref_grads"]), (what, r["grad_types"])
            for k, (got, want) in enumerate(zip(r["grads"], r["ref_grads"], strict=True)):
                close(f"{what}: gradient of float input {k}", got, want, RTOL)
            want_pl = OUT_PLACEMENTS.get(name, {}).get(key)
            if want_pl is not None:
                assert r["placements"] == want_pl, (what, r["placements"], want_pl)
