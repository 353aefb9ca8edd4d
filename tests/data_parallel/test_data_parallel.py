"""data_parallel: gradients averaged over the dp group, bucketed and overlapped with backward;
training on n ranks equals one process on the full batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.parallel.data_parallel import data_parallel
from hyperpar.platform import get_platform
from hyperpar.testing.parity import assert_close_to_reference

BATCH, STEPS = 16, 3


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(model: nn.Module, rank: int, world: int, accumulate: int = 1,
           sync: bool = True) -> dict[str, torch.Tensor]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = _batch(step)
        per = BATCH // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        micro = per // accumulate
        for i in range(accumulate):
            xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
            last = i == accumulate - 1
            ctx = model.no_sync() if (sync and not last) else _nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(model(xs), ys) / accumulate
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _reference(accumulate: int = 1) -> dict[str, torch.Tensor]:
    return _train(_model(), 0, 1, accumulate, sync=False)


def _dp_training(bucket_cap_mb: float, accumulate: int = 1) -> dict[str, torch.Tensor]:
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    model = data_parallel(_model(seed=rank), bucket_cap_mb=bucket_cap_mb)  # broadcast syncs
    return _train(model, rank, world, accumulate)


@pytest.mark.parametrize("world", [2, 4])
def test_dp_training_equals_one_process_on_the_full_batch(run_on_ranks, world):
    results = run_on_ranks(world, _dp_training, 25.0)
    ref = _reference()
    for state in results:
        assert_close_to_reference(state, ref, what=f"dp{world} state")


def test_tiny_buckets_launch_many_all_reduces_with_the_same_result(run_on_ranks):
    results = run_on_ranks(2, _dp_training, 0.0002)  # ~50 floats per bucket
    ref = _reference()
    for state in results:
        assert_close_to_reference(state, ref, what="dp2 tiny-bucket state")


def test_no_sync_accumulation_equals_one_big_batch(run_on_ranks):
    results = run_on_ranks(2, _dp_training, 25.0, 2)
    ref = _reference()
    for state in results:
        assert_close_to_reference(state, ref, what="dp2 no_sync state")


def _bucket_launches() -> tuple[int, int]:
    model = data_parallel(_model(), bucket_cap_mb=0.0002)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    reducer = model._hp_reducer
    return len(reducer.buckets), reducer.launched_during_backward


def test_full_buckets_are_all_reduced_during_backward_not_after(run_on_ranks):
    for n_buckets, overlapped in run_on_ranks(2, _bucket_launches):
        assert n_buckets == 3  # one per Linear: each weight alone exceeds the cap
        assert overlapped == 3


class _TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(x) if use_b else self.a(x)


def _unused_param_gets_average() -> list[torch.Tensor]:
    rank = get_platform().rank()
    torch.manual_seed(0)
    model = data_parallel(_TwoBranch())
    x = torch.full((1, 4), float(rank + 1))
    model(x, use_b=rank == 1).sum().backward()
    return [model.a.weight.grad.clone(), model.b.weight.grad.clone()]


def test_parameter_unused_on_one_rank_gets_the_average_with_zero(run_on_ranks):
    (a0, b0), (a1, b1) = run_on_ranks(2, _unused_param_gets_average)
    torch.testing.assert_close(a0, torch.full((1, 4), 0.5))  # rank 0's 1s, rank 1's 0s
    torch.testing.assert_close(b0, torch.full((1, 4), 1.0))  # rank 0's 0s, rank 1's 2s
    torch.testing.assert_close(a1, a0)
    torch.testing.assert_close(b1, b0)


class _ShardedScale(nn.Module):
    """A tensor-parallel-like module: a DTensor weight sharded over tp, forward on the local
    shard."""

    def __init__(self, mesh) -> None:
        super().__init__()
        from hyperpar.dtensor.placement import Shard
        from hyperpar.torch.dtensor.api import distribute_tensor

        full = torch.arange(8, dtype=torch.float32)
        self.w = nn.Parameter(distribute_tensor(full, mesh["tp"], [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w.to_local() * x).sum()


def _dtensor_grads_reduced_over_dp_only() -> tuple[list[float], tuple, int]:
    from hyperpar.dtensor.mesh import init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = data_parallel(_ShardedScale(mesh), mesh, "dp")
    rank = get_platform().rank()
    model(torch.full((4,), float(rank))).backward()
    g = model.w.to_local().grad
    return g.tolist(), tuple(model.w.placements), mesh.get_local_rank("tp")


def test_dtensor_parameter_local_grad_is_averaged_over_dp_only(run_on_ranks):
    results = run_on_ranks(4, _dtensor_grads_reduced_over_dp_only)
    # mesh [[0, 1], [2, 3]]: dp groups {0, 2} and {1, 3}; the local grad is the input value.
    for rank, (grad, placements, tp_index) in enumerate(results):
        expected = [(0 + 2) / 2] * 4 if tp_index == 0 else [(1 + 3) / 2] * 4
        assert grad == expected, f"rank {rank}"
        assert "Shard(dim=0)" in repr(placements)


class _FailOnce(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("injected backward failure")
        return grad


class _Fragile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.last = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(_FailOnce.apply(self.first(x)))


def _recovers_after_failed_backward() -> list[torch.Tensor]:
    rank = get_platform().rank()
    _FailOnce.armed = True
    model = data_parallel(_Fragile(), bucket_cap_mb=1e-5)  # one bucket per parameter
    x = torch.full((2, 4), float(rank + 1))
    try:
        model(x).sum().backward()  # `last` buckets launched, then the failure
    except RuntimeError:
        pass
    model.zero_grad()
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_backward_that_raised_does_not_poison_the_next_one(run_on_ranks):
    g0, g1 = run_on_ranks(2, _recovers_after_failed_backward)
    ref = _Fragile()
    _FailOnce.armed = False
    for rank in range(2):
        ref(torch.full((2, 4), float(rank + 1))).sum().backward()
    for a, b, r in zip(g0, g1, ref.parameters(), strict=True):
        torch.testing.assert_close(a, r.grad / 2)
        torch.testing.assert_close(b, r.grad / 2)


class _ShardedOverDp(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        from hyperpar.dtensor import Shard, distribute_tensor

        self.w = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))


def _sharded_over_dp_is_refused() -> str:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    try:
        data_parallel(_ShardedOverDp(mesh), mesh, "dp")
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_parameter_sharded_over_the_dp_dimension_is_refused(run_on_ranks):
    msg = run_on_ranks(2, _sharded_over_dp_is_refused)[0]
    assert "'w'" in msg and "Shard(dim=0)" in msg and "'dp'" in msg


def _tp_after_dp_is_caught() -> str:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    model = data_parallel(nn.Sequential(nn.Linear(4, 4)))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})  # wrong order
    try:
        model(torch.ones(1, 4))
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_parameters_replaced_after_wrapping_are_reported_at_forward(run_on_ranks):
    msg = run_on_ranks(2, _tp_after_dp_is_caught)[0]
    assert "replaced after data_parallel()" in msg and "parallelize_module" in msg


def _grads_across_steps(world_batch: int) -> tuple[list, list, list]:
    """Step 0's averaged grads, step 1 without zero_grad (grads accumulate), then step 2 after
    zero_grad(set_to_none=True); and the .grad tensors of step 1, kept by reference."""
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    model = data_parallel(_model(), bucket_cap_mb=0.0002)  # several buckets
    per = world_batch // world
    rows = slice(rank * per, (rank + 1) * per)

    def backward(step: int) -> list[torch.Tensor]:
        x, y = _batch(step)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        return [p.grad.clone() for p in model.parameters()]

    first = backward(0)
    accumulated = backward(1)  # onto step 0's averages
    kept = [p.grad for p in model.parameters()]  # references, not copies
    model.zero_grad(set_to_none=True)
    third = backward(2)
    return first, accumulated, third, [g.clone() for g in kept]


def _reference_grads(step: int) -> list[torch.Tensor]:
    model = _model()
    x, y = _batch(step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_kept_grads_stay_and_accumulation_without_zero_grad_sums_the_averages(run_on_ranks):
    ref = [_reference_grads(s) for s in range(3)]
    for first, accumulated, third, kept in run_on_ranks(2, _grads_across_steps, BATCH):
        for i, r in enumerate(ref[0]):
            torch.testing.assert_close(first[i], r)
            torch.testing.assert_close(accumulated[i], r + ref[1][i])
            torch.testing.assert_close(third[i], ref[2][i])
            # a .grad kept past zero_grad(set_to_none=True) is not overwritten by the next
            # backward (each backward packs into fresh buckets)
            torch.testing.assert_close(kept[i], accumulated[i], rtol=0, atol=0)


class _WithUnused(nn.Module):
    """``spare`` is used by no rank; ``side`` by rank 1 only (when ``use_side``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Linear(8, 4)
        self.side = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        return self.main(x) + (self.side(x) if use_side else 0.0)


def _unused_training(world: int) -> tuple[list[bool], dict[str, torch.Tensor]]:
    """AdamW (weight decay on) for 3 steps; returns which grads were None after the first
    backward, and the final state. In one process (``world == 1``) rank 1's batch half runs
    through ``side`` as a separate loss term, so both sides see the same sum."""
    platform = get_platform()
    rank = platform.rank() if world > 1 else 0
    model = _WithUnused()
    if world > 1:
        model = data_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    none_after_first: list[bool] = []
    for step in range(3):
        x, y = _batch(step)
        y = y[:, :4]
        halves = [(x[:BATCH // 2], y[:BATCH // 2], False), (x[BATCH // 2:], y[BATCH // 2:], True)]
        if world > 1:
            xs, ys, side = halves[rank]
            loss = nn.functional.mse_loss(model(xs, side), ys)
        else:  # the dp average of the two halves' losses
            loss = sum(nn.functional.mse_loss(model(xs, side), ys) for xs, ys, side in halves) / 2
        loss.backward()
        if step == 0:
            none_after_first = [p.grad is None for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return none_after_first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_parameter_unused_on_every_rank_keeps_grad_none_like_one_process(run_on_ranks):
    """A parameter no rank uses keeps ``.grad is None`` (it used to become zeros, so AdamW's
    weight decay moved it); the training matches one process on the full batch."""
    ref_none, ref_state = _unused_training(1)
    assert ref_none == [False, False, False, False, True, True]  # spare: no grad
    for none, state in run_on_ranks(2, _unused_training, 2):
        assert none == ref_none
        assert torch.equal(state["spare.weight"], _WithUnused().spare.weight.detach())
        assert_close_to_reference(state, ref_state, what="dp2 state with unused parameters")


def _missing_queue_callback() -> str:
    """data_parallel on a torch whose autograd engine lacks queue_callback (simulated by
    swapping the engine object for one without it, in this rank only)."""

    class _EngineWithoutCallback:
        pass

    variable = torch.autograd.Variable
    engine = variable._execution_engine
    variable._execution_engine = _EngineWithoutCallback()
    try:
        data_parallel(_model())
    except RuntimeError as exc:
        return str(exc)
    finally:
        variable._execution_engine = engine
    return "no error"


def test_missing_engine_callback_is_an_error_not_wrong_gradients(run_on_ranks):
    for message in run_on_ranks(2, _missing_queue_callback):
        assert "queue_callback" in message and "torch version" in message, message
