"""A torch optimizer's saved state loaded into the MindSpore optimizer of the same update
(``hyperpar.checkpoint.optim_map`` has the pairs): ``exp_avg``/``exp_avg_sq`` -> ``moment1``/
``moment2`` with ``global_step`` = step and ``beta{1,2}_power`` = beta**step, and
``momentum_buffer`` -> ``moments`` (Momentum) or ``accum`` with ``stat`` 0 (SGD). The torch
entries are read into the boxes the MindSpore state already has (they are laid out as their
parameters), so any saved layout loads into any current one."""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np

from hyperpar.checkpoint._format import CheckpointError
from hyperpar.checkpoint.arrays import Want
from hyperpar.checkpoint.optim_map import (
    MS_SGD,
    Pair,
    beta_power,
    check_groups,
    common_step,
    find_pair,
    torch_hyperparameters,
)


def _number(value: Any) -> float:
    return float(np.asarray(value.asnumpy() if hasattr(value, "asnumpy") else value).ravel()[0])


def hyperparameters(optimizer: Any) -> dict[str, Any]:
    """``optimizer``'s hyperparameters by ``optim_map``'s names (recorded in the index so a
    torch load can check them). A learning rate or weight decay that is a schedule or set per
    group is left out."""
    out: dict[str, Any] = {}
    if not optimizer.dynamic_lr and not optimizer.is_group_lr:
        out["lr"] = _number(optimizer.learning_rate)
    if not optimizer.is_group and not optimizer.dynamic_weight_decay:
        # the optimizer keeps weight_decay * loss_scale (it decays the scaled gradient)
        out["weight_decay"] = _number(optimizer.weight_decay) / float(optimizer.loss_scale)
    for name in ("beta1", "beta2", "eps", "momentum"):
        if hasattr(optimizer, name):
            out[name] = _number(getattr(optimizer, name))
    if isinstance(getattr(optimizer, "dampening", None), (int, float)):
        out["dampening"] = float(optimizer.dampening)
    for name, attr in (("nesterov", "use_nesterov"), ("nesterov", "nesterov"),
                       ("amsgrad", "use_amsgrad")):
        if isinstance(getattr(optimizer, attr, None), bool):
            out[name] = getattr(optimizer, attr)
    return out


def check_translated(optimizer: Any, section: dict[str, Any], mine: str, path: str) -> Pair:
    """The pair translating ``section`` (a torch optimizer's index section) into
    ``optimizer``, after refusing what the pair cannot run; warns about hyperparameters set
    differently (the loading optimizer's are kept). Reads no tensor."""
    pair = find_pair(section.get("class"), mine, path)
    saved = [(f"param group {i} of the saved {pair.torch}", torch_hyperparameters(group))
             for i, group in enumerate(section.get("param_groups", []))]
    check_groups(pair, saved, [(f"this {pair.mindspore}", hyperparameters(optimizer))], path)
    return pair


class Translation:
    """The reads a translated load adds and what it sets afterwards.

    ``targets``: torch entry -> (MindSpore state Parameter, its box), read like the
    Parameter's own entry; ``steps``: torch's per-parameter Adam ``step`` entries (0-d);
    ``fresh``: state Parameters whose parameter has no torch state yet (its buffer starts at
    zero, ``nn.SGD``'s ``stat`` at 1)."""

    def __init__(self, pair: Pair, optimizer: Any, layout: dict[str, tuple[Any, Any]],
                 index: dict[str, Any], path: str) -> None:
        self.pair, self.optimizer, self.path = pair, optimizer, path
        saved = index["tensors"]
        self.targets: dict[str, tuple[Any, Any]] = {}
        self.fresh: list[tuple[str, Any]] = []
        self.stats: dict[str, Any] = {}   # parameter key -> nn.SGD's stat Parameter
        self.steps: dict[str, Want] = {}
        self.scalar_steps: dict[str, float] = {}
        ms_to_torch = {prefix: key for key, prefix in pair.state}
        for key, (state, box) in layout.items():
            param_key, _, prefix = key[len("optimizer."):].rpartition(".")
            if prefix == "stat" and pair.mindspore == MS_SGD:
                self.stats[param_key] = (state, box)
            if prefix not in ms_to_torch:
                continue
            torch_key = f"optimizer.{param_key}.{ms_to_torch[prefix]}"
            if torch_key in saved:
                self.targets[torch_key] = (state, box)
            else:
                self.fresh.append((param_key, state))
            step_key = f"optimizer.{param_key}.step"
            if pair.kind == "adam" and step_key in saved:
                shape = tuple(saved[step_key]["shape"])
                self.steps[step_key] = Want(shape, (0,) * len(shape), shape)
            elif pair.kind == "adam":
                scalar = index["optimizer"].get("scalars", {}).get(step_key)
                if scalar is not None:   # torch before 1.12 kept step as a number
                    self.scalar_steps[step_key] = float(scalar)
        if pair.kind == "adam" and self.targets and self.fresh:
            raise CheckpointError(
                f"load(optimizer=...): {path}: torch's Adam holds no state for "
                f"{sorted(k for k, _ in self.fresh)[:3]} (no gradient yet) but does for "
                "others; MindSpore's Adam keeps one step count for all parameters, so this "
                "state cannot be translated")

    def apply(self, steps: dict[str, np.ndarray]) -> None:
        """After the targets were read: zero the fresh buffers and set the counters."""
        for _key, state in self.fresh:
            state.set_data(ms.Tensor(np.zeros(tuple(state.shape),
                                              ms.dtype_to_nptype(state.dtype))))
        if self.pair.mindspore == MS_SGD:   # stat 0: the buffer holds a step's gradient
            fresh = {k for k, _ in self.fresh}
            for key, (stat, _box) in self.stats.items():
                fill = np.ones if key in fresh else np.zeros
                stat.set_data(ms.Tensor(fill(tuple(stat.shape), ms.dtype_to_nptype(stat.dtype))))
        if self.pair.kind != "adam":
            return   # torch's SGD counts no steps: global_step stays this optimizer's
        values = {k: float(np.asarray(v).ravel()[0]) for k, v in steps.items()}
        step = common_step({**values, **self.scalar_steps}, self.path)
        opt = self.optimizer
        for name in ("beta1", "beta2"):   # the loading optimizer's betas (kept)
            power = np.float32(beta_power(_number(getattr(opt, name)), step))
            getattr(opt, f"{name}_power").set_data(ms.Tensor(power))
        opt.global_step.set_data(ms.Tensor(np.array([step], np.int32)))
