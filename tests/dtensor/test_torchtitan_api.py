"""The DeviceMesh / DTensor API torchtitan uses (issue 31 B), on real ranks, each checked
against the same computation in plain torch in one process.

Tolerances: float32 sums of a few dozen terms reduced in another order differ by ~1e-6
relative; 1e-5 leaves margin and still fails on a wrong shard or a missing reduction (errors
of order 1). Optimizer steps: AdamW moves an element by about lr times the relative gradient
difference, so after 3 steps parameters agree within 1e-5 too (lr = 1e-2).
"""

from __future__ import annotations

import pytest
import torch

TOL = 1e-5


# ----------------------------------------------------------------------------- mesh
def _unflatten_facts():
    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyperpar.platform import get_platform

    platform = get_platform()
    world = init_device_mesh((4,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (2, 2), ("dp", "tp"))
    loader = world._unflatten("world", (2, 2), ("batch", "tp"))
    flat = dense["dp", "tp"]._flatten("dp_tp")
    errors = {}
    for key, call in {
        "sizes": lambda: world._unflatten(0, (3, 2), ("a", "b")),
        "names": lambda: world._unflatten(0, (2, 2), ("a",)),
        "dup": lambda: world._unflatten(0, (2, 2), ("a", "a")),
        "dim": lambda: world._unflatten("nope", (2, 2), ("a", "b")),
        "part": lambda: dense["tp"]._unflatten(0, (2, 1), ("a", "b")),
    }.items():
        try:
            call()
            errors[key] = None
        except (ValueError, NotImplementedError) as exc:
            errors[key] = str(exc)
    # DTensors on the "tp" of two unflattenings combine: the same devices
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    a = distribute_tensor(full, dense["tp"], [Shard(0)])
    b = distribute_tensor(full * 2, loader["tp"], [Shard(0)])
    total = (a + b).redistribute(dense["tp"], [Replicate()]).to_local()
    return {
        "shape": dense.shape, "names": dense.mesh_dim_names, "coord": dense.get_coordinate(),
        "tp": platform.group_ranks(dense["tp"].get_group()),
        "dp": platform.group_ranks(dense["dp"].get_group()),
        "same_tp": dense["tp"] == loader["tp"] and hash(dense["tp"]) == hash(loader["tp"]),
        "same_group": dense["tp"].get_group() is loader["tp"].get_group(),
        "batch_is_not_dp": dense["dp"] != loader["batch"],
        "by_index": (dense[0] == dense["dp"], dense[-1] == dense["tp"]),
        "flat": (flat.tolist(), dense["dp_tp"] is flat),
        "errors": errors, "total": total, "expected": full * 3,
    }


def test_unflatten_slices_and_several_unflattenings_share_devices(run_on_ranks):
    facts = run_on_ranks(4, _unflatten_facts)
    for rank, f in enumerate(facts):
        dp, tp = divmod(rank, 2)
        assert f["shape"] == (2, 2) and f["names"] == ("dp", "tp") and f["coord"] == [dp, tp]
        assert f["tp"] == [2 * dp, 2 * dp + 1] and f["dp"] == [tp, tp + 2]
        assert f["same_tp"] and f["same_group"] and f["batch_is_not_dp"]
        assert f["by_index"] == (True, True)
        assert f["flat"] == ([0, 1, 2, 3], True)
        e = f["errors"]
        assert "multiply to the size 4" in e["sizes"]
        assert "one name per size" in e["names"]
        assert "repeats" in e["dup"]
        assert "'nope' is not in" in e["dim"]
        assert "does not cover the world" in e["part"]
        torch.testing.assert_close(f["total"], f["expected"], rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------- collectives
def _funcol_facts():
    import hyperpar.dtensor.functional_collectives as funcol

    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    rank = mesh.get_rank()
    x = torch.arange(4.0).reshape(2, 2) + 10 * rank
    keep = x.clone()
    out = {
        "sum_tp": funcol.all_reduce(x, "sum", group=mesh["tp"]),
        "max_dp": funcol.all_reduce(x, "max", group=(mesh, "dp")),
        "avg_group": funcol.all_reduce(x, "avg", group=mesh.get_group("tp")),
        "gather1": funcol.wait_tensor(funcol.all_gather_tensor(x, 1, mesh["tp"])),
        "scatter1": funcol.reduce_scatter_tensor(x, "sum", 1, mesh["tp"]),
        "unchanged": torch.equal(x, keep),
    }
    try:
        from hyperpar.dtensor import Replicate, distribute_tensor

        funcol.all_reduce(distribute_tensor(x, mesh["tp"], [Replicate()]), "sum", mesh["tp"])
        out["dtensor_error"] = None
    except TypeError as exc:
        out["dtensor_error"] = str(exc)
    return out


def test_functional_collectives_take_hyperpar_meshes(run_on_ranks):
    facts = run_on_ranks(4, _funcol_facts)
    xs = [torch.arange(4.0).reshape(2, 2) + 10 * r for r in range(4)]
    for rank, f in enumerate(facts):
        dp, tp = divmod(rank, 2)
        row = [xs[2 * dp], xs[2 * dp + 1]]
        col = [xs[tp], xs[tp + 2]]
        torch.testing.assert_close(f["sum_tp"], row[0] + row[1])
        torch.testing.assert_close(f["max_dp"], torch.maximum(col[0], col[1]))
        torch.testing.assert_close(f["avg_group"], (row[0] + row[1]) / 2)
        torch.testing.assert_close(f["gather1"], torch.cat(row, dim=1))
        torch.testing.assert_close(f["scatter1"], (row[0] + row[1])[:, tp:tp + 1])
        assert f["unchanged"]
        assert "to_local()" in f["dtensor_error"]


# ----------------------------------------------------------------------------- optimizers
def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _reference_steps(kind: str) -> list[torch.Tensor]:
    model = _model()
    opt = _optimizer(kind, model.parameters())
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 6)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _optimizer(kind: str, params):
    if kind == "sgd_fused":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1,
                             **({"fused": True} if kind == "fused" else {"foreach": True}))


