"""Sequence parallelism and boundary re-layouts on MindSpore Cells: ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``.

Their meaning comes from :mod:`hyperpar.parallel.spec` (:func:`~hyperpar.parallel.spec.
sequence_parallel`, :data:`~hyperpar.parallel.spec.REPLICATED_PARAM_GRAD`,
:func:`~hyperpar.parallel.spec.prepare_comm`); the mechanics are those of :mod:`.parallel`:
boundary Cells with a custom ``bprop`` run from forward hooks. ``use_local_output=False`` gives
MindSpore DTensors (:mod:`.dtensor`); by default activations are local tensors whose layout the
plan declares (torch's ``SequenceParallel`` and ``PrepareModuleInput`` default to DTensors). A
DTensor input is redistributed to the declared layout first. Uneven pieces follow
``torch.chunk``, as on PyTorch.

A Megatron sequence-parallel block::

    {"norm": SequenceParallel(),                                  # on this rank's positions
     "fc1": ColwiseParallel(input_layouts=Shard(1)),              # all-gather the sequence
     "fc2": RowwiseParallel(output_layouts=Shard(1))}             # reduce-scatter it
"""

from __future__ import annotations

from typing import Any

from mindspore import Tensor, nn

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Placement, Replicate, Shard
from hyperpar.parallel.spec import REPLICATED_PARAM_GRAD, prepare_comm, sequence_parallel
from hyperpar.platform import get_platform

from .comm import Boundary
from .graph import refuse_graph_mode
from .parallel import ParallelStyle, as_local, check_layout, check_src_data_rank, wrap_output
from .platform import SHARD_PLACEMENTS

__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
           "SequenceParallel"]


