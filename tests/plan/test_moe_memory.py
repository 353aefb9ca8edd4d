"""The MoE planner's memory knobs (what the published runs state they do: recompute, FP8
activation caching, BF16 moments, FP32 ZeRO gradients, routing weights on the expert's side)
and DualPipe's per-rank placement of the head and of in-flight microbatches. Every expected
value is worked out by hand from the model's shapes in the test's comment."""

from __future__ import annotations

import json

import pytest

from hyperpar.plan.layout import Run, parse_layout
from hyperpar.plan.memory import memory_per_rank
from hyperpar.plan.model import from_hf_config
from hyperpar.plan.moe import moe_from_hf_config
from hyperpar.plan.moe_layout import moe_shape_problems, parse_moe_layout
from hyperpar.plan.moe_memory import (
    dualpipe_in_flight,
    holds_head,
    moe_layer_activation_bytes,
    moe_stage_memory,
    stage_param_counts,
)
from hyperpar.plan.moe_plan import moe_memory_per_rank, recompute_flops_per_token

from ._common import LLAMA2_7B, ROOT

CONFIGS = ROOT / "tests" / "plan" / "configs"
V3_LAYOUT = "dp128.pp16.ep64.nl4.mb120.zero1.dualpipe"
V3_KNOBS = ".rcnorm.rcup.rcswiglu.fp8act.wexpert"


def _spec(name: str):
    return moe_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def _v3_run(**kw) -> Run:
    return Run(world=2048, seq_len=4096, global_batch=15360, **kw)


@pytest.mark.parametrize("name", [V3_LAYOUT + V3_KNOBS, "fsdp8.ep8.mb2.rcnorm.fp8act",
                                  "dp64.pp16.ep8.mb144.zbh1.zero1.rcnorm.rcup"])
def test_knob_names_round_trip(name) -> None:
    lay = parse_moe_layout(name)
    assert lay.name == name
    assert parse_moe_layout(lay.name) == lay


def test_v3_bytes_per_token_per_moe_layer_by_hand() -> None:
    """DeepSeek-V3 (h 7168, 128 heads, q latent 1536, kv latent 512, rope 64, nope 128, v 128,
    256 experts of width 2048 top-8, one shared), tp 1, bf16 (c = 2).

    No knobs: norms 2 blocks x h x (in 2 + out 2) = 57,344; MLA latents (1536 + 512 + 64) x 2 =
    4,224, normed latents (1536 + 512) x 2 = 4,096, q_b out 128 x 192, kv_b out 128 x 256,
    q and k after rotary 2 x 128 x 192, v 128 x 128 = 122,880 elements x 2 = 245,760,
    attention output 16,384 x 2 = 32,768 (MLA 286,848); a SwiGLU of 2048: gate, up, SiLU,
    product 4 x 2048 x 2 = 16,384; per copy dispatched input + expert output 2 x 14,336 +
    16,384 = 45,056, x 8 = 360,448; router fp32 logits and probabilities 2 x 256 x 4 = 2,048;
    shared 16,384. Sum 723,072.

    V3's knobs: norms keep only their inputs 2 x 7168 x 2 = 28,672; MLA keeps the latents
    before their norms 4,224 and the attention output in E5M6 16,384 x 1.5 = 24,576 (28,800);
    a SwiGLU keeps its inputs in FP8 2 x 2048 = 4,096; per copy the FP8 dispatched input 7,168
    + 4,096 = 11,264, x 8 = 90,112; router 2,048; shared 4,096. Sum 153,728."""
    spec, run = _spec("deepseek-v3"), _v3_run()
    bare = moe_layer_activation_bytes(spec, run, parse_moe_layout(V3_LAYOUT))
    knobs = moe_layer_activation_bytes(spec, run, parse_moe_layout(V3_LAYOUT + V3_KNOBS))
    assert bare[0] == pytest.approx(723_072)
    assert knobs[0] == pytest.approx(153_728)
    # the expert output per copy alone (wexpert off): 8 x 7168 x 2 = 114,688 bytes more
    no_w = moe_layer_activation_bytes(spec, run, parse_moe_layout(V3_LAYOUT + ".rcnorm.rcup."
                                                                  "rcswiglu.fp8act"))
    assert no_w[0] - knobs[0] == pytest.approx(114_688)


def test_dualpipe_head_and_loss_only_on_the_end_ranks() -> None:
    """DualPipe rank r holds stages r and pp - 1 - r: only ranks 0 and 15 hold stage 15's
    head. The loss term there: (1 + 1 MTP) x 4096 tokens x 129,280 logits x (2 + 2 x 4) bytes
    under the eager loss, (2) under the fused one: the difference 2 x 4096 x 129,280 x 8 =
    8,472,494,080 bytes on rank 0, none on rank 2."""
    spec = _spec("deepseek-v3")
    lay = parse_moe_layout(V3_LAYOUT)
    assert [s for s in range(16) if holds_head(lay, s)] == [0, 15]
    assert [s for s in range(16) if holds_head(parse_moe_layout(
        "dp128.pp16.ep64.nl4.mb120.zero1"), s)] == [15]
    for stage, want in ((0, 8_472_494_080), (2, 0)):
        eager = moe_stage_memory(spec, _v3_run(), lay, stage).activations
        fused = moe_stage_memory(spec, _v3_run(loss="fused"), lay, stage).activations
        assert eager - fused == pytest.approx(want, abs=2)


