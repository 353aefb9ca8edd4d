"""DeepSpeed's LayerSpec / TiedLayerSpec / PipelineModule / engine API, as its seed documents it,
on hyperpar: the usage example runs with only its import line changed and trains like one
process (2 and 4 real ranks, float32 parity rtol 1e-4 / atol 1e-5)."""

from __future__ import annotations

import pytest
import torch
from deepspeed_example import (
    check_data_parallel,
    check_fp16_overflow_is_skipped,
    check_two_stages,
    seed_example,
)
from torch import nn

from hyperpar.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, partition_layers


def test_layer_spec_of_a_non_module_raises_runtime_error_as_documented():
    with pytest.raises(RuntimeError, match="typename must be a module class"):
        LayerSpec(int)
    with pytest.raises(TypeError):   # and still a TypeError for hyperpar's own callers
        LayerSpec(nn.Linear(2, 2))


def test_tied_weight_attr_defaults_to_a_list_and_takes_a_string_or_a_list():
    assert TiedLayerSpec("k", nn.Linear, 2, 2).tied_weight_attr == ["weight"]
    assert TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr="bias").tied_weight_attr == \
        ["bias"]
    spec = TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr=["weight", "bias"])
    assert spec.tied_weight_attr == ["weight", "bias"]


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        return self.linear(x)


def test_a_dotted_tied_weight_attr_reaches_into_a_submodule():
    module = PipelineModule([TiedLayerSpec("t", Wrapped, tied_weight_attr="linear.weight"),
                             TiedLayerSpec("t", Wrapped, tied_weight_attr="linear.weight")],
                            num_stages=1)
    [(name, param)] = module.tied_parameters()
    assert name == "t.linear.weight" and param is module.tied_modules["t"].linear.weight
    with pytest.raises(AttributeError, match="'linear.wieght'.*no attribute 'wieght'"):
        PipelineModule([TiedLayerSpec("t", Wrapped, tied_weight_attr="linear.wieght")],
                       num_stages=1)


def test_the_seed_lists_split_as_under_deepspeed():
    layers, tied_layers, _ = seed_example()
    assert partition_layers(layers, 2, "parameters") == [0, 2, 4]
    # a tied layer counts at every position (once, it would split [0, 1, 4])
    assert partition_layers(tied_layers, 2, "parameters") == [0, 2, 4]


def test_pipeline_module_takes_deepspeed_arguments_positionally():
    layers, _, _ = seed_example()
    seeds = []
    calls = []

    def seed_fn(seed):
        seeds.append(seed)
        torch.manual_seed(seed)

    def ckpt(fn, *args):
        calls.append(len(args))
        return fn(*args)

    module = PipelineModule(layers, 1, None, None, True, seed_fn, 7, "uniform", 2, ckpt,
                            ["Linear"], True)
    assert seeds == [7, 8, 9, 10]
    assert module.dynamic_shape and module.checkpointable_layers == ["Linear"]
    out = module(torch.randint(0, 40, (2, 3)))
    # units [Embedding, Linear] (not all listed: not checkpointed), [Linear, Linear] (is)
    assert calls == [1] and out.shape == (2, 3, 40)


@pytest.mark.parametrize("virtual_stages", [1, 2], ids=["1f1b", "interleaved"])
def test_deepspeed_example_trains_as_two_stages_like_one_process(run_on_ranks, virtual_stages):
    results = run_on_ranks(2, check_two_stages, virtual_stages, timeout_s=240)
    assert [r["last"] for r in results] == [False, True]
    # the loss is returned on every stage, the same value
    assert results[0]["losses"] == results[1]["losses"]


@pytest.mark.parametrize("use_topology", [False, True], ids=["num_stages", "topology"])
def test_data_parallel_replicas_average_the_loss_and_gradients(run_on_ranks, use_topology):
    results = run_on_ranks(4, check_data_parallel, use_topology, timeout_s=300)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    # DeepSpeed's layout: stage = rank // dp, so ranks 2 and 3 hold the last stage
    assert [r["last"] for r in results] == [False, False, True, True]


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(run_on_ranks):
    results = run_on_ranks(2, check_fp16_overflow_is_skipped, timeout_s=240)
    assert results[0] == results[1]
    assert results[0]["changed"]
