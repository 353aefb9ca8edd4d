"""fully_shard (FSDP2 semantics) on MindSpore Cells, PyNative mode.

>>> mesh = init_device_mesh((world,), mesh_dim_names=("dp",))          # doctest: +SKIP
>>> for block in net.blocks:
...     fully_shard(block, mesh=mesh)
>>> fully_shard(net, mesh=mesh)
>>> opt = nn.Adam(net.trainable_params(), learning_rate=1e-3)   # state for the shards only
>>> step = ms.value_and_grad(loss_fn, None, opt.parameters)
>>> loss, grads = step(x_local, y_local)  # grads: this rank's shard of the dp-mean gradient
>>> opt(grads)
>>> full = net.full_parameters()          # name -> whole value (a collective)

Each parameter of a unit is replaced by a ``Parameter`` of the same name holding this rank's
dim-0 ``torch.chunk`` piece, zero-padded to ``ceil(d0 / n)`` rows (the layout, the flat buffer
and the reduction groups come from the framework-neutral :mod:`hyperpar.parallel.shard_plan`).
Before the unit's ``construct`` runs, its shards are concatenated and all-gathered in one
collective; the whole values stand in for the parameters while ``construct`` runs and the shard
``Parameter`` objects are put back afterwards. The all-gather is a Cell with a ``bprop``: in
backward MindSpore hands it the gradient of the gathered buffer, which it reduce-scatters
(summed over the shard group, then over the replicate group for HSDP, times ``1/world``), so
``value_and_grad`` returns each rank's shard of the averaged gradient. The padding rows get a
zero gradient and stay zero under SGD, Momentum and Adam.

MindSpore's PyNative autodiff keeps the gathered values its backward needs until backward runs,
so ``reshard_after_forward`` does not change what is held or sent here: one all-gather per
unit per forward, one reduce-scatter per unit per backward (no re-gather in backward, no
prefetch). The argument is accepted and checked for torch compatibility.

Graph mode (``ms.jit``, ``GRAPH_MODE``) compiles the whole step: a graph never runs the Python
that puts the whole values in place, so each Cell owning a sharded parameter reads it through a
property that, when the compiler reads it, all-gathers that parameter's shard with MindSpore's
communication primitives (:mod:`.fsdp_graph`; one gather per parameter, not per unit). The
gathered values are graph intermediates: as in PyNative, ``reshard_after_forward`` does not
change what is held or sent.

``mp_policy=MixedPrecisionPolicy(...)`` (hyperpar's one policy class, MindSpore dtypes) follows
torch FSDP2: the flat shard buffer is cast to ``param_dtype`` before the gather, floating inputs
are cast to it, the gathered buffer's gradient is reduce-scattered in ``reduce_dtype`` and
handed back in the shards' dtype, outputs are cast to ``output_dtype``. PyNative only: those
casts are Python a compiled graph skips, so a compile refuses the unit (:mod:`.fsdp_graph`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from hyperpar.dtensor.placement import Shard
from hyperpar.fsdp.policy import MixedPrecisionPolicy
from hyperpar.fsdp.sections import divide_scale
from hyperpar.parallel.shard_plan import UnitPlan, plan_unit, reshard_after
from hyperpar.platform import get_platform

from .fsdp_graph import install_graph_reads
from .fsdp_sections import attach_shard_full_tensor, split_by_mesh, units_of
from .graph import refuse_graph_mode
from .parallel import SHARD_GROUP
from .tensors import SHARD_PLACEMENTS, copy_tensor

__all__ = ["FullyShardedCell", "fully_shard", "units_of"]


class _Precision(NamedTuple):
    """A unit's checked :class:`MixedPrecisionPolicy` (``None``: no cast)."""

    param_dtype: Any = None
    reduce_dtype: Any = None  # the policy's, else param_dtype (torch FSDP2's default)
    output_dtype: Any = None
    cast_inputs: bool = False


