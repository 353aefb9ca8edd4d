"""``--measure``: the planner's exact bytes (local parameter shards + gradients + AdamW states on
rank 0) equal what the real fully_shard / parallelize_module leave on real gloo ranks. Step
times are measured too but not asserted (no timing thresholds in tests)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hyperpar.plan.layout import Layout, Run  # noqa: E402
from hyperpar.plan.measure import measure_layout  # noqa: E402
from hyperpar.plan.memory import memory_per_rank  # noqa: E402
from hyperpar.plan.model import example_spec  # noqa: E402


@pytest.mark.parametrize("layout", [Layout(dp_shard=2), Layout(tp=2)], ids=lambda x: x.name)
def test_predicted_state_bytes_equal_measured_on_2_ranks(layout: Layout) -> None:
    run = Run(world=2, seq_len=16, global_batch=4, param_dtype="float32")
    got = measure_layout("tiny", layout, run, steps=1, warmup=0)
    predicted = memory_per_rank(example_spec("tiny"), run, layout).states
    assert int(got["states"]) == predicted
    assert got["step_ms"] > 0


def test_predicted_state_bytes_equal_measured_fsdp_x_tp_on_4_ranks() -> None:
    layout = Layout(dp_shard=2, tp=2)
    run = Run(world=4, seq_len=16, global_batch=4, param_dtype="float32")
    got = measure_layout("tiny", layout, run, steps=1, warmup=0)
    assert int(got["states"]) == memory_per_rank(example_spec("tiny"), run, layout).states


def test_uneven_fully_shard_padding_is_exact_on_2_ranks() -> None:
    from hyperpar.plan.model import spec_from_model_args

    # odd row counts: rank 0 holds ceil(rows / 2) of the embedding (65), w1/w3 (71)
    sizes = {"vocab_size": 65, "dim": 40, "n_layers": 2, "n_heads": 4, "ffn_hidden": 71}
    layout = Layout(dp_shard=2)
    run = Run(world=2, seq_len=8, global_batch=2, param_dtype="float32")
    got = measure_layout(sizes, layout, run, steps=1, warmup=0)
    spec = spec_from_model_args(sizes)
    predicted = memory_per_rank(spec, run, layout).states
    assert predicted > 16 * spec.parameters // 2  # the padding is really there
    assert int(got["states"]) == predicted
