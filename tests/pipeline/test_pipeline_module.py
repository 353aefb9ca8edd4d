"""LayerSpec, TiedLayerSpec, partitioners and PipelineModule in one process."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import Block, data, lm_loss, tied_layers
from torch import nn

from hyperpar.pipeline import (
    LayerSpec,
    PipelineModule,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    TiedLayerSpec,
    partition_balanced,
    partition_layers,
    partition_uniform,
)


def test_layer_spec_defers_construction_and_prints_its_arguments():
    spec = LayerSpec(nn.Linear, 4, 3, bias=False)
    assert repr(spec) == "LayerSpec(Linear, 4, 3, bias=False)"
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.bias is None
    assert spec.count_parameters() == 12


def test_layer_spec_rejects_an_instance_with_a_hint():
    with pytest.raises(TypeError, match="module class.*not an instance"):
        LayerSpec(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="module class"):
        LayerSpec(len)


def test_tied_layer_spec_repr_names_key_and_forward_fn():
    spec = TiedLayerSpec("emb", nn.Embedding, 5, 2, forward_fn=lambda m, x: x)
    assert "key='emb'" in repr(spec) and "Embedding, 5, 2" in repr(spec)
    assert spec.tied_weight_attr == ["weight"]   # DeepSpeed's default, a list


def test_uniform_partition_spreads_the_remainder_first():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]


def test_balanced_partition_minimises_the_heaviest_stage():
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    parts = partition_balanced([5, 1, 1, 1, 1, 1], 3)
    assert parts[1] == 1 and parts[2] - parts[1] <= 5


def test_parameter_partition_counts_specs_without_building_and_tied_at_every_position():
    layers = [LayerSpec(nn.Linear, 100, 100), LayerSpec(nn.Linear, 10, 10),
              LayerSpec(nn.Linear, 10, 10), LayerSpec(nn.Linear, 100, 100)]
    assert partition_layers(layers, 2, "parameters") == [0, 2, 4]
    assert partition_layers(tied_layers(), 2, "parameters")[-1] == 10
    big = [TiedLayerSpec("e", nn.Embedding, 100, 10), LayerSpec(nn.Linear, 10, 10),
           LayerSpec(nn.Linear, 10, 10), TiedLayerSpec("e", nn.Embedding, 100, 10)]
    # counted once, the head would weigh 0 and the split be [0, 1, 4]
    assert partition_layers(big, 2, "parameters") == [0, 2, 4]


def test_balanced_partition_follows_deepspeeds_rule():
    # expected values from DeepSpeed's partition_balanced (smallest max - min, later cut on
    # ties); minimising only the heaviest part would give [0, 2, 4, 5] for the first
    assert partition_balanced([5, 1, 1, 5, 1], 3) == [0, 1, 3, 5]
    assert partition_balanced([3, 1, 1, 3], 2) == [0, 2, 4]
    assert partition_balanced([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]


def test_type_partition_balances_matching_layers():
    parts = partition_layers(tied_layers(), 2, "type:^block$")
    names = [type(x).__name__ if not isinstance(x, LayerSpec) else x.typename.__name__
             for x in tied_layers()]
    counts = [sum(n == "Block" for n in names[a:b]) for a, b in zip(parts, parts[1:],
                                                                   strict=False)]
    assert counts == [2, 2]


def test_type_partition_that_matches_nothing_lists_the_class_names():
    with pytest.raises(ValueError, match="matched no layer.*Embedding"):
        partition_layers(tied_layers(), 2, "type:Attention")


def test_explicit_partition_is_validated():
    assert partition_layers(tied_layers(), 2, [0, 3, 10]) == [0, 3, 10]
    with pytest.raises(ValueError, match="strictly increasing boundaries from 0 to 10"):
        partition_layers(tied_layers(), 2, [0, 11, 10])


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot split 10 layers into 12 stages"):
        partition_layers(tied_layers(), 12, "uniform")


def test_unknown_partition_method_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="'uniform', 'parameters', 'type:REGEX'"):
        partition_layers(tied_layers(), 2, "layers")


def test_num_stages_must_divide_the_group():
    with pytest.raises(ValueError, match="does not divide the group size 1"):
        PipelineModule(tied_layers(), num_stages=2)


def test_single_stage_module_is_the_whole_model_with_shared_tied_weights():
    model = PipelineModule(tied_layers(), num_stages=1, seed_layers=True, loss_fn=lm_loss)
    x, y = data()
    assert model(x).shape == (x.shape[0], x.shape[1], 11)
    assert [n for n, _ in model.named_parameters()].count("tied_modules.emb.weight") == 1


def test_seed_layers_makes_weights_independent_of_the_partition():
    a = PipelineModule(tied_layers(), 1, seed_layers=True, partition_method="uniform")
    b = PipelineModule(tied_layers(), 1, seed_layers=True, partition_method=[0, 10])
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_activation_checkpointing_keeps_gradients():
    x, y = data()
    grads = []
    for interval in (0, 3):
        model = PipelineModule(tied_layers(), 1, seed_layers=True,
                               activation_checkpoint_interval=interval)
        lm_loss(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name])


def test_one_rank_pipeline_runs_every_stage_locally():
    x, y = data()
    ref = PipelineModule(tied_layers(), 1, seed_layers=True)
    lm_loss(ref(x), y).backward()
    model = PipelineModule(tied_layers(), 1, seed_layers=True, virtual_stages=1)
    loss = Schedule1F1B(model, 4, loss_fn=lm_loss).step(x, target=y)
    assert loss is not None
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_layers_must_be_specs_modules_or_callables():
    with pytest.raises(TypeError, match="layer 1 is 3"):
        PipelineModule([LayerSpec(Block, 4), 3], 1)


def test_schedule_without_a_loss_function_says_where_to_put_one():
    model = PipelineModule(tied_layers(), 1)
    with pytest.raises(ValueError, match="pass loss_fn="):
        Schedule1F1B(model, 2)


def test_a_dict_cannot_cross_a_stage_boundary():
    layers = tied_layers()
    layers[3:3] = [lambda x: {"h": x}, lambda d: d["h"]]
    model = PipelineModule(layers, 1, virtual_stages=2, partition_method=[0, 4, 12],
                           loss_fn=lm_loss)
    x, y = data()
    with pytest.raises(TypeError, match="output of stage 0.*got dict"):
        ScheduleInterleaved1F1B(model, 2).step(x, target=y)
