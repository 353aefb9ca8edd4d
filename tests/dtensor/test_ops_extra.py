"""The extra op families (``_ops/extra.py``; neutral rules ``local_dims`` and ``gathered``):
each case against the same op on full tensors in one process, values and input gradients, on
2 real ranks, all cases in one spawn.

Tolerance ``rtol=1e-5, atol=1e-6``: every case runs the op elementwise on the same values
(elementwise, ``local_dims``) or on the same whole tensors (``gathered``), so the only
difference from the reference is the gradient of a gathered input summed in another order
(a few float32 ulps on values of order 1)."""

import torch
import torch.nn.functional as F

from hyperpar.dtensor import Partial, Replicate, Shard

S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial()
TOL = {"rtol": 1e-5, "atol": 1e-6}

# name -> (function of the inputs, [(shape, placements, kind)], expected output placements
# or None); kind "f" float N(0, 1), "u" float in (0.05, 0.95), "p" float > 1.1
CASES = [
    # elementwise: sharded stays sharded; a Partial input is reduced first
    ("acosh", lambda x: torch.acosh(x), [((6, 4), [S0], "p")], (S0,)),
    ("asinh_partial", lambda x: torch.asinh(x), [((6, 4), [P], "f")], (R,)),
    ("logit_eps", lambda x: torch.logit(x, eps=1e-3), [((5, 4), [S1], "u")], (S1,)),
    ("special_entr", lambda x: torch.special.entr(x), [((5, 4), [S0], "u")], (S0,)),
    ("nextafter_bcast", lambda x, y: torch.nextafter(x, y), [((6, 4), [S0], "f"),
                                                            ((4,), [R], "f")], (S0,)),
    ("rsub", lambda x, y: torch.rsub(x, y, alpha=2), [((6, 4), [S1], "f"),
                                                      ((6, 4), [S1], "f")], (S1,)),
    ("polygamma", lambda x: torch.polygamma(1, x), [((5, 4), [S0], "p")], (S0,)),
    ("xlog1py", lambda x, y: torch.special.xlog1py(x, y), [((6, 4), [S0], "f"),
                                                          ((6, 4), [R], "p")], (S0,)),
    # local_dims: local on the dims the op does not read
    ("flip_unsharded", lambda x: torch.flip(x, (1,)), [((6, 4), [S0], "f")], (S0,)),
    ("flip_sharded", lambda x: x.flip(0, 1), [((5, 4), [S0], "f")], (R,)),
    ("roll_flat", lambda x: torch.roll(x, 3), [((5, 4), [S1], "f")], (R,)),
    ("roll_dim", lambda x: torch.roll(x, (1, -2), (1, 2)), [((4, 5, 3), [S0], "f")], (S0,)),
    ("tril_batch", lambda x: torch.tril(x, -1), [((4, 5, 5), [S0], "f")], (S0,)),
    ("triu_matrix", lambda x: x.triu(1), [((5, 6), [S1], "f")], (R,)),
    ("cummax", lambda x: torch.cummax(x, 1).values, [((6, 5), [S0], "f")], (S0,)),
    ("cummin_idx", lambda x: torch.cummin(x, 0).indices * 1.0, [((6, 5), [S0], "f")], (R,)),
    ("logcumsumexp", lambda x: torch.logcumsumexp(x, 0), [((5, 4), [S1], "f")], (S1,)),
    ("softmin", lambda x: F.softmin(x, dim=1), [((6, 4), [S1], "f")], (R,)),
    ("normalize", lambda x: F.normalize(x, dim=1), [((6, 4), [S0], "f")], (S0,)),
    # gathered: the op on whole tensors, the result Replicate
    ("addmm", lambda b, x, w: torch.addmm(b, x, w, beta=0.5), [((3,), [R], "f"),
                                                               ((5, 4), [S0], "f"),
                                                               ((4, 3), [S1], "f")], (R,)),
    ("baddbmm", lambda b, x, w: torch.baddbmm(b, x, w), [((2, 3, 5), [S0], "f"),
                                                         ((2, 3, 4), [S0], "f"),
                                                         ((2, 4, 5), [S2], "f")], (R,)),
    ("dot", lambda a, b: torch.dot(a, b), [((7,), [S0], "f"), ((7,), [R], "f")], (R,)),
    ("mv", lambda a, b: torch.mv(a, b), [((5, 6), [S1], "f"), ((6,), [S0], "f")], (R,)),
    ("outer", lambda a, b: torch.outer(a, b), [((5,), [S0], "f"), ((3,), [R], "f")], (R,)),
    ("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), [((2, 3, 4), [S0], "f"),
                                                                ((2, 4, 5), [S1], "f")], (R,)),
    ("tensordot", lambda a, b: torch.tensordot(a, b, dims=([1], [0])),
     [((5, 6), [S1], "f"), ((6, 3), [S0], "f")], (R,)),
    ("diag", lambda x: torch.diag(x, 1), [((5, 5), [S0], "f")], (R,)),
    ("diagonal", lambda x: torch.diagonal(x, 0, 1, 2), [((3, 4, 4), [S2], "f")], (R,)),
    ("repeat", lambda x: x.repeat(2, 1, 3), [((5, 4), [S0], "f")], (R,)),
    ("tile", lambda x: torch.tile(x, (2,)), [((5, 4), [S1], "f")], (R,)),
    ("hstack", lambda a, b: torch.hstack([a, b]), [((4, 3), [S0], "f"),
                                                   ((4, 2), [S1], "f")], (R,)),
    ("vstack", lambda a, b: torch.vstack([a, b]), [((3,), [R], "f"), ((3,), [S0], "f")], (R,)),
    ("select", lambda x: x.select(1, 2), [((6, 4), [S0], "f")], (R,)),
    ("narrow", lambda x: torch.narrow(x, 0, 1, 3), [((5, 4), [S0], "f")], (R,)),
    ("nansum", lambda x: torch.nansum(x, 1), [((6, 4), [S0], "f")], (R,)),
    ("nanmean", lambda x: torch.nanmean(x), [((5, 4), [S1], "f")], (R,)),
    ("aminmax", lambda x: torch.aminmax(x, dim=0).max, [((5, 4), [S0], "f")], (R,)),
    ("count_nonzero", lambda x: torch.count_nonzero(x.relu(), 0) * 1.0,
     [((5, 4), [S0], "f")], (R,)),
    ("kthvalue", lambda x: torch.kthvalue(x, 2, 0).values, [((5, 4), [S0], "f")], (R,)),
    # losses: mean over a Shard(0) batch, gradients from the whole batch (not 2x)
    ("mse_mean", lambda a, b: F.mse_loss(a, b), [((6, 4), [S0], "f"), ((6, 4), [S0], "f")],
     (R,)),
    ("l1_sum", lambda a, b: F.l1_loss(a, b, reduction="sum"), [((5, 4), [S0], "f"),
                                                              ((5, 4), [R], "f")], (R,)),
    ("huber_none", lambda a, b: F.huber_loss(a, b, reduction="none", delta=0.5),
     [((6, 4), [S0], "f"), ((6, 4), [S0], "f")], (R,)),
    ("smooth_l1_mean", lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), [((6, 4), [S1], "f"),
                                                                      ((6, 4), [R], "f")], (R,)),
    ("kl_div_batchmean", lambda a, b: F.kl_div(a.log_softmax(-1), b.softmax(-1),
                                               reduction="batchmean"),
     [((6, 4), [S0], "f"), ((6, 4), [S0], "f")], (R,)),
    ("bce_mean", lambda a, b: F.binary_cross_entropy(a, b), [((6, 4), [S0], "u"),
                                                            ((6, 4), [S0], "u")], (R,)),
    ("bce_logits_sum", lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction="sum"),
     [((5, 4), [S0], "f"), ((5, 4), [R], "u")], (R,)),
    # issue 51, second pass: sort along dim 0, pooling, native norms, rmod, decompositions
    ("msort_kept", lambda x: torch.msort(x), [((6, 4), [S1], "f")], (S1,)),
    ("msort_sorted_dim", lambda x: x.msort(), [((7, 3), [S0], "f")], (R,)),
    # remainder(scalar, tensor) has no derivative in torch: compared without one
    ("rmod_scalar", lambda x: 5.0 % x.detach(), [((6, 4), [S0], "p")], (S0,)),
    ("rmod_tensor", lambda x, y: y.__rmod__(x), [((6, 4), [S0], "f"), ((4,), [R], "p")],
     (S0,)),
    ("max_pool2d_values", lambda x: F.max_pool2d(x, 2, return_indices=True)[0],
     [((2, 3, 4, 6), [S1], "f")], (S1,)),
    ("max_pool2d_indices", lambda x: F.max_pool2d(x, 2, return_indices=True)[1] * 1.0,
     [((3, 3, 4, 6), [S0], "f")], (S0,)),
    ("max_pool1d_spatial", lambda x: F.max_pool1d(x, 2, 1, return_indices=True)[0],
     [((2, 3, 7), [S2], "f")], (R,)),
    ("max_pool3d_indices", lambda x: F.max_pool3d(x, 2, return_indices=True)[1] * 1.0,
     [((3, 2, 2, 4, 4), [S0], "f")], (S0,)),
    ("avg_pool2d_pad", lambda x: F.avg_pool2d(x, 3, 2, 1), [((5, 2, 5, 6), [S0], "f")], (S0,)),
    ("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (2, 3), return_indices=True)[0],
     [((2, 3, 5, 7), [S1], "f")], (S1,)),
    ("native_layer_norm_stats", lambda x, w, b: _sum3(torch.native_layer_norm(x, (4,), w, b,
                                                                             1e-5)),
     [((6, 4), [S0], "f"), ((4,), [R], "f"), ((4,), [R], "f")], (S0,)),
    ("native_layer_norm_normed", lambda x, w, b: torch.native_layer_norm(x, (3, 4), w, b,
                                                                         1e-5)[0],
     [((2, 3, 4), [S1], "f"), ((3, 4), [R], "f"), ((3, 4), [R], "f")], (R,)),
    ("native_group_norm_uneven", lambda x, w, b: torch.native_group_norm(x, w, b, 5, 6, 3, 2,
                                                                         1e-5)[0],
     [((5, 6, 3), [S0], "f"), ((6,), [R], "f"), ((6,), [R], "f")], (S0,)),
    ("native_group_norm_rstd", lambda x: torch.native_group_norm(x, None, None, 4, 6, 3, 3,
                                                                 1e-5)[2],
     [((4, 6, 3), [S0], "f")], (S0,)),
    ("native_group_norm_channels", lambda x: torch.native_group_norm(x, None, None, 4, 6, 3, 3,
                                                                     1e-5)[0],
     [((4, 6, 3), [S1], "f")], (R,)),
    ("linalg_lu_U", lambda x: torch.linalg.lu(x).U, [((5, 5), [S0], "f")], (R,)),
    ("lu_factor", lambda x: torch.lu(x)[0], [((5, 5), [S1], "f")], (R,)),
    ("linalg_qr_R", lambda x: torch.linalg.qr(x).R, [((6, 4), [S0], "f")], (R,)),
    ("qr_Q", lambda x: torch.qr(x)[0], [((6, 4), [S1], "f")], (R,)),
    ("linalg_svd_S", lambda x: torch.linalg.svd(x, full_matrices=False).S,
     [((6, 4), [S0], "f")], (R,)),
    ("svd_U_abs", lambda x: torch.svd(x)[0].abs(), [((6, 4), [S1], "f")], (R,)),
    ("meshgrid", lambda a, b: torch.meshgrid(a, b, indexing="ij")[0]
     + 2 * torch.meshgrid([a, b], indexing="xy")[1], [((3,), [S0], "f"), ((3,), [R], "f")],
     (R,)),
    ("linalg_eigvals_abs", lambda x: torch.linalg.eigvals(x).abs(), [((4, 4), [S0], "f")],
     (R,)),
    ("linalg_eig_vectors_abs", lambda x: torch.linalg.eig(x)[1].abs(), [((4, 4), [S1], "f")],
     (R,)),
    ("linalg_norm_vector", lambda x: torch.linalg.norm(x), [((6, 4), [S0], "f")], (R,)),
    ("linalg_norm_spectral", lambda x: torch.linalg.norm(x, 2, dim=(0, 1)),
     [((6, 4), [S1], "f")], (R,)),
    ("mH", lambda x: x.mH, [((2, 3, 4), [S1], "f")], (S2,)),
    ("adjoint", lambda x: torch.adjoint(x) * 1.0, [((3, 4), [S0], "f")], (S1,)),
    ("zero_", lambda x: torch.zero_(x * 1.0), [((6, 4), [S0], "f")], (S0,)),
    ("feature_alpha_dropout_eval", lambda x: F.feature_alpha_dropout(x, 0.5) * 1.0,
     [((4, 3, 2), [S0], "f")], (S0,)),
    ("dropout2d_p1", lambda x: F.dropout2d(x, 1.0), [((4, 3, 2, 2), [S1], "f")], (S1,)),
    # split into one piece: a tuple of one DTensor, like torch
    ("split_one_piece", lambda x: torch.split(x, 4, 1)[0] * 2, [((4, 4, 4), [S0], "f")],
     (S0,)),
]


