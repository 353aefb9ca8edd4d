"""The framework-neutral table of optimizer pairs (hyperpar/checkpoint/optim_map.py): which
pairs translate, what is refused and why, the step counts. No framework, no process: the
loads themselves are tested across frameworks in tests/mindspore/test_checkpoint.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hyperpar.checkpoint import CheckpointError
from hyperpar.checkpoint._validate import check_index
from hyperpar.checkpoint.optim_map import (
    MS_ADAM,
    MS_ADAM_WEIGHT_DECAY,
    MS_MOMENTUM,
    MS_SGD,
    PAIRS,
    TORCH_ADAM,
    TORCH_ADAMW,
    TORCH_SGD,
    check_groups,
    check_required,
    common_step,
    compare_hyperparameters,
    find_pair,
    step_from_mindspore,
    torch_hyperparameters,
)


def test_each_pair_is_found_in_either_direction() -> None:
    for torch_cls, ms_cls in ((TORCH_ADAM, MS_ADAM), (TORCH_SGD, MS_MOMENTUM),
                              (TORCH_SGD, MS_SGD)):
        assert find_pair(torch_cls, ms_cls, "p") is find_pair(ms_cls, torch_cls, "p")
    assert len(PAIRS) == 3


def test_adamw_into_adam_weight_decay_is_refused_naming_the_bias_correction() -> None:
    with pytest.raises(CheckpointError, match="no bias correction") as err:
        find_pair(TORCH_ADAMW, MS_ADAM_WEIGHT_DECAY, "ckpt")
    assert TORCH_ADAMW in str(err.value) and MS_ADAM_WEIGHT_DECAY in str(err.value)


def test_an_unknown_pair_names_both_classes_and_the_supported_pairs() -> None:
    with pytest.raises(CheckpointError) as err:
        find_pair(TORCH_ADAM, MS_SGD, "ckpt")
    msg = str(err.value)
    assert TORCH_ADAM in msg and MS_SGD in msg and f"{TORCH_ADAM} <-> {MS_ADAM}" in msg


def test_options_the_other_side_cannot_run_are_refused() -> None:
    adam, momentum = find_pair(TORCH_ADAM, MS_ADAM, "p"), find_pair(TORCH_SGD, MS_MOMENTUM, "p")
    for pair, hyper, name in ((adam, {"amsgrad": True}, "amsgrad"),
                              (adam, {"maximize": True}, "maximize"),
                              (momentum, {"dampening": 0.1}, "dampening"),
                              (momentum, {"nesterov": True}, "nesterov")):
        with pytest.raises(CheckpointError, match=f"{name}="):
            check_required(pair, hyper, "the saved optimizer", "ckpt")
    check_required(adam, torch_hyperparameters(
        {"lr": 0.01, "betas": (0.9, 0.999), "amsgrad": False, "maximize": False}), "x", "ckpt")


def test_hyperparameters_compare_float32_values_as_equal() -> None:
    adam = find_pair(TORCH_ADAM, MS_ADAM, "p")
    saved = torch_hyperparameters({"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8,
                                   "weight_decay": 0})
    # MindSpore keeps them as float32: 0.9 -> 0.8999999761581421
    ms = {"lr": 0.009999999776482582, "beta1": 0.8999999761581421, "beta2": 0.9990000128746033,
          "eps": 9.99999993922529e-09, "weight_decay": 0.0}
    assert compare_hyperparameters(adam, saved, ms) == []
    assert compare_hyperparameters(adam, saved, {**ms, "lr": 0.02}) == [
        "lr: saved 0.01, this optimizer 0.02"]


def test_groups_are_refused_before_any_warning_and_warned_per_group() -> None:
    adam = find_pair(TORCH_ADAM, MS_ADAM, "p")
    ms = [("this nn.Adam", {"lr": 0.01, "beta1": 0.9})]
    torch_groups = [(f"param group {i} of the saved Adam", {"lr": lr, "beta1": 0.9})
                    for i, lr in enumerate((0.01, 0.02, 0.03))]
    # one MindSpore side is compared with each of torch's groups: groups 1 and 2 differ
    with pytest.warns(UserWarning) as caught:
        check_groups(adam, torch_groups, ms, "ckpt")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "param group 1 keeps" in messages[0] and "lr: saved 0.02, this optimizer 0.01" \
        in messages[0]
    assert "param group 2 keeps" in messages[1] and "lr: saved 0.03" in messages[1]
    # a refused option in the last group raises before group 1's difference is warned about
    bad = [*torch_groups[:2], ("param group 2 of the saved Adam", {"amsgrad": True})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match="param group 2 of the saved Adam has amsgrad"):
            check_groups(adam, bad, ms, "ckpt")
    check_groups(adam, [], ms, "ckpt")  # a saved section without groups compares nothing


def test_torch_steps_must_agree_for_mindspore_adams_one_count() -> None:
    assert common_step({"a.step": 3.0, "b.step": 3.0}, "ckpt") == 3
    assert common_step({}, "ckpt") == 0
    with pytest.raises(CheckpointError, match="one step count"):
        common_step({"a.step": 3.0, "b.step": 2.0}, "ckpt")


def test_mindspore_step_is_checked_against_beta1_power() -> None:
    beta1 = 0.8999999761581421
    power = 1.0
    for _ in range(5):   # float32 accumulation, as nn.Adam does
        power = float(np.float32(power * beta1))
    assert step_from_mindspore(5, power, beta1, "ckpt") == 5
    with pytest.raises(CheckpointError, match="beta1_power"):
        step_from_mindspore(10, power, beta1, "ckpt")   # e.g. a count of other calls
    assert step_from_mindspore(2000, 0.0, beta1, "ckpt") == 2000   # past float32's range


def test_malformed_hyperparameters_in_the_index_are_refused() -> None:
    index = {"version": 2, "file_format": "safetensors", "files": {}, "tensors": {},
             "optimizer": {"class": MS_ADAM, "param_groups": [{}], "hyperparameters": {
                 "lr": "0.01"}}}
    with pytest.raises(CheckpointError, match="hyperparameters"):
        check_index("ckpt", index)
    index["optimizer"]["hyperparameters"] = {"lr": 0.01, "nesterov": False}
    check_index("ckpt", index)
