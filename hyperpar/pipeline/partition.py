"""Partitioners: split a list of layers into contiguous stages.

Every partitioner returns *boundaries*: a list ``parts`` of ``n_parts + 1`` increasing indices
with ``parts[0] == 0`` and ``parts[-1] == n_layers``; stage ``s`` holds layers
``parts[s]:parts[s + 1]``. Every stage gets at least one layer. All functions are pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from .spec import LayerSpec, trainable_count


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
    """Boundaries of ``n_parts`` non-empty contiguous parts whose total weights are as even as
    possible, by DeepSpeed's rule (so a layer list splits as it does under DeepSpeed): minimise
    the spread ``max(part) - min(part)``; among equal spreads the later cut wins.

    Dynamic programme over (layers so far, parts so far), O(n^2 * n_parts)."""
    n = len(weights)
    _check_counts(n, n_parts)
    w = [int(x) for x in weights]
    if any(x < 0 for x in w):
        raise ValueError(f"partition weights must be non-negative, got {list(weights)}")
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    # best[j][i] = (spread, heaviest, lightest, cut) for the first i layers in j parts
    best: list[list[tuple[int, int, int, int] | None]] = [[None] * (n + 1)
                                                          for _ in range(n_parts + 1)]
    best[0][0] = (0, 0, -1, 0)   # lightest -1: no part yet
    for j in range(1, n_parts + 1):
        for i in range(j, n - (n_parts - j) + 1):
            choice = None
            for k in range(j - 1, i):
                prev = best[j - 1][k]
                if prev is None:
                    continue
                part = prefix[i] - prefix[k]
                hi = max(prev[1], part)
                lo = part if prev[2] < 0 else min(prev[2], part)
                if choice is None or hi - lo <= choice[0]:
                    choice = (hi - lo, hi, lo, k)
            best[j][i] = choice
    parts = [n]
    for j in range(n_parts, 0, -1):
        entry = best[j][parts[-1]]
        assert entry is not None
        parts.append(entry[3])
    return parts[::-1]


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
    if hasattr(layer, "forward") or hasattr(layer, "construct"):   # a Module or Cell instance
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def layer_parameter_count(layer: Any) -> int:
    """Trainable parameters of a layer; a spec is counted without being built where possible."""
    if isinstance(layer, LayerSpec):
        return layer.count_parameters()
    return trainable_count(layer)


def partition_layers(layers: Sequence[Any], n_parts: int,
                     method: str | Sequence[int] | Callable[..., Any] = "parameters"
                     ) -> list[int]:
    """Boundaries for ``layers`` by ``method``:

    * ``"uniform"`` -- equal layer counts;
    * ``"parameters"`` -- balanced trainable parameter counts; a tied layer counts at every
      position, as in DeepSpeed, so a list splits the same way as there;
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
        counts: dict[int, int] = {}   # the same object listed twice is counted (built) once
        weights = []
        for layer in layers:
            if id(layer) not in counts:
                counts[id(layer)] = layer_parameter_count(layer)
            weights.append(counts[id(layer)])
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
