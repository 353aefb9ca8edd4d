"""FlexModel's API (VectorInstitute/flex_model) as thin entry points over :class:`InspectedModel`.

Code written for FlexModel ports by changing its import line::

    from hyperpar.inspect import FlexModel, HookFunction

The gathering, checking, editing and re-sharding are :class:`InspectedModel`'s; this module
only maps FlexModel's names and conventions onto it:

* the parallel sizes become a ``(pp, dp, tp)`` device mesh (tensor parallelism fastest, as
  FlexModel lays out ranks); data-parallel replicas are gathered along dim 0;
* an editing function is called as ``fn(current_module, inputs, save_ctx, modules)``;
* every registered hook is in group ``"all"``; ``forward(groups=..., complement=...)`` runs
  only the hooks of (or outside) the given groups;
* captures are appended, one host tensor per hooked call, to ``output_ptr[module_name]``
  (a list) on rank 0; gradients under ``"<module_name>.grad"``.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from ._layout import _Layout
from .model import HookFunction, InspectedModel

__all__ = ["FlexModel"]

class _FlexInspected(InspectedModel):
    """InspectedModel calling editing functions with FlexModel's signature. Holds the shared
    state, never the :class:`FlexModel` (so dropping the FlexModel frees it and its hooks)."""

    def __init__(self, model: nn.Module, mesh: Any, save_ctx: Namespace,
                 modules: nn.ModuleDict, direct: dict[str, list[torch.Tensor]] | None) -> None:
        super().__init__(model, mesh=mesh, tp_dim="tp", dp_dim="dp" if mesh is not None else None)
        self._concat = False  # one list entry per hooked call, as FlexModel
        self._save_ctx = save_ctx
        self._trainable = [modules]  # a list: not registered as a submodule
        self._direct = direct

    def _store(self, key: str, host: torch.Tensor) -> None:
        # Without pipeline stages rank 0 holds every capture it keeps: straight into
        # output_ptr, so gradient captures are there right after backward, as in FlexModel.
        platform = get_platform()
        if self._direct is not None and (not platform.is_initialized() or platform.rank() == 0):
            self._direct.setdefault(key, []).append(host)
        else:
            super()._store(key, host)

    def _call_edit(self, hook: HookFunction, name: str, full: torch.Tensor) -> Any:
        module = self._modules_by_name[name]
        return hook.editing_function(module, full, self._save_ctx, self._trainable[0])


class FlexModel(nn.Module):
    """Wrap ``module`` for FlexModel-style model surgery on a (TP/PP/DP-)parallel model.

    Args:
        module: the model to hook into (already parallelised; its module names are the hook
            targets).
        output_ptr: the user's dict; on rank 0, ``output_ptr[module_name]`` becomes a list of
            host tensors, one appended per hooked call (other ranks: left empty).
        tensor_parallel_size, pipeline_parallel_size, data_parallel_size: the parallel sizes;
            their product must be the world size.
        process_group: ``None`` (the world), or a group spanning the whole world.

    Attributes (FlexModel's): ``module``, ``output_ptr``, ``save_ctx`` (a ``Namespace`` every
    editing function receives), ``trainable_modules`` (an ``nn.ModuleDict`` every editing
    function receives as ``modules``), ``tp_size``, ``pp_size``, ``dp_size``.

    Dropping the wrapper, or :meth:`restore`, takes its hooks off ``module``.
    """

    def __init__(self, module: nn.Module, output_ptr: dict[str, list[torch.Tensor]],
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 data_parallel_size: int = 1, process_group: Any = None) -> None:
        super().__init__()
        sizes = {"tensor_parallel_size": tensor_parallel_size,
                 "pipeline_parallel_size": pipeline_parallel_size,
                 "data_parallel_size": data_parallel_size}
        for key, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FlexModel: {key} must be a positive int, got {value!r}")
        if not isinstance(output_ptr, dict):
            raise TypeError(f"FlexModel: output_ptr must be a dict, got "
                            f"{type(output_ptr).__name__}")
        platform = get_platform()
        world = platform.world_size() if platform.is_initialized() else 1
        product = tensor_parallel_size * pipeline_parallel_size * data_parallel_size
        if product != world:
            raise ValueError(
                f"FlexModel: tensor_parallel_size * pipeline_parallel_size * "
                f"data_parallel_size = {tensor_parallel_size} * {pipeline_parallel_size} * "
                f"{data_parallel_size} = {product}, but the world has {world} rank(s); the "
                f"sizes must multiply to the world size")
        if process_group is not None and platform.world_size(process_group) != world:
            raise NotImplementedError(
                f"FlexModel: process_group spans {platform.world_size(process_group)} of "
                f"{world} ranks; hyperpar's FlexModel runs over the whole world only (pass "
                "process_group=None)")
        self.module = module
        self.output_ptr = output_ptr
        self.save_ctx = Namespace()
        self.trainable_modules = nn.ModuleDict()
        self.tp_size, self.pp_size, self.dp_size = (tensor_parallel_size,
                                                    pipeline_parallel_size, data_parallel_size)
        self.process_group = process_group
        mesh = None
        if world > 1:
            from hyperpar.dtensor import init_device_mesh

            mesh = init_device_mesh((pipeline_parallel_size, data_parallel_size,
                                     tensor_parallel_size), mesh_dim_names=("pp", "dp", "tp"))
        # Not a submodule (object.__setattr__): parameters and state_dict stay the model's.
        direct = output_ptr if pipeline_parallel_size == 1 else None
        object.__setattr__(self, "_inspected", _FlexInspected(module, mesh, self.save_ctx,
                                                              self.trainable_modules, direct))
        self._groups: dict[HookFunction, set[str]] = {}

    # -------------------------------------------------------------- registration
    def _register(self, hook_function: HookFunction, kind: str) -> None:
        if not isinstance(hook_function, HookFunction):
            raise TypeError(f"FlexModel: expected a HookFunction, got "
                            f"{type(hook_function).__name__}")
        if hook_function in self._groups:
            raise ValueError(f"FlexModel: HookFunction {hook_function.module_name!r} is "
                             "already registered")
        hook_function.kind = kind
        self._inspected.register_hook(hook_function)
        self._groups[hook_function] = {"all"}

    def register_forward_hook(self, hook_function: HookFunction) -> None:
        """Capture (and edit, with its ``editing_function``) the full output of the module
        ``hook_function.module_name``."""
        self._register(hook_function, "forward")

    def register_full_backward_pre_hook(self, hook_function: HookFunction) -> None:
        """Capture (and edit) the full gradient w.r.t. the module's output (captured under
        ``"<module_name>.grad"``, on rank 0 right after backward; with pipeline stages, at the
        end of the next forward)."""
        self._register(hook_function, "backward")

    def _unsupported(self, what: str) -> None:
        raise NotImplementedError(
            f"FlexModel.{what} is not supported by hyperpar; use register_forward_hook (module "
            "outputs) or register_full_backward_pre_hook (gradients w.r.t. module outputs)")

    def register_forward_pre_hook(self, hook_function: HookFunction) -> None:
        """Not supported (module inputs): raises ``NotImplementedError``."""
        self._unsupported("register_forward_pre_hook")

    def register_full_backward_hook(self, hook_function: HookFunction) -> None:
        """Not supported (gradients w.r.t. module inputs): raises ``NotImplementedError``."""
        self._unsupported("register_full_backward_hook")

    def register_hook(self, hook_function: HookFunction) -> None:
        """Not supported (parameter-gradient hooks): raises ``NotImplementedError``."""
        self._unsupported("register_hook")

    def register_trainable_module(self, name: str, module: nn.Module) -> None:
        """Make ``module`` available to every editing function as ``modules[name]``."""
        self.trainable_modules[name] = module

    # -------------------------------------------------------------- groups
    def _select(self, constructor: Any) -> list[HookFunction]:
        if isinstance(constructor, HookFunction):
            found = [constructor]
        elif isinstance(constructor, str):  # FlexModel: substring of the module name
            found = [h for h in self._groups if constructor in h.module_name]
        elif isinstance(constructor, (list, tuple)) and all(
                isinstance(h, HookFunction) for h in constructor):
            found = list(constructor)
        else:
            raise TypeError("FlexModel: a group constructor is a HookFunction, a list of them, "
                            f"or a module-name substring, got {type(constructor).__name__}")
        unknown = [h.module_name for h in found if h not in self._groups]
        if unknown:
            raise ValueError(f"FlexModel: HookFunctions {unknown} are not registered")
        return found

    def create_hook_group(self, group_name: str, group_constructor: str,
                          expected_shape: Sequence[int | None] | None = None,
                          editing_function: Callable[..., Any] | None = None,
                          unpack_idx: int = 0, hook_type: str = "forward") -> None:
        """Register one :class:`HookFunction` (built from these arguments) per module whose
        name contains ``group_constructor``, all in group ``group_name`` (and ``"all"``)."""
        kinds = {"forward": self.register_forward_hook,
                 "full_backward_pre": self.register_full_backward_pre_hook}
        if hook_type not in kinds:
            self._unsupported(f"create_hook_group(hook_type={hook_type!r})")
        names = [n for n, _ in self.module.named_modules() if n and group_constructor in n]
        if not names:
            raise KeyError(f"FlexModel: no module name contains {group_constructor!r}")
        for name in names:
            hook = HookFunction(name, expected_shape, editing_function, unpack_idx)
            kinds[hook_type](hook)
            self._groups[hook].add(group_name)

    def update_hook_groups(self, group_constructor: Any, group_name: str) -> None:
        """Add ``group_name`` to the selected HookFunctions (a list, one, or a substring of
        their module names)."""
        for hook in self._select(group_constructor):
            self._groups[hook].add(group_name)

    def remove_hook_groups(self, group_constructor: Any, group_name: str) -> None:
        """Remove ``group_name`` from the selected HookFunctions (``"all"`` cannot be)."""
        if group_name == "all":
            raise ValueError("FlexModel: every HookFunction stays in group 'all'")
        for hook in self._select(group_constructor):
            self._groups[hook].discard(group_name)

    def get_hook_function_groups(self, hook_function: HookFunction) -> set[str]:
        """The groups ``hook_function`` belongs to."""
        return set(self._groups.get(hook_function, set()))

    def get_group_hook_functions(self, group_name: str) -> list[HookFunction]:
        """The HookFunctions of group ``group_name``."""
        return [h for h, groups in self._groups.items() if group_name in groups]

    # -------------------------------------------------------------- running
    def forward(self, *args: Any, groups: str | list[str] = "all", complement: bool = False,
                **kwargs: Any) -> Any:
        """Run the model with the hooks of ``groups`` (default: every hook) -- or, with
        ``complement=True``, with every hook *outside* them -- then append the captures to
        ``output_ptr`` on rank 0 (collective)."""
        wanted = {groups} if isinstance(groups, str) else set(groups)
        active = {h for h, g in self._groups.items() if bool(g & wanted) != complement}
        inspected = self._inspected
        inspected._only_hooks = active
        try:
            out = inspected.module(*args, **kwargs)
        finally:
            inspected._only_hooks = None
        self._collect()
        return out

    def _collect(self) -> None:
        """Move the pending captures (every rank calls this) to ``output_ptr`` on rank 0."""
        inspected = self._inspected
        inspected.flush()
        for name, values in inspected.captured.items():
            self.output_ptr.setdefault(name, []).extend(values)
        inspected.captured.clear()

    def get_module_parameter(self, parameter_name: str,
                             expected_shape: Sequence[int | None] | None = None
                             ) -> torch.Tensor:
        """The full (unsharded) parameter ``parameter_name``, detached, on the host, on every
        rank (collective). ``expected_shape`` is checked against its real global shape."""
        param = self.module.get_parameter(parameter_name)
        hook = HookFunction(parameter_name, expected_shape)
        layout = _Layout(self._inspected, param.detach(), parameter_name, hook,
                         what="the parameter", gather_dp=False)
        with torch.no_grad():
            return layout.full().detach().cpu().clone()

    def restore(self) -> nn.Module:
        """Take every hook off the wrapped module and return it."""
        self._inspected.restore()
        self._groups.clear()
        return self.module

    # -------------------------------------------------------------- FlexModel conveniences
    @property
    def wrapped_module_names(self) -> list[str]:
        """Names of the wrapped module's submodules."""
        return [n for n, _ in self.module.named_modules()]

    @property
    def trainable_modules_names(self) -> list[str]:
        """Names of the trainable modules."""
        return list(self.trainable_modules.keys())

    @property
    def all_modules_names(self) -> list[str]:
        """Wrapped and trainable module names."""
        return self.wrapped_module_names + self.trainable_modules_names

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters (as FlexModel: trainable modules excluded)."""
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers."""
        return self.module.named_buffers(*args, **kwargs)
