"""hyperpar's one DeviceMesh and its collectives along a dim, on MindSpore's real processes.

The mesh (``hyperpar.dtensor.mesh``) and ``DimCollectives`` are written once for both
frameworks; these are the same checks ``tests/dtensor/test_mesh.py`` and
``tests/dtensor/test_redistribute.py`` make on torch. Expected values come from numpy."""

from __future__ import annotations

import mindspore as ms
import numpy as np

from hyperpar.platform import get_platform


def _mesh_facts() -> dict:
    import hyperpar_mindspore

    from hyperpar import init_device_mesh
    from hyperpar.dtensor import mesh as neutral

    platform = get_platform()
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    flat = mesh.flatten("dp_tp")
    return {
        "one_class": (hyperpar_mindspore.DeviceMesh is neutral.DeviceMesh
                      and hyperpar_mindspore.init_device_mesh is neutral.init_device_mesh
                      and type(mesh) is neutral.DeviceMesh),
        "device": mesh.device_type == platform.device_type,
        "shape": mesh.shape, "coord": mesh.get_coordinate(),
        "local": (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")),
        "tp_ranks": platform.group_ranks(tp.get_group()),
        "dp_ranks": platform.group_ranks(dp.get_group()),
        "swapped": mesh["tp", "dp"].tolist(),
        "flat": (flat.tolist(), platform.group_ranks(flat.get_group())),
        "tensor": (isinstance(mesh.mesh, ms.Tensor), mesh.mesh.dtype == ms.int64,
                   mesh.mesh.asnumpy().tolist()),
    }


def test_the_mesh_is_hyperpars_one_mesh_with_groups_along_rows_and_columns(pool4):
    for rank, f in enumerate(pool4.run(_mesh_facts)):
        dp, tp = divmod(rank, 2)
        assert f["one_class"] and f["device"]
        assert f["shape"] == (2, 2) and f["coord"] == [dp, tp] and f["local"] == (dp, tp)
        assert f["tp_ranks"] == [2 * dp, 2 * dp + 1] and f["dp_ranks"] == [tp, tp + 2]
        assert f["swapped"] == [[0, 2], [1, 3]]
        assert f["flat"] == ([0, 1, 2, 3], [0, 1, 2, 3])
        assert f["tensor"] == (True, True, [[0, 1], [2, 3]])


def _bounds(size: int, n: int, k: int) -> tuple[int, int]:
    """(start, length) of piece ``k`` of ``size`` in torch.chunk's layout."""
    from hyperpar.platform.dim_collectives import chunk_sizes

    sizes = chunk_sizes(size, n)
    return sum(sizes[:k]), sizes[k]


def _dim_collectives_with_uneven_pieces() -> int:
    """Gather, reduce-scatter, all-to-all and the local piece along every dim, on torch.chunk
    pieces of every length (the tail shorter or empty), against numpy."""
    platform = get_platform()
    n, rank = platform.world_size(), platform.rank()
    checked = 0
    for size in range(1, 2 * n + 2):
        for dim in range(3):
            shape = [3, 2, 4]
            shape[dim] = size
            full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
            sizes = [_bounds(size, n, k)[1] for k in range(n)]
            start, length = _bounds(size, n, rank)
            mine = np.take(full, range(start, start + length), axis=dim)
            got = platform.all_gather_along(ms.Tensor(mine), dim, sizes=sizes)
            np.testing.assert_array_equal(got.asnumpy(), full)
            piece = platform.piece_along(ms.Tensor(full), dim)
            np.testing.assert_array_equal(piece.asnumpy(), mine)
            summed = platform.reduce_scatter_along(ms.Tensor(full * (rank + 1)), dim)
            np.testing.assert_array_equal(summed.asnumpy(), mine * sum(range(1, n + 1)))
            other = (dim + 1) % 3
            o_start, o_len = _bounds(full.shape[other], n, rank)
            moved = platform.all_to_all_along(ms.Tensor(mine), other, dim, concat_sizes=sizes)
            np.testing.assert_array_equal(
                moved.asnumpy(), np.take(full, range(o_start, o_start + o_len), axis=other))
            checked += 1
    return checked


def test_dim_collectives_gather_scatter_and_exchange_uneven_pieces(pool2, pool4):
    for pool in (pool2, pool4):
        assert min(pool.run(_dim_collectives_with_uneven_pieces)) > 0
