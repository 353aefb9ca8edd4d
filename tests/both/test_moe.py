"""Expert parallelism, one body for torch and MindSpore: grouped experts under
``parallelize_module(experts, mesh, ExpertParallel())`` on 2 and 4 real ranks against the same
experts computed in one plain process of the same framework; ``ExpertTensorParallel`` on an
``(ep, tp)`` mesh and ``TensorParallel`` for grouped experts the same way; and EP x fully_shard
in torchtitan's layout (experts over ``(efsdp, ep)``, fully_shard over ``efsdp`` through
``shard_placement_fn`` returning ``ShardPlacementResult``, a dense projection in front of them
over every rank, gradients divided by the world), whose reference is the same model (projection
included) trained on the mean of the ranks' losses; the tolerance reasoning below holds for it
too (one more matmul of dim 6 in front, the dense gradient a sum over <= 4 * 10 rows).

Every rank routes its own tokens (4 experts, top-2, 5 tokens per rank). The routing is skewed:
expert 3 gets no token from anyone (with ep = 4 its rank computes on zero rows), and the last
rank sends every token to experts 0 and 1 (with ep = 2 it sends nothing to itself). Dropless,
and with a capacity of 2 assignments per expert per sending rank, dropped in the core's stated
order (:func:`hyperpar.moe.routing.capacity_keep`). The routing is host bookkeeping done by the
neutral core in both runs; the test compares what the frameworks compute with it:

* each rank's expert output rows (dispatch -> local experts -> combine, in the input's order);
* the gradient of each rank's routed tokens (the combine's and dispatch's backward all-to-alls);
* every expert weight after one SGD step at lr 1 (``w - grad``, gathered with
  ``full_tensor()``): each expert's gradient sums the tokens of every rank.

The reference runs each rank's rows through the unsharded experts and sums the ranks' losses.

Tolerance: weights normal(0, 0.5), tokens normal(0, 1), dim 6, hidden 5: activations and
gradients O(1-10). The two runs differ only in which rows share a matmul call and in the order
of the gradient sums over tokens (<= 20 rows per expert): each moves by <= 20 * 2^-24 relative,
~1.2e-6, a few chained; 2e-5 * max(1, max |want|) leaves margin on any x86 CPU, while a wrong
split, a row in the wrong order or a lost gradient is O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.both._frameworks import get
from tests.both._numpy_layout import close

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
E, K, T, D, H = 4, 2, 5, 6, 5
CAPACITY = 2


def _routing(rank: int, n: int, capacity: int | None) -> dict[str, np.ndarray]:
    """Rank ``rank``'s tokens, routed rows (sorted by expert, dropped ones left out), counts
    and the loss weights of its output rows; numpy, decided by the neutral core."""
    from hyperpar.moe.routing import capacity_keep, stable_sort_by_expert

    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((T, D)).astype(np.float32)
    pool = [0, 1] if rank == n - 1 else [0, 1, 2]  # expert 3 never chosen (skew)
    ids = [list(rng.choice(pool, size=K, replace=False)) for _ in range(T)]
    keep = (capacity_keep(ids, E, capacity) if capacity is not None
            else [[True] * K for _ in ids])
    kept = [t * K + c for t in range(T) for c in range(K) if keep[t][c]]
    order, counts = stable_sort_by_expert([ids[a // K][a % K] for a in kept], E)
    rows = x[[kept[i] // K for i in order]]
    g = rng.standard_normal((len(rows), D)).astype(np.float32)
    return {"rows": rows, "counts": np.asarray(counts, np.int64), "g": g}


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w1": (rng.standard_normal((E, H, D)) * 0.5).astype(np.float32),
            "w2": (rng.standard_normal((E, D, H)) * 0.5).astype(np.float32),
            "w3": (rng.standard_normal((E, H, D)) * 0.5).astype(np.float32)}


def _step(fw: Any, experts: Any, rows: Any, counts: Any, g: Any) -> dict[str, Any]:
    """Output rows, the routed rows' gradient, then one SGD step (lr 1) on the weights."""
    def loss(inp: Any) -> Any:
        return (experts(inp, counts) * g).sum()

    out = fw.numpy(experts(rows, counts))
    _, (grad,) = fw.value_and_grad(loss, [rows])
    fw.sgd(experts, 1.0)(lambda: loss(rows))
    return {"out": out, "grad": fw.numpy(grad)}


