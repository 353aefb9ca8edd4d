"""The model of the checkpoint tests, framework-free: shapes, weights by PyTorch's parameter
names (numpy seed), the fixed batch. ``_torch_side.py`` (torch venv) and ``test_checkpoint.py``
(MindSpore venv) both build LayerNorm(8) -> Linear(8, 7) -> ReLU -> Linear(7, 8) from it."""

from __future__ import annotations

import numpy as np

D, H = 8, 7
SHAPES = {"fc1.bias": (H,), "fc1.weight": (H, D), "fc2.bias": (D,), "fc2.weight": (D, H),
          "norm.bias": (D,), "norm.weight": (D,)}


def weights(seed: int) -> dict[str, np.ndarray]:
    """float32 weights by torch's names (the norm's scale near 1)."""
    rng = np.random.default_rng(seed)
    out = {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in SHAPES.items()}
    out["norm.weight"] += np.float32(1.0)
    return out


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((4, D)).astype(np.float32),
            rng.standard_normal((4, D)).astype(np.float32))


def train_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of training step ``step`` (0, 1, 2, ...) of the optimizer tests."""
    rng = np.random.default_rng(100 + step)
    return (rng.standard_normal((4, D)).astype(np.float32),
            rng.standard_normal((4, D)).astype(np.float32))
