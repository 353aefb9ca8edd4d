"""The PyTorch half of the cross-framework checkpoint test, run by the torch venv's
``hyperpar run -n 1`` (the MindSpore venv has no torch). The model is the MindSpore test's Cell
written in torch (:mod:`tests.mindspore._ckpt_model`).

    save <folder> <out.json> <seed>: weights from ``seed``, saved to ``folder``
    load <folder> <out.json> <seed>: a model with weights from ``seed`` loads ``folder``

Either way ``out.json`` gets the loss on the fixed batch and every parameter's float32 bytes
(hex), read back from the model.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hyperpar import checkpoint  # noqa: E402
from hyperpar.platform import get_platform  # noqa: E402
from tests.mindspore._ckpt_model import D, H, batch, weights  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def main(mode: str, folder: str, out: str, seed: str) -> None:
    get_platform().init_process_group()
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights(int(seed))[name]))
    if mode == "save":
        checkpoint.save(net, folder, file_format="safetensors")
    else:
        checkpoint.load(net, folder)
    x, y = (torch.from_numpy(a) for a in batch())
    with torch.no_grad():
        loss = float(((net(x) - y) ** 2).mean())
    params = {n: p.detach().numpy().tobytes().hex() for n, p in net.named_parameters()}
    with open(out, "w") as f:
        json.dump({"loss": loss, "params": params}, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
