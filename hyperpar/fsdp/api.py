"""``fully_shard``: sharded data parallelism with torch FSDP2's semantics, above the Platform.

Apply it to each block, then to the root::

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

Each parameter becomes a :class:`~hyperpar.dtensor.DTensor` split on dim 0 over the
data-parallel mesh (``Shard(0)``; a 2-D mesh ``(replicate, shard)`` gives HSDP,
``(Replicate(), Shard(0))``). Before a module's forward its parameters are all-gathered (the
next module's gather is started early, so it overlaps this one's compute); after it they are
freed again when ``reshard_after_forward``. Backward re-gathers them and reduce-scatters the
gradients, so each rank keeps only its shard of parameters, gradients and optimizer states.
"""

from __future__ import annotations

from torch import nn

from hyperpar.dtensor.mesh import DeviceMesh, init_device_mesh
from hyperpar.platform import get_platform

from ._group import ParamGroup
from ._param import ShardedParam
from ._state import Hooks, RootContext
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["FSDPModule", "fully_shard"]

_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def wait(self) -> None:
        self._group.wait_unshard()


class FSDPModule(nn.Module):
    """Mixin class of a module prepared by :func:`fully_shard` (never built directly): the
    module's class becomes ``FSDP<Class>``, a subclass of this and of its own class."""

    _fsdp_group: ParamGroup
    _fsdp_hooks: Hooks

    def _fsdp_modules(self, recurse: bool = True) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (``async_op``: return a handle to wait on);
        they stay unsharded until :meth:`reshard` or the end of the next forward/backward."""
        self._fsdp_group.unshard(async_op=async_op)
        return UnshardHandle(self._fsdp_group) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds only its shards again."""
        self._fsdp_group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """``False``: backward passes accumulate unsharded gradients locally, without
        reduce-scatter (gradient accumulation); the next backward with ``True`` reduces the
        accumulated sum."""
        for m in self._fsdp_modules(recurse):
            m._fsdp_group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` after :func:`fully_shard`."""
        for m in self._fsdp_modules(recurse):
            m._fsdp_group.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` as soon as this module's forward starts (instead of the next
        module in recorded forward order)."""
        self._ctx_required().forward_prefetch[id(self._fsdp_group)] = [
            _require_fsdp(m)._fsdp_group for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` as soon as this module's backward starts."""
        self._ctx_required().backward_prefetch[id(self._fsdp_group)] = [
            _require_fsdp(m)._fsdp_group for m in modules]

    def set_implicit_prefetch(self, enabled: bool) -> None:
        """Turn the default prefetch (next module in recorded forward order, previous one in
        backward) on or off -- off makes every all-gather wait in the critical path."""
        self._ctx_required().implicit_prefetch = enabled

    def sync_gradients(self) -> None:
        """Reduce-scatter the gradients accumulated under ``set_requires_gradient_sync(False)``
        now -- e.g. once after a pipeline schedule has run every microbatch's backward."""
        self._ctx_required().sync_gradients()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # to_empty()/to()/float() must reach each shard's local tensor (assigning a DTensor's
        # .data would leave it behind): apply fn to the shards here, and hide them from
        # nn.Module._apply, which handles everything else
        group = self._fsdp_group
        group.reshard()
        for sp in group.params:
            sp.apply_to_local(fn)
            sp.module._parameters[sp.name] = None
        try:
            out = super()._apply(fn, recurse)
        finally:
            for sp in group.params:
                sp.rebind_sharded()
        group.refresh_dtype()
        return out

    def _ctx_required(self) -> RootContext:
        return self._fsdp_group.ctx


def _require_fsdp(m: nn.Module) -> FSDPModule:
    if not isinstance(m, FSDPModule):
        raise TypeError(f"expected a module prepared by fully_shard, got {type(m).__name__}")
    return m


def _dp_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        world = get_platform().world_size()
        return init_device_mesh((world,), mesh_dim_names=("dp",))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a hyperpar DeviceMesh, got "
                        f"{type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh {mesh!r} has {mesh.ndim} dims; pass the data-parallel slice "
            "(1-D: shard; 2-D: (replicate, shard) for HSDP), e.g. mesh['dp'] or "
            "mesh['dp_replicate', 'dp_shard']")
    return mesh


