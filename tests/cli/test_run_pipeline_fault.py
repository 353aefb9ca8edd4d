"""Under `hyperpar run` (torchrun), a pipeline stage that raises ends its process; the other
rank's receive sees only "Connection closed by peer" from gloo -- it must name the stage."""

from __future__ import annotations

import textwrap

from .conftest import hyperpar_cmd

SCRIPT = """
import torch
from torch import nn
from hyperpar.platform import get_platform
from hyperpar.pipeline import PipelineModule, get_schedule_class

class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom in the second stage")

get_platform().init_process_group()
module = PipelineModule([nn.Linear(4, 4), Boom()], num_stages=2,
                        loss_fn=lambda o, t: (o - t).pow(2).mean(), partition_method="uniform")
get_schedule_class("1f1b")(module, 2).step(torch.ones(4, 4), target=torch.zeros(4, 4))
"""


def test_the_surviving_rank_names_the_stage_that_raised(tmp_path):
    script = tmp_path / "pipeline_boom.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = hyperpar_cmd("run", "-n", "2", "--backend", "cpu", "--timeout", "30", str(script),
                        timeout=240)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "first failure: rank 1" in out
    assert "PipelineStageError: stage 1 (rank 1) failed: ValueError: boom in the second stage" \
        in out, out[-3000:]
