"""Composition: dp2 x tp2 on 4 ranks trains the example Llama model exactly like one process on
the full batch (logits, loss, gradients, parameters after SGD; float32, rtol = atol = 1e-5).

Rank placement: ``init_device_mesh((2, 2), ("dp", "tp"))`` puts ranks [[0, 1], [2, 3]] in the
grid, so tp groups are {0, 1} and {2, 3} (one model replica each) and dp groups are {0, 2} and
{1, 3} (the same shard of the two replicas). Replica ``d`` takes batch rows ``[d*B/2, (d+1)*B/2)``.
"""

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
from hyperpar.parallel.data_parallel import data_parallel  # noqa: E402
from hyperpar.testing.parity import assert_close_to_reference  # noqa: E402

STEPS, LR, BATCH = 3, 0.1, 4


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _sgd(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            _local(p).add_(_local(p.grad), alpha=-LR)
            p.grad = None


def _dp_tp_against_reference(plan_name: str) -> None:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import parallelize_module

    args = llama.ModelArgs.tiny()
    reference, model = llama.build(args, seed=0), llama.build(args, seed=0)
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    plan = plans.tp_plan() if plan_name == "tp" else plans.tp_sp_plan()
    parallelize_module(model, mesh["tp"], plan)
    data_parallel(model, mesh, "dp")
    dp = mesh.get_local_rank("dp")
    rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    for step in range(STEPS):
        tokens, labels = llama.batch(args, batch_size=BATCH, seed=step)
        ref_logits = reference(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()).backward()
        logits = model(tokens[rows])
        F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten()).backward()
        assert_close_to_reference(_full(logits), ref_logits[rows].detach(),
                                  what=f"step {step} logits")
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        assert_close_to_reference(grads, ref_grads, what=f"step {step} grad")
        _sgd(model)
        _sgd(reference)
    params = {n: _full(p).detach() for n, p in model.named_parameters()}
    assert_close_to_reference(params, dict(reference.named_parameters()),
                              what="params after SGD")


@pytest.mark.parametrize("plan_name", ["tp", "tp_sp"])
def test_dp2_tp2_llama_matches_one_process_on_the_full_batch(run_on_ranks, plan_name):
    run_on_ranks(4, _dp_tp_against_reference, plan_name)