def _managed(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Parameters of ``module`` not already owned by a fully_shard submodule."""
    out: list[tuple[nn.Module, str, nn.Parameter]] = []

    def walk(m: nn.Module) -> None:
        for name, p in m._parameters.items():
            if p is not None:
                out.append((m, name, p))
        for child in m._modules.values():
            if child is not None and not isinstance(child, FSDPModule):
                walk(child)

    walk(module)
    return out


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (FSDP2 semantics).

    Args:
        module: a block or the root; apply to the blocks first, then to the root. Its
            parameters may be tensor-parallel DTensors on another dim of the same mesh.
        mesh: the data-parallel mesh -- 1-D (shard) or 2-D ``(replicate, shard)`` for HSDP.
            Default: every rank of the world.
        reshard_after_forward: free the gathered parameters after forward (re-gathered in
            backward); ``False`` keeps them until the end of backward (more memory, less
            communication). The root always keeps them (backward needs them at once).
        mp_policy: :class:`MixedPrecisionPolicy` (default: none).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards, gradients and optimizer
            states in host memory (default :class:`OffloadPolicy`: no offload).

    Returns ``module`` itself, whose class now also derives from :class:`FSDPModule`.
    """
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: {type(module).__name__} is already fully_shard-ed")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"fully_shard: {type(module).__name__} has no forward to hook; apply fully_shard "
            "to each of its modules instead")
    mp = mp_policy or MixedPrecisionPolicy()
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    dp_mesh = _dp_mesh(mesh)
    platform = get_platform()
    shard_group = dp_mesh.get_group(dp_mesh.ndim - 1)
    replicate_group = dp_mesh.get_group(0) if dp_mesh.ndim == 2 else None
    shard_rank = dp_mesh.get_local_rank(dp_mesh.ndim - 1)
    shard_size = dp_mesh.size(dp_mesh.ndim - 1)
    device = platform.device()
    managed = _managed(module)
    seen: dict[int, str] = {}
    for _, name, p in managed:
        if id(p) in seen:
            raise NotImplementedError(
                f"fully_shard({type(module).__name__}): parameter {name!r} is the same tensor "
                f"as {seen[id(p)]!r} (tied weights); shared parameters are not supported yet "
                "-- untie them, or keep both users inside one fully_shard module")
        seen[id(p)] = name
        if getattr(p, "_hp_fsdp", False):
            raise ValueError(f"fully_shard: parameter {name!r} is already sharded")
    params: list[ShardedParam] = []
    for owner, name, p in managed:
        sp = ShardedParam(owner, name, p, dp_mesh=dp_mesh, shard_rank=shard_rank,
                          shard_size=shard_size, param_dtype=mp.param_dtype,
                          offload=offload, device=device)
        sp.sharded._hp_fsdp = True
        params.append(sp)
    for sp in params:
        sp.rebind_sharded()
    group = ParamGroup(params, shard_group=shard_group, replicate_group=replicate_group,
                       mp=mp, reshard_after_forward=reshard_after_forward, offload=offload,
                       device=device, label=type(module).__name__)
    hooks = Hooks(module, group)
    cls = type(module)
    new_cls = _CLASSES.get(cls)
    if new_cls is None:
        new_cls = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = new_cls
    module._fsdp_group = group
    module._fsdp_hooks = hooks
    group._hooks.append(platform.register_forward_pre_hook(module, hooks.pre_forward,
                                                           with_kwargs=True))
    group._hooks.append(platform.register_forward_hook(module, hooks.post_forward,
                                                       with_kwargs=True))
    # state_dict()/load_state_dict() must see the sharded DTensors, also between a forward
    # and its backward (when the root holds gathered tensors): reshard first (backward
    # re-gathers what it needs)
    group._hooks.append(module.register_state_dict_pre_hook(
        lambda *_args, **_kw: group.reshard()))
    group._hooks.append(module.register_load_state_dict_pre_hook(
        lambda *_args, **_kw: group.reshard()))
    # the outermost fully_shard module is the root: its context (forward order, prefetch,
    # end-of-backward callback) covers every fully_shard module below it, replacing theirs --
    # so a pipeline stage whose layers run without the root's forward still shares one
    RootContext(group, [m._fsdp_group for m in reversed(list(module.modules()))
                        if isinstance(m, FSDPModule)])
    return module
