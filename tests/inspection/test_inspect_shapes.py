"""``expected_shape`` is checked against the global shape the real sharding gives (DTensor specs,
or the local shapes and values exchanged over the tensor-parallel group), never used to decide
the gather: a wrong one raises ``ShapeMismatchError`` naming the module, the real global shape
and the expected one -- on every rank, before any activation is gathered."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.inspect import InspectedModel, ShapeMismatchError
from hyperpar.platform import get_platform

B = 4


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _x() -> torch.Tensor:
    return torch.linspace(-1, 1, B * 8).reshape(B, 8)


def _tp(hook: str, expected: tuple | None, sharded_dim: int | None = None) -> dict:
    """Run the tp2 MLP with one hook; the error text (or the capture) per rank."""
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    model = parallelize_module(_MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    im = InspectedModel(model, mesh=mesh)
    im.register_forward_hook(hook, expected, sharded_dim=sharded_dim)
    try:
        with torch.no_grad():
            im(_x())
    except ShapeMismatchError as exc:
        return {"error": str(exc)}
    return {"captured": dict(im.captured)}


def _reference(name: str) -> torch.Tensor:
    model = _MLP()
    seen = {}
    model.get_submodule(name).register_forward_hook(
        lambda m, a, out: seen.setdefault(name, out.detach()))
    model(_x())
    return seen[name]


@pytest.mark.parametrize(("hook", "expected", "sharded_dim", "real"), [
    # column-parallel output, local (4, 8) per rank: a too-large size used to add a zero column
    ("up", (B, 17), None, (B, 16)),
    # row-parallel output, replicated (4, 8): a doubled size used to capture two copies
    ("down", (B, 16), None, (B, 8)),
    # the local shape given as the global one used to capture rank 0's half silently; which
    # dimension is split cannot be told then, so the message asks for sharded_dim
    ("up", (B, 8), None, None),
    # an explicit sharded_dim: the global size comes from the ranks, not from expected_shape
    ("up", (B, 15), 1, (B, 16)),
    # wrong number of dimensions: the message used to call the local shape the full one
    ("up", (B, 16, 1), 1, (B, 16)),
], ids=["colwise-too-large", "replicated-doubled", "local-as-global", "explicit-dim",
        "wrong-ndim"])
def test_tp2_wrong_expected_shape_raises_naming_the_real_global_shape(
        run_on_ranks, hook, expected, sharded_dim, real):
    results = run_on_ranks(2, _tp, hook, expected, sharded_dim)
    for rank, r in enumerate(results):
        assert "error" in r, f"rank {rank} captured {r} instead of raising"
        msg = r["error"]
        assert f"{hook!r}" in msg, msg
        assert f"expected_shape is {expected}" in msg, msg
        assert f"global shape {real}" in msg if real else "sharded_dim=" in msg, msg


@pytest.mark.parametrize(("hook", "expected"), [("up", (B, 16)), ("down", (B, 8)),
                                                 ("up", (None, 16)), ("down", None)])
def test_tp2_right_expected_shape_captures_the_unsharded_activation(run_on_ranks, hook,
                                                                    expected):
    results = run_on_ranks(2, _tp, hook, expected, None)
    assert "captured" in results[0], results[0]
    torch.testing.assert_close(results[0]["captured"][hook], _reference(hook))


def test_tp2_split_output_without_dimension_or_shape_raises_instead_of_keeping_a_half(
        run_on_ranks):
    for r in run_on_ranks(2, _tp, "up", None, None):
        assert "differs between the 2 tp ranks" in r["error"], r
        assert "sharded_dim=" in r["error"], r


def test_tp2_sharded_dim_on_a_replicated_output_raises_instead_of_gathering_copies(
        run_on_ranks):
    for r in run_on_ranks(2, _tp, "down", (B, 16), 1):
        assert "equal on the 2 tp ranks" in r["error"] and "'down'" in r["error"], r


def _dp(expected: tuple | None) -> dict:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    rank = get_platform().rank()
    im = InspectedModel(_MLP(), mesh=mesh, dp_dim="dp")
    im.register_forward_hook("up", expected)
    try:
        with torch.no_grad():
            im(_x()[rank * B // 2:(rank + 1) * B // 2])
    except ShapeMismatchError as exc:
        return {"error": str(exc)}
    return {"captured": dict(im.captured)}


def test_dp2_wrong_expected_shape_raises_naming_the_global_batch(run_on_ranks):
    results = run_on_ranks(2, _dp, (B // 2, 16))  # the per-replica shape, not the global one
    for r in results:
        assert "error" in r, r
        assert "'up'" in r["error"] and f"global shape {(B, 16)}" in r["error"], r["error"]
        assert f"expected_shape is {(B // 2, 16)}" in r["error"], r["error"]


def test_dp2_captures_the_whole_batch(run_on_ranks):
    results = run_on_ranks(2, _dp, (B, 16))
    torch.testing.assert_close(results[0]["captured"]["up"], _reference("up"))
    assert results[1]["captured"] == {}


def _dp_mesh_without_dp_dim(expected: tuple) -> dict:
    """A 1-D data-parallel mesh passed as ``mesh`` without ``dp_dim``: replicas hold different
    rows. Nothing says how to gather them, so a shape that needs a gather must raise."""
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    rank = get_platform().rank()
    im = InspectedModel(_MLP(), mesh=mesh)
    im.register_forward_hook("up", expected)
    try:
        with torch.no_grad():
            im(_x()[rank * B // 2:(rank + 1) * B // 2])
    except ShapeMismatchError as exc:
        return {"error": str(exc)}
    return {"captured": dict(im.captured)}


def test_pieces_that_differ_in_more_than_the_expected_dim_raise(run_on_ranks):
    # local (2, 16) on each rank, values differ; (4, 17) used to be checked against (2, 16)
    # and reported as "full shape (2, 16)"; now the global shape along the one dim that can
    # be sharded is named.
    results = run_on_ranks(2, _dp_mesh_without_dp_dim, (B, 17))
    for r in results:
        assert "error" in r, r
        assert "'up'" in r["error"] and "expected_shape is (4, 17)" in r["error"], r["error"]
        assert "full shape (2, 16)" not in r["error"], r["error"]