@functools.cache
def _bf16_matmul_runs() -> bool:
    """Whether a bfloat16 MatMul runs on this process's device (measured: MindSpore 2.10's CPU
    MatMul has no bfloat16 kernel, "Select CPU operator[MatMul] fail! Unsupported data type")."""
    one = Tensor(np.ones((1, 1), np.float32)).astype(ms.bfloat16)
    try:
        ops.matmul(one, one).asnumpy()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def _precision(mp_policy: Any, what: str) -> _Precision:
    """Check ``mp_policy`` for a MindSpore Cell (local checks only: every rank raises alike,
    before any collective)."""
    if mp_policy is None:
        return _Precision()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a hyperpar MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp_policy, field)
        if value is not None and not type(value).__module__.startswith("mindspore"):
            raise TypeError(f"fully_shard: mp_policy.{field}={value!r} is not a MindSpore dtype; "
                            f"on Cells pass mindspore's (e.g. mindspore.float16)")
    param = mp_policy.param_dtype
    if param == ms.bfloat16 and not _bf16_matmul_runs():
        raise ValueError(
            f"fully_shard({what}): mp_policy.param_dtype=mindspore.bfloat16, but MindSpore's "
            f"{ms.get_context('device_target')} MatMul has no bfloat16 kernel here (a bfloat16 "
            f"MatMul failed); use param_dtype=mindspore.float16 on this device (bfloat16 where "
            f"the device has it)")
    reduce = mp_policy.reduce_dtype if mp_policy.reduce_dtype is not None else param
    return _Precision(param, reduce, mp_policy.output_dtype,
                      bool(mp_policy.cast_forward_inputs) and param is not None)


def _cast_floating(value: Any, dtype: Any) -> Any:
    """``value`` with its floating tensors (in tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, Tensor):
        if value.dtype in ms.dtype.float_type and value.dtype != dtype:
            return value.astype(dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


class _GatherFlat(nn.Cell):
    """All-gather of a unit's flat shard buffer, cast to ``param_dtype`` first (so the gather
    moves that dtype); its ``bprop`` is the averaging reduce-scatter of the gathered buffer's
    gradient, in ``reduce_dtype``, handed back in the shards' own dtype."""

    def __init__(self, plan: UnitPlan, shard_group: Any, replicate_group: Any,
                 param_dtype: Any = None, reduce_dtype: Any = None) -> None:
        super().__init__()
        self.platform = get_platform()
        self.plan = plan
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        # what backward does with the gradient (see BACKWARD_MODES); "accumulate" keeps the
        # unsharded sum here (a dict, not a Cell attribute: MindSpore's Cell bookkeeping never
        # sees the tensor)
        # "all_reduce": False (HSDP, set_requires_all_reduce) keeps the reduce-scattered shard
        # gradients summed in "partial" instead of all-reducing them over the replicas
        self.accumulate: dict[str, Any] = {"mode": "sync", "grad": None, "all_reduce": True,
                                           "partial": None}
        self.divide_factor: float | None = None  # set_gradient_divide_factor

    def construct(self, flat: Any) -> tuple[Any, ...]:
        if self.param_dtype is not None and flat.dtype != self.param_dtype:
            flat = flat.astype(self.param_dtype)
        n = self.plan.shard_size
        pieces = (self.platform.gather_list(flat, self.shard_group, "fully_shard") if n > 1
                  else [flat])
        return tuple(self._whole(pieces, slot) for slot in self.plan.slots)

    @staticmethod
    def _whole(pieces: list[Any], slot: Any) -> Any:
        # each rank's piece of this parameter, put together straight from the gathered list:
        # one copy per parameter (a flat cat and then a strided reshape were two, measured
        # 13 ms of a 225 ms step at batch 64)
        parts = [mint.narrow(piece, 0, slot.offset, slot.shard_numel) for piece in pieces]
        full = (mint.cat(parts) if len(parts) > 1 else copy_tensor(parts[0]))
        full = full.reshape(slot.padded_shape(len(pieces)))
        if full.shape[0] != slot.shape[0]:
            full = mint.narrow(full, 0, 0, slot.shape[0])
        return full

    def _flat_gradient(self, dout: tuple[Any, ...]) -> Any:
        """The gathered buffer's gradient, rank-major as the gather laid it out: rank r's
        block holds each parameter's rows r's piece, the padding rows zero."""
        n = self.plan.shard_size
        padded = []
        for slot, grad in zip(self.plan.slots, dout, strict=True):
            if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
                grad = grad.astype(self.reduce_dtype)
            missing = n * slot.rows_per_rank - slot.shape[0]
            if missing:
                grad = mint.cat([grad, mint.zeros((missing, *slot.shape[1:]), dtype=grad.dtype)])
            padded.append(grad.reshape(-1))
        if n == 1:
            return mint.cat(padded) if len(padded) > 1 else padded[0]
        slots = list(zip(self.plan.slots, padded, strict=True))
        return mint.cat([mint.narrow(g, 0, r * slot.shard_numel, slot.shard_numel)
                         for r in range(n) for slot, g in slots])

    def bprop(self, flat: Any, out: Any, dout: tuple[Any, ...]) -> tuple[Any]:
        numel = self.plan.flat_numel
        acc = self.accumulate
        if acc["mode"] == "discard":   # a backward whose parameter gradients nobody reads
            return (ops.zeros(flat.shape, flat.dtype),)
        if not isinstance(dout, (tuple, list)):  # one parameter: MindSpore unwraps the tuple
            dout = (dout,)
        dout = self._flat_gradient(dout)
        if acc["grad"] is not None:
            dout = dout + acc["grad"]
            acc["grad"] = None
        if acc["mode"] == "accumulate":
            # no reduction now: the unsharded sum waits for the next synced backward; this
            # backward's gradient for the shards is zero (see set_requires_gradient_sync)
            acc["grad"] = copy_tensor(dout)
            return (ops.zeros(flat.shape, flat.dtype),)
        if self.plan.shard_size > 1:
            # the platform's reduce-scatter (on CPU a point-to-point ring for large buffers,
            # which moves (n - 1)/n of the bytes an all-reduce would)
            grad = ops.zeros((numel,), dout.dtype)
            self.platform.reduce_scatter_tensor(grad, dout, "sum", self.shard_group)
        else:  # a copy: the replicate all-reduce below works in place
            grad = copy_tensor(dout)
        if self.plan.replicate > 1:
            if acc["partial"] is not None:
                grad = grad + acc["partial"]
                acc["partial"] = None
            if not acc["all_reduce"]:
                # reduce-scattered but not all-reduced: summed here until the next backward
                # that all-reduces (torch FSDP2's partial reduce output); zeros returned
                acc["partial"] = grad
                return (ops.zeros(flat.shape, flat.dtype),)
            self.platform.all_reduce(grad, "sum", self.replicate_group)
        grad = grad * divide_scale(self.divide_factor, self.plan.shard_size,
                                   self.plan.replicate)
        if grad.dtype != flat.dtype:  # the sharded parameter's gradient, in its dtype (fp32)
            grad = grad.astype(flat.dtype)
        return (grad,)


