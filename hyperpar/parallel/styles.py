"""The tensor-parallel styles, written once for every framework (this module imports none).

``ParallelStyle``, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput`` and ``PrepareModuleInputOutput`` are one set of
classes on PyTorch and on MindSpore: their constructor arguments (torch's names and defaults),
validation and messages, ``__repr__``, which parameter gets which placement (from
:mod:`hyperpar.parallel.spec`) and the applicability check live here. What touches tensors --
sharding parameters, boundary hooks or Cells, the local forward, DTensor outputs -- is the
framework's, reached through the platform: :meth:`Platform.tp_mechanics()
<hyperpar.platform.base.Platform.tp_mechanics>` returns an object with the members below
(:class:`Mechanics`). PyTorch's is in :mod:`hyperpar.torch.parallel.style`, MindSpore's in
``hyperpar_mindspore.parallel``.

Where the frameworks really differ, the difference is the mechanics': MindSpore's
``SequenceParallel`` and ``PrepareModuleInput`` give local tensors by default
(``Mechanics.local_by_default``), and MindSpore refuses at construction a layout its boundaries
cannot reach (``Mechanics.check_style``; PyTorch can make a ``Partial`` output).
"""

from __future__ import annotations

from typing import Any, Protocol

from hyperpar.dtensor.placement import Partial, Placement, Replicate, Shard
from hyperpar.platform import BackendError, get_platform

from .driver import UNKNOWN, StyleBase, UnsupportedModuleError
from .prepare_plan import check_entries
from .spec import (
    COLWISE,
    ROWWISE,
    StyleSpec,
    check_no_empty_piece,
    check_src_data_rank,
    reshard_input,
)

__all__ = [
    "ColwiseParallel",
    "Mechanics",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "as_placement",
    "module_kind",
]


class Mechanics(Protocol):
    """What a framework supplies for the styles (``Platform.tp_mechanics()``)."""

    #: style class names whose ``use_local_output`` defaults to ``True`` here (torch: ``False``)
    local_by_default: frozenset[str]
    #: who cannot compute on an empty piece (named in the refusal), ``None``: no one (torch)
    refuses_empty_pieces: str | None

    def check_style(self, style: Any) -> None:
        """Raise (at construction) for settings this framework cannot run."""

    def check_applicable(self, style: Any, module: Any, fqn: str) -> None:
        """Framework checks before a plan changes anything (after the neutral ones)."""

    def param_names(self, module: Any, kind: str) -> dict[str, str]:
        """The framework's name of each parameter the spec names (``"weight"``, ``"bias"``)."""

    def before_apply(self, style: Any, module: Any, mesh: Any, fqn: str) -> None:
        """Called just before any style's ``_apply`` (debug checks)."""

    def shard(self, style: Any, module: Any, mesh: Any, kind: str) -> Any:
        """Colwise/RowwiseParallel (``style.spec``) on a ``kind`` module: shard, install."""

    def sequence_parallel(self, style: Any, module: Any, mesh: Any) -> Any:
        """SequenceParallel: replicate the parameters, install the slice's hooks."""

    def prepare_inputs(self, style: Any, module: Any, mesh: Any) -> Any:
        """PrepareModuleInput: install the input re-layouts."""

    def prepare_outputs(self, style: Any, module: Any, mesh: Any) -> Any:
        """PrepareModuleOutput: install the output re-layouts."""


def mechanics() -> Mechanics | None:
    """The platform's mechanics, or ``None`` when no backend can be selected yet (a style made
    before one is: the checks that need it run when the style is applied)."""
    try:
        return get_platform().tp_mechanics()
    except BackendError:
        return None


def _local_default(style: Any, name: str, given: bool) -> bool:
    """``given`` when the caller passed it, else this framework's default (torch's ``False``
    unless the mechanics list ``name`` in ``local_by_default``)."""
    if "use_local_output" in getattr(style, "_given", ()):
        return bool(given)
    mech = mechanics()
    return mech is not None and name in mech.local_by_default


def as_placement(p: Any, what: str = "a layout") -> Placement | None:
    """Accept hyperpar placements and, by duck typing, torch's ``Shard``/``Replicate``/
    ``Partial`` (so a plan written for torch runs unchanged). ``None`` stays ``None``."""
    if p is None or isinstance(p, Placement):
        return p
    kind = type(p).__name__
    if kind in ("Shard", "_StridedShard") and hasattr(p, "dim"):
        return Shard(int(p.dim))
    if kind == "Replicate":
        return Replicate()
    if kind in ("Partial", "_Partial", "_NormPartial"):
        return Partial(str(getattr(p, "reduce_op", "sum")))
    raise TypeError(f"{what} must be Shard(dim), Replicate() or Partial(), got {p!r}")


