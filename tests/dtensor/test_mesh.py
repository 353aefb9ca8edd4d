"""DeviceMesh on real ranks: shape, names, slicing, groups, coordinates, errors."""

import os
import subprocess
import sys

import pytest

from hyperpar.platform import get_platform


def _mesh_facts():
    from hyperpar.dtensor import current_mesh, init_device_mesh

    platform = get_platform()
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    swapped = mesh["tp", "dp"]
    flat = mesh["dp", "tp"].flatten("dp_tp")
    with mesh:
        inside = current_mesh() is mesh
    return {
        "type": mesh.device_type == platform.device_type,
        "shape": mesh.shape, "ndim": mesh.ndim, "size": mesh.size(), "size_tp": mesh.size("tp"),
        "coord": mesh.get_coordinate(),
        "local": (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")),
        "tp_ranks": platform.group_ranks(tp.get_group()),
        "dp_ranks": platform.group_ranks(dp.get_group()),
        "tp_same_group": tp.get_group() is mesh.get_group("tp"),
        "swapped": (swapped.shape, swapped.mesh_dim_names, swapped.mesh.tolist()),
        "flat": (flat.mesh.tolist(), platform.group_ranks(flat.get_group())),
        "root_flat": mesh["dp_tp"] is flat,
        "inside": inside, "after": current_mesh() is None,
    }


def test_two_d_mesh_slices_by_name_and_groups_follow_rows_and_columns(run_on_ranks):
    facts = run_on_ranks(4, _mesh_facts)
    for rank, f in enumerate(facts):
        dp, tp = divmod(rank, 2)
        assert f["type"] and f["shape"] == (2, 2) and f["ndim"] == 2
        assert f["size"] == 4 and f["size_tp"] == 2
        assert f["coord"] == [dp, tp] and f["local"] == (dp, tp)
        assert f["tp_ranks"] == [2 * dp, 2 * dp + 1]
        assert f["dp_ranks"] == [tp, tp + 2]
        assert f["tp_same_group"]
        assert f["swapped"][0] == (2, 2) and f["swapped"][1] == ("tp", "dp")
        assert f["swapped"][2] == [[0, 2], [1, 3]]
        assert f["flat"] == ([0, 1, 2, 3], [0, 1, 2, 3])
        assert f["root_flat"] and f["inside"] and f["after"]


def _mesh_errors():
    from hyperpar.dtensor import init_device_mesh

    out = {}
    for key, call in {
        "size": lambda: init_device_mesh((3,)),
        "dup": lambda: init_device_mesh((1, 2), mesh_dim_names=("a", "a")),
        "count": lambda: init_device_mesh((2,), mesh_dim_names=("a", "b")),
        "unknown": lambda: init_device_mesh((2,), mesh_dim_names=("tp",))["dp"],
    }.items():
        try:
            call()
        except (ValueError, KeyError) as exc:
            out[key] = str(exc)
    return out


def test_mesh_errors_name_the_bad_value_and_what_is_accepted(run_on_ranks):
    errors = run_on_ranks(2, _mesh_errors)[0]
    assert "holds 3 ranks but the world has 2" in errors["size"]
    assert "repeats ['a']" in errors["dup"]
    assert "2 mesh_dim_names" in errors["count"]
    assert "no dimension named 'dp'" in errors["unknown"] and "('tp',)" in errors["unknown"]


def _two_meshes_do_not_share_groups():
    from hyperpar.dtensor import init_device_mesh

    platform = get_platform()
    a = init_device_mesh((2, 2), mesh_dim_names=("x", "y"))
    b = init_device_mesh((4,), mesh_dim_names=("w",))
    c = init_device_mesh((2, 2), mesh_dim_names=("x", "y"))
    return (platform.group_ranks(a.get_group("y")), platform.group_ranks(b.get_group()),
            a.get_group("y") is c.get_group("y"), a == c, hash(a) == hash(c), a != b)


def test_groups_are_cached_per_rank_list_and_distinct_rank_lists_never_collide(run_on_ranks):
    results = run_on_ranks(4, _two_meshes_do_not_share_groups)
    for rank, (ay, bw, same, eq, heq, ne) in enumerate(results):
        assert ay == [rank - rank % 2, rank - rank % 2 + 1]
        assert bw == [0, 1, 2, 3]
        assert same and eq and heq and ne


@pytest.mark.parametrize("shape", [(2,), (1, 2)])
def test_one_and_two_d_meshes_on_two_ranks(run_on_ranks, shape):
    res = run_on_ranks(2, _coord, shape)
    assert [r[0] for r in res] == [list(divmod(i, 2)) if len(shape) == 2 else [i]
                                    for i in range(2)]


def _coord(shape):
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh(shape)
    return mesh.get_coordinate(), mesh.shape


# ---------------------------------------------------------------- call forms (torch's and ours)
def _call_forms():
    from hyperpar.dtensor import init_device_mesh

    device = get_platform().device_type
    forms = {
        "ours_positional_names": init_device_mesh((1, 2), ("dp", "tp")),
        "ours_keyword": init_device_mesh(mesh_shape=(1, 2), mesh_dim_names=("dp", "tp")),
        "torch": init_device_mesh(device, (2,), mesh_dim_names=("tp",)),
        "torch_keywords": init_device_mesh(device_type=device, mesh_shape=(2,),
                                           mesh_dim_names=("tp",)),
        "string_1d": init_device_mesh((2,), mesh_dim_names="tp"),
    }
    return {k: (m.device_type == device, m.shape, m.mesh_dim_names) for k, m in forms.items()}


def test_both_call_forms_keep_shape_and_names(run_on_ranks):
    forms = run_on_ranks(2, _call_forms)[0]
    assert forms["ours_positional_names"] == (True, (1, 2), ("dp", "tp"))
    assert forms["ours_keyword"] == (True, (1, 2), ("dp", "tp"))
    assert forms["torch"] == forms["torch_keywords"] == (True, (2,), ("tp",))
    assert forms["string_1d"] == (True, (2,), ("tp",))


def _bad_calls():
    from hyperpar.dtensor import init_device_mesh

    platform = get_platform()
    mesh = init_device_mesh((1, 2), mesh_dim_names=("dp", "tp"))
    other = "cuda" if platform.device_type != "cuda" else "cpu"
    out = {}
    for key, call in {
        "string_names_2d": lambda: init_device_mesh((1, 2), mesh_dim_names="tp"),
        "float_index": lambda: mesh[0.5],
        "other_device": lambda: init_device_mesh(other, (2,), mesh_dim_names=("tp",)),
        "device_index": lambda: init_device_mesh(f"{platform.device_type}:0", (2,)),
        "names_twice": lambda: init_device_mesh((2,), ("tp",), mesh_dim_names=("tp",)),
        "shape_twice": lambda: init_device_mesh(platform.device_type, (2,), mesh_shape=(2,)),
        "no_shape": lambda: init_device_mesh(platform.device_type),
    }.items():
        try:
            call()
        except (TypeError, ValueError, KeyError) as exc:
            out[key] = (type(exc).__name__, str(exc))
    out["int_index"] = (mesh[0] == mesh["dp"], mesh[1] == mesh["tp"], mesh[-1] == mesh["tp"])
    return out, other, platform.name


def test_bad_mesh_arguments_raise_clear_errors(run_on_ranks):
    errors, other, backend = run_on_ranks(2, _bad_calls)[0]
    kind, msg = errors["string_names_2d"]
    assert kind == "ValueError" and "mesh_dim_names='tp' is one string" in msg
    assert "tuple of 2 names" in msg
    # mesh[i] is the 1-D sub-mesh of dimension i (torchtitan indexes meshes so); other
    # non-name keys still raise
    assert errors["int_index"] == (True, True, True)
    kind, msg = errors["float_index"]
    assert kind == "TypeError" and "sliced by dimension name" in msg and "get_mesh(i)" in msg
    kind, msg = errors["other_device"]
    assert kind == "ValueError" and f"device_type {other!r} does not match" in msg
    assert f"backend {backend!r}" in msg and "HYPERPAR_BACKEND" in msg and "set_backend" in msg
    assert "names a device index" in errors["device_index"][1]
    assert "mesh_dim_names twice" in errors["names_twice"][1]
    assert "mesh_shape twice" in errors["shape_twice"][1]
    assert "mesh_shape is required" in errors["no_shape"][1]


# ---------------------------------------------------------------- the rank grid as given
def _mesh_argument_forms():
    import numpy as np
    import torch

    from hyperpar.dtensor import DeviceMesh

    device = get_platform().device_type
    forms = {"list": [[0], [1]], "tuple": ((0,), (1,)), "torch": torch.tensor([[0], [1]]),
             "numpy": np.array([[0], [1]])}
    meshes = {k: DeviceMesh(device, v, mesh_dim_names=("dp", "tp")) for k, v in forms.items()}
    first = meshes["list"]
    out = {"equal": all(m == first and hash(m) == hash(first) for m in meshes.values()),
           "tensor": (first.mesh.dtype, first.mesh.device.type, first.mesh.tolist(),
                      first.mesh is first.mesh),
           "tolist": first.tolist(), "coord": first.get_coordinate(),
           "repr": repr(first), "one": DeviceMesh(device, torch.tensor(1)).shape}
    for key, bad in {"ragged": [[0, 1], [2]], "floats": [0.0, 1.0], "empty": []}.items():
        try:
            DeviceMesh(device, bad)
        except (TypeError, ValueError) as exc:
            out[key] = (type(exc).__name__, str(exc))
    return out


def test_a_mesh_is_given_as_a_list_a_tensor_or_an_array_and_reads_back_as_a_tensor(
        run_on_ranks):
    import torch

    for rank, f in enumerate(run_on_ranks(2, _mesh_argument_forms)):
        assert f["equal"] and f["tolist"] == [[0], [1]] and f["coord"] == [rank, 0]
        # mesh.mesh: an int64 CPU tensor, as torch's DeviceMesh.mesh; built once
        assert f["tensor"] == (torch.int64, "cpu", [[0], [1]], True)
        assert f["repr"].endswith("[[0], [1]], mesh_dim_names=('dp', 'tp'))")
        assert f["one"] == (1,)
        assert f["ragged"][0] == "ValueError" and "ragged" in f["ragged"][1]
        assert f["floats"][0] == "TypeError" and "int ranks" in f["floats"][1]
        assert f["empty"][0] == "ValueError" and "holds no rank" in f["empty"][1]


# ---------------------------------------------------------------- the dimension resolver
def _resolver():
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.dtensor.mesh import MeshDimError

    platform = get_platform()
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh((4,))
    flat = mesh.flatten("dp_tp")

    def ranks(m):
        return platform.group_ranks(m.get_group())

    def error(call):
        try:
            call()
        except MeshDimError as exc:
            return str(exc)
        return None

    return {
        "by_name": ranks(mesh.get_mesh("tp")), "by_index": ranks(mesh.get_mesh(0)),
        "negative": ranks(mesh.get_mesh(-1)), "default": ranks(mesh.get_mesh(default="tp")),
        "same_as_slice": mesh.get_mesh("tp") == mesh["tp"],
        "cached": mesh.get_mesh("tp") is mesh.get_mesh(1),
        "one_d_self": mesh["tp"].get_mesh() is mesh["tp"],
        "one_d_default": mesh["tp"].get_mesh(default="dp") is mesh["tp"],
        "unnamed_any": unnamed.get_mesh("tp") is unnamed,
        "flattened": mesh.get_mesh("dp_tp") is flat,
        "optional_missing": mesh.get_mesh_or_none("pp"),
        "optional_present": ranks(mesh.get_mesh_or_none("dp")),
        "missing": error(lambda: mesh.get_mesh("pp")),
        "named_1d_other": error(lambda: mesh["tp"].get_mesh("dp")),
        "missing_default": error(lambda: mesh.get_mesh(default="pp")),
        "no_default": error(lambda: mesh.get_mesh()),
    }


def test_get_mesh_resolves_names_indices_and_defaults_and_lists_names(run_on_ranks):
    for rank, r in enumerate(run_on_ranks(4, _resolver)):
        dp, tp = divmod(rank, 2)
        assert r["by_name"] == r["negative"] == r["default"] == [2 * dp, 2 * dp + 1]
        assert r["by_index"] == r["optional_present"] == [tp, tp + 2]
        assert r["same_as_slice"] and r["cached"] and r["one_d_self"] and r["one_d_default"]
        assert r["unnamed_any"] and r["flattened"] and r["optional_missing"] is None
        assert "no dimension named 'pp'" in r["missing"] and "('dp', 'tp')" in r["missing"]
        assert "flattened: ['dp_tp']" in r["missing"]
        assert "no dimension named 'dp'" in r["named_1d_other"]
        assert "'pp' (the default)" in r["missing_default"]
        assert "is 2-D: say which dimension" in r["no_default"]


# ---------------------------------------------------------------- the resolver at its call sites
def _call_sites():
    from torch import nn

    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColumnParallelLinear, data_parallel
    from hyperpar.pipeline import PipelineModule

    platform = get_platform()
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    tp_only = init_device_mesh((4,), mesh_dim_names=("tp",))
    out = {}
    # a dimension named explicitly that a named 1-D mesh lacks used to fall back to the mesh
    for key, call in {
        "pipeline": lambda: PipelineModule([nn.Linear(2, 2)] * 4, mesh=tp_only, mesh_dim="pp"),
        "data_parallel": lambda: data_parallel(nn.Linear(2, 2), tp_only, "dp"),
    }.items():
        try:
            call()
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
    # no mesh_dim: a 1-D mesh is used whole, an n-D mesh by its conventional name
    out["pipeline_default_1d"] = PipelineModule([nn.Linear(2, 2)] * 4, mesh=tp_only).stage_ranks
    out["pipeline_index"] = PipelineModule([nn.Linear(2, 2)] * 2, mesh=mesh,
                                           mesh_dim=1).stage_ranks
    # an n-D mesh given to a tensor-parallel layer: its "tp" dimension
    layer = ColumnParallelLinear(4, 8, device_mesh=mesh)
    out["layer_mesh"] = platform.group_ranks(layer.weight.device_mesh.get_group())
    return out


def test_pipeline_data_parallel_and_layers_resolve_mesh_dims_one_way(run_on_ranks):
    for rank, r in enumerate(run_on_ranks(4, _call_sites)):
        for key in ("pipeline", "data_parallel"):
            assert r[key] is not None, f"{key} silently used the 'tp' mesh for another dim"
            assert "no dimension named" in r[key] and "('tp',)" in r[key]
        assert r["pipeline_default_1d"] == [0, 1, 2, 3]
        assert r["pipeline_index"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["layer_mesh"] == [2 * (rank // 2), 2 * (rank // 2) + 1]


# ---------------------------------------------------------------- a torch TP script, unchanged
TORCH_STYLE_TP = '''
import copy

import torch
import torch.distributed as dist
from torch import nn

from hyperpar import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module

# no init_process_group: the mesh joins the world from the launcher's environment, as torch's
tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
reference = copy.deepcopy(model)
parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
x = torch.randn(4, 8)
torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
print(f"rank {dist.get_rank()}: tp output matches one process")
dist.destroy_process_group()
'''


@pytest.mark.parametrize("launcher", ["hyperpar run", "torchrun"])
def test_torch_style_tp_script_runs_without_init_process_group(tmp_path, launcher):
    script = tmp_path / "tp_torch_style.py"
    script.write_text(TORCH_STYLE_TP)
    env = {**os.environ, "HYPERPAR_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(script)]
    else:
        cmd = [sys.executable, "-m", "hyperpar", "run", "-n", "2", "--backend", "cpu",
               str(script)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank}: tp output matches one process" in proc.stdout