def _sharded_steps(kind: str):
    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    model = _model()
    for mod in (model[0], model[2]):
        mod.weight = torch.nn.Parameter(distribute_tensor(mod.weight.detach(), mesh,
                                                          [Shard(0)]))
        mod.bias = torch.nn.Parameter(distribute_tensor(mod.bias.detach(), mesh,
                                                        [Replicate()]))
    opt = _optimizer(kind, model.parameters())
    torch.manual_seed(1)
    norms = []
    for _ in range(3):
        x = distribute_tensor(torch.randn(5, 6), mesh, [Replicate()])
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5,
                                                    foreach=True).full_tensor())
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("kind", ["foreach", "fused", "sgd_fused"])
def test_foreach_and_fused_optimizers_with_clipping_match_plain_torch(run_on_ranks, kind):
    expected = _reference_steps(kind)
    for params, norms in run_on_ranks(2, _sharded_steps, kind):
        assert len(norms) == 3 and all(n.dim() == 0 for n in norms)
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(p, e, rtol=TOL, atol=TOL)


def _foreach_facts():
    from hyperpar.dtensor import (
        Replicate,
        Shard,
        ShardingError,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    fulls = [torch.randn(4, 6), torch.randn(6)]
    a = [distribute_tensor(fulls[0], mesh, [Shard(1)]), distribute_tensor(fulls[1], mesh,
                                                                          [Replicate()])]
    norms = {o: [n.full_tensor() for n in torch._foreach_norm(a, o)]
             for o in (1, 2, float("inf"))}
    same = torch._foreach_mul_(a, 3.0)
    out = {"norms": norms, "same": same[0] is a[0],
           "scaled": [t.full_tensor() for t in a]}
    try:
        torch._foreach_add_(a, [distribute_tensor(fulls[0], mesh, [Shard(0)]), a[1]])
        out["mismatch"] = None
    except ShardingError as exc:
        out["mismatch"] = str(exc)
    return out


def test_foreach_norm_and_inplace_ops_and_layout_mismatch_error(run_on_ranks):
    torch.manual_seed(0)
    fulls = [torch.randn(4, 6), torch.randn(6)]
    for f in run_on_ranks(2, _foreach_facts):
        for o, got in f["norms"].items():
            for g, t in zip(got, fulls, strict=True):
                torch.testing.assert_close(g, torch.linalg.vector_norm(t, o), rtol=TOL,
                                           atol=TOL)
        assert f["same"]
        for g, t in zip(f["scaled"], fulls, strict=True):
            torch.testing.assert_close(g, t * 3, rtol=TOL, atol=TOL)
        assert "entry 0 of its tensor lists has two layouts" in f["mismatch"]


# ----------------------------------------------------------------------------- local_map
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _local_map_facts():
    from hyperpar.dtensor.experimental import local_map as experimental_local_map

    from hyperpar import local_map
    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    x_full, w_full = torch.randn(4, 6), torch.randn(6)
    x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    rms = local_map(_rms, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
                    in_grad_placements=([Shard(0)], [Partial()]), device_mesh=mesh)
    y = rms(x, w)
    y.sum().backward()
    out = {"same_fn": experimental_local_map is local_map, "placements": y.placements,
           "y": y.full_tensor().detach(), "gx": x.grad.full_tensor(),
           "gw": w.grad.full_tensor()}
    xr = distribute_tensor(x_full, mesh, [Replicate()])
    try:
        rms(xr, w)
        out["strict"] = None
    except ValueError as exc:
        out["strict"] = str(exc)
    redis = local_map(_rms, out_placements=[Shard(0)], in_placements=([Shard(0)], None),
                      redistribute_inputs=True)
    out["redistributed"] = redis(xr, w.detach()).full_tensor()
    return out


from hyperpar.dtensor import Partial  # noqa: E402  (used inside the rank function above)


def test_local_map_runs_on_shards_with_grad_placements(run_on_ranks):
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    y = _rms(x, w)
    y.sum().backward()
    for f in run_on_ranks(2, _local_map_facts):
        assert f["same_fn"] and [type(p).__name__ for p in f["placements"]] == ["Shard"]
        torch.testing.assert_close(f["y"], y.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["gx"], x.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["gw"], w.grad, rtol=TOL, atol=TOL)
        assert "redistribute_inputs=True" in f["strict"]
        torch.testing.assert_close(f["redistributed"], y.detach(), rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------- rope ops
def _rope(x: torch.Tensor, freqs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs).flatten(-2)
    return torch.gather(out, 1, idx)


def _rope_facts(x_place: int):
    from hyperpar.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    x_full = torch.randn(4, 8)
    freqs = torch.polar(torch.ones(4, 4), torch.randn(4, 4))
    idx = torch.randint(0, 8, (4, 5))
    x = distribute_tensor(x_full, mesh, [Shard(x_place)]).requires_grad_()
    f = distribute_tensor(freqs, mesh, [Shard(0)])
    i = distribute_tensor(idx, mesh, [Shard(0)])
    y = _rope(x, f, i)
    (y * y).sum().backward()
    return {"y": y.full_tensor().detach(), "placements": str(y.placements),
            "gx": x.grad.full_tensor(), "complex": torch.view_as_complex(
                x.detach().reshape(4, 4, 2)).full_tensor()}


@pytest.mark.parametrize("x_place", [0, 1])
def test_rope_view_as_complex_real_and_gather_match_plain_torch(run_on_ranks, x_place):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    freqs = torch.polar(torch.ones(4, 4), torch.randn(4, 4))
    idx = torch.randint(0, 8, (4, 5))
    y = _rope(x, freqs, idx)
    (y * y).sum().backward()
    for f in run_on_ranks(2, _rope_facts, x_place):
        torch.testing.assert_close(f["y"], y.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["gx"], x.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["complex"], torch.view_as_complex(
            x.detach().reshape(4, 4, 2)))


# ----------------------------------------------------------------------------- to_empty
def _to_empty_facts():
    from hyperpar.dtensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = torch.nn.Linear(6, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight, mesh, [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias, mesh, [Replicate()]))
    model.register_buffer("scale", distribute_tensor(torch.empty(4, device="meta"), mesh,
                                                     [Shard(0)]))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.weight.copy_(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
        model.bias.fill_(0.5)
        model.scale.fill_(2.0)
    x = distribute_tensor(torch.ones(3, 6), mesh, [Replicate()])
    (model(x) * model.scale).sum().backward()
    # a constant filled into a Partial("sum") counts once; a plain whole tensor copied into
    # uneven shards (5 rows: 3 + 2) leaves each rank its own rows
    partial = DTensor.from_local(torch.zeros(2, 3), mesh, [Partial()]).fill_(1.5)
    product = DTensor.from_local(torch.zeros(2, 3), mesh, [Partial("product")]).fill_(1.5)
    uneven = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])
    uneven.copy_(torch.arange(15.0).view(5, 3))
    return {"devices": {n: (t.device.type, t.to_local().device.type, type(t).__name__)
                        for n, t in [*model.named_parameters(), *model.named_buffers()]},
            "params": [isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter)
                       for p in model.parameters()],
            "grad": model.weight.grad.full_tensor(),
            "partial_fill": partial.full_tensor(), "product_fill": product.full_tensor(),
            "copied": uneven.full_tensor()}


