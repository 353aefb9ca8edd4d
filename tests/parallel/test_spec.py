"""The framework-neutral style specs (hyperpar/parallel/spec.py): the boundary table, the
Colwise/Rowwise meanings, plan resolution -- and that the torch styles shard as the spec says."""

from __future__ import annotations

import pytest

from hyperpar.dtensor.placement import Partial, Replicate, Shard
from hyperpar.parallel.spec import (
    COLWISE,
    REPLICATED_PARAM_GRAD,
    ROWWISE,
    Comm,
    PlanKeyError,
    boundary,
    check_divisible,
    check_reachable,
    check_src_data_rank,
    feature_lengths,
    local_range,
    output_global_shape,
    prepare_comm,
    resolve_plan,
    row_bias,
    sequence_parallel,
)


@pytest.mark.parametrize(("src", "dst", "grad", "want"), [
    (Replicate(), Replicate(), "partial", Comm("none", "all_reduce")),
    (Replicate(), Replicate(), "replicate", Comm("none", "none")),
    (Shard(1), Replicate(), "partial", Comm("all_gather", "reduce_scatter", 1)),
    (Shard(-1), Replicate(), "replicate", Comm("all_gather", "chunk", -1)),
    (Replicate(), Shard(-1), "replicate", Comm("chunk", "all_gather", -1)),
    (Partial(), Replicate(), "replicate", Comm("all_reduce", "none")),
    (Partial(), Shard(1), "replicate", Comm("reduce_scatter", "all_gather", 1)),
    (Shard(0), Shard(1), "replicate", Comm("all_to_all", "all_to_all", 0, 1)),
])
def test_each_boundary_has_its_adjoint_backward(src, dst, grad, want):
    assert boundary(src, dst, grad) == want


def test_a_boundary_cannot_make_a_partial():
    with pytest.raises(ValueError, match="not make one Partial"):
        boundary(Replicate(), Partial())


def test_megatron_mlp_communicates_once_each_way():
    # Colwise fc1 -> Rowwise fc2: all-reduce of the input gradient, all-reduce of the output.
    assert COLWISE.input_comm("linear") == Comm("none", "all_reduce")
    assert COLWISE.output_comm("linear") == Comm("none", "none")
    assert ROWWISE.input_comm("linear") == Comm("none", "none")
    assert ROWWISE.output_comm("linear") == Comm("all_reduce", "none")
    assert ROWWISE.output_comm("linear", Shard(1)) == Comm("reduce_scatter", "all_gather", 1)
    assert COLWISE.input_comm("linear", Shard(1)) == Comm("all_gather", "reduce_scatter", 1)


def test_sequence_parallel_communicates_only_its_parameters_gradients():
    # A Megatron-SP norm: its slice in, its slice out, whole parameters whose per-slice
    # gradients are summed over the ranks.
    sp = sequence_parallel(1)
    assert sp.param_dims == {"module": {}}
    assert sp.input_comm("module") == Comm("none", "none")
    assert sp.output_comm("module") == Comm("none", "none")
    assert sequence_parallel(0).default_output == Shard(0)
    assert REPLICATED_PARAM_GRAD == Comm("none", "all_reduce")


def test_prepare_relayouts_treat_the_gradient_like_the_local_output():
    assert prepare_comm(Replicate(), Shard(1)) == Comm("chunk", "all_gather", 1)
    assert prepare_comm(Shard(1), Replicate()) == Comm("all_gather", "chunk", 1)
    assert prepare_comm(Shard(1), Shard(1)) == Comm("none", "none")


def test_split_dims_follow_the_weight_layouts():
    assert COLWISE.param_dims == {"linear": {"weight": 0, "bias": 0}, "embedding": {"weight": 1}}
    assert ROWWISE.param_dims == {"linear": {"weight": 1, "bias": None},
                                  "embedding": {"weight": 0}}


def test_non_divisible_dim_names_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"'fc1': weight of shape \(6, 4\) has size 6 on dim 0, "
                                         r"not divisible by the 4 tensor-parallel ranks"):
        check_divisible("ColwiseParallel", "fc1", "weight", (6, 4), 0, 4)


class _Node:
    def __init__(self, **children: _Node) -> None:
        self.children = children


def _kids(node: _Node):
    return list(node.children.items())


def test_plans_resolve_wildcards_and_nesting_in_order():
    leaf = _Node
    tree = _Node(layers=_Node(**{"0": _Node(up=leaf(), down=leaf()),
                                 "1": _Node(up=leaf(), down=leaf())}), head=leaf())
    plan = {"layers.*": {"up": "col", "down": "row"}, "head": "col"}
    got = [(path, style) for path, _, style in
           resolve_plan(tree, plan, children=_kids, is_style=lambda s: isinstance(s, str))]
    assert got == [("layers.0.up", "col"), ("layers.0.down", "row"), ("layers.1.up", "col"),
                   ("layers.1.down", "row"), ("head", "col")]


def test_a_key_matching_nothing_names_the_closest_paths():
    tree = _Node(layers=_Node(**{"0": _Node(w1=_Node(), w2=_Node())}))
    with pytest.raises(PlanKeyError, match=r"'layers.\*.w3' matched nothing in _Node; closest: "
                                           r"'layers.\*.w2', 'layers.\*.w1'"):
        resolve_plan(tree, {"layers.*.w3": "col"}, children=_kids,
                     is_style=lambda s: isinstance(s, str))


