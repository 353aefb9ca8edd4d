"""A plan written with torch.distributed.tensor.parallel styles, re-imported from hyperpar,
shards the example model exactly as torch does and computes the same thing.

(Tests may import torch.distributed; the library may not.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from _tp_llama import llama, plans

from hyperpar.dtensor import init_device_mesh
from hyperpar.parallel import parallelize_module
from hyperpar.platform import get_platform
from hyperpar.testing import assert_close_to_reference


def _layout(param) -> tuple | None:
    """Placements as comparable values; None for a parameter left unsharded."""
    if not hasattr(param, "placements"):
        return None
    return tuple((type(p).__name__, getattr(p, "dim", None)) for p in param.placements)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _side_by_side(plan_name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    platform = get_platform()
    n = platform.world_size()
    args = llama.ModelArgs.tiny()
    build_plan = plans.tp_plan if plan_name == "tp" else plans.tp_sp_plan
    theirs, ours, mixed = (llama.build(args) for _ in range(3))
    torch_parallelize(theirs, torch_init_device_mesh(platform.device_type, (n,),
                                                     mesh_dim_names=("tp",)),
                      build_plan(plans.torch_styles()))
    mesh = init_device_mesh((n,), mesh_dim_names=("tp",))
    parallelize_module(ours, mesh, build_plan(plans.hyperpar_styles()))
    # hyperpar styles fed torch's placement objects: the plan text runs unchanged
    t = plans.torch_styles()
    h = plans.hyperpar_styles()
    parallelize_module(mixed, mesh, build_plan(SimpleNamespace(**{**vars(h), "Shard": t.Shard,
                                                                  "Replicate": t.Replicate})))

    theirs_params = dict(theirs.named_parameters())
    mixed_params = dict(mixed.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert _layout(p) == _layout(q), name
        assert _layout(mixed_params[name]) == _layout(q), name
        assert torch.equal(_local(p), _local(q)), name

    tokens, labels = llama.batch(args, seed=1)
    their_logits, our_logits = theirs(tokens), ours(tokens)
    if hasattr(their_logits, "full_tensor"):
        their_logits = their_logits.full_tensor()
    F.cross_entropy(their_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()
    assert_close_to_reference(our_logits, their_logits.detach(), what="logits")
    for name, p in ours.named_parameters():
        assert_close_to_reference(_full(p.grad), _full(theirs_params[name].grad),
                                  what=f"grad of {name}")


@pytest.mark.parametrize("plan_name", ["tp", "tp_sp"])
def test_torch_plan_reimported_from_hyperpar_shards_and_computes_the_same(run_on_ranks,
                                                                          plan_name):
    run_on_ranks(2, _side_by_side, plan_name)
