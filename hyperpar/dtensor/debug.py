"""``CommDebugMode``: count the collectives a block of code issues, per kind and per module.

The API of ``torch.distributed.tensor.debug.CommDebugMode`` (which the hyperpar import rewrite
maps here): a context manager; :meth:`CommDebugMode.get_total_counts`,
:meth:`~CommDebugMode.get_comm_counts`, :meth:`~CommDebugMode.get_per_module_comm_counts`,
:meth:`~CommDebugMode.get_parameter_info`, :meth:`~CommDebugMode.generate_comm_debug_tracing_table`
and :meth:`~CommDebugMode.log_comm_debug_tracing_table_to_file`.

It counts at the Platform's collective methods, the one layer every hyperpar collective goes
through (DTensor redistribution, the parallel styles, fully_shard, pipelines, checkpoints), so
it works the same on every framework and needs no dispatch mode. The platform supplies only
the framework's pieces, each optional:

* ``comm_op_key(name)``: the key a count is filed under (PyTorch: torch's legacy functional
  collective ops, ``torch.ops.c10d_functional.all_reduce``, the keys torch's own
  ``CommDebugMode.get_comm_counts()`` uses); without it, the method's name;
* ``track_module_calls(enter, leave)``: call ``enter(module)`` / ``leave(module)`` around every
  module's forward (PyTorch: global forward hooks) for the per-module counts; without it,
  everything counts under ``"Global"``;
* ``in_backward()``: True while autograd runs a backward pass (forward / backward columns).

Counted: ``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``broadcast`` (torch's keys), and under their own names the object
collectives and the barrier (``all_gather_object``, ``broadcast_object``, ``barrier``) and
point-to-point traffic (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``), which
torch's mode does not count. A collective that a platform method issues through another one is
counted once (the outer call). No framework imported here.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["CommDebugMode"]

#: Platform methods counted (the bulk collectives first: the ones torch's mode counts too).
COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_to_all_single", "broadcast", "all_gather_object", "broadcast_object", "barrier",
           "send", "recv", "isend", "irecv", "batch_isend_irecv")
GLOBAL = "Global"

_ACTIVE: list[CommDebugMode] = []
_local = threading.local()  # depth of counted calls on this thread (nested ones not counted)
_MARK = "__hyperpar_comm_counted__"


def _counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return fn(self, *args, **kwargs)
        depth = getattr(_local, "depth", 0)
        if depth == 0:
            for mode in _ACTIVE:
                mode._record(self, name)
        _local.depth = depth + 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            _local.depth = depth

    setattr(counted, _MARK, True)
    return counted


def _install(cls: type) -> None:
    """Wrap ``cls``'s collective methods once (a pass-through while no mode is active)."""
    for name in COUNTED:
        fn = getattr(cls, name, None)
        if fn is not None and not getattr(fn, _MARK, False):
            setattr(cls, name, _counting(name, fn))


