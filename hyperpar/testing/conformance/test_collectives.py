"""Each collective gives the right values on 1, 2 and 4 real ranks (sync, async, sub-groups)."""

from __future__ import annotations

import pytest
import torch

from hyperpar.platform import P2POp, get_platform
from hyperpar.testing.conformance.inputs import rank_tensor

REDUCERS = {
    "sum": lambda ts: torch.stack(ts).sum(0),
    "avg": lambda ts: torch.stack(ts).mean(0),
    "max": lambda ts: torch.stack(ts).amax(0),
    "min": lambda ts: torch.stack(ts).amin(0),
    "product": lambda ts: torch.stack(ts).prod(0),
}


def _all_reduce(op: str, async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    dev = p.device()
    t = rank_tensor(r, (3, 5), salt=1).to(dev)
    work = p.all_reduce(t, op, async_op=async_op)
    if async_op:
        assert work is not None, "async_op=True must return a Work handle"
        work.wait()
    expected = REDUCERS[op]([rank_tensor(i, (3, 5), salt=1) for i in range(n)])
    torch.testing.assert_close(t.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", list(REDUCERS))
def test_all_reduce_matches_local_reduction(run_on_ranks, world_size, op):
    run_on_ranks(world_size, _all_reduce, op, False)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_async_handle_completes_on_wait(run_on_ranks, world_size, op):
    run_on_ranks(world_size, _all_reduce, op, True)


def _all_reduce_int64() -> None:
    p = get_platform()
    t = torch.full((4,), p.rank() + 1, dtype=torch.int64, device=p.device())
    p.all_reduce(t)
    n = p.world_size()
    assert t.dtype == torch.int64
    assert t.cpu().tolist() == [n * (n + 1) // 2] * 4


def test_all_reduce_keeps_integer_dtype(run_on_ranks, world_size):
    run_on_ranks(world_size, _all_reduce_int64)


def _all_gather(async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    out = torch.empty(n * 2, 3, device=p.device())
    work = p.all_gather_into_tensor(out, rank_tensor(r, (2, 3), salt=2).to(p.device()),
                                    async_op=async_op)
    if async_op:
        work.wait()
    expected = torch.cat([rank_tensor(i, (2, 3), salt=2) for i in range(n)])
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_gather_concatenates_in_rank_order(run_on_ranks, world_size, async_op):
    run_on_ranks(world_size, _all_gather, async_op)


def _reduce_scatter(op: str, async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    out = torch.empty(2, 3, device=p.device())
    work = p.reduce_scatter_tensor(out, rank_tensor(r, (2 * n, 3), salt=3).to(p.device()), op,
                                   async_op=async_op)
    if async_op:
        work.wait()
    full = REDUCERS[op]([rank_tensor(i, (2 * n, 3), salt=3) for i in range(n)])
    torch.testing.assert_close(out.cpu(), full[2 * r: 2 * r + 2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", list(REDUCERS))
def test_reduce_scatter_gives_each_rank_its_reduced_rows(run_on_ranks, world_size, op):
    # every op: torch 2.6's gloo answered max/min/product with the sum (probes.py)
    run_on_ranks(world_size, _reduce_scatter, op, False)


def test_reduce_scatter_async_handle_completes_on_wait(run_on_ranks, world_size):
    run_on_ranks(world_size, _reduce_scatter, "avg", True)


def _all_to_all(uneven: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    # rows rank i sends to rank j: (i + j) % 3 + 1 when uneven, else 2
    rows = (lambda i, j: (i + j) % 3 + 1) if uneven else (lambda i, j: 2)
    send_sizes = [rows(r, j) for j in range(n)]
    recv_sizes = [rows(i, r) for i in range(n)]
    inp = rank_tensor(r, (sum(send_sizes), 4), salt=4).to(p.device())
    out = torch.empty(sum(recv_sizes), 4, device=p.device())
    p.all_to_all_single(out, inp, recv_sizes if uneven else None,
                        send_sizes if uneven else None)
    pieces = []
    for i in range(n):
        src = rank_tensor(i, (sum(rows(i, j) for j in range(n)), 4), salt=4)
        start = sum(rows(i, j) for j in range(r))
        pieces.append(src[start:start + rows(i, r)])
    torch.testing.assert_close(out.cpu(), torch.cat(pieces))


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_all_to_all_single_routes_slices(run_on_ranks, world_size, uneven):
    run_on_ranks(world_size, _all_to_all, uneven)


def _broadcast() -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    src = n - 1
    t = rank_tensor(r, (5,), salt=5).to(p.device())
    p.broadcast(t, src)
    torch.testing.assert_close(t.cpu(), rank_tensor(src, (5,), salt=5))


def test_broadcast_from_last_rank(run_on_ranks, world_size):
    run_on_ranks(world_size, _broadcast)


def _ring(mode: str) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    mine = rank_tensor(r, (3,), salt=6).to(p.device())
    buf = torch.empty(3, device=p.device())
    if mode == "blocking":  # even ranks send first, odd ranks receive first: no deadlock
        if r % 2 == 0:
            p.send(mine, nxt)
            p.recv(buf, prv)
        else:
            p.recv(buf, prv)
            p.send(mine, nxt)
    elif mode == "nonblocking":
        works = [p.irecv(buf, prv), p.isend(mine, nxt)]
        for w in works:
            w.wait()
    else:  # batched, posted in an order that would deadlock if blocking
        for w in p.batch_isend_irecv([P2POp("send", mine, nxt), P2POp("recv", buf, prv)]):
            w.wait()
    torch.testing.assert_close(buf.cpu(), rank_tensor(prv, (3,), salt=6))


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "batched"])
def test_point_to_point_ring_passes_each_tensor_to_the_next_rank(run_on_ranks,
                                                                  multi_rank_world_size, mode):
    run_on_ranks(multi_rank_world_size, _ring, mode)


def _subgroups() -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    g_even, g_odd = p.new_group(evens), p.new_group(odds)
    assert p.new_group(evens) is g_even, "new_group must cache per rank list"
    mine = g_even if r % 2 == 0 else g_odd
    other = g_odd if r % 2 == 0 else g_even
    members = evens if r % 2 == 0 else odds
    assert p.group_ranks(mine) == members
    assert p.world_size(mine) == len(members)
    assert p.rank(mine) == members.index(r)
    assert p.rank(other) == -1, "rank() in a group this process is not in must be -1"
    t = torch.tensor([float(r)], device=p.device())
    p.all_reduce(t, group=mine)
    assert t.item() == float(sum(members))
    out = torch.empty(len(members), device=p.device())
    p.all_gather_into_tensor(out, torch.tensor([float(r)], device=p.device()), group=mine)
    assert out.cpu().tolist() == [float(m) for m in members]
    b = torch.tensor([float(r)], device=p.device())
    p.broadcast(b, members[-1], group=mine)
    assert b.item() == float(members[-1])
    p.barrier(mine)
    world = p.new_group(range(n))
    assert p.group_ranks(world) == list(range(n))


def test_sub_groups_reduce_gather_and_broadcast_among_members_only(run_on_ranks,
                                                                    multi_rank_world_size):
    run_on_ranks(multi_rank_world_size, _subgroups)


def _objects() -> None:
    p = get_platform()
    r, n = p.rank(), p.world_size()
    assert p.all_gather_object({"rank": r}) == [{"rank": i} for i in range(n)]
    assert p.broadcast_object(("from", r), src=n - 1) == ("from", n - 1)
    p.barrier()


def test_object_collectives_round_trip_python_values(run_on_ranks, world_size):
    run_on_ranks(world_size, _objects)


def _bad_reduce_op() -> str:
    p = get_platform()
    try:
        p.all_reduce(torch.ones(1, device=p.device()), "median")
    except ValueError as exc:
        return str(exc)
    raise AssertionError("an unknown reduce op must raise ValueError")


def test_unknown_reduce_op_is_a_clear_error(run_on_ranks, hyperpar_max_ranks):
    messages = run_on_ranks(min(2, hyperpar_max_ranks or 2), _bad_reduce_op)
    assert all("median" in m and "sum" in m for m in messages)
