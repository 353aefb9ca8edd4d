"""The framework-neutral op rules (hyperpar.dtensor.rules), checked without any framework: a mesh
is simulated in numpy. Each rank's input piece is cut from the whole array by the placements
the rule asks for (a Partial("sum") input: rank 0 of that mesh dim holds it, the others zeros),
the op runs on the pieces as the rule says (a local reshape to this rank's piece of the output,
a mean as a local sum divided by the global count), and the pieces, put back together by the
output placements (Partial dims summed or maxed over), must equal the op on the whole arrays.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from hyperpar.dtensor.layout import shard_shape_and_offset
from hyperpar.dtensor.placement import Partial, Replicate, Shard
from hyperpar.dtensor.rules import (
    P_SUM,
    GlobalMean,
    MaskedLookup,
    ShardingError,
    TensorMeta,
    broadcast_shapes,
    propagate,
)

R = Replicate()
S0, S1, S2, S3 = Shard(0), Shard(1), Shard(2), Shard(3)


def _piece(full: np.ndarray, placements, mesh_shape, coord) -> np.ndarray:
    shape, off = shard_shape_and_offset(full.shape, placements, mesh_shape, coord)
    out = full[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))]
    for m, p in enumerate(placements):
        if type(p) is Partial and coord[m] != 0:
            out = np.zeros_like(out)  # rank 0 of a Partial("sum") dim holds the value
    return out


def _softmax(x, dim):
    e = np.exp(x - x.max(dim, keepdims=True))
    return e / e.sum(dim, keepdims=True)


def _cross_entropy(logits, target, reduction, weight=None, ignore_index=-100):
    """torch's cross entropy on (N, C) logits: ignored targets count 0 in the sum and the mean's
    count; each sample is weighted by its class weight."""
    logp = np.log(_softmax(logits, 1))
    valid = target != ignore_index
    t = np.where(valid, target, 0)
    w = (np.ones(logits.shape[1]) if weight is None else weight)[t] * valid
    loss = -logp[np.arange(len(target)), t] * w
    return loss if reduction == "none" else loss.sum() if reduction == "sum" else \
        loss.sum() / w.sum()


def _ce_count(target, args, weight=None):
    """The count a mean cross entropy divides by, on this rank's targets."""
    valid = target != args.get("ignore_index", -100)
    return float(((1.0 if weight is None else weight[np.where(valid, target, 0)]) * valid).sum())


def _masked_lookup(how, w, ids, mesh_shape, coord):
    """MaskedLookup on one rank: ids in [lo, hi) look up their row of this piece, others 0."""
    lo, hi = how.rows(mesh_shape, coord)
    assert w.shape[0] == hi - lo
    inside = (ids >= lo) & (ids < hi)
    return np.where(inside[..., None], w[np.where(inside, ids - lo, 0)], 0.0)


