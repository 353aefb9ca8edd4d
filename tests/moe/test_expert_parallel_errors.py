"""Bad expert-parallel input gets a clear error on every rank, before the token all-to-all:
each case runs on 2 real ranks, every rank catches what it raised and returns it, so a case
where one rank raised and the other waited would time out instead of passing."""

from __future__ import annotations

import pytest
import torch

from tests.moe.test_expert_parallel import DIM, GroupedExperts, MoE


def _caught(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what each rank raised
        return type(exc).__name__, str(exc)
    return "", "no error"


def _parallelize(experts_per_rank: tuple[int, int] = (4, 4), mesh_names=("ep",)) -> tuple:
    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    rank = get_platform().rank()
    torch.manual_seed(0)
    experts = GroupedExperts(experts_per_rank[rank])
    shape = (2,) if len(mesh_names) == 1 else (1, 2)
    mesh = init_device_mesh(shape, mesh_dim_names=mesh_names)
    return rank, experts, lambda: parallelize_module(experts, mesh, ExpertParallel())


def _config_case(case: str) -> tuple[str, str]:
    if case == "not_divisible":
        _, _, go = _parallelize((3, 3))
    elif case == "no_ep_dim":
        _, _, go = _parallelize(mesh_names=("dp", "tp"))
    else:  # experts differ across ranks
        _, _, go = _parallelize((4, 2))
    return _caught(go)


@pytest.mark.parametrize("case,error,words", [
    ("not_divisible", "MoEConfigError", "num_experts=3 is not divisible by the expert-parallel "
                                        "degree ep=2"),
    ("no_ep_dim", "MoEConfigError", "needs a mesh dimension named 'ep'"),
    ("differ", "MoEConfigError", "the experts' parameters differ across ranks"),
])
def test_bad_configuration_raises_on_every_rank(run_on_ranks, case, error, words):
    for name, msg in run_on_ranks(2, _config_case, case, timeout_s=60):
        assert name == error and words in msg, msg


def _input_case(case: str) -> tuple[str, str]:
    rank, experts, go = _parallelize()
    go()
    rows = 5
    x = torch.randn(rows, DIM)
    counts = torch.tensor([2, 1, 0, 2])
    if rank == 1 and case == "nan":
        x[3, 1] = float("nan")
    if rank == 1 and case == "counts":
        counts = torch.tensor([2, 1, 0, 1])  # 4 rows described, 5 given
    if rank == 1 and case == "hidden":
        x = torch.randn(rows, DIM + 1)
    if rank == 1 and case == "length":
        counts = torch.tensor([2, 1, 2])
    return _caught(lambda: experts(x, counts))


@pytest.mark.parametrize("case,words", [
    ("nan", "ep rank 1: routed_input contains NaN"),
    ("counts", "ep rank 1: num_tokens_per_expert does not sum to routed_input's rows"),
    ("hidden", "ep rank 1: routed_input is not (tokens, dim) with the experts' dim"),
    ("length", "ep rank 1: num_tokens_per_expert has a different length"),
])
def test_bad_routed_input_on_one_rank_raises_on_every_rank(run_on_ranks, case, words):
    for name, msg in run_on_ranks(2, _input_case, case, timeout_s=60):
        assert name == "MoERoutingError" and words in msg, msg


def _nan_scores() -> tuple[str, str]:
    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    torch.manual_seed(0)
    model = MoE(4)
    mesh = init_device_mesh((2,), mesh_dim_names=("ep",))
    parallelize_module(model, mesh, {"experts": ExpertParallel()})
    x = torch.randn(6, DIM)
    if get_platform().rank() == 1:
        x[2] = float("nan")  # NaN router scores on rank 1 only; tokens weighted after experts
    return _caught(lambda: model(x))


def test_nan_router_scores_on_one_rank_are_named_on_every_rank(run_on_ranks):
    results = run_on_ranks(2, _nan_scores, timeout_s=60)
    for name, msg in results:
        assert name == "MoERoutingError" and "ep rank 1: router scores contain NaN" in msg, msg
    assert "first at token 2" in results[1][1]


def test_nan_router_scores_raise_at_once_without_expert_parallel():
    from hyperpar.moe import MoERoutingError

    x = torch.randn(4, DIM)
    x[1] = float("nan")
    with pytest.raises(MoERoutingError, match="router scores contain .* first at token 1"):
        MoE(4)(x)


def _dense_style_without_tp() -> tuple[str, str]:
    from hyperpar import ColwiseParallel, ExpertParallel, init_device_mesh, parallelize_module

    torch.manual_seed(0)
    model = MoE(4, dense=True)
    mesh = init_device_mesh((1, 2), mesh_dim_names=("dp", "ep"))
    return _caught(lambda: parallelize_module(
        model, mesh, {"dense": ColwiseParallel(), "experts": ExpertParallel()}))


def test_a_dense_style_beside_expert_parallel_still_needs_a_tp_dim(run_on_ranks):
    # the expert styles take their own dims; the dense ones still resolve "tp" as before
    for name, msg in run_on_ranks(2, _dense_style_without_tp, timeout_s=60):
        assert name == "MeshDimError" and "'tp'" in msg, msg