def _sum3(outs):
    """native_layer_norm's output plus its two statistics (broadcast over the normed dim)."""
    out, mean, rstd = outs
    return out + mean + rstd


def _input(shape, kind, gen):
    x = torch.randn(shape, generator=gen)
    if kind == "u":
        return torch.sigmoid(x) * 0.9 + 0.05
    if kind == "p":
        return x.abs() + 1.1
    return x


def _run_cases(cases):
    """On every rank: each case's output and gradients equal the single-process ones, and its
    output placements are the expected ones."""
    from hyperpar.dtensor import DTensor, distribute_tensor, init_device_mesh
    from hyperpar.testing import assert_close_to_reference

    mesh = init_device_mesh((2,))
    failures = []
    for i, (name, fn, specs, want) in enumerate(CASES if cases is None else cases):
        gen = torch.Generator().manual_seed(i)
        fulls = [_input(shape, kind, gen) for shape, _, kind in specs]
        try:
            ref_in = [t.clone().requires_grad_() for t in fulls]
            ref = fn(*ref_in)
            w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(100 + i))
            ref_grads = (torch.autograd.grad((ref * w).sum(), ref_in, allow_unused=True)
                         if ref.requires_grad else None)
            leaves, dts = [], []
            for t, (_, pl, _) in zip(fulls, specs, strict=True):
                leaf_pl = [R if isinstance(p, Partial) else p for p in pl]
                leaf = distribute_tensor(t.clone().requires_grad_(), mesh, leaf_pl)
                leaves.append(leaf)
                dts.append(leaf.redistribute(mesh, pl))
            out = fn(*dts)
            assert isinstance(out, DTensor), f"returned {type(out)}"
            assert out.placements == want, f"placements {out.placements}, expected {want}"
            full = out.full_tensor()
            assert_close_to_reference(full, ref.detach(), **TOL, what=f"{name} value")
            if ref_grads is None:  # an integer result (indices, counts): no gradient
                assert not full.requires_grad, "a gradient where torch has none"
                continue
            (full * w).sum().backward()
            for leaf, g, t in zip(leaves, ref_grads, fulls, strict=True):
                got = leaf.grad.full_tensor() if leaf.grad is not None else torch.zeros_like(t)
                exp = g if g is not None else torch.zeros_like(t)
                assert_close_to_reference(got, exp, **TOL, what=f"{name} grad")
        except Exception as exc:  # collect every failure, not just the first
            failures.append(f"{name}: {type(exc).__name__}: {exc}"[:600])
    return failures


