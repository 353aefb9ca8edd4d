"""Offset-based random numbers: a sharded tensor gets the values of the full tensor made in one
process with the same seed, on every backend."""

import torch

from hyperpar.testing import assert_close_to_reference


def _random_values(mesh_shape, placements):
    import torch.nn.functional as F

    from hyperpar.dtensor import distribute_tensor, init_device_mesh, manual_seed, rand, randn

    mesh = init_device_mesh(mesh_shape)
    manual_seed(1234)
    u = rand(5, 6, device_mesh=mesh, placements=placements).full_tensor()
    n = randn(5, 6, device_mesh=mesh, placements=placements).full_tensor()
    x = distribute_tensor(torch.ones(5, 6), mesh, placements)
    d = F.dropout(x, p=0.5, training=True).full_tensor()
    w = distribute_tensor(torch.zeros(5, 6), mesh, placements)
    torch.nn.init.normal_(w, mean=1.0, std=0.5)
    torch.nn.init.uniform_(x, -2.0, 2.0)
    like = torch.rand_like(x).full_tensor()
    return u, n, d, w.full_tensor(), x.full_tensor(), like


def _reference():
    from hyperpar.dtensor import random

    random.manual_seed(1234)
    u, n = random.rand(5, 6), random.randn(5, 6)
    d = random.dropout(torch.ones(5, 6), p=0.5)
    w = 1.0 + 0.5 * random.randn(5, 6)
    x = -2.0 + 4.0 * random.rand(5, 6, dtype=torch.float64)
    like = random.rand(5, 6)
    return u, n, d, w, x.float(), like


def _check(results):
    expected = _reference()
    for per_rank in results:
        assert_close_to_reference(list(per_rank), list(expected), rtol=1e-6, atol=1e-6)


def test_sharded_random_values_equal_the_full_tensor_made_in_one_process(run_on_ranks):
    from hyperpar.dtensor import Replicate, Shard

    _check(run_on_ranks(2, _random_values, (2,), [Shard(0)]))
    _check(run_on_ranks(2, _random_values, (2,), [Replicate()]))


def test_random_values_do_not_depend_on_the_2d_layout(run_on_ranks):
    from hyperpar.dtensor import Shard

    _check(run_on_ranks(4, _random_values, (2, 2), [Shard(1), Shard(0)]))


def test_generator_is_uniform_and_normal_in_distribution():
    from hyperpar.dtensor import random

    random.manual_seed(0)
    u = random.rand(100_000)
    n = random.randn(100_000)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(n.mean())) < 0.02
    assert abs(float(n.std()) - 1.0) < 0.02
    assert not torch.equal(random.rand(10), random.rand(10))  # the offset advances


def test_dropout_keeps_about_one_minus_p_and_rescales():
    from hyperpar.dtensor import random

    random.manual_seed(3)
    out = random.dropout(torch.ones(10_000), p=0.25)
    kept = out != 0
    assert abs(float(kept.float().mean()) - 0.75) < 0.02
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.75))
