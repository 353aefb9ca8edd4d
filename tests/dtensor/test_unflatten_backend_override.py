"""``DeviceMesh._unflatten(..., backend_override=)`` as torchtitan's ParallelDims calls it: the
dims it will not use named ``"fake"`` are accepted; a real backend for a real dim raises."""

from __future__ import annotations


def _facts():
    from hyperpar.dtensor import init_device_mesh

    world = init_device_mesh((2,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, 2, 1), ("pp", "dp", "tp"),
                            backend_override={"pp": "fake", "dp": "fake", "tp": "nccl"})
    try:
        world._unflatten(0, (1, 2), ("pp", "dp"), backend_override={"dp": "gloo"})
        error = None
    except NotImplementedError as exc:
        error = str(exc)
    return {"shape": mesh.shape, "dp": mesh["dp"].size(), "error": error}


def test_backend_override_for_size_one_dims_only(run_on_ranks):
    for f in run_on_ranks(2, _facts):
        assert f["shape"] == (1, 2, 1) and f["dp"] == 2
        assert "{'dp': 'gloo'} picks a backend for dims of size > 1" in f["error"]
