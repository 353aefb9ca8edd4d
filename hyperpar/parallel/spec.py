"""What each tensor-parallel style *means*, written once for every framework.

A style's meaning is data: which dim of each parameter is split, what layout the local compute
produces, and what each module boundary communicates forward and backward. The mechanics --
differentiable collectives, parameter swap, hooks -- belong to each framework (the styles of
:mod:`hyperpar.parallel.styles` reach them through ``Platform.tp_mechanics()``). This module
imports no framework.

Conventions (the weights' own layouts, as both frameworks store them):

* linear: ``weight`` is ``(out_features, in_features)`` (``nn.Linear``, MindSpore ``nn.Dense``,
  ``mint.nn.Linear``), ``bias`` is ``(out_features,)``;
* embedding: ``weight`` is ``(num_embeddings, embedding_dim)``.

Plan resolution (:func:`resolve_plan`) is here too: dotted paths with ``fnmatch`` wildcards per
level, nested plans, and the error that names the closest paths when a key matches nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hyperpar.dtensor.layout import _plan as plan_steps
from hyperpar.dtensor.placement import Partial, Placement, Replicate, Shard, chunk_bounds

__all__ = [
    "COLWISE",
    "REPLICATED_PARAM_GRAD",
    "ROWWISE",
    "Comm",
    "PlanKeyError",
    "StyleSpec",
    "boundary",
    "boundary_global_shape",
    "check_divisible",
    "check_no_empty_piece",
    "check_reachable",
    "check_src_data_rank",
    "check_style_input",
    "RESHARD_INPUT_DEFAULT",
    "reshard_input",
    "feature_lengths",
    "local_range",
    "output_global_shape",
    "param_placement",
    "prepare_comm",
    "resolve_plan",
    "row_bias",
    "sequence_parallel",
]

ModuleKind = Literal["linear", "embedding"]
#: How the gradient of a replicated activation arrives: ``"partial"`` when the consumer is a
#: sharded-weight compute (each rank holds a partial sum of it), ``"replicate"`` otherwise.
GradKind = Literal["partial", "replicate"]


@dataclass(frozen=True)
class Comm:
    """One boundary's communication: the forward op and its backward (the adjoint).

    Ops: ``"none"``, ``"all_gather"`` (along ``dim``), ``"reduce_scatter"`` (along ``dim``),
    ``"all_reduce"``, ``"chunk"`` (keep this rank's piece along ``dim``: no communication),
    ``"all_to_all"`` (split ``dim``, concatenate ``dim2``; backward swaps them).
    """

    forward: str
    backward: str
    dim: int | None = None
    dim2: int | None = None

    def __str__(self) -> str:
        at = "" if self.dim is None else f"(dim={self.dim}" + (
            "" if self.dim2 is None else f"->{self.dim2}") + ")"
        return f"fwd {self.forward}{at}, bwd {self.backward}"


def boundary(src: Placement, dst: Placement, grad: GradKind = "replicate") -> Comm:
    """The communication that turns an activation laid out as ``src`` into ``dst``.

    The forward is the DTensor redistribution planner's one step on a 1-D mesh
    (:mod:`hyperpar.dtensor.layout`: one table for DTensors and style boundaries, on every
    framework); this adds the tensor-parallel backward. ``grad`` says how the gradient of a
    *replicated* result arrives (see :data:`GradKind`): a replicated input to a column-parallel
    layer gets partial gradients (all-reduced or reduce-scattered in backward, Megatron's
    ``f``); a replicated output consumed by replicated code gets the full gradient (only this
    rank's piece is kept, Megatron's gather/split).
    """
    if src == dst:
        if isinstance(dst, Replicate) and grad == "partial":
            return Comm("none", "all_reduce")
        return Comm("none", "none")
    steps = plan_steps((2,), (src,), (dst,))  # 2 ranks: any size > 1 plans alike
    if len(steps) != 1 or steps[0][0] not in _BOUNDARY_STEPS:
        raise ValueError(
            f"no tensor-parallel boundary turns {src} into {dst}: a boundary may gather, "
            f"reduce, scatter or re-shard an activation, not make one Partial; use Replicate() "
            f"or Shard(d)")
    kind, _, _, a, b = steps[0]
    forward, backward = _BOUNDARY_STEPS[kind]
    if kind == "gather" and grad == "partial":
        backward = "reduce_scatter"
    if kind == "allreduce":
        return Comm(forward, backward)
    return Comm(forward, backward, a, b if kind == "all_to_all" else None)


#: the planner's step kind -> a boundary's forward op and its backward (a gather's backward is
#: a reduce-scatter instead when the gradients arrive partial)
_BOUNDARY_STEPS = {"gather": ("all_gather", "chunk"), "chunk": ("chunk", "all_gather"),
                   "allreduce": ("all_reduce", "none"),
                   "reduce_scatter": ("reduce_scatter", "all_gather"),
                   "all_to_all": ("all_to_all", "all_to_all")}


@dataclass(frozen=True)
class StyleSpec:
    """The framework-neutral meaning of one sharding style.

    ``param_dims[kind][name]`` is the dim of parameter ``name`` split over the mesh dim
    (``None``: kept whole, replicated). ``local_output[kind]`` is the layout of the output the
    local compute produces from local shards. ``desired_input[kind]`` is the layout the local
    compute needs, and ``input_grad`` how a replicated input's gradient arrives.
    """

    name: str
    param_dims: Mapping[str, Mapping[str, int | None]]
    local_output: Mapping[str, Placement]
    desired_input: Mapping[str, Placement]
    default_input: Placement
    default_output: Placement
    input_grad: Mapping[str, GradKind]

    def kinds(self) -> tuple[str, ...]:
        """Module kinds this style applies to."""
        return tuple(self.param_dims)

    def input_comm(self, kind: str, given: Placement | None = None) -> Comm:
        """Forward/backward communication at the input of a ``kind`` module."""
        src = self.default_input if given is None else given
        return boundary(src, self.desired_input[kind], self.input_grad[kind])

    def output_comm(self, kind: str, wanted: Placement | None = None) -> Comm:
        """Forward/backward communication at the output of a ``kind`` module."""
        dst = self.default_output if wanted is None else wanted
        return boundary(self.local_output[kind], dst, "replicate")


def param_placement(spec: StyleSpec, kind: str, name: str) -> Placement:
    """The placement of parameter ``name`` of a ``kind`` module under ``spec`` on the style's
    1-D mesh: ``Shard`` of its split dim, ``Replicate`` when kept whole."""
    dim = spec.param_dims[kind][name]
    return Replicate() if dim is None else Shard(dim)


#: Column-wise: the output features (linear) / the embedding dim (embedding) are split. The input
#: is replicated, so its gradient is a partial sum (all-reduced in backward); the local output is
#: sharded on the last dim.
COLWISE = StyleSpec(
    name="ColwiseParallel",
    param_dims={"linear": {"weight": 0, "bias": 0}, "embedding": {"weight": 1}},
    local_output={"linear": Shard(-1), "embedding": Shard(-1)},
    desired_input={"linear": Replicate(), "embedding": Replicate()},
    default_input=Replicate(),
    default_output=Shard(-1),
    input_grad={"linear": "partial", "embedding": "replicate"},
)

#: Row-wise: the input features (linear) / the vocabulary (embedding) are split. A linear takes
#: its input sharded on the last dim and produces partial sums (the bias, kept whole, is added
#: once after the reduction); an embedding looks up the rows it holds (others give zeros), a
#: partial sum too. The default output is replicated: an all-reduce forward, nothing backward.
ROWWISE = StyleSpec(
    name="RowwiseParallel",
    param_dims={"linear": {"weight": 1, "bias": None}, "embedding": {"weight": 0}},
    local_output={"linear": Partial(), "embedding": Partial()},
    desired_input={"linear": Shard(-1), "embedding": Replicate()},
    default_input=Shard(-1),
    default_output=Replicate(),
    input_grad={"linear": "replicate", "embedding": "replicate"},
)


@dataclass(frozen=True)
class RowBias:
    """How a row-wise linear adds its whole (replicated) bias once its partial sums are
    reduced to the output layout. ``grad`` is the bias's boundary (nothing forward; an
    all-reduce backward where each rank's gradient is only a part of it). ``one_rank``: the
    output is still a ``Partial`` sum over the ranks, so only the mesh's rank 0 adds the bias
    (every rank adding it would count it once per rank); the others add it times zero, which
    keeps every rank in the backward all-reduce."""

    grad: Comm
    one_rank: bool

    def share(self, rank: int) -> float:
        """What the mesh's rank ``rank`` multiplies the bias by before adding it: 1, or 0 on
        every rank but 0 when only one rank adds it (:attr:`one_rank`)."""
        return 0.0 if self.one_rank and rank != 0 else 1.0


def row_bias(output: Placement) -> RowBias:
    """The :class:`RowBias` of a ``RowwiseParallel`` linear whose output is laid out as
    ``output``: replicated -> each rank adds it, its gradient is whole already; ``Shard(d)``
    -> each rank adds it to its rows (a partial gradient, all-reduced); ``Partial`` -> rank 0
    adds it (rank 0's gradient, all-reduced so every rank steps alike)."""
    if isinstance(output, Replicate):
        return RowBias(Comm("none", "none"), one_rank=False)
    return RowBias(Comm("none", "all_reduce"), one_rank=isinstance(output, Partial))


def sequence_parallel(sequence_dim: int = 1) -> StyleSpec:
    """``SequenceParallel``: a module that works position by position (norms, dropout) runs on
    this rank's slice of the sequence. Its parameters stay whole (replicated, from rank 0); its
    input is taken to be, and its output is, ``Shard(sequence_dim)`` -- a local input is this
    rank's slice already, so neither boundary communicates. Each rank's gradient of a parameter
    is a partial sum over its slice: see :data:`REPLICATED_PARAM_GRAD`."""
    seq = Shard(sequence_dim)
    return StyleSpec(
        name="SequenceParallel",
        param_dims={"module": {}},
        local_output={"module": seq},
        desired_input={"module": seq},
        default_input=seq,
        default_output=seq,
        input_grad={"module": "replicate"},
    )


#: A replicated parameter used on a slice of the activations (``SequenceParallel``): nothing
#: forward, its gradient all-reduced backward so every rank steps with the whole-sequence one.
REPLICATED_PARAM_GRAD = boundary(Replicate(), Replicate(), "partial")


def prepare_comm(src: Placement, dst: Placement) -> Comm:
    """``PrepareModuleInput``/``PrepareModuleOutput``: turn a local activation laid out as
    ``src`` into ``dst``. The result is used as a local tensor, whose gradient arrives laid out
    as ``dst`` (torch's ``to_local`` takes it so), hence ``grad="replicate"``."""
    return boundary(src, dst, "replicate")


def check_divisible(style: str, path: str, param: str, shape: Iterable[int], dim: int,
                    n: int) -> None:
    """Raise when ``param`` of ``path`` cannot be split evenly over ``n`` ranks along ``dim``."""
    shape = tuple(shape)
    size = shape[dim]
    if size % n:
        raise ValueError(
            f"{style} on {path or '<root>'!r}: {param} of shape {shape} has size {size} on dim "
            f"{dim}, not divisible by the {n} tensor-parallel ranks; pick a size divisible by {n}"
            f" or a tensor-parallel degree that divides {size}"
        )


def check_src_data_rank(who: str, src_data_rank: int | None, n: int) -> None:
    """Raise for a source rank outside the ``n``-rank group: a plain argument check, so every
    rank raises the same error before any broadcast (an out-of-range index would fail inside a
    collective on some ranks; a negative one would silently pick a rank from the end)."""
    if src_data_rank is not None and not 0 <= src_data_rank < n:
        raise ValueError(f"{who}: src_data_rank={src_data_rank} is not a rank of the "
                         f"{n}-rank tensor-parallel group; give 0..{n - 1}, or None for each "
                         f"rank to keep its own parameters")


def check_reachable(style: str, spec: StyleSpec, input: Placement, output: Placement) -> None:
    """Raise when no tensor-parallel boundary of ``spec`` turns ``input`` into what the local
    compute takes, or its output into ``output``, for some module kind (a ``Partial``
    column-parallel output: only a DTensor redistribution can make one)."""
    for what, given in (("input", input), ("output", output)):
        try:
            for kind in spec.kinds():
                (spec.input_comm if what == "input" else spec.output_comm)(kind, given)
        except ValueError as exc:
            raise ValueError(f"{style}({what}_layouts={given!r}): {exc}") from None


def feature_lengths(kind: str, weight_shape: tuple[int, ...]) -> tuple[int | None, int]:
    """The global length of the last (feature) dim of a ``kind`` module's input and output,
    read from its weight's global shape (the conventions above): a linear's
    ``(in_features, out_features)``; an embedding's input is ids (``None``), its output
    ``embedding_dim`` long. A boundary gathering that dim needs no exchange of lengths."""
    if kind == "linear":
        return weight_shape[1], weight_shape[0]
    return None, weight_shape[1]


def output_global_shape(spec: StyleSpec, kind: str, local_shape: tuple[int, ...],
                        weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape of the local compute's output (``local_shape``: this rank's): its shard
    dim, when ``spec.local_output`` is one, is the weight's feature length; a ``Partial`` sum
    is as long as the whole."""
    local = spec.local_output[kind]
    if not isinstance(local, Shard):
        return tuple(local_shape)
    shape = list(local_shape)
    shape[local.dim % len(shape)] = feature_lengths(kind, weight_shape)[1]
    return tuple(shape)


def check_style_input(placements: Iterable[Placement], what: str) -> Placement:
    """The one placement of a style's DTensor input (``what``: the style and side, for the
    message); raise unless the DTensor lives on a 1-D mesh -- a style communicates over one
    tensor-parallel group, and which dim of a wider mesh is that group is not the input's to
    say. Every rank holds the same placements, so every rank raises, before any collective."""
    placements = tuple(placements)
    if len(placements) != 1:
        raise ValueError(
            f"{what}: expected a DTensor on a 1-D mesh, got placements {placements}; pass "
            f"the input as a DTensor on the tensor-parallel slice of the mesh (mesh['tp'], the "
            f"mesh the plan was applied with) or as this rank's local tensor")
    return placements[0]


def boundary_global_shape(local_shape: Iterable[int], placement: Placement,
                          length: int | None, exchanged: Callable[[int], int]
                          ) -> tuple[int, ...]:
    """The global shape of a boundary tensor whose local piece has ``local_shape``, laid out as
    ``placement``: along a ``Shard`` dim, ``length`` when the caller knows it (a weight's
    feature length, a DTensor input's shape), else ``exchanged(dim)`` -- the framework's
    exchange of the ranks' lengths (one small collective, only then)."""
    shape = list(local_shape)
    if isinstance(placement, Shard):
        d = placement.dim % len(shape)
        shape[d] = length if length is not None else exchanged(d)
    return tuple(shape)


def local_range(spec: StyleSpec, kind: str, name: str, shape: tuple[int, ...], n: int,
                rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s ``torch.chunk`` piece of parameter ``name`` (global
    ``shape``) along its split dim (a row-wise embedding: the ids this rank looks up)."""
    dim = spec.param_dims[kind][name]
    if dim is None:
        raise ValueError(f"{spec.name} keeps {name} of a {kind} whole: it has no piece")
    return chunk_bounds(shape[dim], n, rank)


def check_no_empty_piece(size: int, n: int, dim: int, shape: Iterable[int], what: str = "",
                         who: str = "the kernels") -> None:
    """Raise when ``torch.chunk`` would leave a rank an empty piece of ``size`` (``6`` over
    ``4``: ``[2, 2, 2, 0]``), for a framework whose kernels (``who``) refuse empty tensors.
    Every rank sees the same sizes, so every rank raises, before any collective."""
    lengths = [chunk_bounds(size, n, k)[1] for k in range(n)]
    if 0 in lengths:
        at = f"{what}: " if what else ""
        fits = [s for s in range(max(1, size - n), size + n + 1)
                if all(chunk_bounds(s, n, k)[1] for k in range(n))]
        raise ValueError(
            f"{at}cannot split dim {dim} of size {size} (shape {tuple(shape)}) over {n} "
            f"tensor-parallel ranks: torch.chunk's pieces {lengths} leave a rank an empty "
            f"piece, which {who} cannot compute on; use a size that gives every rank at least "
            f"one (near {size}: {', '.join(map(str, fits[:4]))}), or fewer ranks"
        )


#: Whether a column-parallel linear fed an all-gathered (sequence-sharded) input keeps only the
#: shard for backward and all-gathers it again there (Megatron's sequence parallelism), unless a
#: style or a ``parallelize_module`` call says otherwise. Chosen from
#: ``benchmarks/bench_sp_memory.py`` (see docs/tensor-parallel.md): the saved input shrinks t
#: times for one more all-gather per gathered input in backward.
RESHARD_INPUT_DEFAULT = True


def reshard_input(style_value: bool | None, call_value: bool | None, supported: bool,
                  who: str = "ColwiseParallel") -> bool:
    """Whether a column-parallel boundary saves its input's shard (gathering it again in
    backward) rather than the gathered input: the style's own ``reshard_input_after_forward``
    when given, else the ``parallelize_module`` call's, else :data:`RESHARD_INPUT_DEFAULT` --
    where the framework's mechanics can (``supported``); an explicit ``True`` where they cannot
    is refused (never silently ignored), the default falls back to keeping the gathered input."""
    given = style_value if style_value is not None else call_value
    if given is not None and not isinstance(given, bool):
        raise TypeError(f"{who}: reshard_input_after_forward must be True, False or None, got "
                        f"{given!r}")
    if not supported:
        if given:
            raise NotImplementedError(
                f"{who}(reshard_input_after_forward=True): this framework's tensor-parallel "
                f"mechanics keep the gathered input for backward (no re-gather); pass False "
                f"or leave it None")
        return False
    return RESHARD_INPUT_DEFAULT if given is None else given


# --------------------------------------------------------------------------- plans
class PlanKeyError(ValueError):
    """A ``parallelize_plan`` key matched no submodule."""


def _generic(names: Iterable[str]) -> list[str]:
    names = list(names)
    generic = {re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n) for n in names}
    return sorted(set(names) | generic)


def resolve_plan(module: Any, plan: Any, *, children: Callable[[Any], Iterable[tuple[str, Any]]],
                 is_style: Callable[[Any], bool], prefix: str = "",
                 convert: Callable[[Any, str], Any] | None = None
                 ) -> list[tuple[str, Any, Any]]:
    """``(path, submodule, style)`` for every entry of ``plan``, nested plans expanded, in
    application order. ``children(m)`` lists ``(name, child)`` pairs (``named_children`` on
    torch, ``name_cells().items()`` on MindSpore). ``convert(value, path)`` may turn a plan
    value into a style (a ``torch.distributed.tensor.parallel`` style into hyperpar's) or
    return ``None`` to leave it as it is. Raises before anything is changed: a key that
    matches nothing names the closest paths."""
    if convert is not None:
        converted = convert(plan, prefix)
        if converted is not None:
            plan = converted
    if is_style(plan):
        return [(prefix, module, plan)]
    if not isinstance(plan, Mapping):
        what = "parallelize_plan" if not prefix else f"plan entry for {prefix!r}"
        raise TypeError(
            f"{what} must be a hyperpar ParallelStyle or a dict {{fqn: style}}, got "
            f"{type(plan).__module__}.{type(plan).__name__} (import the styles from hyperpar, "
            f"not torch.distributed.tensor.parallel)"
        )
    entries: list[tuple[str, Any, Any]] = []
    for key, style in plan.items():
        if not isinstance(key, str):
            raise PlanKeyError(f"plan keys must be module paths (str), got {key!r}")
        if key == "":  # torch: the module the plan is applied to
            entries += resolve_plan(module, style, children=children, is_style=is_style,
                                    prefix=prefix, convert=convert)
            continue
        found = [("", module)]
        for atom in key.split("."):
            found = [(f"{p}.{name}" if p else name, child) for p, parent in found
                     for name, child in children(parent) if fnmatch.fnmatchcase(name, atom)]
        if not found:
            close = difflib.get_close_matches(key, _generic(_all_paths(module, children)), n=3,
                                              cutoff=0.4)
            where = f" under {prefix!r}" if prefix else ""
            hint = ", ".join(repr(c) for c in close) or "(no similar paths)"
            raise PlanKeyError(f"plan key {key!r} matched nothing{where} in "
                               f"{type(module).__name__}; closest: {hint}")
        for fqn, sub in found:
            entries += resolve_plan(sub, style, children=children, is_style=is_style,
                                    prefix=f"{prefix}.{fqn}" if prefix else fqn, convert=convert)
    return entries


def _all_paths(module: Any, children: Callable[[Any], Iterable[tuple[str, Any]]],
               prefix: str = "") -> list[str]:
    out = []
    for name, child in children(module):
        path = f"{prefix}.{name}" if prefix else name
        out += [path, *_all_paths(child, children, path)]
    return out
