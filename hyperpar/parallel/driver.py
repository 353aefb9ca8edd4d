"""``parallelize_module``, written once for every framework (this module imports none).

The driver resolves the mesh and the plan, checks the whole plan before anything changes
(every key matches, no module is claimed twice, no style meets an already-parallelized
module, tied parameters are sharded alike), then applies the styles and re-ties shared
parameters. It reads modules and parameters only through the platform
(:meth:`~hyperpar.platform.base.Platform.named_children`, ``named_modules``,
``named_parameters``, ``set_parameter``, ``parameter_placements``); what a style does to a
module is the style's, through the protocol below, implemented by hyperpar's one set of styles
(:mod:`hyperpar.parallel.styles`, the same classes on every framework) and by custom ones.

The style protocol (:class:`StyleBase` gives the bookkeeping; a style supplies ``_apply``):

* ``_claimed()`` -- what the style takes over on a module (``"parameters"``, ``"inputs"``,
  ``"outputs"``); two styles claiming one thing on one module is an error;
* ``_check_applicable(module, fqn, pending)`` -- raise before anything changes;
* ``_check_mesh(module, fqn, mesh)`` -- raise before anything changes, knowing the 1-D mesh
  (default: nothing);
* ``_param_placements(module, owner, name)`` -- the placements the style will give a parameter
  (for tied parameters), ``None`` (left alone) or :data:`UNKNOWN`;
* ``_apply(module, mesh)`` -- shard ``module`` in place over the 1-D ``mesh``;
* ``_mark_applied(module)`` -- record the claims on the module.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from hyperpar.dtensor.errors import AlreadyParallelizedError
from hyperpar.platform import get_platform

from .spec import PlanKeyError, check_src_data_rank, resolve_plan

__all__ = [
    "UNKNOWN",
    "AlreadyParallelizedError",
    "PlanKeyError",
    "StyleBase",
    "TiedParameterError",
    "UnsupportedModuleError",
    "check_ties",
    "find_ties",
    "parallelize_module",
    "register_plan_converter",
    "retie",
]

#: module attribute: {claim ("parameters" / "inputs" / "outputs" / a style name): style repr}
APPLIED = "_hyperpar_parallel"
#: :meth:`StyleBase._param_placements` of a style whose parameter layout is known only after it
#: ran (a custom style): its ties are checked after applying.
UNKNOWN = "unknown"


class UnsupportedModuleError(TypeError):
    """A style was applied to a module type it cannot shard."""


class TiedParameterError(ValueError):
    """A plan shards the holders of one tied parameter differently."""


# --------------------------------------------------------------------------- the style protocol
class StyleBase:
    """The bookkeeping every parallel style shares, on any framework. A style sets ``_claims``
    and implements ``_apply(module, device_mesh)``; ``src_data_rank`` is set by the driver
    (the rank whose full parameters are scattered; ``None``: every rank keeps its own)."""

    src_data_rank: int | None = 0
    #: What this style takes over on a module. ``None``: the style's class name (a custom style
    #: may be applied once per module).
    _claims: tuple[str, ...] | None = None

    def _claimed(self) -> tuple[str, ...]:
        return self._claims if self._claims is not None else (type(self).__name__,)

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement _apply")

    def _check_applicable(self, module: Any, fqn: str,
                          pending: dict[str, str] | None = None) -> None:
        """Raise :class:`AlreadyParallelizedError` if ``module`` (at path ``fqn``) already has
        a style claiming what this one claims, or -- for a style that shards parameters --
        parameters that are distributed already. ``pending``: claims made earlier in the same
        plan, not yet applied. Changes nothing."""
        where = f"{fqn!r}" if fqn else "the root module"
        done = {**getattr(module, APPLIED, {}), **(pending or {})}
        for claim in self._claimed():
            if claim in done:
                raise AlreadyParallelizedError(
                    f"{where} ({type(module).__name__}) is already parallelized: {done[claim]} "
                    f"was applied to it, and {self!r} would take over its {claim} again (its "
                    f"hooks would run twice: outputs doubled, parameters re-sharded). Apply a "
                    f"plan once per module; to change it, rebuild the model and parallelize the "
                    f"fresh one"
                )
        if "parameters" in self._claimed():
            platform = get_platform()
            done_params = [n for n, p in platform.named_parameters(module)
                           if platform.parameter_placements(p) is not None]
            if done_params:
                raise AlreadyParallelizedError(
                    f"{where} ({type(module).__name__}) is already parallelized: its parameters "
                    f"{done_params[:3]} are DTensors already (distribute_module, a parallel "
                    f"style or distribute_tensor made them); {self!r} cannot shard them again. "
                    f"Apply it to the plain module, before any other sharding"
                )

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        """Raise if ``module`` cannot be parallelized over the 1-D ``mesh`` (default: it can).
        Called for every entry of a plan, on every rank, before anything changes."""

    def _param_placements(self, module: Any, owner: Any, name: str) -> Any:
        """The placements applying this style to ``module`` gives parameter ``name`` of
        ``owner`` (``module`` or a submodule): a tuple, ``None`` (left alone) or
        :data:`UNKNOWN` (the default: known only after applying)."""
        return UNKNOWN

    def _before_apply(self, module: Any, device_mesh: Any, fqn: str) -> None:
        """Called by the driver just before :meth:`_apply` (default: nothing)."""

    def _mark_applied(self, module: Any) -> None:
        record = dict(getattr(module, APPLIED, {}))
        record.update({claim: repr(self) for claim in self._claimed()})
        module.__dict__[APPLIED] = record  # beside the module's own state, not through hooks


# --------------------------------------------------------------------------- plan conversion
_CONVERTERS: list[Callable[[Any, str], Any]] = []


def register_plan_converter(convert: Callable[[Any, str], Any]) -> None:
    """Let ``convert(value, path)`` turn a foreign plan value into a hyperpar style (or return
    ``None``): PyTorch's stack registers its ``torch.distributed.tensor.parallel`` twin."""
    if convert not in _CONVERTERS:
        _CONVERTERS.append(convert)


