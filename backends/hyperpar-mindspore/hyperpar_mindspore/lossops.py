"""``mindspore.ops.cross_entropy`` / ``ops.nll_loss`` on DTensors, decided by the neutral
``cross_entropy`` rule (the same decision as torch's).

MindSpore 2.10 composes these losses in Python from primitives (log-softmax, ``GatherD``,
``MaskedFill``, a weight ``Gather``, sums and a division), so ``DTensor.__fallback__`` sees only
the pieces: a mean over a batch-sharded input came out gathered, and a class weight was refused
(its 1-D ``Gather`` has no rule). :func:`install` wraps the functions once (``ops``,
``ops.function`` and ``nn_func``, where ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` and
``loss_parallel`` look them up): a DTensor input is dispatched as the neutral op
``cross_entropy``. Batch-sharded logits give sharded per-sample losses, a Partial("sum") sum,
and a Partial("sum") mean: the local sum over the global count of non-ignored, class-weighted
targets (:func:`.localops.global_mean`). Plain tensors go to MindSpore's own functions.
``mint.nn.functional.cross_entropy`` has no CPU kernel in 2.10 and is left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hyperpar.dtensor.rules import ShardingError

from .dispatch import MixedTensorError, _run
from .dtensor_core import DTensor, clear_grad_state
from .opnames import Call

_NAMES = ("cross_entropy", "nll_loss")
_installed: dict[str, Callable[..., Any]] = {}


def _homes() -> list[Any]:
    import mindspore.ops.function as function
    import mindspore.ops.function.nn_func as nn_func
    from mindspore import ops

    return [ops, function, nn_func]


def dtensor_loss(original: Callable[..., Any], name: str, input: Any, target: Any,
                 weight: Any = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> Any:
    """MindSpore's ``name`` (``original``) on a DTensor ``input``, laid out by the neutral
    rule. ``target`` must be a DTensor on the same mesh; ``weight`` may be a DTensor (it is
    replicated) or a plain tensor (a constant, the same on every rank)."""
    if not isinstance(target, DTensor):
        raise MixedTensorError(
            f"ops.{name}: the input is a DTensor but the target is a plain "
            f"{type(target).__name__}; make it a DTensor (distribute_tensor) on the same mesh")
    real = [input, target, weight, ignore_index, reduction, label_smoothing]
    tensors = (0, 1, 2) if isinstance(weight, DTensor) else (0, 1)
    call = Call("cross_entropy", tensors,
                {"reduction": reduction, "ignore_index": int(ignore_index)})
    try:
        return _run(original, f"ops.{name}", tuple(real), real, {}, call, False)
    except (ShardingError, MixedTensorError, ValueError, IndexError):
        clear_grad_state()  # an error inside ms.grad must not poison the next gradient call
        raise


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)  # the name, module and docstring of MindSpore's own
    def loss(input: Any, target: Any, weight: Any = None, ignore_index: int = -100,
             reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
        if isinstance(input, DTensor):
            return dtensor_loss(original, name, input, target, weight, ignore_index,
                                reduction, label_smoothing)
        return original(input, target, weight, ignore_index, reduction, label_smoothing)

    return loss


def install() -> None:
    """Route ``cross_entropy`` / ``nll_loss`` on DTensors through the neutral rule (once)."""
    if _installed:
        return
    homes = _homes()
    for name in _NAMES:
        original = getattr(homes[-1], name)
        _installed[name] = original
        wrapped = _wrap(name, original)
        for home in homes:
            setattr(home, name, wrapped)
