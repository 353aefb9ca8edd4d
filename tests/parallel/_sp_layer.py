"""One Llama TransformerBlock under tensor + sequence parallelism, for the tests of the
column-parallel boundary that saves its input's shard (``reshard_input_after_forward``)."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel._tp_llama import llama, plans

ARGS = llama.ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, ffn_hidden=64,
                       max_seq_len=16)


def block_plan(styles: Any = None) -> dict[str, Any]:
    """The torchtitan TP+SP plan of one block (``layers.*.`` stripped)."""
    plan = plans.tp_sp_plan(styles)
    return {k[len("layers.*."):]: v for k, v in plan.items() if k.startswith("layers.*.")}


def block(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return llama.TransformerBlock(ARGS)


def inputs(batch: int, seq: int, rank: int, world: int) -> torch.Tensor:
    """This rank's sequence shard of one fixed input (the block's input is ``Shard(1)``)."""
    x = torch.randn(batch, seq, ARGS.dim, generator=torch.Generator().manual_seed(1))
    return x.chunk(world, dim=1)[rank].contiguous().requires_grad_()


def rope(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return llama.rope_tables(ARGS.head_dim, seq, ARGS.rope_theta)
