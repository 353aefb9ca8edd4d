"""``hyperpar plan`` against published runs: each row is a run whose figures were read in its
source (cited beside it), re-predicted with ``hyperpar plan --layout`` (the exact command is
printed). No assertions; the table goes to docs/planning.md.

Rows are kept only where the source states the model, the layout, the batch and the hardware
and the run uses what the planner models (bf16 mixed precision, no Float8, no torch.compile):
torchtitan's Tables 1 and 3 (FSDP rows). Those runs use selective ("op") activation
checkpointing: each row is predicted with it (``.sac``), and without and with full
checkpointing as bounds.

    python benchmarks/validate_published.py
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyperpar.cli import main  # noqa: E402

#: Llama 3.1 8B (its Hugging Face config.json).
LLAMA31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}

#: torchtitan docs/performance.md (pytorch/torchtitan; also Liang et al. 2024, "TorchTitan",
#: arXiv:2410.06511): H100 96 GB HBM2e at 500 W, 8 per host, NVLink, 400 Gb/s RDMA per GPU.
#: Sequence length 8192: torchtitan's llama3_8b.toml default (the tables do not restate it);
#: gradients reduced in fp32: torchtitan's ``mixed_precision_reduce`` default.
ROWS = [
    {"source": "torchtitan Table 1, FSDP", "world": 8, "layout": "fsdp8.mb1",
     "global_batch": 16, "tps_per_gpu": 5762, "memory_gib": 82.4},
    {"source": "torchtitan Table 3, FSDP", "world": 128, "layout": "fsdp128.mb1",
     "global_batch": 256, "tps_per_gpu": 5605, "memory_gib": 67.0},
]
SEQ = 8192


def predict(row: dict, ac: str, config: Path) -> tuple[list[str], dict]:
    layout = row["layout"] + {"none": "", "full": ".ac", "selective op": ".sac"}[ac]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        args = ["plan", "--config", str(config), "--world", str(row["world"]), "--seq-len",
                str(SEQ), "--global-batch", str(row["global_batch"]), "--device", "h100",
                "--device-memory", "96GB", "--reduce-dtype", "float32", "--layout", layout]
        with redirect_stdout(io.StringIO()):
            main([*args, "--json", str(out)])
        doc = json.loads(out.read_text())
    entry = (doc["layouts"] or doc["ruled_out"])[0]
    return ["hyperpar", *args, "--json", "one.json"], entry


def main_() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llama-3.1-8b.json"
        config.write_text(json.dumps(LLAMA31_8B))
        rows, within_mem, within_tps, n = [], 0, 0, 0
        for row in ROWS:
            for ac in ("selective op", "none", "full"):
                cmd, e = predict(row, ac, config)
                tokens = row["global_batch"] * SEQ
                tps = tokens / (e["predicted_step_ms"] / 1e3) / row["world"]
                mem = e["memory"]["peak"] / 2**30
                dm = mem / row["memory_gib"] - 1
                dt = tps / row["tps_per_gpu"] - 1
                if ac == "selective op":  # what the runs used; the others are bounds
                    n += 1
                    within_mem += abs(dm) <= 0.15
                    within_tps += abs(dt) <= 0.25
                rows.append((row["source"], ac, row["memory_gib"],
                             mem, dm, row["tps_per_gpu"], tps, dt, " ".join(cmd)))
    print("| source | planner AC | memory GiB published | predicted | error | TPS/GPU "
          "published | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for src, ac, pm, m, dm, pt, t, dt, _ in rows:
        print(f"| {src} | {ac} | {pm} | {m:.1f} | {dm:+.0%} | {pt:,} | {t:,.0f} | {dt:+.0%} |")
    print(f"\nselective-op rows within ±15% memory: {within_mem}/{n}; within ±25% throughput: "
          f"{within_tps}/{n}")
    print("\ncommands (the config is Llama 3.1 8B's sizes, written to a temporary file):")
    for *_, cmd in rows:
        print("  " + cmd.replace(str(config), "llama-3.1-8b.json"))


if __name__ == "__main__":
    main_()
