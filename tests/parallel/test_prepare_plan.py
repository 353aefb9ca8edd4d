"""The framework-neutral walk of ``PrepareModuleInput`` / ``PrepareModuleOutput``
(:mod:`hyperpar.parallel.prepare_plan`): which value each layout reaches, what passes through,
and the errors, with a recording ``convert`` standing in for a framework's re-layout. The
re-layouts themselves are tested per framework (tests/parallel, tests/both/test_tp.py,
tests/mindspore/test_tp_options.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.parallel.prepare_plan import check_entries, prepare_inputs, prepare_outputs
from hyperpar.parallel.styles import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)

R, S0, S1 = Replicate(), Shard(0), Shard(1)


class Value:
    """A stand-in tensor: the walk only checks its type and hands it to ``convert``."""

    def __init__(self, name: str) -> None:
        self.name = name


def _recording() -> tuple[list, Any]:
    seen: list[tuple[str, Any, Any, str]] = []

    def convert(x: Value, layout: Any, desired: Any, what: str) -> str:
        seen.append((x.name, layout, desired, what))
        return f"{x.name}:{desired}"

    return seen, convert


def test_each_positional_and_keyword_layout_reaches_its_value_and_none_passes_through():
    style = PrepareModuleInput(input_layouts=(S1, None), desired_input_layouts=(R, None),
                               input_kwarg_layouts={"mask": S0},
                               desired_input_kwarg_layouts={"mask": R})
    seen, convert = _recording()
    a, b, mask, other = Value("a"), Value("b"), Value("mask"), Value("other")
    args, kwargs = prepare_inputs(style, (a, b), {"mask": mask, "other": other}, convert,
                                  Value)
    assert args == (f"a:{R}", b) and kwargs == {"mask": f"mask:{R}", "other": other}
    assert seen == [("a", S1, R, "input 0"), ("mask", S0, R, "keyword input 'mask'")]
    # an absent keyword input is skipped, a non-tensor without a layout is left alone
    seen.clear()
    args, kwargs = prepare_inputs(style, (a, 3), {}, convert, Value)
    assert args == (f"a:{R}", 3) and kwargs == {} and len(seen) == 1


def test_outputs_one_value_or_a_tuple():
    seen, convert = _recording()
    one = PrepareModuleOutput(output_layouts=S0, desired_output_layouts=R)
    assert prepare_outputs(one, Value("y"), convert, Value) == f"y:{R}"
    two = PrepareModuleOutput(output_layouts=(None, S1), desired_output_layouts=(None, R))
    y0 = Value("y0")
    assert prepare_outputs(two, (y0, Value("y1")), convert, Value) == (y0, f"y1:{R}")
    assert [what for *_, what in seen] == ["output 0", "output 1"]


def test_mismatches_are_refused_with_the_fix():
    _, convert = _recording()
    style = PrepareModuleInput(input_layouts=(S1,), desired_input_layouts=(R,))
    with pytest.raises(ValueError, match="1 input layouts given but the module got 2 "
                                         "positional inputs; give one layout per"):
        prepare_inputs(style, (Value("a"), Value("b")), {}, convert, Value)
    with pytest.raises(TypeError, match=r"input 0: a layout \(Shard\(dim=1\)\) is given but "
                                        r"the value is a int, not a tensor; give None"):
        prepare_inputs(style, (3,), {}, convert, Value)
    out = PrepareModuleOutput(output_layouts=(S0, S0), desired_output_layouts=(R, R))
    with pytest.raises(ValueError, match="2 output layouts given but the module returned 1"):
        prepare_outputs(out, Value("y"), convert, Value)


def test_a_layout_without_a_desired_layout_is_refused_when_the_style_is_applied():
    with pytest.raises(ValueError, match=r"PrepareModuleInput input 1: layout Shard\(dim=0\) "
                                         r"given but desired layout None"):
        check_entries(PrepareModuleInput(input_layouts=(None, S0),
                                         desired_input_layouts=(None, None)))
    with pytest.raises(ValueError, match="PrepareModuleOutput output 0"):
        check_entries(PrepareModuleInputOutput(
            input_layouts=(S0,), desired_input_layouts=(R,), output_layouts=(S0,),
            desired_output_layouts=(None,)).prepare_module_output)
    check_entries(PrepareModuleInput(input_layouts=(None, S0), desired_input_layouts=(None, R)))
