"""The small training setup the data-parallel test bodies share (tests/both): an MLP built
from fixed numpy weights, and one optimizer step written once for torch and MindSpore.

How gradients are averaged over data-parallel ranks is the one real difference:
torch averages during ``.backward()`` (``data_parallel``, ``fully_shard``); MindSpore's
``value_and_grad`` returns a tuple that ``model.reduce_gradients(grads)`` averages under
``data_parallel``, while ``fully_shard``'s gradients come back averaged already
(docs/mindspore.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tests.both._frameworks import Framework

STEPS = 3
LR = {"sgd": 0.1, "adam": 0.01}
D, H, PER_RANK = 8, 7, 3  # hidden 7: split unevenly over 2 and 4 ranks


def weights() -> dict[str, np.ndarray]:
    """The MLP's weights: normal(0, 0.5), fixed seed."""
    rng = np.random.default_rng(0)
    shapes = {"w1": (H, D), "b1": (H,), "w2": (D, H), "b2": (D,)}
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def mlp(fw: Framework, w: dict[str, np.ndarray]) -> Any:
    """``fc2(relu(fc1(x)))`` with the weights ``w``."""
    return fw.container(lambda m, x: m.fc2(fw.relu(m.fc1(x))),
                        fc1=fw.linear(w["w1"], w["b1"]), fc2=fw.linear(w["w2"], w["b2"]))


def data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets for ``rows`` rows, normal(0, 1), fixed seed."""
    rng = np.random.default_rng(1)
    return (rng.standard_normal((rows, D)).astype(np.float32),
            rng.standard_normal((rows, D)).astype(np.float32))


def trainer(fw: Framework, model: Any, opt: str, reduce_gradients: bool = False
            ) -> tuple[Callable[[Any, Any], float], Any]:
    """``(step, optimizer)``: ``step(x, y)`` takes one optimizer step on the mean squared error
    and returns the loss. ``reduce_gradients``: MindSpore's ``data_parallel`` averages the
    gradient tuple by ``model.reduce_gradients`` (torch averages in backward)."""
    lr = LR[opt]
    if fw.name == "torch":
        torch = fw.torch
        params = list(model.parameters())
        optim = (torch.optim.SGD(params, lr=lr) if opt == "sgd"
                 else torch.optim.Adam(params, lr=lr))

        def torch_step(x: Any, y: Any) -> float:
            optim.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optim.step()
            return float(loss.detach())

        return torch_step, optim
    ms, nn = fw.ms, fw.nn
    optim = (nn.SGD(model.trainable_params(), learning_rate=lr) if opt == "sgd"
             else nn.Adam(model.trainable_params(), learning_rate=lr))

    def loss_fn(x: Any, y: Any) -> Any:
        return ((model(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, optim.parameters)

    def ms_step(x: Any, y: Any) -> float:
        loss, grads = grad_fn(x, y)
        optim(model.reduce_gradients(grads) if reduce_gradients else grads)
        return float(loss.asnumpy())

    return ms_step, optim


def full_params(fw: Framework, model: Any, sharded: bool) -> dict[str, np.ndarray]:
    """Every parameter whole, by name, as numpy copies (a CPU tensor's numpy() shares the
    parameter's memory, which later steps change). ``sharded``: a ``fully_shard`` model, read
    back with a collective -- torch: each DTensor parameter's ``full_tensor()``; MindSpore:
    ``model.full_parameters()`` (its Parameters are the shards themselves)."""
    if fw.name == "torch":
        return {name: fw.numpy(p.full_tensor() if sharded else p.detach()).copy()
                for name, p in model.named_parameters()}
    if sharded:
        return {name: fw.numpy(v).copy() for name, v in model.full_parameters().items()}
    return {p.name: fw.numpy(p).copy() for p in model.trainable_params()}