def _layouts(what: str, value: Any) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return tuple(as_placement(v, what) for v in value)
    return (as_placement(value, what),)


def _kw_layouts(what: str, value: dict[str, Any] | None) -> dict[str, Placement | None]:
    return {k: as_placement(v, f"{what}[{k!r}]") for k, v in (value or {}).items()}


def module_kind(module: Any) -> str | None:
    """``"linear"``, ``"embedding"`` (as the platform recognises them) or ``None``."""
    platform = get_platform()
    if platform.is_linear(module):
        return "linear"
    if platform.is_embedding(module):
        return "embedding"
    return None


def _one_d(device_mesh: Any, style: Any) -> Any:
    if device_mesh.ndim != 1:
        raise ValueError(
            f"{type(style).__name__} needs a 1-D mesh, got {device_mesh!r}; pass the "
            f"tensor-parallel sub-mesh (mesh['tp']) or let parallelize_module pick it"
        )
    return device_mesh


def _checked_mesh(device_mesh: Any, style: Any) -> Any:
    """The style's 1-D mesh, once its ``src_data_rank`` is known to be one of its ranks (a
    style that broadcasts parameters checks this on every rank before the first broadcast)."""
    mesh = _one_d(device_mesh, style)
    check_src_data_rank(type(style).__name__, style.src_data_rank, mesh.size(0))
    return mesh


def unsupported_module(style: Any, module: Any, fqn: str) -> UnsupportedModuleError:
    """The error for a sharding style given a module that is neither the platform's linear nor
    its embedding (one message on every framework)."""
    platform = get_platform()
    names = ", ".join(sorted({t.__name__ for t in (*platform.linear_types,
                                                    *platform.embedding_types)}))
    return UnsupportedModuleError(
        f"cannot apply {type(style).__name__} to {fqn or '<root>'!r} "
        f"({type(module).__module__}.{type(module).__name__}): it shards linear and embedding "
        f"modules ({platform.name}: {names}, and their subclasses); give a plan entry for the "
        f"linear/embedding modules inside it instead")


