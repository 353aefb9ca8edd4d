"""Behaviour of the individual styles, plans and tensor-parallel layers (2 and 4 real ranks)."""

from __future__ import annotations

import pytest
import torch
from _tp_llama import llama
from torch import nn

from hyperpar.dtensor import DTensor, Replicate, Shard, init_device_mesh
from hyperpar.parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    PlanKeyError,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowParallelLinear,
    RowwiseParallel,
    UnsupportedModuleError,
    VocabParallelEmbedding,
    parallelize_module,
)
from hyperpar.platform import get_platform
from hyperpar.testing import assert_close_to_reference


def _mesh():
    return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))


def _raises(fn, exc, *needles):
    try:
        fn()
    except exc as err:
        for needle in needles:
            assert needle in str(err), f"{needle!r} not in: {err}"
        return str(err)
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


# ------------------------------------------------------------------------------- plans
def _plan_key_typo_lists_closest_matches() -> None:
    model = llama.build(llama.ModelArgs.tiny())
    _raises(lambda: parallelize_module(model, _mesh(), {"layers.*.feed_forward.w4":
                                                        ColwiseParallel()}),
            PlanKeyError, "'layers.*.feed_forward.w4' matched nothing",
            "'layers.*.feed_forward.w1'")


def test_plan_key_matching_nothing_raises_with_closest_paths(run_on_ranks):
    run_on_ranks(2, _plan_key_typo_lists_closest_matches)


def _unsupported_module_names_path_and_type() -> None:
    model = llama.build(llama.ModelArgs.tiny())
    _raises(lambda: parallelize_module(model, _mesh(), {"layers.0.ffn_norm": ColwiseParallel()}),
            UnsupportedModuleError, "'layers.0.ffn_norm'", "RMSNorm")


def test_style_on_unsupported_module_names_its_path_and_type(run_on_ranks):
    run_on_ranks(2, _unsupported_module_names_path_and_type)


def _nested_plan_and_2d_mesh() -> None:
    args = llama.ModelArgs.tiny()
    reference, model = llama.build(args), llama.build(args)
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    nested = {"layers.*": {"feed_forward.w1": ColwiseParallel(),
                           "feed_forward.w3": ColwiseParallel(),
                           "feed_forward.w2": RowwiseParallel()}}
    parallelize_module(model, mesh, nested)  # the "tp" dimension is picked by name
    w1 = model.layers[1].feed_forward.w1.weight
    assert w1.placements == (Shard(0),) and w1.to_local().shape == (args.ffn_hidden // 2, args.dim)
    assert w1.device_mesh.mesh_dim_names == ("tp",)
    tokens, _ = llama.batch(args)
    assert_close_to_reference(model(tokens), reference(tokens).detach())


def test_nested_plan_on_2d_mesh_uses_the_tp_dimension(run_on_ranks):
    run_on_ranks(4, _nested_plan_and_2d_mesh)


# ------------------------------------------------------------------------------- styles
class _TwoInputs(nn.Module):
    def forward(self, x, scale=None, *, bias=None):
        return x * (1 if scale is None else scale) + (0 if bias is None else bias), x


def _prepare_input_output_layouts() -> None:
    n, rank = get_platform().world_size(), get_platform().rank()
    mesh = _mesh()
    full = torch.arange(4.0 * n).reshape(1, 2 * n, 2)
    mod = parallelize_module(_TwoInputs(), mesh, PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"bias": Shard(1)}, desired_input_kwarg_layouts={"bias": Replicate()},
        use_local_output=True))
    local = full.chunk(n, 1)[rank]
    out, x = mod(local, None, bias=local)
    assert torch.equal(x, full) and torch.equal(out, 2 * full)
    mod2 = parallelize_module(_TwoInputs(), mesh, PrepareModuleOutput(
        output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None),
        use_local_output=False))
    out, x = mod2(full)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    assert torch.equal(out.to_local(), full.chunk(n, 1)[rank]) and x is not out


def test_prepare_module_input_output_convert_positional_keyword_and_skip_none(run_on_ranks):
    run_on_ranks(2, _prepare_input_output_layouts)


