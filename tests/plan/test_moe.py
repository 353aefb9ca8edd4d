"""MoE models in the planner: parameter counts of published models from their Hugging Face
configs against the totals their authors publish,, and the dense planner's refusal of every
MoE config (a prediction it cannot make is refused, never made up).

Published figures, as printed (rounded or truncated: the count must lie within half a unit
of the last digit below and one unit above it; the counts are exact sums of the config's
tensor shapes, so nothing else is allowed for; Qwen3's 3.353B prints as 3.3B):
DeepSeek-V3 671B total / 37B active (arXiv:2412.19437, abstract), DeepSeek-V2 236B / 21B
(arXiv:2405.04434), Mixtral 8x7B 46.7B / 12.9B (arXiv:2401.04088 sec. 2.1: 47B / 13B; the
Mistral announcement's 46.7B / 12.9B), Qwen3-30B-A3B 30.5B / 3.3B (its model card),
Qwen1.5-MoE-A2.7B 14.3B / 2.7B (its model card), gpt-oss-20b 20.91B / 3.61B and gpt-oss-120b
116.83B / 5.13B (the gpt-oss model card, Table 1: its active count leaves out the embedding
lookup, so it is compared with the matmul count).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hyperpar.plan.model import from_hf_config
from hyperpar.plan.moe import moe_from_hf_config, moe_keys

from ._common import LLAMA2_7B, ROOT

CONFIGS = ROOT / "tests" / "plan" / "configs"


def _spec(name: str):
    return moe_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))


@pytest.mark.parametrize("name,total,active,digits,count", [
    ("deepseek-v3", 671, 37, 0, "active_matmul_parameters"),
    ("deepseek-v2", 236, 21, 0, "active_matmul_parameters"),
    ("mixtral-8x7b", 46.7, 12.9, 1, "active_parameters"),
    ("qwen3-30b-a3b", 30.5, 3.3, 1, "active_parameters"),
    ("qwen1.5-moe-a2.7b", 14.3, 2.7, 1, "active_parameters")])
def test_total_and_active_match_the_published(name, total, active, digits, count) -> None:
    """DeepSeek's 37B / 21B leave the embedding lookup out (with it V3 is 37.55B, which
    would round to 38B); Mixtral's and Qwen's count it."""
    spec = _spec(name)
    unit = 10 ** -digits  # the figure rounded or truncated to its last digit
    assert -unit / 2 <= spec.parameters / 1e9 - total < unit, spec.parameters
    assert -unit / 2 <= getattr(spec, count) / 1e9 - active < unit, getattr(spec, count)


@pytest.mark.parametrize("name,total,active", [("gpt-oss-20b", 20.91, 3.61),
                                               ("gpt-oss-120b", 116.83, 5.13)])
def test_gpt_oss_counts_match_its_model_card(name, total, active) -> None:
    spec = _spec(name)
    assert abs(spec.parameters / 1e9 - total) <= 0.005, spec.parameters
    assert abs(spec.active_matmul_parameters / 1e9 - active) <= 0.005
    assert spec.sliding_layers == spec.num_layers // 2 and spec.window == 128


def test_deepseek_v3_layers_and_mtp() -> None:
    """3 dense layers then 58 MoE ones; one MTP module, which holds one MoE layer and a
    ``2h x h`` projection more than the layer (its share of the checkpoint's loosely
    published "685B = 671B + 14B" is not asserted: 13.5B with its embedding copies)."""
    spec = _spec("deepseek-v3")
    assert (spec.dense_layer_count, spec.moe_layers) == (3, 58)
    assert spec.mtp == 1
    assert spec.mtp_parameters - spec.moe_layer_params == 2 * 7168 * 7168 + 3 * 7168


def test_sliding_layers_cut_attention_flops() -> None:
    """gpt-oss at 4096 tokens: half its layers attend to 128 keys, so its attention FLOPs
    are those of the full layers plus 128 / 2048 of a full layer's for each sliding one."""
    spec = _spec("gpt-oss-20b")
    full = spec.attention_flops_per_token(4096)
    per_full = 6 * spec.num_heads * 2 * spec.head_dim * 4096 / 2
    assert full == pytest.approx(12 * per_full + 12 * per_full * 128 / 2048)


