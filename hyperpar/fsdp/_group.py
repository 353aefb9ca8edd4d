"""The parameters of one ``fully_shard``-ed module, gathered and reduced as one flat buffer.

One all-gather brings every rank's shards of the group's parameters (each rank's flat shard is
the concatenation of its padded per-parameter pieces); one reduce-scatter (plus, under HSDP,
one all-reduce across replicas) returns each rank its piece of the averaged gradients; the
reduction uses the gradient buckets of :mod:`hyperpar.parallel._bucket`, shared with the
replicated data_parallel. Both collectives run asynchronously through the Platform, so a
prefetched gather overlaps the previous block's compute and a reduce-scatter overlaps the next
block's backward.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.parallel._bucket import Bucket, averaging, pack
from hyperpar.platform import get_platform

from ._param import ShardedParam, _free
from .policy import MixedPrecisionPolicy

SHARDED, GATHERING, UNSHARDED = "sharded", "gathering", "unsharded"


class ParamGroup:
    """Sharded/unsharded state machine of one fully_shard module's parameters."""

    def __init__(self, params: list[ShardedParam], *, shard_group: Any, replicate_group: Any,
                 mp: MixedPrecisionPolicy, reshard_after_forward: bool | None, offload: bool,
                 device: torch.device, label: str) -> None:
        self.params = params
        self.label = label
        self.platform = get_platform()
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_size = self.platform.world_size(shard_group)
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward  # None: all but the root
        self.modules: list[Any] = []  # the fully_shard-ed module(s) of this group
        self.forward_count = 0  # modules of a list group that ran forward this time
        self.unshard_in_backward = True
        self.offload = offload
        self.device = device
        dtypes = {p.unsharded_dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"fully_shard({label}): its parameters have different dtypes "
                f"{sorted(map(str, dtypes))}; "
                "one all-gather needs one dtype -- cast the module first, or fully_shard the "
                "submodules of each dtype separately")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.reduce_dtype = mp.reduce_dtype or self.dtype
        offset = 0
        for p in params:
            p.offset = offset
            offset += p.padded_numel
        self.flat_numel = offset
        # the reduce-scatter buffer adds one "had a gradient" flag per parameter after the
        # gradients: a parameter no rank's backward reached keeps grad None, as in torch
        self.reduce_numel = offset + len(params)
        self.state = SHARDED
        self._work: Any = None
        self._gathered: torch.Tensor | None = None
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce across replicas
        self.reshard_after_backward = True
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        self._averaging: tuple[str, float | None] | None = None  # (op, pre-scale)
        # per-backward bookkeeping
        self.pending: set[int] = set()
        self.used_in_backward = False
        self.reduced_in_backward = False
        self._all_had_grads = True   # set by reduce_grads: every parameter had a local grad
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ unshard / reshard
    @torch.no_grad()
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather of this group's parameters (a no-op if already under way)."""
        if self.state != SHARDED or not self.params:
            if not async_op:
                self.wait_unshard()
            return
        n = self.shard_size
        inp = torch.zeros(self.flat_numel, dtype=self.dtype, device=self.device)
        for p in self.params:
            local = p.shard_local()
            if local.numel():
                inp[p.offset:p.offset + local.numel()].copy_(local.reshape(-1))
        out = torch.empty(n * self.flat_numel, dtype=self.dtype, device=self.device)
        if n == 1:
            out.copy_(inp)
            self._work = None
        else:
            self._work = self.platform.all_gather_into_tensor(
                out, inp, group=self.shard_group, async_op=True)
        self._gathered = out
        self.state = GATHERING
        if not async_op:
            self.wait_unshard()

    @torch.no_grad()
    def wait_unshard(self) -> None:
        """Finish a started all-gather and make the module use the unsharded parameters."""
        if self.state != GATHERING:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        n = self.shard_size
        gathered = self._gathered.view(n, self.flat_numel)
        for p in self.params:
            padded = p.alloc_unsharded(n)
            # refilling the same tensor autograd saved in forward is intended: keep its
            # version so backward accepts it
            with torch.autograd._unsafe_preserve_version_counter(p.unsharded):
                padded.copy_(gathered[:, p.offset:p.offset + p.padded_numel])
            p.finish_unsharded()
            p.bind_unsharded()
            if p.requires_grad and not getattr(p, "_hooked", False):
                self._hooks.append(p.unsharded.register_post_accumulate_grad_hook(
                    self._on_grad))
                p._hooked = True
        self._gathered = None
        self.state = UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters; the module uses its sharded DTensors again."""
        if self.state == GATHERING:
            self.wait_unshard()
        if self.state != UNSHARDED:
            return
        for p in self.params:
            p.keep_requires_grad()
            p.free_unsharded()
            p.rebind_sharded()
        self.state = SHARDED

    def refresh_dtype(self) -> None:
        """After ``module._apply`` changed the shards' dtype or device."""
        if self.params:
            self.dtype = self.params[0].unsharded_dtype
            self.reduce_dtype = self.mp.reduce_dtype or self.dtype
            if not self.offload:
                self.device = self.params[0].device

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        if self.used_in_backward:
            return
        self.used_in_backward = True
        self.pending = {id(p.unsharded) for p in self.params
                        if p.requires_grad and p.unsharded is not None}

    def _on_grad(self, tensor: torch.Tensor) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.ensure_final_callback()
        self.begin_backward()
        self.pending.discard(id(tensor))
        if not self.pending and not self.reduced_in_backward:
            self.post_backward()

    def post_backward(self) -> None:
        """All gradients of this group are ready: reduce-scatter them (unless gradient sync is
        off, when they stay accumulated on the unsharded parameters) and reshard."""
        self.reduced_in_backward = True
        if self.requires_gradient_sync:
            self.reduce_grads()
        # a frozen parameter has no gradient to wait for, but backward may still need it (the
        # input gradient of its op): such a group reshards at the end of backward instead
        if self.reshard_after_backward and all(p.requires_grad for p in self.params):
            self.reshard()

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Launch the reduce-scatter of the unsharded gradients (async; ctx waits on it)."""
        if not any(p.requires_grad for p in self.params):
            return
        if self._averaging is None:
            # HSDP: pre-scale by the whole dp world, then sum the replicas' pieces
            replicas = (self.platform.world_size(self.replicate_group)
                        if self.replicate_group is not None else 1)
            if self.divide_factor is not None:
                self._averaging = ("sum", 1.0 / self.divide_factor)
            else:
                self._averaging = averaging(self.shard_group, self.shard_size * replicas)
        op, scale = self._averaging
        bucket = Bucket(self.shard_size, self.reduce_numel, self.reduce_dtype, self.device,
                        self.shard_group)
        flags = bucket.block(self.flat_numel, len(self.params))
        self._all_had_grads = True
        for i, p in enumerate(self.params):
            grad = p.flat_grad()
            pack(bucket.block(p.offset, p.padded_numel), grad, scale)
            # every rank's row holds this rank's flag: each rank receives the reduced flags
            flags[:, i] = 0.0 if grad is None else 1.0
            if grad is None and p.requires_grad:
                self._all_had_grads = False
            if grad is not None:
                p.unsharded.grad = None
        out = bucket.reduce_scatter(op)
        self.ctx.add_reduction(self, bucket, out)

    @torch.no_grad()
    def finish_reduction(self, bucket: Bucket, out: torch.Tensor) -> None:
        bucket.wait()
        bucket.buffer = None
        if self.replicate_group is not None and self.requires_all_reduce and \
                self.platform.world_size(self.replicate_group) > 1:
            # the pieces were pre-scaled by 1/(whole dp world): the replicas' sum is the mean
            self.platform.all_reduce(out, op="sum", group=self.replicate_group)
        if self._all_had_grads or out.is_meta:
            # this rank's backward reached every parameter, so some rank did: the flags need
            # not be read (reading them waits for the device; meta tensors have no values)
            reached = [True] * len(self.params)
        else:
            # > 0: some rank had a gradient (avg or sum of 0/1 flags, summed over replicas)
            reached = (out[self.flat_numel:] > 0).tolist()
        for p, had_grad in zip(self.params, reached, strict=True):
            if p.requires_grad and had_grad:
                p.accumulate_shard_grad(out)
        _free(out)

    def end_backward(self) -> None:
        self.forward_count = 0
        self.pending = set()
        self.used_in_backward = False
        self.reduced_in_backward = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