def _convert(value: Any, path: str) -> Any:
    for convert in _CONVERTERS:
        out = convert(value, path)
        if out is not None:
            return out
    return None


# --------------------------------------------------------------------------- tied parameters
#: slots of one shared parameter: [(path "module.name", owner module, attribute name)]
Tie = list[tuple[str, Any, str]]


def find_ties(module: Any) -> list[Tie]:
    """Every parameter held by more than one (module, attribute) slot under ``module``."""
    platform = get_platform()
    slots: dict[int, Tie] = {}
    for fqn, sub in platform.named_modules(module):
        for name, p in platform.named_parameters(sub, recurse=False):
            slots.setdefault(id(p), []).append((f"{fqn}.{name}" if fqn else name, sub, name))
    return [tie for tie in slots.values() if len(tie) > 1]


def _covers(sub: Any, owner: Any) -> bool:
    return owner is sub or any(m is owner for _, m in get_platform().named_modules(sub))


def _describe(placements: Any) -> str:
    return "left unsharded" if placements is None else f"sharded as {tuple(placements)}"


def _mismatch(tie: Tie, placements: list[Any]) -> TiedParameterError:
    (a, _, _), (b, _, _) = tie[0], next(
        (s for s, p in zip(tie, placements, strict=True) if p != placements[0]), tie[1])
    pa = placements[0]
    pb = placements[[s[0] for s in tie].index(b)]
    return TiedParameterError(
        f"{a!r} and {b!r} are one tied parameter, but the plan leaves {a!r} "
        f"{_describe(pa)} and {b!r} {_describe(pb)}; a tie can only be kept when both are "
        f"sharded the same way (e.g. RowwiseParallel(input_layouts=Replicate()) on an Embedding "
        f"and ColwiseParallel() on the Linear head: both Shard(0)). Change one style, or untie "
        f"them before parallelize_module"
    )


def check_ties(ties: list[Tie], entries: list[tuple[str, Any, Any]]) -> None:
    """Before anything is applied: raise if the plan would shard a tie's holders differently
    (styles whose placements are known ahead; custom ones are checked by :func:`retie`)."""
    for tie in ties:
        placements = []
        for _, owner, name in tie:
            got = None
            for _, sub, style in entries:
                if _covers(sub, owner):
                    p = style._param_placements(sub, owner, name)
                    got = p if p is not None else got
            placements.append(got)
        if UNKNOWN in placements:
            continue
        if any(p != placements[0] for p in placements):
            raise _mismatch(tie, placements)


def retie(ties: list[Tie]) -> None:
    """After the styles ran: point every holder of a tie at one distributed parameter."""
    platform = get_platform()
    for tie in ties:
        params = [dict(platform.named_parameters(owner, recurse=False)).get(name)
                  for _, owner, name in tie]
        placements = [platform.parameter_placements(p) for p in params]
        if all(p is None for p in placements):
            continue
        placements = [None if p is None else tuple(p) for p in placements]
        if any(p != placements[0] for p in placements) or any(
                tuple(p.shape) != tuple(params[0].shape) for p in params):
            raise _mismatch(tie, placements)
        for _, owner, name in tie:
            platform.set_parameter(owner, name, params[0])