@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b",
                                  "gpt-oss-20b", "qwen1.5-moe-a2.7b", "deepseek-v2"])
def test_dense_planner_refuses_every_moe_config(name) -> None:
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    with pytest.raises(ValueError, match="Mixture-of-Experts.*refuses"):
        from_hf_config(cfg)


@pytest.mark.parametrize("key,value", [("num_local_experts", 8), ("num_experts", 64),
                                       ("n_routed_experts", 64), ("num_experts_per_tok", 2),
                                       ("moe_intermediate_size", 768)])
def test_any_moe_key_on_a_llama_config_is_refused(key, value) -> None:
    cfg = {**json.loads(LLAMA2_7B.read_text()), key: value}
    assert moe_keys(cfg) == [key]
    with pytest.raises(ValueError, match=key):
        from_hf_config(cfg)


def test_null_moe_keys_are_dense() -> None:
    cfg = {**json.loads(LLAMA2_7B.read_text()), "num_experts": None, "n_routed_experts": 0}
    assert moe_keys(cfg) == []
    assert from_hf_config(cfg).parameters == 6_738_415_616


def test_unknown_moe_family_is_refused() -> None:
    with pytest.raises(ValueError, match="not modelled.*mixtral"):
        moe_from_hf_config({"model_type": "dbrx", "num_experts": 16})


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyperpar.plan.cli", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_plans_gpt_oss_as_moe(tmp_path) -> None:
    """The issue's case: gpt-oss-20b on 8 H100 was planned as dense (516 GiB for FSDP 8);
    now it goes to the MoE planner, whose FSDP 8 layout holds the routed experts sharded
    (the run fit in 80 GB) and whose JSON layouts carry ep and etp."""
    out = _cli("--config", str(CONFIGS / "gpt-oss-20b.json"), "--world", "8", "--seq-len",
               "4096", "--global-batch", "256", "--layout", "fsdp8.mb32.ac", "--json",
               str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr
    assert "MoE" in out.stdout and "fits" in out.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    lay = doc["ranked"][0]["layout"]
    assert (lay["ep"], lay["etp"], lay["dp_shard"]) == (1, 1, 8)
    assert doc["ranked"][0]["memory"]["peak"] < 80 * 2**30


def test_cli_refuses_an_unmodelled_moe_family(tmp_path) -> None:
    cfg = tmp_path / "dbrx.json"
    cfg.write_text(json.dumps({"model_type": "dbrx", "num_experts": 16, "hidden_size": 6144}))
    out = _cli("--config", str(cfg), "--world", "8", "--seq-len", "4096", "--global-batch",
               "64")
    assert out.returncode == 2
    assert "not modelled" in out.stderr and "tok/s" not in out.stdout


def test_cli_refuses_moe_layout_dims_that_do_not_divide() -> None:
    out = _cli("--config", str(CONFIGS / "mixtral-8x7b.json"), "--world", "16", "--seq-len",
               "4096", "--global-batch", "64", "--layout", "fsdp16.ep16.mb1")
    assert out.returncode == 2
    assert "experts=8 % ep=16" in out.stderr


def test_cli_refuses_measure_of_an_moe_config_and_ep_on_a_dense_one() -> None:
    out = _cli("--config", str(CONFIGS / "qwen3-30b-a3b.json"), "--world", "4", "--seq-len",
               "512", "--global-batch", "4", "--measure")
    assert out.returncode == 2 and "predicted only" in out.stderr
    out = _cli("--config", str(LLAMA2_7B), "--world", "8", "--seq-len", "4096",
               "--global-batch", "8", "--layout", "fsdp8.ep8.mb1")
    assert out.returncode == 2 and "MoE layout part" in out.stderr
