"""Context parallelism (``hyperpar.parallel.context_parallel``) against plain torch in one process.

The example Llama (``examples/llama/model.py``: causal SDPA, RoPE buffers) runs with its tokens,
labels and RoPE tables sharded over cp = 2 and cp = 4 real gloo ranks; gradients are averaged
over cp by ``data_parallel`` (or ``fully_shard``) on the cp mesh. Loss, logits (gathered and put
back in order) and every parameter gradient are compared with the same model in one process,
for several AdamW steps (gradients compared before each step). The attention itself is also
checked alone, causal and not, in both shard orders, forward and backward.

Tolerance: float32 everywhere (eps 1.2e-7). The only differences from the reference are the
order of summations: softmax over the gathered keys with an explicit mask instead of the fused
causal kernel, and gradients summed over ranks (reduce-scatter of dK/dV, the cp average). Each
such sum has at most a few hundred O(1) terms here, so a bound of a few hundred eps (~1e-5)
times the tensor's scale holds on any x86 CPU; the errors seen are ~2e-7.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tp_llama import llama

from hyperpar.dtensor import DTensor, init_device_mesh
from hyperpar.parallel import (
    ContextParallelError,
    context_parallel,
    context_parallel_unshard,
    data_parallel,
)
from hyperpar.platform import get_platform

STEPS = 3
RTOL = 1e-4


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(1.0, expected.detach().abs().max().item())
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=RTOL, atol=1e-5 * scale,
                               msg=lambda m: f"{what}: {m}")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _cp_mesh():
    return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("cp",))


def _llama_against_reference(reduce_with: str = "data_parallel",
                             load_balance: bool = True) -> float:
    """Train the example Llama with cp = world size for STEPS AdamW steps next to the same model
    in one process; return the largest gradient difference seen."""
    platform = get_platform()
    args = llama.ModelArgs.tiny()  # max_seq_len 16: the RoPE tables are as long as the batch
    reference, model = llama.build(args, seed=0), llama.build(args, seed=0)
    mesh = _cp_mesh()
    if reduce_with == "data_parallel":
        data_parallel(model, mesh, "cp")
    else:
        from hyperpar.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(STEPS):
        tokens, labels = llama.batch(args, batch_size=2, seed=step)
        ref_logits = reference(tokens)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
        ref_loss.backward()

        with context_parallel(mesh, buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                              buffer_seq_dims=[1, 1, 0, 0], load_balance=load_balance):
            assert tokens.shape[1] == args.max_seq_len // mesh.size()
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            (full_logits,) = context_parallel_unshard(mesh, [logits], [1],
                                                      load_balance=load_balance)
        # buffers restored on exit
        assert tokens.shape[1] == args.max_seq_len == model.rope_cos.shape[0]
        total = loss.detach().clone()
        platform.all_reduce(total, "avg", mesh.get_group())

        _close(total, ref_loss, f"step {step} loss")
        _close(full_logits, ref_logits, f"step {step} logits")
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            grad, ref_grad = _full(param.grad), ref_params[name].grad
            _close(grad, ref_grad, f"step {step} grad of {name}")
            worst = max(worst, (grad - ref_grad).abs().max().item())
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    return worst


@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_matches_single_process_through_adamw_steps(run_on_ranks, world_size):
    run_on_ranks(world_size, _llama_against_reference)


def test_llama_contiguous_order_matches_single_process(run_on_ranks):
    run_on_ranks(2, _llama_against_reference, "data_parallel", False)


def test_llama_with_fully_shard_over_cp_matches_single_process(run_on_ranks):
    run_on_ranks(2, _llama_against_reference, "fully_shard")


def _dp_by_cp_against_reference(reduce_with: str = "data_parallel") -> None:
    """4 ranks as dp = 2 x cp = 2: each dp replica takes one batch row; gradients are averaged
    over the flattened (dp, cp) mesh by ``data_parallel``, or by ``fully_shard`` sharding every
    parameter 4 ways over it (torchtitan's ``dp_shard_cp``), through STEPS AdamW steps."""
    platform = get_platform()
    args = llama.ModelArgs.tiny()
    reference, model = llama.build(args, seed=0), llama.build(args, seed=0)
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "cp"))
    if reduce_with == "data_parallel":
        data_parallel(model, mesh.flatten("dp_cp"), "dp_cp")
    else:
        from hyperpar.fsdp import fully_shard

        flat = mesh["dp", "cp"].flatten("dp_shard_cp")
        for layer in model.layers:
            fully_shard(layer, mesh=flat)
        fully_shard(model, mesh=flat)
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local * 4 == sum(p.numel() for p in reference.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        tokens, labels = llama.batch(args, batch_size=2, seed=5 + step)
        ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten())
        ref_loss.backward()
        row = mesh.get_local_rank("dp")
        tokens, labels = tokens[row:row + 1].clone(), labels[row:row + 1].clone()
        with context_parallel(mesh["cp"], buffers=[tokens, labels, model.rope_cos,
                                                   model.rope_sin],
                              buffer_seq_dims=[1, 1, 0, 0]):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
        total = loss.detach().clone()
        platform.all_reduce(total, "avg")
        _close(total, ref_loss, f"step {step} loss")
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            _close(_full(param.grad), ref_params[name].grad, f"step {step} grad of {name}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()


@pytest.mark.parametrize("reduce_with", ["data_parallel", "fully_shard"])
def test_dp_by_cp_on_four_ranks_matches_single_process(run_on_ranks, reduce_with):
    run_on_ranks(4, _dp_by_cp_against_reference, reduce_with)


def _attention_against_reference(causal: bool, load_balance: bool, gqa: bool) -> None:
    """The attention alone: q, k, v and the upstream gradient sharded like buffers."""
    platform = get_platform()
    mesh = _cp_mesh()
    gen = torch.Generator().manual_seed(7)
    kv_heads = 2 if gqa else 4
    q = torch.randn(2, 4, 16, 8, generator=gen)
    k = torch.randn(2, kv_heads, 16, 8, generator=gen)
    v = torch.randn(2, kv_heads, 16, 8, generator=gen)
    up = torch.randn(2, 4, 16, 8, generator=gen)
    extra = {"enable_gqa": True} if gqa else {}
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=causal, **extra)
    ref_out.backward(up)
    with context_parallel(mesh, buffers=[q, k, v, up], buffer_seq_dims=[2, 2, 2, 2],
                          load_balance=load_balance):
        lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, **extra)
        out.backward(up)
        got = context_parallel_unshard(mesh, [out, lq.grad, lk.grad, lv.grad], [2, 2, 2, 2],
                                       load_balance=load_balance)
    what = f"causal={causal} load_balance={load_balance} gqa={gqa} cp={platform.world_size()}"
    for name, a, e in zip(("out", "dq", "dk", "dv"), got,
                          (ref_out, ref_q.grad, ref_k.grad, ref_v.grad), strict=True):
        _close(a, e, f"{what}: {name}")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["head_tail", "contiguous"])
