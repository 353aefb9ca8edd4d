"""``reshard_input_after_forward`` beyond the plain plan: Megatron's
``ColumnParallelLinear(sequence_parallel=True)``, ``fully_shard`` x TP+SP, ``torch.compile``, and
the neutral rule that decides it (every framework). Values are compared with ``torch.equal``
against the keep-gathered path (same kernels, same order: see test_reshard_input.py)."""

from __future__ import annotations

import pytest
import torch

from hyperpar.parallel.spec import RESHARD_INPUT_DEFAULT, reshard_input
from hyperpar.testing.harness import run_distributed


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _megatron_layer():
    """Megatron's layer (default switch) and a Linear under ColwiseParallel(Shard(1), keep)."""
    from torch import nn

    from hyperpar import ColwiseParallel, Shard, init_device_mesh, parallelize_module
    from hyperpar.parallel import ColumnParallelLinear
    from hyperpar.platform import get_platform
    from hyperpar.torch.parallel.memory import SavedBytes

    p = get_platform()
    rank, world = p.rank(), p.world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 24, sequence_parallel=True, device_mesh=mesh)
    torch.manual_seed(0)
    plain = nn.Linear(16, 24)
    parallelize_module(plain, mesh, ColwiseParallel(input_layouts=Shard(1),
                                                    reshard_input_after_forward=False))
    full = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    out = []
    for m in (layer, plain):
        x = full.chunk(world, 1)[rank].contiguous().requires_grad_()
        with SavedBytes(exclude=[_local(q) for q in m.parameters()]) as saved:
            y = m(x)
        (y * y).sum().backward()
        out.append((saved.nbytes, y.detach(), x.grad,
                    [_local(q.grad).clone() for q in m.parameters()]))
    return out


@pytest.mark.skipif(not RESHARD_INPUT_DEFAULT, reason="the default keeps the gathered input")
def test_megatron_column_layer_saves_the_shard_by_default():
    for (shard, keep) in run_distributed(_megatron_layer, 2):
        assert torch.equal(shard[1], keep[1]) and torch.equal(shard[2], keep[2])
        assert all(torch.equal(a, b) for a, b in zip(shard[3], keep[3], strict=True))
        # the gathered (2, 8, 16) fp32 input is kept as its (2, 4, 16) shard
        assert keep[0] - shard[0] == 2 * 8 * 16 * 4 - 2 * 4 * 16 * 4


def _fsdp_block(reshard):
    from hyperpar import fully_shard, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform
    from tests.parallel._sp_layer import block, block_plan, inputs, rope

    p = get_platform()
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh["tp"].get_local_rank(0)
    dp_rank = mesh["dp"].get_local_rank(0)
    model = block()
    parallelize_module(model, mesh["tp"], block_plan(), reshard_input_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"])
    x = inputs(4, 8, tp_rank, 2)[2 * dp_rank:2 * dp_rank + 2].detach().requires_grad_()
    cos, sin = rope(8)
    for _ in range(2):  # the second step runs on re-gathered parameters
        y = _local(model(x, cos, sin))
        y.square().sum().backward()
    assert p.world_size() == 4
    return y.detach(), x.grad, [_local(q.grad).clone() for q in model.parameters()]


def _fsdp_both():
    return _fsdp_block(False), _fsdp_block(True)


def test_fully_shard_times_tp_sp_is_bit_identical():
    for a, b in run_distributed(_fsdp_both, 4):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert all(torch.equal(g, h) for g, h in zip(a[2], b[2], strict=True))


def _compiled_block():
    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform
    from tests.parallel._sp_layer import block, block_plan, inputs, rope

    p = get_platform()
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    eager, model = block(), block()
    parallelize_module(eager, mesh, block_plan(), reshard_input_after_forward=True)
    parallelize_module(model, mesh, block_plan(), reshard_input_after_forward=True)
    cos, sin = rope(8)
    x = inputs(2, 8, p.rank(), 2)
    torch._dynamo.reset()
    breaks = torch._dynamo.explain(model)(x, cos, sin).graph_break_count
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y = _local(compiled(x, cos, sin))
    ref = _local(eager(x.detach().clone(), cos, sin))
    return int(breaks), (y - ref).abs().max().item()


def test_compile_has_no_graph_break_with_the_switch_on():
    """Compiled, AOTAutograd decides what the graph saves (the hooks stay out of the graph):
    0 graph breaks, and the same output as eager (aot_eager runs the same aten ops: fp32
    differences only from op fusion order, < 1e-5)."""
    for breaks, diff in run_distributed(_compiled_block, 2):
        assert breaks == 0
        assert diff < 1e-5


def test_switch_rule_style_then_call_then_default():
    assert reshard_input(None, None, True) is RESHARD_INPUT_DEFAULT
    assert reshard_input(None, False, True) is False
    assert reshard_input(True, False, True) is True
    assert reshard_input(False, True, True) is False


def test_switch_refused_where_the_mechanics_cannot():
    assert reshard_input(None, None, False) is False  # the default falls back, stated in docs
    assert reshard_input(False, None, False) is False
    with pytest.raises(NotImplementedError, match="keep the gathered input"):
        reshard_input(True, None, False)
    with pytest.raises(NotImplementedError):
        reshard_input(None, True, False)
    with pytest.raises(TypeError, match="True, False or None"):
        reshard_input("yes", None, True)


def test_style_repr_and_argument():
    from hyperpar import ColwiseParallel

    assert "reshard" not in repr(ColwiseParallel())
    style = ColwiseParallel(reshard_input_after_forward=False)
    assert "reshard_input_after_forward=False" in repr(style)
    assert style.resolved_reshard_input() is False
    with pytest.raises(TypeError):
        ColwiseParallel(reshard_input_after_forward=1)
