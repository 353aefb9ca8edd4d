"""A broken editing function is named on every rank (not an AttributeError deep inside)."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.inspect import InspectedModel
from hyperpar.platform import get_platform


def _returns_text(t: torch.Tensor) -> str:
    return "not a tensor"


def _edit_returning_text() -> str:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    im = InspectedModel(model, mesh=mesh)
    im.register_forward_hook("0", (4, 16), _returns_text)
    try:
        im(torch.ones(4, 8))
    except TypeError as exc:
        return str(exc)
    return "no error"


def test_an_edit_returning_a_non_tensor_is_named_on_every_rank(run_on_ranks):
    messages = run_on_ranks(2, _edit_returning_text)
    for message in messages:
        assert "_returns_text" in message and "'0'" in message, message
        assert "returned str" in message and "must return a tensor of shape (4, 16)" in message
