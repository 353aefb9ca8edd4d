"""What the MindSpore parity tests do the same way to a parallel Cell and its one-process
reference: seed the weights, train with SGD, read the parameters back."""
from __future__ import annotations

from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import nn


def set_weights(model: nn.Cell, seed: int = 0) -> None:
    """Every parameter from a normal(0, 0.5) stream, in sorted name order."""
    rng = np.random.default_rng(seed)
    for _name, param in sorted(model.parameters_and_names()):
        param.set_data(ms.Tensor((rng.standard_normal(param.shape) * 0.5).astype(np.float32)))


def mean_squared_error(out: ms.Tensor, target: ms.Tensor) -> ms.Tensor:
    return ((out - target) ** 2).mean()


def train_sgd(model: nn.Cell, x: ms.Tensor, y: ms.Tensor, steps: int, lr: float,
              criterion: Callable[[ms.Tensor, ms.Tensor], ms.Tensor] = mean_squared_error,
              ) -> tuple[list[float], np.ndarray]:
    """``steps`` SGD steps on ``criterion(model(x), y)``; the losses and the final output."""
    opt = nn.SGD(model.trainable_params(), learning_rate=lr)

    def loss_fn(inp, target):
        return criterion(model(inp), target)

    step = ms.value_and_grad(loss_fn, None, opt.parameters)
    losses = []
    for _ in range(steps):
        loss, grads = step(x, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, model(x).asnumpy()


def param_arrays(model: nn.Cell) -> dict[str, np.ndarray]:
    return {name: p.asnumpy() for name, p in model.parameters_and_names()}
