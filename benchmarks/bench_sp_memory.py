"""Saved activations and step time of one tensor + sequence parallel Llama layer, side by side
in one run: hyperpar saving the sequence shard of each all-gathered input (gathering it again in
backward; ``reshard_input_after_forward=True``), hyperpar keeping the gathered input (torch's
behaviour; ``False``), and torch-native TP+SP (``torch.distributed.tensor.parallel``, the same
torchtitan plan), against Korthikanti et al.'s per-layer formula.

Run: ``python benchmarks/bench_sp_memory.py [--ranks 2,4] [--rounds 5] [--seq 512] [--dim 512]
[--heads 8] [--ffn 1408] [--batch 1] [--dtype bfloat16] [--json F]``

Memory is exact, not sampled: the bytes of the distinct storages autograd saves during one
forward (``hyperpar.torch.parallel.memory.SavedBytes``; parameters excluded) on rank 0. The
formulas, per layer and rank, in bytes, with ``e`` bytes per element (2 for 16-bit):

* Korthikanti eq. 6 (TP + SP, with selective recompute): ``34 s b h / t``; without it
  ``+ 5 a s^2 b / t``. It counts a GPT layer at 16 bits: LayerNorm inputs 2x(2sbh), QKV
  input 2sbh, Q and K 4sbh, V 2sbh, attention-output projection input 2sbh, MLP input 2sbh,
  GeLU input and output 2x(8sbh), two dropout masks 2x(sbh); the s^2 terms are softmax output,
  its dropout mask and dropout output.
* The same accounting for the Llama layer measured (``examples/llama``'s block, flash SDPA as
  torch runs it on CPU and GPU): ``e s b (10 h + 4 f) / t`` plus SDPA's fp32 logsumexp
  ``4 a s b / t`` and the norms' two ``rsqrt`` columns ``2 e s b / t``. Term by term:
  attention as Korthikanti's, 5 sbh elements -- q/k/v input (the norm output), the rotated
  q and k and v that SDPA saves (RoPE saves only its cos/sin tables: they need no gradient),
  SDPA's output, which *is* the output projection's input (its layout makes the transpose and
  reshape views); flash attention keeps no s^2 term. MLP: its input sbh and SwiGLU's w1
  output, silu output, w3 output and their product, 4 sbf (Korthikanti's GeLU MLP: GeLU input
  and output, 2x 4sbh). Norms: an unfused RMSNorm saves its input and the normalised input,
  2x2 sbh (Korthikanti's LayerNorm: its input, 2x sbh). No dropout, so no masks. With a GeLU
  MLP of ``f = 4h``, one saved tensor per norm and dropout masks this is Korthikanti's 34sbh/t.

Step time: forward + backward of the layer, the three interleaved round by round, median over
rounds; the ratio reshard / keep-gathered is the cost of the extra all-gather per gathered input.
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

from examples.llama import model as llama  # noqa: E402
from examples.llama import plan as plans  # noqa: E402


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _block_plan(styles=None):
    return {k[len("layers.*."):]: v for k, v in plans.tp_sp_plan(styles).items()
            if k.startswith("layers.*.")}


def _measure(cfg: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform
    from hyperpar.torch.parallel.memory import SavedBytes

    p = get_platform()
    rank, t = p.rank(), p.world_size()
    dtype = getattr(torch, cfg["dtype"])
    args = llama.ModelArgs(dim=cfg["dim"], n_layers=1, n_heads=cfg["heads"],
                           ffn_hidden=cfg["ffn"], max_seq_len=cfg["seq"])
    s, b = cfg["seq"], cfg["batch"]
    cos, sin = llama.rope_tables(args.head_dim, s, args.rope_theta)
    cos, sin = cos.to(dtype), sin.to(dtype)
    mesh = init_device_mesh((t,), mesh_dim_names=("tp",))
    torch_mesh = torch_init_device_mesh(p.device_type, (t,), mesh_dim_names=("tp",))

    def build():
        torch.manual_seed(0)
        return llama.TransformerBlock(args).to(dtype)

    models = {}
    models["hyperpar reshard"] = parallelize_module(build(), mesh, _block_plan(),
                                                    reshard_input_after_forward=True)
    models["hyperpar keep"] = parallelize_module(build(), mesh, _block_plan(),
                                                 reshard_input_after_forward=False)
    models["torch-native"] = torch_parallelize(build(), torch_mesh,
                                               _block_plan(plans.torch_styles()))
    x_full = torch.randn(b, s, args.dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    x_local = x_full.chunk(t, dim=1)[rank].contiguous()

    def step(model, record=None):
        x = x_local.clone().requires_grad_()
        if record is None:
            y = model(x, cos, sin)
        else:
            with record:
                y = model(x, cos, sin)
        _local(y).float().square().mean().backward()
        return _local(y).detach(), x.grad

    saved, outs = {}, {}
    for name, model in models.items():
        rec = SavedBytes(exclude=[_local(q) for q in model.parameters()])
        outs[name] = step(model, rec)
        saved[name] = rec.nbytes
        model.zero_grad(set_to_none=True)
    same = all(torch.equal(a, b) for a, b in zip(outs["hyperpar reshard"],
                                                     outs["hyperpar keep"], strict=True))
    times = {name: [] for name in models}
    for _ in range(cfg["rounds"]):
        for name, model in models.items():
            p.barrier()
            start = time.perf_counter()
            for _ in range(cfg["iters"]):
                step(model)
            p.barrier()
            times[name].append((time.perf_counter() - start) / cfg["iters"] * 1e3)
            model.zero_grad(set_to_none=True)
    e = torch.tensor([], dtype=dtype).element_size()
    h, a, f = args.dim, args.n_heads, args.ffn_hidden
    return {
        "t": t, "s": s, "b": b, "h": h, "a": a, "f": f, "dtype": cfg["dtype"],
        "saved": saved, "bit_identical": same,
        "ms": {k: statistics.median(v) for k, v in times.items()},
        "korthikanti_34": 34 * s * b * h / t,
        "korthikanti_full": 34 * s * b * h / t + 5 * a * s * s * b / t,
        # the same accounting for this layer at e bytes per element (+ SDPA's fp32 logsumexp)
        "llama_formula": e * s * b * (10 * h + 4 * f) / t + 4 * a * s * b / t + 2 * e * s * b / t,
    }


def main(argv: list[str] | None = None) -> int:
    from hyperpar.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("rounds", "iters", "seq", "dim", "heads", "ffn",
                                         "batch", "dtype")}
    rows = [run_distributed(_measure, int(n), cfg, timeout_s=900)[0]
            for n in args.ranks.split(",")]
    r0 = rows[0]
    print(f"one Llama layer, TP+SP, s={r0['s']} b={r0['b']} h={r0['h']} a={r0['a']} "
          f"f={r0['f']} {r0['dtype']}, torch {torch.__version__}, gloo on CPU; saved bytes of "
          f"rank 0 (exact), step = forward+backward median ms")
    print(f"{'t':>2} {'path':<18}{'saved MiB':>10}{'/34sbh/t':>10}{'/llama':>8}"
          f"{'/+5as2b':>9}{'step ms':>9}{'/keep':>7}")
    for row in rows:
        for name in ("hyperpar reshard", "hyperpar keep", "torch-native"):
            sv = row["saved"][name]
            print(f"{row['t']:>2} {name:<18}{sv / 2**20:>10.2f}"
                  f"{sv / row['korthikanti_34']:>10.3f}{sv / row['llama_formula']:>8.3f}"
                  f"{sv / row['korthikanti_full']:>9.3f}{row['ms'][name]:>9.1f}"
                  f"{row['ms'][name] / row['ms']['hyperpar keep']:>7.3f}")
        print(f"   formulas: 34sbh/t {row['korthikanti_34'] / 2**20:.2f} MiB, Llama layer "
              f"{row['llama_formula'] / 2**20:.2f} MiB, 34sbh/t+5as^2b/t "
              f"{row['korthikanti_full'] / 2**20:.2f} MiB; reshard vs keep bit-identical: "
              f"{row['bit_identical']}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
