"""fully_shard inside a hyperpar.pipelining stage behaves as torch's FSDPModule does under torch
pipelining: gradients accumulate unsynced over the microbatches and are reduce-scattered once,
in the stage's last backward of the step; nothing a shape pass could leave behind reaches the
gradients. 4 ranks: ``init_device_mesh((2, 2), ("pp", "dp"))``, 2 stages x 2 shards; 2 SGD
steps equal the whole model on the whole batch in one process. Under ScheduleZBVZeroBubble
(two stages per pipeline rank in a V, backward split into input and weight gradients) the
parameters stay gathered for the step and each stage's gradients are reduced once after its
last weight gradient, as torch's runtime schedules do."""

from __future__ import annotations

import pytest
import torch
from pipelining_cases import BATCH, LR, batches, build_model, mse_mean

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(schedule: str) -> dict:
    import hyperpar.pipelining as pipelining
    from hyperpar import fully_shard, init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    v = 2 if schedule == "ScheduleZBVZeroBubble" else 1
    n_stages = 2 * v
    model = build_model(n_stages)
    indices = [pp, n_stages - 1 - pp] if v == 2 else [pp]
    stage_mods = [fully_shard(model[i], mesh=mesh["dp"]) for i in indices]
    group_cls = type(stage_mods[0]._fsdp_group)
    original, calls = group_cls.reduce_grads, []

    def counting(self):  # count reduce-scatters: one per stage and step, not per microbatch
        calls.append(1)
        return original(self)

    group_cls.reduce_grads = counting
    try:
        stages = [pipelining.PipelineStage(m, i, n_stages, None, group=mesh["pp"].get_group())
                  for m, i in zip(stage_mods, indices, strict=True)]
        cls = getattr(pipelining, schedule)
        sched = cls(stages[0] if v == 1 else stages, n_microbatches=2, loss_fn=mse_mean)
        params = [p for m in stage_mods for p in m.parameters()]
        opt = torch.optim.SGD(params, lr=LR)
        rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
        first, last = 0 in indices, n_stages - 1 in indices
        grads = []
        for x, y in batches(2):
            opt.zero_grad()
            sched.step(*((x[rows],) if first else ()), target=y[rows] if last else None)
            grads.append({f"{i}.{n}": _full(p.grad).clone()
                          for m, i in zip(stage_mods, indices, strict=True)
                          for n, p in m.named_parameters()})
            opt.step()
    finally:
        group_cls.reduce_grads = original
    params = {f"{i}.{n}": _full(p).detach().clone()
              for m, i in zip(stage_mods, indices, strict=True) for n, p in m.named_parameters()}
    return {"grads": grads, "params": params, "reduce_scatters": len(calls), "stages": v}


def _reference(n_stages: int) -> dict:
    model = build_model(n_stages)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for x, y in batches(2):
        opt.zero_grad()
        mse_mean(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleZBVZeroBubble"])
def test_fully_shard_stages_train_like_one_process(run_on_ranks, schedule):
    results = run_on_ranks(4, _train, schedule, timeout_s=90)
    ref = _reference(2 * results[0]["stages"])
    for r in results:
        assert r["reduce_scatters"] == 2 * r["stages"], r["reduce_scatters"]  # steps x stages
        for step in range(2):
            for n, g in r["grads"][step].items():
                torch.testing.assert_close(g, ref["grads"][step][n], **TOL, msg=f"{step} {n}")
        for n, p in r["params"].items():
            torch.testing.assert_close(p, ref["params"][n], **TOL, msg=n)
    assert {n for r in results for n in r["params"]} == set(ref["params"])
