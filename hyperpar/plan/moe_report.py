"""Text and JSON output of MoE plans (``hyperpar plan --config <MoE config>``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .devices import DeviceProfile
from .layout import Run
from .moe import MoESpec
from .moe_layout import RECOMPUTE
from .moe_plan import MoECandidate, MoELayout

G = 2**30


def layout_json(lay: MoELayout) -> dict[str, object]:
    """A layout's dims as the dense JSON names them, with ``ep`` and ``etp`` beside them."""
    b = lay.base
    return {"name": lay.name, "dp_replicate": b.dp_replicate, "dp_shard": b.dp_shard,
            "tp": b.tp, "pp": b.pp, "cp": b.cp, "ep": lay.ep, "etp": lay.etp, "edp": lay.edp,
            "microbatches": b.microbatches, "activation_checkpointing":
            b.activation_checkpointing, "schedule": "dualpipe" if lay.dualpipe else b.schedule,
            "zero": b.zero, "capacity": lay.capacity or "dropless",
            "node_limit": lay.node_limit,
            "recompute": [r for r in RECOMPUTE if r in lay.recompute],
            "fp8_cache": lay.fp8_cache, "weights_on_expert": lay.weights_on_expert}


def candidate_json(c: MoECandidate) -> dict[str, object]:
    return {"layout": layout_json(c.layout), "fits": c.fits, "reason": c.reason,
            "memory": c.memory.to_json(), "time_ms": {k: v * 1e3 for k, v in
                                                      asdict(c.time).items()
                                                      if k.endswith("_s")},
            "tokens_per_s_per_device": c.tokens_per_s_per_device}


def header(spec: MoESpec, run: Run, profile: DeviceProfile) -> str:
    return (f"{spec.name}: MoE, {spec.parameters:,} parameters ({spec.active_parameters:,} "
            f"active per token), {spec.experts} experts top-{spec.top_k}; world {run.world} "
            f"({run.gpus_per_node}/node) on {profile.name}; seq {run.seq_len}, global batch "
            f"{run.global_batch}; device memory {run.device_memory / G:.2f} GiB")


def describe(c: MoECandidate) -> str:
    m, t = c.memory, c.time
    fit = "fits" if c.fits else f"does not run: {c.reason}"
    return "\n".join([
        f"layout {c.layout.name}: {fit}",
        f"  memory per rank (stage {m.stage}, GiB): params {m.params / G:.2f}, grads "
        f"{m.grads / G:.2f}, optimizer {m.optimizer / G:.2f}, fsdp buffers "
        f"{m.fsdp_buffers / G:.2f}, activations {m.activations / G:.2f}; peak {m.peak / G:.2f}",
        f"  step {t.step_ms:.1f} ms ({c.tokens_per_s_per_device:,.0f} tok/s/device); parts "
        f"(ms): compute {t.compute_s * 1e3:.1f}, bubble {t.bubble_s * 1e3:.1f}, all-to-all "
        f"{t.a2a_s * 1e3:.1f} (exposed {t.a2a_exposed_s * 1e3:.1f}), tp {t.tp_s * 1e3:.1f}, "
        f"pp {t.pp_s * 1e3:.1f}, fsdp {t.fsdp_exposed_s * 1e3:.1f}, dp "
        f"{t.dp_exposed_s * 1e3:.1f}, optimizer {t.optimizer_s * 1e3:.1f}; grouped-GEMM "
        f"tile efficiency {t.gemm_efficiency:.2f}"])


def table(ranked: list[MoECandidate], top: int) -> str:
    rows = [f"{'layout':48s} {'step ms':>10s} {'tok/s/dev':>10s} {'peak GiB':>9s} "
            f"{'a2a ms':>9s}"]
    for c in ranked[:top]:
        rows.append(f"{c.layout.name:48s} {c.time.step_ms:10.1f} "
                    f"{c.tokens_per_s_per_device:10,.0f} {c.memory.peak / G:9.2f} "
                    f"{c.time.a2a_exposed_s * 1e3:9.1f}")
    return "\n".join(rows)


def write_json(path: str | Path, spec: MoESpec, run: Run, ranked: list[MoECandidate],
               ruled: list[tuple[str, str]]) -> None:
    doc = {"model": {"name": spec.name, "parameters": spec.parameters,
                     "active_parameters": spec.active_parameters, "experts": spec.experts,
                     "top_k": spec.top_k},
           "run": asdict(run), "ranked": [candidate_json(c) for c in ranked],
           "ruled_out": [{"layout": n, "reason": r} for n, r in ruled]}
    Path(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
