"""Inspection of the example Llama model under the TP and TP+SP plans on 2 ranks: captured
activations and gradients equal the unsharded model's at the same module names, and zeroing an
MLP output changes logits and every gradient exactly as it does in the unsharded model.

Under TP+SP the hooked outputs come in every layout hyperpar produces: sequence-sharded local
tensors (``feed_forward``, ``tok_embeddings``), sequence-sharded DTensors (the norms),
hidden-sharded local tensors (``feed_forward.w1``) and replicated tensors (``output``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.llama import model as llama  # noqa: E402
from examples.llama import plan as plans  # noqa: E402
from hyperpar.inspect import InspectedModel  # noqa: E402

ARGS = llama.ModelArgs.tiny()
B, S = 2, ARGS.max_seq_len
HOOKS = {  # module name -> expected global shape
    "tok_embeddings": (B, S, ARGS.dim),
    "layers.*.attention_norm": (B, S, ARGS.dim),
    "layers.*.feed_forward.w1": (B, S, ARGS.ffn_hidden),
    "layers.*.feed_forward": (B, S, ARGS.dim),
    "norm": (B, S, ARGS.dim),
    "output": (B, S, ARGS.vocab_size),
}
NAMES = ["tok_embeddings", "layers.0.attention_norm", "layers.1.attention_norm",
         "layers.0.feed_forward.w1", "layers.1.feed_forward.w1", "layers.0.feed_forward",
         "layers.1.feed_forward", "norm", "output"]


def _zero(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sharded(plan_name: str, edit: bool) -> tuple[dict, torch.Tensor, dict]:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import parallelize_module
    from hyperpar.platform import get_platform

    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    model = llama.build(ARGS, seed=0)
    parallelize_module(model, mesh, plans.tp_plan() if plan_name == "tp" else plans.tp_sp_plan())
    im = InspectedModel(model, mesh=mesh)
    for name, shape in HOOKS.items():
        im.register_forward_hook(name, shape)
    if edit:
        im.register_forward_hook("layers.0.feed_forward", capture=False, editing_function=_zero,
                                 expected_shape=HOOKS["layers.*.feed_forward"])
    im.register_backward_hook("layers.1.feed_forward", HOOKS["layers.*.feed_forward"])
    tokens, labels = llama.batch(ARGS, batch_size=B)
    logits = im(tokens)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    im.flush()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(im.captured), logits.detach(), grads


def _unsharded(edit: bool) -> tuple[dict, torch.Tensor, dict]:
    model = llama.build(ARGS, seed=0)
    seen: dict[str, torch.Tensor] = {}
    for name in NAMES:
        def hook(m, a, out, name=name):
            seen[name] = out.detach().clone()
            if name == "layers.1.feed_forward":
                out.register_hook(lambda g: seen.setdefault(f"{name}.grad", g.clone()))
            if edit and name == "layers.0.feed_forward":
                return _zero(out)
            return None
        model.get_submodule(name).register_forward_hook(hook)
    tokens, labels = llama.batch(ARGS, batch_size=B)
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return seen, logits.detach(), grads


@pytest.mark.parametrize("edit", [False, True], ids=["capture", "zero-mlp"])
@pytest.mark.parametrize("plan_name", ["tp", "tp_sp"])
def test_llama_captures_and_edits_match_the_unsharded_model(run_on_ranks, plan_name, edit):
    captured, logits, grads = run_on_ranks(2, _sharded, plan_name, edit)[0]
    ref_seen, ref_logits, ref_grads = _unsharded(edit)
    assert sorted(captured) == sorted(NAMES + ["layers.1.feed_forward.grad"])
    for key, value in captured.items():
        torch.testing.assert_close(value, ref_seen[key], rtol=1e-5, atol=1e-5, msg=key)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert sorted(grads) == sorted(ref_grads)
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-5, atol=1e-5, msg=key)
    if edit:
        assert not torch.allclose(ref_logits, _unsharded(False)[1]), "the edit had an effect"
