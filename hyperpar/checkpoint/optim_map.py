"""Optimizer state from one framework to the other: the torch and MindSpore optimizers that
run the same update, what each one's saved state is called on the other side, and the checks
that keep a translated load from continuing a run with different arithmetic.

Imports no framework: the PyTorch loader (:mod:`.optim_cross`) and the MindSpore backend
(``hyperpar_mindspore.optim_cross``) hand it class names, hyperparameters and step counts.

Each pair was checked numerically (torch 2.13, MindSpore 2.10, CPU): 4 steps from the same
weights and gradients, and 2 steps in one framework continued for 2 in the other from the
translated state; the parameters agree to float32 rounding (relative 1e-7) -- except the pairs
:data:`REFUSED` names, whose updates differ by 1e-2 and more.

Hyperparameters: a translated load keeps the *loading* optimizer's (its learning rate, betas,
eps, weight decay, momentum, dampening, nesterov), because the user built that optimizer for
the new framework (a MindSpore learning rate may be a schedule indexed by ``global_step``); one
that differs from the saved run's is reported (:func:`compare_hyperparameters`, a warning).
Options the other framework's optimizer cannot run at all (amsgrad, maximize, ...) are refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._format import CheckpointError

TORCH_ADAM = "torch.optim.adam.Adam"
TORCH_ADAMW = "torch.optim.adamw.AdamW"
TORCH_SGD = "torch.optim.sgd.SGD"
MS_ADAM = "mindspore.nn.optim.adam.Adam"
MS_ADAM_WEIGHT_DECAY = "mindspore.nn.optim.adam.AdamWeightDecay"
MS_MOMENTUM = "mindspore.nn.optim.momentum.Momentum"
MS_SGD = "mindspore.nn.optim.sgd.SGD"

#: torch param-group keys with a meaning in this table (``betas`` is split into beta1/beta2)
_TORCH_KEYS = ("lr", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad",
               "maximize", "decoupled_weight_decay")


@dataclass(frozen=True)
class Pair:
    """A torch optimizer and a MindSpore one whose updates are the same arithmetic.

    ``state``: (torch per-parameter key, MindSpore state prefix) pairs -- the tensors laid out
    as their parameter. ``kind``: how the counters translate -- ``"adam"`` (torch's
    per-parameter ``step`` <-> MindSpore's ``global_step`` and ``beta{1,2}_power`` = beta**step)
    or ``"momentum"`` (no counter; a torch buffer that does not exist yet is a zero MindSpore
    buffer, or ``stat`` 1 for ``nn.SGD``). ``compared``: hyperparameters reported when they
    differ. ``required``: hyperparameter -> (the value both sides must have, why)."""

    torch: str
    mindspore: str
    kind: str
    state: tuple[tuple[str, str], ...]
    compared: tuple[str, ...]
    required: Mapping[str, tuple[Any, str]] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.torch} <-> {self.mindspore}"


_NO_MAXIMIZE = (False, "MindSpore's optimizers have no maximize")

PAIRS: tuple[Pair, ...] = (
    Pair(TORCH_ADAM, MS_ADAM, "adam", (("exp_avg", "moment1"), ("exp_avg_sq", "moment2")),
         ("lr", "beta1", "beta2", "eps", "weight_decay"),
         {"amsgrad": (False, "amsgrad's extra state (max_exp_avg_sq / vhat) is not translated"),
          "maximize": _NO_MAXIMIZE,
          "nesterov": (False, "torch's Adam has no Nesterov variant (NAdam is another update)"),
          "decoupled_weight_decay": (False, "MindSpore's Adam adds weight decay to the "
                                            "gradient (L2), as torch's Adam does without it")}),
    Pair(TORCH_SGD, MS_MOMENTUM, "momentum", (("momentum_buffer", "moments"),),
         ("lr", "momentum", "weight_decay"),
         {"nesterov": (False, "MindSpore's Momentum applies Nesterov with the buffer before "
                              "this step's update, torch with the one after it (measured: "
                              "1e-2 apart after one step); use mindspore.nn.SGD(nesterov=True)"),
          "dampening": (0.0, "MindSpore's Momentum has no dampening; use mindspore.nn.SGD"),
          "maximize": _NO_MAXIMIZE}),
    Pair(TORCH_SGD, MS_SGD, "momentum", (("momentum_buffer", "accum"),),
         ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
         {"maximize": _NO_MAXIMIZE}),
)

#: pairs that look alike but update differently: (torch, MindSpore) -> why they are refused
REFUSED: dict[tuple[str, str], str] = {
    (TORCH_ADAMW, MS_ADAM_WEIGHT_DECAY): (
        "mindspore.nn.AdamWeightDecay applies no bias correction (it steps by "
        "lr * (m / (sqrt(v) + eps) + weight_decay * w)), torch's AdamW divides m by "
        "1 - beta1**step and v by 1 - beta2**step (measured: 1e-2 apart after one step), so the "
        "run would not continue as it trained"),
}


def supported() -> str:
    """The supported pairs, for error messages."""
    return "; ".join(str(p) for p in PAIRS)


def find_pair(saved: str, loading: str, path: str) -> Pair:
    """The pair of the class that saved ``path``'s optimizer state and the loading
    optimizer's class (either order); raises :class:`CheckpointError` naming both classes and
    the supported pairs."""
    for pair in PAIRS:
        if {saved, loading} == {pair.torch, pair.mindspore}:
            return pair
    why = REFUSED.get((saved, loading)) or REFUSED.get((loading, saved))
    reason = f": {why}" if why else (f"; optimizer state crosses frameworks only between "
                                     f"{supported()}")
    raise CheckpointError(
        f"load(optimizer=...): {path} holds the state of a {saved} but the optimizer given is "
        f"a {loading}{reason}. Build the optimizer of a supported pair, or load without "
        "optimizer= and start its state afresh")


def is_mindspore(class_name: str | None) -> bool:
    return bool(class_name) and class_name.startswith("mindspore.")


def is_torch(class_name: str | None) -> bool:
    return bool(class_name) and class_name.startswith("torch.")


def torch_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A torch param group's hyperparameters by this table's names (``betas`` split)."""
    out = {k: group[k] for k in _TORCH_KEYS if k in group}
    if "betas" in group:
        out["beta1"], out["beta2"] = (float(b) for b in group["betas"])
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal, reading a float32 value (MindSpore keeps its hyperparameters as float32
    tensors) as equal to the float it came from."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    return a == b


def check_required(pair: Pair, hyper: Mapping[str, Any], who: str, path: str) -> None:
    """Refuse an option of one side that the other side's optimizer cannot run."""
    for name, (value, why) in pair.required.items():
        if name in hyper and not _same(hyper[name], value):
            raise CheckpointError(
                f"load(optimizer=...): {path}: {who} has {name}={hyper[name]!r}, which "
                f"{pair} does not translate ({why}); use {name}={value!r} or load without "
                "optimizer=")


def compare_hyperparameters(pair: Pair, saved: Mapping[str, Any], loading: Mapping[str, Any]
                            ) -> list[str]:
    """The compared hyperparameters the saved run and the loading optimizer set differently
    (the loading optimizer's are kept), as ``"name: saved X, now Y"``."""
    return [f"{k}: saved {saved[k]!r}, this optimizer {loading[k]!r}"
            for k in pair.compared if k in saved and k in loading
            and not _same(saved[k], loading[k])]


Labelled = Sequence[tuple[str, Mapping[str, Any]]]


def check_groups(pair: Pair, saved: Labelled, loading: Labelled, path: str) -> None:
    """Refuse what ``pair`` cannot run in either side's hyperparameters, then warn, per param
    group, where the loading optimizer's differ from the saved run's (the loading optimizer's
    are kept). Each side is a list of ``(who, hyperparameters)``, one per param group; a side
    with one entry (MindSpore's optimizer) is compared with every group of the other."""
    for who, hyper in (*saved, *loading):
        check_required(pair, hyper, who, path)
    for i in range(max(len(saved), len(loading)) if saved and loading else 0):
        diffs = compare_hyperparameters(pair, saved[min(i, len(saved) - 1)][1],
                                        loading[min(i, len(loading) - 1)][1])
        if diffs:
            warnings.warn(f"load(optimizer=...): {path}: param group {i} keeps this "
                          f"optimizer's hyperparameters, which differ from the saved run's "
                          f"({'; '.join(diffs)})", stacklevel=5)


def common_step(steps: Mapping[str, float], path: str) -> int:
    """The one step count of torch's per-parameter Adam ``step`` values (MindSpore's Adam
    keeps one count for every parameter); raises when they differ."""
    values = sorted({float(v) for v in steps.values()})
    if len(values) > 1:
        first = {v: sorted(n for n, s in steps.items() if float(s) == v)[:3] for v in values}
        raise CheckpointError(
            f"load(optimizer=...): {path}: torch's Adam took different numbers of steps for "
            f"different parameters ({first}: a parameter without a gradient is skipped), but "
            "MindSpore's Adam keeps one step count (beta1_power, beta2_power) for all; this "
            "state cannot be translated")
    if values and (values[0] < 0 or values[0] != int(values[0])):
        raise CheckpointError(f"load(optimizer=...): {path}: Adam step {values[0]} is not a "
                              "whole number of steps")
    return int(values[0]) if values else 0


def step_from_mindspore(global_step: int, beta1_power: float, beta1: float, path: str) -> int:
    """Torch's Adam step from a MindSpore Adam's counters: ``global_step``, checked against
    ``beta1_power`` (= beta1**steps, float32), which drives MindSpore's bias correction."""
    t = int(global_step)
    if t < 0:
        raise CheckpointError(f"load(optimizer=...): {path}: global_step {t} is negative")
    # beta1**t in float32 is accumulated by t multiplications: relative error <= t * 2**-24.
    # Past float32's range (beta1**t < 1e-30) the bias correction is 1 either way.
    want = beta1 ** t
    if want > 1e-30 and not math.isclose(beta1_power, want, rel_tol=max(t, 1) * 2e-7):
        raise CheckpointError(
            f"load(optimizer=...): {path}: MindSpore's Adam counted global_step={t} but its "
            f"beta1_power {beta1_power} is not beta1**{t} = {want} (beta1={beta1}); the step "
            "count that drives its bias correction is unknown, so the state is not translated")
    return t


def beta_power(beta: float, step: int) -> float:
    """MindSpore's ``beta_power`` after ``step`` Adam steps."""
    return float(beta) ** int(step)
