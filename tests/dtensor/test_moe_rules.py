"""DTensor rules for the ops MoE routers, token dispatchers and experts call (``topk`` incl.
``sorted=False``, ``sort``, ``argsort``, ``histc``, ``bincount``, ``scatter_`` of a value,
``scatter_add``, ``index_add``, ``gather``, ``cumsum``, ``zeros_like(dtype=bool)``, ``bmm`` and
``torch._grouped_mm`` on 3-D expert weights, per-expert ``w[i]``), on 2 real ranks, each on
Replicate and on a Shard of every dim, against plain torch on the full tensors: values, and the
gradients of the differentiable inputs. A layout that cannot run in place raises naming the op
and the placements.

Tolerance 1e-5: each output element is a sum of at most 8 fp32 products (reordered only by a
Partial sum of 2 terms); a wrong shard or a missing reduction is off by order 1.
"""

from __future__ import annotations

import torch

TOL = 1e-5
#: (case, layout) pairs that must raise: an in-place scatter_ along the dim that is sharded
REFUSED = {("mask", "S1")}


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "scores": torch.randn(6, 8, generator=g),
        "ids": torch.randint(0, 8, (6, 3), generator=g),
        "src": torch.randn(6, 3, generator=g),
        "rows": torch.tensor([1, 3, 1, 0, 2, 7]),
        "counts_in": torch.randint(0, 8, (12,), generator=g),
        "w": torch.randn(4, 8, 8, generator=g),
        "xb": torch.randn(4, 2, 8, generator=g),
        "tokens": torch.randn(6, 8, generator=g),
        "offs": torch.tensor([2, 4, 5, 6], dtype=torch.int32),
        "weight_out": torch.randn(6, 8, generator=g),
    }


def _cases(t: dict[str, torch.Tensor], wrap, full):
    """name -> (fn(wrapped inputs...) -> output, names of the inputs, differentiable inputs).
    ``wrap(name)`` gives the input as the case's DTensor (or the plain tensor in the reference);
    the first input takes the layout under test, the others are replicated unless the case
    shards them alike."""
    return {
        "topk_sorted_false": (lambda s: torch.topk(s, 3, dim=-1, sorted=False).values
                              .sort(-1).values, ["scores"], ["scores"]),
        "topk_indices": (lambda s: torch.topk(s, 3, dim=-1).indices.float(), ["scores"], []),
        "sort": (lambda s: torch.sort(s, dim=-1, descending=True).values, ["scores"],
                 ["scores"]),
        "argsort": (lambda s: torch.argsort(s, dim=0, stable=True).float(), ["scores"], []),
        "histc": (lambda s: torch.histc(s, bins=4, min=-2, max=2), ["scores"], []),
        "cumsum": (lambda s: torch.cumsum(s, 0), ["scores"], ["scores"]),
        "mask": (lambda s, ids: torch.zeros_like(s, dtype=torch.bool)
                 .scatter_(-1, ids, True).float(), ["scores", "ids"], []),
        "scatter_add": (lambda s, ids, src: torch.zeros_like(s).scatter_add(-1, ids, src),
                        ["scores", "ids", "src"], ["src"]),
        "gather": (lambda s, ids: torch.gather(s, -1, ids), ["scores", "ids"], ["scores"]),
        "bmm": (lambda w, xb: torch.bmm(xb, w), ["w", "xb"], ["w", "xb"]),
        "expert_index": (lambda w: w[1] * 2, ["w"], ["w"]),
    }


