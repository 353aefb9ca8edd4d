"""Which of torch's functional collectives are differentiable, and what their backward is.

Runs torch's own ``torch.distributed._functional_collectives`` on 2 gloo CPU ranks and prints,
per op, whether the output requires grad, what ``backward`` does (the input's gradient, an error,
or a warning) and whether that gradient equals the one-process adjoint of
``loss = sum over ranks of (w_r * out_r).sum()`` (w_r a per-rank weight, known on every rank).

    python scripts/probe_funcol_autograd.py        # with the torch under test on the path

The table it gave is recorded in docs/dtensor.md ("Functional collectives and autograd").
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 2


def _w(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g)


def _x(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, 3, generator=g)


def _expected(name: str, rank: int) -> torch.Tensor | None:
    """The input's gradient of sum_r (w_r * out_r).sum(), computed from full tensors."""
    xs = [_x(r).requires_grad_() for r in range(N)]
    if name.startswith("all_reduce_sum"):
        outs = [sum(xs)] * N
    elif name.startswith("all_reduce_avg"):
        outs = [sum(xs) / N] * N
    elif name.startswith("all_gather"):
        outs = [torch.cat(xs, 0)] * N
    elif name.startswith("reduce_scatter_sum"):
        outs = list(sum(xs).chunk(N, 0))
    elif name.startswith("reduce_scatter_avg"):
        outs = list((sum(xs) / N).chunk(N, 0))
    elif name.startswith("all_to_all"):
        ins = [(1, 3), (2, 2)]        # rank r sends ins[r][j] rows to rank j
        pieces = [x.split(list(s), 0) for x, s in zip(xs, ins, strict=True)]
        outs = [torch.cat([pieces[i][j] for i in range(N)], 0) for j in range(N)]
    elif name.startswith("broadcast"):
        outs = [xs[0]] * N
    elif name.startswith("wait_tensor"):
        outs = xs
    else:
        return None
    loss = sum((_w(r, o.shape) * o).sum() for r, o in enumerate(outs))
    loss.backward()
    return xs[rank].grad


def _cases(funcol, group):
    ins = [(1, 3), (2, 2)]
    outs = [(1, 2), (3, 2)]
    r = dist.get_rank()
    c = {
        "all_reduce_sum": lambda x: funcol.all_reduce(x, "sum", group),
        "all_reduce_avg": lambda x: funcol.all_reduce(x, "avg", group),
        "all_reduce_max": lambda x: funcol.all_reduce(x, "max", group),
        "all_gather_tensor": lambda x: funcol.all_gather_tensor(x, 0, group),
        "all_gather_tensor_autograd": lambda x: funcol.all_gather_tensor_autograd(x, 0, group),
        "reduce_scatter_sum_tensor": lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, group),
        "reduce_scatter_sum_tensor_autograd":
            lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 0, group),
        "reduce_scatter_avg_tensor": lambda x: funcol.reduce_scatter_tensor(x, "avg", 0, group),
        "all_to_all_single": lambda x: funcol.all_to_all_single(
            x, list(outs[r]), list(ins[r]), group),
        "all_to_all_single_autograd": lambda x: funcol.all_to_all_single_autograd(
            x, list(outs[r]), list(ins[r]), group),
        "broadcast": lambda x: funcol.broadcast(x, 0, group),
        "wait_tensor": lambda x: funcol.wait_tensor(x),
    }
    for extra in ("all_gather_single", "all_gather_single_autograd"):
        if hasattr(funcol, extra):
            fn = getattr(funcol, extra)
            c[extra] = lambda x, f=fn: f(x, 0, group)
    for extra in ("reduce_scatter_single", "reduce_scatter_single_autograd"):
        if hasattr(funcol, extra):
            fn = getattr(funcol, extra)
            c[extra.replace("reduce_scatter", "reduce_scatter_sum")] = \
                lambda x, f=fn: f(x, "sum", 0, group)
    return c


def _worker(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=N)
    import torch.distributed._functional_collectives as funcol
    group = dist.group.WORLD
    rows = []
    for name, fn in _cases(funcol, group).items():
        x = _x(rank).requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = funcol.wait_tensor(fn(x))
                req = out.requires_grad
                err = None
                if req:
                    try:
                        (_w(rank, out.shape) * out).sum().backward()
                    except Exception as e:  # noqa: BLE001 -- the probe reports what torch raises
                        err = f"backward raises {type(e).__name__}: {str(e).splitlines()[0][:90]}"
            except Exception as e:  # noqa: BLE001
                req, err = None, f"forward raises {type(e).__name__}: {str(e)[:90]}"
        warn = sorted({type(w.message).__name__ + ": " + str(w.message)[:80] for w in caught
                       if "deprecated" not in str(w.message)})
        dist.barrier()
        exp = _expected(name, rank)
        if err:
            verdict = err
        elif not req:
            verdict = "no grad (output does not require grad)"
        elif x.grad is None:
            verdict = "backward ran, input grad None"
        elif exp is None:
            verdict = "backward ran, grad given (no adjoint to compare)"
        elif torch.allclose(x.grad, exp, atol=1e-5):
            verdict = "grad == adjoint"
        else:
            verdict = f"grad WRONG (max err {(x.grad - exp).abs().max().item():.3g})"
        if name == "broadcast" and x.grad is not None:
            local = torch.allclose(x.grad, _w(rank, x.shape))
            verdict += " (grad == w_r: the local identity)" if local else ""
        rows.append((name, req, verdict, warn))
    if rank == 0:
        print(f"torch {torch.__version__}")
        for name, req, verdict, warn in rows:
            warns = f"  warns {warn}" if warn else ""
            print(f"{name:38s} requires_grad={req!s:5s} {verdict}{warns}")
    dist.destroy_process_group()


if __name__ == "__main__":
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    mp.spawn(_worker, args=(f"file://{path}",), nprocs=N, join=True)
    sys.exit(0)
