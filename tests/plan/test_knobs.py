"""Dense-planner knobs of issue 50: ``cpfs`` (fully_shard over the cp ranks without dp_shard,
as torchtitan folds cp into its FSDP mesh) and the Float8 / torch.compile factors."""

from __future__ import annotations

import pytest

from hyperpar.plan.devices import get_profile
from hyperpar.plan.layout import Run, parse_layout
from hyperpar.plan.memory import memory_per_rank
from hyperpar.plan.model import from_hf_config
from hyperpar.plan.search import shape_problems
from hyperpar.plan.timing import collectives, matmul_step_flops, step_time

from ._common import LLAMA2_7B


def test_cpfs_shards_states_over_the_cp_ranks() -> None:
    """cp8.cpfs shards parameters, gradients and optimizer states 8 ways, as fsdp8 does (the
    same tensors split over a group of 8): the states agree exactly; plain cp8 replicates
    them (8x the fp32 states, plus its bf16 copy)."""
    spec = from_hf_config(LLAMA2_7B)
    run = Run(world=8, seq_len=32768, global_batch=1)
    sharded = memory_per_rank(spec, run, parse_layout("cp8.mb1.ac.cpfs"))
    fsdp = memory_per_rank(spec, Run(world=8, seq_len=32768, global_batch=8),
                           parse_layout("fsdp8.mb1.ac"))
    plain = memory_per_rank(spec, run, parse_layout("cp8.mb1.ac"))
    assert sharded.states == fsdp.states
    assert plain.optimizer == pytest.approx(8 * sharded.optimizer, rel=1e-3)


def test_cpfs_reduce_scatters_instead_of_all_reducing() -> None:
    spec = from_hf_config(LLAMA2_7B)
    run = Run(world=8, seq_len=32768, global_batch=1)
    kinds = {(c.dim, c.kind) for c in collectives(spec, run, parse_layout("cp8.mb1.cpfs"), 0)}
    assert ("dp_shard", "rs") in kinds and ("cp", "ar") not in kinds
    plain = {(c.dim, c.kind) for c in collectives(spec, run, parse_layout("cp8.mb1"), 0)}
    assert ("cp", "ar") in plain and ("dp_shard", "rs") not in plain


def test_cpfs_needs_cp_and_no_dp_shard() -> None:
    spec = from_hf_config(LLAMA2_7B)
    run = Run(world=8, seq_len=4096, global_batch=8)
    assert any("needs cp > 1" in p for p in shape_problems(spec, run,
                                                           parse_layout("fsdp8.mb1.cpfs")))
    assert any("already spans" in p for p in shape_problems(spec, run,
                                                            parse_layout("fsdp4.cp2.mb1.cpfs")))


def test_float8_divides_only_the_linears() -> None:
    """--float8 F: the step's compute drops by (1 - 1/F) of the linears' FLOPs at the
    profile's rate, attention and the elementwise ops unchanged."""
    spec = from_hf_config(LLAMA2_7B)
    prof = get_profile("h100")
    lay = parse_layout("fsdp8.mb1")
    base, fast = (Run(world=8, seq_len=4096, global_batch=8, float8=f) for f in (1.0, 2.0))
    t1 = step_time(spec, base, lay, prof, memory_per_rank(spec, base, lay))
    t2 = step_time(spec, fast, lay, prof, memory_per_rank(spec, fast, lay))
    saved = matmul_step_flops(spec, base, lay) / 2 / 8 / prof.flops("bfloat16")
    assert t1.compute_s - t2.compute_s == pytest.approx(saved, rel=1e-9)


def test_compile_fusion_divides_the_elementwise_time() -> None:
    spec = from_hf_config(LLAMA2_7B)
    prof = get_profile("h100")
    lay = parse_layout("fsdp8.mb1")
    from hyperpar.plan.timing import elementwise_seconds

    base, fused = (Run(world=8, seq_len=4096, global_batch=8, compile_fusion=f)
                   for f in (1.0, 5.0))
    t1 = step_time(spec, base, lay, prof, memory_per_rank(spec, base, lay))
    t5 = step_time(spec, fused, lay, prof, memory_per_rank(spec, fused, lay))
    ew = elementwise_seconds(spec, base, lay, prof)
    assert ew > 0
    assert t1.compute_s - t5.compute_s == pytest.approx(ew * 4 / 5, rel=1e-9)


@pytest.mark.parametrize("kw", [{"float8": 0.5}, {"float8": 5.0}, {"compile_fusion": 0.9}])
def test_knobs_out_of_range_are_refused(kw) -> None:
    with pytest.raises(ValueError, match="factors >= 1"):
        Run(world=8, seq_len=4096, global_batch=8, **kw)
