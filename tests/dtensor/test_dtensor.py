"""DTensor basics on real ranks: construction, conversion, metadata, use as a parameter."""

import torch

from hyperpar.testing import assert_close_to_reference


def _from_local_facts():
    from hyperpar.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh((2,))
    rank = mesh.get_local_rank()
    local = torch.full((3 - rank, 2), float(rank))  # rank 0: 3 rows, rank 1: 2 rows
    even = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(1)])
    uneven = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 2))
    try:  # torch's rule: run_check without shape= needs equal local shapes on every rank
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
        checked = "no error"
    except ValueError as err:
        checked = str(err)
    partial = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])
    replica = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Replicate()],
                                 run_check=True)
    return {
        "even": (tuple(even.shape), even.placements, even.to_local().shape),
        "uneven": uneven.full_tensor(), "checked": checked,
        "partial": partial.full_tensor(), "replica": replica.to_local(),
        "meta": (even.dtype, even.ndim, even.size(1), even.numel(), len(even),
                 even.device_mesh == mesh, even.device == torch.ones(1).device),
    }


def test_from_local_infers_even_global_shape_and_run_check_refuses_uneven_shards(run_on_ranks):
    from hyperpar.dtensor import Shard

    for f in run_on_ranks(2, _from_local_facts):
        assert f["even"] == ((2, 8), (Shard(1),), torch.Size([2, 4]))
        assert_close_to_reference(f["uneven"], torch.tensor([[0.0] * 2] * 3 + [[1.0] * 2] * 2))
        assert "local shapes disagree" in f["checked"] and "shape=" in f["checked"]
        assert_close_to_reference(f["partial"], torch.tensor([3.0, 3.0]))
        assert_close_to_reference(f["replica"], torch.tensor([0.0, 0.0]))  # rank 0's copy
        assert f["meta"] == (torch.float32, 2, 8, 16, 2, True, True)


def _to_local_grad_placements():
    from hyperpar.dtensor import Partial, Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    x = distribute_tensor(torch.arange(4.0, requires_grad=True), mesh, [Replicate()])
    rank = mesh.get_local_rank()
    # each rank uses its replica for a different term: gradients are partial sums
    (x.to_local(grad_placements=[Partial()]) * (rank + 1)).sum().backward()
    return x.grad.to_local(), x.grad.placements


def test_to_local_grad_placements_partial_sums_the_gradient_of_a_replica(run_on_ranks):
    from hyperpar.dtensor import Replicate

    for grad, placements in run_on_ranks(2, _to_local_grad_placements):
        assert_close_to_reference(grad, torch.full((4,), 3.0))
        assert placements == (Replicate(),)


def _train(steps, placements, optimizer):
    from hyperpar.dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    torch.manual_seed(0)
    w = torch.randn(5, 3)
    x = torch.randn(4, 3)
    param = torch.nn.Parameter(distribute_tensor(w, mesh, placements))
    opt = getattr(torch.optim, optimizer)([param], lr=0.1)
    for _ in range(steps):
        loss = (x @ param.full_tensor().t()).pow(2).mean()
        loss.backward()
        assert type(param.grad).__name__ == "DTensor" and param.grad.placements == param.placements
        opt.step()
        opt.zero_grad()
    return param.full_tensor().detach(), isinstance(param, torch.nn.Parameter)