# op -> numpy implementation on (arrays, args)
NUMPY = {
    "add": lambda xs, a: xs[0] + xs[1], "sub": lambda xs, a: xs[0] - xs[1],
    "neg": lambda xs, a: -xs[0], "mul": lambda xs, a: xs[0] * xs[1],
    "div": lambda xs, a: xs[0] / xs[1], "elementwise": lambda xs, a: np.exp(xs[0]),
    "matmul": lambda xs, a: xs[0] @ xs[1], "bmm": lambda xs, a: xs[0] @ xs[1],
    "linear": lambda xs, a: xs[0] @ xs[1].T + (xs[2] if len(xs) > 2 else 0),
    "sum": lambda xs, a: np.sum(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "mean": lambda xs, a: np.mean(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "max": lambda xs, a: np.max(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "min": lambda xs, a: np.min(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "max_dim": lambda xs, a: np.max(xs[0], a["dim"], keepdims=a.get("keepdim", False)),
    "min_dim": lambda xs, a: np.min(xs[0], a["dim"], keepdims=a.get("keepdim", False)),
    "softmax": lambda xs, a: _softmax(xs[0], a["dim"]),
    "log_softmax": lambda xs, a: np.log(_softmax(xs[0], a["dim"])),
    "reshape": lambda xs, a: xs[0].reshape(a["shape"]),
    "getitem": lambda xs, a: xs[0][a["index"]],
    "expand": lambda xs, a: np.broadcast_to(xs[0], a["shape"]),
    "transpose": lambda xs, a: np.swapaxes(xs[0], a["dim0"], a["dim1"]),
    "permute": lambda xs, a: np.transpose(xs[0], a["dims"]),
    "cat": lambda xs, a: np.concatenate(xs, a["dim"]),
    "stack": lambda xs, a: np.stack(xs, a["dim"]),
    "split": lambda xs, a: np.split(xs[0], np.cumsum(a["sizes"])[:-1], a["dim"])[a["_out"]],
    "unbind": lambda xs, a: np.moveaxis(xs[0], a["dim"], 0)[a["_out"]],
    "embedding": lambda xs, a: xs[0][xs[1]],
    "gather_d": lambda xs, a: np.take_along_axis(xs[0], xs[1], a["dim"]),
    # red29: the gathered reductions and the scans (numpy's var/std take ddof = correction)
    "prod": lambda xs, a: np.prod(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "var": lambda xs, a: np.var(xs[0], _axis(a), ddof=a.get("correction", 1),
                                keepdims=a.get("keepdim", False)),
    "std": lambda xs, a: np.std(xs[0], _axis(a), ddof=a.get("correction", 1),
                                keepdims=a.get("keepdim", False)),
    "argmax": lambda xs, a: np.argmax(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "argmin": lambda xs, a: np.argmin(xs[0], _axis(a), keepdims=a.get("keepdim", False)),
    "logsumexp": lambda xs, a: np.log(np.sum(np.exp(xs[0]), _axis(a),
                                             keepdims=a.get("keepdim", False))),
    "cumsum": lambda xs, a: np.cumsum(xs[0], a["dim"]),
    "cumprod": lambda xs, a: np.cumprod(xs[0], a["dim"]),
    "cross_entropy": lambda xs, a: _cross_entropy(xs[0], xs[1], a.get("reduction", "mean"),
                                                  xs[2] if len(xs) > 2 else None,
                                                  a.get("ignore_index", -100)),
}


def _axis(args):
    dim = args.get("dim")  # torch's reading: an empty dim list reduces every dim
    return None if dim is None or dim == [] else dim if isinstance(dim, int) else tuple(dim)


def _simulate(op, arrays, placements, mesh_shape, **args):
    metas = tuple(TensorMeta(p, a.shape) for a, p in zip(arrays, placements, strict=True))
    rule = propagate(op, metas, mesh_shape, **args)
    want = np.asarray(NUMPY[op](arrays, args))
    k = args.get("_out", 0)  # which output to check (split, unbind)
    out_pl, out_shape = rule.outputs[k], rule.shapes[k]
    assert out_shape == want.shape, (op, out_shape, want.shape)
    pieces = {}
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    locals_ = {c: [_piece(a, t, mesh_shape, c) for a, t in zip(arrays, rule.inputs, strict=True)]
               for c in coords}
    for coord in coords:
        local = locals_[coord]
        if isinstance(rule.local, MaskedLookup):
            y = _masked_lookup(rule.local, local[0], local[1], mesh_shape, coord)
        elif isinstance(rule.local, GlobalMean):
            assert rule.local.weighted == (len(local) > 2)
            w = local[2] if len(local) > 2 else None
            total = np.asarray(NUMPY[op](local, {**args, "reduction": "sum"}))
            # the all-reduce over rule.local.dims: ranks that differ only along those dims
            count = rule.local.count or sum(
                _ce_count(locals_[c][1], args, w) for c in coords
                if all(c[m] == coord[m] for m in range(len(mesh_shape))
                       if m not in rule.local.dims))
            y = total / count
        elif op in ("reshape", "expand"):  # the local op makes this rank's output piece
            shape, _ = shard_shape_and_offset(out_shape, out_pl, mesh_shape, coord)
            y = local[0].reshape(shape) if op == "reshape" else np.broadcast_to(local[0], shape)
        elif rule.divide_by is not None:
            y = np.sum(local[0], _axis(args), keepdims=args.get("keepdim", False)) \
                / rule.divide_by
        else:
            y = np.asarray(NUMPY[op](local, args))
        pieces[coord] = y
    # combine over Partial mesh dims; compare each resulting piece with the whole result's
    for coord, y in pieces.items():
        if any(type(p) is Partial and coord[m] for m, p in enumerate(out_pl)):
            continue
        total = y.astype(np.float64)
        for other, z in pieces.items():
            if other != coord and all(other[m] == coord[m] or type(p) is Partial
                                      for m, p in enumerate(out_pl)):
                ops = {p.reduce_op for m, p in enumerate(out_pl)
                       if type(p) is Partial and other[m] != coord[m]}
                total = np.maximum(total, z) if ops == {"max"} else \
                    np.minimum(total, z) if ops == {"min"} else total + z
        expect = _piece(want, tuple(R if type(p) is Partial else p for p in out_pl),
                        mesh_shape, coord)
        np.testing.assert_allclose(total, expect, rtol=1e-9, atol=1e-9,
                                   err_msg=f"{op} {placements} on {mesh_shape} at {coord}")
    return rule


rng = np.random.default_rng(0)
A56, A64, B6, B63 = (rng.standard_normal(s) for s in ((5, 6), (6, 4), (6,), (6, 3)))
A246, A463, A465 = (rng.standard_normal(s) for s in ((2, 4, 6), (4, 6, 3), (4, 6, 5)))
IDS = rng.integers(0, 6, (3, 5))
TARGET = rng.integers(0, 4, (5,))
TARGET_IGN = np.array([3, -100, 0, 2, 2])  # one ignored target
TARGET_IGN1 = np.array([1, 0, 3, 1, 3])     # ignore_index=1 drops two
W4 = np.array([0.5, 2.0, 1.0, 3.0])        # class weights

CASES = [
    ("add", [A56, B6], [(S0,), (R,)], (4,), {}),
    ("add", [A56, A56], [(P_SUM,), (P_SUM,)], (2,), {}),
    ("add", [A56, A56], [(S1, P_SUM), (P_SUM, S0)], (2, 2), {}),
    ("sub", [A56, A56], [(S0,), (S1,)], (3,), {}),
    ("neg", [A56], [(P_SUM,)], (2,), {}),
    ("mul", [A56, B6], [(P_SUM,), (S0,)], (2,), {}),
    ("mul", [A56, A56], [(P_SUM,), (P_SUM,)], (2,), {}),
    ("div", [A56, A56 + 9], [(P_SUM,), (R,)], (2,), {}),
    ("div", [A56 + 9, A56], [(R,), (P_SUM,)], (2,), {}),
    ("elementwise", [A56], [(P_SUM,)], (2,), {}),
    ("elementwise", [A56], [(S1, S0)], (2, 2), {}),
    ("matmul", [A56, B63], [(S0,), (R,)], (4,), {}),
    ("matmul", [A56, B63], [(S1,), (S0,)], (4,), {}),
    ("matmul", [A56, B63], [(S0, S1), (R, S1)], (2, 2), {}),
    ("matmul", [A56, B63], [(P_SUM,), (S1,)], (2,), {}),
    ("matmul", [A246, B63], [(S0,), (R,)], (2,), {}),
    ("bmm", [A465.transpose(0, 2, 1), A463], [(S0,), (S2,)], (2,), {}),
    ("bmm", [A465.transpose(0, 2, 1), A463], [(S2,), (S1,)], (2,), {}),
    ("linear", [A56, A64.T, A64[0]], [(R,), (S0,), (S0,)], (2,), {}),
    ("linear", [A56, A64.T, A64[0]], [(S1,), (S1,), (R,)], (4,), {}),
    ("linear", [A56, A64.T], [(S0, S1), (R, S1)], (2, 2), {}),
    ("sum", [A56], [(S0,)], (4,), {"dim": 0}),
    ("sum", [A56], [(S0, S1)], (2, 2), {"dim": None}),
    ("sum", [A56], [(P_SUM,)], (2,), {"dim": 1, "keepdim": True}),
    ("mean", [A56], [(S0,)], (4,), {"dim": (0,)}),
    ("mean", [A56], [(S1, S0)], (2, 2), {"dim": 1, "keepdim": True}),
    ("max", [A56], [(S0,)], (4,), {"dim": 0}),
    ("max", [A56], [(S1,)], (2,), {"dim": 0}),
    # negative and several dims, keepdim, uneven shards (5 rows over 4 ranks: 2, 2, 1, 0)
    ("sum", [A56], [(S0,)], (4,), {"dim": -2, "keepdim": True}),
    ("sum", [A246], [(S2, S0)], (2, 2), {"dim": (-1, 1)}),
    ("sum", [A246], [(S1,)], (4,), {"dim": []}),
    ("mean", [A56], [(S0,)], (4,), {"dim": (0, -1)}),
    ("mean", [A465], [(S2, S1)], (2, 2), {"dim": (2,), "keepdim": True}),
    ("max", [A56], [(S0, S1)], (2, 2), {"dim": None}),
    ("min", [A56], [(S0,)], (4,), {"dim": -2, "keepdim": True}),
    ("max_dim", [A56], [(S0,)], (4,), {"dim": -2}),
    # pending (no gradient: torch's amax under no_grad): Partial(max/min) over shards
    ("max", [A56], [(S0,)], (2,), {"dim": 0, "pending": True}),
    ("min", [A56], [(S1, S0)], (2, 2), {"dim": None, "pending": True}),
    ("max", [A56], [(S0,)], (4,), {"dim": 0, "pending": True}),  # a piece is empty: gathered
    ("min", [A56], [(Partial("min"),)], (2,), {"dim": 1, "pending": True}),
    ("min_dim", [A246], [(S1, S2)], (2, 2), {"dim": 2, "keepdim": True}),
    # red29: gathered reductions keep a shard of another dim (renumbered unless keepdim) and
    # reduce a Partial first; scans gather their dim only
    ("prod", [A56], [(S0,)], (2,), {"dim": 1}),
    ("prod", [A246], [(S2, S0)], (2, 2), {"dim": 0, "keepdim": True}),
    ("var", [A56], [(S1,)], (4,), {"dim": 1, "correction": 0}),
    ("var", [A246], [(S1, S2)], (2, 2), {"dim": (0, 2)}),
    ("var", [A246], [(S1, S2)], (2, 2), {"dim": []}),  # torch: an empty dim list is every dim
    ("std", [A56], [(P_SUM,)], (2,), {"dim": 0, "keepdim": True}),
    ("argmax", [A56], [(S0,)], (4,), {"dim": 1}),
    ("argmax", [A246], [(S1, S2)], (2, 2), {"dim": -1, "keepdim": True}),
    ("argmin", [A56], [(S0, S1)], (2, 2), {"dim": None}),
    ("logsumexp", [A246], [(S0, S1)], (2, 2), {"dim": 1}),
    ("cumsum", [A56], [(S0, S1)], (2, 2), {"dim": 1}),
    ("cumprod", [A246], [(P_SUM, S1)], (2, 2), {"dim": 0}),
    ("softmax", [A56], [(S1,)], (2,), {"dim": 1}),
    ("log_softmax", [A56], [(S0, S1)], (2, 2), {"dim": 0}),
    ("reshape", [A64], [(S0,)], (2,), {"shape": (-1,)}),
    ("reshape", [A64], [(S0,)], (4,), {"shape": (2, 12)}),
    ("reshape", [A56], [(S0,)], (4,), {"shape": (30,)}),
    ("reshape", [A64], [(S1,)], (2,), {"shape": (24,)}),
    ("reshape", [A246], [(S1, S2)], (2, 2), {"shape": (8, 6)}),
    ("reshape", [A465], [(S2,)], (4,), {"shape": (24, 5)}),    # 5 over 4: 2, 2, 1, 0 kept
    ("reshape", [A465], [(S0, S2)], (2, 2), {"shape": (24, 5)}),
    # size-1 dims (unsqueeze, squeeze, flatten/unflatten around them) and an empty tensor
    ("reshape", [A64], [(S0,)], (2,), {"shape": (1, 6, 4)}),
    ("reshape", [A64], [(S1, S0)], (2, 2), {"shape": (6, 1, 4, 1)}),
    ("reshape", [A64.reshape(1, 6, 1, 4)], [(S1, S3)], (4, 2), {"shape": (6, 4)}),
    ("reshape", [A246], [(S1,)], (2,), {"shape": (2, 1, 24)}),
    ("reshape", [A465], [(S1,)], (4,), {"shape": (4, 2, 3, 5)}),   # 6 over 4: gathered
    ("reshape", [A465], [(S1, S2)], (2, 2), {"shape": (4, 3, 2, 5)}),
    ("reshape", [np.zeros((0, 6))], [(S1,)], (2,), {"shape": (3, 0, 2)}),
    ("transpose", [A246], [(S0, S2)], (2, 2), {"dim0": 0, "dim1": 2}),
    ("cat", [A56, A56[:3]], [(S1, S0), (R, S0)], (2, 2), {"dim": 0}),
    ("cat", [A465, A465], [(S0, P_SUM), (S2, P_SUM)], (4, 2), {"dim": -1}),
    ("stack", [A56, A56 * 2], [(S1,), (S0,)], (4,), {"dim": 1}),
    ("stack", [A56, A56], [(P_SUM, S0), (P_SUM, S1)], (2, 2), {"dim": -1}),
    ("split", [A465], [(S1, S0)], (2, 2), {"dim": 1, "sizes": (4, 2), "_out": 1}),
    ("split", [A465], [(P_SUM, S2)], (2, 2), {"dim": -1, "sizes": (2, 2, 1), "_out": 0}),
    ("unbind", [A246], [(S0, S2)], (2, 2), {"dim": 1, "_out": 3}),
    ("permute", [A246], [(P_SUM, S1)], (2, 2), {"dims": (2, 0, 1)}),
    ("embedding", [A64, IDS], [(R,), (S1,)], (4,), {}),
    ("embedding", [A64, IDS], [(S1,), (R,)], (2,), {}),
    ("embedding", [A64, IDS], [(S0,), (S0,)], (2,), {}),
    # vocabulary-parallel: a masked lookup of this rank's rows, Partial output
    ("embedding", [A64, IDS], [(S0,), (R,)], (2,), {}),
    ("embedding", [A64, IDS], [(S0,), (R,)], (3,), {"padding_idx": -1}),
    ("embedding", [A64, IDS], [(S0,), (R,)], (4,), {}),   # 6 rows over 4: one rank has none
    ("embedding", [A64, IDS], [(S0, S0), (R, R)], (2, 2), {"padding_idx": 2}),
    ("embedding", [A64, IDS], [(S0, R), (R, S1)], (2, 2), {}),
    ("embedding", [A64, IDS], [(S1, S0), (S0, R)], (2, 2), {}),
    ("gather_d", [A56, IDS[:, :5].repeat(2, 0)[:5, :4] % 6], [(S0,), (R,)], (2,), {"dim": 1}),
    ("cross_entropy", [A56[:, :4], TARGET], [(S0,), (S0,)], (2,), {"reduction": "sum"}),
    ("cross_entropy", [A56[:, :4], TARGET], [(S1,), (S0,)], (4,), {"reduction": "none"}),
    ("cross_entropy", [A56[:, :4], TARGET], [(S0,), (R,)], (2,), {"reduction": "mean"}),
    # a mean over a sharded batch: local sum / global count of non-ignored (weighted) targets
    ("cross_entropy", [A56[:, :4], TARGET_IGN], [(S0,), (S0,)], (4,), {}),
    ("cross_entropy", [A56[:, :4], TARGET_IGN1, W4], [(S0,), (R,), (R,)], (2,),
     {"ignore_index": 1}),
    ("cross_entropy", [A56[:, :4], TARGET_IGN, W4], [(S0, S0), (R, R), (S0, R)], (2, 2), {}),
    ("cross_entropy", [A56[:, :4], TARGET_IGN, W4], [(S0, S1), (S0, R), (R, R)], (2, 2),
     {"reduction": "sum"}),
    # view29b: basic indexing (touched dims gathered, other shards move) and expand
    ("getitem", [A246], [(S1,)], (2,), {"index": (slice(None), slice(1, 3))}),
    ("getitem", [A246], [(S2, S0)], (2, 2), {"index": (None, Ellipsis, 0)}),
    ("getitem", [A465], [(S1,)], (4,), {"index": (0, Ellipsis, slice(None, None, 2))}),
    ("getitem", [A465], [(S2,)], (4,), {"index": (1, slice(None))}),  # 5 over 4: uneven kept
    ("getitem", [A56], [(P_SUM, S1)], (2, 2), {"index": -1}),
    ("getitem", [A56], [(S0,)], (4,), {"index": (slice(1, None, 2), None)}),
    ("getitem", [A56], [(S1,)], (2,), {"index": Ellipsis}),
    ("expand", [A56[:, None]], [(S0,)], (4,), {"shape": (3, 5, 2, 6)}),
    ("expand", [A56[:, None]], [(S1,)], (2,), {"shape": (5, 4, 6)}),  # a sharded 1 grows
    ("expand", [A56[:, None]], [(P_SUM, S2)], (2, 2), {"shape": (2, 5, 3, 6)}),
]


@pytest.mark.parametrize("op,arrays,placements,mesh_shape,args", CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_rule_output_assembles_to_the_whole_result(op, arrays, placements, mesh_shape, args):
    _simulate(op, arrays, placements, mesh_shape, **args)


def test_the_rules_keep_communication_low_where_they_can():
    # column-parallel linear: no input moves, the output is sharded along the features
    r = propagate("linear", (TensorMeta((R,), (4, 6)), TensorMeta((S0,), (8, 6)),
                             TensorMeta((S0,), (8,))), (2,))
    assert r.inputs == ((R,), (S0,), (S0,)) and r.outputs == ((S1,),)
    assert r.grad_sum == ((0,), (), ())  # the replicated input's gradient is summed
    # row-parallel: Partial output, the bias added once
    r = propagate("linear", (TensorMeta((S1,), (4, 6)), TensorMeta((S1,), (8, 6)),
                             TensorMeta((R,), (8,))), (2,))
    assert r.outputs == ((P_SUM,),) and r.inputs[2] == (P_SUM,)
    # a sum over a sharded dim stays Partial; a mean too, as a sum over the global count
    r = propagate("mean", (TensorMeta((S0,), (5, 6)),), (4,), dim=0)
    assert r.outputs == ((P_SUM,),) and r.divide_by == 5
    # a dim kept whole by a reshape keeps its uneven shard (logits (B, S, 11) -> (B * S, 11)
    # for loss_parallel): torch.chunk's pieces do not change
    r = propagate("reshape", (TensorMeta((S2,), (2, 8, 11)),), (4,), shape=(16, 11))
    assert r.inputs == ((S2,),) and r.outputs == ((S1,),)
    # unsqueeze / squeeze move the shard to the dim it became, without communication
    r = propagate("reshape", (TensorMeta((S0, S1), (6, 4)),), (2, 2), shape=(1, 6, 1, 4))
    assert r.inputs == ((S0, S1),) and r.outputs == ((S1, S3),)
    r = propagate("reshape", (TensorMeta((S2,), (2, 1, 7)),), (4,), shape=(2, 7))
    assert r.inputs == ((S2,),) and r.outputs == ((S1,),)
    # a split of the sharded dim keeps the shard when both sizes divide by the ranks
    r = propagate("reshape", (TensorMeta((S1, S1), (3, 8)),), (2, 2), shape=(3, 4, 2))
    assert r.inputs == ((S1, S1),) and r.outputs == ((S1, S1),)
    # cat keeps shards off the cat dim (others take the first input's layout); stack moves them
    r = propagate("cat", (TensorMeta((S0,), (4, 6)), TensorMeta((S1,), (4, 2))), (2,), dim=1)
    assert r.inputs == ((S0,), (S0,)) and r.outputs == ((S0,),) and r.shapes == ((4, 8),)
    r = propagate("stack", (TensorMeta((S1,), (4, 6)),) * 3, (2,), dim=0)
    assert r.inputs == ((S1,),) * 3 and r.outputs == ((S2,),) and r.shapes == ((3, 4, 6),)
    r = propagate("split", (TensorMeta((S1,), (4, 6)),), (2,), dim=0, sizes=(3, 1))
    assert r.inputs == ((S1,),) and r.outputs == ((S1,),) * 2
    # a constant added to a Partial sum would be added once per rank: reduce first
    r = propagate("add", (TensorMeta((P_SUM,), (5, 6)),), (2,), has_scalar=True)
    assert r.inputs == ((R,),)


def test_vocab_parallel_lookup_and_global_mean_describe_the_local_computation():
    # the rows of each rank follow the table's Shard(0) pieces (torch.chunk), over two mesh dims
    r = propagate("embedding", (TensorMeta((S0, S0), (7, 4)), TensorMeta((R, R), (3,))), (2, 2),
                  padding_idx=-2)
    how = r.local
    assert isinstance(how, MaskedLookup) and how.dims == (0, 1) and how.padding_idx == 5
    assert r.outputs == ((P_SUM, P_SUM),) and r.shapes == ((3, 4),)
    ranges = [how.rows((2, 2), c) for c in itertools.product(range(2), range(2))]
    assert ranges == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert [how.local_padding(lo, hi) for lo, hi in ranges] == [None, None, 1, None]
    with pytest.raises(ValueError, match="padding_idx 7 is outside the table's 7 rows"):
        propagate("embedding", (TensorMeta((S0,), (7, 4)), TensorMeta((R,), (3,))), (2,),
                  padding_idx=7)
    # sharded ids win over a vocabulary-sharded table on the same mesh dim (no masked lookup)
    r = propagate("embedding", (TensorMeta((S0,), (7, 4)), TensorMeta((S0,), (4,))), (2,))
    assert r.local is None and r.inputs == ((R,), (S0,)) and r.outputs == ((S0,),)
    # a mean cross entropy over a batch sharded on mesh dim 1 only all-reduces over dim 1
    r = propagate("cross_entropy", (TensorMeta((R, S0), (8, 5)), TensorMeta((R, R), (8,)),
                                    TensorMeta((R, R), (5,))), (2, 2), ignore_index=3)
    assert r.local == GlobalMean((1,), 3, True) and r.outputs == ((R, P_SUM),)
    assert r.inputs == ((R, S0), (R, S0), (R, R))
    # K-dim logits (N, C, L) sharded on L: the target (N, L) follows on its dim 1
    r = propagate("cross_entropy", (TensorMeta((S2,), (4, 5, 6)), TensorMeta((R,), (4, 6))),
                  (2,), reduction="none")
    assert r.inputs == ((S2,), (S1,)) and r.outputs == ((S1,),) and r.shapes == ((4, 6),)
    # probability targets: the mean divides by the (known) number of samples, no all-reduce
    r = propagate("cross_entropy", (TensorMeta((S0,), (8, 5)), TensorMeta((R,), (8, 5))), (2,))
    assert r.local == GlobalMean((0,), count=8) and r.divide_by is None
    assert r.inputs == ((S0,), (S0,))
    # the class dim is gathered; a mean over an unsharded batch is the op itself
    r = propagate("cross_entropy", (TensorMeta((S1,), (8, 5)), TensorMeta((S0,), (8,))), (2,))
    assert r.local is None and r.inputs == ((R,), (R,)) and r.outputs == ((R,),)


def test_an_op_or_layout_without_a_rule_names_both():
    with pytest.raises(ShardingError, match=r"'fft'.*\[Shard\(dim=0\)\] shape \(5, 6\)"):
        propagate("fft", (TensorMeta((S0,), (5, 6)),), (2,))
    with pytest.raises(ShardingError, match=r"'matmul'.*0-dim operand"):
        propagate("matmul", (TensorMeta((S0,), (5, 6)), TensorMeta((R,), ())), (2,))


def test_matmul_follows_torch_matmul_for_vectors_and_broadcast_batch_dims():
    # matrix @ vector: the row shard stays; a sharded vector makes the product Partial
    r = propagate("matmul", (TensorMeta((S0,), (5, 6)), TensorMeta((R,), (6,))), (2,))
    assert r.inputs == ((S0,), (R,)) and r.outputs == ((S0,),) and r.shapes == ((5,),)
    r = propagate("matmul", (TensorMeta((R,), (6,)), TensorMeta((S0,), (6, 7))), (2,))
    assert r.inputs == ((S0,), (S0,)) and r.outputs == ((P_SUM,),) and r.shapes == ((7,),)
    r = propagate("matmul", (TensorMeta((S0,), (6,)), TensorMeta((S0,), (6,))), (2,))
    assert r.outputs == ((P_SUM,),) and r.shapes == ((),)
    # a batch dim of size 1 broadcast against 4: the larger side keeps its shard, the other
    # side (one matrix for every batch) is not split along it
    r = propagate("matmul", (TensorMeta((S0,), (4, 3, 5)), TensorMeta((R,), (1, 5, 2))), (2,))
    assert r.inputs == ((S0,), (R,)) and r.outputs == ((S0,),) and r.shapes == ((4, 3, 2),)
    r = propagate("matmul", (TensorMeta((R,), (1, 3, 5)), TensorMeta((S0,), (4, 5, 2))), (2,))
    assert r.inputs == ((R,), (S0,)) and r.outputs == ((S0,),)
    # batch dims of different counts align from the right
    r = propagate("matmul", (TensorMeta((S0, S1), (2, 4, 3, 5)), TensorMeta((S0, R), (4, 5, 2))),
                  (2, 2))
    assert r.outputs == ((S0, S1),) and r.shapes == ((2, 4, 3, 2),)


def test_broadcast_shapes_is_numpys():
    for shapes in [((5, 1, 3), (4, 1)), ((), (2, 3)), ((3,), (2, 3)), ((1,), (1, 1, 7))]:
        assert broadcast_shapes(*shapes) == np.broadcast_shapes(*shapes)
    with pytest.raises(ValueError):
        broadcast_shapes((2, 3), (4,))


# ---------------------------------------------------------------------------- norms, attention
def _normalised(x, axes, eps=1e-5):
    mean = x.mean(axes, keepdims=True)
    var = x.var(axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps), mean, var


def _layer_norm(xs, a):
    n = 1 if isinstance(a["normalized_shape"], int) else len(a["normalized_shape"])
    x = xs[0]
    y, mean, var = _normalised(x, tuple(range(x.ndim - n, x.ndim)))
    if len(xs) > 1:
        y = y * xs[1]  # the weight
    if len(xs) > 2:
        y = y + xs[2]  # the bias
    return (y, mean, var)[a.get("_out", 0)]


def _rms_norm(xs, a):
    x = xs[0]
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    return y * xs[1] if len(xs) > 1 else y


def _group_norm(xs, a):
    x, g = xs[0], a["num_groups"]
    grouped = x.reshape(x.shape[0], g, -1)
    y, mean, var = _normalised(grouped, (2,))
    y = y.reshape(x.shape)
    if len(xs) > 1:  # per-channel weight and bias (dim 1)
        y = y * xs[1].reshape(-1, *(1,) * (x.ndim - 2)) + xs[2].reshape(-1, *(1,) * (x.ndim - 2))
    return (y, mean[..., 0], var[..., 0])[a.get("_out", 0)]


def _sdpa(xs, a):
    q, k, v = xs[:3]
    group = q.shape[-3] // k.shape[-3]  # grouped key/value heads serve `group` query heads
    k, v = np.repeat(k, group, -3), np.repeat(v, group, -3)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if len(xs) > 3:
        s = s + xs[3]  # an additive mask
    return _softmax(s, -1) @ v


NUMPY.update({"layer_norm": _layer_norm, "rms_norm": _rms_norm, "group_norm": _group_norm,
              "sdpa": _sdpa})
W5, W6, Q, K, V, MASK = (rng.standard_normal(s) for s in ((5,), (6,), (2, 4, 3, 5), (2, 2, 6, 5),
                                                            (2, 2, 6, 4), (3, 6)))
NORM_ATTENTION_CASES = [
    ("layer_norm", [A465, W5, W5], [(S0,), (S0,), (P_SUM,)], (2,), {"normalized_shape": (5,)}),
    ("layer_norm", [A465], [(S2, S1)], (2, 2), {"normalized_shape": (6, 5)}),
    # a Partial input is reduced first (the bias shows it: a normalised zero is not zero)
    ("layer_norm", [A465, W5, W5], [(S1, P_SUM), (R, S0), (R, R)], (4, 2),  # 6 over 4: 2,2,2,0
     {"normalized_shape": 5}),
    # MindSpore's LayerNorm also returns the mean and variance, laid out like the output
    ("layer_norm", [A465, W5, W5], [(S1, S2), (R, R), (R, R)], (2, 2),
     {"normalized_shape": (5,), "stats": 2, "_out": 1}),
    ("layer_norm", [A465], [(S0, S1)], (2, 2), {"normalized_shape": (6, 5), "stats": 2,
                                                "_out": 2}),
    ("rms_norm", [A465, W5], [(S1,), (P_SUM,)], (2,), {"normalized_shape": (5,)}),
    ("rms_norm", [A465], [(S2, S0)], (2, 2), {"normalized_shape": [5]}),
    ("group_norm", [A465, W6, W6], [(S0, S1), (S0, R), (R, R)], (2, 2), {"num_groups": 3}),
    ("group_norm", [A465], [(S2,)], (4,), {"num_groups": 2, "stats": 2, "_out": 1}),
    ("group_norm", [A465, W6, W6], [(S0, P_SUM), (R, R), (R, R)], (2, 2),
     {"num_groups": 6, "stats": 2}),
    ("sdpa", [Q, K, V], [(S0,), (R,), (S2,)], (2,), {}),   # batch (q's) kept
    ("sdpa", [Q, K, V], [(S1,), (S1,), (S1,)], (2,), {}),  # heads: 4 and 2 over 2
    ("sdpa", [Q, K, V], [(S1,), (S1,), (S1,)], (4,), {}),  # 2 kv heads over 4: gathered
    ("sdpa", [Q, K, V, MASK], [(S1, S0), (R, P_SUM), (S3, R), (S0, S1)], (2, 2), {}),
    ("sdpa", [Q, K, V, np.broadcast_to(MASK, (2, 1, 3, 6))], [(S2,), (S1,), (S0,), (S0,)],
     (2,), {}),  # a heads shard; the mask broadcasts over heads: replicated
]


@pytest.mark.parametrize("op,arrays,placements,mesh_shape,args", NORM_ATTENTION_CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in NORM_ATTENTION_CASES])
def test_norm_and_attention_rules_assemble_to_the_whole_result(op, arrays, placements,
                                                               mesh_shape, args):
    _simulate(op, arrays, placements, mesh_shape, **args)


def test_norm_and_attention_rules_keep_batch_and_head_shards():
    # a batch-sharded layer norm moves nothing; the replicated weight's gradient is summed
    r = propagate("layer_norm", (TensorMeta((S0,), (4, 6, 5)), TensorMeta((R,), (5,))), (2,),
                  normalized_shape=(5,))
    assert r.inputs == ((S0,), (R,)) and r.outputs == ((S0,),) and r.grad_sum == ((), (0,))
    # the normalised dims and a Partial are gathered; a sharded weight too
    r = propagate("rms_norm", (TensorMeta((S2, P_SUM), (4, 6, 5)), TensorMeta((S0, R), (5,))),
                  (2, 2), normalized_shape=5)
    assert r.inputs == ((R, R), (R, R)) and r.outputs == ((R, R),)
    r = propagate("group_norm", (TensorMeta((S0, S1), (4, 6, 5)),), (2, 2), num_groups=2,
                  stats=2)
    assert r.outputs == ((S0, R),) * 3 and r.shapes == ((4, 6, 5), (4, 2), (4, 2))
    # heads stay sharded with the mask following them; uneven heads are gathered
    q, kv = TensorMeta((S1,), (2, 4, 3, 5)), TensorMeta((S1,), (2, 2, 6, 5))
    r = propagate("sdpa", (q, kv, kv, TensorMeta((R,), (2, 4, 3, 6))), (2,))
    assert r.inputs == ((S1,), (S1,), (S1,), (S1,)) and r.outputs == ((S1,),)
    assert r.shapes == ((2, 4, 3, 5),)
    r = propagate("sdpa", (q, kv, kv), (4,))
    assert r.inputs == ((R,),) * 3 and r.outputs == ((R,),)
    # a sequence shard is gathered (context parallelism is the styles' job)
    kv = TensorMeta((R,), (2, 2, 6, 5))
    r = propagate("sdpa", (TensorMeta((S2,), (2, 4, 3, 5)), kv, kv), (2,))
    assert r.inputs == ((R,), (R,), (R,))


def test_rules_and_layout_import_no_framework():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'mindspore', 'numpy'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import hyperpar.dtensor.rules, hyperpar.dtensor.layout\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_max_dim_gathers_a_partial_max_input_because_its_indices_cannot_be_combined():
    for op in ("max_dim", "min_dim"):
        p = Partial(op[:3])
        r = propagate(op, (TensorMeta((p,), (5, 6)),), (2,), dim=1)
        assert r.inputs == ((R,),) and r.outputs == ((R,), (R,)) and r.shapes == ((5,), (5,))
    # a whole-tensor max of a Partial("max") input stays pending (max commutes with max) only
    # where no gradient flows; else it is reduced first (its gradient must reach one rank)
    r = propagate("max", (TensorMeta((Partial("max"),), (5, 6)),), (2,), pending=True)
    assert r.outputs == ((Partial("max"),),) and r.shapes == ((),)
    r = propagate("max", (TensorMeta((Partial("max"),), (5, 6)),), (2,))
    assert r.inputs == ((R,),) and r.outputs == ((R,),)


def test_pending_max_over_shards_is_partial_unless_a_piece_is_empty():
    r = propagate("max", (TensorMeta((S0, S1), (6, 4)),), (2, 2), dim=0, pending=True)
    assert r.inputs == ((S0, S1),) and r.outputs == ((Partial("max"), S0),)
    r = propagate("min", (TensorMeta((S0,), (5, 6)),), (4,), dim=0, pending=True)
    assert r.inputs == ((R,),) and r.outputs == ((R,),)  # 5 rows over 4: 2, 2, 1, 0
    r = propagate("max", (TensorMeta((S0,), (6, 4)),), (2,), dim=0)  # a gradient may flow
    assert r.inputs == ((R,),) and r.outputs == ((R,),)


def test_a_reduction_dim_out_of_range_raises_naming_it():
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range "
                                         r"of \[-2, 1\], but got 2\)"):
        propagate("sum", (TensorMeta((S0,), (5, 6)),), (2,), dim=2)


def test_view_shapes_match_numpy_and_refuse_dims_out_of_range():
    from hyperpar.dtensor.rules.view import flattened_shape, squeezed_shape, unsqueezed_shape

    a = np.zeros((2, 1, 3, 1))
    for start, end in [(0, -1), (1, 2), (-2, -1), (2, 2)]:
        want = a.reshape(a.shape[:start % 4] + (-1,) + a.shape[end % 4 + 1:]).shape
        assert flattened_shape(a.shape, start, end) == want
    assert flattened_shape((), 0, -1) == (1,)  # a 0-d tensor flattens to one element
    assert [unsqueezed_shape((2, 3), d) for d in (0, 2, -1, -3)] == \
        [np.expand_dims(np.zeros((2, 3)), d).shape for d in (0, 2, -1, -3)]
    assert squeezed_shape(a.shape) == (2, 3) and squeezed_shape(a.shape, (1, 2)) == (2, 3, 1)
    assert squeezed_shape(a.shape, -1) == (2, 1, 3)
    for bad in (lambda: flattened_shape((2, 3), 0, 2), lambda: unsqueezed_shape((2, 3), 3),
                lambda: unsqueezed_shape((2, 3), -4), lambda: squeezed_shape((2, 3), 2)):
        with pytest.raises(IndexError, match=r"Dimension out of range"):
            bad()
    with pytest.raises(ValueError, match="start_dim 1 cannot come after end_dim 0"):
        flattened_shape((2, 3), 1, 0)


def test_layout_helpers_both_frameworks_share():
    from hyperpar.dtensor.layout import check_chunk_split, even_global_shape, some_rank_empty

    assert even_global_shape((3, 2), (S0, S1), (2, 4)) == (6, 8)
    assert even_global_shape((3, 2), (R, Partial()), (2, 2)) == (3, 2)
    assert check_chunk_split([2, 2, 1, 0], 1) == 5
    with pytest.raises(ValueError, match=r"lengths \[2, 3\].*torch.chunk's pieces \[3, 2\]"):
        check_chunk_split([2, 3], 0, "boundary")
    assert some_rank_empty((5, 6), (S0,), (4,))  # 2, 2, 1, 0
    assert some_rank_empty((6, 6), (S0,), (4,))  # 2, 2, 2, 0
    assert not some_rank_empty((8, 6), (S0,), (4,)) and not some_rank_empty((0, 6), (S0,), (4,))
    assert some_rank_empty((4, 3), (S0, S1), (2, 4))  # 3 columns over 4: 1, 1, 1, 0


def test_loss_parallel_plan():
    from hyperpar.parallel.loss_plan import (
        check_loss_args,
        class_shard,
        flatten_outside_shard,
    )

    # 10 classes over 4 ranks: torch.chunk gives 3, 3, 3, 1 -> rank 3 holds [9, 10)
    assert class_shard((S1,), (8, 10), (4,), (3,), class_dim=1) == (0, 1, 9, 1)
    assert class_shard((R, Shard(-1)), (8, 10), (2, 4), (1, 2), class_dim=1) == (1, 1, 6, 3)
    assert class_shard((S0,), (8, 10), (4,), (0,), class_dim=1) is None  # rows, not classes
    assert class_shard((S1, S0), (8, 10), (2, 2), (0, 0)) is None  # two shards
    assert class_shard((S1, P_SUM), (8, 10), (2, 2), (0, 0)) is None  # a pending sum
    assert class_shard((Shard(-1),), (2, 3, 10), (2,), (1,)) == (0, 2, 5, 5)
    for bad, match in (("avg", "reduction"), ("mean", "label_smoothing")):
        with pytest.raises(ValueError, match=match):
            check_loss_args(bad, 1.5 if bad == "mean" else 0.0)
    # logits [B, S, V] sharded on V, flattened over (B, S): the shard moves to dim 1
    assert flatten_outside_shard((S2,), (2, 3, 10), 0, 1) == ((S1,), (6, 10))
    assert flatten_outside_shard((S0,), (2, 3, 10), 1, 2) == ((S0,), (2, 30))
    assert flatten_outside_shard((S1,), (2, 3, 10), 0, 1) is None  # the shard is flattened
    assert flatten_outside_shard((S2, R), (2, 3, 10), 0, 1) is None  # 2-D mesh: no plan


def test_placements_move_to_a_transposed_mesh_only_where_the_layout_survives():
    from hyperpar.dtensor.remesh import moved_placements

    swap = (1, 0)
    assert moved_placements((S0, S1), swap) == (S1, S0)
    assert moved_placements((S0, R), swap) == (R, S0)
    # one dim split by both mesh dims: moving them would swap the outer and inner split
    assert moved_placements((S0, S0), swap) is None
    assert moved_placements((S0, S0), (0, 1)) == (S0, S0)
    # two different pending reductions may not be reordered; two sums may
    assert moved_placements((Partial("sum"), Partial("max")), swap) is None
    assert moved_placements((Partial("sum"), Partial("sum")), swap) == (Partial(), Partial())


def test_basic_index_and_expand_read_like_torch_and_refuse_the_rest():
    from hyperpar.dtensor.rules.index import basic_index, expanded_shape

    # the row shard of x[:, 1:3] stays; x[None, ..., 0] moves it to dim 1
    r = propagate("getitem", (TensorMeta((S0,), (8, 6)),), (2,), index=(slice(None), slice(1, 3)))
    assert r.inputs == ((S0,),) and r.outputs == ((S0,),) and r.shapes == ((8, 2),)
    r = propagate("getitem", (TensorMeta((S0, S1), (8, 6)),), (2, 2), index=(None, Ellipsis, 0))
    assert r.inputs == ((S0, R),) and r.outputs == ((S1, R),) and r.shapes == ((1, 8),)
    assert basic_index((slice(2, None, 3), None), (8, 6)) == ({0}, {0: 0, 1: 2}, (2, 1, 6))
    for bad, err in (((8,), IndexError), ((0, 0, 0), IndexError), ((Ellipsis, Ellipsis),
                     IndexError), ((slice(None, None, -1),), ValueError)):
        with pytest.raises(err):
            propagate("getitem", (TensorMeta((S0,), (8, 6)),), (2,), index=bad)
    # advanced indices (a list, a bool mask, an array) have no rule: never a guessed layout
    for bad in ([0, 1], True, (slice(None), np.array([0]))):
        with pytest.raises(ShardingError, match="basic indexing"):
            propagate("getitem", (TensorMeta((S0,), (8, 6)),), (2,), index=bad)
    # expand: -1 keeps a dim; a new leading dim is replicated; a size-1 shard that grows gathers
    assert expanded_shape((5, 1, 6), (2, -1, 3, -1)) == (2, 5, 3, 6)
    r = propagate("expand", (TensorMeta((S1, S0), (5, 1, 6)),), (2, 2), shape=(2, 5, 3, 6))
    assert r.inputs == ((R, S0),) and r.outputs == ((R, S1),)
    for bad in ((5, 2, 7), (-1, 5, 1, 6), (1, 6)):
        with pytest.raises(ValueError, match="expand"):
            propagate("expand", (TensorMeta((S0,), (5, 1, 6)),), (2,), shape=bad)
