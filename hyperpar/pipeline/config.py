"""The DeepSpeed-style configuration dict that :class:`~hyperpar.pipeline.PipelineEngine` reads.

Only keys whose meaning hyperpar implements are accepted; a key that would change the training
math but is not implemented (``"scheduler"``, ZeRO stages, ...) raises rather than being
silently ignored. Logging-only keys are accepted and ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EngineConfig", "build_optimizer"]

_IGNORED = {"steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard",
            "wandb", "csv_monitor", "comms_logger", "flops_profiler", "memory_breakdown"}
_KNOWN = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
          "gradient_clipping", "fp16", "bf16", "optimizer", "pipeline", "zero_optimization",
          "seed"} | _IGNORED
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "min_loss_scale", "consecutive_hysteresis", "auto_cast"}


@dataclass
class EngineConfig:
    """The parsed configuration; sizes follow DeepSpeed's rule
    ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp``."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 0.0
    dtype: torch.dtype = torch.float32
    fp16: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    activation_checkpoint_interval: int = 0

    @classmethod
    def from_any(cls, config: Mapping[str, Any] | str | os.PathLike | None,
                 dp_size: int) -> EngineConfig:
        """Parse a dict or a JSON file path; ``dp_size`` is the number of data-parallel
        replicas of the pipeline."""
        if config is None:
            raise ValueError("PipelineEngine: a config is required, e.g. "
                             "{'train_micro_batch_size_per_gpu': 4, "
                             "'gradient_accumulation_steps': 2}")
        if isinstance(config, str | os.PathLike):
            with open(config) as f:
                config = json.load(f)
        if not isinstance(config, Mapping):
            raise TypeError(f"PipelineEngine: config must be a dict or a JSON file path, got "
                            f"{type(config).__name__}")
        unknown = sorted(set(config) - _KNOWN)
        if unknown:
            raise ValueError(f"PipelineEngine: config keys {unknown} are not supported by "
                             f"hyperpar (supported: {sorted(_KNOWN - _IGNORED)}); remove them "
                             f"or implement them around the engine")
        zero = dict(config.get("zero_optimization") or {})
        if int(zero.get("stage", 0)) != 0:
            raise ValueError("PipelineEngine: zero_optimization stages are not supported (and "
                             "DeepSpeed rejects stages 2 and 3 with pipelines); shard with "
                             "hyperpar.fully_shard inside the stages instead")
        tbs, mbs, gas = _batch_sizes(config, dp_size)
        fp16 = dict(config.get("fp16") or {})
        bf16 = dict(config.get("bf16") or {})
        bad = sorted(set(fp16) - _FP16_KEYS)
        if bad:
            raise ValueError(f"PipelineEngine: fp16 keys {bad} are not supported; known: "
                             f"{sorted(_FP16_KEYS)}")
        if fp16.get("enabled") and bf16.get("enabled"):
            raise ValueError("PipelineEngine: fp16 and bf16 are both enabled; pick one")
        dtype = (torch.float16 if fp16.get("enabled") else
                 torch.bfloat16 if bf16.get("enabled") else torch.float32)
        pipe = dict(config.get("pipeline") or {})
        clip = float(config.get("gradient_clipping", 0.0) or 0.0)
        if clip < 0:
            raise ValueError(f"PipelineEngine: gradient_clipping must be >= 0, got {clip}")
        return cls(tbs, mbs, gas, clip, dtype, fp16 if fp16.get("enabled") else {},
                   config.get("optimizer"), int(pipe.get("activation_checkpoint_interval", 0)))


def _batch_sizes(config: Mapping[str, Any], dp: int) -> tuple[int, int, int]:
    """Fill in the one of (train_batch_size, micro batch, accumulation steps) left out."""
    tbs = config.get("train_batch_size")
    mbs = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    for name, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                    ("gradient_accumulation_steps", gas)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"PipelineEngine: {name} must be a positive int, got {v!r}")
    if tbs is None and mbs is None:
        raise ValueError("PipelineEngine: the config needs train_batch_size or "
                         "train_micro_batch_size_per_gpu")
    if tbs is not None and mbs is not None and gas is None:
        gas, rem = divmod(tbs, mbs * dp)
        if rem or gas < 1:
            raise ValueError(f"PipelineEngine: train_batch_size={tbs} is not a multiple of "
                             f"train_micro_batch_size_per_gpu={mbs} x {dp} data-parallel "
                             f"replicas")
    gas = gas if gas is not None else 1
    if mbs is None:
        mbs, rem = divmod(tbs, gas * dp)
        if rem or mbs < 1:
            raise ValueError(f"PipelineEngine: train_batch_size={tbs} is not divisible by "
                             f"gradient_accumulation_steps={gas} x {dp} replicas")
    if tbs is None:
        tbs = mbs * gas * dp
    if tbs != mbs * gas * dp:
        raise ValueError(f"PipelineEngine: train_batch_size={tbs} != "
                         f"train_micro_batch_size_per_gpu={mbs} x gradient_accumulation_steps="
                         f"{gas} x {dp} data-parallel replicas = {mbs * gas * dp}")
    return tbs, mbs, gas


_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad",
               "rmsprop": "RMSprop"}


def build_optimizer(spec: Mapping[str, Any],
                    params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """``{"type": "AdamW", "params": {"lr": 1e-3, ...}}`` -> the matching ``torch.optim``
    optimizer. As in DeepSpeed, ``"Adam"`` decouples weight decay (AdamW) unless its params say
    ``"adam_w_mode": false``, and weight decay defaults to 0 for both (DeepSpeed's fused Adam
    default; ``torch.optim.AdamW``'s own is 0.01); ``torch_adam`` is accepted and ignored."""
    kind = str(spec.get("type", "")).lower()
    if kind not in _OPTIMIZERS:
        raise ValueError(f"PipelineEngine: optimizer type {spec.get('type')!r} is not supported; "
                         f"use one of {sorted(_OPTIMIZERS.values())} or pass optimizer=")
    kwargs = dict(spec.get("params") or {})
    kwargs.pop("torch_adam", None)
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    name = _OPTIMIZERS[kind]
    if name == "Adam" and adam_w_mode:
        name = "AdamW"
    if name in ("Adam", "AdamW"):
        kwargs.setdefault("weight_decay", 0.0)
    try:
        return getattr(torch.optim, name)(list(params), **kwargs)
    except TypeError as err:
        raise ValueError(f"PipelineEngine: optimizer {name} rejects params {kwargs}: {err}") \
            from None
