"""Every schedule on 2 and 4 real ranks equals the whole model in one process (loss and
parameter gradients, tied embedding/head included) for several microbatch counts."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import run_cases, run_group_cases, run_shape_cases

CASES_2 = [
    # m < p, m not a multiple of p, m a multiple of p; several partitions
    *({"schedule": s, "m": m, "partition": part}
      for s in ("gpipe", "1f1b", "zerobubble")
      for m, part in ((1, "uniform"), (3, "parameters"), (4, [0, 4, 10]))),
    {"schedule": "1f1b", "m": 3, "checkpoint": 2, "partition": "type:block"},
    {"schedule": "zerobubble", "m": 4, "checkpoint": 2},
    {"schedule": "1f1b", "m": 2, "steps": 2},
    *({"schedule": "interleaved1f1b", "m": m, "virtual_stages": 2} for m in (1, 3, 4, 6)),
]

CASES_4 = [
    *({"schedule": s, "m": m, "partition": part}
      for s in ("gpipe", "1f1b", "zerobubble")
      for m, part in ((2, "uniform"), (5, [0, 4, 5, 8, 10]), (8, "parameters"))),
    {"schedule": "zerobubble", "m": 3, "checkpoint": 2},
    *({"schedule": "interleaved1f1b", "m": m, "virtual_stages": 2, "partition": "uniform"}
      for m in (2, 5, 8)),
]


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_every_schedule_matches_single_process(run_on_ranks, world, cases):
    results = run_on_ranks(world, run_cases, cases, timeout_s=240)
    assert all(len(r) == len(cases) for r in results)


def test_pipelines_in_a_larger_world_mesh_and_tied_broadcast(run_on_ranks):
    results = run_on_ranks(4, run_group_cases, timeout_s=180)
    # DeepSpeed layout: stage s of pipeline d is global rank s * dp + d
    assert [r["num_stages=2 stage_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # a row-major ("dp", "pp") mesh: pipelines are the rows
    assert [r["mesh stage_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # the embedding (stage 0) and the head (stage 3) hold the broadcast copy of rank 0
    w0, w3 = results[0]["tied"]["emb.weight"], results[3]["tied"]["emb.weight"]
    assert torch.equal(w0, w3)
    assert results[1]["tied"] == {} and results[2]["tied"] == {}


def test_outputs_merge_batch_size_may_change_and_eval_runs_forward_only(run_on_ranks):
    expected = ["batch 8", "batch 5", "eval 1f1b x3", "eval interleaved1f1b x3",
                "eval interleaved1f1b x4"]
    assert run_on_ranks(2, run_shape_cases, timeout_s=60) == [expected] * 2
