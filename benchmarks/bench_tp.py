"""Forward+backward step time of the example Llama model under tensor parallelism, 2 ranks:
hyperpar TP vs torch-native TP (torch.distributed.tensor.parallel) vs a hand-written
Megatron-style model calling raw torch.distributed collectives.

Run: ``python benchmarks/bench_tp.py [--ranks 2] [--rounds 5] [--sizes small,large] [--json F]``

All three run in the same processes on the same weights and batch (their losses are checked to
agree first), interleaved round by round so machine noise hits them alike; each figure is the
median over rounds of the per-step time. Ratios > 1 mean hyperpar is slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402  (reference side, outside the library)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from examples.llama import model as llama  # noqa: E402
from examples.llama import plan as plans  # noqa: E402

SIZES = {
    # overhead-bound: tiny matmuls, many boundaries
    "small": (llama.ModelArgs(vocab_size=512, dim=128, n_layers=2, n_heads=4, ffn_hidden=256,
                              max_seq_len=64), 4, 64),
    # compute-bound: matmuls dominate
    "large": (llama.ModelArgs(vocab_size=4096, dim=512, n_layers=2, n_heads=8, ffn_hidden=1408,
                              max_seq_len=256), 2, 256),
}


# ------------------------------------------------------------------ hand-written Megatron
class _Copy(torch.autograd.Function):  # f: identity / all-reduce
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _Reduce(torch.autograd.Function):  # g: all-reduce / identity
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherLast(torch.autograd.Function):  # all-gather last dim / keep own chunk
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(), -1)[dist.get_rank()].contiguous()


class MegatronLlama(nn.Module):
    """The same model, sharded by hand: local parameters, collectives at the Megatron points."""

    def __init__(self, full: llama.Transformer) -> None:
        super().__init__()
        n, r = dist.get_world_size(), dist.get_rank()
        self.full = full  # norms and rope tables are used as they are (replicated)

        def rows(w):
            return nn.Parameter(w.detach().chunk(n, 0)[r].clone())

        def cols(w):
            return nn.Parameter(w.detach().chunk(n, 1)[r].clone())

        self.vocab_start = r * (full.args.vocab_size // n)
        self.emb = rows(full.tok_embeddings.weight)
        self.blocks = nn.ModuleList()
        for layer in full.layers:
            a, m = layer.attention, layer.feed_forward
            block = nn.Module()
            block.wq, block.wk, block.wv = rows(a.wq.weight), rows(a.wk.weight), rows(a.wv.weight)
            block.wo = cols(a.wo.weight)
            block.w1, block.w3, block.w2 = rows(m.w1.weight), rows(m.w3.weight), cols(m.w2.weight)
            self.blocks.append(block)
        self.out = rows(full.output.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        full, hd = self.full, self.full.args.head_dim
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.emb.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.emb)
        h = _Reduce.apply(h.masked_fill(outside.unsqueeze(-1), 0.0))
        cos, sin = full.rope_cos, full.rope_sin
        for layer, blk in zip(full.layers, self.blocks, strict=True):
            b, s, _ = h.shape
            x = _Copy.apply(layer.attention_norm(h))
            q = F.linear(x, blk.wq).view(b, s, -1, hd)
            k = F.linear(x, blk.wk).view(b, s, -1, hd)
            v = F.linear(x, blk.wv).view(b, s, -1, hd)
            q, k = llama.apply_rope(q, cos[:s], sin[:s]), llama.apply_rope(k, cos[:s], sin[:s])
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            h = h + _Reduce.apply(F.linear(o.transpose(1, 2).reshape(b, s, -1), blk.wo))
            x = _Copy.apply(layer.ffn_norm(h))
            y = F.linear(F.silu(F.linear(x, blk.w1)) * F.linear(x, blk.w3), blk.w2)
            h = h + _Reduce.apply(y)
        return _GatherLast.apply(F.linear(_Copy.apply(full.norm(h)), self.out))


# ------------------------------------------------------------------ measurement
def _step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss


def _measure(size_names: list[str], rounds: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import parallelize_module
    from hyperpar.platform import get_platform

    n = get_platform().world_size()
    device = get_platform().device()  # models and batch on the backend's device (cuda: NCCL)
    mesh = init_device_mesh((n,), mesh_dim_names=("tp",))
    torch_mesh = torch_init_device_mesh(get_platform().device_type, (n,), mesh_dim_names=("tp",))
    rows = []
    for size in size_names:
        args, batch, seq = SIZES[size]
        tokens, labels = llama.batch(args, batch_size=batch, seq_len=seq)
        tokens, labels = tokens.to(device), labels.to(device)
        ours = parallelize_module(llama.build(args).to(device), mesh, plans.tp_plan())
        native = torch_parallelize(llama.build(args).to(device), torch_mesh,
                                   plans.tp_plan(plans.torch_styles()))
        megatron = MegatronLlama(llama.build(args).to(device))
        variants = {"hyperpar": ours, "torch": native, "megatron": megatron}
        losses = {k: _step(m, tokens, labels).item() for k, m in variants.items()}
        spread = max(losses.values()) - min(losses.values())
        assert spread < 1e-4, f"{size}: the three variants disagree: {losses}"
        for m in variants.values():  # warm-up
            _step(m, tokens, labels)
        one = time.perf_counter()
        _step(ours, tokens, labels)
        iters_t = torch.tensor([max(1, min(20, int(0.3 / max(time.perf_counter() - one, 1e-4))))],
                               device=device)
        dist.all_reduce(iters_t, op=dist.ReduceOp.MIN)  # every rank must run the same steps
        iters = int(iters_t.item())
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(rounds):
            for name in names[r % 3:] + names[:r % 3]:  # rotate: no variant always goes first
                m = variants[name]
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    _step(m, tokens, labels)
                get_platform().synchronize()  # an accelerator runs the steps asynchronously
                times[name].append((time.perf_counter() - start) / iters * 1e3)
                cpu[name].append((time.process_time() - cpu_start) / iters * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        for ref, label in (("torch", "torch-native TP"), ("megatron", "hand-written Megatron")):
            rows.append({
                "benchmark": "tp", "case": f"llama {size} fwd+bwd", "hyperpar_ms": med["hyperpar"],
                "reference": label, "reference_ms": med[ref], "ratio": med["hyperpar"] / med[ref],
                "hyperpar_cpu_ms": med_cpu["hyperpar"], "reference_cpu_ms": med_cpu[ref],
                "cpu_ratio": med_cpu["hyperpar"] / med_cpu[ref],
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    from hyperpar.platform import get_platform
    from hyperpar.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    rows = run_distributed(_measure, args.ranks, sizes, args.rounds, timeout_s=600)[0]
    print(f"tensor parallelism, {args.ranks} ranks, backend {get_platform().name}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} cores here")
    print("wall: median step time; cpu: this process's CPU time per step (less sensitive to other "
          "load on the machine)")
    print(f"{'case':<24}{'reference':<24}{'hyperpar ms':>12}{'ref ms':>10}{'ratio':>8}"
          f"{'cpu ratio':>11}")
    for row in rows:
        print(f"{row['case']:<24}{row['reference']:<24}{row['hyperpar_ms']:>12.2f}"
              f"{row['reference_ms']:>10.2f}{row['ratio']:>8.3f}{row['cpu_ratio']:>11.3f}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
