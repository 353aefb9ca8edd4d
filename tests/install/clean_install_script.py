"""Run by tests/install/test_clean_install.py on 2 ranks (``hyperpar run -n 2``) with a
non-editable install of hyperpar + hyperpar-cpu in a venv that started with torch alone, from a
folder outside the checkout: TP forward, a checkpoint save/load, DTensor random init."""

import sys

import torch
from torch import nn

import hyperpar
from hyperpar import (
    ColwiseParallel,
    Replicate,
    RowwiseParallel,
    Shard,
    distribute_tensor,
    init_device_mesh,
    parallelize_module,
)
from hyperpar import checkpoint as ckpt


def main() -> None:
    assert "site-packages" in hyperpar.__file__, f"hyperpar not installed: {hyperpar.__file__}"
    platform = hyperpar.get_platform()
    platform.init_process_group()
    rank = platform.rank()
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))

    # TP forward against the same plain module in this process.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)

    # Checkpoint save then load into a freshly parallelised model (object collectives: numpy).
    folder = sys.argv[1]
    ckpt.save(model, folder)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(other, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ckpt.load(other, folder)
    torch.testing.assert_close(other(x), ref(x), atol=1e-5, rtol=1e-5)

    # DTensor random init with no explicit seed: the ranks agree on one (an object broadcast).
    w = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    torch.nn.init.normal_(w)
    full = w.full_tensor()
    every = platform.all_gather_object(full)
    assert all(torch.equal(every[0], t) for t in every), "ranks disagree on the random init"
    assert full.std() > 0.1, full
    r = distribute_tensor(torch.randn(3, 3), mesh, [Replicate()])
    assert r.to_local().shape == (3, 3)
    print(f"rank {rank}: clean-install checks OK", flush=True)
    # Finish every collective and drop the groups before the interpreter exits: gloo's worker
    # threads otherwise can abort a finished job at shutdown.
    platform.barrier()
    platform.destroy_process_group()


if __name__ == "__main__":
    main()
