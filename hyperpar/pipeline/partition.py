"""Partitioners: split a list of layers into contiguous stages.

Every partitioner returns *boundaries*: a list ``parts`` of ``n_parts + 1`` increasing indices
with ``parts[0] == 0`` and ``parts[-1] == n_layers``; stage ``s`` holds layers
``parts[s]:parts[s + 1]``. Every stage gets at least one layer. All functions are pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .spec import LayerSpec


def partition_uniform(n_items: int, n_parts: int) -> list[int]:
    """Boundaries giving each part ``n_items // n_parts`` items, the first ``n_items % n_parts``
    parts one more."""
    _check_counts(n_items, n_parts)
    base, extra = divmod(n_items, n_parts)
    parts = [0]
    for i in range(n_parts):
        parts.append(parts[-1] + base + (1 if i < extra else 0))
    return parts


def partition_balanced(weights: Sequence[int], n_parts: int) -> list[int]:
    """Boundaries minimising the heaviest part's total weight (non-negative integer weights),
    each part non-empty. Among optimal splits, earlier parts are filled first."""
    n = len(weights)
    _check_counts(n, n_parts)
    w = [int(x) for x in weights]
    if any(x < 0 for x in w):
        raise ValueError(f"partition weights must be non-negative, got {list(weights)}")

    def cut(limit: int) -> list[int] | None:
        parts, total = [0], 0
        for i, x in enumerate(w):
            remaining_parts = n_parts - len(parts)          # parts still to open after this one
            must_cut = n - i == remaining_parts            # one layer left per remaining part
            if (total + x > limit or must_cut) and i > parts[-1]:
                if len(parts) == n_parts:
                    return None
                parts.append(i)
                total = 0
            total += x
            if total > limit:
                return None
        parts.append(n)
        return parts if len(parts) == n_parts + 1 else None

    lo, hi = max(w, default=0), sum(w)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    parts = cut(lo)
    assert parts is not None
    return parts


def _check_counts(n_items: int, n_parts: int) -> None:
    if n_parts < 1:
        raise ValueError(f"the number of stages must be >= 1, got {n_parts}")
    if n_items < n_parts:
        raise ValueError(
            f"cannot split {n_items} layers into {n_parts} stages: every stage needs at least one "
            f"layer. Use at most {n_items} stages, or give the pipeline more (smaller) layers."
        )


def layer_name(layer: Any) -> str:
    """The class name a ``type:`` regex is matched against."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def layer_parameter_count(layer: Any) -> int:
    """Trainable parameters of a layer; a spec is counted without being built where possible."""
    if isinstance(layer, LayerSpec):
        return layer.count_parameters()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def partition_layers(layers: Sequence[Any], n_parts: int,
                     method: str | Sequence[int] | Callable[..., Any] = "parameters"
                     ) -> list[int]:
    """Boundaries for ``layers`` by ``method``:

    * ``"uniform"`` -- equal layer counts;
    * ``"parameters"`` -- balanced trainable parameter counts (tied layers count once);
    * ``"type:REGEX"`` -- balanced count of layers whose class name matches ``REGEX``
      (``re.search``, case-insensitive);
    * a list of ``n_parts + 1`` boundaries, used as given after validation.
    """
    n = len(layers)
    if not isinstance(method, str):
        return _check_explicit(list(method), n, n_parts)
    key = method.lower()
    if key == "uniform":
        return partition_uniform(n, n_parts)
    if key == "parameters":
        _check_counts(n, n_parts)
        seen: set[str] = set()
        weights = []
        for layer in layers:
            tied_key = getattr(layer, "key", None)
            if tied_key is not None and tied_key in seen:
                weights.append(0)
                continue
            if tied_key is not None:
                seen.add(tied_key)
            weights.append(layer_parameter_count(layer))
        return partition_balanced(weights, n_parts)
    if key.startswith("type:"):
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise ValueError(f"partition_method {method!r}: invalid regex: {err}") from None
        names = [layer_name(layer) for layer in layers]
        weights = [1 if regex.search(name) else 0 for name in names]
        matched = sum(weights)
        if matched == 0:
            raise ValueError(
                f"partition_method {method!r} matched no layer; layer class names are "
                f"{sorted(set(names))}"
            )
        if matched < n_parts:
            raise ValueError(
                f"partition_method {method!r} matched {matched} layers "
                f"({[n for n, w in zip(names, weights, strict=True) if w]}) but {n_parts} "
                f"stages need at least one each"
            )
        return partition_balanced(weights, n_parts)
    raise ValueError(
        f"unknown partition_method {method!r}; accepted: 'uniform', 'parameters', "
        f"'type:REGEX' or a list of {n_parts + 1} boundaries like "
        f"{partition_uniform(max(n, n_parts), n_parts) if n_parts >= 1 else [0, n]}"
    )


def _check_explicit(parts: list[int], n: int, n_parts: int) -> list[int]:
    ok = (len(parts) == n_parts + 1 and all(isinstance(b, int) for b in parts)
          and parts[0] == 0 and parts[-1] == n
          and all(a < b for a, b in zip(parts, parts[1:], strict=False)))
    if not ok:
        raise ValueError(
            f"explicit partition {parts} is invalid for {n} layers and {n_parts} stages: give "
            f"{n_parts + 1} strictly increasing boundaries from 0 to {n}, e.g. "
            f"{partition_uniform(n, n_parts) if n >= n_parts >= 1 else '[0, ..., n]'}"
        )
    return parts
