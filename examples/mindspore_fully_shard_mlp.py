"""fully_shard (FSDP2 semantics) on MindSpore Cells, the torch user's calls.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 examples/mindspore_fully_shard_mlp.py
    msrun --worker_num=2 --local_worker_num=2 examples/mindspore_fully_shard_mlp.py --jit

Every rank builds the same MLP, shards each layer and then the root with ``fully_shard``
(each rank keeps 1/N of every parameter), and trains on its own rows of the batch with
``ms.value_and_grad`` and ``nn.SGD`` over the shards: gradients come back averaged over the
data-parallel ranks, as torch's FSDP2 does. With ``--jit`` the whole step (forward with the
all-gathers, backward with the reduce-scatters, the update) is compiled with ``ms.jit``.
Rank 0 also trains an unsharded copy on the whole batch in its own process and prints the
largest parameter difference after training (float32 rounding, ~1e-7).
"""

from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn

# With HYPERPAR_BACKEND=mindspore these are the Cell versions.
from hyperpar import fully_shard, init_device_mesh

ROWS, DIM, HIDDEN = 8, 16, 64


class MLP(nn.Cell):
    """A plain MindSpore model: no parallel code in it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(DIM, HIDDEN)
        self.act = nn.Tanh()
        self.fc2 = nn.Dense(HIDDEN, DIM)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build(seed: int = 0) -> MLP:
    model = MLP()
    rng = np.random.default_rng(seed)
    for _, param in sorted(model.parameters_and_names()):
        param.set_data(ms.Tensor((rng.standard_normal(param.shape) * 0.1).astype(np.float32)))
    return model


def train(model: nn.Cell, x: ms.Tensor, y: ms.Tensor, steps: int = 4,
          jit: bool = False) -> list[float]:
    opt = nn.SGD(model.trainable_params(), learning_rate=0.1)

    def loss_fn(a, b):  # a named function: a graph cannot compile a lambda
        return ((model(a) - b) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

    def step(a, b):
        loss, grads = grad_fn(a, b)
        opt(grads)
        return loss

    if jit:
        step = ms.jit(step)
    return [float(step(x, y).asnumpy()) for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jit", action="store_true", help="compile the training step (ms.jit)")
    args = parser.parse_args()
    world = _world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    y = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    mine = slice(rank * ROWS // world, (rank + 1) * ROWS // world)  # this rank's rows

    model = build()
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, ms.Tensor(x[mine]), ms.Tensor(y[mine]), jit=args.jit)
    trained = {k: v.asnumpy() for k, v in model.full_parameters().items()}  # collective
    if rank == 0:
        reference = build()
        train(reference, ms.Tensor(x), ms.Tensor(y))
        want = {k: v.asnumpy() for k, v in reference.parameters_and_names()}
        print(f"fc1.weight on rank 0: {tuple(model.fc1.weight.shape)} of ({HIDDEN}, {DIM})")
        print(f"mode: {'ms.jit' if args.jit else 'PyNative'}")
        print(f"largest parameter difference vs one process: "
              f"{max(float(np.abs(trained[k] - want[k]).max()) for k in want):.2e}")


def _world_size() -> int:
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    return platform.world_size()


if __name__ == "__main__":
    main()