class _Unit:
    """One fully-sharded Cell: its shard parameters, where they sit, and the gather."""

    def __init__(self, cell: nn.Cell, plan: UnitPlan, slots: list[list[tuple[nn.Cell, str]]],
                 shards: list[Parameter], shard_group: Any, replicate_group: Any,
                 reshard: bool, mp: _Precision) -> None:
        self.cell, self.plan, self.slots, self.shards = cell, plan, slots, shards
        self.shard_group = shard_group
        self.mp = mp
        self.gather = _GatherFlat(plan, shard_group, replicate_group, mp.param_dtype,
                                  mp.reduce_dtype)
        # full_parameters(): the values in the shards' own dtype, not param_dtype
        self.gather_exact = (self.gather if mp.param_dtype is None
                             else _GatherFlat(plan, shard_group, replicate_group))
        self.reshard = reshard
        self.originals: set[int] = set()  # ids of the Parameters the shards replaced
        # per parameter, (dim, group) when tensor parallelism had split it before (dp x tp):
        # the shard is then rows of a tp piece, which checkpoints place in the global tensor
        self.tp_layouts: list[tuple[int, Any] | None] = [None] * len(shards)

    def unshard(self, exact: bool = False) -> list[Any]:
        """The whole value of every parameter (differentiable w.r.t. the shards), in the
        policy's ``param_dtype`` (``exact``: in the shards' own dtype)."""
        if not self.shards:
            return []
        flat = mint.cat([p.reshape(-1) for p in self.shards])
        gather = self.gather_exact if exact else self.gather
        return list(gather(flat))

    def install(self, values: list[Any]) -> None:
        """Put the whole values in the parameters' slots while the unit runs (its forward
        hooks too: a tensor-parallel Cell's hooks swap and read ``_params`` themselves)."""
        for where, value in zip(self.slots, values, strict=True):
            for owner, attr in where:
                owner._params[attr] = value

    def restore(self) -> None:
        """The shard Parameters back in their places (also the first placement)."""
        for where, shard in zip(self.slots, self.shards, strict=True):
            for owner, attr in where:
                owner._params[attr] = shard

    def settle_owners(self) -> None:
        """Run MindSpore's once-per-Cell first-call checks now, on the shard Parameters: they
        walk ``_params`` (of the Cell and below) expecting Parameters, and would otherwise run
        while whole values (plain tensors) stand in the slots."""
        for _name, sub in self.cell.cells_and_names():
            if not (sub._init_flag or sub._is_check_and_refresh):
                sub._init_check()
                sub._self_check()


