"""Graph mode (``ms.jit``, ``GRAPH_MODE``) for the tensor-parallel styles.

A Cell with forward hooks runs them from ``Cell.__call__`` in PyNative mode, but when MindSpore
*compiles* a call of it (``ms.jit`` or ``GRAPH_MODE``) the parser compiles the Cell's
``_jit_forward_pre_hook`` / ``_jit_forward_hook`` methods instead (``mindspore/nn/cell.py``).
hyperpar's PyNative hooks are Python (the Platform's ``mint.distributed`` calls, in-place
collectives, parameter swaps, DTensors) that a graph cannot hold. So each parallelized Cell's
class is swapped (like torch's FSDP2 does, names and parameters unchanged) for a subclass whose
two ``_jit_*`` methods run graph-compilable boundaries instead:

* :class:`GraphBoundary` -- a Cell with a custom ``bprop``: forward op in ``construct``, backward
  op on the gradient, each one of :class:`AllReduce` / :class:`GatherAlong` / :class:`PieceAlong`
  / identity, built at ``parallelize_module`` time on MindSpore's communication primitives
  (``ops.AllReduce`` / ``ops.AllGather`` with the group's name) with constant shapes and ranks.
* a row-wise linear's bias: the compiled ``construct`` adds it on every rank, so the boundary
  reduces ``output - bias`` and adds the bias once after it (no parameter swap).

PyNative behaviour is untouched: those methods are only read by the graph compiler. What the graph
path does not cover (DTensor outputs, uneven gathers, row-wise embeddings, sequence parallelism)
installs a method that raises ``NotImplementedError`` (a graph may raise only Python's own
exception types) at compile time, naming the style, the Cell and the reason, on every rank before
any collective runs. Other forward hooks a user registered on such a
Cell still run in the graph, after hyperpar's boundary.
"""

from __future__ import annotations

from typing import Any

from mindspore import nn, ops

from hyperpar.parallel.spec import Comm

__all__ = ["AllReduce", "GatherAlong", "GraphBoundary", "PieceAlong", "graph_boundary",
           "install_graph_hooks", "refuse_graph_mode"]


class _Identity(nn.Cell):
    def construct(self, x: Any) -> Any:
        return x


