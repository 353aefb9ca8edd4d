"""Tensor-parallel boundaries: the DTensor redistribution plan on a 1-D mesh, run on *local*
tensors with the backward choices of tensor parallelism.

Which collective a boundary issues is decided by the one planner,
:func:`hyperpar.torch.dtensor.redistribute.plan_redistribute` (a 1-D plan has one or two steps);
the collectives along a dimension are the platform's
(:class:`~hyperpar.platform.dim_collectives.DimCollectives`), uneven pieces included. This
module only adds what a per-op DTensor does not know: each step's backward, chosen for tensor
parallelism, which is not always the adjoint of the forward:

=====================================  ==========================  ============================
step / primitive                       forward                     backward
=====================================  ==========================  ============================
:func:`copy_to_region` (Megatron f)    identity                    all-reduce (grads are partial)
``allreduce`` (Megatron g)             all-reduce (in place)       identity (grad is replicated)
``gather``                             all-gather along ``dim``    keep this rank's piece
``chunk``                              keep this rank's piece      all-gather along ``dim``
``reduce_scatter``                     reduce-scatter              all-gather
``all_to_all``                         all-to-all                  all-to-all, dims swapped
:func:`to_replicated_input`            all-gather (Shard input)    reduce-scatter (partial grads)
=====================================  ==========================  ============================

Pieces follow ``torch.chunk`` (like DTensor's ``Shard``). A boundary that gathers a plain
tensor declared ``Shard(d)`` does not know the other ranks' lengths: it exchanges them first
(one small all-gather) and raises on every rank if they are not a ``torch.chunk`` split.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from hyperpar.dtensor.layout import check_chunk_split
from hyperpar.dtensor.placement import Placement, Shard, chunk_bounds
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor.redistribute import plan_redistribute

Group = Any
Mesh = Any  # a 1-D hyperpar DeviceMesh


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@functools.lru_cache(maxsize=1024)
def _sizes(full: int, n: int) -> tuple[int, ...]:
    return tuple(chunk_bounds(full, n, k)[1] for k in range(n))


@functools.lru_cache(maxsize=64)
def _mesh_info(mesh: Mesh) -> tuple[Group, int, int]:
    """``(group, size, this rank's index)`` of a 1-D mesh, resolved once."""
    return mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0)


def full_length(local: torch.Tensor, dim: int, mesh: Mesh) -> int:
    """Global length along ``dim`` of a plain local piece laid out as ``Shard(dim)`` on the 1-D
    ``mesh``: the pieces' lengths are exchanged (one small all-gather) and must be a
    ``torch.chunk`` split, else every rank raises the same error."""
    n = mesh.size(0)
    if n == 1:
        return local.shape[dim]
    if torch.compiler.is_compiling():
        return _even_full_length_checked(local, dim, n, mesh)
    lengths = get_platform().all_gather_sizes(local.shape[dim], mesh.get_group(0))
    return check_chunk_split(lengths, dim, "tensor-parallel boundary")


def _even_full_length_checked(local: torch.Tensor, dim: int, n: int, mesh: Mesh) -> int:
    """:func:`full_length` inside ``torch.compile``: an int read out of a collective would be
    a graph break, so the pieces are taken to be even (as torch does) and the graph checks it
    -- the lengths are still exchanged, and every rank raises if they differ."""
    mine = local.shape[dim]
    lengths = get_platform().all_gather_along(
        torch.full((1,), mine, dtype=torch.int64, device=local.device), 0, mesh.get_group(0))
    torch._assert_async(
        torch.all(lengths == mine),
        f"tensor-parallel boundary under torch.compile: the local pieces laid out as "
        f"Shard({dim}) differ in length across the {n} ranks; a compiled region needs even "
        f"pieces: keep that dim divisible by the mesh size or pass a DTensor")
    return mine * n


def _piece(x: torch.Tensor, dim: int, sizes: tuple[int, ...], index: int) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:index]), sizes[index]).contiguous()


