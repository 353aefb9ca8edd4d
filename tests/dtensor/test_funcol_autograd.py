"""Gradients through hyperpar's functional collectives (torch funcol's names), on real ranks,
each against the adjoint computed in one process from every rank's full tensors.

Each rank r holds x_r and a weight w_r; the loss is sum_r (w_r * out_r).sum(), so the one-process
reference is autograd through the same collective written as plain tensor algebra (cat, sum,
split). Tolerance 1e-5: float32 sums of at most 4 terms reordered differ by ~1e-7; a missing
gradient or a wrong adjoint is off by order 1.

Every name in ``functional_collectives.__all__`` is covered: an input that requires grad either
gets its adjoint or, where torch's funcol raises too (``max``/``min``/``product``), a clear
RuntimeError at backward. None returns a result detached from its input.
"""

from __future__ import annotations

import torch

TOL = 1e-5
ROWS = 6


def _x(rank: int) -> torch.Tensor:
    return torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(rank))


def _w(rank: int, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def _splits(n: int, r: int) -> tuple[list[int], list[int]]:
    """Uneven all-to-all: rows rank r sends to each rank, rows each rank sends to r."""
    sends = [(r + 2 * j) % 3 for j in range(n)]
    recvs = [(j + 2 * r) % 3 for j in range(n)]
    return sends, recvs


def _ops(funcol, group, n: int, r: int, src: int):
    sends, recvs = _splits(n, r)
    return {
        "all_reduce:sum": lambda x: funcol.all_reduce(x, "sum", group),
        "all_reduce:avg": lambda x: funcol.all_reduce(x, "avg", group),
        "all_reduce:max": lambda x: funcol.all_reduce(x, "max", group),
        "all_gather_tensor": lambda x: funcol.all_gather_tensor(x, 1, group),
        "all_gather_single": lambda x: funcol.all_gather_single(x, 0, group),
        "all_gather_tensor_autograd": lambda x: funcol.all_gather_tensor_autograd(x, 0, group),
        "all_gather_single_autograd": lambda x: funcol.all_gather_single_autograd(x, 1, group),
        "reduce_scatter_tensor": lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, group),
        "reduce_scatter_single": lambda x: funcol.reduce_scatter_single(x, "avg", 1, group),
        "reduce_scatter_tensor_autograd":
            lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 1, group),
        "reduce_scatter_single_autograd":
            lambda x: funcol.reduce_scatter_single_autograd(x, "sum", 0, group),
        "reduce_scatter_single:min": lambda x: funcol.reduce_scatter_single(x, "min", 0, group),
        "all_to_all_single": lambda x: funcol.all_to_all_single(
            x[:sum(sends)], recvs, sends, group),
        "all_to_all_single_autograd": lambda x: funcol.all_to_all_single_autograd(
            x, None, None, group),
        "broadcast": lambda x: funcol.broadcast(x, src, group),
        "wait_tensor": lambda x: funcol.wait_tensor(x * 3),
    }


def _reference(name: str, n: int, src_index: int) -> list[torch.Tensor]:
    """Each group rank's input gradient of sum_r (w_r * out_r).sum(), in one process."""
    xs = [_x(r).requires_grad_() for r in range(n)]
    op = name.split(":")[0]
    kind = name.split(":")[1] if ":" in name else None
    dim = {"all_gather_tensor": 1, "all_gather_single_autograd": 1, "reduce_scatter_single": 1,
           "reduce_scatter_tensor_autograd": 1}.get(op, 0)
    if op == "all_reduce":
        total = sum(xs) / (n if kind == "avg" else 1)
        outs = [total] * n
    elif op.startswith("all_gather"):
        outs = [torch.cat(xs, dim)] * n
    elif op.startswith("reduce_scatter"):
        total = sum(xs) / (n if op == "reduce_scatter_single" else 1)
        outs = list(total.chunk(n, dim))
    elif op == "all_to_all_single":
        pieces = [x[:sum(_splits(n, r)[0])].split(_splits(n, r)[0]) for r, x in enumerate(xs)]
        outs = [torch.cat([pieces[i][j] for i in range(n)]) for j in range(n)]
    elif op == "all_to_all_single_autograd":
        pieces = [x.chunk(n) for x in xs]
        outs = [torch.cat([pieces[i][j] for i in range(n)]) for j in range(n)]
    elif op == "broadcast":
        outs = [xs[src_index]] * n
    elif op == "wait_tensor":
        outs = [x * 3 for x in xs]
    else:
        raise AssertionError(name)
    sum((_w(r, o.shape) * o).sum() for r, o in enumerate(outs)).backward()
    return [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]


def _grads(mesh_shape: tuple[int, ...], dim_name: str):
    import hyperpar.dtensor.functional_collectives as funcol

    from hyperpar.dtensor import init_device_mesh

    names = ("world",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh(mesh_shape, mesh_dim_names=names)
    sub = mesh[dim_name]
    r, n = sub.get_local_rank(), sub.size()
    src = sub.mesh.tolist()[-1]                       # a global rank: the last of this group
    out = {"covered": None, "exported": sorted(funcol.__all__)}
    ops = _ops(funcol, sub, n, r, src)
    out["covered"] = sorted({k.split(":")[0] for k in ops})
    for name, op in ops.items():
        x = _x(r).requires_grad_()
        y = op(x)
        entry = {"requires_grad": y.requires_grad}
        try:
            (_w(r, y.shape) * y).sum().backward()
            entry["grad"] = x.grad
        except RuntimeError as exc:
            entry["error"] = str(exc)
        out[name] = entry
    return out


def _check(facts, n: int) -> None:
    for rank, f in enumerate(facts):
        assert f["covered"] == f["exported"], "every exported collective has a gradient case"
        for name, entry in f.items():
            if name in ("covered", "exported"):
                continue
            assert entry["requires_grad"], f"{name}: result detached from an input needing grad"
            r = rank % n
            if name.endswith((":max", ":min")):
                assert "backward only supports 'sum' and 'avg'" in entry["error"], name
                assert name.split(":")[1] in entry["error"]
                continue
            assert "error" not in entry, f"{name}: {entry.get('error')}"
            expected = _reference(name, n, n - 1)[r]
            torch.testing.assert_close(entry["grad"], expected, rtol=TOL, atol=TOL,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_funcol_gradients_match_the_adjoint_on_2_ranks(run_on_ranks):
    _check(run_on_ranks(2, _grads, (2,), "world"), 2)


def test_funcol_gradients_over_a_mesh_dim_of_4_ranks(run_on_ranks):
    """Groups are the rows of a 2 x 2 mesh (``tp``): broadcast's src is a global rank there."""
    facts = run_on_ranks(4, _grads, (2, 2), "tp")
    _check(facts, 2)


def _plain_results():
    import hyperpar.dtensor.functional_collectives as funcol

    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("world",))
    x = torch.ones(4, 2, requires_grad=True)
    with torch.no_grad():
        a = funcol.all_to_all_single(x, None, None, mesh)
    b = funcol.all_reduce(x.detach(), "max", mesh)
    return a.requires_grad, b.requires_grad, a.sum().item()


def test_no_grad_and_detached_inputs_stay_plain(run_on_ranks):
    for a_grad, b_grad, total in run_on_ranks(2, _plain_results):
        assert (a_grad, b_grad, total) == (False, False, 8.0)
