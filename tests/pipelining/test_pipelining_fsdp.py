"""fully_shard inside a hyperpar.pipelining stage behaves as torch's FSDPModule does under torch
pipelining: gradients accumulate unsynced over the microbatches and are reduce-scattered once,
in the stage's last backward of the step; nothing a shape pass could leave behind reaches the
gradients. 4 ranks: ``init_device_mesh((2, 2), ("pp", "dp"))``, 2 stages x 2 shards; 2 SGD
steps equal the whole model on the whole batch in one process."""

from __future__ import annotations

import torch
from pipelining_cases import BATCH, LR, batches, build_model, mse_mean

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train() -> dict:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh((2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    model = build_model(2)
    stage_mod = fully_shard(model[pp], mesh=mesh["dp"])
    group_cls = type(stage_mod._fsdp_group)
    original, calls = group_cls.reduce_grads, []

    def counting(self):  # count reduce-scatters: one per step, not one per microbatch
        calls.append(1)
        return original(self)

    group_cls.reduce_grads = counting
    try:
        stage = PipelineStage(stage_mod, pp, 2, None, group=mesh["pp"].get_group())
        sched = Schedule1F1B(stage, n_microbatches=2, loss_fn=mse_mean)
        opt = torch.optim.SGD(stage_mod.parameters(), lr=LR)
        rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
        grads = []
        for x, y in batches(2):
            opt.zero_grad()
            sched.step(*((x[rows],) if pp == 0 else ()), target=y[rows] if pp == 1 else None)
            grads.append({f"{pp}.{n}": _full(p.grad).clone()
                          for n, p in stage_mod.named_parameters()})
            opt.step()
    finally:
        group_cls.reduce_grads = original
    params = {f"{pp}.{n}": _full(p).detach().clone() for n, p in stage_mod.named_parameters()}
    return {"grads": grads, "params": params, "reduce_scatters": len(calls)}


def _reference() -> dict:
    model = build_model(2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for x, y in batches(2):
        opt.zero_grad()
        mse_mean(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach() for n, p in model.named_parameters()}}


def test_fully_shard_stages_train_like_one_process(run_on_ranks):
    results = run_on_ranks(4, _train, timeout_s=90)
    ref = _reference()
    for r in results:
        assert r["reduce_scatters"] == 2, r["reduce_scatters"]   # 2 steps x 1
        for step in range(2):
            for n, g in r["grads"][step].items():
                torch.testing.assert_close(g, ref["grads"][step][n], **TOL, msg=f"{step} {n}")
        for n, p in r["params"].items():
            torch.testing.assert_close(p, ref["params"][n], **TOL, msg=n)
    assert {n for r in results for n in r["params"]} == set(ref["params"])
