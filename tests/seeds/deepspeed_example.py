"""The DeepSpeed seed's usage example (seeds/deepspeed-layerspec.txt) with only its import line
changed and the sizes shrunk, trained as a 2-stage pipeline through ``train_batch`` and
compared with the same model trained in one process. Importable by spawned ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperpar.testing import assert_close_to_reference

STEPS, MICRO, GAS, SEQ, CLIP, LR, SEED = 3, 2, 2, 5, 0.5, 1e-2, 1234
EPS = 1e-3   # Adam's first steps are ~lr * sign(g): a larger eps keeps tiny gradients stable
# float32; microbatch losses are averaged in another order than one process does
RTOL, ATOL = 1e-4, 1e-5


def seed_example():
    """Verbatim from the seed except the import line (deepspeed.pipe -> hyperpar.pipeline) and
    the sizes (30000 x 1024 -> 40 x 16)."""
    from hyperpar.pipeline import LayerSpec, TiedLayerSpec  # noqa: I001
    import torch.nn as nn  # noqa: I001  (the seed's import order)

    vocab_size = 40
    hidden_size = 16

    # Basic layer specification without instantiation
    layers = [
        LayerSpec(nn.Embedding, vocab_size, hidden_size),
        LayerSpec(nn.Linear, hidden_size, hidden_size),
        LayerSpec(nn.Linear, hidden_size, hidden_size),
        LayerSpec(nn.Linear, hidden_size, vocab_size),
    ]

    # Weight tying between embedding and output projection
    def output_forward(module, input):
        return torch.nn.functional.linear(input, module.weight)

    tied_layers = [
        TiedLayerSpec("embed", nn.Embedding, vocab_size, hidden_size),
        LayerSpec(nn.Linear, hidden_size, hidden_size),
        LayerSpec(nn.Linear, hidden_size, hidden_size),
        TiedLayerSpec("embed", nn.Embedding, vocab_size, hidden_size,
                      forward_fn=output_forward),
    ]
    return layers, tied_layers, vocab_size


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batches(step: int, vocab: int, dp_rank: int = 0, dp: int = 1) -> list[tuple]:
    """The ``GAS`` microbatches ``(ids, labels)`` of replica ``dp_rank`` at ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (dp * GAS * MICRO, SEQ), generator=g)
    labels = torch.randint(0, vocab, (dp * GAS * MICRO, SEQ), generator=g)
    mine = slice(dp_rank * GAS * MICRO, (dp_rank + 1) * GAS * MICRO)
    ids, labels = ids[mine], labels[mine]
    return [(ids[i * MICRO:(i + 1) * MICRO], labels[i * MICRO:(i + 1) * MICRO])
            for i in range(GAS)]


def reference(steps: int = STEPS, dp: int = 1) -> dict:
    """The tied model in one process: what seed_layers=True builds for each layer index, the
    mean microbatch loss, torch's clip_grad_norm_ and AdamW (weight decay 0, DeepSpeed's)."""
    _, tied, vocab = seed_example()
    built = []
    for i, spec in enumerate(tied[:3]):
        torch.manual_seed(SEED + i)
        built.append(spec.build())
    emb, l1, l2 = built
    params = [*emb.parameters(), *l1.parameters(), *l2.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.0)

    def model(x: torch.Tensor) -> torch.Tensor:
        return F.linear(l2(l1(emb(x))), emb.weight)

    losses = []
    for step in range(steps):
        mbs = [mb for r in range(dp) for mb in batches(step, vocab, r, dp)]
        loss = sum(lm_loss(model(x), y) for x, y in mbs) / len(mbs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    x, y = batches(steps, vocab)[0]
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in batches(steps, vocab)])
        eval_loss = sum(lm_loss(model(x), y) for x, y in batches(steps, vocab)) / GAS
    return {"losses": losses, "logits": logits, "eval_loss": eval_loss,
            "emb": emb.weight.detach().clone()}


