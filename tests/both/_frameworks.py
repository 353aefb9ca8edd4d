"""What really differs between torch and MindSpore, and nothing else.

The test bodies in ``tests/both`` are written once against hyperpar's public names; they call
this adapter only for: tensors from numpy and back, the names of matmul / softmax / relu /
cross-entropy / nll-loss / log-softmax / embedding lookup / layer and group norm, how
gradients are taken (torch: ``requires_grad`` + ``torch.autograd.grad``; MindSpore:
``ms.value_and_grad``, which returns DTensor gradients for DTensor inputs once hyperpar is
imported, since MindSpore has no ``.backward()``), how Linear / LayerNorm / Embedding modules
and a container module are built with given weights, reading a parameter back, and an SGD step.

Nothing here imports a framework at module level: collecting ``tests/both`` in the torch venv
must not import mindspore (and the MindSpore venv has no torch).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: framework -> the hyperpar backend its ranks run (torch: the CPU/gloo backend)
BACKENDS = {"torch": "cpu", "mindspore": "mindspore"}


def available(name: str) -> bool:
    """Whether ``name``'s framework is importable here (``find_spec``: imports nothing)."""
    return importlib.util.find_spec(name) is not None


class Framework:
    """The per-framework operations a test body needs; see the module docstring."""

    name = ""

    # tensors ------------------------------------------------------------------------------
    def tensor(self, a: np.ndarray) -> Any:
        raise NotImplementedError

    def index(self, a: np.ndarray) -> Any:
        """Integer ids / class labels (torch: int64, MindSpore's kernels: int32)."""
        raise NotImplementedError

    def numpy(self, t: Any) -> np.ndarray:
        """A plain tensor (a DTensor's ``full_tensor()``, a shard, a parameter) as numpy."""
        raise NotImplementedError

    # ops whose names differ ----------------------------------------------------------------
    def matmul(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def softmax(self, x: Any, dim: int) -> Any:
        raise NotImplementedError

    def relu(self, x: Any) -> Any:
        raise NotImplementedError

    def broadcast_to(self, x: Any, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def cross_entropy(self, logits: Any, target: Any, weight: Any = None,
                      ignore_index: int = -100, reduction: str = "mean", **options: Any) -> Any:
        """The framework's cross-entropy (``options``: label_smoothing, ...)."""
        raise NotImplementedError

    def var(self, x: Any, dim: int, correction: int, keepdim: bool = False) -> Any:
        raise NotImplementedError

    def std(self, x: Any, dim: int, correction: int, keepdim: bool = False) -> Any:
        raise NotImplementedError

    def var_mean(self, x: Any, dim: Any, correction: int, keepdim: bool = False) -> Any:
        """(variance, mean) over ``dim`` (an int, or ``()``: every dim)."""
        raise NotImplementedError

    def std_mean(self, x: Any, dim: Any, correction: int, keepdim: bool = False) -> Any:
        raise NotImplementedError

    def argmax(self, x: Any, dim: int, keepdim: bool) -> Any:
        raise NotImplementedError

    def nll_loss(self, logp: Any, target: Any, ignore_index: int = -100) -> Any:
        raise NotImplementedError

    def log_softmax(self, x: Any, dim: int) -> Any:
        raise NotImplementedError

    def lookup(self, ids: Any, table: Any) -> Any:
        """An embedding lookup ``table[ids]`` (torch: ``F.embedding``; MindSpore: ``ops.gather``,
        what ``nn.Embedding`` runs -- mint's ``Embedding`` has no CPU kernel in 2.10)."""
        raise NotImplementedError

    def layer_norm_op(self, x: Any, ndims: int, weight: Any, bias: Any) -> Any:
        """Layer norm over the last ``ndims`` dims, eps 1e-5 (MindSpore: the legacy primitive
        ``ops.LayerNorm``; ``LayerNormExt`` has no CPU kernel in 2.10)."""
        raise NotImplementedError

    def group_norm(self, x: Any, groups: int, weight: Any, bias: Any) -> Any:
        raise NotImplementedError

    # gradients ----------------------------------------------------------------------------
    def value_and_grad(self, fn: Callable[..., Any], inputs: Sequence[Any]
                       ) -> tuple[Any, list[Any]]:
        """``fn(*inputs)`` (a scalar plain tensor) and its gradient for every input; a DTensor
        input's gradient is a DTensor."""
        raise NotImplementedError

    # modules ------------------------------------------------------------------------------
    def linear(self, weight: np.ndarray, bias: np.ndarray | None) -> Any:
        """A Linear (torch) / Dense (MindSpore) layer with ``weight`` as (out, in)."""
        raise NotImplementedError

    def layer_norm(self, weight: np.ndarray, bias: np.ndarray) -> Any:
        raise NotImplementedError

    def embedding(self, table: np.ndarray) -> Any:
        raise NotImplementedError

    def container(self, forward: Callable[..., Any], **children: Any) -> Any:
        """A module holding ``children`` as attributes whose forward is ``forward(self, *x)``."""
        raise NotImplementedError

    def experts(self, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray) -> Any:
        """Grouped experts (torchtitan's ``GroupedExperts``): parameters ``w1``/``w3``
        ``(E, hidden, dim)`` and ``w2`` ``(E, dim, hidden)``, called as ``experts(x,
        num_tokens_per_expert)`` with ``x``'s rows sorted by expert; expert ``e`` computes
        ``(relu(x w1[e]^T) * (x w3[e]^T)) w2[e]^T`` on its rows (a loop over experts)."""
        raise NotImplementedError

    def weight(self, module: Any) -> Any:
        """The weight parameter of a Linear / LayerNorm / Embedding (a shard on MindSpore, a
        DTensor on torch once parallelized)."""
        raise NotImplementedError

    def bias(self, module: Any) -> Any:
        raise NotImplementedError

    def full_param(self, param: Any, mesh: Any, placement: Any, shape: tuple[int, ...]
                   ) -> np.ndarray:
        """The whole of a parallelized module's parameter laid out as ``placement``, read back
        as torch users do: ``param.full_tensor()`` (on MindSpore the parameter stays this
        rank's piece, a ``Parameter``, with that method bound on it)."""
        from hyperpar.platform import get_platform

        got = get_platform().parameter_placements(param)
        assert got == (placement,), (got, placement)
        full = self.numpy(param.full_tensor())
        assert full.shape == shape, (full.shape, shape)
        return full

    def sgd(self, model: Any, lr: float) -> Callable[[Callable[[], Any]], float]:
        """A training step: ``step(loss_fn)`` takes the gradient of ``loss_fn()`` (a scalar)
        over ``model``'s parameters, applies SGD and returns the loss."""
        raise NotImplementedError


class Torch(Framework):
    name = "torch"

    def __init__(self) -> None:
        import torch
        import torch.nn.functional as F

        self.torch, self.F = torch, F

    def tensor(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(a))

    def index(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(a.astype(np.int64))

    def numpy(self, t: Any) -> np.ndarray:
        return t.detach().cpu().numpy()

    def matmul(self, a: Any, b: Any) -> Any:
        return self.torch.matmul(a, b)

    def softmax(self, x: Any, dim: int) -> Any:
        return self.torch.softmax(x, dim)

    def relu(self, x: Any) -> Any:
        return self.torch.relu(x)

    def broadcast_to(self, x: Any, shape: tuple[int, ...]) -> Any:
        return self.torch.broadcast_to(x, shape)

    def cross_entropy(self, logits: Any, target: Any, weight: Any = None,
                      ignore_index: int = -100, reduction: str = "mean", **options: Any) -> Any:
        return self.F.cross_entropy(logits, target, weight, ignore_index=ignore_index,
                                    reduction=reduction, **options)

    def var(self, x: Any, dim: int, correction: int, keepdim: bool = False) -> Any:
        return x.var(dim, correction=correction, keepdim=keepdim)

    def std(self, x: Any, dim: int, correction: int, keepdim: bool = False) -> Any:
        return x.std(dim, correction=correction, keepdim=keepdim)

    # every dim as None: torch 2.13's var/std(_mean) over dim=() reduce every dim but their
    # backward reads () as no dim (an infinite gradient), on plain tensors too
    def var_mean(self, x: Any, dim: Any, correction: int, keepdim: bool = False) -> Any:
        return self.torch.var_mean(x, dim if dim != () else None, correction=correction,
                                   keepdim=keepdim)

    def std_mean(self, x: Any, dim: Any, correction: int, keepdim: bool = False) -> Any:
        return self.torch.std_mean(x, dim if dim != () else None, correction=correction,
                                   keepdim=keepdim)

    def argmax(self, x: Any, dim: int, keepdim: bool) -> Any:
        return x.argmax(dim, keepdim=keepdim)

    def nll_loss(self, logp: Any, target: Any, ignore_index: int = -100) -> Any:
        return self.F.nll_loss(logp, target, ignore_index=ignore_index)

    def log_softmax(self, x: Any, dim: int) -> Any:
        return self.F.log_softmax(x, dim)

    def lookup(self, ids: Any, table: Any) -> Any:
        return self.F.embedding(ids, table)

    def layer_norm_op(self, x: Any, ndims: int, weight: Any, bias: Any) -> Any:
        return self.F.layer_norm(x, tuple(x.shape[-ndims:]), weight, bias, 1e-5)

    def group_norm(self, x: Any, groups: int, weight: Any, bias: Any) -> Any:
        return self.F.group_norm(x, groups, weight, bias, 1e-5)

    def value_and_grad(self, fn: Callable[..., Any], inputs: Sequence[Any]
                       ) -> tuple[Any, list[Any]]:
        leaves = [t.detach().requires_grad_() for t in inputs]
        value = fn(*leaves)
        return value.detach(), list(self.torch.autograd.grad(value, leaves))

    def linear(self, weight: np.ndarray, bias: np.ndarray | None) -> Any:
        layer = self.torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with self.torch.no_grad():
            layer.weight.copy_(self.tensor(weight))
            if bias is not None:
                layer.bias.copy_(self.tensor(bias))
        return layer

    def layer_norm(self, weight: np.ndarray, bias: np.ndarray) -> Any:
        norm = self.torch.nn.LayerNorm(weight.shape[0])
        with self.torch.no_grad():
            norm.weight.copy_(self.tensor(weight))
            norm.bias.copy_(self.tensor(bias))
        return norm

    def embedding(self, table: np.ndarray) -> Any:
        emb = self.torch.nn.Embedding(*table.shape)
        with self.torch.no_grad():
            emb.weight.copy_(self.tensor(table))
        return emb

    def container(self, forward: Callable[..., Any], **children: Any) -> Any:
        nn = self.torch.nn

        class Container(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                for key, child in children.items():
                    setattr(self, key, child)

            def forward(self, *args: Any) -> Any:
                return forward(self, *args)

        return Container()

    def experts(self, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray) -> Any:
        torch = self.torch

        class GroupedExperts(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                for name, a in (("w1", w1), ("w2", w2), ("w3", w3)):
                    setattr(self, name, torch.nn.Parameter(torch.from_numpy(a.copy())))

            def forward(self, x: Any, counts: Any) -> Any:
                outs, start = [], 0
                for e, c in enumerate(counts.tolist()):
                    # no rows at all: expert 0 on the empty input, so the output still depends
                    # on the weights (every rank then joins the backward all-to-all)
                    if c or (e == 0 and not x.shape[0]):
                        xe = x[start:start + c]
                        h = torch.relu(xe @ self.w1[e].t()) * (xe @ self.w3[e].t())
                        outs.append(h @ self.w2[e].t())
                    start += c
                return torch.cat(outs)

        return GroupedExperts()

    def weight(self, module: Any) -> Any:
        return module.weight

    def bias(self, module: Any) -> Any:
        return module.bias

    def sgd(self, model: Any, lr: float) -> Callable[[Callable[[], Any]], float]:
        opt = self.torch.optim.SGD(model.parameters(), lr=lr)

        def step(loss_fn: Callable[[], Any]) -> float:
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            opt.step()
            return float(loss.detach())

        return step


class MindSpore(Framework):
    name = "mindspore"

    def __init__(self) -> None:
        import mindspore as ms
        from mindspore import mint, nn, ops

        self.ms, self.mint, self.nn, self.ops = ms, mint, nn, ops

    def tensor(self, a: np.ndarray) -> Any:
        return self.ms.Tensor(np.ascontiguousarray(a))

    def index(self, a: np.ndarray) -> Any:
        return self.ms.Tensor(a.astype(np.int32))

    def numpy(self, t: Any) -> np.ndarray:
        return t.asnumpy()

    def matmul(self, a: Any, b: Any) -> Any:
        return self.mint.matmul(a, b)

    def softmax(self, x: Any, dim: int) -> Any:
        return self.ops.softmax(x, dim)

    def relu(self, x: Any) -> Any:
        return self.ops.relu(x)

    def broadcast_to(self, x: Any, shape: tuple[int, ...]) -> Any:
        return self.mint.broadcast_to(x, shape)

    def cross_entropy(self, logits: Any, target: Any, weight: Any = None,
                      ignore_index: int = -100, reduction: str = "mean", **options: Any) -> Any:
        return self.ops.cross_entropy(logits, target, weight, ignore_index, reduction,
                                      **options)

    def var(self, x: Any, dim: int, correction: int, keepdim: bool = False) -> Any:
        return x.var(dim, ddof=correction, keepdims=keepdim)      # DeprecatedVar

    def std(self, x: Any, dim: int, correction: int, keepdim: bool = False) -> Any:
        return x.std(dim, ddof=correction, keepdims=keepdim)      # DeprecatedStd

    def var_mean(self, x: Any, dim: Any, correction: int, keepdim: bool = False) -> Any:
        return self.ops.var_mean(x, dim, correction, keepdim)     # ReduceStd, then Square

    def std_mean(self, x: Any, dim: Any, correction: int, keepdim: bool = False) -> Any:
        return self.ops.std_mean(x, dim, correction, keepdim)     # ReduceStd

    def argmax(self, x: Any, dim: int, keepdim: bool) -> Any:
        return x.argmax(dim, keepdims=keepdim)                    # DeprecatedArgmax

    def nll_loss(self, logp: Any, target: Any, ignore_index: int = -100) -> Any:
        return self.ops.nll_loss(logp, target, ignore_index=ignore_index)

    def log_softmax(self, x: Any, dim: int) -> Any:
        return self.ops.log_softmax(x, dim)

    def lookup(self, ids: Any, table: Any) -> Any:
        return self.ops.gather(table, ids, 0)

    def layer_norm_op(self, x: Any, ndims: int, weight: Any, bias: Any) -> Any:
        begin = len(x.shape) - ndims  # the primitive takes only -1 as a negative axis
        return self.ops.LayerNorm(begin, begin, 1e-5)(x, weight, bias)[0]

    def group_norm(self, x: Any, groups: int, weight: Any, bias: Any) -> Any:
        return self.mint.nn.functional.group_norm(x, groups, weight, bias, 1e-5)

    def value_and_grad(self, fn: Callable[..., Any], inputs: Sequence[Any]
                       ) -> tuple[Any, list[Any]]:
        # MindSpore has no .backward(): gradients are a function transform. The user's own
        # ms.value_and_grad gives DTensor gradients for DTensor inputs (hyperpar wraps
        # MindSpore's PyNative gradient function); plain inputs (the one-process reference)
        # get MindSpore's result unchanged.
        value, grads = self.ms.value_and_grad(fn, tuple(range(len(inputs))))(*inputs)
        return value, list(grads) if isinstance(grads, (tuple, list)) else [grads]

    def _set(self, param: Any, a: np.ndarray) -> None:
        param.set_data(self.tensor(a.astype(np.float32)))

    def linear(self, weight: np.ndarray, bias: np.ndarray | None) -> Any:
        layer = self.nn.Dense(weight.shape[1], weight.shape[0], has_bias=bias is not None)
        self._set(layer.weight, weight)
        if bias is not None:
            self._set(layer.bias, bias)
        return layer

    def layer_norm(self, weight: np.ndarray, bias: np.ndarray) -> Any:
        norm = self.nn.LayerNorm((weight.shape[0],))
        self._set(norm.gamma, weight)
        self._set(norm.beta, bias)
        return norm

    def embedding(self, table: np.ndarray) -> Any:
        emb = self.nn.Embedding(*table.shape)
        self._set(emb.embedding_table, table)
        return emb

    def container(self, forward: Callable[..., Any], **children: Any) -> Any:
        nn = self.nn

        class Container(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                for key, child in children.items():
                    setattr(self, key, child)

            def construct(self, *args: Any) -> Any:
                return forward(self, *args)

        return Container()

    def experts(self, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray) -> Any:
        ms, mint = self.ms, self.mint

        class GroupedExperts(self.nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                for name, a in (("w1", w1), ("w2", w2), ("w3", w3)):
                    setattr(self, name, ms.Parameter(ms.Tensor(a.copy()), name=name))

            def construct(self, x: Any, counts: Any) -> Any:
                outs, start = [], 0
                for e, c in enumerate(counts.asnumpy().tolist()):
                    if c or (e == 0 and not x.shape[0]):  # see the torch twin
                        xe = mint.narrow(x, 0, start, c)
                        h = mint.nn.functional.relu(mint.matmul(xe, self.w1[e].T)) * \
                            mint.matmul(xe, self.w3[e].T)
                        outs.append(mint.matmul(h, self.w2[e].T))
                    start += c
                return mint.cat(outs) if len(outs) > 1 else outs[0]

        return GroupedExperts()

    def weight(self, module: Any) -> Any:
        if isinstance(module, self.nn.LayerNorm):
            return module.gamma
        if isinstance(module, self.nn.Embedding):
            return module.embedding_table
        return module.weight

    def bias(self, module: Any) -> Any:
        return module.beta if isinstance(module, self.nn.LayerNorm) else module.bias

    def sgd(self, model: Any, lr: float) -> Callable[[Callable[[], Any]], float]:
        opt = self.nn.SGD(model.trainable_params(), learning_rate=lr)

        def step(loss_fn: Callable[[], Any]) -> float:
            # Gradients over the optimizer's parameters (the shards on a parallelized Cell).
            loss, grads = self.ms.value_and_grad(loss_fn, None, opt.parameters)()
            opt(grads)
            return float(loss.asnumpy())

        return step


def get(name: str) -> Framework:
    """The adapter for ``name`` ("torch" or "mindspore"), importing that framework now."""
    return {"torch": Torch, "mindspore": MindSpore}[name]()
