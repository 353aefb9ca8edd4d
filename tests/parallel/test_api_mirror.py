"""hyperpar.parallel mirrors torch.distributed.tensor.parallel: same names, parameters, kinds and
defaults (hyperpar may add keyword-only parameters at the end)."""

import inspect

import pytest
import torch.distributed.tensor.parallel as torch_tp

import hyperpar.parallel as hp_tp

NAMES = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
         "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module", "loss_parallel"]


def _params(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(target)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", NAMES)
def test_signature_matches_torch(name):
    ours, theirs = _params(getattr(hp_tp, name)), _params(getattr(torch_tp, name))
    assert ours[:len(theirs)] == theirs, f"{name}: {ours} vs torch {theirs}"
    extra = ours[len(theirs):]
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in extra), extra


def test_parallel_style_has_apply_and_src_data_rank():
    assert hp_tp.ParallelStyle.src_data_rank == 0
    # a subclass overrides _apply (torch's spelling) or apply (HyperParallel's); neither: error
    with pytest.raises(TypeError, match="overrides _apply"):
        type("NoApply", (hp_tp.ParallelStyle,), {})()
    for method in ("_apply", "apply"):
        style = type("Custom", (hp_tp.ParallelStyle,), {method: lambda self, m, mesh: m})()
        assert style._apply("module", None) == "module"


def test_distribute_module_signature_matches_torch():
    import torch.distributed.tensor as torch_dt

    assert _params(hp_tp.distribute_module) == _params(torch_dt.distribute_module)
