"""Tensor-parallel MLP on MindSpore Cells with a torch-style plan.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 examples/mindspore_tp_mlp.py
    HYPERPAR_BACKEND=mindspore python examples/mindspore_tp_mlp.py       # a world of one
    msrun --worker_num=2 --local_worker_num=2 examples/mindspore_tp_mlp.py --jit

Every rank builds the same MLP, shards fc1 column-wise and fc2 row-wise, and trains it with
``ms.value_and_grad`` and ``nn.SGD`` on its shards; with ``--jit`` the whole step (forward,
backward, update) is compiled with ``ms.jit``. Rank 0 also trains an unsharded copy in its own
process (PyNative) and prints the largest difference of the losses (float32 rounding, ~1e-7).
"""

from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn

# The import line torch users write: with HYPERPAR_BACKEND=mindspore these are the Cell versions.
from hyperpar import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module


class MLP(nn.Cell):
    """A plain MindSpore model: no parallel code in it."""

    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Dense(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Dense(hidden, dim)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build(seed: int = 0) -> MLP:
    model = MLP()
    rng = np.random.default_rng(seed)
    for _, param in sorted(model.parameters_and_names()):
        param.set_data(ms.Tensor((rng.standard_normal(param.shape) * 0.1).astype(np.float32)))
    return model


def train(model: nn.Cell, x: ms.Tensor, y: ms.Tensor, steps: int = 5,
          jit: bool = False) -> list[float]:
    opt = nn.SGD(model.trainable_params(), learning_rate=0.05)

    def loss_fn(a, b):  # a named function: a graph cannot compile a lambda
        return ((model(a) - b) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

    def step(a, b):
        loss, grads = grad_fn(a, b)
        opt(grads)
        return loss

    if jit:
        step = ms.jit(step)  # the same step, compiled: forward, backward and the update
    return [float(step(x, y).asnumpy()) for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jit", action="store_true", help="compile the training step (ms.jit)")
    args = parser.parse_args()
    mesh = init_device_mesh((_world_size(),), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    rng = np.random.default_rng(1)
    x = ms.Tensor(rng.standard_normal((8, 32)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((8, 32)).astype(np.float32))

    model = parallelize_module(build(), mesh, {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})
    losses = train(model, x, y, jit=args.jit)
    if rank == 0:
        reference = train(build(), x, y)
        print(f"fc1.weight on rank 0: {tuple(model.fc1.weight.shape)} of (128, 32)")
        print(f"mode: {'ms.jit' if args.jit else 'PyNative'}")
        print("losses:", " ".join(f"{v:.6f}" for v in losses))
        print(f"largest loss difference vs one process: "
              f"{max(abs(a - b) for a, b in zip(losses, reference, strict=True)):.2e}")


def _world_size() -> int:
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    return platform.world_size()


if __name__ == "__main__":
    main()
