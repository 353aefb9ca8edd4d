"""The MindSpore Platform on 2 and 4 real processes: native collectives (all-reduce, broadcast,
barrier, point-to-point, objects), composed ones (all-gather into a tensor, reduce-scatter,
all-to-all), sub-groups that only their members create, and bad inputs.

Expected values are computed with numpy from each rank's known input, never by the platform."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint

from hyperpar.platform import P2POp, get_platform


def _inputs(rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Rank-specific, exactly representable float32 data."""
    size = int(np.prod(shape))
    return (np.arange(size, dtype=np.float32).reshape(shape) + 100 * rank) / 4


# --------------------------------------------------------------------------- rank functions
def _identity() -> tuple[int, int, str, str, bool]:
    p = get_platform()
    return p.rank(), p.world_size(), p.device_type, p.dist_backend, p.is_initialized()


def _all_reduce(op: str) -> np.ndarray:
    p = get_platform()
    x = ms.Tensor(_inputs(p.rank(), (2, 3)) + 1)
    p.all_reduce(x, op)
    return x.asnumpy()


def _all_reduce_async() -> np.ndarray:
    p = get_platform()
    x = ms.Tensor(_inputs(p.rank(), (4,)))
    p.all_reduce(x, "sum", async_op=True).wait()
    return x.asnumpy()


def _all_gather() -> np.ndarray:
    p = get_platform()
    n = p.world_size()
    out = mint.zeros((2 * n, 3), dtype=ms.float32)
    p.all_gather_into_tensor(out, ms.Tensor(_inputs(p.rank(), (2, 3))))
    return out.asnumpy()


def _reduce_scatter(op: str, odd_ranks: bool = False, ring: bool = False) -> np.ndarray | None:
    import hyperpar_mindspore.collectives as collectives  # where reduce_scatter_tensor reads it

    p = get_platform()
    group = p.new_group([1, 3]) if odd_ranks else None  # every rank creates it, as contracted
    if odd_ranks and p.rank() % 2 == 0:
        return None
    n = p.world_size(group)
    out = mint.zeros((2, 3), dtype=ms.float32)
    # the CPU ring (point-to-point) path is taken from a size on; force it, or keep it off
    saved = collectives.RING_MIN_BYTES
    collectives.RING_MIN_BYTES = 0 if ring else 1 << 40
    try:
        p.reduce_scatter_tensor(out, ms.Tensor(_inputs(p.rank(), (2 * n, 3))), op, group)
    finally:
        collectives.RING_MIN_BYTES = saved
    return out.asnumpy()


def _all_to_all(uneven: bool) -> np.ndarray:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    # Rank r sends (j + r + 1) rows to rank j when uneven, else 2 rows to everyone.
    send = [(j + r + 1) if uneven else 2 for j in range(n)]
    recv = [(r + j + 1) if uneven else 2 for j in range(n)]
    x = ms.Tensor(_inputs(r, (sum(send), 2)))
    out = mint.zeros((sum(recv), 2), dtype=ms.float32)
    p.all_to_all_single(out, x, recv if uneven else None, send if uneven else None)
    return out.asnumpy()


def _broadcast(src: int) -> np.ndarray:
    p = get_platform()
    x = ms.Tensor(_inputs(p.rank(), (3,)))
    p.broadcast(x, src)
    p.barrier()
    return x.asnumpy()


def _ring() -> np.ndarray:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    got = mint.zeros((3,), dtype=ms.float32)
    works = p.batch_isend_irecv([P2POp("send", ms.Tensor(_inputs(r, (3,))), (r + 1) % n),
                                 P2POp("recv", got, (r - 1) % n)])
    for w in works:
        w.wait()
    return got.asnumpy()


def _objects() -> tuple[list, object]:
    p = get_platform()
    r = p.rank()
    return p.all_gather_object({"rank": r, "name": f"r{r}"}), p.broadcast_object(["from", r], 1)