class AllReduce(nn.Cell):
    """The sum over the group (``ops.AllReduce`` on the group's name)."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.op = ops.AllReduce(ops.ReduceOp.SUM, group_name)

    def construct(self, x: Any) -> Any:
        return self.op(x)


class GatherAlong(nn.Cell):
    """Every rank's (equal) piece concatenated along ``dim`` in rank order. ``ops.AllGather``
    stacks along dim 0: its ``n`` blocks are split off and concatenated along ``dim``."""

    def __init__(self, group_name: str, dim: int, n: int) -> None:
        super().__init__()
        self.op = ops.AllGather(group_name)
        self.dim, self.n = dim, n

    def construct(self, x: Any) -> Any:
        gathered = self.op(x)
        if self.dim == 0:
            return gathered
        return ops.cat(ops.chunk(gathered, self.n, 0), self.dim)


class PieceAlong(nn.Cell):
    """This rank's piece along ``dim`` (no communication). The length comes from the compiled
    shape; an uneven split is refused when the graph is compiled."""

    def __init__(self, dim: int, n: int, rank: int) -> None:
        super().__init__()
        self.dim, self.n, self.rank = dim, n, rank

    def construct(self, x: Any) -> Any:
        size = x.shape[self.dim]
        if size % self.n != 0:
            raise ValueError("hyperpar graph mode: a tensor-parallel boundary keeps this rank's "
                             "piece of a dim not divisible by the group size; uneven pieces run "
                             "in PyNative mode only")
        length = size // self.n
        return ops.narrow(x, self.dim, self.rank * length, length)


class GraphBoundary(nn.Cell):
    """``fwd`` in ``construct``, ``bwd`` on the gradient in ``bprop`` (graph-compilable)."""

    def __init__(self, fwd: nn.Cell, bwd: nn.Cell) -> None:
        super().__init__()
        self.fwd, self.bwd = fwd, bwd

    def construct(self, x: Any) -> Any:
        return self.fwd(x)

    def bprop(self, x: Any, out: Any, dout: Any) -> tuple[Any]:
        return (self.bwd(dout),)


class _ReduceScatter(nn.Cell):
    # ops.ReduceScatter has no CPU kernel ("Kernel select failed", measured): all-reduce, then
    # this rank's piece, as the PyNative path composes it.
    def __init__(self, group_name: str, dim: int, n: int, rank: int) -> None:
        super().__init__()
        self.reduce, self.piece = AllReduce(group_name), PieceAlong(dim, n, rank)

    def construct(self, x: Any) -> Any:
        return self.piece(self.reduce(x))


def _op(op: str, comm: Comm, group_name: str | None, n: int, rank: int,
        size: int | None, backward: bool) -> nn.Cell:
    """One boundary op as a graph Cell; raises ``ValueError`` (the reason) where the graph path
    has none. ``size``: the global length along ``comm.dim`` where the weight tells it."""
    if op == "none" or n == 1:
        return _Identity()
    if group_name is None:
        raise ValueError("this rank is not a member of the group")
    if op == "all_reduce":
        return AllReduce(group_name)
    if op in ("all_gather", "chunk", "reduce_scatter"):
        if size is not None and size % n:
            raise ValueError(f"{op} along dim {comm.dim} of length {size} over {n} ranks is "
                             f"uneven; uneven pieces run in PyNative mode only")
        if op == "all_gather":
            return GatherAlong(group_name, comm.dim, n)
        if op == "chunk":
            return PieceAlong(comm.dim, n, rank)
        return _ReduceScatter(group_name, comm.dim, n, rank)
    raise ValueError(f"the {'backward' if backward else 'forward'} op {op!r} has no graph-mode "
                     f"implementation")


def graph_boundary(comm: Comm, group_name: str | None, n: int, rank: int,
                   size: int | None = None) -> GraphBoundary:
    """The graph-mode Cell for ``comm`` (raises ``ValueError`` with the reason where none)."""
    return GraphBoundary(_op(comm.forward, comm, group_name, n, rank, size, False),
                         _op(comm.backward, comm, group_name, n, rank, size, True))


# ---------------------------------------------------------------------- the swapped classes
# Each _jit_* method first runs hyperpar's boundary, then the forward hooks hyperpar did not
# register (kept in registration order), as MindSpore's own _jit_* methods would.

class _GraphPre:
    def _jit_forward_pre_hook(self, inputs: tuple) -> tuple:
        inputs = (self._hp_graph_in(inputs[0]),) + inputs[1:]
        for hook_id, fn in self._forward_pre_hook.items():
            if hook_id not in self._hp_hook_ids:
                ret = fn(self, inputs)
                if ret is not None:
                    inputs = ret if isinstance(ret, tuple) else (ret,)
        return inputs


class _GraphPost:
    def _jit_forward_hook(self, inputs: tuple, output: Any) -> Any:
        output = self._hp_graph_out(output)
        for hook_id, fn in self._forward_hook.items():
            if hook_id not in self._hp_hook_ids:
                ret = fn(self, inputs, output)
                if ret is not None:
                    output = ret
        return output


class _GraphPostBias:
    """Row-wise linear with a bias: reduce ``output - bias``, then add the bias once (through
    ``_hp_graph_bias``: identity, or all-reduced gradient; ``_hp_bias_share``: 1 or, for a
    Partial output, 1 on rank 0 only)."""

    def _jit_forward_hook(self, inputs: tuple, output: Any) -> Any:
        bias = self.bias
        output = self._hp_graph_out(output - bias) + self._hp_graph_bias(bias) * \
            self._hp_bias_share
        for hook_id, fn in self._forward_hook.items():
            if hook_id not in self._hp_hook_ids:
                ret = fn(self, inputs, output)
                if ret is not None:
                    output = ret
        return output


class _GraphRefuse:
    def _jit_forward_pre_hook(self, inputs: tuple) -> tuple:
        raise NotImplementedError(self._hp_graph_refusal)

    def _jit_forward_hook(self, inputs: tuple, output: Any) -> Any:
        raise NotImplementedError(self._hp_graph_refusal)


_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}


def _swap_class(cell: nn.Cell, mixins: tuple[type, ...]) -> None:
    base = getattr(type(cell), "_hp_graph_base", type(cell))
    key = (base, mixins)
    if key not in _CLASSES:
        # same name as the Cell's class: errors and reprs read as before
        _CLASSES[key] = type(base.__name__, (*mixins, base),
                             {"_hp_graph_base": base, "__qualname__": base.__qualname__,
                              "__module__": base.__module__})
    cell.__class__ = _CLASSES[key]


def _hook_ids(handles: list[Any]) -> tuple[int, ...]:
    return tuple(h.handle_id for h in handles if h is not None)


def install_graph_hooks(cell: nn.Cell, handles: list[Any], pre: GraphBoundary | None,
                        post: GraphBoundary | None, bias: GraphBoundary | None = None,
                        bias_share: float = 1.0) -> None:
    """Give ``cell`` graph-mode boundaries: ``pre`` on its first input, ``post`` on its output
    (``None``: nothing), with ``bias``: a row-wise linear's bias added after ``post``.
    ``handles``: hyperpar's PyNative hooks on ``cell``, which the graph path replaces (both
    ``_jit_*`` methods are overridden, so none of them is ever compiled). A Cell another style
    refused graph mode for stays refused."""
    if getattr(cell, "_hp_graph_refusal", None) is not None:
        return
    # Plain attributes (object.__setattr__), not child Cells: the Cell tree and its names stay
    # as they were; the graph compiler resolves them as attributes.
    object.__setattr__(cell, "_hp_hook_ids", _hook_ids(handles))
    object.__setattr__(cell, "_hp_graph_in", pre if pre is not None else _Identity())
    object.__setattr__(cell, "_hp_graph_out", post if post is not None else _Identity())
    if bias is not None:
        object.__setattr__(cell, "_hp_graph_bias", bias)
        object.__setattr__(cell, "_hp_bias_share", float(bias_share))
        _swap_class(cell, (_GraphPre, _GraphPostBias))
    else:
        _swap_class(cell, (_GraphPre, _GraphPost))


def refuse_graph_mode(cell: nn.Cell, what: str, reason: str) -> None:
    """Make a compile of ``cell`` (``ms.jit`` / ``GRAPH_MODE``) raise, naming ``what`` and
    ``reason``; PyNative is unaffected."""
    object.__setattr__(cell, "_hp_graph_refusal", (
        f"{what}: {reason}; under ms.jit / GRAPH_MODE hyperpar runs ColwiseParallel and "
        f"RowwiseParallel on linear layers (and ColwiseParallel on embeddings) with the default "
        f"use_local_output=True and even splits; run this plan in PyNative mode "
        f"(ms.set_context(mode=ms.PYNATIVE_MODE), no ms.jit around the parallelized Cell)"))
    _swap_class(cell, (_GraphRefuse,))