def _reference(steps, optimizer):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    x = torch.randn(4, 3)
    opt = getattr(torch.optim, optimizer)([w], lr=0.1)
    for _ in range(steps):
        (x @ w.t()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return w.detach()


def test_a_sharded_parameter_trains_like_the_full_parameter_with_sgd_and_adam(run_on_ranks):
    from hyperpar.dtensor import Shard

    for optimizer in ("SGD", "Adam", "AdamW"):
        expected = _reference(3, optimizer)
        for got, is_param in run_on_ranks(2, _train, 3, [Shard(0)], optimizer):
            assert is_param
            assert_close_to_reference(got, expected, what=optimizer)


def _module_with_dtensor_parameter():
    import copy

    from hyperpar.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    lin = torch.nn.Linear(3, 4)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    names = [n for n, _ in lin.named_parameters()]
    clone = copy.deepcopy(lin)
    return names, type(clone.weight).__name__, clone.weight.placements


def test_dtensor_parameters_register_on_modules_and_survive_deepcopy(run_on_ranks):
    from hyperpar.dtensor import Shard

    names, kind, placements = run_on_ranks(2, _module_with_dtensor_parameter)[0]
    assert names == ["weight", "bias"] and kind == "DTensor" and placements == (Shard(0),)


def _distribute_uses_source_rank():
    from hyperpar.dtensor import Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    mine = torch.full((2,), float(mesh.get_local_rank()))
    return (distribute_tensor(mine, mesh, [Replicate()]).to_local(),
            distribute_tensor(mine, mesh, [Replicate()], src_data_rank=1).to_local(),
            distribute_tensor(mine, mesh, [Replicate()], src_data_rank=None).to_local())


def test_distribute_tensor_takes_the_data_of_src_data_rank(run_on_ranks):
    for rank, (r0, r1, own) in enumerate(run_on_ranks(2, _distribute_uses_source_rank)):
        assert r0.tolist() == [0.0, 0.0] and r1.tolist() == [1.0, 1.0]
        assert own.tolist() == [float(rank)] * 2


def _tp_mlp_step():
    import torch.nn.functional as F

    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    x, t = torch.randn(8, 6), torch.randint(0, 5, (8,))
    w1, w2 = torch.randn(16, 6), torch.randn(5, 16)
    # data parallel over "dp", Megatron column/row parallel over "tp"
    dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    dt = distribute_tensor(t, mesh, [Shard(0), Replicate()])
    p1 = torch.nn.Parameter(distribute_tensor(w1, mesh, [Replicate(), Shard(0)]))
    p2 = torch.nn.Parameter(distribute_tensor(w2, mesh, [Replicate(), Shard(1)]))
    loss = F.cross_entropy(F.linear(F.relu(F.linear(dx, p1)), p2), dt)
    loss.backward()
    g1, g2 = torch.autograd.grad(
        F.cross_entropy(F.linear(F.relu(F.linear(dx, p1)), p2), dt), [p1, p2])
    return (loss.full_tensor().detach(), p1.grad.full_tensor(), p2.grad.full_tensor(),
            g1.full_tensor(), g2.full_tensor(), p1.grad.placements)


def test_a_2d_data_and_tensor_parallel_mlp_step_matches_one_process(run_on_ranks):
    import torch.nn.functional as F

    from hyperpar.dtensor import Replicate, Shard

    torch.manual_seed(0)
    x, t = torch.randn(8, 6), torch.randint(0, 5, (8,))
    w1 = torch.randn(16, 6, requires_grad=True)
    w2 = torch.randn(5, 16, requires_grad=True)
    loss = F.cross_entropy(F.linear(F.relu(F.linear(x, w1)), w2), t)
    loss.backward()
    for got in run_on_ranks(4, _tp_mlp_step):
        assert_close_to_reference(list(got[:5]),
                                  [loss.detach(), w1.grad, w2.grad, w1.grad, w2.grad],
                                  rtol=1e-4, atol=1e-5)
        assert got[5] == (Replicate(), Shard(0))


def _module_plumbing():
    from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6)
    x = torch.randn(3, 4)
    for name in ("weight", "bias"):
        full = getattr(lin, name).detach()
        setattr(lin, name, torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
    dx = distribute_tensor(x, mesh, [Replicate()])
    lin(dx).pow(2).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.5)
    grads = [p.grad.full_tensor() for p in lin.parameters()]
    state = {k: v.full_tensor() for k, v in lin.state_dict().items()}
    lin.load_state_dict({k: v * 2 for k, v in state.items()})
    loaded = lin.weight.full_tensor().detach()
    lin.double()
    return total.full_tensor(), grads, loaded, lin.weight.dtype, type(lin.weight).__name__


def test_clip_grad_norm_state_dict_and_dtype_casts_work_on_dtensor_modules(run_on_ranks):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6)
    x = torch.randn(3, 4)
    lin(x).pow(2).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.5)
    for got in run_on_ranks(2, _module_plumbing):
        assert_close_to_reference(got[0], total, rtol=1e-5, atol=1e-5)
        assert_close_to_reference(got[1], [lin.weight.grad, lin.bias.grad])
        assert_close_to_reference(got[2], lin.weight.detach() * 2)
        assert got[3:] == (torch.float64, "DTensor")


def _python_protocol():
    from hyperpar.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    x = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    rows = [row.full_tensor().tolist() for row in x]
    return (f"{x}".startswith("DTensor(local_tensor="), rows, torch.equal(x, x),
            torch.allclose(x, x + 1), x.sum().item(), float(x.amax()))


def test_dtensors_format_iterate_compare_and_convert_to_python_numbers(run_on_ranks):
    for got in run_on_ranks(2, _python_protocol):
        assert got == (True, [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], True, False, 15.0, 5.0)
