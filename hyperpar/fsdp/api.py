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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.mesh import DeviceMesh, init_device_mesh
from hyperpar.platform import get_platform

from ._group import ParamGroup
from ._param import ShardedParam
from ._state import Hooks, RootContext
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .sections import mesh_key as _mesh_key
from .sections import shard_placement as _shard_placement

__all__ = ["FSDPModule", "fully_shard", "register_fsdp_forward_method"]

_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def wait(self) -> None:
        self._group.wait_unshard()


class FSDPModule(nn.Module):
    """Mixin class of a module prepared by :func:`fully_shard` (never built directly): the
    module's class becomes ``FSDP<Class>``, a subclass of this and of its own class.

    It has every public method of torch 2.13's ``FSDPModule``. Those about CUDA streams,
    events, symmetric memory, custom collectives or communication buffers are accepted and
    do nothing (``docs/fsdp.md`` lists them): hyperpar runs its collectives through the
    Platform, which owns those choices.
    """

    _fsdp_group: ParamGroup
    _fsdp_hooks: Hooks

    def _fsdp_modules(self, recurse: bool = True) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def _fsdp_groups(self, recurse: bool = True) -> list[ParamGroup]:
        seen: dict[int, ParamGroup] = {}
        for m in self._fsdp_modules(recurse):
            seen.setdefault(id(m._fsdp_group), m._fsdp_group)
        return list(seen.values())

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
        for g in self._fsdp_groups(recurse):
            g.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *,
                                recurse: bool = True) -> None:
        """HSDP: ``False`` skips the all-reduce across replicas (each replica keeps its own
        reduce-scattered gradient) until it is set back to ``True``."""
        for g in self._fsdp_groups(recurse):
            g.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` after :func:`fully_shard`."""
        value = _check_reshard(reshard_after_forward, allow_none=False)
        for g in self._fsdp_groups(recurse):
            g.reshard_after_forward = _resolve_reshard(value, g.shard_size, root=False)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """``False`` keeps the parameters unsharded after backward (e.g. between gradient
        accumulation microbatches, saving the next forward's all-gather)."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"set_reshard_after_backward: expected a bool, got "
                            f"{reshard_after_backward!r}")
        for g in self._fsdp_groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Tell the coming backward whether it is the last one before the optimizer step
        (torch uses it to skip work for microbatches); hyperpar's backward reduces or
        accumulates according to :meth:`set_requires_gradient_sync` only, so this records
        the flag and changes nothing."""
        self._ctx_required().is_last_backward = bool(is_last_backward)

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

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` promises that backward does not need this module's parameters. hyperpar
        re-gathers only parameters that backward really uses (autograd asks for them), so
        this is accepted and changes nothing."""
        self._fsdp_group.unshard_in_backward = bool(unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size."""
        factor = float(factor)
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for g in self._fsdp_groups():
            g.divide_factor = factor
            g.reset_averaging()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``sum`` and scale separately. hyperpar already does so where the
        collective library has no native average, and the result is the same either way:
        accepted, no effect."""

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """hyperpar always includes parameters unused in forward in the group's one
        reduce-scatter (as zeros, with a flag: one that no rank's backward reached keeps
        ``grad`` None, as in torch): accepted, no effect."""

    def set_post_optim_event(self, event: object) -> None:
        """A CUDA event the next all-gather waits for. hyperpar's collectives are ordered
        by the Platform on the current stream: accepted, no effect."""

    def set_all_reduce_hook(self, hook: object, *, stream: object = None) -> None:
        """torch runs ``hook`` on the HSDP all-reduce output; not supported (the gradient
        path is fixed): raises rather than ignoring the hook."""
        raise NotImplementedError(
            "FSDPModule.set_all_reduce_hook: hyperpar's fully_shard has no gradient hook "
            "point; reduce the gradients yourself after backward instead")

    def set_custom_all_gather(self, comm: object) -> None:
        """torch: replace the all-gather. Not supported -- the Platform owns collectives;
        raises rather than ignoring it."""
        raise NotImplementedError(
            "FSDPModule.set_custom_all_gather: collectives belong to the Platform; implement "
            "them in a backend (docs/writing-a-backend.md)")

    def set_custom_reduce_scatter(self, comm: object) -> None:
        """torch: replace the reduce-scatter. Not supported (see set_custom_all_gather)."""
        raise NotImplementedError(
            "FSDPModule.set_custom_reduce_scatter: collectives belong to the Platform; "
            "implement them in a backend (docs/writing-a-backend.md)")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """torch: let the process group allocate communication buffers (NCCL). Accepted,
        no effect."""

    def set_symm_mem_for_comm(self, backend: str | None = None) -> None:
        """torch: symmetric-memory collectives (NCCL). Accepted, no effect."""

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """torch: a second process group for reduce-scatter (to overlap on NCCL). Accepted,
        no effect: the Platform's async collectives already overlap."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """torch: reduce-scatter input buffers kept in flight. hyperpar keeps one: accepted,
        no effect."""

    def reset_iter_state(self) -> None:
        """Forget the per-iteration state (recorded prefetch order): the next forward
        records it again."""
        ctx = self._ctx_required()
        ctx.order = []
        ctx.order_done = False

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
        below = {id(m) for m in self.modules()}  # a list group spans several modules
        mine = [sp for sp in group.params if any(id(m) in below for m, _ in sp.aliases)]
        for sp in mine:
            sp.apply_to_local(fn)
            for m, name in sp.aliases:
                m._parameters[name] = None
        try:
            out = super()._apply(fn, recurse)
        finally:
            for sp in mine:
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
        platform = get_platform()
        if not platform.is_initialized():  # as torch: join the launcher's world (or be one)
            platform.init_process_group()
        world = platform.world_size()
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


def _check_reshard(value: object, *, allow_none: bool = True) -> bool | int | None:
    """``reshard_after_forward`` is None, a bool or a positive int (as in torch)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 1:
        return value
    raise TypeError(
        f"fully_shard: reshard_after_forward must be a bool, a positive int (reshard to that "
        f"many ranks) or None (reshard every module but the root), got {value!r} "
        f"({type(value).__name__})")


