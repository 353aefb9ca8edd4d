"""Context parallelism: shard the sequence of every sequence-long tensor over a 1-D mesh and run
``torch.nn.functional.scaled_dot_product_attention`` exactly across the shards.

The API is that of ``torch.distributed.tensor.experimental.context_parallel``::

    with context_parallel(mesh["cp"], buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                          buffer_seq_dims=[1, 1, 0, 0]):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()

Inside the context:

* every tensor of ``buffers`` is replaced *in place* (``resize_`` + ``copy_``) by this rank's
  part of its sequence dimension; no collective is needed, every rank holds the full buffer on
  entry. On exit the buffers get their full contents back, except those in
  ``no_restore_buffers``.
* ``F.scaled_dot_product_attention`` (looked up through the ``torch.nn.functional`` module, as
  models call it) keeps the query chunk of this rank and all-gathers K and V over the cp group
  (torch's "allgather" rotate method; no ring). Under ``is_causal=True`` a query attends to the
  keys whose *global* position is not after its own, so the result is exactly the one-process
  attention. The gather is differentiable: its backward reduce-scatters (sums) dK and dV, so
  every rank's K/V projection receives the gradient of every rank's loss.

Order of the shards (``load_balance``). With causal attention the last positions attend to the
most keys; cutting the sequence into ``cp`` contiguous pieces would leave the last rank with
most of the work. As torch does by default, the sequence is cut into ``2 * cp`` chunks and rank
``r`` keeps chunks ``r`` and ``2*cp - 1 - r`` (head-tail). It is the same order as torch's, so a
shard layout written for torch means the same here. Differences from torch, on purpose: torch
silently falls back to in-order pieces when the length is not a multiple of ``2 * cp``; here
that is an error (a silent change of order would break a restore path written for the balanced
order) -- pass ``load_balance=False`` for contiguous pieces. :func:`context_parallel_unshard`
puts sharded results back in sequence order for either choice.

Gradients. Each rank computes its loss over its own tokens. With a per-rank *mean* (equal
pieces), averaging the parameter gradients over the cp group gives the gradient of the mean over
the whole sequence: treat cp like a data-parallel dimension, ``data_parallel(model, cp_mesh)``
or ``fully_shard(model, mesh=cp_mesh)`` (with dp as well: a group or flattened mesh over dp x
cp, as torchtitan's ``dp_shard_cp``). This module reduces no parameter gradient itself.

Not supported (an error on every rank, before any collective): an ``attn_mask`` tensor,
``dropout_p > 0``, a query whose sequence differs from the key's (cross-attention), nesting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.platform import get_platform

__all__ = ["ContextParallelError", "context_parallel", "context_parallel_unshard"]


class ContextParallelError(ValueError):
    """An argument ``context_parallel`` (or the attention it runs) cannot accept."""


@dataclass(frozen=True)
class _State:
    group: Any
    rank: int
    size: int
    load_balance: bool
    local_len: int | None  # the buffers' local sequence length (None: no buffers given)
    sdpa: Any  # the function the context replaced
    # causal masks by (local length, device): every layer of a step asks for the same one
    masks: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def causal_mask(self, local: int, device: torch.device) -> torch.Tensor:
        """``[local, size * local]`` bool, True where this rank's query may attend the key
        (both at their global positions); built once per length and device."""
        key = (local, str(device))
        if key not in self.masks:
            q_pos = _positions(self.rank, self.size, local, self.load_balance, device)
            k_pos = torch.cat([_positions(r, self.size, local, self.load_balance, device)
                               for r in range(self.size)])
            self.masks[key] = k_pos[None, :] <= q_pos[:, None]
        return self.masks[key]


_ACTIVE: _State | None = None


def _positions(rank: int, size: int, local_len: int, load_balance: bool,
               device: torch.device) -> torch.Tensor:
    """Global sequence positions of the ``local_len`` elements rank ``rank`` holds."""
    if not load_balance:
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    half = local_len // 2
    head = torch.arange(rank * half, (rank + 1) * half, device=device)
    tail_start = (2 * size - 1 - rank) * half
    tail = torch.arange(tail_start, tail_start + half, device=device)
    return torch.cat([head, tail])


def _shard(buffer: torch.Tensor, dim: int, rank: int, size: int,
           load_balance: bool) -> torch.Tensor:
    """This rank's part of ``buffer`` along ``dim`` (a new tensor)."""
    if not load_balance:
        return buffer.chunk(size, dim)[rank].clone()
    chunks = buffer.chunk(2 * size, dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def _mesh_group(mesh: Any, what: str) -> tuple[Any, int, int]:
    ndim = getattr(mesh, "ndim", None)
    if ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        hint = (f"pass the cp dimension alone, e.g. mesh[{names[-1]!r}]" if names
                else "pass a 1-D mesh of the context-parallel ranks")
        raise ContextParallelError(
            f"{what} needs a 1-D DeviceMesh of the context-parallel ranks; got "
            f"{mesh!r} ({ndim}-D): {hint}")
    group = mesh.get_group()
    platform = get_platform()
    return group, platform.rank(group), platform.world_size(group)


def _check_buffers(buffers: Sequence[torch.Tensor], dims: Sequence[int],
                   no_restore: Any, size: int, load_balance: bool) -> list[int]:
    """Validate the buffers; return their sequence dims normalised to be non-negative."""
    if len(buffers) != len(dims):
        raise ContextParallelError(
            f"context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one "
            f"sequence dimension per buffer")
    for extra in no_restore:
        if not any(extra is b for b in buffers):
            raise ContextParallelError(
                "context_parallel: no_restore_buffers holds a tensor that is not in buffers; it "
                "must be a subset of buffers (the same tensor objects)")
    out: list[int] = []
    for i, (buf, dim) in enumerate(zip(buffers, dims, strict=True)):
        if not isinstance(buf, torch.Tensor):
            raise ContextParallelError(
                f"context_parallel: buffers[{i}] is a {type(buf).__name__}, not a tensor")
        if isinstance(buf, torch.nn.Parameter) or buf.requires_grad:
            raise ContextParallelError(
                f"context_parallel: buffers[{i}] is a parameter or requires grad; buffers are "
                f"resized in place, so pass only inputs, labels and position tables (buffers "
                f"of the module), never parameters or tensors autograd tracks")
        if not buf.is_contiguous():
            raise ContextParallelError(
                f"context_parallel: buffers[{i}] (shape {tuple(buf.shape)}) is not contiguous; "
                f"resizing it in place would scramble the tensor it is a view of -- pass a "
                f"contiguous tensor (.contiguous() before the context, and use that one)")
        if not -buf.dim() <= dim < buf.dim():
            raise ContextParallelError(
                f"context_parallel: buffer_seq_dims[{i}] = {dim} is out of range for buffers[{i}]"
                f" of shape {tuple(buf.shape)}; give its sequence dimension in "
                f"[{-buf.dim()}, {buf.dim() - 1}]")
        out.append(dim % buf.dim())
    lengths = [b.shape[d] for b, d in zip(buffers, out, strict=True)]
    for i, length in enumerate(lengths):
        if length != lengths[0]:
            raise ContextParallelError(
                f"context_parallel: buffers[{i}] has {length} positions along dim {out[i]} but "
                f"buffers[0] has {lengths[0]}; every buffer is split into the same positions, "
                f"so slice tables such as RoPE cos/sin to the sequence length first")
    pieces = 2 * size if load_balance else size
    if lengths and lengths[0] % pieces:
        fix = ("pad the sequence to a multiple of "
               f"{pieces}, or pass load_balance=False (then a multiple of {size} is enough)"
               if load_balance else f"pad the sequence to a multiple of {size}")
        why = (f"2 x cp = {pieces} chunks (load-balanced causal order)" if load_balance
               else f"cp = {size} pieces")
        raise ContextParallelError(
            f"context_parallel: sequence length {lengths[0]} is not divisible into {why}; {fix}")
    return out


@contextlib.contextmanager
def context_parallel(mesh: Any, *, buffers: Sequence[torch.Tensor] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None,
                     no_restore_buffers: Any = None,
                     load_balance: bool = True) -> Iterator[None]:
    """Run attention context-parallel over the 1-D ``mesh`` and shard ``buffers`` in place.

    Args:
        mesh: a 1-D :class:`~hyperpar.dtensor.DeviceMesh` of the cp ranks (``mesh["cp"]``).
        buffers: tensors with a sequence dimension (tokens, labels, RoPE tables); each is
            replaced in place by this rank's positions and restored on exit.
        buffer_seq_dims: the sequence dimension of each buffer.
        no_restore_buffers: buffers (a subset, by identity) left sharded on exit.
        load_balance: head-tail order (rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of
            ``2cp``), torch's default; ``False``: contiguous pieces in rank order.

    Raises :class:`ContextParallelError` on every rank, before any collective, for a mesh that
    is not 1-D, mismatched or out-of-range dims, a parameter or non-contiguous buffer, buffers
    of different sequence lengths or a length that does not split evenly, and (at the
    attention call) unsupported arguments.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise ContextParallelError(
            "context_parallel is already active in this process; contexts do not nest -- "
            "exit the first before entering another")
    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    no_restore = list(no_restore_buffers or [])
    group, rank, size = _mesh_group(mesh, "context_parallel")
    dims = _check_buffers(buffers, dims, no_restore, size, load_balance)
    local_len = buffers[0].shape[dims[0]] // size if buffers else None

    originals = [None if any(b is x for x in no_restore) else b.clone() for b in buffers]
    _ACTIVE = _State(group, rank, size, load_balance, local_len, F.scaled_dot_product_attention)
    F.scaled_dot_product_attention = _context_parallel_sdpa
    try:
        with torch.no_grad():
            for buf, dim in zip(buffers, dims, strict=True):
                shard = _shard(buf, dim, rank, size, load_balance)
                buf.resize_(shard.shape)
                buf.copy_(shard)
        yield
    finally:
        F.scaled_dot_product_attention = _ACTIVE.sdpa
        _ACTIVE = None
        with torch.no_grad():
            for buf, original in zip(buffers, originals, strict=True):
                if original is not None:
                    buf.resize_(original.shape)
                    buf.copy_(original)


def _context_parallel_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                           is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` on ``[..., seq_local, head_dim]`` shards: K and V
    gathered over the cp group, the causal mask at global positions."""
    state = _ACTIVE
    if state is None:  # a reference kept past the context: refuse rather than mis-shard
        raise ContextParallelError(
            "the context-parallel attention was called outside context_parallel; call "
            "F.scaled_dot_product_attention again after the context exits")
    _check_attention(state, query, key, value, attn_mask, dropout_p)
    platform = get_platform()
    seq_dim = key.dim() - 2
    key = platform.all_gather_autograd(key, seq_dim, state.group)
    value = platform.all_gather_autograd(value, seq_dim, state.group)
    mask = state.causal_mask(query.shape[-2], query.device) if is_causal else None
    extra = {"enable_gqa": True} if enable_gqa else {}
    return state.sdpa(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                      scale=scale, **extra)


def _check_attention(state: _State, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attn_mask: Any, dropout_p: float) -> None:
    where = "scaled_dot_product_attention under context_parallel"
    if attn_mask is not None:
        raise ContextParallelError(
            f"{where}: an attn_mask tensor is not supported (it would have to be sharded to "
            f"the query rows and gathered key columns); use is_causal=True, or run this "
            f"attention outside the context")
    if dropout_p:
        raise ContextParallelError(
            f"{where}: dropout_p = {dropout_p} is not supported; pass dropout_p=0.0 (e.g. "
            f"put the model in eval mode or set its attention dropout to 0)")
    if query.dim() < 2 or key.shape[-2] != query.shape[-2] or value.shape[-2] != key.shape[-2]:
        raise ContextParallelError(
            f"{where}: query, key and value must be this rank's shards of one sequence "
            f"(self-attention, [..., seq, head_dim]); got seq lengths {query.shape[-2]}, "
            f"{key.shape[-2]}, {value.shape[-2]}")
    local = query.shape[-2]
    if state.local_len is not None and local != state.local_len:
        raise ContextParallelError(
            f"{where}: the query has {local} positions but the buffers were sharded to "
            f"{state.local_len} per rank; pass every sequence-long input (tokens, position "
            f"tables) through buffers= so the model sees this rank's shard")
    if state.load_balance and local % 2:
        raise ContextParallelError(
            f"{where}: {local} local positions cannot be the two head-tail chunks of the "
            f"load-balanced order; use an even local length or load_balance=False")


def context_parallel_unshard(mesh: Any, buffers: Sequence[torch.Tensor],
                             seq_dims: Sequence[int], *,
                             load_balance: bool = True) -> list[torch.Tensor]:
    """Gather tensors sharded by :func:`context_parallel` (outputs, logits) along their sequence
    dims over ``mesh`` and put them back in sequence order. Not differentiable (as torch's).

    ``load_balance`` must match the one the tensors were sharded with.
    """
    group, rank, size = _mesh_group(mesh, "context_parallel_unshard")
    if len(buffers) != len(seq_dims):
        raise ContextParallelError(
            f"context_parallel_unshard: {len(buffers)} tensors but {len(seq_dims)} seq_dims")
    platform = get_platform()
    out = []
    with torch.no_grad():
        for i, (buf, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
            if not -buf.dim() <= dim < buf.dim():
                raise ContextParallelError(
                    f"context_parallel_unshard: seq_dims[{i}] = {dim} is out of range for a "
                    f"tensor of shape {tuple(buf.shape)}")
            dim %= buf.dim()
            local = buf.shape[dim]
            if load_balance and local % 2:
                raise ContextParallelError(
                    f"context_parallel_unshard: tensor {i} has {local} positions along dim "
                    f"{dim}, odd, so it was not sharded in head-tail order; pass "
                    f"load_balance=False if it was sharded with it")
            full = platform.all_gather_along(buf.detach(), dim, group)
            if load_balance:
                pos = torch.cat([_positions(r, size, local, True, buf.device)
                                 for r in range(size)])
                full = full.index_select(dim, torch.argsort(pos))
            out.append(full)
    return out
