"""GPT-style blocks (LayerNorm, GeLU MLP, biases, learned positions) and their per-layer
activation memory against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4: bytes per layer in fp16 with dropout, s: sequence, b: microbatch,
h: hidden, a: heads, t: tensor-parallel size)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hyperpar.plan.layout import Layout, Run
from hyperpar.plan.memory import eager_scores_bytes, layer_activation_elems, stage_memory
from hyperpar.plan.model import ModelSpec, from_hf_config

from ._common import ROOT

#: the sizes of Megatron-LM's 1.7B GPT (h 2304, 24 heads, 24 layers, vocab 51200)
GPT = ModelSpec(name="gpt-1.7b", hidden_size=2304, intermediate_size=4 * 2304, num_layers=24,
                num_heads=24, num_kv_heads=24, vocab_size=51200, block="gpt",
                max_positions=2048, dropout=True)
S, B = 2048, 4


def per_layer(spec: ModelSpec, layout: Layout, attention: str = "eager") -> float:
    """Bytes one layer saves for backward as the planner counts them."""
    run = Run(world=layout.world, seq_len=S, global_batch=B * layout.dp,
              attention=attention)  # type: ignore[arg-type]
    full, saved = layer_activation_elems(spec, layout, run.compute_bytes)
    if layout.activation_checkpointing:
        return saved * S * B * run.compute_bytes
    return full * S * B * run.compute_bytes + eager_scores_bytes(spec, run, layout)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_per_layer_activations_match_korthikanti(t: int) -> None:
    """No parallelism ``sbh(34 + 5as/h)``; tp without sp ``sbh(10 + 24/t + 5as/(ht))``;
    full recompute ``2sbh``; Korthikanti's selective recompute (attention's core recomputed)
    ``34sbh/t`` with tp+sp is what a fused attention kernel saves (no ``s x s`` term)."""
    s, b, h, a = S, B, GPT.hidden_size, GPT.num_heads
    sbh = s * b * h
    assert per_layer(GPT, Layout()) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert per_layer(GPT, Layout(tp=t, sp=False)) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert per_layer(GPT, Layout(activation_checkpointing=True)) == pytest.approx(2 * sbh)
    # without dropout the two masks (2sbh) and attention's (a s^2 b plus its output) go
    nodrop = replace(GPT, dropout=False)
    assert per_layer(nodrop, Layout()) == pytest.approx(sbh * (32 + 2 * a * s / h), rel=1e-12)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_matches_the_paper_when_the_shard_is_saved(t: int) -> None:
    """The paper's tp+sp ``sbh/t (34 + 5as/h)`` (selective: ``34sbh/t``) assumes the inputs of
    the two column-parallel linears are saved split and all-gathered again in backward, as
    hyperpar's default does (``Layout.sp_reshard_input``); keeping them gathered (torch's
    ColwiseParallel, ``sp_reshard_input=False``) holds exactly ``4sbh (1 - 1/t)`` more per
    layer (2 x 2sbh whole instead of split)."""
    s, b, h, a = S, B, GPT.hidden_size, GPT.num_heads
    sbh = s * b * h
    lay = Layout(tp=t)
    assert per_layer(GPT, lay) == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
    assert per_layer(GPT, lay, "flash") == pytest.approx(34 * sbh / t, rel=1e-12)
    extra = 4 * sbh * (1 - 1 / t)
    keep = Layout(tp=t, sp_reshard_input=False)
    assert per_layer(GPT, keep) == pytest.approx(sbh / t * (34 + 5 * a * s / h) + extra,
                                                 rel=1e-12)
    assert per_layer(GPT, keep, "flash") == pytest.approx(34 * sbh / t + extra, rel=1e-12)


def test_stage_memory_adds_the_per_layer_figure_per_layer() -> None:
    """The planner's activations for a stage grow by exactly one layer's bytes per layer."""
    run = Run(world=4, seq_len=S, global_batch=B, attention="eager")
    lay = Layout(tp=4)
    one, two = replace(GPT, num_layers=1), replace(GPT, num_layers=2)
    diff = stage_memory(two, run, lay, 0).activations - stage_memory(one, run, lay, 0).activations
    assert diff == pytest.approx(per_layer(GPT, lay), abs=2)


def test_gpt2_config_parameters_and_errors(tmp_path: Path) -> None:
    """GPT-2 small from its Hugging Face config: 124,439,808 parameters (tied head, learned
    positions, biases); GPT-NeoX keys; a bad block and --measure with a GPT block refused."""
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
           "n_positions": 1024, "vocab_size": 50257, "resid_pdrop": 0.1, "attn_pdrop": 0.1}
    spec = from_hf_config(cfg)
    assert (spec.block, spec.intermediate_size, spec.dropout) == ("gpt", 3072, True)
    assert spec.parameters == 124_439_808
    h, v, f = 768, 50257, 3072
    per_block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    assert spec.matmul_parameters == 12 * (4 * h * h + 2 * h * f) + v * h
    assert spec.parameters == v * h + 1024 * h + 12 * per_block + 2 * h
    neox = from_hf_config({"model_type": "gpt_neox", "hidden_size": 64,
                           "intermediate_size": 256, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "vocab_size": 100})
    assert (neox.block, neox.max_positions, neox.tie_word_embeddings, neox.dropout) == (
        "gpt", 0, False, False)
    with pytest.raises(ValueError, match="block 'bert'; accepted: llama, gpt"):
        replace(GPT, block="bert")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lacks"):
        from_hf_config({"model_type": "gpt2", "n_embd": 64})
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "hyperpar.cli", "plan", "--config", str(path),
                           "--world", "2", "--seq-len", "64", "--global-batch", "2",
                           "--measure"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "GPT-style block is predicted only" in proc.stderr + proc.stdout


def test_gpt_block_replicated_gradients_are_all_reduced_over_tp() -> None:
    """Under tp with sequence parallelism every tp-replicated h-sized tensor's gradient is
    all-reduced: a GPT layer has six (two LayerNorms' weight and bias, the biases of the two
    row-parallel linears), its last stage two more (the final LayerNorm); a Llama layer two."""
    from hyperpar.plan.timing import collectives

    run = Run(world=8, seq_len=S, global_batch=8)
    lay = Layout(dp_replicate=2, tp=4)

    def count(spec: ModelSpec) -> int:
        cs = collectives(spec, run, lay, 0)
        return next(c.count for c in cs if c.what == "norm weight grads")

    assert count(GPT) == 6 * GPT.num_layers + 2
    llama = ModelSpec(name="l", hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=4, vocab_size=100)
    assert count(llama) == 2 * 3 + 1