# --------------------------------------------------------------------- autograd functions
class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        get_platform().all_reduce(out, "sum", ctx.group)
        return out, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        # Compiled: out of place (a graph gains nothing from reducing in place, and Dynamo 2.6
        # refuses x.is_contiguous() inside an autograd.Function: "Illegal getattr invocation")
        if (torch.compiler.is_compiling() or x.is_leaf or x._base is not None
                or not x.is_contiguous()):
            out = x.contiguous().clone()
            get_platform().all_reduce(out, op, group)
            return out
        # A fresh module output (a matmul's result): reduce in place, as Megatron does. Marked
        # dirty, so if anything had saved it for backward autograd raises instead of using it.
        get_platform().all_reduce(x, op, group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's piece of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, dim, sizes, index, group):
        ctx.args = (dim, sizes, index)
        return get_platform().all_gather_along(x, dim, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        return _piece(grad, *ctx.args), None, None, None, None


class _GatherPartialGrad(torch.autograd.Function):
    """All-gather forward; backward reduce-scatters the (partial) gradient to the piece."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.args = (dim, sizes, group)
        return get_platform().all_gather_along(x, dim, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        out = get_platform().reduce_scatter_along(grad.contiguous(), dim, "sum", group,
                                                  sizes=sizes)
        return out, None, None, None


class _RegatheredView(torch.autograd.Function):
    """The already all-gathered ``gathered`` (no communication), differentiated w.r.t. the
    ``shard`` it came from: backward reduce-scatters the (partial) gradient to the shard."""

    @staticmethod
    def forward(ctx, shard, gathered, dim, sizes, group):
        ctx.args = (dim, sizes, group)
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        out = get_platform().reduce_scatter_along(grad.contiguous(), dim, "sum", group,
                                                  sizes=sizes)
        return out, None, None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, index, group):
        sizes = _sizes(x.shape[dim], get_platform().world_size(group))
        ctx.args = (dim, sizes, group)
        return _piece(x, dim, sizes, index)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        return get_platform().all_gather_along(grad, dim, group, sizes=sizes), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, op, group):
        sizes = _sizes(x.shape[dim], get_platform().world_size(group))
        ctx.args = (dim, sizes, group)
        return get_platform().reduce_scatter_along(x, dim, op, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        return get_platform().all_gather_along(grad, dim, group, sizes=sizes), None, None, None


class _AllToAll(torch.autograd.Function):
    """Shard(concat) -> Shard(split); backward is the same exchange the other way round."""

    @staticmethod
    def forward(ctx, x, split, concat, concat_sizes, group):
        split_sizes = _sizes(x.shape[split], len(concat_sizes))
        ctx.args = (split, concat, split_sizes, concat_sizes, group)
        return get_platform().all_to_all_along(x, split, concat, group, split_sizes=split_sizes,
                                               concat_sizes=concat_sizes)

    @staticmethod
    def backward(ctx, grad):
        split, concat, split_sizes, concat_sizes, group = ctx.args
        out = get_platform().all_to_all_along(grad, concat, split, group,
                                              split_sizes=concat_sizes, concat_sizes=split_sizes)
        return out, None, None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, index):
        return torch.zeros_like(x) if op == "sum" and index != 0 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


# --------------------------------------------------------------------- primitives
def copy_to_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's *f*: identity forward, all-reduce (sum) of the gradient backward."""
    return x if get_platform().world_size(group) == 1 else _Copy.apply(x, group)


# gathered output id -> (weak ref to it, the shard it came from, dim, sizes, group). Kept beside
# the tensor, not on it: an attribute would make user-visible outputs unpicklable (a process
# group) and would travel with the tensor into user code.
_GATHERED_FROM: dict[int, tuple[weakref.ref, torch.Tensor, int, tuple[int, ...], Group]] = {}


def _remember_gather(out: torch.Tensor, shard: torch.Tensor, dim: int,
                     sizes: tuple[int, ...], group: Group) -> None:
    key = id(out)
    _GATHERED_FROM[key] = (weakref.ref(out), shard, dim, sizes, group)
    weakref.finalize(out, _GATHERED_FROM.pop, key, None)


def _gathered_origin(x: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, ...], Group] | None:
    if torch.compiler.is_compiling():  # ids and weak refs of traced tensors mean nothing
        return None
    entry = _GATHERED_FROM.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2], entry[3], entry[4]


# --------------------------------------------------------------------- the boundary
def _resolve(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim + ndim) if type(p) is Shard and p.dim < 0 else p


