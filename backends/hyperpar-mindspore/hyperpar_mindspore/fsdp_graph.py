"""fully_shard under ``ms.jit`` / ``GRAPH_MODE``: each parameter gathered where it is read.

In PyNative mode a fully-sharded unit's ``_run_construct`` gathers the whole values and puts
them in the parameters' slots while ``construct`` runs. A compiled graph never runs that Python:
the parser reads ``self.weight`` in each Cell's ``construct`` and finds the Parameter in
``_params`` -- this rank's padded dim-0 shard. So every Cell owning a sharded parameter gets a
subclass (same class name) with a ``property`` per sharded attribute: read by the graph compiler
it returns :class:`FullParameter` of the shard -- ``ops.AllGather`` on the shard group, the
padding cut off -- whose ``bprop`` is the FSDP2 reduce-scatter (``ops.AllReduce`` + this rank's
rows, as ``ops.ReduceScatter`` has no CPU kernel), then the replicate group's all-reduce for HSDP,
times ``1 / (shard x replicate)``. Read in PyNative (by ``construct`` or by the user) the
property returns ``_params[attr]`` as before: the whole value while the unit runs,
the shard outside it.

The property must sit in the Cell's own class, which is built without the base's
``__qualname__``: otherwise MindSpore 2.10's compiler evaluated the attribute in Python at compile
time (measured: the forward was right, the gradients of the shards zero) or read ``_params``
(a shape error).

Whether the compiler is reading is decided by :func:`compiling`, a ``constexpr`` (run in Python
at compile time, and in PyNative when called): it looks for MindSpore's ``compile`` on the stack.
"""

from __future__ import annotations

import sys
from typing import Any

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import constexpr

from hyperpar.parallel.shard_plan import ParamSlot, UnitPlan

__all__ = ["FullParameter", "compiling", "install_graph_reads"]

_PREFIX_SHARD = "_hp_fsdp_shard_"
_PREFIX_FULL = "_hp_fsdp_full_"


@constexpr
def compiling() -> bool:
    """True while MindSpore compiles a graph (``ms.jit`` or a ``GRAPH_MODE`` Cell call)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile" and "mindspore" in code.co_filename:
            return True
        frame = frame.f_back
    return False


class _GatherRows(nn.Cell):
    """The padded shard gathered along dim 0 over the shard group; ``bprop``: the averaging
    reduce-scatter (summed over the shard group, this rank's rows, summed over the replicate
    group, scaled to the mean over every data-parallel rank)."""

    def __init__(self, shard_group: str | None, n: int, rank: int, rows: int,
                 replicate_group: str | None, replicate: int, scale: float,
                 by_sum: bool) -> None:
        super().__init__()
        self.n, self.rank, self.rows, self.replicate, self.scale = n, rank, rows, replicate, scale
        self.by_sum = by_sum
        if n > 1:
            self.gather = ops.AllGather(shard_group)
            self.shard_sum = ops.AllReduce(ops.ReduceOp.SUM, shard_group)
        if replicate > 1:
            self.replicate_sum = ops.AllReduce(ops.ReduceOp.SUM, replicate_group)

    def construct(self, shard: Any) -> Any:
        if self.n > 1:
            if self.by_sum:
                return self.shard_sum(self._placed(shard))
            return self.gather(shard)
        return shard * 1  # a new value, so that bprop runs (HSDP with shard size 1)

    def _placed(self, shard: Any) -> Any:
        """The shard at its rows of a zero buffer of the gathered shape: summed over the
        group, that is the all-gather, exactly (each element is one value plus zeros)."""
        rest = shard.shape[1:]
        if self.rank == 0:
            return ops.concat((shard, ops.zeros(((self.n - 1) * self.rows,) + rest,
                                                shard.dtype)), 0)
        if self.rank == self.n - 1:
            return ops.concat((ops.zeros((self.rank * self.rows,) + rest, shard.dtype),
                               shard), 0)
        return ops.concat((ops.zeros((self.rank * self.rows,) + rest, shard.dtype), shard,
                           ops.zeros(((self.n - 1 - self.rank) * self.rows,) + rest,
                                     shard.dtype)), 0)

    def bprop(self, shard: Any, out: Any, dout: Any) -> tuple[Any]:
        grad = dout
        if self.n > 1:
            grad = ops.narrow(self.shard_sum(dout), 0, self.rank * self.rows, self.rows)
        if self.replicate > 1:
            grad = self.replicate_sum(grad)
        return (grad * self.scale,)


class FullParameter(nn.Cell):
    """The whole value of one sharded parameter from this rank's padded shard (graph mode)."""

    def __init__(self, slot: ParamSlot, plan: UnitPlan, shard_group: str | None, rank: int,
                 replicate_group: str | None) -> None:
        super().__init__()
        self.gather = _GatherRows(shard_group, plan.shard_size, rank, slot.rows_per_rank,
                                  replicate_group, plan.replicate, plan.grad_scale(),
                                  _gather_by_sum(shard_group))
        self.d0 = slot.shape[0]
        self.cut = plan.shard_size * slot.rows_per_rank != self.d0

    def construct(self, shard: Any) -> Any:
        full = self.gather(shard)
        if self.cut:
            full = ops.narrow(full, 0, 0, self.d0)
        return full


