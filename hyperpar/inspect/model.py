"""Capture and edit the activations of a sharded model as if it were not sharded.

:class:`InspectedModel` wraps a (tensor-, sequence-, data- or pipeline-) parallel model. Hooks
are registered by module name (``fnmatch`` wildcards) and see the *full* activation:

* a DTensor output is gathered with ``full_tensor()`` (Shard -> all-gather, Partial ->
  all-reduce), whatever mesh it lives on;
* a plain-tensor output of a sharded module (``use_local_output=True``) is gathered over the
  tensor-parallel mesh dimension along ``sharded_dim`` -- given per hook, or inferred when
  ``expected_shape`` differs from the local shape in exactly one dimension;
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

__all__ = ["HookFunction", "InspectedModel", "ShapeMismatchError"]

EditFn = Callable[[torch.Tensor], "torch.Tensor | None"]


class ShapeMismatchError(ValueError):
    """A gathered activation does not have the hook's ``expected_shape``."""


@dataclass
class HookFunction:
    """What to do with the output of the modules matching ``module_name``.

    * ``module_name`` -- a module path or an ``fnmatch`` pattern (``"layers.*.mlp"``).
    * ``expected_shape`` -- the global shape of the full activation; ``None`` accepts any shape,
      and a ``None`` entry accepts any size in that dimension.
    * ``editing_function`` -- ``fn(full) -> new full`` (or ``None`` to keep ``full``, which it
      may have changed in place); runs on every rank with the same full tensor.
    * ``sharded_dim`` -- for a plain-tensor output sharded over the TP dimension: the tensor
      dimension it is split along (inferred from ``expected_shape`` when omitted).
    * ``group`` -- the hook group, switched on and off per forward call.
    * ``kind`` -- ``"forward"`` (the module's output) or ``"backward"`` (the gradient of the
      loss w.r.t. the module's output).
    * ``capture`` -- store the full value (before the edit) on rank 0.
    """

    module_name: str
    expected_shape: Sequence[int | None] | None = None
    editing_function: EditFn | None = None
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


def _dtensor_types() -> tuple[type, Any, Any, Any]:
    from hyperpar.dtensor import DTensor, Partial, Replicate, Shard

    return DTensor, Replicate, Shard, Partial


def _check_shape(name: str, hook: HookFunction, shape: Sequence[int], what: str) -> None:
    want = hook.expected_shape
    if want is None:
        return
    ok = len(want) == len(shape) and all(w is None or w == s for w, s in zip(want, shape,
                                                                                strict=False))
    if not ok:
        raise ShapeMismatchError(
            f"inspect: {what} of module {name!r} (hook {hook.module_name!r}) has full shape "
            f"{tuple(shape)} but expected_shape is {tuple(want)}"
        )