def _resolve_reshard(value: bool | int | None, shard_size: int, *, root: bool) -> bool:
    """What the group does after forward: free its gathered parameters or keep them.

    ``None``: every module but the root reshards (the root's parameters are needed at once by
    backward). An int ``k`` asks torch to keep the parameters sharded over ``k`` ranks after
    forward; hyperpar frees them fully for ``k > 1`` (same values, less memory, a full
    re-gather in backward) and keeps them for ``k == 1`` (fully replicated)."""
    if value is None:
        return not root
    if isinstance(value, bool):
        return value
    if shard_size % value:
        raise ValueError(
            f"fully_shard: reshard_after_forward={value} must divide the shard group size "
            f"{shard_size}")
    return value != 1


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


def _modules_of(module: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected an nn.Module or a list of them, got "
                            f"{type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard: {type(m).__name__} is already fully_shard-ed")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise TypeError(
                f"fully_shard: {type(m).__name__} has no forward to hook; apply fully_shard "
                "to each of its modules instead, or pass them as one list: "
                "fully_shard(list(module_list))")
    return modules


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: OffloadPolicy | None = None,
                ignored_params: set[nn.Parameter] | None = None) -> Any:
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (FSDP2 semantics).

    Args:
        module: a block or the root; apply to the blocks first, then to the root. Its
            parameters may be tensor-parallel DTensors on another dim of the same mesh. A
            list of modules forms one group: one all-gather before the first of them runs,
            one reshard after the last (e.g. ``fully_shard([model.norm, model.output])``).
        mesh: the data-parallel mesh -- 1-D (shard) or 2-D ``(replicate, shard)`` for HSDP.
            Default: every rank of the world.
        reshard_after_forward: free the gathered parameters after forward (re-gathered in
            backward); ``False`` keeps them until the end of backward (more memory, less
            communication). ``None`` (default): ``True`` for every module but the root,
            which keeps them (backward needs them at once). An int ``k`` (torch: stay sharded
            over ``k`` ranks) frees them fully for ``k > 1`` and keeps them for ``k == 1``.
        shard_placement_fn: ``fn(param) -> Shard(dim) | ShardPlacementResult | None``: the
            dim each parameter is split on (``None``: dim 0; uneven dims follow
            ``torch.chunk``), or with ``ShardPlacementResult(placement, FSDPMeshInfo(mesh,
            shard_mesh_dim))`` (hyperpar's or torch's) also its own data-parallel mesh:
            parameters on each mesh are gathered and reduce-scattered over it (torchtitan's
            routed experts over ``efsdp``, the rest over ``mesh``).
        mp_policy: :class:`MixedPrecisionPolicy` (default: none).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards, gradients and optimizer
            states in host memory (default :class:`OffloadPolicy`: no offload).
        ignored_params: parameters left alone: not sharded, not gathered, their gradients
            not reduced (they stay plain tensors, as in torch).

    Returns ``module`` itself (or the list), whose class now also derives from
    :class:`FSDPModule`.
    """
    modules = _modules_of(module)
    reshard_after_forward = _check_reshard(reshard_after_forward)
    mp = mp_policy or MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                        f"{type(mp).__name__}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp, field)  # the policy class also takes MindSpore's dtypes
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(f"fully_shard: mp_policy.{field}={value!r} is not a torch.dtype; "
                            f"on torch modules pass torch's (e.g. torch.bfloat16)")
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be callable, got "
                        f"{type(shard_placement_fn).__name__}")
    ignored = {id(p) for p in (ignored_params or ())}
    dp_mesh = _dp_mesh(mesh)
    platform = get_platform()
    shard_group = dp_mesh.get_group(dp_mesh.ndim - 1)
    replicate_group = dp_mesh.get_group(0) if dp_mesh.ndim == 2 else None
    shard_size = dp_mesh.size(dp_mesh.ndim - 1)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = _resolve_reshard(reshard_after_forward, shard_size, root=False)
    device = platform.device()
    label = "[" + ", ".join(type(m).__name__ for m in modules) + "]" if len(modules) > 1 \
        else type(modules[0]).__name__
    managed: list[tuple[nn.Module, str, nn.Parameter]] = []
    for m in modules:
        managed += [e for e in _managed(m) if id(e[2]) not in ignored]
    # one ShardedParam per distinct Parameter: a tied weight (embedding and output head)
    # is sharded once and bound under every name that holds it
    params: list[ShardedParam] = []
    by_id: dict[int, ShardedParam] = {}
    # one section (flat buffers, collectives) per distinct data-parallel mesh
    sections: dict[tuple[Any, ...], tuple[DeviceMesh, list[ShardedParam]]] = {}
    for owner, name, p in managed:
        if getattr(p, "_hp_fsdp", False):
            raise ValueError(f"fully_shard: parameter {name!r} is already sharded")
        done = getattr(p, "_hp_fsdp_replaced", None)
        if done is not None:
            raise ValueError(
                f"fully_shard({label}): parameter {name!r} of {type(owner).__name__} is the "
                f"same tensor as a parameter already sharded by fully_shard({done}) (a weight "
                "tied across two fully_shard units); the copies would train apart. Put every "
                "module that uses it into one unit: fully_shard their common parent (e.g. the "
                "root) without sharding them separately, or fully_shard([module_a, module_b])")
        sp = by_id.get(id(p))
        if sp is not None:
            sp.aliases.append((owner, name))
            continue
        dim, pmesh = _shard_placement(shard_placement_fn, p, name, dp_mesh)
        key = _mesh_key(pmesh)
        pmesh = sections.setdefault(key, (pmesh, []))[0]
        sp = ShardedParam(owner, name, p, dp_mesh=pmesh,
                          shard_rank=pmesh.get_local_rank(pmesh.ndim - 1),
                          shard_size=pmesh.size(pmesh.ndim - 1), param_dtype=mp.param_dtype,
                          offload=offload, device=device, shard_dim=dim)
        sp.sharded._hp_fsdp = True
        by_id[id(p)] = sp
        params.append(sp)
        sections[key][1].append(sp)
    for sp in params:
        _retire(sp, label)
        sp.rebind_sharded()
    group = ParamGroup(params, shard_group=shard_group, replicate_group=replicate_group,
                       mp=mp, reshard_after_forward=reshard_after_forward, offload=offload,
                       device=device, label=label,
                       sections=[(ps, m.get_group(m.ndim - 1),
                                  m.get_group(0) if m.ndim == 2 else None)
                                 for m, ps in sections.values()])
    group.modules = modules
    for m in modules:
        _install(m, group, platform)
    _guard_optimizers()
    # the outermost fully_shard module is the root: its context (forward order, prefetch,
    # end-of-backward callback) covers every fully_shard module below it, replacing theirs --
    # so a pipeline stage whose layers run without the root's forward still shares one
    groups: dict[int, ParamGroup] = {}
    for m in modules:
        for sub in reversed(list(m.modules())):
            if isinstance(sub, FSDPModule):
                groups.setdefault(id(sub._fsdp_group), sub._fsdp_group)
    RootContext(group, list(groups.values()))
    return module


def _install(module: nn.Module, group: ParamGroup, platform: Any) -> None:
    """Make ``module`` an ``FSDP<Class>`` run by ``group`` and hook its forward."""
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


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` gather and free the parameters like ``forward`` does
    (e.g. ``generate`` of a fully_shard model), as torch's function of the same name."""
    if not isinstance(module, FSDPModule):
        return  # torch: a no-op on a module that is not fully_shard-ed
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no "
                         f"method {method_name!r}")
    hooks = module._fsdp_hooks

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = hooks.pre_forward(module, args, kwargs)
        out = method(*args, **kwargs)
        return hooks.post_forward(module, args, kwargs, out)

    setattr(module, method_name, wrapped)


def _retire(sp: ShardedParam, label: str) -> None:
    """Mark the Parameter that fully_shard replaced: an optimizer still holding it (built
    before fully_shard) is refused at its next step, and sharding it again is refused."""
    for module, name in sp.aliases:
        old = module._parameters.get(name)
        if old is not None and old is not sp.sharded:
            old._hp_fsdp_replaced = label
    return None


_GUARD: list[Any] = []


def _guard_optimizers() -> None:
    """Install (once) a global optimizer step pre-hook that refuses to step parameters that
    fully_shard replaced -- they never get a gradient again, so the step would silently
    train nothing."""
    if _GUARD:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def check(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                label = getattr(p, "_hp_fsdp_replaced", None)
                if label is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__}.step(): this optimizer holds a parameter "
                        f"of shape {tuple(p.shape)} that fully_shard({label}) replaced by its "
                        "sharded version -- the optimizer was built before fully_shard and "
                        "would train nothing. Build it from model.parameters() after "
                        "fully_shard")

    _GUARD.append(register_optimizer_step_pre_hook(check))