# ---------------------------------------------------------------------------------- styles
class ParallelStyle(StyleBase):
    """How to shard one module (``nn.Module`` or ``nn.Cell``) over a 1-D device mesh.
    ``src_data_rank`` is the rank whose full parameters are scattered (``None``: every rank
    keeps its own chunk). A custom style overrides ``_apply(module, device_mesh)`` (torch's
    spelling) or ``apply`` (HyperParallel's); the bookkeeping is
    :class:`~hyperpar.parallel.driver.StyleBase`'s."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ParallelStyle:
        if cls._apply is ParallelStyle._apply and cls.apply is ParallelStyle.apply:
            raise TypeError(
                f"Can't instantiate {cls.__name__}: a ParallelStyle subclass overrides "
                f"_apply(self, module, device_mesh) (torch's spelling) or apply(self, module, "
                f"device_mesh) (HyperParallel's), shards module in place and returns it"
            )
        obj = super().__new__(cls)
        # the keywords the caller gave: a framework default applies only to the others
        obj.__dict__["_given"] = frozenset(kwargs)
        return obj

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        """Shard ``module`` in place over ``device_mesh`` and return it. A subclass overrides
        this (torch) or :meth:`apply` (HyperParallel); either is what a plan runs."""
        if type(self).apply is not ParallelStyle.apply:
            return type(self).apply(self, module, device_mesh)
        raise NotImplementedError(f"{type(self).__name__} overrides neither _apply nor apply")

    def apply(self, module: Any, device_mesh: Any) -> Any:
        """Public spelling of :meth:`_apply` (refuses an already-parallelized module)."""
        self._check_applicable(module, "")
        self._check_mesh(module, "", device_mesh)
        self._apply(module, device_mesh)
        self._mark_applied(module)
        return module

    def _before_apply(self, module: Any, device_mesh: Any, fqn: str) -> None:
        get_platform().tp_mechanics().before_apply(self, module, device_mesh, fqn)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if k != "src_data_rank" and not k.startswith("_")
                           and not (k == "reshard_input_after_forward" and v is None))
        return f"{type(self).__name__}({fields})"


class _ShardingStyle(ParallelStyle):
    """Colwise/RowwiseParallel: shard a linear/embedding module's parameters as ``spec`` says."""

    spec: StyleSpec
    _claims = ("parameters",)

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = (as_placement(input_layouts, "input_layouts")
                              or self.spec.default_input,)
        self.output_layouts = (as_placement(output_layouts, "output_layouts")
                               or self.spec.default_output,)
        self.desired_input_layouts = (self.spec.desired_input["linear"],)
        self.use_local_output = use_local_output
        mech = mechanics()
        if mech is not None:
            mech.check_style(self)

    def _check_applicable(self, module: Any, fqn: str,
                          pending: dict[str, str] | None = None) -> None:
        super()._check_applicable(module, fqn, pending)
        if module_kind(module) is None:  # before anything changes, on every rank
            raise unsupported_module(self, module, fqn)
        get_platform().tp_mechanics().check_applicable(self, module, fqn)

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        """On a framework whose kernels refuse empty tensors (the mechanics'
        ``refuses_empty_pieces``), no parameter may be split into an empty piece: refused
        here, on every rank, before any module changes (not mid-apply)."""
        mech = get_platform().tp_mechanics()
        who = getattr(mech, "refuses_empty_pieces", None)
        kind = module_kind(module)
        if who is None or kind is None:
            return
        params = dict(get_platform().named_parameters(module, recurse=False))
        for spec_name, name in mech.param_names(module, kind).items():
            dim, param = self.spec.param_dims[kind].get(spec_name), params.get(name)
            if dim is not None and param is not None:
                shape = tuple(param.shape)
                check_no_empty_piece(shape[dim], mesh.size(0), dim, shape,
                                     f"{type(self).__name__} on {fqn or '<root>'!r}: "
                                     f"{name}", who)

    def _param_placements(self, module: Any, owner: Any, name: str) -> Any:
        if owner is not module:
            return None
        kind = module_kind(module)
        if kind is None:
            return UNKNOWN
        for spec_name, fw_name in get_platform().tp_mechanics().param_names(module,
                                                                            kind).items():
            if fw_name == name:
                dim = self.spec.param_dims[kind].get(spec_name)
                return (Replicate(),) if dim is None else (Shard(dim),)
        return None

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        mesh = _checked_mesh(device_mesh, self)
        kind = module_kind(module)
        if kind is None:
            raise unsupported_module(self, module, "")
        self.desired_input_layouts = (self.spec.desired_input[kind],)
        get_platform().tp_mechanics().shard(self, module, mesh, kind)
        return module


class ColwiseParallel(_ShardingStyle):
    """Shard a Linear's weight and bias by rows (``Shard(0)``: output features) or an
    Embedding's weight by columns (``Shard(1)``).

    Input: ``input_layouts`` (default ``Replicate()``) is made replicated -- for a Linear with
    an all-reduce of the input gradient in backward (Megatron's *f*), or an all-gather forward /
    reduce-scatter backward when the input is sequence-sharded. Output: sharded on the last dim,
    converted to ``output_layouts`` (default ``Shard(-1)``); a local tensor unless
    ``use_local_output=False``.
    """

    spec = COLWISE

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None,
                 use_local_output: bool = True,
                 reshard_input_after_forward: bool | None = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        #: ``True``: a Linear whose input is all-gathered (``input_layouts=Shard(d)``, or an
        #: input an earlier boundary gathered) keeps only this rank's shard for backward and
        #: all-gathers it again there (Megatron's sequence parallelism; t times less saved);
        #: ``False``: keeps the gathered input (torch's ``ColwiseParallel``); ``None``: the
        #: ``parallelize_module`` call's choice, else the default (``spec.RESHARD_INPUT_DEFAULT``)
        self.reshard_input_after_forward = reshard_input_after_forward
        self._call_reshard: bool | None = None
        reshard_input(reshard_input_after_forward, None, _reshards(mechanics()))

    def resolved_reshard_input(self) -> bool:
        """What this style does on the current framework (see :func:`spec.reshard_input`)."""
        return reshard_input(self.reshard_input_after_forward, self._call_reshard,
                             _reshards(mechanics()))


def _reshards(mech: Any) -> bool:
    """Whether ``mech`` can save a gathered input as its shard (``None``: not known yet)."""
    return mech is None or bool(getattr(mech, "reshards_gathered_input", False))