class _Layout:
    """How one local tensor maps to the full one: ``full()`` gathers, ``reshard(full)`` gives
    back a tensor laid out like the original (differentiable both ways)."""

    def __init__(self, owner: InspectedModel, x: torch.Tensor, name: str, hook: HookFunction,
                 grad_of: Any = None) -> None:
        DTensor, Replicate, Shard, _ = _dtensor_types()
        self.owner, self.x = owner, x
        self.dt: Any = None
        self.was_local = True
        if grad_of is not None:  # x is the local gradient of DTensor grad_of
            from hyperpar.dtensor.placement import grad_placements_of

            self.dt = DTensor.from_local(x, grad_of.device_mesh,
                                         grad_placements_of(tuple(grad_of.placements)),
                                         shape=grad_of.shape)
        elif isinstance(x, DTensor):
            self.dt, self.was_local = x, False
        else:
            dim = hook.sharded_dim
            tp = owner._tp_mesh()
            if dim is None and tp is not None and hook.expected_shape is not None:
                skip = owner.batch_dim % x.ndim if owner._dp_mesh() is not None else None
                dim = self._infer_dim(hook, tuple(x.shape), tp.size(), skip)
            if dim is not None:
                if tp is None:
                    raise ValueError(
                        f"inspect: hook {hook.module_name!r} says sharded_dim={dim} but the "
                        "InspectedModel has no tensor-parallel mesh; pass mesh= (and tp_dim=)")
                dim = dim % x.ndim
                shape = self._global_shape(hook, x, dim, tp.size())
                self.dt = DTensor.from_local(x, tp, [Shard(dim)], shape=shape,
                                             run_check=shape is None)
        self.dp = owner._dp_mesh()
        if self.dt is not None and owner.dp_dim in (self.dt.device_mesh.mesh_dim_names or ()):
            self.dp = None  # a DTensor on a mesh with the dp dim: full_tensor() covers it
        self.dp_dt: Any = None
        self.Replicate, self.Shard = Replicate, Shard

    @staticmethod
    def _infer_dim(hook: HookFunction, local: tuple[int, ...], n: int, skip: int | None
                   ) -> int | None:
        """The one dimension where ``expected_shape`` exceeds the local shape (ignoring the
        batch dimension ``skip`` that data parallelism splits)."""
        want = hook.expected_shape
        if want is None or len(want) != len(local):
            return None
        diff = [d for d, (w, s) in enumerate(zip(want, local, strict=True))
                if w is not None and w != s and d != skip]
        if len(diff) == 1 and -(-want[diff[0]] // n) >= local[diff[0]]:
            return diff[0]
        return None

    @staticmethod
    def _global_shape(hook: HookFunction, x: torch.Tensor, dim: int, n: int
                      ) -> list[int] | None:
        want = hook.expected_shape
        if want is not None and len(want) == x.ndim and want[dim] is not None:
            shape = list(x.shape)
            shape[dim] = int(want[dim])
            return shape
        return None  # ask the ranks (uneven shards)

    def full(self) -> torch.Tensor:
        full = self.dt.full_tensor() if self.dt is not None else self.x
        if self.dp is not None:
            DTensor = type(self.dt) if self.dt is not None else _dtensor_types()[0]
            self.dp_dt = DTensor.from_local(full, self.dp, [self.Shard(self.owner.batch_dim)],
                                            run_check=True)
            full = self.dp_dt.full_tensor()
        return full

    def reshard(self, full: torch.Tensor) -> torch.Tensor:
        DTensor = _dtensor_types()[0]
        y = full
        if self.dp_dt is not None:
            rep = DTensor.from_local(y, self.dp, [self.Replicate()])
            y = rep.redistribute(self.dp, self.dp_dt.placements).to_local()
        if self.dt is None:
            return y
        mesh = self.dt.device_mesh
        rep = DTensor.from_local(y, mesh, [self.Replicate()] * mesh.ndim)
        out = rep.redistribute(mesh, self.dt.placements)
        return out.to_local() if self.was_local else out

    def is_leader(self) -> bool:
        """Whether this rank keeps the capture (first rank of every gathered dimension)."""
        if self.dt is not None and any(c != 0 for c in self.dt.device_mesh.get_coordinate()):
            return False
        return self.dp is None or self.dp.get_local_rank(0) == 0


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
        self._modules_by_name = dict(model.named_modules())
        if dp_dim is not None and (mesh is None or dp_dim not in (mesh.mesh_dim_names or ())):
            raise ValueError(f"InspectedModel: dp_dim={dp_dim!r} needs a mesh with that "
                             f"dimension, got mesh={mesh!r}")

    # -------------------------------------------------------------- meshes
    def _sub(self, dim: str | None) -> Any:
        if self.mesh is None or dim is None:
            return None
        names = self.mesh.mesh_dim_names or ()
        if dim not in names:
            return self.mesh if (self.mesh.ndim == 1 and dim == self.tp_dim
                                 and self.dp_dim is None) else None
        sub = self.mesh[dim]
        return sub if sub.size() > 1 else None

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
        for name in names:
            module = self._modules_by_name[name]
            handles.append(platform.register_forward_hook(
                module, self._make_forward_hook(name, hook)))
        self._hooks.append((hook, handles))
        return hook

    def register_forward_hook(self, module_name: str, expected_shape: Sequence[int | None] |
                              None = None, editing_function: EditFn | None = None, *,
                              sharded_dim: int | None = None, group: str = "default",
                              capture: bool = True) -> HookFunction:
        """Capture (and optionally edit) the full output of the modules named ``module_name``."""
        return self.register_hook(HookFunction(module_name, expected_shape, editing_function,
                                               sharded_dim, group, "forward", capture))

    def register_backward_hook(self, module_name: str, expected_shape: Sequence[int | None] |
                               None = None, editing_function: EditFn | None = None, *,
                               sharded_dim: int | None = None, group: str = "default",
                               capture: bool = True) -> HookFunction:
        """Capture (and optionally edit) the full gradient w.r.t. the modules' output."""
        return self.register_hook(HookFunction(module_name, expected_shape, editing_function,
                                               sharded_dim, group, "backward", capture))

    def remove_hooks(self, group: str | None = None) -> None:
        """Remove every hook (of ``group`` only, if given)."""
        keep = []
        for hook, handles in self._hooks:
            if group is None or hook.group == group:
                for h in handles:
                    h.remove()
            else:
                keep.append((hook, handles))
        self._hooks = keep

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
        if hook.group in self._disabled:
            return False
        return self._only is None or hook.group in self._only

    # -------------------------------------------------------------- hooks
    def _make_forward_hook(self, name: str, hook: HookFunction) -> Callable[..., Any]:
        def forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not self._active(hook):
                return None
            rest: tuple = ()
            if isinstance(output, (tuple, list)) and output and isinstance(output[0],
                                                                          torch.Tensor):
                out, rest = output[0], tuple(output[1:])
            elif isinstance(output, torch.Tensor):
                out = output
            else:
                raise TypeError(f"inspect: module {name!r} returned {type(output).__name__}; "
                                "hooks need a tensor (or a tuple whose first item is one)")
            if hook.kind == "forward":
                new = self._visit(name, hook, out, name)
            else:
                new = None
                self._watch_grad(name, hook, out)
            if new is None:
                return None
            return (new, *rest) if rest or isinstance(output, (tuple, list)) else new

        return forward_hook

    def _visit(self, name: str, hook: HookFunction, x: torch.Tensor, key: str,
               grad_of: Any = None) -> torch.Tensor | None:
        layout = _Layout(self, x, name, hook, grad_of)
        edit = hook.editing_function
        with torch.no_grad() if edit is None else contextlib.nullcontext():
            full = layout.full()
            what = "the gradient of the output" if key != name else "the output"
            _check_shape(name, hook, tuple(full.shape), what)
            if hook.capture and layout.is_leader():
                host = full.detach().cpu()
                if host.data_ptr() == full.data_ptr():  # already on the host: keep a copy
                    host = host.clone()
                self._pending.setdefault(key, []).append(host)
            if edit is None:
                return None
            new = edit(full)
            if new is None:
                new = full
            if tuple(new.shape) != tuple(full.shape):
                raise ShapeMismatchError(
                    f"inspect: editing_function of hook {hook.module_name!r} on {name!r} "
                    f"returned shape {tuple(new.shape)} for an input of shape "
                    f"{tuple(full.shape)}; edits must keep the shape")
            return layout.reshard(new)

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
        local = {k: (v[0] if len(v) == 1 else torch.cat(v, self.batch_dim))
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
