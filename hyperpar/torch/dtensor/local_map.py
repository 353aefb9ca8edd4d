"""``local_map``: run a function written for plain tensors on DTensors' local shards
(torch's ``torch.distributed.tensor.experimental.local_map``, same signature).

torch's ``local_map`` does not recognise hyperpar DTensors (it checks for torch's class), so a
migrated script imports this one: ``from hyperpar import local_map`` or
``from hyperpar.torch.dtensor.experimental import local_map``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Placement, normalize_placements
from hyperpar.torch.dtensor.api import DTensor

__all__ = ["local_map"]

PlacementsArg = Sequence[Placement] | None


def _per_item(spec: Any, n: int, what: str) -> list[Any]:
    """``spec`` (one placements tuple, or one per item) as a list of ``n`` entries."""
    if spec is None:
        return [None] * n
    spec = list(spec)
    if spec and isinstance(spec[0], Placement):  # one placements tuple for a single item
        spec = [tuple(spec)]
    if len(spec) != n:
        raise ValueError(f"local_map: {what} has {len(spec)} entries but there are {n} "
                         f"{'arguments' if what.startswith('in') else 'outputs'}; give one "
                         f"placements tuple (or None) per item")
    return spec


def local_map(func: Callable[..., Any] | None = None, out_placements: Any = None,
              in_placements: Any = None, in_grad_placements: Any = None,
              device_mesh: DeviceMesh | None = None, *,
              redistribute_inputs: bool = False) -> Callable[..., Any]:
    """Wrap ``func`` (written for local tensors) to take and return DTensors.

    Each DTensor argument must be laid out as its ``in_placements`` entry (or is redistributed
    there with ``redistribute_inputs=True``; else a ``ValueError``), is passed as its local
    shard (its gradient laid out as its ``in_grad_placements`` entry, default its placements),
    and each tensor output is wrapped as a DTensor with its ``out_placements`` entry
    (``None`` for a non-tensor output). Without DTensor arguments ``func`` runs unchanged.
    Called with ``func=None``, returns a decorator."""
    if func is None:
        return functools.partial(local_map, out_placements=out_placements,
                                 in_placements=in_placements,
                                 in_grad_placements=in_grad_placements,
                                 device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(v, DTensor) for v in kwargs.values()):
            raise ValueError("local_map: DTensor keyword arguments are not mapped (torch's "
                             "neither); pass DTensors positionally")
        ins = _per_item(in_placements, len(args), "in_placements")
        grads = _per_item(in_grad_placements, len(args), "in_grad_placements")
        mesh = device_mesh
        seen = False
        local_args = []
        for i, a in enumerate(args):
            if not isinstance(a, DTensor):
                local_args.append(a)
                continue
            seen = True
            mesh = mesh if mesh is not None else a.device_mesh
            if a.device_mesh != mesh:
                raise ValueError(f"local_map: argument {i} is on {a.device_mesh!r}, not on "
                                 f"device_mesh {mesh!r}; redistribute it onto that mesh")
            if ins[i] is not None:
                want = normalize_placements(ins[i], mesh.ndim, a.ndim,
                                            f"local_map in_placements[{i}]")
                if want != a.placements:
                    if not redistribute_inputs:
                        raise ValueError(
                            f"local_map: argument {i} is laid out as {a.placements} but "
                            f"in_placements asks for {want}; redistribute it first or pass "
                            f"redistribute_inputs=True")
                    a = a.redistribute(mesh, want)
            local_args.append(a.to_local(grad_placements=grads[i]))
        out = func(*local_args, **kwargs)
        if not seen:
            return out
        multi = isinstance(out, tuple | list)
        outs = list(out) if multi else [out]
        places = _per_item(out_placements, len(outs), "out_placements")
        wrapped_out = []
        for k, (o, p) in enumerate(zip(outs, places, strict=True)):
            if isinstance(o, torch.Tensor) and p is not None:
                wrapped_out.append(DTensor.from_local(o, mesh, p, run_check=False))
            elif isinstance(o, torch.Tensor):
                raise ValueError(f"local_map: output {k} is a tensor but its out_placements "
                                 f"entry is None; give its placements")
            else:
                wrapped_out.append(o)
        return type(out)(wrapped_out) if multi else wrapped_out[0]

    return wrapped
