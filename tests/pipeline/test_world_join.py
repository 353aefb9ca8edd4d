"""``PipelineModule`` joins the world as ``init_device_mesh`` does: under plain ``torchrun``
with no ``init_process_group`` in the script it sees every launched rank, not a world of one."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from hyperpar.pipeline import LayerSpec, PipelineModule
from hyperpar.platform import get_platform

NO_INIT = '''
import torch
from torch import nn

from hyperpar.pipeline import LayerSpec, PipelineModule
from hyperpar.platform import get_platform

specs = [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
model = PipelineModule(layers=specs, num_stages=2, partition_method="uniform")  # no init
platform = get_platform()
print(f"rank {platform.rank()} of {platform.world_size()}: stage {model.stage_id} of "
      f"{model.num_stages}, {len(list(model.parameters()))} parameters", flush=True)
'''


def test_pipeline_module_joins_the_torchrun_world_without_init_process_group(tmp_path):
    script = tmp_path / "pipe_no_init.py"
    script.write_text(NO_INIT)
    env = {**os.environ, "HYPERPAR_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):  # each rank builds its own two Linears (weight + bias each)
        assert f"rank {rank} of 2: stage {rank} of 2, 4 parameters" in proc.stdout, (
            proc.stdout + proc.stderr)


def test_a_lone_process_is_a_world_of_one():
    """``python script.py``: one rank holds every stage of a one-stage pipeline."""
    model = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4) for _ in range(3)], num_stages=1)
    assert get_platform().world_size() == 1 and model.stage_id == 0
    assert len(list(model.parameters())) == 6
