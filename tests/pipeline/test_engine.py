"""PipelineEngine / initialize in one process: DeepSpeed's config rules, the loss scaler,
topologies, and the errors a user sees. The multi-rank parity runs are in tests/seeds."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import PlainTiedModel, data, lm_loss, tied_layers
from torch import nn

from hyperpar.pipeline import (
    PipeDataParallelTopology,
    PipelineEngine,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    RepeatingLoader,
    initialize,
)
from hyperpar.pipeline.config import EngineConfig
from hyperpar.pipeline.precision import DynamicLossScaler

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _model(**kwargs) -> PipelineModule:
    return PipelineModule(tied_layers(), num_stages=1, loss_fn=lm_loss, seed_layers=True,
                          **kwargs)


def _microbatches(n: int = 2):
    x, y = data()
    return [(x[i::n], y[i::n]) for i in range(n)]


def test_batch_sizes_follow_deepspeeds_rule():
    cfg = EngineConfig.from_any({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2},
                                dp_size=2)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps) == \
        (16, 2, 4)
    cfg = EngineConfig.from_any({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 2)
    assert cfg.micro_batch_size == 2
    with pytest.raises(ValueError, match="train_batch_size=10 != .* = 8"):
        EngineConfig.from_any({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                               "gradient_accumulation_steps": 2}, 2)


def test_config_keys_that_would_change_training_are_refused():
    base = {"train_micro_batch_size_per_gpu": 2}
    with pytest.raises(ValueError, match=r"\['scheduler'\] are not supported"):
        EngineConfig.from_any({**base, "scheduler": {"type": "WarmupLR"}}, 1)
    with pytest.raises(ValueError, match="zero_optimization"):
        EngineConfig.from_any({**base, "zero_optimization": {"stage": 1}}, 1)
    with pytest.raises(ValueError, match="both enabled"):
        EngineConfig.from_any({**base, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1)
    EngineConfig.from_any({**base, "steps_per_print": 10, "wall_clock_breakdown": False}, 1)


def test_engine_trains_one_stage_like_plain_torch():
    torch.manual_seed(0)
    engine, opt, loader, sched = initialize(
        model=_model(), config={"train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2, "optimizer": SGD})
    assert isinstance(opt, torch.optim.SGD) and loader is None and sched is None
    assert engine.is_first_stage() and engine.is_last_stage()
    reference = PlainTiedModel()  # the same layers and seeds in plain torch, tied by hand
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        loss = engine.train_batch(iter(_microbatches()))
        ref = sum(lm_loss(reference(x), y) for x, y in _microbatches()) / 2
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    assert engine.global_steps == 2 and engine.global_samples == 16


def test_train_batch_needs_gradients_and_pairs():
    model = _model()
    engine = PipelineEngine(model, lambda params: torch.optim.SGD(params, lr=0.1),
                            {"train_micro_batch_size_per_gpu": 4})
    with torch.no_grad(), pytest.raises(RuntimeError, match="Use eval_batch"):
        engine.train_batch(iter(_microbatches(1)))
    with pytest.raises(TypeError, match=r"pair \(inputs, labels\)"):
        engine.train_batch(iter([data()[0]]))
    with pytest.raises(RuntimeError, match="only train_batch"):
        engine(data()[0])
    with pytest.raises(ValueError, match="no optimizer"):
        PipelineEngine(model, None, {"train_micro_batch_size_per_gpu": 4})


def test_eval_batch_returns_the_logits_of_every_microbatch():
    model = _model()
    engine, *_ = initialize(model=model, config={"train_micro_batch_size_per_gpu": 4,
                                                 "gradient_accumulation_steps": 2,
                                                 "optimizer": SGD})
    mbs = _microbatches()
    loss, logits = engine.eval_batch(iter(mbs), return_logits=True)
    with torch.no_grad():
        expected = torch.cat([model(x) for x, _ in mbs])
        ref = sum(lm_loss(model(x), y) for x, y in mbs) / 2
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(loss, ref)
    per_mb = engine.eval_batch(iter(mbs), reduce_output=None)
    assert len(per_mb) == 2


def test_bf16_keeps_fp32_masters_and_a_bf16_model():
    model = _model()
    engine, *_ = initialize(model=model, config={"train_micro_batch_size_per_gpu": 4,
                                                 "bf16": {"enabled": True}, "optimizer": SGD})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in engine.masters.masters)
    before = [m.detach().clone() for m in engine.masters.masters]
    engine.train_batch(RepeatingLoader(_microbatches(1)))
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.masters.masters,
                                                     strict=True))
    for p, m in zip(engine.masters.params, engine.masters.masters, strict=True):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))


def test_dynamic_loss_scaler_follows_deepspeeds_rule():
    s = DynamicLossScaler({"initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 2})
    assert s.scale == 16
    s.update(True)            # first overflow: hysteresis absorbs it
    assert s.scale == 16
    s.update(True)            # second: halve
    assert s.scale == 8
    s.update(False)
    s.update(False)           # two clean steps after the last overflow: double
    assert s.scale == 16
    fixed = DynamicLossScaler({"loss_scale": 128})
    fixed.update(True)
    assert fixed.scale == 128 and not fixed.dynamic


def test_topologies_lay_out_ranks_as_deepspeed():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_coord(5).pipe == 1 and topo.get_dim("tensor") == 0
    assert PipeDataParallelTopology(2, 2).get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert ProcessTopology(["x", "y"], [2, 3]).get_axis_list("y", 0) == [0, 3]


def test_pipeline_module_argument_errors():
    with pytest.raises(ValueError, match="num_stages=3 but the topology's 'pipe' axis has 1"):
        PipelineModule([nn.Linear(2, 2)], 3, PipeDataParallelTopology(1, 1))
    with pytest.raises(TypeError, match="checkpointable_layers must be a list"):
        PipelineModule([nn.Linear(2, 2)], 1, checkpointable_layers="Linear")
    with pytest.raises(NotImplementedError, match="nesting"):
        PipelineModule([PipelineModule([nn.Linear(2, 2)], 1)], 1)


def test_a_sequential_is_taken_as_its_layers():
    seq = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    module = PipelineModule(seq, 1)
    x = torch.randn(4, 3)
    torch.testing.assert_close(module(x), seq(x))


def test_engine_over_fully_shard_on_a_pp_dp_mesh_matches_one_process(run_on_ranks):
    from engine_fsdp_case import run

    results = run_on_ranks(4, run, timeout_s=300)
    assert all(r == results[0] for r in results)   # the loss on every stage and replica


def test_training_data_and_lr_scheduler_as_in_deepspeed_initialize():
    from torch.utils.data import TensorDataset

    x, y = data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, _, loader, lr_scheduler = initialize(
        model=model, optimizer=opt, training_data=TensorDataset(x, y), lr_scheduler=sched,
        config={"train_batch_size": 4, "gradient_accumulation_steps": 2})
    assert lr_scheduler is sched and len(loader) == 4   # 8 samples, micro batches of 2
    for _ in range(3):                                  # the loader repeats when exhausted
        assert torch.isfinite(engine.train_batch())
    assert engine.get_lr() == [0.1 * 0.5 ** 3]
