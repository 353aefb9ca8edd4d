"""The PyTorch half of the cross-framework checkpoint test, run by the torch venv's
``hyperpar run -n 1`` (the MindSpore venv has no torch). The model is the MindSpore test's Cell
written in torch (:mod:`tests.mindspore._ckpt_model`).

    save <folder> <out.json> <seed>: weights from ``seed``, saved to ``folder``
    load <folder> <out.json> <seed>: a model with weights from ``seed`` loads ``folder``

Either way ``out.json`` gets the loss on the fixed batch and every parameter's float32 bytes
(hex), read back from the model.

    optim <folder> <out.json> <seed>: optimizer state across frameworks, for each optimizer
    of :data:`OPTIMIZERS`: weights from ``seed``, 2 steps, saved with the optimizer to
    ``<folder>/torch-<kind>``, then a 3rd step (the reference MindSpore's resumed step is
    compared with); and a model of other weights loads ``<folder>/ms-<kind>`` (MindSpore's
    optimizer state) and takes that 3rd step. Also saves an AdamW (``torch-adamw``, refused by
    MindSpore) and reports torch's refusal of a MindSpore Adam's state into an SGD.
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
from tests.mindspore._ckpt_model import D, H, batch, train_batch, weights  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


#: the torch half of each optimizer pair of the test (MindSpore: nn.Adam, nn.Momentum, nn.SGD)
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}


def _net(seed: int) -> Net:
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights(seed)[name]))
    return net


def _steps(net: Net, opt: torch.optim.Optimizer, steps: tuple[int, ...]) -> None:
    for i in steps:
        x, y = (torch.from_numpy(a) for a in train_batch(i))
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()


def _hex(net: Net) -> dict[str, str]:
    return {n: p.detach().numpy().tobytes().hex() for n, p in net.named_parameters()}


def optim(folder: str, out: str, seed: int) -> None:
    report: dict = {}
    for kind, make in OPTIMIZERS.items():
        net = _net(seed)
        opt = make(net.parameters())
        _steps(net, opt, (0, 1))
        checkpoint.save(net, os.path.join(folder, f"torch-{kind}"), optimizer=opt,
                        file_format="safetensors")
        _steps(net, opt, (2,))
        report[f"torch-{kind}"] = _hex(net)
        if kind == "adamw":
            continue
        net = _net(seed + 3)   # other weights: the load must bring them
        opt = make(net.parameters())
        checkpoint.load(net, os.path.join(folder, f"ms-{kind}"), optimizer=opt)
        _steps(net, opt, (2,))
        report[f"from-ms-{kind}"] = _hex(net)
    try:
        net = _net(seed)
        checkpoint.load(net, os.path.join(folder, "ms-adam"),
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        report["refused"] = "loaded"
    except Exception as exc:  # noqa: BLE001 -- the message is what the test checks
        report["refused"] = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as f:
        json.dump(report, f)


def main(mode: str, folder: str, out: str, seed: str) -> None:
    get_platform().init_process_group()
    if mode == "optim":
        optim(folder, out, int(seed))
        return
    net = _net(int(seed))
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