def train_pipeline(num_stages: int | None = 2, dp: int = 1, config_extra: dict | None = None,
                   topology=None, virtual_stages: int = 1) -> dict:
    """The seed's tied list as a ``num_stages``-stage pipeline, trained by train_batch."""
    from hyperpar.pipeline import PipelineModule, initialize
    from hyperpar.platform import get_platform

    _, tied_layers, vocab = seed_example()
    model = PipelineModule(layers=tied_layers, num_stages=num_stages, topology=topology,
                           loss_fn=lm_loss, partition_method="parameters", seed_layers=True,
                           base_seed=SEED, virtual_stages=virtual_stages)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}}}
    config.update(config_extra or {})
    engine, optimizer, _, _ = initialize(model=model, config=config)
    assert engine.train_batch_size() == MICRO * GAS * dp
    dp_rank = get_platform().rank(model.dp_group) if model.dp_size > 1 else 0
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter(batches(step, vocab, dp_rank, dp))))
    loss, logits = engine.eval_batch(iter(batches(STEPS, vocab, dp_rank, dp)),
                                     return_logits=True)
    emb = model.tied_modules["embed"].weight.detach().clone()
    return {"parts": model.parts, "losses": losses, "eval_loss": loss, "logits": logits,
            "emb": emb, "last": engine.is_last_stage(), "scale": engine.loss_scale}


def check_two_stages(virtual_stages: int = 1) -> dict:
    """2 ranks; with ``virtual_stages=2`` four one-layer stages driven by interleaved 1F1B."""
    out = train_pipeline(virtual_stages=virtual_stages)
    ref = reference()
    expected_parts = [0, 2, 4] if virtual_stages == 1 else [0, 1, 2, 3, 4]
    assert out["parts"] == expected_parts, out["parts"]   # DeepSpeed's split of this list
    assert_close_to_reference(out["losses"], ref["losses"], rtol=RTOL, atol=ATOL,
                              what="train_batch losses")
    assert_close_to_reference(out["eval_loss"], ref["eval_loss"], rtol=RTOL, atol=ATOL,
                              what="eval_batch loss")
    assert_close_to_reference(out["emb"], ref["emb"], rtol=RTOL, atol=ATOL,
                              what="tied embedding after training")
    if out["last"]:
        assert_close_to_reference(out["logits"], ref["logits"], rtol=RTOL, atol=ATOL,
                                  what="eval_batch logits")
    else:
        assert out["logits"] is None
    return {"losses": [float(x) for x in out["losses"]], "last": out["last"]}


def check_data_parallel(use_topology: bool) -> dict:
    """4 ranks: two 2-stage pipelines, each fed its own half of every batch; built from
    ``num_stages=2`` or from DeepSpeed's ``PipeDataParallelTopology(num_pp=2, num_dp=2)``."""
    from hyperpar.pipeline import PipeDataParallelTopology

    if use_topology:
        out = train_pipeline(None, dp=2, topology=PipeDataParallelTopology(num_pp=2, num_dp=2))
    else:
        out = train_pipeline(num_stages=2, dp=2)
    ref = reference(dp=2)
    assert_close_to_reference(out["losses"], ref["losses"], rtol=RTOL, atol=ATOL,
                              what="dp2 x pp2 losses")
    assert_close_to_reference(out["emb"], ref["emb"], rtol=RTOL, atol=ATOL,
                              what="dp2 x pp2 embedding")
    return {"losses": [float(x) for x in out["losses"]], "last": out["last"]}


def check_fp16_overflow_is_skipped() -> dict:
    """A loss scale of 2**40 overflows fp16 gradients: the step is skipped on every rank, the
    weights stay as built and the scale halves (hysteresis 1)."""
    from hyperpar.pipeline import PipelineModule, initialize

    _, tied_layers, vocab = seed_example()
    model = PipelineModule(layers=tied_layers, num_stages=2, loss_fn=lm_loss,
                           seed_layers=True, base_seed=SEED)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 1},
              "optimizer": {"type": "Adam", "params": {"lr": LR}}}
    engine, *_ = initialize(model=model, config=config)
    loss = engine.train_batch(iter(batches(0, vocab)))
    assert torch.isfinite(loss), loss
    assert engine.loss_scale == 2.0 ** 39, engine.loss_scale
    for n, p in model.named_parameters():
        assert p.dtype == torch.float16
        assert torch.equal(p.detach(), before[n].half()), f"{n} changed on a skipped step"
    # with a sane static scale the step is taken and matches fp32 to fp16 precision
    engine.scaler.scale, engine.scaler.dynamic = 128.0, False
    loss2 = engine.train_batch(iter(batches(0, vocab)))
    changed = any(not torch.equal(p.detach(), before[n].half())
                  for n, p in model.named_parameters())
    return {"loss": float(loss), "loss2": float(loss2), "changed": changed}
