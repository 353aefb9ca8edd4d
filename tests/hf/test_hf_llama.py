"""A real Hugging Face decoder under hyperpar: a tiny ``LlamaForCausalLM`` (random weights, GQA,
tied and untied embeddings) with torchtitan-style TP and TP+SP plans. Logits, loss and every
gradient equal one process within 1e-5 on 2 and 4 ranks, and torch-native TP where torch gets
them right (untied: torch splits a tie made before parallelize_module, see docs/migration.md).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

TOL = 1e-5


def _config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=64, tie_word_embeddings=tied,
                       attn_implementation="sdpa")


def _build(tied: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(tied)).float()
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def tp_plan(s, sequence_parallel: bool) -> dict:
    """The torchtitan Llama plan in Hugging Face module names; ``s``: the styles' namespace
    (hyperpar or torch)."""
    layer = {
        "self_attn.q_proj": s.ColwiseParallel(),
        "self_attn.k_proj": s.ColwiseParallel(),
        "self_attn.v_proj": s.ColwiseParallel(),
        "self_attn.o_proj": s.RowwiseParallel(),
        "mlp.gate_proj": s.ColwiseParallel(),
        "mlp.up_proj": s.ColwiseParallel(),
        "mlp.down_proj": s.RowwiseParallel(),
    }
    plan = {"model.embed_tokens": s.RowwiseParallel(input_layouts=s.Replicate()),
            "lm_head": s.ColwiseParallel(output_layouts=s.Replicate())}
    if sequence_parallel:
        seq = s.Shard(1)
        layer.update({
            "input_layernorm": s.SequenceParallel(),
            "self_attn": s.PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": s.Replicate()},
                use_local_output=True),
            "self_attn.o_proj": s.RowwiseParallel(output_layouts=seq),
            "post_attention_layernorm": s.SequenceParallel(),
            "mlp": s.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(
                s.Replicate(),), use_local_output=True),
            "mlp.down_proj": s.RowwiseParallel(output_layouts=seq),
        })
        plan.update({
            "model.embed_tokens": s.RowwiseParallel(input_layouts=s.Replicate(),
                                                    output_layouts=seq),
            "model.norm": s.SequenceParallel(),
            "lm_head": s.ColwiseParallel(input_layouts=seq, output_layouts=s.Replicate()),
        })
    plan.update({f"model.layers.*.{k}": v for k, v in layer.items()})
    return plan


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(128, (2, 8), generator=g)
    return ids, torch.arange(8).unsqueeze(0).expand(2, 8)


def _step(model, ids, positions):
    out = model(input_ids=ids, position_ids=positions, labels=ids)
    out.loss.backward()
    logits = out.logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for n, p in model.named_parameters()}
    return logits.detach(), out.loss.detach(), grads


def _run(tied: bool, sequence_parallel: bool, with_torch: bool) -> dict:
    import hyperpar
    from hyperpar import init_device_mesh, parallelize_module

    n = torch.distributed.get_world_size()
    ids, positions = _batch()
    want = _step(_build(tied), ids, positions)
    model = _build(tied)
    mesh = init_device_mesh((n,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, tp_plan(hyperpar, sequence_parallel))
    out = {"want": want, "ours": _step(model, ids, positions),
           "tied_kept": (model.lm_head.weight is model.model.embed_tokens.weight) if tied
           else None}
    if with_torch:
        import torch.distributed.tensor as tdt
        import torch.distributed.tensor.parallel as ttp
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        theirs = _build(tied)
        ns = type("torch_styles", (), {**vars(ttp), "Shard": tdt.Shard,
                                       "Replicate": tdt.Replicate})
        ttp.parallelize_module(theirs, torch_mesh("cpu", (n,), mesh_dim_names=("tp",)),
                               tp_plan(ns, sequence_parallel))
        out["torch"] = _step(theirs, ids, positions)
    return out


def _assert_same(got, want, what):
    logits, loss, grads = got
    torch.testing.assert_close(logits, want[0], atol=TOL, rtol=TOL, msg=f"{what}: logits")
    torch.testing.assert_close(loss, want[1], atol=TOL, rtol=TOL, msg=f"{what}: loss")
    assert set(grads) == set(want[2]), (what, sorted(grads), sorted(want[2]))
    for name, g in grads.items():
        torch.testing.assert_close(g, want[2][name], atol=TOL, rtol=TOL,
                                   msg=f"{what}: grad of {name}")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_hf_llama_tp_equals_one_process(run_on_ranks, n, tied, sp):
    with_torch = not tied and not sp and n == 2
    for rank, r in enumerate(run_on_ranks(n, _run, tied, sp, with_torch)):
        _assert_same(r["ours"], r["want"], f"rank {rank} hyperpar")
        if tied:
            assert r["tied_kept"], "the tied embedding/head must stay one parameter"
        if with_torch:
            _assert_same(r["torch"], r["want"], f"rank {rank} torch-native")