#: what a unit's backward does with its gathered parameters' gradient: "sync" reduce-scatters
#: it (plus what was accumulated); "accumulate" adds it to a local unsharded sum and returns
#: zeros; "discard" returns zeros and keeps nothing (a backward for input gradients only)
BACKWARD_MODES = ("sync", "accumulate", "discard")


def set_backward_mode(units: Iterable[_Unit], mode: str) -> None:
    """Set each unit's backward mode (:data:`BACKWARD_MODES`); a pipeline engine uses it to
    reduce once per step."""
    if mode not in BACKWARD_MODES:
        raise ValueError(f"unknown backward mode {mode!r}; expected one of {BACKWARD_MODES}")
    for unit in units:
        unit.gather.accumulate["mode"] = mode


def reset_backward(units: Iterable[_Unit]) -> None:
    """Every unit back to "sync", dropping any accumulated gradient (after a failed step)."""
    for unit in units:
        unit.gather.accumulate.update(mode="sync", grad=None, partial=None)


def pending_gradients(units: Iterable[_Unit]) -> list[str]:
    """Class names of the units holding an accumulated gradient no synced backward reduced."""
    return [type(u.cell).__name__ for u in units
            if u.gather.accumulate["grad"] is not None
            or u.gather.accumulate["partial"] is not None]


def _group_name(group: Any, size: int) -> str | None:
    """MindSpore's name of ``group`` (``None``: the world) for the graph's primitives."""
    if size == 1:
        return None
    if group is None:
        from mindspore.communication import GlobalComm

        return GlobalComm.WORLD_COMM_GROUP
    return group.name


def _run_through_hooks(cell: nn.Cell, inputs: tuple) -> None:
    """A no-op forward pre-hook: with one, ``Cell.__call__`` runs ``_run_construct``."""
    return None