def _local(param: Any) -> Any:
    """This rank's piece (torch: the DTensor's local tensor; MindSpore: the Parameter)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _mesh(style: str, n: int) -> tuple[Any, Any, int, int]:
    """The mesh, the style, how many distinct token sets the ranks hold and this rank's set
    (tokens are replicated over tp: the tp ranks of one ep rank route the same tokens)."""
    from hyperpar import ExpertParallel, ExpertTensorParallel, TensorParallel, init_device_mesh
    from hyperpar.platform import get_platform

    rank = get_platform().rank()
    if style == "ep":
        return init_device_mesh((n,), mesh_dim_names=("ep",)), ExpertParallel(), n, rank
    if style == "etp":  # (ep, tp) = (2, n // 2)
        mesh = init_device_mesh((2, n // 2), mesh_dim_names=("ep", "tp"))
        return mesh, ExpertTensorParallel(reduce_output=True), 2, rank // (n // 2)
    mesh = init_device_mesh((n,), mesh_dim_names=("tp",))
    return mesh, TensorParallel(reduce_output=True), 1, 0


def _run(framework: str, style: str, n: int, capacity: int | None) -> dict:
    from hyperpar import parallelize_module
    from hyperpar.platform import get_platform

    fw = get(framework)
    rank = get_platform().rank()
    mesh, plan, sets, mine_set = _mesh(style, n)
    w = _weights()
    experts = parallelize_module(fw.experts(w["w1"], w["w2"], w["w3"]), mesh, plan)
    shapes = {k: tuple(_local(getattr(experts, k)).shape) for k in w}
    mine = _routing(mine_set, sets, capacity)
    got = _step(fw, experts, fw.tensor(mine["rows"]), fw.tensor(mine["counts"]),
                fw.tensor(mine["g"]))
    got["weights"] = {k: fw.numpy(getattr(experts, k).full_tensor()) for k in w}
    got["local_shapes"], got["set"], got["sets"] = shapes, mine_set, sets
    if rank == 0:  # the one-process reference: every token set through the whole experts
        ref = fw.experts(w["w1"], w["w2"], w["w3"])
        ref_sets = []
        for r in range(sets):
            rr = _routing(r, sets, capacity)
            rows, counts, g = (fw.tensor(rr["rows"]), fw.tensor(rr["counts"]),
                               fw.tensor(rr["g"]))
            out = fw.numpy(ref(rows, counts))
            _, (grad,) = fw.value_and_grad(
                lambda inp, c=counts, g=g: (ref(inp, c) * g).sum(), [rows])
            ref_sets.append({"out": out, "grad": fw.numpy(grad)})
        ref_model = fw.experts(w["w1"], w["w2"], w["w3"])
        tensors = [tuple(fw.tensor(a) for a in (rr["rows"], rr["counts"], rr["g"]))
                   for rr in (_routing(r, sets, capacity) for r in range(sets))]

        def total() -> Any:
            x, c, g = tensors[0]
            loss = (ref_model(x, c) * g).sum()
            for x, c, g in tensors[1:]:
                loss = loss + (ref_model(x, c) * g).sum()
            return loss

        fw.sgd(ref_model, 1.0)(total)
        got["ref"] = ref_sets
        got["ref_weights"] = {k: fw.numpy(getattr(ref_model, k)) for k in w}
    return got


def _check(results: list[dict], style: str, n: int, capacity: int | None) -> None:
    ref = results[0]
    for r, got in enumerate(results):
        local_experts = {"ep": E // n, "etp": E // 2, "tp": E}[style]
        assert got["local_shapes"]["w1"][0] == local_experts, got["local_shapes"]
        want = ref["ref"][got["set"]]
        close(f"rank {r} output rows", got["out"], want["out"], RTOL)
        close(f"rank {r} routed-row gradient", got["grad"], want["grad"], RTOL)
        for k, w in ref["ref_weights"].items():
            close(f"rank {r} {k} after one step", got["weights"][k], w, RTOL)
    # the skew happened: expert 3 unused, so its weights did not move
    assert np.array_equal(ref["ref_weights"]["w1"][3], _weights()["w1"][3])
    if capacity is not None:  # and the capacity dropped something somewhere
        sets = ref["sets"]
        assert any(len(_routing(r, sets, capacity)["rows"]) < T * K for r in range(sets))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("capacity", [None, CAPACITY], ids=["dropless", "capacity"])
def test_expert_parallel_matches_one_process(framework, pool, n, capacity) -> None:
    _check(pool(n).run(_run, framework, "ep", n, capacity), "ep", n, capacity)


@pytest.mark.parametrize(("style", "n"), [("etp", 4), ("tp", 2)])
def test_expert_tensor_parallel_matches_one_process(framework, pool, style, n) -> None:
    """ExpertTensorParallel on (ep, tp) = (2, 2) and TensorParallel on 2 ranks (hidden 5:
    uneven pieces 3 + 2), both with reduce_output=True, capacity dropping on."""
    _check(pool(n).run(_run, framework, style, n, CAPACITY), style, n, CAPACITY)


# ------------------------------------------------------------------ EP x fully_shard (efsdp)
def _proj() -> np.ndarray:
    return (np.random.default_rng(8).standard_normal((D, D)) * 0.5).astype(np.float32)


def _moe_forward(self: Any, x: Any, counts: Any) -> Any:
    return self.experts(self.proj(x), counts)


def _run_fsdp(framework: str, n: int, capacity: int | None) -> dict:
    """torchtitan's layout: the experts split over ``ep`` and, through ``shard_placement_fn``
    returning ``ShardPlacementResult``, fully_shard over their own data-parallel dim ``efsdp``;
    the dense projection fully_shard over every rank (``dp``). The gradients are divided by the
    world (``set_gradient_divide_factor``), as torchtitan does: the mean of the ranks' losses."""
    from hyperpar import ExpertParallel, Shard, fully_shard, init_device_mesh, parallelize_module
    from hyperpar.fsdp import FSDPMeshInfo, ShardPlacementResult
    from hyperpar.platform import get_platform

    fw = get(framework)
    rank = get_platform().rank()
    sparse = init_device_mesh((n // 2, 2), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh((n,), mesh_dim_names=("dp",))
    w = _weights()
    experts = parallelize_module(fw.experts(w["w1"], w["w2"], w["w3"]), sparse["ep"],
                                 ExpertParallel())
    model = fw.container(_moe_forward, proj=fw.linear(_proj(), None), experts=experts)
    info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    ids = {id(getattr(experts, k)) for k in w}

    def placement(p: Any) -> Any:
        return ShardPlacementResult(Shard(0), info) if id(p) in ids else None

    fully_shard(model, mesh=dense, shard_placement_fn=placement)
    model.set_gradient_divide_factor(n)
    mine = _routing(rank, n, capacity)
    rows, counts, g = (fw.tensor(mine[k]) for k in ("rows", "counts", "g"))

    def loss(inp: Any) -> Any:
        return (model(inp, counts) * g).sum()

    got: dict[str, Any] = {"out": fw.numpy(model(rows, counts))}
    _, (grad,) = fw.value_and_grad(loss, [rows])
    got["grad"] = fw.numpy(grad)
    fw.sgd(model, 1.0)(lambda: loss(rows))
    params = {k: getattr(model.experts, k) for k in w}
    params["proj"] = fw.weight(model.proj)
    got["local_shapes"] = {k: tuple(_local(p).shape) for k, p in params.items()}
    got["weights"] = {k: fw.numpy(p.full_tensor()) for k, p in params.items()}
    if rank == 0:  # one plain process: every rank's tokens through the whole model
        def ref_model() -> Any:
            return fw.container(_moe_forward, proj=fw.linear(_proj(), None),
                                experts=fw.experts(w["w1"], w["w2"], w["w3"]))

        ref, sets = ref_model(), []
        tensors = [tuple(fw.tensor(rr[k]) for k in ("rows", "counts", "g"))
                   for rr in (_routing(r, n, capacity) for r in range(n))]
        for x, c, gg in tensors:
            out = fw.numpy(ref(x, c))
            _, (gx,) = fw.value_and_grad(lambda inp, c=c, gg=gg: (ref(inp, c) * gg).sum(), [x])
            sets.append({"out": out, "grad": fw.numpy(gx)})
        trained = ref_model()

        def total() -> Any:
            x, c, gg = tensors[0]
            s = (trained(x, c) * gg).sum()
            for x, c, gg in tensors[1:]:
                s = s + (trained(x, c) * gg).sum()
            return s / n

        fw.sgd(trained, 1.0)(total)
        got["ref"] = sets
        got["ref_weights"] = {k: fw.numpy(getattr(trained.experts, k)) for k in w}
        got["ref_weights"]["proj"] = fw.numpy(fw.weight(trained.proj))
    return got


@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_with_fully_shard_matches_one_process(framework, pool, n) -> None:
    """EP x fully_shard on (efsdp, ep) = (n // 2, 2), the dense weight over all n ranks,
    capacity dropping on. With n = 2, efsdp has one rank (torchtitan's layout when ep equals
    the data-parallel degree): the experts' section has no collective, the dense one has."""
    results = pool(n).run(_run_fsdp, framework, n, CAPACITY)
    ref = results[0]
    for r, got in enumerate(results):
        # each rank stores E / ep experts split over efsdp (MindSpore pads to ceil rows too)
        assert got["local_shapes"]["w1"] == (E // 2 // (n // 2), H, D), got["local_shapes"]
        want = ref["ref"][r]
        close(f"rank {r} output rows", got["out"], want["out"], RTOL)
        close(f"rank {r} routed-row gradient", got["grad"], want["grad"], RTOL)
        for k, w in ref["ref_weights"].items():
            close(f"rank {r} {k} after one step", got["weights"][k], w, RTOL)
    assert np.array_equal(ref["ref_weights"]["w1"][3], _weights()["w1"][3])
    assert not np.array_equal(ref["ref_weights"]["proj"], _proj())


#: bad input to EP x fully_shard -> (error type, words its message holds), on both frameworks
FSDP_MISTAKES = {
    "placement fn returns a string": ("TypeError", "must return Shard(dim)"),
    "mesh_info without a DeviceMesh": ("TypeError", "hyperpar DeviceMesh"),
    "mesh_info dim out of range": ("ValueError", "not distinct dims"),
    "Shard(1) for an expert weight": ("NotImplementedError", "Shard(1)"),
    "experts fully_shard over their own ep ranks": ("ValueError", "tile one grid"),
    "divide factor 0": ("ValueError", "must be > 0"),
}


def _fsdp_mistakes(framework: str) -> dict:
    """Each mistake on a fresh model (every check is local: every rank raises it, before any
    collective), then a correct EP x fully_shard forward that would hang had a rank been left
    inside a collective."""
    from hyperpar import ExpertParallel, Shard, fully_shard, init_device_mesh, parallelize_module
    from hyperpar.fsdp import FSDPMeshInfo, ShardPlacementResult

    fw = get(framework)
    sparse = init_device_mesh((1, 2), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh((2,), mesh_dim_names=("dp",))
    w = _weights()

    def build() -> tuple[Any, set[int]]:
        experts = parallelize_module(fw.experts(w["w1"], w["w2"], w["w3"]), sparse["ep"],
                                     ExpertParallel())
        model = fw.container(_moe_forward, proj=fw.linear(_proj(), None), experts=experts)
        return model, {id(getattr(experts, k)) for k in w}

    def shard_with(result: Any) -> Callable[[], Any]:
        def call() -> Any:
            model, ids = build()
            return fully_shard(model, mesh=dense,
                               shard_placement_fn=lambda p: result if id(p) in ids else None)
        return call

    def divide_zero() -> None:
        shard_with(ShardPlacementResult(None, FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0))
                   )().set_gradient_divide_factor(0)

    cases = {
        "placement fn returns a string": shard_with("efsdp"),
        "mesh_info without a DeviceMesh": shard_with(
            ShardPlacementResult(Shard(0), FSDPMeshInfo("efsdp", shard_mesh_dim=0))),
        "mesh_info dim out of range": shard_with(
            ShardPlacementResult(Shard(0), FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=1))),
        "Shard(1) for an expert weight": shard_with(
            ShardPlacementResult(Shard(1), FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0))),
        "experts fully_shard over their own ep ranks": shard_with(None),
        "divide factor 0": divide_zero,
    }
    got: dict[str, Any] = {}
    for name, call in cases.items():
        try:
            call()
            got[name] = None
        except Exception as e:  # noqa: BLE001 -- the type is what the test compares
            got[name] = (type(e).__name__, str(e))
    model, ids = build()
    info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    fully_shard(model, mesh=dense,
                shard_placement_fn=lambda p: ShardPlacementResult(None, info)
                if id(p) in ids else None)
    mine = _routing(0, 2, None)
    got["after"] = fw.numpy(model(fw.tensor(mine["rows"]), fw.tensor(mine["counts"]))).shape
    return got


def test_expert_parallel_with_fully_shard_mistakes_raise_on_every_rank(framework, pool) -> None:
    for rank, got in enumerate(pool(2).run(_fsdp_mistakes, framework)):
        for name, (kind, words) in FSDP_MISTAKES.items():
            assert got[name] is not None, f"rank {rank}: {name} was accepted"
            assert got[name][0] == kind and words in got[name][1], (rank, name, got[name])
        assert got["after"] == (len(_routing(0, 2, None)["rows"]), D)