class RowwiseParallel(_ShardingStyle):
    """Shard a Linear's weight by columns (``Shard(1)``: input features; bias replicated, added
    once after the reduction) or an Embedding's weight by rows (``Shard(0)``: a
    vocabulary-parallel embedding; ids held elsewhere look up zeros).

    Input: ``input_layouts`` (default ``Shard(-1)``; token ids of an Embedding are made
    replicated). Output: the partial sums are all-reduced to ``output_layouts`` (default
    ``Replicate()``) or reduce-scattered to ``Shard(d)`` (sequence parallelism); a local
    tensor unless ``use_local_output=False``.
    """

    spec = ROWWISE


class SequenceParallel(ParallelStyle):
    """Run a module that works position by position (norms, dropout) on this rank's slice of
    the sequence: parameters are replicated (their gradients are all-reduced), the input is
    taken as / made ``Shard(sequence_dim)``; the output is a ``Shard(sequence_dim)`` DTensor
    unless ``use_local_output=True`` (MindSpore's default: local tensors)."""

    _claims = ("parameters",)

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = _local_default(self, "SequenceParallel", use_local_output)

    @property
    def sequence_dim(self) -> int:
        """The sharded sequence dim."""
        return self.sequence_sharding[0].dim

    def _param_placements(self, module: Any, owner: Any, name: str) -> Any:
        return (Replicate(),)  # every parameter under it, whole

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        get_platform().tp_mechanics().sequence_parallel(self, module,
                                                        _checked_mesh(device_mesh, self))
        return module


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional: ``input_layouts`` -> ``desired_input_layouts``,
    one entry per argument, ``None`` passes through; keyword: the ``*_kwarg_layouts`` dicts)
    before its forward. Inputs come out as DTensors unless ``use_local_output=True``
    (MindSpore's default when the argument is not given: local tensors)."""

    _claims = ("inputs",)

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _layouts("input_layouts", input_layouts)
        self.desired_input_layouts = _layouts("desired_input_layouts", desired_input_layouts)
        self.input_kwarg_layouts = _kw_layouts("input_kwarg_layouts", input_kwarg_layouts)
        self.desired_input_kwarg_layouts = _kw_layouts("desired_input_kwarg_layouts",
                                                       desired_input_kwarg_layouts)
        self.use_local_output = _local_default(self, "PrepareModuleInput", use_local_output)
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None
            and len(self.input_layouts) != len(self.desired_input_layouts)
        ):
            raise ValueError(
                f"input_layouts {self.input_layouts} and desired_input_layouts "
                f"{self.desired_input_layouts} must have the same length"
            )
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"input_kwarg_layouts keys {sorted(self.input_kwarg_layouts)} and "
                f"desired_input_kwarg_layouts keys {sorted(self.desired_input_kwarg_layouts)} "
                f"must match"
            )

    def _param_placements(self, module: Any, owner: Any, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        check_entries(self)
        get_platform().tp_mechanics().prepare_inputs(self, module, _one_d(device_mesh, self))
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs (a tensor or a tuple; ``None`` entries pass through) from
    ``output_layouts`` to ``desired_output_layouts`` after its forward; local tensors unless
    ``use_local_output=False``."""

    _claims = ("outputs",)

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _layouts("output_layouts", output_layouts)
        self.desired_output_layouts = _layouts("desired_output_layouts",
                                               desired_output_layouts)
        self.use_local_output = use_local_output
        if (self.output_layouts is None) != (self.desired_output_layouts is None) or (
            self.output_layouts is not None
            and len(self.output_layouts) != len(self.desired_output_layouts)
        ):
            raise ValueError(
                f"output_layouts {self.output_layouts} and desired_output_layouts "
                f"{self.desired_output_layouts} must have the same length"
            )

    def _param_placements(self, module: Any, owner: Any, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        check_entries(self)
        get_platform().tp_mechanics().prepare_outputs(self, module, _one_d(device_mesh, self))
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module
    (``use_local_input`` is the former's ``use_local_output``)."""

    _claims = ("inputs", "outputs")

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_input: bool = False, output_layouts: Any,
                 desired_output_layouts: Any, use_local_output: bool = True) -> None:
        given = {"use_local_output": use_local_input} if "use_local_input" in self._given else {}
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts, **given,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _param_placements(self, module: Any, owner: Any, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        check_entries(self.prepare_module_output)  # both refused before either is installed
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module
