"""MindSpore primitive names (what ``__fallback__`` receives as ``OpCall.name``) mapped to the
neutral op names of :mod:`hyperpar.dtensor.rules`, with how to read each call's arguments.

The names were read off ``__fallback__`` in MindSpore 2.10 PyNative: ``x + y`` is ``AddExt``,
``x + 1`` ``AddScalar``, ``1 - x`` ``Sub``, ``x * 2`` ``Muls``, ``mint.matmul``/``@``
``MatMulExt``, ``mint.nn.functional.linear`` ``Dense``, ``x.sum()``/``ops.sum`` ``SumExt``,
``mint.amax``/``amin`` ``ReduceMax``/``ReduceMin``, ``x.view``/``reshape`` ``Reshape``,
``x.unsqueeze`` ``ExpandDims`` (``mint.unsqueeze`` ``ExpandDimsView``), ``x.squeeze``
``Squeeze``, ``flatten`` ``FlattenExt``, ``x.transpose(a, b)`` ``TransposeExtView``, ``x.T`` and
``x.permute`` ``Transpose``, ``ops.gather`` (what ``nn.Embedding`` runs) the legacy primitive
``Gather``, ``mint.cat`` ``Concat``, ``mint.stack`` ``StackExt``, ``x.split`` ``SplitTensor``
(with sizes ``SplitWithSize``), ``mint.chunk`` ``ChunkView``, ``x.expand``/``x.broadcast_to``
``BroadcastTo``, ``mint.broadcast_to`` ``BroadcastToView``, ``x.expand_as`` ``ExpandAs``.
Basic indexing never
reaches ``__fallback__`` whole (``x[0]``, ``x[:, 1:3]``, ``x[..., 0]`` run no OpCall there at
all, ``x[1:]`` arrives as a legacy ``StridedSlice``, ``x[None]`` as ``ExpandDims``):
``DTensor.__getitem__`` reads the index itself (:func:`.dispatch.getitem`). Left out on purpose:
``mint.unbind`` (``UnstackExtView``: plain MindSpore 2.10 cannot differentiate it) and
``mint.split`` (``SplitTensorView``, ``SplitWithSizeView``: plain MindSpore 2.10 gets their
gradients wrong when an output is used twice), so they raise "no sharding rule is mapped". Add a
primitive by adding a line to :data:`OPS`.

The reductions computed on gathered dims (read the same way; each computed and differentiated
by plain MindSpore 2.10 on CPU before mapping): ``mint.prod``/``ops.prod`` ``ProdExt`` (x, dim,
keepdim, dtype), ``x.prod`` ``DeprecatedProd`` (x, axis, keep_dims), ``x.var``/``x.std``
``DeprecatedVar``/``DeprecatedStd`` (x, axis, ddof, keepdims), ``x.std(dim)`` ``Std``,
``x.argmax`` ``DeprecatedArgmax`` (x, axis, keepdims), ``x.argmin`` ``ArgMinExt``, ``ops.argmax``
``Argmax`` (x, axis, output type; ``keepdims`` applied after), ``x.cumsum`` ``CumsumExt``,
``ops.cumsum`` ``CumSum``, ``mint.cumprod``/``x.cumprod`` ``CumProd``, ``x.logsumexp``
``LogSumExp``, ``ops.var_mean``/``ops.std_mean`` (and ``ops.var``/``ops.std``) the legacy
``ReduceStd`` (x, axis, unbiased, keep_dims) -> (std, mean); ``var_mean`` squares the std
afterwards. ``x.norm()`` runs ``Square``, the legacy ``ReduceSum`` and ``Sqrt``. Not mapped:
``mint.var``/``mint.std`` with a correction (``Var``/``Std`` with 4 arguments),
``mint.var_mean``/``mint.std_mean`` (``VarMean``/``StdMean``) and
``mint.argmax``/``mint.logsumexp``/``mint.cumsum`` (no CPU kernel: "The kernel ... unregistered"),
``mint.linalg.vector_norm`` (``LinalgVectorNorm``, no CPU kernel) and ``x.norm(p, dim)``
(``LpNorm``: ``p`` and the axis are attributes of the primitive, not arguments); they raise
"no sharding rule is mapped", with the mapped spelling to use where :data:`UNMAPPED_HINTS`
has one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mindspore import Tensor

from hyperpar.dtensor.rules.base import norm_dim, spelled_dims
from hyperpar.dtensor.rules.view import flattened_shape, squeezed_shape, unsqueezed_shape


@dataclass
class Call:
    """One op call read for the rules: the neutral ``op``, the argument positions of its tensor
    inputs (in the rule's order), the rule's keyword arguments, whether the local call is a
    reshape to this rank's piece of the global output shape (``reshape``) or a broadcast to it
    (``expand``), for ops taking a
    list of tensors (``Concat``) the position of that list (``tensor_list``; ``tensors`` empty),
    and for a lookup the position of its padding index (``padding_at``).
    """

    op: str
    tensors: tuple[int, ...]
    args: dict[str, Any] = field(default_factory=dict)
    reshape: bool = False
    expand: bool = False  # broadcast the local piece to this rank's piece of the output
    tensor_list: int | None = None
    padding_at: int | None = None  # embedding: where the call takes its padding index


Parser = Callable[[Sequence[Any], dict[str, Any]], Call]


def _is_tensor(a: Any) -> bool:
    # a 0-d plain tensor (a scalar fill value) is a scalar to the rules
    return isinstance(a, Tensor) and (type(a) is not Tensor or a.ndim > 0)


def _arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def elementwise(op: str, operands: int | None = None) -> Parser:
    """An elementwise op; only the first ``operands`` arguments are operands (``AddExt``'s
    third is ``alpha``, a scale of the second)."""

    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        head = list(args if operands is None else args[:operands])
        pos = tuple(i for i, a in enumerate(head) if _is_tensor(a))
        scalar = any(isinstance(a, int | float) and not isinstance(a, bool)
                     or (isinstance(a, Tensor) and not _is_tensor(a)) for a in head)
        return Call(op, pos, {"has_scalar": scalar, "first_is_tensor": 0 in pos})

    return parse


def _linear(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    bias = _arg(args, kwargs, 2, "bias", None)
    return Call("linear", (0, 1, 2) if bias is not None else (0, 1))


def reduction(op: str, dim_at: int = 1, keep_at: int = 2, dim_name: str = "dim",
              keep_name: str = "keepdim") -> Parser:
    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        dim = _arg(args, kwargs, dim_at, dim_name, None) if dim_at else None
        keep = bool(_arg(args, kwargs, keep_at, keep_name, False)) if keep_at else False
        return Call(op, (0,), {"dim": dim, "keepdim": keep})

    return parse


def gathered(op: str, dim_at: int = 1, keep_at: int | None = 2) -> Parser:
    """A reduction computed on the gathered reduced dims; ``dim``/``axis`` and
    ``keepdim``/``keep_dims``/``keepdims`` by position or keyword (``keep_at`` None: no
    keepdim argument)."""

    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim", kwargs.get("axis"))
        keep = args[keep_at] if keep_at is not None and len(args) > keep_at else next(
            (kwargs[k] for k in ("keepdim", "keep_dims", "keepdims") if k in kwargs), False)
        return Call(op, (0,), {"dim": dim, "keepdim": bool(keep)})

    return parse


def _reduce_sum(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    """The legacy ``ReduceSum`` (x, axis, keep_dims, skip_mode) that ``x.norm()`` runs; with
    ``skip_mode`` an empty axis means no reduction at all: left without a rule."""
    axis = _arg(args, kwargs, 1, "axis", ())
    if bool(_arg(args, kwargs, 3, "skip_mode", False)) and axis in ((), [], None):
        return Call("ReduceSum(skip_mode=True, axis=())", (0,))
    return Call("sum", (0,), {"dim": axis, "keepdim": bool(_arg(args, kwargs, 2, "keep_dims",
                                                                False))})


def scan(op: str) -> Parser:
    """``cumsum``/``cumprod`` along a dim (``CumSum``/``CumProd`` then take ``exclusive`` and
    ``reverse`` flags, which do not change the layout)."""

    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        return Call(op, (0,), {"dim": int(_arg(args, kwargs, 1, "dim", kwargs.get("axis", 0)))})

    return parse


def _dims(args: Sequence[Any]) -> tuple[int, ...]:
    """``(x, 1, 0)`` or ``(x, (1, 0))`` or ``(x, [1, 0])`` -> ``(1, 0)``."""
    return tuple(int(d) for d in spelled_dims(args[1:]))


def _reshape(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    shape = _dims(args) if len(args) > 1 else tuple(kwargs["shape"])
    return Call("reshape", (0,), {"shape": shape}, reshape=True)


def _flatten(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    shape = flattened_shape(tuple(args[0].shape), int(_arg(args, kwargs, 1, "start_dim", 0)),
                            int(_arg(args, kwargs, 2, "end_dim", -1)))
    return Call("reshape", (0,), {"shape": shape}, reshape=True)


def _expand_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    shape = unsqueezed_shape(tuple(args[0].shape), int(_arg(args, kwargs, 1, "axis", 0)))
    return Call("reshape", (0,), {"shape": shape}, reshape=True)


def _squeeze(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    shape = squeezed_shape(tuple(args[0].shape), _arg(args, kwargs, 1, "axis", None))
    return Call("reshape", (0,), {"shape": shape}, reshape=True)


def _broadcast_to(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    """``BroadcastTo`` (``x.expand(*sizes)``, ``x.broadcast_to(shape)``) and
    ``BroadcastToView`` (``mint.broadcast_to``): the sizes inline or as one tuple."""
    shape = _dims(args) if len(args) > 1 else tuple(_arg(args, kwargs, 1, "shape", ()))
    return Call("expand", (0,), {"shape": shape}, expand=True)


def _expand_as(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    """``ExpandAs`` (``x.expand_as(other)``): the shape of ``other`` (global for a DTensor)."""
    return Call("expand", (0,), {"shape": tuple(_arg(args, kwargs, 1, "other", None).shape)},
                expand=True)


def _transpose(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    return Call("transpose", (0,), {"dim0": int(args[1]), "dim1": int(args[2])})


def _permute(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    return Call("permute", (0,), {"dims": _dims(args)})


def softmax(op: str) -> Parser:
    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        dim = _arg(args, kwargs, 1, "axis", kwargs.get("dim", -1))
        if isinstance(dim, list | tuple):
            if len(dim) != 1:
                return Call(f"{op} over several dims", (0,))
            dim = dim[0]
        return Call(op, (0,), {"dim": int(dim)})

    return parse


# Normalisation, read off __fallback__ in MindSpore 2.10 PyNative: nn.LayerNorm and
# ops.LayerNorm run the legacy primitive ``LayerNorm`` (x, gamma, beta, begin_norm_axis,
# begin_params_axis, epsilon) -> (y, mean, variance), CPU kernel present;
# mint.nn.functional.layer_norm, mint.nn.LayerNorm and ops.layer_norm run ``LayerNormExt``
# (x, normalized_shape, weight, bias, eps) -> (y, mean, rstd), no CPU kernel ("Create
# kernelmod for op LayerNormExt failed", plain MindSpore too): mapped, run only where a kernel
# exists; mint.nn.functional.group_norm and mint.nn.GroupNorm run ``GroupNorm`` (x,
# num_groups, weight, bias, eps) -> (y, mean, rstd) of shape (N, num_groups), CPU kernel
# present. Not mapped: ``RmsNorm`` (ops.rms_norm; "The kernel RmsNorm unregistered" on CPU,
# mint has no rms_norm) and attention (mint has no scaled_dot_product_attention;
# ``FlashAttentionScore`` is unregistered on CPU).
def _dtensor_params(op: str, args: Sequence[Any], positions: Sequence[int]) -> tuple[int, ...]:
    """The positions of a norm's weight and bias (None: left out). A plain Tensor there -- a
    Cell's Parameter, or the ones/zeros mint makes when none is passed -- is refused: its
    gradient would miss the other ranks' rows."""
    out = []
    for i in positions:
        a = args[i] if len(args) > i else None
        if a is None:
            continue
        if not hasattr(a, "placements"):
            raise ValueError(
                f"{op} on a DTensor: its weight/bias is a plain Tensor of shape "
                f"{tuple(a.shape)} (a Cell's Parameter, or the ones/zeros mint makes when none "
                "is passed); pass weight and bias as DTensors, e.g. distribute_tensor(w, mesh, "
                "[Replicate()] * mesh.ndim), to ops.LayerNorm / mint.nn.functional.group_norm, "
                "or apply the Cell to x.to_local() (or through SequenceParallel)")
        out.append(i)
    return tuple(out)


def _layer_norm(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    """Legacy ``LayerNorm``: normalised from ``begin_norm_axis`` on."""
    x = args[0]
    begin = norm_dim(int(_arg(args, kwargs, 3, "begin_norm_axis", -1)), x.ndim)
    return Call("layer_norm", (0, *_dtensor_params("LayerNorm", args, (1, 2))),
                {"normalized_shape": tuple(x.shape[begin:]), "stats": 2})


def _layer_norm_ext(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    shape = _arg(args, kwargs, 1, "normalized_shape", None)
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    return Call("layer_norm", (0, *_dtensor_params("LayerNormExt", args, (2, 3))),
                {"normalized_shape": shape, "stats": 2})


def _group_norm(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    return Call("group_norm", (0, *_dtensor_params("GroupNorm", args, (2, 3))),
                {"num_groups": int(_arg(args, kwargs, 1, "num_groups", 1)), "stats": 2})


def joined(op: str) -> Parser:
    """``Concat``/``StackExt``: a list of tensors, then the dim."""

    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        dim = _arg(args, kwargs, 1, "axis", kwargs.get("dim", 0))
        return Call(op, (), {"dim": int(dim)}, tensor_list=0)

    return parse


def _split_sizes(size: int, step: int) -> tuple[int, ...]:
    """Pieces of ``step`` (the last one shorter) covering ``size``, as torch.split gives."""
    if step <= 0:
        raise ValueError(f"split: the piece size must be positive, got {step}")
    return tuple(min(step, size - s) for s in range(0, size, step)) or (0,)


def split(kind: str) -> Parser:
    """``SplitTensor`` (a piece size), ``SplitWithSize`` (the sizes), ``ChunkView``
    (a number of chunks, each ``ceil(size / chunks)`` as torch.chunk): all become the sizes."""

    def parse(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        dim = int(_arg(args, kwargs, 2, "dim", kwargs.get("axis", 0)))
        how = args[1]
        size = args[0].shape[dim]
        if kind == "sizes":
            sizes = tuple(int(s) for s in how)
        elif kind == "chunks":
            sizes = _split_sizes(size, -(-size // int(how)) if size else 1)
        else:
            sizes = _split_sizes(size, int(how))
        return Call("split", (0,), {"dim": dim, "sizes": sizes})

    return parse


def _gather(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    axis = int(_arg(args, kwargs, 2, "axis", 0))
    batch_dims = int(_arg(args, kwargs, 3, "batch_dims", 0))
    if axis != 0 or batch_dims != 0 or args[0].ndim != 2:
        return Call(f"Gather(axis={axis}, batch_dims={batch_dims})", (0, 1))
    return Call("embedding", (0, 1))


def _embedding(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    # mint's order is (indices, weight, padding_idx, ...); MindSpore 2.10 has no CPU kernel
    padding = _arg(args, kwargs, 2, "padding_idx", None)
    return Call("embedding", (1, 0), {"padding_idx": padding},
                padding_at=2 if len(args) > 2 else None)


def _gather_d(args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    return Call("gather_d", (0, 2), {"dim": int(args[1])})


_UNARY = ("Exp", "Log", "Log1p", "ReLU", "Tanh", "Sigmoid", "Sqrt", "Rsqrt", "Abs", "Square",
          "SiLU", "Erf", "Sin", "Cos", "Reciprocal", "PowTensorScalar", "OnesLike", "ZerosLike",
          "Floor", "Ceil", "Sign", "LogicalNot", "IsNan", "IsFinite")
_BINARY = ("Pow", "Maximum", "Minimum", "Equal", "NotEqual", "Greater", "GreaterEqual",
           "Less", "LessEqual", "MaskedFill", "Select", "Atan2", "LogicalAnd", "LogicalOr")

#: MindSpore primitive name -> how to read its call.
OPS: dict[str, Parser] = {
    "AddExt": elementwise("add", 2), "AddScalar": elementwise("add", 2),
    "Add": elementwise("add", 2), "SubExt": elementwise("sub", 2),
    "SubScalar": elementwise("sub", 2), "Sub": elementwise("sub", 2),
    "Neg": elementwise("neg"), "ToDtype": elementwise("identity", 1),
    "Cast": elementwise("identity", 1), "Contiguous": elementwise("identity", 1),
    "Mul": elementwise("mul"), "Muls": elementwise("mul"), "Div": elementwise("div"),
    "Divs": elementwise("div"),
    **{name: elementwise("elementwise") for name in _UNARY + _BINARY},
    "MatMulExt": lambda a, k: Call("matmul", (0, 1)),
    "MatMul": lambda a, k: Call("matmul", (0, 1)),
    "BatchMatMulExt": lambda a, k: Call("bmm", (0, 1)),
    "Dense": _linear,
    "SumExt": reduction("sum"), "MeanExt": reduction("mean"),
    "DeprecatedSum": reduction("sum", 1, 2, "axis", "keepdims"),
    "ReduceSum": _reduce_sum,
    "ReduceMax": reduction("max"), "ReduceMin": reduction("min"),
    "Max": reduction("max", 0, 0),
    "MaxDim": reduction("max_dim"),
    "ProdExt": gathered("prod"), "DeprecatedProd": gathered("prod"),
    "DeprecatedVar": gathered("var", 1, 3), "DeprecatedStd": gathered("std", 1, 3),
    "Std": gathered("std", 1, 3),
    "DeprecatedArgmax": gathered("argmax"), "ArgMaxExt": gathered("argmax"),
    "ArgMinExt": gathered("argmin"),
    "Argmax": gathered("argmax", 1, None), "Argmin": gathered("argmin", 1, None),
    "LogSumExp": gathered("logsumexp"),
    "ReduceStd": gathered("std_mean", 1, 3),
    "CumsumExt": scan("cumsum"), "CumSum": scan("cumsum"), "CumProd": scan("cumprod"),
    "Reshape": _reshape, "FlattenExt": _flatten, "ExpandDims": _expand_dims,
    "ExpandDimsView": _expand_dims, "Squeeze": _squeeze,
    "BroadcastTo": _broadcast_to, "BroadcastToView": _broadcast_to, "ExpandAs": _expand_as,
    "TransposeExtView": _transpose, "Transpose": _permute, "TransposeView": _permute,
    "Softmax": softmax("softmax"), "LogSoftmax": softmax("log_softmax"),
    "LogSoftmaxExt": softmax("log_softmax"),
    "LayerNorm": _layer_norm, "LayerNormExt": _layer_norm_ext, "GroupNorm": _group_norm,
    "Gather": _gather, "Embedding": _embedding, "GatherD": _gather_d,
    "Concat": joined("cat"), "StackExt": joined("stack"),
    "SplitTensor": split("size"),
    "SplitWithSize": split("sizes"),
    "ChunkView": split("chunks"),
}

#: Primitives that only inspect their input (no tensor result to lay out).
PASSTHROUGH = frozenset({"typeof"})

#: Unmapped primitives whose op has a mapped spelling: the "no sharding rule" error names it.
#: MindSpore 2.10 has no CPU kernel for these (plain tensors fail too), so no rule was checked.
UNMAPPED_HINTS = {
    "VarMean": "mint.var_mean has no CPU kernel in MindSpore 2.10; ops.var_mean(x, axis, ddof, "
               "keepdims) (ReduceStd) is mapped",
    "StdMean": "mint.std_mean has no CPU kernel in MindSpore 2.10; ops.std_mean(x, axis, ddof, "
               "keepdims) (ReduceStd) is mapped",
    "Var": "mint.var has no CPU kernel in MindSpore 2.10; x.var(axis, ddof=..., keepdims=...) "
           "(DeprecatedVar) and ops.var (ReduceStd) are mapped",
    "LinalgVectorNorm": "mint.linalg.vector_norm has no CPU kernel in MindSpore 2.10; x.norm() "
                        "is mapped (Square, ReduceSum, Sqrt)",
}