@functools.lru_cache(maxsize=512)
def _steps(src: Placement, dst: Placement, ndim: int, mesh: Mesh) -> tuple[tuple, ...]:
    """The redistribution plan ``src -> dst`` on the 1-D ``mesh``, with what running it needs
    (``(kind, arg1, arg2, group, mesh size, this rank's index)`` per step); cached, so a
    model's boundaries resolve once. 1-D plans do not depend on the tensor's shape."""
    s, d = _resolve(src, ndim), _resolve(dst, ndim)
    group, n, index = _mesh_info(mesh)
    return tuple((kind, a, b, group, n, index)
                 for kind, _, _, a, b in plan_redistribute(mesh, (s,), (d,), ()))


def needs_full_length(src: Placement, dst: Placement, ndim: int, mesh: Mesh) -> bool:
    """Whether ``src -> dst`` must know the other ranks' lengths along ``src``'s shard dim."""
    return any(step[0] in ("gather", "all_to_all") for step in _steps(src, dst, ndim, mesh))


def redistribute_boundary(x: torch.Tensor, src: Placement, dst: Placement, mesh: Mesh, *,
                          full: int | None = None, tag_gather: bool = True) -> torch.Tensor:
    """Re-lay out ``x``, this rank's piece under ``src``, as ``dst`` on the 1-D ``mesh`` (the
    DTensor plan, the tensor-parallel backward). Differentiable.

    ``full`` is the global length along ``src``'s shard dim when the caller knows it (a
    DTensor's shape, a weight's size); otherwise a gather exchanges the lengths first.
    """
    steps = _steps(src, dst, x.dim(), mesh)
    for kind, a, b, group, n, index in steps:
        if kind == "gather":
            if full is None:
                full = full_length(x, a, mesh)
            sizes = _sizes(full, n)
            shard, x = x, _Gather.apply(x, a, sizes, index, group)
            if tag_gather and not torch.compiler.is_compiling():
                # Let a column-parallel consumer route its (partial) gradient straight back to
                # the shard with one reduce-scatter instead of all-reduce + slice.
                _remember_gather(x, shard, a, sizes, group)
        elif kind == "allreduce":
            x = _Reduce.apply(x, a, group)
        elif kind == "chunk":
            x = _Chunk.apply(x, a, index, group)
        elif kind == "reduce_scatter":
            x = _ReduceScatter.apply(x, a, b, group)
        elif kind == "all_to_all":
            if full is None:
                full = full_length(x, a, mesh)
            x = _AllToAll.apply(x, b, a, _sizes(full, n), group)
        elif kind == "to_partial":
            x = _ToPartial.apply(x, a, index)
        else:  # pragma: no cover
            raise AssertionError(kind)
    return x


def gather_ids(x: torch.Tensor, src: Placement, mesh: Mesh, full: int | None = None
               ) -> torch.Tensor:
    """Token ids (no gradient) laid out as ``src`` made replicated."""
    if type(src) is not Shard or mesh.size(0) == 1:
        return x
    dim = _norm_dim(src.dim, x.dim())
    if full is None:
        full = full_length(x, dim, mesh)
    return get_platform().all_gather_along(x, dim, mesh.get_group(0),
                                           sizes=_sizes(full, mesh.size(0)))


