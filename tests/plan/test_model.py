"""The planner's model description: exact parameter counts from HF configs, and the example
models' tensors, checked against the real examples/llama modules built in torch."""

from __future__ import annotations

import json

import pytest

from hyperpar.plan.model import example_spec, from_hf_config

from ._common import LLAMA2_7B, LLAMA3_70B


def test_llama2_7b_parameter_count_is_exact() -> None:
    assert from_hf_config(LLAMA2_7B).parameters == 6_738_415_616


def test_llama3_70b_parameter_count_is_exact() -> None:
    # 70.55B as published for Meta-Llama-3-70B (GQA with 8 KV heads, untied head)
    assert from_hf_config(LLAMA3_70B).parameters == 70_553_706_496


def test_tied_embeddings_count_the_head_once() -> None:
    cfg = json.loads(LLAMA2_7B.read_text())
    untied = from_hf_config(cfg).parameters
    tied = from_hf_config({**cfg, "tie_word_embeddings": True}).parameters
    assert untied - tied == cfg["vocab_size"] * cfg["hidden_size"]


def test_missing_key_names_it(tmp_path) -> None:
    cfg = json.loads(LLAMA2_7B.read_text())
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_config(cfg)


def test_bad_kv_heads_is_an_error() -> None:
    cfg = json.loads(LLAMA2_7B.read_text())
    with pytest.raises(ValueError, match="num_key_value_heads=5"):
        from_hf_config({**cfg, "num_key_value_heads": 5})


def test_unknown_example_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="llama.*tiny"):
        example_spec("huge")


@pytest.mark.parametrize("name", ["tiny", "llama"])
def test_example_tensors_match_the_real_model(name: str) -> None:
    torch = pytest.importorskip("torch")  # noqa: F841
    from examples.llama import model as llama

    args = llama.ModelArgs.tiny() if name == "tiny" else llama.ModelArgs()
    real = {n: tuple(p.shape) for n, p in llama.build(args).named_parameters()}
    spec = example_spec(name)
    planned = {t.name: t.shape for t in spec.embed_tensors() + spec.final_tensors()}
    for i in range(spec.num_layers):
        planned.update({f"layers.{i}.{t.name}": t.shape for t in spec.block_tensors()})
    assert planned == real
    assert spec.parameters == sum(p.numel() for p in llama.build(args).parameters())