def _colwise_output_layouts_and_embeddings() -> None:
    n, rank = get_platform().world_size(), get_platform().rank()
    mesh = _mesh()
    torch.manual_seed(0)
    lin, emb = nn.Linear(6, 4 * n), nn.Embedding(8 * n, 4 * n)
    x, ids = torch.randn(3, 6), torch.randint(0, 8 * n, (3, 5))
    want_lin, want_emb = lin(x).detach(), emb(ids).detach()

    sharded = parallelize_module(nn.Linear(6, 4 * n), mesh, ColwiseParallel(use_local_output=False))
    for name in ("weight", "bias"):
        getattr(sharded, name).to_local().data.copy_(
            getattr(lin, name).detach().chunk(n, 0)[rank])
    out = sharded(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    assert_close_to_reference(out.full_tensor(), want_lin)

    for style, placement in ((ColwiseParallel(output_layouts=Replicate()), Shard(1)),
                             (RowwiseParallel(input_layouts=Replicate()), Shard(0))):
        table = nn.Embedding(8 * n, 4 * n)
        table.weight.data.copy_(emb.weight.detach())
        parallelize_module(table, mesh, style)
        assert table.weight.placements == (placement,)
        assert_close_to_reference(table(ids), want_emb)


def test_colwise_dtensor_output_and_both_embedding_shardings(run_on_ranks):
    run_on_ranks(2, _colwise_output_layouts_and_embeddings)


# ------------------------------------------------------------------------------- layers
def _layers_match_plain_modules(sequence_parallel: bool) -> None:
    n, rank = get_platform().world_size(), get_platform().rank()
    torch.manual_seed(0)
    emb, up, down = nn.Embedding(16, 8), nn.Linear(8, 4 * n), nn.Linear(4 * n, 8)
    torch.manual_seed(0)
    p_emb = VocabParallelEmbedding(16, 8, sequence_parallel=sequence_parallel)
    p_up = ColumnParallelLinear(8, 4 * n, sequence_parallel=sequence_parallel)
    p_down = RowParallelLinear(4 * n, 8, sequence_parallel=sequence_parallel)
    for plain, par in ((emb, p_emb), (up, p_up), (down, p_down)):
        for name, p in plain.named_parameters():
            assert torch.equal(getattr(par, name).full_tensor(), p), name
    ids = torch.randint(0, 16, (2, 2 * n))
    want = down(torch.relu(up(emb(ids))))
    want.square().sum().backward()
    got = p_down(torch.relu(p_up(p_emb(ids))))
    if sequence_parallel:  # output split along the sequence (dim 1)
        assert_close_to_reference(got, want.detach().chunk(n, 1)[rank])
    else:
        assert_close_to_reference(got, want.detach())
    # With sequence parallelism each rank's loss covers its slice; the gradients are those of
    # the sum of the slices' losses, i.e. of the full loss.
    got.square().sum().backward()
    for plain, par in ((emb, p_emb), (up, p_up), (down, p_down)):
        for name, p in plain.named_parameters():
            assert_close_to_reference(getattr(par, name).grad.full_tensor(), p.grad,
                                      what=f"{type(par).__name__}.{name}.grad")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_layers_match_plain_modules(run_on_ranks, sequence_parallel):
    run_on_ranks(2, _layers_match_plain_modules, sequence_parallel)


def _deepcopy_of_sharded_mlp_computes_the_same() -> None:
    import copy

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = parallelize_module(copy.deepcopy(reference), _mesh(),
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    clone = copy.deepcopy(model)
    x = torch.randn(3, 8)
    assert_close_to_reference(model(x), reference(x).detach())
    assert_close_to_reference(clone(x), reference(x).detach())
    assert clone[2].bias.placements == (Replicate(),)


def test_deepcopy_of_a_sharded_model_keeps_the_row_parallel_bias(run_on_ranks):
    run_on_ranks(2, _deepcopy_of_sharded_mlp_computes_the_same)


def _distribute_module_hooks_and_partition() -> None:
    from hyperpar.dtensor import distribute_tensor
    from hyperpar.parallel import distribute_module

    mesh = _mesh()
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    model = nn.Linear(4, 6)
    model.load_state_dict(reference.state_dict())

    def partition(name, module, device_mesh):
        if name == "":
            module.register_parameter("weight", nn.Parameter(
                distribute_tensor(module.weight.detach(), device_mesh, [Shard(0)])))

    distribute_module(
        model, mesh, partition,
        input_fn=lambda mod, inputs, m: (DTensor.from_local(inputs[0], m, [Replicate()]),),
        output_fn=lambda mod, out, m: out.full_tensor(),
    )
    assert model.weight.placements == (Shard(0),) and model.bias.placements == (Replicate(),)
    x = torch.randn(3, 4)
    assert_close_to_reference(model(x), reference(x).detach())


def test_distribute_module_partitions_replicates_the_rest_and_hooks_io(run_on_ranks):
    run_on_ranks(2, _distribute_module_hooks_and_partition)


class _ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + 2 * x  # x also feeds a replicated branch


def _gathered_input_feeding_parallel_and_replicated_branches() -> None:
    import copy

    n, rank = get_platform().world_size(), get_platform().rank()
    torch.manual_seed(0)
    reference = _ResidualBlock()
    block = copy.deepcopy(reference)
    parallelize_module(block, _mesh(), PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
    parallelize_module(block, _mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, 2 * n, 4)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    x_local = x.chunk(n, 1)[rank].clone().requires_grad_()
    out = block(x_local)
    assert_close_to_reference(out, reference(x).detach())
    out.square().sum().backward()
    assert_close_to_reference(x_local.grad, x_ref.grad.chunk(n, 1)[rank], what="input grad")
    assert_close_to_reference(block.up.weight.grad.full_tensor(), reference.up.weight.grad)


def test_sequence_gathered_input_used_by_parallel_and_replicated_code(run_on_ranks):
    run_on_ranks(2, _gathered_input_feeding_parallel_and_replicated_branches)


def _forward_after_a_failed_forward() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    model = parallelize_module(nn.Linear(4, 6), _mesh(),
                               ColwiseParallel(output_layouts=Replicate()))
    for name in ("weight", "bias"):
        getattr(model, name).to_local().data.copy_(
            getattr(reference, name).detach().chunk(get_platform().world_size(), 0)[
                get_platform().rank()])
    _raises(lambda: model(torch.randn(3, 5)), RuntimeError)  # wrong feature size
    x = torch.randn(3, 4)
    assert_close_to_reference(model(x), reference(x).detach())
    assert isinstance(model.weight, DTensor)


def test_a_failed_forward_does_not_break_the_next_one(run_on_ranks):
    run_on_ranks(2, _forward_after_a_failed_forward)