def _gather_by_sum(group: str | None) -> bool:
    """MindSpore 2.10's CPU ``AllGather`` runs on the world group only (measured: "AllGather
    only support mccl_world_group on CPU, but got hccl_2_..." on a 2x2 mesh's sub-group), so
    there a sub-group's gather is an all-reduce of zero-padded shards (n times the bytes)."""
    from mindspore.communication import GlobalComm

    return ms.get_context("device_target") == "CPU" and group != GlobalComm.WORLD_COMM_GROUP


@constexpr
def _mp_refused() -> None:
    """Raised at compile time: the policy's casts of inputs and outputs are Python that a
    compiled graph does not run."""
    raise NotImplementedError(
        "fully_shard(..., mp_policy=MixedPrecisionPolicy(...)) on MindSpore runs in PyNative "
        "mode only; a compiled graph (ms.jit / GRAPH_MODE) would skip its casts -- run the step "
        "in PyNative, or drop mp_policy and cast the Cell yourself (Cell.to_float)")


def _reader(attr: str, refused: bool) -> Any:
    if refused:
        def read(self: nn.Cell) -> Any:
            if compiling():
                _mp_refused()
            return self._params[attr]
    else:
        def read(self: nn.Cell) -> Any:
            if compiling():
                return getattr(self, _PREFIX_FULL + attr)(getattr(self, _PREFIX_SHARD + attr))
            return self._params[attr]

    read.__name__ = read.__qualname__ = f"read_{attr}"
    return read


_CLASSES: dict[tuple[type, tuple[str, ...], tuple[str, ...]], type] = {}


def _with_reads(cell: nn.Cell, attrs: tuple[str, ...], refused: bool = False) -> None:
    own = type(cell).__dict__  # a class this module made (not a subclass of one)
    base = own.get("_hp_fsdp_read_base", type(cell))
    old_refused = set(own.get("_hp_fsdp_read_refused", ()))
    refused_attrs = tuple(sorted(old_refused | set(attrs) if refused else old_refused))
    attrs = tuple(sorted(set(attrs) | set(own.get("_hp_fsdp_read_attrs", ()))))
    key = (base, attrs, refused_attrs)
    if key not in _CLASSES:
        body: dict[str, Any] = {a: property(_reader(a, a in refused_attrs)) for a in attrs}
        body.update(_hp_fsdp_read_base=base, _hp_fsdp_read_attrs=attrs,
                    _hp_fsdp_read_refused=refused_attrs)
        # same name (reprs read as before); no __qualname__ / __module__ of the base: with
        # those the compiler did not use the property (measured)
        _CLASSES[key] = type(base.__name__, (base,), body)
    cell.__class__ = _CLASSES[key]


def install_graph_reads(plan: UnitPlan, slots: list[list[tuple[nn.Cell, str]]],
                        shards: list[Any], shard_group: str | None, rank: int,
                        replicate_group: str | None, mp_refused: bool = False) -> None:
    """Make each slot's owner read its sharded parameter whole when a graph is compiled.
    ``shard_group`` / ``replicate_group``: MindSpore's group names (``None`` where the group
    has one rank). ``mp_refused``: the unit has a mixed-precision policy, which a compile
    refuses (:func:`_mp_refused`)."""
    for slot, where, shard in zip(plan.slots, slots, shards, strict=True):
        full = FullParameter(slot, plan, shard_group, rank, replicate_group)
        for owner, attr in where:
            # plain attributes, not child Cells / registered Parameters: the Cell tree, its
            # parameter names and trainable_params() stay as they were
            object.__setattr__(owner, _PREFIX_SHARD + attr, shard)
            object.__setattr__(owner, _PREFIX_FULL + attr, full)
            _with_reads(owner, (attr,), mp_refused)
