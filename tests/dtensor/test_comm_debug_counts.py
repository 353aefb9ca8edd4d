"""``hyperpar.dtensor.debug.CommDebugMode`` beyond the side-by-side with torch
(``tests/torch_compat/test_comm_debug_mode.py``): the collectives a test knows it issues are
counted once each (an object collective built on a tensor one counts as itself), point-to-point
traffic and a checkpoint's collectives are counted, nothing outside the ``with`` is, the
tracing table and its file name modules and counts. 2 real gloo ranks."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.platform import get_platform


def _known_collectives() -> dict:
    from hyperpar.dtensor.debug import CommDebugMode

    platform = get_platform()
    t = torch.ones(4)
    platform.all_reduce(t, "sum")  # before the mode: not counted
    with CommDebugMode() as mode:
        platform.all_reduce(t, "sum")
        platform.all_reduce(t, "max")
        platform.all_gather_object(platform.rank())  # built on tensor collectives: counts once
        platform.barrier()
        if platform.rank() == 0:
            platform.send(t, 1)
        else:
            platform.recv(t, 0)
    platform.all_reduce(t, "sum")  # after: not counted
    return {str(k): n for k, n in mode.get_comm_counts().items()} | {
        "total": mode.get_total_counts()}


def test_counts_exactly_the_collectives_issued_inside_the_mode(run_on_ranks):
    for rank, counts in enumerate(run_on_ranks(2, _known_collectives)):
        p2p = "send" if rank == 0 else "recv"
        assert counts == {"c10d_functional.all_reduce": 2, "all_gather_object": 1,
                          "barrier": 1, p2p: 1, "total": 5}, (rank, counts)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _table_and_file(path: str) -> dict:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.dtensor.debug import CommDebugMode
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _MLP()
    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    with CommDebugMode() as mode:
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    if get_platform().rank() == 0:
        mode.log_comm_debug_tracing_table_to_file(path, noise_level=1)
    return {"per_module": {fqn: {str(k): n for k, n in c.items()}
                           for fqn, c in mode.get_per_module_comm_counts().items() if c},
            "quiet": mode.generate_comm_debug_tracing_table(noise_level=0),
            "sharding": {k: str(tuple(v)) for k, v in mode.get_sharding_info().items()}}


def test_per_module_counts_table_and_file(run_on_ranks, tmp_path):
    path = tmp_path / "comm.txt"
    for out in run_on_ranks(2, _table_and_file, str(path)):
        key = "c10d_functional.all_reduce"
        # forward: w2's output all-reduce (in w2, MLP, Global); backward: w1's input gradient
        assert out["per_module"] == {"Global": {key: 2}, "_MLP": {key: 1},
                                     "_MLP.w2": {key: 1}}, out
        assert out["sharding"] == {"_MLP.w1.weight": "(Shard(dim=0),)",
                                   "_MLP.w1.bias": "(Shard(dim=0),)",
                                   "_MLP.w2.weight": "(Shard(dim=1),)",
                                   "_MLP.w2.bias": "(Replicate(),)"}, out
        lines = out["quiet"].splitlines()
        assert lines[0] == "Global" and "        _MLP.w2" in lines, lines
        assert "module type" not in out["quiet"], lines
    text = path.read_text()
    assert "*module type: " in text and "*w1.weight" not in text, text
    assert " *weight: (Shard(dim=0),)" in text and "BACKWARD PASS" in text, text
    assert "\x1b" not in text