class SequenceParallel(ParallelStyle):
    """Run a position-by-position Cell (``nn.LayerNorm``, ``nn.Dropout``, an RMSNorm) on this
    rank's slice of the sequence (dim ``sequence_dim``).

    Its parameters stay whole, starting from rank 0's values; each rank's gradient of them is a
    partial sum over its slice and is all-reduced in backward. The input is taken to be this
    rank's slice already (as torch does with a local tensor): feed it from
    ``RowwiseParallel(output_layouts=Shard(1))``, an embedding with ``output_layouts=Shard(1)``
    or ``PrepareModuleInput``; the output is the same slice, for
    ``ColwiseParallel(input_layouts=Shard(1))``.
    """

    _claims = ("parameters",)

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool | None = None) -> None:
        # None (the default here): local outputs, as before DTensor ops existed on MindSpore
        self.use_local_output = use_local_output is not False
        self.sequence_dim = sequence_dim
        self.spec = sequence_parallel(sequence_dim)

    def __repr__(self) -> str:
        return f"SequenceParallel(sequence_dim={self.sequence_dim})"

    def _param_placements(self, cell: nn.Cell, owner: nn.Cell, name: str) -> Any:
        return (Replicate(),)  # every parameter under it, whole

    def _apply(self, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        platform = get_platform()
        group = mesh.get_group(0)
        src = self.src_data_rank
        check_src_data_rank("SequenceParallel", src, platform.world_size(group))
        # Every parameter slot of the Cell and its sub-Cells, each held by the Cell that owns it.
        owners = [(sub, name) for _path, sub in platform.named_modules(cell)
                  for name, _ in platform.named_parameters(sub, recurse=False)]
        done: set[int] = set()
        for sub, name in owners:  # rank src's values everywhere (None: each rank its own)
            param = sub._params[name]
            if id(param) in done:
                continue
            done.add(id(param))
            if src is not None:
                full = Tensor(param.asnumpy())
                platform.broadcast(full, group.ranks[src], group)
                param.set_data(full)
            setattr(param, SHARD_PLACEMENTS, (Replicate(),))
        grad_sum = Boundary(platform, REPLICATED_PARAM_GRAD, group, "SequenceParallel parameter")
        saved: list[list[Any]] = []

        seq, use_local = Shard(self.sequence_dim), self.use_local_output

        def use_summed_grads(_cell: nn.Cell, args: tuple) -> tuple | None:
            now = [sub._params[name] for sub, name in owners]  # a tie may have replaced one
            saved.append(now)
            for (sub, name), param in zip(owners, now, strict=True):
                sub._params[name] = grad_sum(param)  # the forward sees the parameter itself
            if args and isinstance(args[0], Tensor):  # a DTensor: to this rank's slice
                return (as_local(args[0], seq, "SequenceParallel input"), *args[1:])
            return None

        def restore(_cell: nn.Cell, args: tuple, out: Any) -> Any:
            for (sub, name), param in zip(owners, saved.pop(), strict=True):
                sub._params[name] = param
            if use_local or not isinstance(out, Tensor):
                return None
            return wrap_output(out, mesh, seq, None, "SequenceParallel output")

        platform.register_forward_pre_hook(cell, use_summed_grads)
        platform.register_forward_hook(cell, restore)
        refuse_graph_mode(cell, "SequenceParallel", "its hooks swap parameters, which a "
                          "compiled graph does not replay")
        return cell


def _layouts(what: str, value: Any) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return tuple(check_layout(what, v) for v in items)


class _Converter:
    """Re-lay out a tuple of local tensors (one layout per entry; ``None`` passes through)."""

    def __init__(self, style: str, what: str, layouts: tuple, desired: tuple,
                 mesh: DeviceMesh, names: tuple[str, ...] | None = None,
                 use_local: bool = True) -> None:
        platform = get_platform()
        group = mesh.get_group(0)
        self.style, self.what, self.names = style, what, names
        self.mesh, self.use_local = mesh, use_local
        self.layouts, self.desired = layouts, desired
        self.boundaries: list[Boundary | None] = []
        for i, (src, dst) in enumerate(zip(layouts, desired, strict=True)):
            if src is None:
                self.boundaries.append(None)
                continue
            at = repr(names[i]) if names else i
            if dst is None:
                raise ValueError(f"{style} {what} {at}: layout {src} given but desired layout "
                                 f"None; give both (or None for both to leave it as it is)")
            self.boundaries.append(Boundary(platform, prepare_comm(src, dst), group,
                                            f"{style} {what} {at} ({src} -> {dst})"))

    def by_name(self, kwargs: dict) -> dict:
        """The keyword inputs this converter has layouts for, converted (absent ones skipped)."""
        out = {}
        for name, boundary in zip(self.names or (), self.boundaries, strict=True):
            if name not in kwargs or boundary is None:
                continue
            x = kwargs[name]
            if not isinstance(x, Tensor):
                raise TypeError(f"{self.style} {self.what} {name!r}: a layout is given but the "
                                f"value is a {type(x).__name__}, not a Tensor")
            i = self.names.index(name)
            out[name] = self._convert(x, i, boundary, f"{self.what} {name!r}")
        return out

    def _convert(self, x: Any, i: int, boundary: Boundary, what: str) -> Any:
        x = as_local(x, self.layouts[i], f"{self.style} {what}")  # a DTensor: to the layout
        y = boundary(x)
        if self.use_local:
            return y
        return wrap_output(y, self.mesh, self.desired[i], None, f"{self.style} {what}")

    def __call__(self, values: tuple) -> tuple:
        if len(values) != len(self.boundaries):
            raise ValueError(f"{self.style}: {len(self.boundaries)} {self.what} layouts given "
                             f"but the Cell has {len(values)} {self.what}s; give one layout per "
                             f"{self.what} (None leaves one as it is)")
        out = []
        for i, (x, boundary) in enumerate(zip(values, self.boundaries, strict=True)):
            if boundary is not None and not isinstance(x, Tensor):
                raise TypeError(f"{self.style} {self.what} {i}: a layout is given but the value "
                                f"is a {type(x).__name__}, not a Tensor; give None for it")
            out.append(x if boundary is None else self._convert(x, i, boundary,
                                                                 f"{self.what} {i}"))
        return tuple(out)


def _check_pairs(what: str, layouts: tuple | None, desired: tuple | None) -> None:
    if (layouts is None) != (desired is None) or (
            layouts is not None and len(layouts) != len(desired)):
        raise ValueError(f"{what}_layouts {layouts} and desired_{what}_layouts {desired} must "
                         f"have the same length")


class PrepareModuleInput(ParallelStyle):
    """Re-lay out a Cell's inputs before its ``construct``: positional input ``i`` goes from
    ``input_layouts[i]`` to ``desired_input_layouts[i]`` (``None`` passes through), keyword
    input ``k`` from ``input_kwarg_layouts[k]`` to ``desired_input_kwarg_layouts[k]``. E.g.
    ``PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1))`` keeps this
    rank's slice of the sequence (its gradient all-gathered back)."""

    _claims = ("inputs",)

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_output: bool | None = None) -> None:
        # None (the default here): local inputs, as before DTensor ops existed on MindSpore
        self.use_local_output = use_local_output is not False
        self.input_layouts = _layouts("input_layouts", input_layouts)
        self.desired_input_layouts = _layouts("desired_input_layouts", desired_input_layouts)
        _check_pairs("input", self.input_layouts, self.desired_input_layouts)
        self.input_kwarg_layouts = {k: check_layout(f"input_kwarg_layouts[{k!r}]", v)
                                    for k, v in (input_kwarg_layouts or {}).items()}
        self.desired_input_kwarg_layouts = {
            k: check_layout(f"desired_input_kwarg_layouts[{k!r}]", v)
            for k, v in (desired_input_kwarg_layouts or {}).items()}
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"input_kwarg_layouts keys {sorted(self.input_kwarg_layouts)} and "
                f"desired_input_kwarg_layouts keys {sorted(self.desired_input_kwarg_layouts)} "
                f"must match")

    def __repr__(self) -> str:
        kw = (f", input_kwarg_layouts={self.input_kwarg_layouts}, desired_input_kwarg_layouts="
              f"{self.desired_input_kwarg_layouts}") if self.input_kwarg_layouts else ""
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, "
                f"desired_input_layouts={self.desired_input_layouts}{kw})")

    def _param_placements(self, cell: nn.Cell, owner: nn.Cell, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        if self.input_layouts is None and not self.input_kwarg_layouts:
            return cell
        # torch's rule: one layout per positional input. A sequence length that is not a
        # torch.chunk split is caught by the boundary, on every rank, before it communicates.
        convert = None if self.input_layouts is None else _Converter(
            "PrepareModuleInput", "input", self.input_layouts, self.desired_input_layouts, mesh,
            use_local=self.use_local_output)
        keys = tuple(self.input_kwarg_layouts)
        convert_kw = _Converter("PrepareModuleInput", "keyword input",
                                tuple(self.input_kwarg_layouts[k] for k in keys),
                                tuple(self.desired_input_kwarg_layouts[k] for k in keys), mesh,
                                names=keys, use_local=self.use_local_output) if keys else None

        def before(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if convert is not None:
                args = convert(tuple(args))
            if convert_kw is not None:
                kwargs = dict(kwargs)
                kwargs.update(convert_kw.by_name(kwargs))
            return args, kwargs

        get_platform().register_forward_pre_hook(cell, before, with_kwargs=True)
        refuse_graph_mode(cell, "PrepareModuleInput", "its re-layouts run in PyNative mode only")
        return cell


class PrepareModuleOutput(ParallelStyle):
    """Re-lay out a Cell's output (a tensor or a tuple; ``None`` entries pass through) after its
    ``construct``: from ``output_layouts`` to ``desired_output_layouts``. E.g.
    ``PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())``
    gathers the sequence (the gradient keeps this rank's slice)."""

    _claims = ("outputs",)

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any,
                 use_local_output: bool = True) -> None:
        self.use_local_output = use_local_output
        self.output_layouts = _layouts("output_layouts", output_layouts)
        self.desired_output_layouts = _layouts("desired_output_layouts", desired_output_layouts)
        _check_pairs("output", self.output_layouts, self.desired_output_layouts)

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts})")

    def _param_placements(self, cell: nn.Cell, owner: nn.Cell, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        convert = _Converter("PrepareModuleOutput", "output", self.output_layouts,
                             self.desired_output_layouts, mesh, use_local=self.use_local_output)

        def after(_cell: nn.Cell, args: tuple, out: Any) -> Any:
            if isinstance(out, tuple):
                return convert(out)
            return convert((out,))[0]

        get_platform().register_forward_hook(cell, after)
        refuse_graph_mode(cell, "PrepareModuleOutput", "its re-layouts run in PyNative mode only")
        return cell


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one Cell."""

    _claims = ("inputs", "outputs")

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_input: bool | None = None, output_layouts: Any,
                 desired_output_layouts: Any, use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _param_placements(self, cell: nn.Cell, owner: nn.Cell, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        self.prepare_module_input._apply(cell, mesh)
        return self.prepare_module_output._apply(cell, mesh)

