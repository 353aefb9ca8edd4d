"""EasyDeL's ParallelLinear / ColumnParallelLinear / RowParallelLinear / TensorParallelConfig and
sharding helpers (seeds/easydel-parallel-linear.txt) on hyperpar, translated to torch: a
column -> row pair from one config equals the single-process Linear pair on 2 real ranks
(forward and gradients, float32 rtol 1e-5 / atol 1e-6)."""

from __future__ import annotations

import json

import pytest
import torch
from easydel_example import column_row_pair, config_round_trip

from hyperpar.parallel import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    TensorParallelConfig,
    get_matmul_output_sharding,
    get_sharding,
)


def test_without_a_config_the_layers_are_plain_linears():
    torch.manual_seed(0)
    layer = ParallelLinear(4, 3, use_bias=False, kernel_init=torch.nn.init.ones_)
    assert layer.bias is None and torch.equal(layer.weight, torch.ones(3, 4))
    col = ColumnParallelLinear(4, 3, use_bias=True, bias_init=torch.nn.init.zeros_)
    x = torch.randn(2, 4)
    assert torch.allclose(col(x), x @ col.weight.t())
    assert not hasattr(col.weight, "placements")


def test_compute_dtype_and_param_dtype():
    layer = ParallelLinear(4, 3, dtype=torch.float64, param_dtype=torch.float32)
    assert layer.weight.dtype == torch.float32
    assert layer(torch.randn(2, 4)).dtype == torch.float64


def test_config_is_a_dataclass_with_easydel_serialisation():
    config = TensorParallelConfig(axis_name="model", reduce_output=True)
    assert config.replace(reduce_output=False).reduce_output is False
    data = config.to_dict()
    assert data == {"mesh": None, "axis_name": "model", "matmul_method": None,
                    "reduce_output": True, "reduce_scatter_output": False}
    assert TensorParallelConfig.from_dict(data) == config
    assert TensorParallelConfig.from_json(config.to_json(indent=2)) == config
    assert json.loads(config.to_json())["axis_name"] == "model"


def test_config_rejects_what_it_cannot_do():
    with pytest.raises(NotImplementedError, match="matmul_method"):
        TensorParallelConfig(matmul_method="all_gather")
    with pytest.raises(ValueError, match="unknown keys"):
        TensorParallelConfig.from_dict({"axis_nme": "tp"})


def test_the_two_call_forms_do_not_mix():
    with pytest.raises(TypeError, match="Megatron form"):
        ColumnParallelLinear(4, 4, gather_output=True, use_bias=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        RowParallelLinear(4, 4, features=4)


def test_matmul_output_sharding_rule():
    # X (batch, in) sharded on batch by dp, W (in, out) sharded on out by tp
    assert get_matmul_output_sharding(("dp", None), (None, "tp")) == ("dp", "tp")
    # contracted dim sharded: it disappears from the output
    assert get_matmul_output_sharding((None, "tp"), ("tp", None)) == (None, None)
    # an axis used twice is kept the first time only
    assert get_matmul_output_sharding(("tp", None, None), (None, "tp")) == ("tp", None, None)
    assert get_matmul_output_sharding((("dp", "tp"), None), (None, "tp")) == (("dp", "tp"), None)
    assert get_matmul_output_sharding(None, (None, "tp")) == ()
    assert get_sharding(torch.ones(2)) is None


def _dtensor_specs():
    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyperpar.parallel import get_output_partition_spec, matmul_output_placements

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    x = distribute_tensor(torch.ones(4, 6), mesh, [Replicate()])
    w_col = distribute_tensor(torch.ones(6, 8), mesh, [Shard(1)])
    w_row = distribute_tensor(torch.ones(6, 8), mesh, [Shard(0)])
    x_row = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])
    return {"col": get_output_partition_spec(x, w_col), "w_col": get_sharding(w_col),
            "row": [repr(p) for p in matmul_output_placements(x_row, w_row)],
            "row_spec": get_output_partition_spec(x_row, w_row)}


def test_dtensor_matmul_output_specs(run_on_ranks):
    out = run_on_ranks(2, _dtensor_specs)[0]
    assert out["w_col"] == (None, "tp") and out["col"] == (None, "tp")
    assert len(out["row"]) == 1 and "Partial" in out["row"][0]
    assert out["row_spec"] == (None, None)


@pytest.mark.parametrize("scatter", [False, True], ids=["replicated", "reduce_scatter_output"])
def test_column_row_pair_matches_two_linears(run_on_ranks, scatter):
    results = run_on_ranks(2, column_row_pair, scatter)
    assert torch.equal(results[0]["y"], results[1]["y"])


def test_config_json_round_trip_re_resolves_the_mesh(run_on_ranks):
    results = run_on_ranks(2, config_round_trip)
    assert json.loads(results[0]["json"])["mesh"] == {"shape": [2], "dim_names": ["tp"]}


def test_the_seed_module_docstring_example_runs():
    """easydel.layers.linear's example with the import changed and jnp.bfloat16 -> torch's;
    in_features come from the first input (EasyDeL's older Flax form)."""
    from hyperpar.parallel import ParallelLinear  # was: from easydel.layers import ...

    input_tensor = torch.randn(2, 5, 32)
    # Create a parallel linear layer
    layer = ParallelLinear(
        features=768,
        use_bias=True,
        gather_output=False,
        axis_name="model",
        dtype=torch.bfloat16
    )
    output = layer(input_tensor)
    assert type(layer) is ParallelLinear and layer.in_features == 32
    assert output.shape == (2, 5, 768) and output.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32   # param_dtype's default
    expected = torch.nn.functional.linear(input_tensor.bfloat16(), layer.weight.bfloat16(),
                                          layer.bias.bfloat16())
    assert torch.equal(output, expected)