class CommDebugMode:
    """Count the collectives issued inside ``with CommDebugMode() as mode:``, in total, per
    kind and per module (a module counts what its forward issues, its submodules' included;
    ``"Global"`` counts everything). Entering clears the previous counts."""

    def __init__(self) -> None:
        self.comm_counts: dict[Any, int] = defaultdict(int)
        self.comm_module_counts: dict[str, dict[str, dict[Any, int]]] = {}
        self._params: dict[str, dict[str, Any]] = {}
        self._depth: dict[str, int] = {}
        self._types: dict[str, str] = {}
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._platform: Any = None
        self._handle: Any = None

    # ------------------------------------------------------------------ the context
    def __enter__(self) -> CommDebugMode:
        from hyperpar.platform import get_platform

        self._platform = get_platform()
        _install(type(self._platform))
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self._params.clear()
        self._names.clear()
        self._stack = [GLOBAL]
        self._depth = {GLOBAL: 0}
        self._types = {}
        self._module(GLOBAL)
        track = getattr(self._platform, "track_module_calls", None)
        self._handle = track(self._enter_module, self._leave_module) if track else None
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # ------------------------------------------------------------------ recording
    def _module(self, fqn: str) -> dict[str, dict[Any, int]]:
        return self.comm_module_counts.setdefault(
            fqn, {"forward": defaultdict(int), "backward": defaultdict(int)})

    def _record(self, platform: Any, name: str) -> None:
        keyer = getattr(platform, "comm_op_key", None)
        key = keyer(name) if keyer is not None else name
        self.comm_counts[key] += 1
        in_bw = getattr(platform, "in_backward", None)
        phase = "backward" if in_bw is not None and in_bw() else "forward"
        # the innermost module and every module around it (torch's tables are inclusive too)
        for fqn in dict.fromkeys(self._stack if phase == "forward" else [GLOBAL]):
            self._module(fqn)[phase][key] += 1

    def _name_of(self, module: Any) -> str:
        name = self._names.get(id(module))
        if name is None:  # a root: its class name, children named after it (torch's rule)
            name = type(module).__name__
            self._names[id(module)] = name
            for child_path, child in self._platform.named_modules(module):
                if child_path:
                    self._names.setdefault(id(child), f"{name}.{child_path}")
        return name

    def _enter_module(self, module: Any) -> None:
        fqn = self._name_of(module)
        self._stack.append(fqn)
        if fqn not in self._depth:
            self._depth[fqn] = len(self._stack) - 1
            self._types[fqn] = f"{type(module).__module__}.{type(module).__qualname__}"
            self._module(fqn)
            for pname, param in self._platform.named_parameters(module, recurse=False):
                self._params.setdefault(fqn, {})[pname] = param

    def _leave_module(self, module: Any) -> None:
        if len(self._stack) > 1:
            self._stack.pop()

    # ------------------------------------------------------------------ torch's API
    def get_total_counts(self) -> int:
        """All collectives counted."""
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> dict[Any, int]:
        """Collective kind (torch's functional-collective op on PyTorch) -> count."""
        return self.comm_counts

    def get_per_module_comm_counts(self) -> dict[str, dict[Any, int]]:
        """Module path (``"Global"``, ``"MLP"``, ``"MLP.w1"`` ...) -> kind -> count, forward and
        backward together."""
        out: dict[str, dict[Any, int]] = {}
        for fqn, phases in self.comm_module_counts.items():
            merged: dict[Any, int] = defaultdict(int)
            for counts in phases.values():
                for key, n in counts.items():
                    merged[key] += n
            out[fqn] = dict(merged)
        return out

    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """Module path -> its own parameters by name (as torch's mode returns them)."""
        return self._params

    def get_sharding_info(self) -> dict[str, Any]:
        """``"<module path>.<parameter>"`` -> placements, for the distributed parameters."""
        out = {}
        for fqn, params in self._params.items():
            for pname, param in params.items():
                placements = self._platform.parameter_placements(param)
                if placements is not None:
                    out[f"{fqn}.{pname}"] = placements
        return out

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """A table of each module (indented by depth) with its forward and backward collective
        counts; ``noise_level >= 1`` adds each module's type and its distributed parameters'
        placements. Levels 2-3 of torch's table also list every DTensor operation; this mode
        counts at the collective layer and sees no operations, so they show what level 1
        shows."""
        sharding = self.get_sharding_info() if noise_level > 0 else {}
        lines = []
        for fqn, depth in self._depth.items():
            indent = "  " * (2 * depth)
            lines.append(f"{indent}{fqn}")
            if noise_level > 0 and fqn in self._types:
                lines.append(f"{indent}*module type: {self._types[fqn]}")
                params = {p: sharding[f"{fqn}.{p}"] for p in self._params.get(fqn, {})
                          if f"{fqn}.{p}" in sharding}
                if params:
                    lines.append(f"{indent}*Parameter List")
                    lines.extend(f"{indent} *{p}: {tuple(pl)}" for p, pl in params.items())
            counts = self.comm_module_counts.get(fqn, {})
            for phase, title in (("forward", "FORWARD PASS"), ("backward", "BACKWARD PASS")):
                if counts.get(phase):
                    lines.append(f"{indent}  {title}")
                    lines.extend(f"{indent}    *{key}: {n}" for key, n in counts[phase].items())
        return "\n".join(lines) + "\n"

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: int = 3) -> None:
        """Write :meth:`generate_comm_debug_tracing_table` to ``file_name`` (no colours)."""
        table = re.sub(r"\x1B\[[0-?]*[ -/]*[@-~]", "",
                       self.generate_comm_debug_tracing_table(noise_level))
        with open(file_name, "w") as f:
            f.write(table)
