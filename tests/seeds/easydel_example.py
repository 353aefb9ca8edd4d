"""EasyDeL-style column -> row pair built from a TensorParallelConfig, against the same two
Linears in one process (forward and gradients). Importable by spawned ranks."""

from __future__ import annotations

import torch

from hyperpar.testing import assert_close_to_reference

IN, HIDDEN, OUT, BATCH = 8, 12, 6, 4


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference(x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    up, down = torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT)
    y = down(torch.relu(up(x)))
    (y * torch.arange(OUT)).sum().backward()
    return {"y": y.detach(), "up.weight": up.weight.grad, "up.bias": up.bias.grad,
            "down.weight": down.weight.grad, "down.bias": down.bias.grad}


def column_row_pair(reduce_scatter_output: bool) -> dict:
    """The pair as an EasyDeL user writes it (torch in place of jnp); the row layer's config is
    the column's with reduce_output=True, as EasyDeL's own attention layers build it."""
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelConfig

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    config = TensorParallelConfig(mesh=mesh, axis_name="tp",
                                  reduce_scatter_output=reduce_scatter_output)
    torch.manual_seed(0)
    up = ColumnParallelLinear(IN, HIDDEN, use_bias=True, param_dtype=torch.float32,
                              parallel_config=config)
    down = RowParallelLinear(HIDDEN, OUT, use_bias=True,
                             parallel_config=config.replace(reduce_output=True))
    x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(1))
    h = up(x)
    expected_h = HIDDEN // 2 if reduce_scatter_output else HIDDEN
    assert h.shape == (BATCH, expected_h), h.shape
    y = down(torch.relu(h))
    (y * torch.arange(OUT)).sum().backward()
    ref = reference(x)
    got = {"y": y.detach(), "up.weight": _full(up.weight.grad), "up.bias": _full(up.bias.grad),
           "down.weight": _full(down.weight.grad), "down.bias": _full(down.bias.grad)}
    assert_close_to_reference(got, ref, rtol=1e-5, atol=1e-6,
                              what=f"column->row (reduce_scatter_output={reduce_scatter_output})")
    return {"y": y.detach()}


def config_round_trip() -> dict:
    """to_json / from_json with the mesh re-resolved: the current mesh, or one built anew."""
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import TensorParallelConfig

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    config = TensorParallelConfig(mesh=mesh, reduce_scatter_output=True)
    text = config.to_json()
    with mesh:
        again = TensorParallelConfig.from_json(text)
    assert again.mesh is mesh and again == config
    rebuilt = TensorParallelConfig.from_json(text)   # no current mesh: built (collective)
    assert tuple(rebuilt.mesh.shape) == (2,) and rebuilt.mesh.mesh_dim_names == ("tp",)
    return {"json": text}
