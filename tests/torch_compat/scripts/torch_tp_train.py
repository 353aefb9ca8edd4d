"""A torch tensor-parallel training script, as a torch user writes it. The test runs it with
torchrun, then with only its import lines changed to hyperpar's under torchrun and
`hyperpar run`, and compares the printed losses."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.down(torch.relu(self.up(h))))


mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
torch.manual_seed(0)
model = Net()
parallelize_module(model, mesh, {
    "embed": RowwiseParallel(input_layouts=Replicate()),
    "up": ColwiseParallel(),
    "down": RowwiseParallel(),
    "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
})
opt = torch.optim.SGD(model.parameters(), lr=0.5)
ids = torch.arange(24).reshape(3, 8) % 32
for step in range(3):
    opt.zero_grad()
    logits = model(ids)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
    opt.step()
    value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    if mesh.get_rank() == 0:
        print(f"step {step} loss {value.item():.6f}")