def _run(placement_kind: str):
    from hyperpar import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("ep",))
    t = _data()
    out: dict[str, object] = {}
    layouts = {"R": [Replicate()], "S0": [Shard(0)], "S1": [Shard(1)], "S2": [Shard(2)]}
    pl = layouts[placement_kind]
    for name, (fn, inputs, diff) in _cases(t, None, None).items():
        if placement_kind == "S2" and t[inputs[0]].dim() < 3:
            continue
        # inputs sharded alike where they share the dim (scatter/gather: index like self)
        same = name in ("mask", "scatter_add", "gather") or (name == "bmm" and
                                                             placement_kind == "S0")
        args = []
        for i, k in enumerate(inputs):
            p = pl if (i == 0 or same) else [Replicate()]
            x = t[k].clone().requires_grad_(k in diff)
            args.append(distribute_tensor(x.detach(), mesh, p).requires_grad_(k in diff))
        try:
            y = fn(*args)
            full = y.full_tensor()
            grads = {}
            if diff:
                w = torch.randn(full.shape, generator=torch.Generator().manual_seed(5))
                (full * w).sum().backward()
                grads = {k: a.grad.full_tensor() for k, a in zip(inputs, args, strict=True)
                         if k in diff}
            out[name] = {"value": full.detach(), "grads": grads}
        except Exception as exc:  # noqa: BLE001 -- reported and checked by the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    # bincount (gathered) and index_add (indexed dim whole)
    c = distribute_tensor(t["counts_in"], mesh, [Shard(0)] if pl != layouts["R"] else pl)
    out["bincount"] = {"value": torch.bincount(c, minlength=8).full_tensor(), "grads": {}}
    src = distribute_tensor(t["tokens"], mesh, pl if placement_kind in ("R", "S0", "S1")
                            else [Replicate()]).requires_grad_()
    base = distribute_tensor(torch.zeros(8, 8), mesh,
                             pl if placement_kind == "S1" else [Replicate()])
    rows = distribute_tensor(t["rows"], mesh, [Replicate()])
    y = base.index_add(0, rows, src).full_tensor()
    y.mul(t["weight_out"].repeat(2, 1)[:8]).sum().backward()
    out["index_add"] = {"value": y.detach(), "grads": {"tokens": src.grad.full_tensor()}}
    if hasattr(torch, "_grouped_mm"):
        a = distribute_tensor(t["tokens"], mesh, [Shard(1)] if placement_kind == "S1"
                              else [Replicate()]).requires_grad_()
        b = distribute_tensor(t["w"], mesh, pl).requires_grad_()
        offs = distribute_tensor(t["offs"], mesh, [Replicate()])
        y = torch._grouped_mm(a, b, offs=offs).full_tensor()
        y.mul(t["weight_out"]).sum().backward()
        out["grouped_mm"] = {"value": y.detach(), "grads": {"tokens": a.grad.full_tensor(),
                                                             "w": b.grad.full_tensor()}}
    # an in-place scatter_ that would have to gather self: refused, naming op and layout
    s1 = distribute_tensor(torch.zeros(6, 8), mesh, [Shard(1)])
    try:
        s1.scatter_(1, distribute_tensor(t["ids"], mesh, [Shard(1)]), 1.0)
        out["inplace_refused"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["inplace_refused"] = f"{type(exc).__name__}: {exc}"
    return out


def _reference(name: str, t: dict[str, torch.Tensor]):
    if name == "bincount":
        return torch.bincount(t["counts_in"], minlength=8), {}
    if name == "index_add":
        src = t["tokens"].clone().requires_grad_()
        y = torch.zeros(8, 8).index_add(0, t["rows"], src)
        y.mul(t["weight_out"].repeat(2, 1)[:8]).sum().backward()
        return y.detach(), {"tokens": src.grad}
    if name == "grouped_mm":
        a = t["tokens"].clone().requires_grad_()
        b = t["w"].clone().requires_grad_()
        y = torch._grouped_mm(a, b, offs=t["offs"])
        y.mul(t["weight_out"]).sum().backward()
        return y.detach(), {"tokens": a.grad, "w": b.grad}
    fn, inputs, diff = _cases(t, None, None)[name]
    args = [t[k].clone().requires_grad_(k in diff) for k in inputs]
    y = fn(*args)
    grads = {}
    if diff:
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
        (y * w).sum().backward()
        grads = {k: a.grad for k, a in zip(inputs, args, strict=True) if k in diff}
    return y.detach(), grads


def _check(results, kind: str) -> None:
    t = _data()
    for res in results:
        assert "in place" in res["inplace_refused"] and "Shard(dim=1)" in \
            res["inplace_refused"] and "scatter_" in res["inplace_refused"]
        for name, got in res.items():
            if name == "inplace_refused":
                continue
            if (name, kind) in REFUSED:  # scatter_ in place along its own sharded dim
                assert "scatter_ in place" in got["error"] and "Shard(dim=1)" in got["error"]
                continue
            assert "error" not in got, f"{name} on {kind}: {got.get('error')}"
            value, grads = _reference(name, t)
            torch.testing.assert_close(got["value"], value.to(got["value"].dtype),
                                       atol=TOL, rtol=TOL, msg=lambda m, n=name: f"{n}: {m}")
            assert set(got["grads"]) == set(grads), name
            for k, g in grads.items():
                torch.testing.assert_close(got["grads"][k], g, atol=TOL, rtol=TOL,
                                           msg=lambda m, n=name, k=k: f"{n} grad {k}: {m}")


def test_moe_ops_on_replicated_dtensors(run_on_ranks):
    _check(run_on_ranks(2, _run, "R"), "R")


def test_moe_ops_sharded_on_dim_0(run_on_ranks):
    _check(run_on_ranks(2, _run, "S0"), "S0")


def test_moe_ops_sharded_on_dim_1(run_on_ranks):
    _check(run_on_ranks(2, _run, "S1"), "S1")


def test_expert_weights_sharded_on_dim_2(run_on_ranks):
    _check(run_on_ranks(2, _run, "S2"), "S2")