# --------------------------------------------------------------------------- torch agrees
def _torch_local_shapes() -> dict[str, tuple[int, ...]]:
    from torch import nn

    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        init_device_mesh,
        parallelize_module,
    )

    model = nn.Sequential()
    model.add_module("emb_row", nn.Embedding(8, 6))
    model.add_module("emb_col", nn.Embedding(8, 6))
    model.add_module("col", nn.Linear(6, 4))
    model.add_module("row", nn.Linear(4, 6))
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"emb_row": RowwiseParallel(), "emb_col": ColwiseParallel(),
                                     "col": ColwiseParallel(), "row": RowwiseParallel()})
    return {name: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
            for name, p in model.named_parameters()}


def test_the_torch_styles_split_the_dims_the_spec_names(run_on_ranks):
    full = {"emb_row.weight": (8, 6), "emb_col.weight": (8, 6), "col.weight": (4, 6),
            "col.bias": (4,), "row.weight": (6, 4), "row.bias": (6,)}
    specs = {"emb_row": (ROWWISE, "embedding"), "emb_col": (COLWISE, "embedding"),
             "col": (COLWISE, "linear"), "row": (ROWWISE, "linear")}
    want = {}
    for name, shape in full.items():
        module, param = name.split(".")
        spec, kind = specs[module]
        dim = spec.param_dims[kind][param]
        want[name] = tuple(s // 2 if d == dim else s for d, s in enumerate(shape))
    for shapes in run_on_ranks(2, _torch_local_shapes):
        assert shapes == want


# ------------------------------------------- decisions both frameworks' mechanics read (issue 29)
def test_src_data_rank_must_be_a_rank_of_the_group():
    check_src_data_rank("ColwiseParallel", None, 2)
    check_src_data_rank("ColwiseParallel", 1, 2)
    for bad in (2, -1):
        with pytest.raises(ValueError, match=rf"ColwiseParallel: src_data_rank={bad} is not a "
                                             r"rank of the 2-rank tensor-parallel group; give "
                                             r"0\.\.1, or None"):
            check_src_data_rank("ColwiseParallel", bad, 2)


def test_a_layout_no_boundary_reaches_is_named():
    check_reachable("RowwiseParallel", ROWWISE, Shard(-1), Partial())  # partial sums kept
    with pytest.raises(ValueError, match=r"ColwiseParallel\(output_layouts=Partial.*Partial"):
        check_reachable("ColwiseParallel", COLWISE, Replicate(), Partial())


def test_global_lengths_come_from_the_weight():
    # linear weight (out, in) = (6, 4); embedding (vocab, dim) = (10, 8)
    assert feature_lengths("linear", (6, 4)) == (4, 6)
    assert feature_lengths("embedding", (10, 8)) == (None, 8)
    # column-parallel: the last dim is the weight's (3 of 6 here); row-parallel: partial sums
    # are as long as the whole
    assert output_global_shape(COLWISE, "linear", (2, 5, 3), (6, 4)) == (2, 5, 6)
    assert output_global_shape(COLWISE, "embedding", (2, 5, 3), (10, 8)) == (2, 5, 8)
    assert output_global_shape(ROWWISE, "linear", (2, 5, 6), (6, 4)) == (2, 5, 6)


def test_row_wise_embedding_rows_follow_torch_chunk():
    # 11 rows over 4 ranks: torch.chunk's 3, 3, 3, 2
    assert [local_range(ROWWISE, "embedding", "weight", (11, 8), 4, r) for r in range(4)] == [
        (0, 3), (3, 3), (6, 3), (9, 2)]
    with pytest.raises(ValueError, match="keeps bias of a linear whole"):
        local_range(ROWWISE, "linear", "bias", (8,), 2, 0)


def test_a_partial_output_adds_the_bias_on_rank_zero_only():
    assert [row_bias(Partial()).share(r) for r in range(3)] == [1.0, 0.0, 0.0]
    assert [row_bias(Replicate()).share(r) for r in range(3)] == [1.0, 1.0, 1.0]
    assert [row_bias(Shard(1)).share(r) for r in range(3)] == [1.0, 1.0, 1.0]


def test_loss_shapes_and_vocab_embedding_keywords_are_checked_once():
    from hyperpar.parallel.layer_plan import vocab_style
    from hyperpar.parallel.loss_plan import check_loss_shapes

    check_loss_shapes((4, 11, 3), 1, (4, 3), (11,))
    with pytest.raises(ValueError, match=r"target shape \(12,\) must be the logits' global "
                                         r"shape \(4, 11, 3\) without its sharded class dim 1: "
                                         r"\(4, 3\)"):
        check_loss_shapes((4, 11, 3), 1, (12,), None)
    with pytest.raises(ValueError, match=r"one value per class \(11\), got shape \(3,\)"):
        check_loss_shapes((4, 11), -1, (4,), (3,))
    with pytest.raises(NotImplementedError, match="padding_idx and max_norm not supported"):
        vocab_style(sequence_parallel=False, sequence_dim=1, src_data_rank=0, padding_idx=0,
                    max_norm=1.0)