class _LastInputMemo:
    """Remembers the last (input, layout) -> prepared-input conversion per process group, so
    sibling projections fed the same tensor (q/k/v, w1/w3) share one boundary collective: one
    all-reduce of the summed gradient instead of one per projection (as Megatron does)."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[Any, Any, torch.Tensor]] = {}

    def get(self, key: Any, x: Any, layout: Any) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            # A graph cannot hold weak refs to its tensors: compiled, each sibling converts
            # its input itself (one gradient all-reduce per projection instead of one).
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        ref, entry_layout, out = entry
        if ref() is x and entry_layout == layout and torch.is_grad_enabled() == out.requires_grad:
            return out
        return None

    def put(self, key: Any, x: Any, layout: Any, out: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            return
        try:
            ref = weakref.ref(x)
        except TypeError:
            return
        self._entries[key] = (ref, layout, out)

    def clear(self) -> None:
        self._entries.clear()


_MEMO = _LastInputMemo()


def to_replicated_input(x: torch.Tensor, src: Placement, mesh: Mesh, *,
                        full: int | None = None) -> torch.Tensor:
    """Prepare the input of a column-parallel matmul: replicate ``x`` (laid out as ``src``)
    knowing that the gradient coming back is *partial* (each rank saw only its columns).

    ``Replicate`` -> Megatron's f (all-reduce in backward); ``Shard(i)`` -> all-gather forward,
    reduce-scatter backward (uneven pieces included; ``full`` as in
    :func:`redistribute_boundary`); ``Partial`` -> all-reduce, then f.
    """
    group, n, _ = _mesh_info(mesh)
    if n == 1:
        return x
    if type(src) is Shard:
        dim = _norm_dim(src.dim, x.dim())
        if full is None:
            full = full_length(x, dim, mesh)
        return _GatherPartialGrad.apply(x, dim, _sizes(full, n), group)
    if src.is_replicate():
        origin = _gathered_origin(x)
        if origin is not None and origin[3] == group:
            shard, dim, sizes, _ = origin
            return _RegatheredView.apply(shard, x.detach(), dim, sizes, group)
        return _Copy.apply(x, group)
    if src.is_partial():
        # reduce now; the replicated value then feeds a column-parallel matmul (partial grads)
        return _Copy.apply(_Reduce.apply(x, src.reduce_op, group), group)
    raise NotImplementedError(f"column-parallel input laid out as {src!r} is not supported")


# --------------------------------------------------------------------- save the shard
# Megatron's sequence-parallel trick (Korthikanti et al. 2022, sec. 4.2.2): a column-parallel
# linear fed an all-gathered input keeps only this rank's *shard* for backward and all-gathers
# it again there, for the weight gradient. Done with saved-tensor hooks around the consumer's
# forward: autograd's own linear (the same kernels, in the same order) saves what it always
# saves, except that a tensor living in the gathered input's storage is swapped for a handle to
# the shard -- so values and gradients are bit for bit those of the keep-gathered path.

# A gather in backward: the shard and what re-gathering it needs (dim, torch.chunk sizes, group)
Origin = tuple[torch.Tensor, int, tuple[int, ...], Group]


class _Regather:
    """The gathered input of one boundary, saved as its shard. Every consumer of that input
    (q, k, v) saves through the same token, so backward gathers once: the first unpack
    gathers, the rest reuse it, and the last one lets it go."""

    __slots__ = ("shard", "version", "dim", "sizes", "group", "ptr", "base", "packs",
                 "unpacks", "full", "__weakref__")

    def __init__(self, gathered: torch.Tensor, origin: Origin) -> None:
        self.shard, self.dim, self.sizes, self.group = origin
        self.version = self.shard._version
        self.ptr = gathered.untyped_storage().data_ptr()
        self.base = gathered.storage_offset()
        self.packs = self.unpacks = 0
        self.full: torch.Tensor | None = None

    def pack(self, t: torch.Tensor, outer: tuple | None = None) -> Any:
        try:
            mine = t.untyped_storage().data_ptr() == self.ptr and t.device == self.shard.device
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
            mine = False
        if not mine:
            return t if outer is None else _Outer(outer[0](t), outer[1])
        if outer is not None and self.packs == 0:
            outer[0](self.shard)  # a transparent (counting) hook outside sees what is kept
        self.packs += 1
        return _SavedShard(self, tuple(t.shape), t.stride(), t.storage_offset() - self.base,
                           t.dtype)

    def gathered(self) -> torch.Tensor:
        if self.shard._version != self.version:
            # autograd refuses a saved tensor changed in place; so do we (never a silent
            # gradient from the new values)
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: the sequence shard a column-parallel linear saved (to "
                "all-gather it again in backward) changed after forward; do not modify a "
                "sequence-parallel activation in place, or pass reshard_input_after_forward="
                "False to keep the gathered input instead")
        if self.full is None:
            with torch.no_grad():
                self.full = get_platform().all_gather_along(self.shard, self.dim, self.group,
                                                            sizes=self.sizes)
        full = self.full
        self.unpacks += 1
        if self.unpacks >= self.packs:  # every consumer has it: free it (a retained graph
            self.full, self.unpacks = None, 0  # gathers again in its next backward)
        return full


class _SavedShard:
    __slots__ = ("token", "shape", "stride", "offset", "dtype")

    def __init__(self, token: _Regather, shape: tuple[int, ...], stride: tuple[int, ...],
                 offset: int, dtype: torch.dtype) -> None:
        self.token, self.shape, self.stride, self.offset = token, shape, stride, offset
        self.dtype = dtype

    def unpack(self) -> torch.Tensor:
        full = self.token.gathered()
        view = full if full.dtype == self.dtype else full.view(self.dtype)
        return view.as_strided(self.shape, self.stride, full.storage_offset() + self.offset)


class _Outer:
    """A tensor packed by a transparent hook outside ours (unpacked by it too)."""

    __slots__ = ("packed", "unpack_fn")

    def __init__(self, packed: Any, unpack_fn: Any) -> None:
        self.packed, self.unpack_fn = packed, unpack_fn


def _unpack(saved: Any) -> Any:
    kind = type(saved)
    if kind is _SavedShard:
        return saved.unpack()
    if kind is _Outer:
        return saved.unpack_fn(saved.packed)
    return saved


# gathered tensor id -> (weak ref to it, its token): the siblings fed one gathered input share
# one token (one gather in backward)
_TOKENS: dict[int, tuple[weakref.ref, _Regather]] = {}


def _token(gathered: torch.Tensor, origin: Origin | None) -> _Regather | None:
    entry = _TOKENS.get(id(gathered))
    if entry is not None and entry[0]() is gathered:
        return entry[1]
    if origin is None:
        return None
    token = _Regather(gathered, origin)
    key = id(gathered)
    _TOKENS[key] = (weakref.ref(gathered), token)
    weakref.finalize(gathered, _TOKENS.pop, key, None)
    return token


# The active saved-tensor hooks, or None on a torch without the accessor (2.6).
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def reshard_scope(gathered: torch.Tensor, origin: Origin | None) -> Any:
    """An entered saved-tensor-hooks context that saves ``gathered`` (the all-gathered input of
    a column-parallel linear, gathered from ``origin``'s shard) as that shard, to be exited
    after the consumer's forward; ``None`` where the keep-gathered path runs instead:

    * no autograd graph is recorded (no grad);
    * another saved-tensor hook is active -- activation checkpointing (it frees and recomputes
      the region itself: saving the shard too would all-gather twice) or offloading -- unless
      it is marked ``transparent`` (it only looks, :class:`~hyperpar.torch.parallel.memory
      .SavedBytes`: then it is chained);
    * the forward runs inside a backward (a reentrant checkpoint's recompute: its backward
      follows at once);
    * under ``torch.compile`` (AOTAutograd's partitioner chooses what a graph saves);
    * on a torch that cannot report the active saved-tensor hook (2.6 has no
      ``_top_saved_tensors_default_hooks``): an inner hook there could hide a tensor from an
      enclosing checkpoint's, so the gathered input is kept -- the same values, torch's memory.
    """
    if (_TOP_HOOKS is None or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or torch._C._current_autograd_node() is not None):
        return None
    outer = _TOP_HOOKS(False)
    if outer is not None and not getattr(getattr(outer[0], "__self__", None), "transparent",
                                         False):
        return None
    token = _token(gathered, origin)
    if token is None:
        return None
    pack = token.pack if outer is None else functools.partial(token.pack, outer=outer)
    scope = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
    scope.__enter__()
    return scope


def prepare_column_input(x: torch.Tensor, src: Placement, mesh: Mesh, *,
                         full: int | None = None) -> tuple[torch.Tensor, Origin | None]:
    """:func:`to_replicated_input`, and where the result was all-gathered from a shard (here,
    or by an earlier boundary), that shard with its dim, sizes and group (else ``None``)."""
    group, n, _ = _mesh_info(mesh)
    out = to_replicated_input(x, src, mesh, full=full)
    if n == 1 or out is x:
        return out, None
    if type(src) is Shard:
        dim = _norm_dim(src.dim, x.dim())
        return out, (x, dim, _sizes(out.shape[dim], n), group)
    if src.is_replicate():
        origin = _gathered_origin(x)
        if origin is not None and origin[3] == group:
            return out, origin
    return out, None
