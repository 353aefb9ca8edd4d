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


class MeshSection:
    """The parameters of a group that shard over one data-parallel mesh, with their own flat
    buffers: ``shard_placement_fn`` may put a block's routed experts on their own mesh
    (torchtitan's ``efsdp``) and its dense parameters on ``dp_shard``; each mesh gets one
    all-gather and one reduce-scatter of its own."""

    def __init__(self, params: list[ShardedParam], shard_group: Any, replicate_group: Any,
                 platform: Any) -> None:
        self.params = params
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_size = platform.world_size(shard_group)
        offset = 0
        for p in params:
            p.offset = offset
            offset += p.padded_numel
        self.flat_numel = offset
        # the reduce-scatter buffer adds one "had a gradient" flag per parameter after the
        # gradients: a parameter no rank's backward reached keeps grad None, as in torch
        self.reduce_numel = offset + len(params)
        self.work: Any = None
        self.gathered: torch.Tensor | None = None
        self.averaging: tuple[str, float | None] | None = None  # (op, pre-scale)
        self.all_had_grads = True  # set by reduce_grads: every parameter had a local grad


class ParamGroup:
    """Sharded/unsharded state machine of one fully_shard module's parameters."""

    def __init__(self, params: list[ShardedParam], *, shard_group: Any, replicate_group: Any,
                 mp: MixedPrecisionPolicy, reshard_after_forward: bool | None, offload: bool,
                 device: torch.device, label: str,
                 sections: list[tuple[list[ShardedParam], Any, Any]] | None = None) -> None:
        self.params = params
        self.label = label
        self.platform = get_platform()
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_size = self.platform.world_size(shard_group)
        if sections is None:
            sections = [(params, shard_group, replicate_group)]
        self.sections = [MeshSection(ps, sg, rg, self.platform) for ps, sg, rg in sections]
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
        self.state = SHARDED
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce across replicas
        self.reshard_after_backward = True
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        # per-backward bookkeeping
        self.pending: set[int] = set()
        self.used_in_backward = False
        self.reduced_in_backward = False
        self._hooks: list[Any] = []

    def reset_averaging(self) -> None:
        """Recompute the gradient pre-scale at the next reduction (divide factor changed)."""
        for sec in self.sections:
            sec.averaging = None

    # ------------------------------------------------------------------ unshard / reshard
    @torch.no_grad()
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather of this group's parameters (a no-op if already under way)."""
        if self.state != SHARDED or not self.params:
            if not async_op:
                self.wait_unshard()
            return
        for sec in self.sections:
            n = sec.shard_size
            inp = torch.zeros(sec.flat_numel, dtype=self.dtype, device=self.device)
            for p in sec.params:
                local = p.shard_local()
                if local.numel():
                    inp[p.offset:p.offset + local.numel()].copy_(local.reshape(-1))
            out = torch.empty(n * sec.flat_numel, dtype=self.dtype, device=self.device)
            if n == 1:
                out.copy_(inp)
                sec.work = None
            else:
                sec.work = self.platform.all_gather_into_tensor(
                    out, inp, group=sec.shard_group, async_op=True)
            sec.gathered = out
        self.state = GATHERING
        if not async_op:
            self.wait_unshard()

    @torch.no_grad()
    def wait_unshard(self) -> None:
        """Finish a started all-gather and make the module use the unsharded parameters."""
        if self.state != GATHERING:
            return
        for sec in self.sections:
            if sec.work is not None:
                sec.work.wait()
                sec.work = None
            n = sec.shard_size
            gathered = sec.gathered.view(n, sec.flat_numel)
            for p in sec.params:
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
            sec.gathered = None
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
        for sec in self.sections:
            if any(p.requires_grad for p in sec.params):
                self._reduce_section(sec)

    def _reduce_section(self, sec: MeshSection) -> None:
        if sec.averaging is None:
            # HSDP: pre-scale by the whole dp world, then sum the replicas' pieces
            replicas = (self.platform.world_size(sec.replicate_group)
                        if sec.replicate_group is not None else 1)
            if self.divide_factor is not None:
                sec.averaging = ("sum", 1.0 / self.divide_factor)
            else:
                sec.averaging = averaging(sec.shard_group, sec.shard_size * replicas)
        op, scale = sec.averaging
        bucket = Bucket(sec.shard_size, sec.reduce_numel, self.reduce_dtype, self.device,
                        sec.shard_group)
        bucket.section = sec  # finish_reduction's: which mesh's pieces these are
        flags = bucket.block(sec.flat_numel, len(sec.params))
        sec.all_had_grads = True
        for i, p in enumerate(sec.params):
            grad = p.flat_grad()
            pack(bucket.block(p.offset, p.padded_numel), grad, scale)
            # every rank's row holds this rank's flag: each rank receives the reduced flags
            flags[:, i] = 0.0 if grad is None else 1.0
            if grad is None and p.requires_grad:
                sec.all_had_grads = False
            if grad is not None:
                p.unsharded.grad = None
        out = bucket.reduce_scatter(op)
        self.ctx.add_reduction(self, bucket, out)

    @torch.no_grad()
    def finish_reduction(self, bucket: Bucket, out: torch.Tensor) -> None:
        sec: MeshSection = bucket.section
        bucket.wait()
        bucket.buffer = None
        if sec.replicate_group is not None and self.requires_all_reduce and \
                self.platform.world_size(sec.replicate_group) > 1:
            # the pieces were pre-scaled by 1/(whole dp world): the replicas' sum is the mean
            self.platform.all_reduce(out, op="sum", group=sec.replicate_group)
        if sec.all_had_grads or out.is_meta:
            # this rank's backward reached every parameter, so some rank did: the flags need
            # not be read (reading them waits for the device; meta tensors have no values)
            reached = [True] * len(sec.params)
        else:
            # > 0: some rank had a gradient (avg or sum of 0/1 flags, summed over replicas)
            reached = (out[sec.flat_numel:] > 0).tolist()
        for p, had_grad in zip(sec.params, reached, strict=True):
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
