"""The PyTorch half of the cross-framework checkpoint tests, run once per test session by the
torch venv's ``hyperpar run -n 1`` (the MindSpore venv has no torch; starting torch costs ~10 s
on a loaded 2-core box, so every torch step of the tests happens in this one process). The
model is the MindSpore test's Cell written in torch (:mod:`tests.mindspore._ckpt_model`).

    _torch_side.py <folder> <out.json>

after the MindSpore side wrote ``<folder>/ms`` (a Cell of weights(9) on 2 tp ranks) and
``<folder>/ms-<kind>`` (each optimizer pair trained 2 steps), writes to ``out.json``:

* ``save``: weights(0), saved to ``<folder>/torch``; ``load``: a model of weights(3) loads
  ``<folder>/ms`` -- each the loss on the fixed batch and every parameter's float32 bytes (hex);
* ``optim``: for each optimizer of :data:`OPTIMIZERS`, weights(0) trained 2 steps and saved
  with the optimizer to ``<folder>/torch-<kind>``, then a 3rd step (``torch-<kind>``: what
  MindSpore's resumed step must reach); a model of weights(3) loads ``<folder>/ms-<kind>``
  and takes that 3rd step (``from-ms-<kind>``); AdamW is saved only (MindSpore refuses it);
  ``refused``: torch's refusal of a MindSpore Adam's state into an SGD.
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


def optim(folder: str, seed: int) -> dict:
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
    return report


def _report(net: Net) -> dict:
    x, y = (torch.from_numpy(a) for a in batch())
    with torch.no_grad():
        loss = float(((net(x) - y) ** 2).mean())
    return {"loss": loss, "params": _hex(net)}


def main(folder: str, out: str) -> None:
    get_platform().init_process_group()
    net = _net(0)
    checkpoint.save(net, os.path.join(folder, "torch"), file_format="safetensors")
    report = {"save": _report(net)}
    net = _net(3)
    checkpoint.load(net, os.path.join(folder, "ms"))
    report["load"] = _report(net)
    report["optim"] = optim(folder, 0)
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