class FullyShardedCell(nn.Cell):
    """Mixin class of a Cell prepared by :func:`fully_shard` (never built directly)."""

    _hp_fsdp_unit: _Unit

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter of this Cell, sharded ones gathered whole (a collective: call it on
        every rank), by the names of ``parameters_and_names()``."""
        whole: dict[int, Tensor] = {}
        for _name, cell in self.cells_and_names():
            for unit in units_of(cell):
                for shard, value in zip(unit.shards, unit.unshard(exact=True), strict=True):
                    whole[id(shard)] = copy_tensor(value)
        return {name: whole.get(id(p), p) for name, p in self.parameters_and_names()}

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """``False``: backward passes keep each unit's unsharded gradient locally, without the
        reduce-scatter (gradient accumulation, as torch FSDP2); the next backward with ``True``
        reduces the accumulated sum once. MindSpore has no ``.grad`` to accumulate into, so a
        backward without sync returns zero gradients for the shards and the synced one returns
        the reduced sum of all: summing the returned gradients (MindSpore's habit) and using
        the last ones (torch's) both give the accumulated gradient. ``recurse``: also the
        fully-sharded Cells below. PyNative only: a compiled step reduces every backward."""
        for unit in self._units_to_switch("set_requires_gradient_sync", requires_gradient_sync,
                                          recurse, "reduces the gradient in every backward -- "
                                          "run the accumulation steps in PyNative, or keep "
                                          "sync on and sum the returned gradients"):
            set_backward_mode([unit], "sync" if requires_gradient_sync else "accumulate")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *,
                                recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters each backward's gradient over the shard group but
        keeps the result summed locally instead of all-reducing it over the replicas; the next
        backward with ``True`` all-reduces the sum once (torch FSDP2's gradient accumulation
        with reduce-scatter only). As for :meth:`set_requires_gradient_sync`, a backward
        without the all-reduce returns zeros and the next one the whole sum. Without a
        replicate dimension there is no all-reduce and this changes nothing. PyNative only."""
        for unit in self._units_to_switch("set_requires_all_reduce", requires_all_reduce,
                                          recurse, "all-reduces the gradient in every "
                                          "backward"):
            unit.gather.accumulate["all_reduce"] = requires_all_reduce

    def _units_to_switch(self, what: str, value: bool, recurse: bool,
                         graph_does: str) -> list[_Unit]:
        """The units a ``set_requires_*`` call switches, after checking its argument: a bool,
        and ``False`` only in PyNative (a compiled graph ``graph_does`` regardless)."""
        if not isinstance(value, bool):
            raise TypeError(f"{what}: expected a bool, got {type(value).__name__}")
        if not value and ms.get_context("mode") == ms.GRAPH_MODE:
            raise NotImplementedError(f"{what}(False) on MindSpore runs in PyNative mode only: "
                                      f"a compiled graph {graph_does}")
        cells = (cell for _n, cell in self.cells_and_names()) if recurse else (self,)
        return [u for c in cells for u in units_of(c)]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of each mesh's data-parallel
        size (torch FSDP2's method; torchtitan passes the world's batch size so that the
        experts on ``efsdp`` and the dense parameters on ``dp`` get the same mean). This Cell's
        units and those below. PyNative only: a compiled graph's gather keeps the scale it was
        built with, so a compile of this Cell is refused from now on."""
        factor = float(factor)
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        if ms.get_context("mode") == ms.GRAPH_MODE:
            raise NotImplementedError("set_gradient_divide_factor on MindSpore runs in PyNative "
                                      "mode only: a compiled graph's gather scales by the "
                                      "data-parallel size it was built with")
        for unit in self._units_to_switch("set_gradient_divide_factor", True, True, ""):
            unit.gather.divide_factor = factor
        refuse_graph_mode(self, "set_gradient_divide_factor",
                          "the compiled gather scales gradients by the data-parallel size")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def shard_layout(self) -> dict[str, tuple[int, int, int]]:
        """``name -> (first global row, rows held, padded rows stored)`` for this unit's own
        sharded parameters, on this rank (each within its own mesh's group)."""
        out = {}
        for unit in units_of(self):
            me = get_platform().rank(unit.shard_group) if unit.plan.shard_size > 1 else 0
            out.update({s.name: (s.starts[me], s.lengths[me], s.rows_per_rank)
                        for s in unit.plan.slots})
        return out


def _groups(mesh: Any) -> tuple[Any, Any, int, int]:
    """``(shard group, replicate group, shard size, replicate size)`` of a 1-D or 2-D
    ``(replicate, shard)`` mesh (``None``: the world)."""
    platform = get_platform()
    if mesh is None:
        return None, None, platform.world_size(None), 1
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return mesh.get_group(0), None, mesh.size(0), 1
    if ndim == 2:
        return mesh.get_group(1), mesh.get_group(0), mesh.size(1), mesh.size(0)
    raise ValueError(f"fully_shard: mesh must be a 1-D (shard) or 2-D (replicate, shard) "
                     f"DeviceMesh, got {mesh!r}; for dp x tp pass mesh['dp']")


def _own_params(cell: nn.Cell, ignored: set[int]) -> tuple[list[Parameter],
                                                             list[list[tuple[nn.Cell, str]]]]:
    """The parameters ``cell`` shards: those not already in a nested unit nor ignored, each
    once (a tied parameter lists every slot it sits in)."""
    claimed: set[int] = set()
    replaced: dict[int, str] = {}  # parameters a nested unit sharded: id -> that unit's class
    for _name, sub in cell.cells_and_names():
        for unit in units_of(sub) if sub is not cell else ():
            claimed.update(id(p) for p in unit.shards)
            replaced.update((i, type(sub).__name__) for i in unit.originals)
    params: list[Parameter] = []
    slots: list[list[tuple[nn.Cell, str]]] = []
    index: dict[int, int] = {}
    for _name, sub in cell.cells_and_names():
        for attr, p in sub._params.items():
            if p is None or id(p) in claimed or id(p) in ignored:
                continue
            if id(p) in replaced:  # a tie reaching outside the nested unit: it would split
                raise ValueError(
                    f"fully_shard: parameter {p.name!r} is tied between the fully-sharded "
                    f"{replaced[id(p)]} and a Cell outside it; apply fully_shard to a Cell "
                    f"holding every use of the parameter (or not to the inner one)")
            if id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
                slots.append([])
            slots[index[id(p)]].append((sub, attr))
    return params, slots


def _tp_layout(param: Parameter) -> tuple[int, Any] | None:
    """``(dim, group)`` of a tensor-parallel shard (a ``Parameter`` ``parallelize_module``
    split over more than one rank), else ``None``."""
    placements = getattr(param, SHARD_PLACEMENTS, None)
    group = getattr(param, SHARD_GROUP, None)
    if not placements or not isinstance(placements[0], Shard) or group is None or (
            get_platform().world_size(group) == 1):
        return None
    return placements[0].dim % len(param.shape), group


def _section(cell: nn.Cell, params: list[Parameter], slots: list[list[tuple[nn.Cell, str]]],
             mesh: Any, reshard: bool, mp: _Precision, what: str) -> _Unit:
    """One mesh's share of ``cell``'s parameters: sharded over ``mesh``, one flat buffer."""
    shard_group, replicate_group, n, rep = _groups(mesh)
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"fully_shard: the parameters of {what} have several "
                         f"dtypes ({sorted(str(d) for d in dtypes)}); one unit gathers one flat "
                         f"buffer -- apply fully_shard to sub-Cells of one dtype each, or pass "
                         f"the others in ignored_params")
    plan = plan_unit([(p.name, p.shape) for p in params], n, rep)
    me = get_platform().rank(shard_group) if n > 1 else 0
    shards = []
    for p, slot in zip(params, plan.slots, strict=True):
        whole = p.asnumpy()  # this rank's piece when a style split it (EP, TP): sharded within
        piece = np.zeros(slot.shard_shape, dtype=whole.dtype)
        start, length = slot.starts[me], slot.lengths[me]
        piece[:length] = whole[start:start + length]
        shard = Parameter(Tensor(piece), name=p.name, requires_grad=p.requires_grad)
        attach_shard_full_tensor(shard, p, slot, shard_group, n)
        shards.append(shard)
    unit = _Unit(cell, plan, slots, shards, shard_group, replicate_group, reshard, mp)
    unit.me = me
    unit.originals = {id(p) for p in params}
    unit.tp_layouts = [_tp_layout(p) for p in params]
    # a piece a style split without a tp group (ExpertParallel): checkpoints refuse it
    unit.style_split = [getattr(p, "_hyperpar_readback", None) is not None and t is None
                        and any(isinstance(q, Shard) for q in p._hyperpar_readback[1])
                        for p, t in zip(params, unit.tp_layouts, strict=True)]
    unit.restore()  # the shards take the parameters' places
    unit.settle_owners()
    return unit


def fully_shard(cell: nn.Cell, *, mesh: Any = None,
                reshard_after_forward: bool | int | None = None,
                ignored_params: Iterable[Parameter] | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                shard_placement_fn: Callable[[Parameter], Any] | None = None) -> nn.Cell:
    """Shard ``cell``'s parameters along dim 0 over the data-parallel ``mesh`` (FSDP2
    semantics): apply to the blocks first, then to the root.

    Args:
        cell: a ``mindspore.nn.Cell`` (a block or the root). Parameters already sharded by a
            nested ``fully_shard`` are left to that unit.
        mesh: a 1-D :class:`~hyperpar.dtensor.DeviceMesh` (shard) or 2-D ``(replicate,
            shard)`` for HSDP; default: every rank. With tensor parallelism pass ``mesh["dp"]``.
        reshard_after_forward: accepted as on torch; see the module docstring for why it does
            not change the schedule on MindSpore PyNative.
        ignored_params: parameters left whole: not sharded, not gathered, their gradients not
            reduced.
        mp_policy: :class:`~hyperpar.fsdp.MixedPrecisionPolicy` with MindSpore dtypes (torch
            FSDP2's semantics): the shards (and so the optimizer state) keep their dtype, the
            gathered parameters are ``param_dtype``, floating inputs are cast to it
            (``cast_forward_inputs``), gradients are reduce-scattered in ``reduce_dtype``
            (default ``param_dtype``) and land in the shards' dtype, floating outputs are cast
            to ``output_dtype``. PyNative only (a compiled graph refuses it). ``bfloat16`` is
            refused where a bfloat16 MatMul does not run (MindSpore's CPU): use ``float16``.
        shard_placement_fn: ``fn(param) -> None | Shard(0) | ShardPlacementResult`` as on
            torch (:mod:`hyperpar.fsdp.sections` decides): a ``ShardPlacementResult`` whose
            ``FSDPMeshInfo`` names another mesh shards that parameter over it -- e.g.
            torchtitan's routed experts (already split by ``ExpertParallel``) over ``efsdp``,
            the rest over ``mesh``. One flat buffer, gather and reduce-scatter per mesh; with
            more than one mesh, PyNative only. Dims other than 0 are refused.

    Returns ``cell`` itself, whose class now also derives from :class:`FullyShardedCell`.
    """
    if not isinstance(cell, nn.Cell):
        raise TypeError(f"fully_shard: expected a mindspore.nn.Cell, got {type(cell).__name__}")
    if isinstance(cell, FullyShardedCell):
        raise ValueError(f"fully_shard: {type(cell).__name__} is already fully sharded; apply "
                         f"fully_shard once per Cell (blocks first, then the root)")
    # checked as on torch; the root is not known yet, and the schedule does not depend on it
    reshard = reshard_after(reshard_after_forward, is_root=False)
    mp = _precision(mp_policy, type(cell).__name__)
    _groups(mesh)  # the unit's mesh checked first, whatever shard_placement_fn says
    ignored = {id(p) for p in (ignored_params or ())}
    params, slots = _own_params(cell, ignored)
    what = type(cell).__name__
    units = [_section(cell, [params[i] for i in idx], [slots[i] for i in idx], pmesh, reshard,
                      mp, what)
             for pmesh, idx in split_by_mesh(params, shard_placement_fn, mesh, what)
             if idx or pmesh is mesh]
    cls = type(cell)
    sharded = type(f"FullyShard{cls.__name__}", (cls, FullyShardedCell), {})

    def _run_construct(self: nn.Cell, *args: Any, **kwargs: Any) -> Any:
        # PyNative only (a compile reads construct and the _jit_* hook methods, never this):
        # the whole values go in place before the Cell's own forward hooks run.
        units = self.__dict__["_hp_fsdp_sections"]
        unit = units[0]
        if unit.mp.cast_inputs:
            args = _cast_floating(args, unit.mp.param_dtype)
            kwargs = _cast_floating(kwargs, unit.mp.param_dtype)
        try:
            for section in units:
                section.install(section.unshard())
            out = super(sharded, self)._run_construct(*args, **kwargs)
        finally:
            for section in units:
                section.restore()
        if unit.mp.output_dtype is not None:
            out = _cast_floating(out, unit.mp.output_dtype)
        return out

    sharded._run_construct = _run_construct
    cell.__class__ = sharded
    object.__setattr__(cell, "_hp_fsdp_unit", units[0])
    object.__setattr__(cell, "_hp_fsdp_sections", units)
    if len(units) > 1:  # several meshes: PyNative only (not yet measured compiled)
        refuse_graph_mode(cell, "fully_shard with shard_placement_fn over several meshes",
                          "each mesh's gather is installed in PyNative only")
    else:
        # graph mode: each owner reads its sharded parameters gathered (fsdp_graph); last, as
        # the property must sit in the Cell's own class (measured: an inherited one is read in
        # Python)
        unit = units[0]
        install_graph_reads(unit.plan, unit.slots, unit.shards,
                            _group_name(unit.shard_group, unit.plan.shard_size), unit.me,
                            _group_name(unit.gather.replicate_group, unit.plan.replicate),
                            mp_refused=mp != _Precision())
    # Cell.__call__ skips _run_construct for a Cell without hooks; a graph compiles this
    # no-op hook (a named function) as it is
    cell.register_forward_pre_hook(_run_through_hooks)
    return cell