def test_dualpipe_in_flight_per_rank_from_its_schedule() -> None:
    """pp 16: rank r holds pp - r of stage r and r + 1 of stage 15 - r, 17 in all (Table 2's
    pp + 1); rank 0: 16 and 1, rank 7: 9 and 8, the mirror rank 15 as rank 0. With 20
    microbatches each direction has 10: rank 0 holds min(16, 10) = 10 of stage 0."""
    lay = parse_moe_layout(V3_LAYOUT)
    assert dualpipe_in_flight(lay, 0) == (16, 1)
    assert dualpipe_in_flight(lay, 7) == (9, 8)
    assert dualpipe_in_flight(lay, 15) == (16, 1)
    assert all(sum(dualpipe_in_flight(lay, r)) == 17 for r in range(16))
    assert dualpipe_in_flight(parse_moe_layout("dp128.pp16.ep64.mb20.zero1.dualpipe"),
                              0) == (10, 1)


def test_v3_rank2_activations_by_hand() -> None:
    """Rank 2 holds stages 2 and 13 (4 MoE layers each): 14 + 3 = 17 microbatches x 4 layers x
    4096 tokens x 153,728 bytes (the V3 knobs) = 42,815,455,232 bytes, no head."""
    spec = _spec("deepseek-v3")
    m = moe_stage_memory(spec, _v3_run(), parse_moe_layout(V3_LAYOUT + V3_KNOBS), 2)
    assert m.activations == pytest.approx(17 * 4 * 4096 * 153_728, abs=2)


def test_bf16_moments_and_fp32_zero_gradients() -> None:
    """ZeRO-1, stage 5: the gradients whole, 2 bytes (compute) or 4 (fp32) per element; the
    partitioned part keeps an fp32 master and two AdamW moments: 4 + 2 x 4 = 12 bytes, with
    BF16 moments 4 + 2 x 2 = 8."""
    spec = _spec("deepseek-v3")
    lay = parse_moe_layout("dp128.pp16.ep64.mb32.zero1")
    dense, routed, _ = stage_param_counts(spec, lay, 5)
    part = dense / 128 + routed / lay.edp
    base = moe_stage_memory(spec, _v3_run(), lay, 5)
    v3 = moe_stage_memory(spec, _v3_run(optimizer_dtype="bfloat16", zero_grad_dtype="float32"),
                          lay, 5)
    assert base.grads == int((dense + routed) * 2)
    assert v3.grads == int((dense + routed) * 4)
    assert base.optimizer == int(part * 12)
    assert v3.optimizer == int(part * 8)


def test_bf16_moments_on_the_dense_planner() -> None:
    """Dense fully_shard: the optimizer term is 2 states x 4 bytes per local element, halved
    with BF16 moments; params and grads unchanged."""
    spec = from_hf_config(LLAMA2_7B)
    lay = parse_layout("fsdp8.mb1")
    a = memory_per_rank(spec, Run(world=8, seq_len=4096, global_batch=8), lay)
    b = memory_per_rank(spec, Run(world=8, seq_len=4096, global_batch=8,
                                  optimizer_dtype="bfloat16"), lay)
    assert b.optimizer * 2 == a.optimizer
    assert (b.params, b.grads) == (a.params, a.grads)


def test_up_projection_recompute_flops_by_hand() -> None:
    """V3: q_b 1536 x 128 x 192 = 37,748,736 and kv_b 512 x 128 x 256 = 16,777,216 weights,
    2 FLOPs each per token, over 61 layers and 1 MTP module: 6,761,218,048."""
    assert recompute_flops_per_token(_spec("deepseek-v3")) == 2 * 54_525_952 * 62
    assert recompute_flops_per_token(_spec("mixtral-8x7b")) == 0


def test_refusals_of_the_new_constraints() -> None:
    """rcup needs MLA; DualPipe needs at least 2 pp microbatches (its schedule sends half each
    way and runs pp - r of them before the first backward)."""
    spec = _spec("mixtral-8x7b")
    run = Run(world=8, seq_len=4096, global_batch=8)
    assert any("rcup" in p for p in moe_shape_problems(
        spec, run, parse_moe_layout("fsdp8.ep8.mb1.rcup")))
    v3 = _spec("deepseek-v3")
    short = parse_moe_layout("dp128.pp16.ep64.mb30.zero1.dualpipe")
    assert any("at least 2 pp" in p for p in moe_shape_problems(v3, _v3_run(), short))


def test_v3_row_fits_with_its_knobs_and_not_without() -> None:
    """The published-run row: the H800 profile's memory (79.65 GiB, what an 80 GB card shows)
    holds the layout with V3's stated knobs and DeepEP's expert-side weights (63.5 GiB);
    without the knobs it does not (207.8 GiB)."""
    from hyperpar.plan.devices import get_profile

    cap = get_profile("h800").memory_bytes
    spec = _spec("deepseek-v3")
    run = _v3_run(optimizer_dtype="bfloat16", zero_grad_dtype="float32")
    fits = moe_memory_per_rank(spec, run, parse_moe_layout(V3_LAYOUT + V3_KNOBS))
    bare = moe_memory_per_rank(spec, _v3_run(), parse_moe_layout(V3_LAYOUT))
    assert fits.peak < cap < bare.peak