def _sub_groups() -> tuple[int, int, list[int], np.ndarray, str]:
    p = get_platform()
    r = p.rank()
    pairs = [p.new_group([0, 1]), p.new_group([2, 3])]  # every rank creates both, as contracted
    mine = pairs[r // 2]
    x = ms.Tensor(_inputs(r, (2,)))
    p.all_reduce(x, group=mine)
    try:
        p.all_reduce(ms.Tensor(np.ones(2, np.float32)), group=pairs[1 - r // 2])
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return p.rank(mine), p.world_size(mine), p.group_ranks(mine), x.asnumpy(), refused


def _bad_inputs() -> list[str]:
    p = get_platform()
    n = p.world_size()
    errors = []
    for call in (
        lambda: p.all_reduce(ms.Tensor([1.0]), "mean"),
        lambda: p.all_gather_into_tensor(mint.zeros((3,), dtype=ms.float32),
                                         ms.Tensor([1.0, 2.0])),
        lambda: p.reduce_scatter_tensor(mint.zeros((1,), dtype=ms.float32),
                                        ms.Tensor([1.0] * (n + 1))),
        lambda: p.all_to_all_single(mint.zeros((n,), dtype=ms.float32),
                                    ms.Tensor([1.0] * n), input_split_sizes=[n]),
        lambda: p.new_group([0, 0]),
    ):
        try:
            call()
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


# --------------------------------------------------------------------------- tests
def test_every_rank_joins_a_cpu_world(pool2):
    assert pool2.run(_identity) == [(0, 2, "cpu", "mccl", True), (1, 2, "cpu", "mccl", True)]


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
def test_all_reduce_matches_numpy(pool2, op):
    ins = [_inputs(r, (2, 3)) + 1 for r in range(2)]
    want = {"sum": sum(ins), "avg": sum(ins) / 2, "max": np.maximum(*ins),
            "min": np.minimum(*ins), "product": ins[0] * ins[1]}[op]
    for got in pool2.run(_all_reduce, op):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_async_all_reduce_completes_on_wait(pool2):
    want = _inputs(0, (4,)) + _inputs(1, (4,))
    for got in pool2.run(_all_reduce_async):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [2, 4])
def test_composed_all_gather_concatenates_in_rank_order(pool2, pool4, n):
    pool = pool2 if n == 2 else pool4
    want = np.concatenate([_inputs(r, (2, 3)) for r in range(n)])
    for got in pool.run(_all_gather):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ring", [False, True], ids=["all-reduce", "ring"])
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_composed_reduce_scatter_gives_each_rank_its_rows(pool4, op, ring):
    # two compositions (MindSpore's CPU build has no ReduceScatter kernel): an all-reduce of a
    # copy, and from a size on a ring of point-to-point exchanges
    ins = [_inputs(r, (8, 3)) for r in range(4)]
    full = {"sum": sum(ins), "max": np.maximum.reduce(ins), "avg": sum(ins) / 4}[op]
    for r, got in enumerate(pool4.run(_reduce_scatter, op, False, ring)):
        np.testing.assert_allclose(got, full[2 * r:2 * r + 2], rtol=1e-6, atol=0)
    # on a sub-group of two ranks (1 and 3): its members' inputs only, in group-rank order
    sub = [_inputs(r, (4, 3)) for r in (1, 3)]
    full = {"sum": sum(sub), "max": np.maximum.reduce(sub), "avg": sum(sub) / 2}[op]
    for r, got in enumerate(pool4.run(_reduce_scatter, op, True, ring)):
        if r % 2 == 0:
            assert got is None
        else:
            np.testing.assert_allclose(got, full[2 * (r // 2):2 * (r // 2) + 2], rtol=1e-6,
                                       atol=0)


@pytest.mark.parametrize("uneven", [False, True])
def test_composed_all_to_all_moves_each_piece_to_its_rank(pool4, uneven):
    n = 4
    sends = [[(j + r + 1) if uneven else 2 for j in range(n)] for r in range(n)]
    data = [_inputs(r, (sum(sends[r]), 2)) for r in range(n)]
    for r, got in enumerate(pool4.run(_all_to_all, uneven)):
        want = np.concatenate([data[s][sum(sends[s][:r]):sum(sends[s][:r + 1])]
                               for s in range(n)])
        np.testing.assert_array_equal(got, want)


def test_broadcast_and_barrier(pool2):
    for got in pool2.run(_broadcast, 1):
        np.testing.assert_array_equal(got, _inputs(1, (3,)))


@pytest.mark.parametrize("n", [2, 4])
def test_point_to_point_ring(pool2, pool4, n):
    pool = pool2 if n == 2 else pool4
    for r, got in enumerate(pool.run(_ring)):
        np.testing.assert_array_equal(got, _inputs((r - 1) % n, (3,)))


def test_object_collectives(pool2):
    for gathered, got in pool2.run(_objects):
        assert gathered == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
        assert got == ["from", 1]


def test_sub_groups_are_created_by_members_only_and_refuse_outsiders(pool4):
    for r, (rank, size, ranks, reduced, refused) in enumerate(pool4.run(_sub_groups)):
        pair = [2 * (r // 2), 2 * (r // 2) + 1]
        assert (rank, size, ranks) == (r % 2, 2, pair)
        np.testing.assert_array_equal(reduced, _inputs(pair[0], (2,)) + _inputs(pair[1], (2,)))
        assert f"rank {r} is not a member" in refused


def test_bad_inputs_raise_before_any_collective(pool2):
    for errors in pool2.run(_bad_inputs):
        op, gather, scatter, a2a, group = errors
        assert "unknown reduce op 'mean'" in op
        assert "output shape (3,)" in gather
        assert "input shape (3,)" in scatter
        assert "input_split_sizes [2]" in a2a
        assert "must be distinct ranks" in group


def test_info_lists_the_compositions_in_use(monkeypatch):
    from hyperpar.platform import registry
    from hyperpar.platform.info import collect_info

    monkeypatch.setenv("HYPERPAR_BACKEND", "mindspore")
    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "CPU")
    registry.reset()
    try:
        text = collect_info().to_text()
    finally:
        registry.reset()
    assert "selected: mindspore" in text
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert name in text


def test_a_process_alone_is_a_world_of_one(monkeypatch):
    from hyperpar_mindspore.platform import MindSporePlatform

    for var in ("MS_ROLE", "WORLD_SIZE", "MS_WORKER_NUM", "RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "CPU")
    p = MindSporePlatform()
    with pytest.raises(RuntimeError, match="call get_platform\\(\\).init_process_group\\(\\)"):
        p.world_size()
    p.init_process_group()
    x = ms.Tensor([1.0, 2.0])
    p.all_reduce(x, "avg")
    out = mint.zeros((2,), dtype=ms.float32)
    p.all_gather_into_tensor(out, x)
    assert (p.rank(), p.world_size()) == (0, 1)
    np.testing.assert_array_equal(out.asnumpy(), [1.0, 2.0])
    p.destroy_process_group()


# --------------------------------------------------------------------------- in this process
def test_module_detection_knows_dense_linear_and_embedding(monkeypatch):
    from hyperpar_mindspore.platform import MindSporePlatform
    from mindspore import nn

    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "CPU")
    p = MindSporePlatform()
    assert p.is_linear(nn.Dense(2, 3)) and p.is_linear(mint.nn.Linear(2, 3))
    assert p.is_embedding(nn.Embedding(4, 2)) and p.is_embedding(mint.nn.Embedding(4, 2))
    assert not p.is_linear(nn.ReLU()) and not p.is_embedding(nn.Dense(2, 3))
    assert p.is_norm(nn.LayerNorm((3,)))


def test_cell_hooks_replace_inputs_and_outputs_and_come_off(monkeypatch):
    from hyperpar_mindspore.platform import MindSporePlatform
    from mindspore import nn

    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "CPU")
    p = MindSporePlatform()
    cell = nn.Dense(2, 2, weight_init="ones", bias_init="zeros")
    x = ms.Tensor(np.ones((1, 2), np.float32))
    pre = p.register_forward_pre_hook(cell, lambda c, args: (args[0] * 3,))
    post = p.register_forward_hook(cell, lambda c, args, out: out + 1)
    np.testing.assert_array_equal(cell(x).asnumpy(), [[7.0, 7.0]])  # (1+1)*3 + 1
    pre.remove()
    post.remove()
    np.testing.assert_array_equal(cell(x).asnumpy(), [[2.0, 2.0]])


def test_device_facts_on_cpu_and_a_bad_target_named(monkeypatch):
    from hyperpar_mindspore.platform import MindSporePlatform

    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "cpu")
    p = MindSporePlatform()
    assert (p.device_type, p.dist_backend, p.device(), p.device_count()) == (
        "cpu", "mccl", "CPU", 1)
    assert p.ranks_share_device and p.max_local_ranks() is None
    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "TPU")
    with pytest.raises(ValueError, match="HYPERPAR_MS_DEVICE='TPU' is not a MindSpore target; "
                                         "use one of CPU, Ascend, GPU"):
        MindSporePlatform()