def test_attention_forward_backward_matches_one_process(run_on_ranks, world_size, causal,
                                                        load_balance):
    run_on_ranks(world_size, _attention_against_reference, causal, load_balance, False)


def test_attention_with_grouped_query_heads(run_on_ranks):
    run_on_ranks(2, _attention_against_reference, True, True, True)


# ------------------------------------------------------------------ bad input

def _bad_input(case: str) -> str:
    """Provoke one error on this rank; return its message (every rank must raise it)."""
    mesh = _cp_mesh()
    x = torch.zeros(2, 16)
    original_sdpa = F.scaled_dot_product_attention
    q = torch.zeros(1, 2, 16, 4)
    try:
        if case == "seq_not_divisible":
            with context_parallel(mesh, buffers=[torch.zeros(2, 14)], buffer_seq_dims=[1]):
                pass
        elif case == "seq_not_divisible_unbalanced":
            with context_parallel(mesh, buffers=[torch.zeros(2, 15)], buffer_seq_dims=[1],
                                  load_balance=False):
                pass
        elif case == "dim_out_of_range":
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
                pass
        elif case == "dims_count":
            with context_parallel(mesh, buffers=[x, x], buffer_seq_dims=[1]):
                pass
        elif case == "lengths_differ":
            with context_parallel(mesh, buffers=[x, torch.zeros(32, 4)], buffer_seq_dims=[1, 0]):
                pass
        elif case == "mesh_2d":
            two_d = init_device_mesh((1, get_platform().world_size()),
                                     mesh_dim_names=("dp", "cp"))
            with context_parallel(two_d, buffers=[x], buffer_seq_dims=[1]):
                pass
        elif case == "parameter":
            with context_parallel(mesh, buffers=[torch.nn.Parameter(x)], buffer_seq_dims=[1]):
                pass
        elif case == "no_restore_not_subset":
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1],
                                  no_restore_buffers={torch.zeros(1)}):
                pass
        elif case == "not_contiguous":
            with context_parallel(mesh, buffers=[torch.zeros(16, 2).t()], buffer_seq_dims=[1]):
                pass
        elif case == "nested":
            with context_parallel(mesh), context_parallel(mesh):
                pass
        elif case == "attn_mask":
            with context_parallel(mesh):
                F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16, dtype=bool))
        elif case == "dropout":
            with context_parallel(mesh):
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        elif case == "unsharded_query":
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
        elif case == "cross_attention":
            with context_parallel(mesh):
                F.scaled_dot_product_attention(q, q[:, :, :8], q[:, :, :8])
        else:
            raise AssertionError(case)
    except ContextParallelError as err:
        # the context left nothing patched and the buffer whole
        assert F.scaled_dot_product_attention is original_sdpa
        assert x.shape == (2, 16)
        return str(err)
    raise AssertionError(f"{case}: no ContextParallelError")