# --------------------------------------------------------------------------- the driver
def _given_mesh(device_mesh: Any) -> Any:
    if device_mesh is None:
        # `with mesh:` makes a mesh current; its module is loaded if any mesh was made.
        mesh_module = sys.modules.get("hyperpar.dtensor.mesh")
        device_mesh = mesh_module.current_mesh() if mesh_module is not None else None
        if device_mesh is None:
            raise ValueError("parallelize_module: no device_mesh given and no mesh is current "
                             "(pass device_mesh=init_device_mesh(...) or use `with mesh:`)")
    if not hasattr(device_mesh, "get_mesh"):
        raise TypeError(f"parallelize_module needs a DeviceMesh (from init_device_mesh), got "
                        f"{type(device_mesh).__module__}.{type(device_mesh).__name__}")
    return device_mesh


def _resolve_mesh(device_mesh: Any, tp_mesh_dim: str | int | None) -> Any:
    # a 1-D mesh whole, else dim tp_mesh_dim (name or index), else the dim named "tp"
    return device_mesh.get_mesh(tp_mesh_dim, default="tp")


def _mesh_for(style: Any, given: Any, resolved: Any, unresolved: Exception | None) -> Any:
    if getattr(style, "_own_mesh", None) is not None:
        return given  # the style slices it (its _check_mesh and _apply take the mesh given)
    if unresolved is not None:
        raise unresolved
    return resolved


def _apply_style(style: Any, module: Any, mesh: Any, fqn: str,
                 src_data_rank: int | None) -> None:
    style.src_data_rank = src_data_rank
    style._before_apply(module, mesh, fqn)
    try:
        style._apply(module, mesh)
    except UnsupportedModuleError as err:
        raise type(err)(
            f"cannot apply {type(style).__name__} to {fqn or '<root>'!r} "
            f"({type(module).__module__}.{type(module).__name__}): {err}"
        ) from None
    style._mark_applied(module)


def parallelize_module(module: Any, device_mesh: Any = None,
                       parallelize_plan: Any = None, *,
                       src_data_rank: int | None = 0, tp_mesh_dim: str | int | None = None,
                       reshard_input_after_forward: bool | None = None) -> Any:
    """Apply a parallel style, or a plan ``{fqn: style}``, to ``module`` in place (a PyTorch
    ``nn.Module`` or a MindSpore ``nn.Cell``: the platform's framework).

    Plan keys are dotted module paths with ``fnmatch`` wildcards per level
    (``"layers.*.attention.wq"``); a value may itself be a plan dict, applied to every module
    the key matched. A key matching nothing raises, naming the closest paths; the whole plan is
    checked before anything changes. On an n-D mesh the tensor-parallel dimension is
    ``tp_mesh_dim`` (default: the dimension named ``"tp"``). ``src_data_rank``: rank whose full
    parameters are scattered (``None``: each rank uses its own copy). A parameter shared by
    several modules stays one parameter. ``reshard_input_after_forward`` (hyperpar's; not in
    torch): the choice of every ``ColwiseParallel`` of the plan that does not make its own --
    ``True`` saves an all-gathered (sequence-sharded) input as its shard and gathers it again
    in backward, ``False`` keeps it gathered as torch does, ``None`` the default (see
    docs/tensor-parallel.md). Returns ``module``.
    """
    # A style that picks its own mesh dims (the expert styles: "ep", ("ep", "tp")) gets the
    # mesh as given; every other style the tp dim, resolved here as before.
    given = _given_mesh(device_mesh)
    try:
        mesh = _resolve_mesh(given, tp_mesh_dim)
        unresolved: Exception | None = None
    except (KeyError, ValueError) as err:  # MeshDimError: no "tp" dim on an n-D mesh
        mesh, unresolved = None, err
    converted = _convert(parallelize_plan, "")
    if converted is not None:
        parallelize_plan = converted
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given; the module is unchanged",
                      stacklevel=2)
        return module
    platform = get_platform()
    # Resolve and check the whole plan first: a bad entry must leave the model untouched.
    entries = resolve_plan(module, parallelize_plan, children=platform.named_children,
                           is_style=lambda s: isinstance(s, StyleBase), convert=_convert)
    meshes = {id(style): _mesh_for(style, given, mesh, unresolved) for _, _, style in entries}
    pending: dict[int, dict[str, str]] = {}
    for fqn, sub, style in entries:
        style._check_applicable(sub, fqn, pending.get(id(sub)))
        pending.setdefault(id(sub), {}).update({c: repr(style) for c in style._claimed()})
    for fqn, sub, style in entries:  # every rank, before the first broadcast
        if hasattr(style, "_call_reshard"):
            style._call_reshard = reshard_input_after_forward
            style.resolved_reshard_input()  # a bad value / unsupported framework raises here
        if "parameters" in style._claimed():
            check_src_data_rank(type(style).__name__, src_data_rank, meshes[id(style)].size(0))
        style._check_mesh(sub, fqn, meshes[id(style)])
    ties = find_ties(module)
    check_ties(ties, entries)
    for fqn, sub, style in entries:
        _apply_style(style, sub, meshes[id(style)], fqn, src_data_rank)
    retie(ties)  # a parameter shared before stays one parameter (torch splits it)
    return module