def _errors():
    """The messages of the refusals that used to be unclear, and tensor_split by a tensor."""
    from hyperpar.dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    full = torch.randn(5, 6)
    x = distribute_tensor(full, mesh, [S1])
    out = {}
    try:
        torch.masked.var(x, 1, keepdim=True)
        out["masked_var"] = "no error"
    except Exception as exc:
        out["masked_var"] = f"{type(exc).__name__}: {exc}"
    for key, ind in (("indices", torch.tensor([1, 4])), ("sections", torch.tensor(4))):
        pieces = torch.tensor_split(x, ind, dim=1)
        ref = torch.tensor_split(full, ind, dim=1)
        out[key] = (len(pieces) == len(ref)
                    and all(torch.equal(p.full_tensor(), r) for p, r in zip(pieces, ref,
                                                                            strict=True)))
    # the same call again with other values: the cached plan must not be reused
    pieces = torch.tensor_split(x, torch.tensor([2, 3]), dim=1)
    out["recached"] = [tuple(p.shape) for p in pieces]
    return out


def _batch_norm_running_stats():
    """batch norm in training on 2 ranks: the output and the running statistics it updates in
    place (one sharded unevenly, one replicated), against plain torch."""
    from hyperpar.dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, 3, generator=gen)
    mean, var = torch.randn(5, generator=gen), torch.rand(5, generator=gen) + 0.5
    ref_mean, ref_var = mean.clone(), var.clone()
    ref = F.batch_norm(x, ref_mean, ref_var, training=True, momentum=0.3)
    d_mean = distribute_tensor(mean.clone(), mesh, [S0])  # 5 channels: pieces of 3 and 2
    d_var = distribute_tensor(var.clone(), mesh, [R])
    out = F.batch_norm(distribute_tensor(x, mesh, [S1]), d_mean, d_var, training=True,
                       momentum=0.3)
    return [(out.full_tensor(), ref), (d_mean.full_tensor(), ref_mean),
            (d_var.full_tensor(), ref_var)]


def test_batch_norm_updates_sharded_running_stats_in_place(run_on_ranks):
    # the op runs on the same whole tensors as the reference: equal up to float32 rounding
    for got, ref in run_on_ranks(2, _batch_norm_running_stats)[0]:
        torch.testing.assert_close(got, ref, **TOL)


def test_extra_ops_match_the_full_tensor_op(run_on_ranks):
    failures = run_on_ranks(2, _run_cases, None)[0]
    assert failures == [], "\n".join(failures)


def test_unclear_refusals_are_named_or_run(run_on_ranks):
    out = run_on_ranks(2, _errors)[0]
    assert "torch.masked.var/std with mask=None" in out["masked_var"], out["masked_var"]
    assert out["indices"] is True and out["sections"] is True
    assert out["recached"] == [(5, 2), (5, 1), (5, 3)]
