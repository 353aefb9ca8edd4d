"""Capture and edit the activations of a sharded model as if it were not sharded.

:class:`InspectedModel` wraps a (tensor-, sequence-, data- or pipeline-) parallel model. Hooks
are registered by module name (``fnmatch`` wildcards) and see the *full* activation:

* a DTensor output is gathered with ``full_tensor()`` (Shard -> all-gather, Partial ->
  all-reduce), whatever mesh it lives on;
* a plain-tensor output of a sharded module (``use_local_output=True``) is examined across the
  tensor-parallel group (local shapes and values exchanged, see :mod:`._layout`): equal pieces
  are a replicated tensor, different ones are gathered along ``sharded_dim`` -- given per hook,
  or the one dimension where ``expected_shape`` differs from the local shape. The global shape
  always comes from the ranks; ``expected_shape`` is only checked against it;
* with ``dp_dim`` set, the (TP-gathered) activation is also gathered across data-parallel
  replicas along ``batch_dim``;
* modules that live on another pipeline stage are captured there and shipped to rank 0 by
  :meth:`InspectedModel.flush` (called at the end of every :meth:`InspectedModel.forward`).

An ``editing_function(full) -> full | None`` may change the activation (or gradient): the edit is
re-sharded back to the module's layout on every rank, so the forward (or backward) continues
with the edited value -- exactly as if the unsharded model had been edited, gradients included
(the edit is differentiable through the gather and re-shard).

Captured values land on rank 0, on the host (``.cpu()``), in :attr:`InspectedModel.captured`
(``{}`` on other ranks): forward activations under the module name, gradients of a module's
output under ``"<name>.grad"``. A module that runs several times between two flushes
(microbatches, a reused block) has its values concatenated along ``batch_dim`` in call order.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from ._layout import ShapeMismatchError, _dtensor_types, _Layout

__all__ = ["HookFunction", "InspectedModel", "ShapeMismatchError"]

EditFn = Callable[[torch.Tensor], "torch.Tensor | None"]


@dataclass(eq=False)  # compared and hashed by identity: hook groups key on instances
class HookFunction:
    """What to do with the output of the modules matching ``module_name``.

    * ``module_name`` -- a module path or an ``fnmatch`` pattern (``"layers.*.mlp"``).
    * ``expected_shape`` -- the global shape of the full activation; ``None`` accepts any shape,
      and a ``None`` entry accepts any size in that dimension. It is checked against the shape
      the real sharding gives, never used to decide the gather (see :mod:`._layout`).
    * ``editing_function`` -- under :class:`InspectedModel`: ``fn(full) -> new full`` (or
      ``None`` to keep ``full``, which it may have changed in place); under
      :class:`~hyperpar.inspect.FlexModel`: FlexModel's ``fn(current_module, inputs, save_ctx,
      modules) -> new full``. Runs on every rank with the same full tensor.
    * ``unpack_idx`` -- which tensor of a module output holding several (tuples, lists, dicts,
      nested) is the activation, counting tensors depth-first (FlexModel's argument).

    Keyword only:

    * ``sharded_dim`` -- for a plain-tensor output sharded over the TP dimension: the tensor
      dimension it is split along (found from the ranks' pieces when omitted).
    * ``group`` -- the hook group, switched on and off per forward call.
    * ``kind`` -- ``"forward"`` (the module's output) or ``"backward"`` (the gradient of the
      loss w.r.t. the module's output).
    * ``capture`` -- store the full value (before the edit) on rank 0.
    """

    module_name: str
    expected_shape: Sequence[int | None] | None = None
    editing_function: Callable[..., Any] | None = None
    unpack_idx: int = 0
    _: KW_ONLY
    sharded_dim: int | None = None
    group: str = "default"
    kind: str = "forward"
    capture: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("forward", "backward"):
            raise ValueError(f"HookFunction kind must be 'forward' or 'backward', got "
                             f"{self.kind!r}")
        if self.expected_shape is not None:
            self.expected_shape = tuple(self.expected_shape)
        if self.editing_function is not None and not callable(self.editing_function):
            raise TypeError(f"HookFunction {self.module_name!r}: editing_function must be "
                            f"callable, got {type(self.editing_function).__name__}")


def _remove_handles(hooks: list[tuple[HookFunction, list[Any]]]) -> None:
    """Take every hook off the model (run by :meth:`InspectedModel.restore` and when the
    wrapper is garbage-collected: it holds no reference to the wrapper)."""
    for _, handles in hooks:
        for handle in handles:
            handle.remove()
    hooks.clear()


class InspectedModel(nn.Module):
    """Wrap ``model`` to capture and edit full activations by module name.

    Args:
        model: the parallelised model (its module names are the hook targets).
        mesh: the device mesh of the model; needed for plain-tensor outputs sharded over TP
            (``tp_dim``) and for gathering across data-parallel replicas (``dp_dim``).
        tp_dim: name of the tensor-parallel mesh dimension (used when ``mesh`` has it).
        dp_dim: name of the data-parallel mesh dimension; ``None``: do not gather replicas.
        batch_dim: the tensor dimension data-parallel replicas split (and microbatches stack).
        output_ptr: the dict captures go to on rank 0 (a new one by default).

    The hooks hold only a weak reference to the wrapper: dropping it (or :meth:`restore`)
    takes them off the model.
    """

    def __init__(self, model: nn.Module, *, mesh: Any = None, tp_dim: str | None = "tp",
                 dp_dim: str | None = None, batch_dim: int = 0,
                 output_ptr: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.module = model
        self.mesh, self.tp_dim, self.dp_dim, self.batch_dim = mesh, tp_dim, dp_dim, batch_dim
        self.captured: dict[str, torch.Tensor] = output_ptr if output_ptr is not None else {}
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._hooks: list[tuple[HookFunction, list[Any]]] = []
        self._disabled: set[str] = set()
        self._only: set[str] | None = None
        self._only_hooks: set[HookFunction] | None = None
        self._concat = True  # several calls of a module between flushes: one tensor
        self._modules_by_name = dict(model.named_modules())
        self._finalizer = weakref.finalize(self, _remove_handles, self._hooks)
        if dp_dim is not None and (mesh is None or dp_dim not in (mesh.mesh_dim_names or ())):
            raise ValueError(f"InspectedModel: dp_dim={dp_dim!r} needs a mesh with that "
                             f"dimension, got mesh={mesh!r}")

    # -------------------------------------------------------------- meshes
    def _sub(self, dim: str | None) -> Any:
        if self.mesh is None or dim is None:
            return None
        # a 1-D mesh without a dp dimension is the tp mesh, whatever its name
        lone_tp = self.mesh.ndim == 1 and dim == self.tp_dim and self.dp_dim is None
        sub = self.mesh if lone_tp else self.mesh.get_mesh_or_none(dim)
        return sub if sub is not None and sub.size() > 1 else None

    def _tp_mesh(self) -> Any:
        return self._sub(self.tp_dim)

    def _dp_mesh(self) -> Any:
        return self._sub(self.dp_dim)

    # -------------------------------------------------------------- registration
    def register_hook(self, hook: HookFunction) -> HookFunction:
        """Attach ``hook`` to every module whose name matches. Collective: a pattern that
        matches no module on any rank raises, naming the closest module names."""
        names = [n for n in self._modules_by_name if n and fnmatch.fnmatchcase(n, hook.module_name)]
        platform = get_platform()
        counts = platform.all_gather_object(len(names)) if platform.is_initialized() \
            else [len(names)]
        if not any(counts):
            close = difflib.get_close_matches(hook.module_name, list(self._modules_by_name), n=3)
            raise KeyError(
                f"inspect: module name {hook.module_name!r} matched nothing under "
                f"{type(self.module).__name__}" + (f"; closest: {close}" if close else "")
            )
        handles = []
        me = weakref.ref(self)
        for name in names:
            module = self._modules_by_name[name]
            handles.append(platform.register_forward_hook(
                module, _make_forward_hook(me, name, hook)))
        self._hooks.append((hook, handles))
        return hook

    def register_forward_hook(self, module_name: str, expected_shape: Sequence[int | None] |
                              None = None, editing_function: EditFn | None = None, *,
                              sharded_dim: int | None = None, group: str = "default",
                              capture: bool = True) -> HookFunction:
        """Capture (and optionally edit) the full output of the modules named ``module_name``."""
        return self.register_hook(HookFunction(module_name, expected_shape, editing_function,
                                               sharded_dim=sharded_dim, group=group,
                                               kind="forward", capture=capture))

    def register_backward_hook(self, module_name: str, expected_shape: Sequence[int | None] |
                               None = None, editing_function: EditFn | None = None, *,
                               sharded_dim: int | None = None, group: str = "default",
                               capture: bool = True) -> HookFunction:
        """Capture (and optionally edit) the full gradient w.r.t. the modules' output."""
        return self.register_hook(HookFunction(module_name, expected_shape, editing_function,
                                               sharded_dim=sharded_dim, group=group,
                                               kind="backward", capture=capture))

    def remove_hooks(self, group: str | None = None) -> None:
        """Remove every hook (of ``group`` only, if given)."""
        keep = []
        for hook, handles in self._hooks:
            if group is None or hook.group == group:
                for h in handles:
                    h.remove()
            else:
                keep.append((hook, handles))
        self._hooks[:] = keep  # the finalizer holds this list

    def restore(self) -> nn.Module:
        """Take every hook off the model and return it (also done when the wrapper is
        garbage-collected)."""
        self._finalizer()
        return self.module

    # -------------------------------------------------------------- groups
    def enable(self, group: str) -> None:
        self._disabled.discard(group)

    def disable(self, group: str) -> None:
        self._disabled.add(group)

    @contextlib.contextmanager
    def hook_groups(self, groups: str | Iterable[str] | None) -> Iterator[None]:
        """Only the hooks of ``groups`` run inside the block (``None``: every enabled one)."""
        old = self._only
        self._only = None if groups is None else ({groups} if isinstance(groups, str)
                                                  else set(groups))
        try:
            yield
        finally:
            self._only = old

    def _active(self, hook: HookFunction) -> bool:
        if self._only_hooks is not None and hook not in self._only_hooks:
            return False
        if hook.group in self._disabled:
            return False
        return self._only is None or hook.group in self._only

    # -------------------------------------------------------------- hooks
    def _visit(self, name: str, hook: HookFunction, x: torch.Tensor, key: str,
               grad_of: Any = None) -> torch.Tensor | None:
        what = "the gradient of the output" if key != name else "the output"
        layout = _Layout(self, x, name, hook, grad_of, what)  # checks expected_shape
        edit = hook.editing_function
        with torch.no_grad() if edit is None else contextlib.nullcontext():
            full = layout.full()
            if tuple(full.shape) != layout.shape:  # a bug in the layout, never the user's
                raise RuntimeError(f"inspect: gathered {what} of {name!r} has shape "
                                   f"{tuple(full.shape)}, its layout says {layout.shape}")
            if hook.capture and layout.is_leader():
                host = full.detach().cpu()
                if host.data_ptr() == full.data_ptr():  # already on the host: keep a copy
                    host = host.clone()
                self._store(key, host)
            if edit is None:
                return None
            new = self._call_edit(hook, name, full)
            if new is None:
                new = full
            if not isinstance(new, torch.Tensor):
                fn = getattr(edit, "__qualname__", None) or repr(edit)
                raise TypeError(
                    f"inspect: editing_function {fn} of hook {hook.module_name!r} on module "
                    f"{name!r} returned {type(new).__name__} ({new!r:.60}); it must return a "
                    f"tensor of shape {tuple(full.shape)} (the edited activation) or None "
                    f"(keep it unchanged)")
            if tuple(new.shape) != tuple(full.shape):
                raise ShapeMismatchError(
                    f"inspect: editing_function of hook {hook.module_name!r} on {name!r} "
                    f"returned shape {tuple(new.shape)} for an input of shape "
                    f"{tuple(full.shape)}; edits must keep the shape")
            return layout.reshard(new)

    def _store(self, key: str, host: torch.Tensor) -> None:
        """Keep a capture until the next :meth:`flush`."""
        self._pending.setdefault(key, []).append(host)

    def _call_edit(self, hook: HookFunction, name: str, full: torch.Tensor) -> Any:
        """Run the hook's editing function (FlexModel overrides the calling convention)."""
        return hook.editing_function(full)

    def _watch_grad(self, name: str, hook: HookFunction, out: torch.Tensor) -> None:
        DTensor = _dtensor_types()[0]
        is_dt = isinstance(out, DTensor)
        target = out.to_local() if is_dt else out
        if not (torch.is_grad_enabled() and target.requires_grad):
            return

        def grad_hook(grad: torch.Tensor) -> torch.Tensor | None:
            new = self._visit(name, hook, grad, f"{name}.grad", out if is_dt else None)
            return new

        target.register_hook(grad_hook)

    # -------------------------------------------------------------- running
    def forward(self, *args: Any, hook_groups: str | Iterable[str] | None = None,
                flush: bool = True, **kwargs: Any) -> Any:
        """Run the model with the hooks of ``hook_groups`` (default: every enabled group),
        then :meth:`flush` the forward captures to rank 0 (collective)."""
        with self.hook_groups(hook_groups) if hook_groups is not None \
                else contextlib.nullcontext():
            out = self.module(*args, **kwargs)
        if flush:
            self.flush()
        return out

    def flush(self) -> dict[str, torch.Tensor]:
        """Move every pending capture to :attr:`captured` on rank 0. Collective: every rank
        calls it (after a backward too, to collect gradient captures)."""
        platform = get_platform()
        local: dict[str, Any] = {
            k: (v if not self._concat else v[0] if len(v) == 1 else torch.cat(v, self.batch_dim))
            for k, v in self._pending.items()}
        self._pending = {}
        if not platform.is_initialized() or platform.world_size() == 1:
            self.captured.update(local)
            return self.captured
        rank = platform.rank()
        keys = platform.all_gather_object(sorted(local))
        provider: dict[str, int] = {}
        for r, ks in enumerate(keys):
            for k in ks:
                provider.setdefault(k, r)
        if rank == 0:
            self.captured.update({k: v for k, v in local.items() if provider[k] == 0})
        for r in sorted(set(provider.values()) - {0}):
            mine = {k: v for k, v in local.items() if provider[k] == r} if rank == r else None
            got = platform.broadcast_object(mine, r)
            if rank == 0:
                self.captured.update(got)
        return self.captured

    def clear(self) -> None:
        """Forget every capture (pending and on rank 0)."""
        self._pending.clear()
        self.captured.clear()


def _make_forward_hook(owner_ref: weakref.ref, name: str, hook: HookFunction
                       ) -> Callable[..., Any]:
    """The forward hook of ``hook`` on module ``name``; a no-op once the wrapper is gone."""
    from torch.utils import _pytree

    def forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
        self = owner_ref()
        if self is None or not self._active(hook):
            return None
        leaves, spec = _pytree.tree_flatten(output)
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if hook.unpack_idx >= len(at) or hook.unpack_idx < -len(at):
            raise TypeError(
                f"inspect: module {name!r} returned {type(output).__name__} with {len(at)} "
                f"tensor(s); hook {hook.module_name!r} needs tensor number {hook.unpack_idx} "
                "(unpack_idx) among them")
        where = at[hook.unpack_idx]
        out = leaves[where]
        if hook.kind == "forward":
            new = self._visit(name, hook, out, name)
        else:
            new = None
            self._watch_grad(name, hook, out)
        if new is None:
            return None
        if isinstance(output, torch.Tensor):
            return new
        leaves[where] = new
        return _pytree.tree_unflatten(leaves, spec)

    return forward_hook
