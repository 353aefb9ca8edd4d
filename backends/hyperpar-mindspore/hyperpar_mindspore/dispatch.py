"""Op dispatch for MindSpore DTensors: an ``OpCall`` seen by ``DTensor.__fallback__`` is read
(:mod:`.opnames`), laid out by the neutral rule (:func:`hyperpar.dtensor.rules.propagate`), its
inputs redistributed (differentiably), and run on the local tensors under ``NoFallbackGuard``."""

from __future__ import annotations

from typing import Any

from mindspore import Tensor, mint
from mindspore._c_expression import NoFallbackGuard

from hyperpar.dtensor.layout import shard_shape_and_offset, some_rank_empty
from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.dtensor.rules import (
    GlobalMean,
    MaskedLookup,
    OpSharding,
    ShardingError,
    TensorMeta,
    propagate,
)

from .dtensor_core import DTensor, clear_grad_state
from .localops import global_mean, masked_lookup
from .opnames import OPS, PASSTHROUGH, UNMAPPED_HINTS, Call
from .redistribute import mesh_coordinate, redistribute, sum_grad_over


class MixedTensorError(TypeError):
    """A DTensor op got a plain (non-scalar) MindSpore tensor among its operands."""


def _layouts(args: Any) -> str:
    return ", ".join(f"{list(a.placements)} shape {a.shape}" if isinstance(a, DTensor)
                     else type(a).__name__ for a in args)


def _unlayout(a: Any) -> Any:
    return a.to_local() if isinstance(a, DTensor) else a


def dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DTensor arguments (see the module docstring)."""
    name = getattr(func, "name", str(func))
    # legacy primitives (ops.gather, ...) arrive as (primitive, name, the real arguments)
    legacy = len(args) == 3 and type(args[1]) is str and isinstance(args[2], tuple) \
        and not isinstance(args[0], Tensor)
    real = list(args[2]) if legacy else list(args)
    try:
        if name in PASSTHROUGH:
            with NoFallbackGuard():
                local = [_unlayout(a) for a in real]
                return func(*((args[0], args[1], tuple(local)) if legacy else local), **kwargs)
        parse = OPS.get(name)
        if parse is None:
            hint = UNMAPPED_HINTS.get(name)
            raise ShardingError(f"DTensor op {name!r} (MindSpore primitive) on inputs "
                                f"({_layouts(real)}): no sharding rule is mapped for it; "
                                + (f"{hint}; or " if hint else "")
                                + "redistribute to Replicate and compute on .full_tensor(), or "
                                "add it to hyperpar_mindspore.opnames.OPS")
        call = parse(real, kwargs)
        return _run(func, name, args, real, kwargs, call, legacy)
    except (ShardingError, MixedTensorError, ValueError, IndexError):
        clear_grad_state()  # an error inside ms.grad must not poison the next gradient call
        raise


def getitem(x: DTensor, index: Any) -> Any:
    """``x[index]`` for a basic index (ints, slices, None, ``...``), laid out by the neutral
    rule (rules/index.py); any other index raises "no sharding rule". MindSpore splits basic
    indexing into several primitives, some of which never reach ``__fallback__``, so the index
    is read here, before MindSpore sees it."""
    items = index if type(index) is tuple else (index,)
    call = Call("getitem", (0,), {"index": items})

    def run(t: Tensor) -> Any:
        return t[index]

    try:
        return _run(run, "getitem", (x,), [x], {}, call, False)
    except (ShardingError, MixedTensorError, ValueError, IndexError):
        clear_grad_state()
        raise


def _run(func: Any, name: str, args: Any, real: list[Any], kwargs: dict[str, Any], call: Call,
         legacy: bool) -> Any:
    listed = call.tensor_list
    operands = list(real[listed]) if listed is not None else [real[i] for i in call.tensors]
    dts = [a for a in operands if isinstance(a, DTensor)]
    mesh = dts[0].device_mesh
    for a in operands:
        if not isinstance(a, DTensor):
            raise MixedTensorError(
                f"{name}: got a mix of DTensor and a plain MindSpore Tensor of shape "
                f"{tuple(a.shape)}; make it a DTensor (DTensor.from_local or "
                "distribute_tensor) first")
        if a.device_mesh is not mesh and tuple(a.device_mesh.shape) != tuple(mesh.shape):
            raise ValueError(f"{name}: DTensor inputs live on different meshes")
    metas = tuple(TensorMeta(a.placements, a.shape) for a in operands)
    sharding = propagate(call.op, metas, tuple(mesh.shape), **call.args)
    if call.op not in EMPTY_SAFE:
        sharding = _without_empty_pieces(call, metas, sharding, tuple(mesh.shape))
    local = list(real)
    moved = [sum_grad_over(redistribute(a.to_local(), mesh, a.placements, target, a.shape),
                           mesh, sums)
             for a, target, sums in zip(operands, sharding.inputs, sharding.grad_sum,
                                        strict=True)]
    if listed is not None:
        local[listed] = type(real[listed])(moved)
    for i, x in zip(call.tensors, moved, strict=False):
        local[i] = x
    for i, a in enumerate(local):  # DTensors outside the operands (none expected): unwrap
        local[i] = _unlayout(a)
    with NoFallbackGuard():
        out = _call_local(func, args, local, kwargs, call, sharding, mesh, legacy)
    return _wrap(out, mesh, sharding)


#: Ops whose MindSpore backward works on every rank even where a local piece is empty. Others
#: never see an empty piece (their inputs are replicated over that mesh dim instead): MatMul's
#: backward skips the other operand's custom backward when the contraction is empty (leaving
#: that rank out of a collective) and a sum's backward (Tile) fails on an empty input.
EMPTY_SAFE = frozenset({"add", "sub", "neg", "identity", "mul", "div", "elementwise",
                        "reshape", "transpose", "permute"})


def _without_empty_pieces(call: Call, metas: tuple[TensorMeta, ...], sharding: OpSharding,
                          mesh_shape: tuple[int, ...]) -> OpSharding:
    """Re-plan with the inputs replicated over every mesh dim where an input or output piece
    would be empty on some rank."""
    layouts = [(m.shape, t) for m, t in zip(metas, sharding.inputs, strict=True)]
    layouts += list(zip(sharding.shapes, sharding.outputs, strict=False))
    bad = {m for shape, pl in layouts if some_rank_empty(shape, pl, mesh_shape)
           for m in range(len(mesh_shape)) if type(pl[m]) is Shard}
    if not bad:
        return sharding
    metas = tuple(TensorMeta(tuple(REPLICATE if m in bad and type(p) is Shard else p
                                   for m, p in enumerate(meta.placements)), meta.shape)
                  for meta in metas)
    return propagate(call.op, metas, mesh_shape, **call.args)


def _call_local(func: Any, args: Any, local: list[Any], kwargs: dict[str, Any], call: Call,
                sharding: OpSharding, mesh: Any, legacy: bool) -> Any:
    if call.reshape or call.expand:
        x = local[call.tensors[0]]
        shape, _ = shard_shape_and_offset(sharding.shapes[0], sharding.outputs[0],
                                          tuple(mesh.shape), mesh_coordinate(mesh))
        return mint.reshape(x, shape) if call.reshape else mint.broadcast_to(x, shape)
    if isinstance(sharding.local, MaskedLookup):  # a vocabulary-parallel lookup
        def run(a: list[Any]) -> Any:
            return func(args[0], args[1], tuple(a), **kwargs) if legacy else func(*a, **kwargs)

        return masked_lookup(run, local, call.tensors, sharding.local, mesh, call.padding_at)
    if isinstance(sharding.local, GlobalMean):  # a mean loss over a sharded batch
        return global_mean(func, local, sharding.local, mesh)
    if sharding.divide_by is not None:  # a mean over a sharded dim: local sum / global count
        dim = call.args["dim"]
        dim = tuple(dim) if isinstance(dim, list) else dim
        return mint.sum(local[call.tensors[0]], dim, call.args["keepdim"]) / sharding.divide_by
    if legacy:
        return func(args[0], args[1], tuple(local), **kwargs)
    return func(*local, **kwargs)


def _wrap(out: Any, mesh: Any, sharding: OpSharding) -> Any:
    if isinstance(out, Tensor):
        return DTensor(out, mesh, sharding.outputs[0], sharding.shapes[0])
    if isinstance(out, tuple | list):
        return type(out)(DTensor(o, mesh, p, s) if isinstance(o, Tensor) else o
                         for o, p, s in zip(out, sharding.outputs, sharding.shapes,
                                            strict=False))
    return out
