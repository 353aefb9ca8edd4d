"""DTensor breadth on PyTorch's own op database: hyperpar's DTensor and torch's, side by side.

Every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` that runs in
float32 on CPU (or the ``--ops`` subset), up to ``--samples`` sample inputs each, under five
shardings of the inputs on a 1-D mesh of 2 gloo ranks:

* ``R``      every tensor Replicate;
* ``S0``     the first shardable tensor (floating point, at least 1-D, first dim >= 2) Shard(0);
* ``Slast``  that tensor Shard(last);
* ``S0all``  every shardable tensor Shard(0);
* ``uneven`` the first tensor with a dim of odd size >= 3 sharded on it (pieces differ).

The same inputs go to hyperpar's DTensor and to ``torch.distributed.tensor`` (this file is
outside the library, so it may import torch's). Each case's ``full_tensor()`` is compared with
the op on plain tensors (shape, dtype, values: ``rtol=1e-4, atol=1e-5``, NaN equal to NaN), and
the gradients of the inputs of ``sum(out * w)`` (``w`` fixed random) with the plain-tensor ones.
A case is *right*, *refused* (the op raised) or *wrong* (it ran and gave another value, shape
or gradient). Prints the table; ``--json`` keeps every case for a before/after diff.

Samples no DTensor can be compared on are skipped, and counted by reason in the output:
*sparse* (a tensor of another layout than strided), *random* (the op runs an aten op tagged
``nondeterministic_seeded``: ``bernoulli``,
``dropout`` in training, ``rand_like``, ...; a DTensor's random stream is its own, so equality
with torch's is not expected),
*dropout_p* (a ``dropout_p > 0`` keyword, e.g. ``scaled_dot_product_attention``'s: random by
design, whatever the tags say) and *uninitialised* (OpInfos whose output is
declared nondeterministic: ``empty``, ``new_empty_strided``, ...).

Run: ``PYTHONHASHSEED=0 python benchmarks/dtensor_op_db.py --ops acosh,tril,mse_loss``
(needs ``expecttest``, in the ``bench`` extra). The full sweep is slow on a small CPU box:
run it in chunks (``--chunk 0/8 --json c0.json`` ... ``--chunk 7/8``) and print the merged
table with ``--merge c*.json`` (a later file's cases replace an earlier one's for the same
op, so a rerun of a few ops after a fix can be merged over the sweep).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHARDINGS = ("R", "S0", "Slast", "S0all", "uneven")
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def _full_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _tensors(sample) -> list[torch.Tensor]:
    """The tensor arguments of a sample (input, args, kwargs; lists flattened one level)."""
    out = []
    for a in (sample.input, *sample.args, *sample.kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(b for b in a if isinstance(b, torch.Tensor))
    return out


class _SeededOps(TorchDispatchMode):
    """Notes whether any aten op run under it draws random numbers."""

    hit = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.hit = True
        return func(*args, **(kwargs or {}))


def _skip_reason(op, sample, tensors: list[torch.Tensor]) -> str | None:
    """Why this sample cannot be compared on a DTensor (None: it can). The seed check runs the
    op twice on the plain inputs, so it is only asked once the cheap checks passed."""
    if any(t.layout != torch.strided for t in tensors):
        return "sparse"
    p = sample.kwargs.get("dropout_p", 0.0)
    if isinstance(p, int | float) and p > 0:
        return "dropout_p"
    if op.has_nondeterministic_output:
        return "uninitialised"
    # OpInfo runs torch's random ops under a fixed seed (wrapper_set_seed), so their values
    # agree run to run: what marks them is an aten op tagged nondeterministic_seeded
    seeded = _SeededOps()
    try:
        with seeded:
            op.op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        return None  # the reference fails too: the sample is dropped there
    return "random" if seeded.hit else None


def _shardable(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.ndim >= 1 and t.shape[0] >= 2


def _layouts(tensors: list[torch.Tensor]) -> dict[str, dict[int, tuple[str, int]] | None]:
    """Sharding name -> {tensor index: ("S", dim)} (absent: Replicate); None where it does not
    apply to this sample."""
    first = next((i for i, t in enumerate(tensors) if _shardable(t)), None)
    out: dict[str, Any] = {"R": {}}
    out["S0"] = {first: 0} if first is not None else None
    out["Slast"] = ({first: tensors[first].ndim - 1}
                    if first is not None and tensors[first].shape[-1] >= 2 else None)
    every = {i: 0 for i, t in enumerate(tensors) if _shardable(t)}
    out["S0all"] = every if len(every) > 1 else None  # one tensor: the same as S0
    out["uneven"] = None
    for i, t in enumerate(tensors):
        if t.is_floating_point():
            odd = [d for d in range(t.ndim) if t.shape[d] >= 3 and t.shape[d] % 2]
            if odd:
                out["uneven"] = {i: odd[0]}
                break
    return out


def _flat_out(out: Any) -> list:
    if isinstance(out, list | tuple):
        res = []
        for o in out:
            res.extend(_flat_out(o))
        return res
    return [out]


def _compare(got: list, ref: list) -> str | None:
    """None when equal, else why not."""
    if len(got) != len(ref):
        return f"{len(got)} outputs, expected {len(ref)}"
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        if isinstance(r, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"output {k}: {type(g).__name__}, expected a tensor"
            if g.shape != r.shape:
                return f"output {k}: shape {tuple(g.shape)}, expected {tuple(r.shape)}"
            if g.dtype != r.dtype:
                return f"output {k}: dtype {g.dtype}, expected {r.dtype}"
            try:
                torch.testing.assert_close(g.detach(), r.detach(), equal_nan=True, **TOL)
            except AssertionError as exc:
                return f"output {k}: " + str(exc).split("\n")[0][:200]
        elif g != r and not (isinstance(r, float) and r != r and g != g):
            return f"output {k}: {g!r}, expected {r!r}"
    return None


class _Impl:
    """One DTensor implementation: how to shard a tensor and read a result back."""

    def __init__(self, name: str, mesh, dt_type, distribute, shard, replicate) -> None:
        self.name, self.mesh, self.dt_type = name, mesh, dt_type
        self.distribute, self.shard, self.replicate = distribute, shard, replicate

    def full(self, x: Any) -> Any:
        return x.full_tensor() if isinstance(x, self.dt_type) else x


def _convert(a: Any, table: dict[int, Any]) -> Any:
    if isinstance(a, torch.Tensor):
        return table[id(a)]
    if isinstance(a, list):
        return [_convert(b, table) for b in a]
    if isinstance(a, tuple):
        return tuple(_convert(b, table) for b in a)
    return a


def _run_case(impl: _Impl, op, sample, tensors, layout, ref_out, ref_grads, w) -> tuple:
    """(forward verdict, backward verdict, note) of one case on one implementation."""
    table, leaves = {}, []
    for i, t in enumerate(tensors):
        pl = [impl.shard(layout[i])] if i in layout else [impl.replicate()]
        base = t.detach().clone()
        grad = t.requires_grad and t.is_floating_point()
        d = impl.distribute(base.requires_grad_(grad), impl.mesh, pl)
        table[id(t)] = d
        leaves.append(d if grad else None)
    try:
        args = [_convert(a, table) for a in sample.args]
        kwargs = {k: _convert(v, table) for k, v in sample.kwargs.items()}
        out = op.op(_convert(sample.input, table), *args, **kwargs)
        got = [impl.full(o) for o in _flat_out(out)]
    except Exception as exc:  # a refusal: the op raised
        return "refused", "-", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    why = _compare(got, ref_out)
    if why is not None:
        return "wrong", "-", why
    if ref_grads is None:
        return "right", "-", ""
    try:
        loss = sum((g * wk).sum() for g, wk in zip(got, w, strict=True)
                   if wk is not None and isinstance(g, torch.Tensor) and g.requires_grad)
        if not isinstance(loss, torch.Tensor):
            return "right", "refused", "no output requires grad"
        loss.backward()
        grads = []
        for leaf, t in zip(leaves, tensors, strict=True):
            if leaf is None:
                continue
            g = leaf.grad
            grads.append(torch.zeros_like(t) if g is None else impl.full(g))
    except Exception as exc:
        return "right", "refused", f"backward {type(exc).__name__}: {str(exc)[:160]}"
    why = _compare(grads, ref_grads)
    return "right", ("wrong" if why else "right"), (f"grad {why}" if why else "")


def _reference(op, sample, tensors) -> tuple:
    """(outputs, input gradients or None, weights) of the op on plain tensors."""
    out = _flat_out(op.op(sample.input, *sample.args, **sample.kwargs))
    gen = torch.Generator().manual_seed(1234)
    w = [torch.randn(o.shape, generator=gen) if isinstance(o, torch.Tensor)
         and o.is_floating_point() and o.requires_grad else None for o in out]
    leaves = [t for t in tensors if t.requires_grad and t.is_floating_point()]
    if not op.supports_autograd or not leaves or all(x is None for x in w):
        return out, None, w
    loss = sum((o * wk).sum() for o, wk in zip(out, w, strict=True) if wk is not None)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves,
                                                                     strict=True)]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in out], grads, w


def sweep(names: list[str] | None, samples: int, chunk: tuple[int, int] = (0, 1)) -> dict:
    """On every rank: each case's verdict on both implementations, and the skipped samples by
    reason (``{"rows": [...], "skipped": {reason: [op/sample, ...]}}``; rank 0's is kept).
    ``chunk`` ``(k, n)``: only every n-th op from the k-th."""
    import warnings

    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import hyperpar.dtensor as hdt
    from hyperpar.platform import get_platform

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ranks = get_platform().world_size()
    impls = [
        _Impl("torch", torch_mesh("cpu", (ranks,)), tdt.DTensor, tdt.distribute_tensor,
              tdt.Shard, tdt.Replicate),
        _Impl("hyperpar", hdt.init_device_mesh((ranks,)), hdt.DTensor, hdt.distribute_tensor,
              hdt.Shard, hdt.Replicate),
    ]
    ops = _op_db()
    if names:
        wanted = set(names)
        ops = [op for op in ops if op.name in wanted or _full_name(op) in wanted]
    k, n = chunk
    ops = ops[k::n]
    rows: list[dict] = []
    skipped: dict[str, list[str]] = {}
    for op in ops:
        torch.manual_seed(0)
        try:
            got = list(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd))
        except Exception:
            continue
        for s_idx, sample in enumerate(got[:samples]):
            tensors = _tensors(sample)
            if not tensors:
                continue
            why = _skip_reason(op, sample, tensors)
            if why is not None:
                skipped.setdefault(why, []).append(f"{_full_name(op)}/s{s_idx}")
                continue
            try:
                ref_out, ref_grads, w = _reference(op, sample, tensors)
            except Exception:
                continue
            for sh, layout in _layouts(tensors).items():
                if layout is None:
                    continue
                row = {"op": _full_name(op), "sample": s_idx, "sharding": sh}
                for impl in impls:
                    fwd, bwd, note = _run_case(impl, op, sample, tensors, layout, ref_out,
                                               ref_grads, w)
                    row[impl.name] = [fwd, bwd, note]
                rows.append(row)
    return {"rows": rows, "skipped": skipped}


def skipped_lines(skipped: dict[str, list[str]]) -> list[str]:
    """One line per skip reason: how many samples, of which ops."""
    lines = []
    for why, cases in sorted(skipped.items()):
        ops = sorted({c.rsplit("/", 1)[0] for c in cases})
        shown = ", ".join(ops[:12]) + (f", ... ({len(ops)} ops)" if len(ops) > 12 else "")
        lines.append(f"skipped {len(cases)} samples ({why}): {shown}")
    return lines


def merge(paths: list[str]) -> dict:
    """The cases of several ``--json`` files; a later file's cases replace an earlier one's
    for the same op (a rerun after a fix)."""
    by_op: dict[str, list[dict]] = {}
    skipped: dict[str, dict[str, list[str]]] = {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        if isinstance(data, list):  # the older format: the rows alone
            data = {"rows": data, "skipped": {}}
        fresh: dict[str, list[dict]] = {}
        for r in data["rows"]:
            fresh.setdefault(r["op"], []).append(r)
        by_op.update(fresh)
        for why, cases in data["skipped"].items():
            for c in cases:
                skipped.setdefault(c.rsplit("/", 1)[0], {}).setdefault(why, []).append(c)
    out: dict[str, list[str]] = {}
    for per in skipped.values():
        for why, cases in per.items():
            out.setdefault(why, []).extend(sorted(set(cases)))
    return {"rows": [r for rows in by_op.values() for r in rows], "skipped": out}


def table(rows: list[dict]) -> str:
    """The summary table of ``rows`` (both implementations side by side)."""
    lines = ["| | torch DTensor | hyperpar DTensor |", "|---|---:|---:|"]
    ops = sorted({r["op"] for r in rows})

    def stat(impl: str) -> dict:
        by_op: dict[str, bool] = {}
        c = {"fwd right": 0, "refused": 0, "fwd wrong": 0, "bwd right": 0, "bwd wrong": 0,
             "bwd refused": 0}
        wrong_ops: set[str] = set()
        for r in rows:
            fwd, bwd, _ = r[impl]
            ok = fwd == "right" and bwd in ("right", "-")
            by_op[r["op"]] = by_op.get(r["op"], True) and ok
            c["fwd right"] += fwd == "right"
            c["refused"] += fwd == "refused"
            c["fwd wrong"] += fwd == "wrong"
            c["bwd right"] += bwd == "right"
            c["bwd wrong"] += bwd == "wrong"
            c["bwd refused"] += bwd == "refused"
            if fwd == "wrong" or bwd == "wrong":
                wrong_ops.add(r["op"])
        c["ops all right"] = sum(by_op.values())
        c["ops with a wrong case"] = len(wrong_ops)
        return c

    t, h = stat("torch"), stat("hyperpar")
    lines.append(f"| ops (of {len(ops)}), {len(rows)} cases | | |")
    for k in ("ops all right", "fwd right", "refused", "fwd wrong", "bwd right", "bwd wrong",
              "bwd refused", "ops with a wrong case"):
        lines.append(f"| {k} | {t[k]} | {h[k]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    parser.add_argument("--samples", type=int, default=3, help="sample inputs per op")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", dest="json_path", default=None, help="write every case here")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every case hyperpar refuses or gets wrong")
    parser.add_argument("--chunk", default="0/1",
                        help="K/N: only every N-th op from the K-th (run the sweep in pieces)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="print the table of these --json files instead of running")
    args = parser.parse_args()
    if args.merge:
        data = merge(args.merge)
    else:
        if os.environ.get("PYTHONHASHSEED") != "0":
            print("note: set PYTHONHASHSEED=0 for the same samples on every run",
                  file=sys.stderr)
        from hyperpar.testing import run_distributed

        names = [n for n in args.ops.split(",") if n] or None
        k, n = (int(v) for v in args.chunk.split("/"))
        data = run_distributed(sweep, args.ranks, names, args.samples, (k, n),
                               timeout_s=3600)[0]
    rows = data["rows"]
    print(table(rows))
    for line in skipped_lines(data["skipped"]):
        print(line)
    for impl in ("hyperpar", "torch"):
        bad = sorted({r["op"] for r in rows if "wrong" in r[impl][:2]})
        print(f"{impl} wrong in {len(bad)} ops: {', '.join(bad) or '-'}")
    if args.verbose:
        for r in rows:
            for impl in ("hyperpar", "torch"):
                fwd, bwd, note = r[impl]
                if fwd != "right" or bwd in ("wrong", "refused"):
                    print(f"{impl:8s} {r['op']:28s} s{r['sample']} {r['sharding']:6s} "
                          f"{fwd}/{bwd} {note}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(data, fh, indent=1)


if __name__ == "__main__":
    main()
