"""More ops for torch's DTensor, each on a neutral rule (:mod:`hyperpar.dtensor.rules`).

* elementwise functions not in :mod:`.pointwise`'s lists (``acosh``, ``logit``, ``sinc``,
  ``nextafter``, ``rsub``, the elementwise ``torch.special`` functions, ...): the elementwise
  rule, nonlinear kind (a Partial input is reduced first);
* ``local_dims`` ops (``flip``, ``roll``, ``tril``/``triu``, ``cummax``/``cummin``,
  ``logcumsumexp``, ``softmin``, ``normalize``, ``msort``): local where the dims they read are
  not sharded, those gathered first; pooling (``max_pool*d`` with or without indices,
  ``avg_pool*d``, ``adaptive_*_pool*d``) the same with its spatial dims, the batch and channel
  shards kept (each plane pooled alone; indices count within a plane);
* ``gathered`` ops (``addmm``, ``einsum``, ``dot``, ``diag``, the losses, ``nansum``,
  ``aminmax``, ...): every DTensor input gathered to Replicate, the op run whole, every output
  Replicate (differentiable). Correct for these deterministic ops, and as slow as computing on
  ``.full_tensor()``; a sharded rule of their own is the way to make one faster. An input the
  op updates in place (batch norm's running statistics) has its shard of the update copied
  back (a Partial one is refused).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.torch.dtensor._ops.dispatch import (
    collect_dtensors,
    infer_shapes,
    replicated_local,
)
from hyperpar.torch.dtensor._ops.neutral import decide, neutral_sharding
from hyperpar.torch.dtensor._ops.pointwise import run_pointwise
from hyperpar.torch.dtensor._ops.registry import (
    OP_TABLE,
    OpCall,
    Sharding,
    ShardingError,
    mixing_error,
    op_name,
    register_op,
    variants,
)
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

_SP = torch.special


def _new(funcs: list[Any]) -> list[Any]:
    """``funcs`` without those another family already registers (one family per function)."""
    return [f for f in funcs if f is not None and f not in OP_TABLE]


# ---------------------------------------------------------------------------- elementwise
ELEMENTWISE = ["acosh", "asinh", "atanh", "arccosh", "arcsinh", "arctanh", "arccos", "arcsin",
               "arctan", "arctan2", "logit", "ldexp", "sinc", "nextafter", "rsub", "i0",
               "igamma", "igammac", "logaddexp2", "isneginf", "isposinf", "isreal", "angle",
               "mvlgamma", "polygamma", "xlogy", "fix", "positive", "absolute", "fmax", "fmin",
               "erfc"]
SPECIAL = ["airy_ai", "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1",
           "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
           "chebyshev_polynomial_w", "entr", "erfcx", "hermite_polynomial_h",
           "hermite_polynomial_he", "i0", "i0e", "i1", "i1e", "laguerre_polynomial_l",
           "legendre_polynomial_p", "log_ndtr", "ndtr", "ndtri", "polygamma",
           "modified_bessel_i0", "modified_bessel_i1", "modified_bessel_k0",
           "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
           "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
           "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w",
           "spherical_bessel_j0", "xlog1py", "zeta", "xlogy", "expit", "exp2", "expm1",
           "erf", "erfc", "erfinv", "gammaln", "digamma", "psi", "multigammaln", "sinc",
           "round", "log1p", "logit", "gammainc", "gammaincc"]
ACTIVATIONS = ["hardshrink", "softshrink"]
#: casts (Tensor methods only): elementwise, the nonlinear kind (a Partial is reduced first)
CASTS = ["byte", "char", "cfloat", "cdouble", "chalf"]


def _elementwise_funcs() -> list[Any]:
    out: list[Any] = []
    for name in ELEMENTWISE:
        out.extend(variants(name))
    out.extend(getattr(_SP, name, None) for name in SPECIAL)
    out.extend(getattr(F, name, None) for name in ACTIVATIONS)
    out.extend(getattr(torch.Tensor, name, None) for name in ACTIVATIONS)
    out.extend(getattr(torch.Tensor, name, None) for name in CASTS)
    return _new(out)


@register_op(_elementwise_funcs(), raw=True)
def elementwise_extra(func, args, kwargs):
    """Nonlinear elementwise (acosh, logit, special.*, ...): Partial inputs reduced first."""
    return run_pointwise(func, args, kwargs, "other", False)


# ---------------------------------------------------------------------------- local dims
def _dims_of(call: OpCall) -> tuple[tuple[int, ...], int]:
    """(the dims ``call``'s op reads whole, its number of outputs)."""
    f = call.func
    x = call.dtensors[0]
    nd = x.ndim
    name = getattr(f, "__name__", "")
    if name == "flip":
        rest = call.args[1:] if call.args and call.args[0] is x else call.args
        dims = call.kwargs.get("dims", rest[0] if len(rest) == 1 else rest)
        return (tuple(dims) if isinstance(dims, list | tuple) else (dims,)), 1
    if name == "fliplr":
        return (1,), 1
    if name == "flipud":
        return (0,), 1
    if name == "roll":
        dims = call.arg(2, "dims", None)
        if dims is None or dims == () or dims == []:
            return tuple(range(nd)), 1
        return (tuple(dims) if isinstance(dims, list | tuple) else (dims,)), 1
    if name in ("tril", "triu"):
        return (-2, -1), 1
    if name in ("cummax", "cummin"):
        return (call.arg(1, "dim"),), 2
    if name == "logcumsumexp":
        return (call.arg(1, "dim"),), 1
    if name == "softmin":
        dim = call.arg(1, "dim", None)
        return (tuple(range(nd)) if dim is None else (dim,)), 1
    if name == "normalize":
        return (call.arg(2, "dim", 1),), 1
    if name == "msort":
        return (0,), 1
    raise AssertionError(f"no dims for {name}")  # pragma: no cover (only the funcs below)


_LOCAL_DIMS = _new([*variants("flip"), *variants("fliplr"), *variants("flipud"),
                    *variants("roll"), *variants("tril"), *variants("triu"),
                    *variants("cummax"), *variants("cummin"), *variants("logcumsumexp"),
                    *variants("msort"), F.softmin, F.normalize])


@register_op(_LOCAL_DIMS)
def local_dims(call: OpCall) -> Sharding:
    """Local where the dims the op reads (flip/roll dims, the matrix dims of tril/triu, the
    cumulative dim) are not sharded; shards on them gathered; same-shaped outputs."""
    if len(call.dtensors) != 1:
        raise mixing_error(call.func, call.dtensors[1])
    dims, n_out = _dims_of(call)
    return neutral_sharding("local_dims", call, dims=dims, n_out=n_out)


# ---------------------------------------------------------------------------- pooling
#: pooling function -> its number of spatial (pooled, trailing) dims
_POOL_DIMS = {getattr(F, f"{kind}{k}d{tail}", None): k
              for k in (1, 2, 3)
              for kind, tails in (("max_pool", ("", "_with_indices")), ("avg_pool", ("",)),
                                  ("adaptive_avg_pool", ("",)),
                                  ("adaptive_max_pool", ("", "_with_indices")))
              for tail in tails}
_POOL_DIMS.pop(None, None)


@register_op(_new(list(_POOL_DIMS)))
def pool(call: OpCall) -> Sharding:
    """Pooling: the trailing spatial dims gathered, batch and channel shards kept (each plane
    is pooled alone; ``return_indices`` counts within a plane, so indices stay right)."""
    if len(call.dtensors) != 1:
        raise mixing_error(call.func, call.dtensors[1])
    k = _POOL_DIMS[call.func]
    shapes = infer_shapes(call.func, call.args, call.kwargs)
    n_out = len(shapes) if isinstance(shapes, list | tuple) and not isinstance(
        shapes, torch.Size) else 1
    out_shapes = tuple(tuple(s) for s in shapes) if n_out > 1 else (tuple(shapes),)
    return neutral_sharding("local_dims", call, dims=tuple(range(-k, 0)), n_out=n_out,
                            shapes=out_shapes)


# ---------------------------------------------------------------------------- gathered
_TORCH_GATHERED = [
    "addmm", "addmv", "addr", "baddbmm", "addbmm", "dot", "vdot", "mv", "outer", "ger",
    "inner", "einsum", "tensordot", "kron", "chain_matmul", "diag", "diagonal",
    "diag_embed", "diagflat", "trace", "hstack", "vstack", "dstack", "column_stack",
    "row_stack", "atleast_1d", "atleast_2d", "atleast_3d", "nansum", "nanmean", "aminmax",
    "count_nonzero", "kthvalue", "median", "nanmedian", "mode", "cross", "diff", "rot90",
    "cartesian_prod", "broadcast_tensors", "trapezoid", "trapz", "cumulative_trapezoid",
    "cov", "corrcoef", "dist", "take_along_dim", "index_select", "index_copy", "index_fill",
    "frexp", "repeat", "tile", "narrow", "narrow_copy", "select", "unsafe_chunk", "hsplit",
    "vsplit", "dsplit", "ravel", "logdet", "det", "slogdet", "inverse", "cholesky",
    "cholesky_solve", "cholesky_inverse", "pinverse", "matrix_exp", "sum_to_size",
    "diagonal_scatter", "select_scatter", "slice_scatter", "constant_pad_nd",
    "lu_solve", "triangular_solve", "cdist", "renorm", "gradient",
    "grid_sampler_2d", "grid_sampler_3d", "bucketize", "diagonal_copy", "expand_copy",
    "alias_copy", "geqrf", "index_put", "index_reduce", "ormqr", "lu_unpack", "permute_copy",
    "squeeze_copy", "t_copy", "transpose_copy", "unsqueeze_copy", "view_copy", "unbind_copy",
    "split_with_sizes_copy", "fill", "lu", "qr", "svd", "meshgrid",
    # running statistics updated in place: written back into their shards (gathered())
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
]
_FFT = ["fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2",
        "rfftn", "irfftn", "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn", "fftshift",
        "ifftshift"]
_LINALG = ["vecdot", "multi_dot", "cross", "diagonal", "matrix_norm", "det", "slogdet", "inv",
           "inv_ex", "cholesky", "cholesky_ex", "solve", "solve_ex", "pinv", "svdvals",
           "eigvalsh", "matrix_exp", "tensorinv", "tensorsolve", "vander", "matrix_power",
           "solve_triangular", "lu_factor", "lu_factor_ex", "lu", "lu_solve", "qr", "eigh",
           "svd", "cond", "matrix_rank", "householder_product", "ldl_factor",
           "ldl_factor_ex", "eig", "eigvals", "norm"]
_F_GATHERED = [
    "batch_norm", "l1_loss", "mse_loss", "huber_loss", "smooth_l1_loss", "kl_div",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "soft_margin_loss", "margin_ranking_loss",
    "hinge_embedding_loss", "poisson_nll_loss", "gaussian_nll_loss",
    "multilabel_soft_margin_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss",
    "cosine_similarity", "pairwise_distance", "glu", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "prelu", "local_response_norm", "max_unpool1d", "max_unpool2d",
    "max_unpool3d",
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "grid_sample",
    "cosine_embedding_loss", "multi_margin_loss", "multilabel_margin_loss",
]


def _gathered_funcs() -> list[Any]:
    out: list[Any] = []
    for name in _TORCH_GATHERED:
        out.extend(variants(name))
    out.extend(getattr(torch.linalg, name, None) for name in _LINALG)
    out.extend(getattr(torch.fft, name, None) for name in _FFT)
    out.extend(getattr(F, name, None) for name in _F_GATHERED)
    # meshgrid([a, b]) (a list) reaches torch function as the C builtin, not torch.meshgrid
    out.append(getattr(torch._C._VariableFunctions, "meshgrid", None))
    # aten ops OpInfo calls directly (the packet or an overload reaches torch function)
    for name in ("max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
                 "_softmax_backward_data", "_upsample_bilinear2d_aa", "_batch_norm_with_update",
                 "native_batch_norm", "_native_batch_norm_legit"):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            out.append(packet)
            out.extend(getattr(packet, o) for o in packet.overloads())
    return _new(out)


_RUNNING_STATS = set(_new([*variants("batch_norm"), *variants("native_batch_norm"),
                           *variants("_native_batch_norm_legit"),
                           *variants("_batch_norm_with_update"), F.batch_norm]))
for _name in ("_batch_norm_with_update", "native_batch_norm", "_native_batch_norm_legit"):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None:
        _RUNNING_STATS.add(_packet)
        _RUNNING_STATS.update(getattr(_packet, o) for o in _packet.overloads())


def _write_back(func: Any, d: DTensor, whole: torch.Tensor) -> None:
    """Copy this rank's piece of ``whole`` (the gathered copy an op updated in place) into
    ``d``'s local tensor, so the in-place update is not lost on a copy."""
    spec = d._spec
    if any(p.is_partial() for p in spec.placements):
        raise ShardingError(f"{op_name(func)} updates an input in place that is Partial "
                            f"({list(spec.placements)}): reduce it first (redistribute to "
                            "Replicate or Shard)")
    shape, offset = spec.local_shape_and_offset()
    piece = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    with torch.no_grad():
        d._local.copy_(piece)


def _shape_of(o: Any) -> tuple[int, ...]:
    return tuple(o.shape) if isinstance(o, torch.Tensor) else ()


@register_op(_gathered_funcs(), raw=True)
def gathered(func, args, kwargs):
    """Gathers every DTensor input to Replicate, runs the op whole, returns Replicate outputs
    (deterministic ops only: every rank computes the same value)."""
    dts = collect_dtensors(args, kwargs)
    mesh = dts[0]._spec.mesh
    for d in dts[1:]:
        if d._spec.mesh != mesh:
            raise ValueError(f"{getattr(func, '__name__', func)}: DTensor inputs live on "
                             "different meshes; redistribute them onto one mesh")
    table = {id(d): replicated_local(d) for d in dts}

    def swap(a: Any) -> Any:
        if isinstance(a, DTensor):
            return table[id(a)]
        if type(a) in (list, tuple):
            return type(a)(swap(b) for b in a)
        return a

    versions = {k: t._version for k, t in table.items()}
    out = func(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
    # an input the op wrote into: its shard too. Batch norm's kernels write the running
    # statistics without bumping the version counter, so for them every input that needs no
    # gradient (the statistics; the others are unchanged) is written back
    stats = func in _RUNNING_STATS
    for d in dts[1:] if stats else dts:
        whole = table[id(d)]
        if whole is not d._local and (whole._version != versions[id(d)] or (
                stats and not d.requires_grad)):
            _write_back(func, d, whole)
    outs = out if isinstance(out, tuple | list) else (out,)
    res = decide("gathered", [d._spec for d in dts],
                 shapes=tuple(_shape_of(o) for o in outs))
    wrapped = [_wrap(o, DTensorSpec(mesh, p, torch.Size(s))) if isinstance(o, torch.Tensor)
               else o for o, p, s in zip(outs, res.outputs, res.shapes, strict=True)]
    if not isinstance(out, tuple | list):
        return wrapped[0]
    return wrapped if type(out) is list else type(out)(wrapped)