@pytest.mark.parametrize(("case", "says"), [
    ("seq_not_divisible", ["sequence length 14", "2 x cp", "load_balance=False"]),
    ("seq_not_divisible_unbalanced", ["sequence length 15", "pad the sequence"]),
    ("dim_out_of_range", ["buffer_seq_dims[0] = 2", "out of range", "(2, 16)"]),
    ("dims_count", ["2 buffers but 1 buffer_seq_dims"]),
    ("lengths_differ", ["buffers[1] has 32 positions", "slice"]),
    ("mesh_2d", ["1-D DeviceMesh", "mesh['cp']"]),
    ("parameter", ["parameter", "never parameters"]),
    ("no_restore_not_subset", ["subset of buffers"]),
    ("not_contiguous", ["buffers[0] (shape (2, 16)) is not contiguous", ".contiguous()"]),
    ("nested", ["already active", "do not nest"]),
    ("attn_mask", ["attn_mask", "is_causal=True"]),
    ("dropout", ["dropout_p = 0.1", "dropout_p=0.0"]),
    ("unsharded_query", ["16 positions", "buffers="]),
    ("cross_attention", ["self-attention", "16, 8, 8"]),
])
def test_bad_input_raises_on_every_rank_with_the_fix(run_on_ranks, case, says):
    messages = run_on_ranks(2, _bad_input, case)
    assert len(messages) == 2 and messages[0] == messages[1], messages
    for words in says:
        assert words in messages[0], (words, messages[0])


# ------------------------------------------------------------------ torch's shard order

def _gathered_positions(load_balance: bool) -> list[int]:
    """Which positions each rank holds inside the context, concatenated in rank order."""
    mesh = _cp_mesh()
    positions = torch.arange(16)
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0],
                          load_balance=load_balance):
        return get_platform().all_gather_along(positions, 0, mesh.get_group()).tolist()


@pytest.mark.parametrize("world_size", [2, 4])
def test_head_tail_order_is_torchs_default_order(run_on_ranks, world_size):
    """torch's context_parallel cannot run on CPU (no sharding rule for the CPU flash-attention
    op in 2.13), so the shard *order* is compared with torch's own load balancer."""
    balancer_module = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._load_balancer",
        reason="this torch has no context-parallel load balancer to compare with")
    head_tail = getattr(balancer_module, "_HeadTailLoadBalancer", None)
    if head_tail is None:
        pytest.skip("this torch's context-parallel module has no _HeadTailLoadBalancer")
    balancer = head_tail(16, world_size, torch.device("cpu"))
    torch_order = balancer._generate_indices()[0].tolist()
    assert run_on_ranks(world_size, _gathered_positions, True)[0] == torch_order
    assert run_on_ranks(world_size, _gathered_positions, False)[0] == list(range(16))
