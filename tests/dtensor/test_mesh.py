"""DeviceMesh on real ranks: shape, names, slicing, groups, coordinates, errors."""

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
