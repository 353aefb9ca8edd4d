"""The contract's tensor mechanics on the selected backend (in the test process): what the
framework-neutral DeviceMesh and DimCollectives ask of a tensor, checked against torch's own ops."""

from __future__ import annotations

import torch

from hyperpar.platform import get_platform


def _x() -> torch.Tensor:
    p = get_platform()
    return torch.arange(24.0, device=p.device()).reshape(2, 3, 4)


def test_rank_tensor_is_an_int64_host_tensor_like_torchs_mesh():
    t = get_platform().rank_tensor([[0, 1], [2, 3]])
    assert t.dtype == torch.int64 and t.device == torch.zeros(0).cpu().device
    assert t.tolist() == [[0, 1], [2, 3]]


def test_cat_split_and_narrow_cut_and_join_along_a_dim():
    p, x = get_platform(), _x()
    pieces = p.split(x, [2, 1, 1], 2)
    assert [tuple(q.shape) for q in pieces] == [(2, 3, 2), (2, 3, 1), (2, 3, 1)]
    assert torch.equal(p.cat(pieces, 2), x)
    assert [tuple(q.shape) for q in p.split(x, [1, 1, 1], 1)] == [(2, 1, 4)] * 3
    assert torch.equal(p.narrow(x, 1, 1, 2), x[:, 1:3])
    assert p.narrow(x, 1, 3, 0).shape == (2, 0, 4)


def test_pad_reshape_and_empty_keep_dtype_device_and_order():
    p, x = get_platform(), _x()
    padded = p.pad_zeros(x, 1, 5)
    assert padded.shape == (2, 5, 4) and torch.equal(padded[:, :3], x)
    assert not padded[:, 3:].any() and p.pad_zeros(x, 1, 3) is x
    flat = p.reshape(x.transpose(1, 2), (-1,))
    assert flat.is_contiguous() and torch.equal(flat, x.transpose(1, 2).reshape(-1))
    empty = p.new_empty(x, (7, 2))
    assert empty.shape == (7, 2) and empty.dtype == x.dtype and empty.device == x.device


def test_int_tensor_round_trips_through_to_ints():
    p = get_platform()
    t = p.int_tensor([3, 0, 5])
    assert t.dtype == torch.int64 and t.device.type == p.device().type
    assert p.to_ints(t) == [3, 0, 5]