def test_to_empty_moves_dtensor_parameters_and_buffers_off_meta(run_on_ranks):
    torch.manual_seed(0)
    w = torch.randn(4, 6, requires_grad=True)
    (torch.nn.functional.linear(torch.ones(3, 6), w, torch.full((4,), 0.5)) * 2).sum().backward()
    for f in run_on_ranks(2, _to_empty_facts):
        assert all(d[:2] == ("cpu", "cpu") for d in f["devices"].values()), f["devices"]
        assert f["params"] == [True, True]
        torch.testing.assert_close(f["grad"], w.grad, rtol=TOL, atol=TOL)
        # exact: 1.5 + 0.0, 1.5 * 1.0 and copied values involve no rounding
        assert torch.equal(f["partial_fill"], torch.full((2, 3), 1.5))
        assert torch.equal(f["product_fill"], torch.full((2, 3), 1.5))  # not 1.5 ** 2
        assert torch.equal(f["copied"], torch.arange(15.0).view(5, 3))


# ----------------------------------------------------------------------------- custom Function
class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return (x * x).sum(-1)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g.unsqueeze(-1)


def _custom_function_facts():
    from hyperpar import local_map
    from hyperpar.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
    sq = local_map(_Square.apply, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    loss = (sq(x) + x.sum(-1)).sum()
    loss.backward()
    return {"loss": loss.full_tensor().detach(), "grad": x.grad.full_tensor()}


def test_custom_autograd_function_through_local_map_keeps_its_gradient(run_on_ranks):
    """The documented way to run a custom autograd.Function on DTensors (applying it to the
    DTensors directly is cut from the graph: docs/migration.md)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    loss = (_Square.apply(x) + x.sum(-1)).sum()
    loss.backward()
    for f in run_on_ranks(2, _custom_function_facts):
        torch.testing.assert_close(f["loss"], loss.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["grad"], x.grad, rtol=TOL, atol=TOL)


class _ScaledMatmul(torch.autograd.Function):
    """x @ w * alpha with a hand-written backward; ``alpha`` is not a tensor."""

    @staticmethod
    def forward(ctx, x, w, alpha):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.alpha = alpha
        return x @ w * alpha

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = g @ w.t() * ctx.alpha if ctx.needs_input_grad[0] else None
        gw = x.t() @ g * ctx.alpha if ctx.needs_input_grad[1] else None
        return gx, gw, None


class _Bridge(torch.autograd.Function):
    """torchtitan's ``_DecoderOutputGradientBackProp``: returns the (detached) loss; its
    backward hands a precomputed gradient to the hidden states."""

    @staticmethod
    def forward(ctx, hidden, accumulated_grad, loss):  # type: ignore[override]
        ctx.save_for_backward(accumulated_grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (accumulated_grad,) = ctx.saved_tensors
        return accumulated_grad * g, None, None


class _Cube(torch.autograd.Function):
    """The ``setup_context`` style (forward without ctx)."""

    @staticmethod
    def forward(x):  # type: ignore[override]
        return x * x * x

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class _PlainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.to_local() * 2   # a plain tensor for a DTensor input: its layout is unknown


def _chunked_loss(hidden, head, target):
    """torchtitan's chunked loss: the head's gradient computed inside, then bridged."""
    h = hidden.detach().requires_grad_()
    with torch.enable_grad():
        loss = ((h @ head - target) ** 2).sum()
        acc, g_head = torch.autograd.grad(loss, (h, head))
    return _Bridge.apply(hidden, acc, loss.detach()), g_head


def _applied_functions(x, w, head, target, cube_in):
    """The computation both sides run: custom Functions applied to (D)Tensors directly."""
    y = _ScaledMatmul.apply(x, w, 0.5)                    # x Shard(0), w Replicate
    hidden = torch.tanh(y) + _Cube.apply(cube_in).sum()
    loss, g_head = _chunked_loss(hidden, head, target)
    return loss + (_Square.apply(x)).sum(), g_head


def _inputs():
    torch.manual_seed(0)
    return (torch.randn(4, 6), torch.randn(6, 5), torch.randn(5, 3), torch.randn(4, 3),
            torch.randn(3))


def _function_facts():
    from hyperpar.dtensor._ops.dispatch import CustomFunctionError

    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    x, w, head, target, cube_in = _inputs()
    dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    dhead = distribute_tensor(head, mesh, [Replicate()]).requires_grad_()
    dtarget = distribute_tensor(target, mesh, [Shard(0)])
    dcube = distribute_tensor(cube_in, mesh, [Shard(0)]).requires_grad_()
    loss, g_head = _applied_functions(dx, dw, dhead, dtarget, dcube)
    out = {"loss_type": type(loss).__name__, "placements": loss.placements,
           "grad_fn": loss.grad_fn is not None}
    loss.backward()
    out.update(loss=loss.full_tensor(), g_head=g_head.full_tensor(), gx=dx.grad.full_tensor(),
               gw=dw.grad.full_tensor(), gcube=dcube.grad.full_tensor(),
               gw_placements=dw.grad.placements)
    try:  # a plain tensor returned as a DTensor input's gradient is refused, not guessed
        _PlainGrad.apply(dx).sum().backward()
        out["plain_grad"] = None
    except CustomFunctionError as exc:
        out["plain_grad"] = str(exc)
    with torch.no_grad():  # plain no_grad and inference mode stay allowed
        out["no_grad"] = (dx * 2).requires_grad
    with torch.inference_mode():
        out["inference"] = (dx * 2).requires_grad
    return out


def test_custom_functions_applied_to_dtensors_keep_their_gradients(run_on_ranks):
    """As torch's DTensor: custom autograd.Functions applied to DTensors directly (saved
    tensors, ``needs_input_grad``, a non-tensor argument, ``setup_context``, a Partial gradient
    of a Replicate input, torchtitan's chunked-loss bridge), against the same Functions on
    whole tensors in one process."""
    x, w, head, target, cube_in = (t.requires_grad_() for t in _inputs())
    loss, g_head = _applied_functions(x, w, head, target, cube_in)
    loss.backward()
    for f in run_on_ranks(2, _function_facts):
        assert f["loss_type"] == "DTensor" and f["grad_fn"], f
        torch.testing.assert_close(f["loss"], loss.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["g_head"], g_head, rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["gx"], x.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["gw"], w.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(f["gcube"], cube_in.grad, rtol=TOL, atol=TOL)
        assert "returned a plain Tensor as the gradient of argument 0" in f["plain_grad"]
        assert f["no_grad"] is False and f["inference"] is False


# ------------------------------------------------------------- c10d on a DTensor
def _c10d_facts():
    import torch.distributed as dist

    from hyperpar.dtensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    out = {}
    for name, placement in (("replicate", Replicate()), ("shard", Shard(0))):
        # rank-dependent locals, as torchtitan's per-rank expert counts under a Replicate label
        local = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank
        dt = DTensor.from_local(local, mesh, [placement], run_check=False)
        ret = dist.all_reduce(dt, group=mesh.get_group("tp"))
        out[name] = (ret, type(dt).__name__, dt.placements, dt.to_local().clone())
    counts = torch.stack([torch.tensor([3, 0, 1]), torch.tensor([1, 2, 1])])[rank]
    dt = DTensor.from_local(counts, mesh, [Replicate()], run_check=False)
    stacked = torch.vstack([dt, dt])  # torchtitan's vstack of per-layer counts
    work = dist.all_reduce(stacked, group=mesh.get_group("tp"), async_op=True)
    work.wait()
    out["async"] = (type(stacked).__name__, stacked.to_local().clone())
    return out


def _c10d_dispatches_torch_functions() -> bool:
    """torch 2.7+: ``torch.distributed.all_reduce`` hands a tensor subclass's call to its
    ``__torch_function__``; before, it went straight to the process group."""
    import inspect

    import torch.distributed as dist
    return "handle_torch_function" in inspect.getsource(dist.all_reduce)


@pytest.mark.skipif(not _c10d_dispatches_torch_functions(),
                    reason="this torch's torch.distributed.all_reduce does not dispatch "
                           "__torch_function__ (torch < 2.7)")
def test_c10d_all_reduce_on_a_dtensor_reduces_its_local_tensor(run_on_ranks):
    """``torch.distributed.all_reduce(dtensor, group=...)`` reduces the local tensor in place,
    as the same call does on ``dtensor.to_local()`` (torch's own DTensor refuses the call; code
    written for it unwraps by ``isinstance`` against torch's class first, which a hyperpar
    DTensor is not: torchtitan's expert-bias update under EP x TP). Integers: exact."""
    base = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    summed = base + (base + 10)
    for f in run_on_ranks(2, _c10d_facts):
        for name in ("replicate", "shard"):
            ret, kind, placements, local = f[name]
            assert ret is None and kind == "DTensor", f[name]
            assert [type(p).__name__ for p in placements] == [name.capitalize()]
            torch.testing.assert_close(local, summed, rtol=0, atol=0)
        kind, local = f["async"]
        assert kind == "DTensor"
        assert local.tolist() == [[4, 2, 2], [4, 2, 2]]
