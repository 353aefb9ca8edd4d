"""Where hyperpar does better than torch-native (torch fails or is silently wrong), checked
against one process: ties made before ``parallelize_module``, ``loss_parallel`` with class
weights and label smoothing, HyperParallel-style custom styles, torch style objects in a plan."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from _cases import MLP, TiedLM, seeded
from torch import nn

TOL = 1e-5


def _tied_before(colwise_embedding: bool) -> dict:
    from hyperpar import (
        ColwiseParallel,
        Replicate,
        RowwiseParallel,
        TiedParameterError,
        init_device_mesh,
        parallelize_module,
    )

    mesh = init_device_mesh((torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    model, reference = seeded(TiedLM), seeded(TiedLM)
    for m in (model, reference):
        m.fc.weight = m.embedding.weight  # tie_word_embeddings
    ids = torch.tensor([[1, 7, 3, 15], [0, 2, 9, 4]])
    if colwise_embedding:  # embedding Shard(1), head Shard(0): the styles disagree
        plan = {"embedding": ColwiseParallel(), "fc": ColwiseParallel()}
        try:
            parallelize_module(model, mesh, plan)
        except TiedParameterError as err:
            untouched = not any(hasattr(p, "placements") for p in model.parameters())
            return {"error": str(err), "untouched": untouched}
        return {"error": None}
    plan = {"embedding": RowwiseParallel(input_layouts=Replicate()),
            "fc": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh, plan)
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
    return {"one_param": model.fc.weight is model.embedding.weight,
            "n_params": len(list(model.parameters())),
            "grad": model.embedding.weight.grad.full_tensor(),
            "want": reference.embedding.weight.grad}


def test_tie_made_before_parallelize_is_kept_one_parameter_one_grad(run_on_ranks):
    for r in run_on_ranks(2, _tied_before, False):
        assert r["one_param"] and r["n_params"] == 1
        torch.testing.assert_close(r["grad"], r["want"], atol=TOL, rtol=TOL)


def test_tie_whose_styles_disagree_raises_naming_both_paths_before_any_change(run_on_ranks):
    for r in run_on_ranks(2, _tied_before, True):
        assert r["error"] and "'embedding.weight'" in r["error"] and "'fc.weight'" in r["error"]
        assert r["untouched"]


def _tie_half_planned() -> str:
    from hyperpar import ColwiseParallel, TiedParameterError, init_device_mesh, parallelize_module

    mesh = init_device_mesh((torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    model = seeded(TiedLM)
    model.fc.weight = model.embedding.weight
    with pytest.raises(TiedParameterError) as info:
        parallelize_module(model, mesh, {"fc": ColwiseParallel()})
    return str(info.value)


def test_tie_with_one_holder_left_out_of_the_plan_raises(run_on_ranks):
    msg = run_on_ranks(2, _tie_half_planned)[0]
    assert "left unsharded" in msg and "'embedding.weight'" in msg


# ----------------------------------------------------------------------------- loss_parallel
VARIANTS = [dict(reduction=r, **extra) for r, extra in itertools.product(
    ("mean", "sum", "none"),
    ({}, {"ignore_index": -100}, {"weight": True}, {"label_smoothing": 0.2},
     {"weight": True, "label_smoothing": 0.1, "ignore_index": 5}))]


def _loss_parallel_variants(classes: int) -> list:
    from hyperpar import Shard, distribute_tensor, init_device_mesh, loss_parallel

    mesh = init_device_mesh((torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    out = []
    for i, variant in enumerate(VARIANTS):
        kwargs = dict(variant)
        g = torch.Generator().manual_seed(i)
        logits = torch.randn(7, classes, 3, generator=g)
        target = torch.randint(classes, (7, 3), generator=g)
        if "ignore_index" in kwargs:
            target[::2, 0] = kwargs["ignore_index"]
        if kwargs.get("weight"):
            kwargs["weight"] = torch.rand(classes, generator=g) + 0.5
        ref_logits = logits.clone().requires_grad_()
        want = F.cross_entropy(ref_logits, target, **kwargs)
        want.backward(torch.ones_like(want))
        dist = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        with loss_parallel():
            got = F.cross_entropy(dist, target, **kwargs)
        got.backward(torch.ones_like(got))
        if hasattr(got, "full_tensor"):  # reduction="none": a replicated DTensor, as torch's
            got = got.full_tensor()
        out.append((variant, got.detach(), want.detach(), dist.grad.full_tensor(),
                    ref_logits.grad))
    return out


@pytest.mark.parametrize(("n", "classes"), [(2, 16), (4, 10)])
def test_loss_parallel_weight_smoothing_ignore_index_every_reduction_equal_one_process(
        run_on_ranks, n, classes):
    for rank_result in run_on_ranks(n, _loss_parallel_variants, classes):
        for variant, got, want, grad, want_grad in rank_result:
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL, msg=str(variant))
            torch.testing.assert_close(grad, want_grad, atol=TOL, rtol=TOL, msg=str(variant))


# ----------------------------------------------------------------------------- styles
def _custom_apply_and_torch_styles() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

    from hyperpar import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        init_device_mesh,
        parallelize_module,
    )

    class Doubled(ParallelStyle):  # HyperParallel's spelling: override apply
        def apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module.register_forward_hook(lambda mod, args, out: out * 2)
            return module

    mesh = init_device_mesh((torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    ours, mixed, plain = seeded(MLP), seeded(MLP), seeded(MLP)
    parallelize_module(ours, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel(),
                                    "relu": Doubled()})
    parallelize_module(mixed, mesh, {"net1": TorchColwise(), "net2": TorchRowwise(),
                                     "relu": Doubled()})
    return {"ours": ours(x).detach(), "mixed": mixed(x).detach(),
            "want": plain.net2(2 * plain.relu(plain.net1(x))).detach(),
            "mixed_sharded": type(mixed.net1.weight).__module__}


def test_custom_style_overriding_apply_and_torch_style_objects_in_a_plan(run_on_ranks):
    for r in run_on_ranks(2, _custom_apply_and_torch_styles):
        torch.testing.assert_close(r["ours"], r["want"], atol=TOL, rtol=TOL)
        torch.testing.assert_close(r["mixed"], r["want"], atol=TOL, rtol=TOL)
        assert r["mixed_sharded"].startswith("hyperpar")
