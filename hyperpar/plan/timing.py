"""Step time of one layout: compute from FLOPs, collectives from an alpha-beta ring model per
link type, the pipeline bubble, and the overlaps hyperpar does (FSDP prefetch, data-parallel
bucket all-reduce during backward).

Ring costs for a group of ``n`` ranks and a full (gathered) tensor of ``B`` bytes, link
bandwidth ``bw`` and latency ``alpha``:

* all-gather and reduce-scatter: ``(n - 1) * alpha + (n - 1) / n * B / bw``
* all-reduce (reduce-scatter then all-gather): twice that.

A mesh dim's group stays inside a node when ``stride * size <= gpus_per_node`` (the mesh is
row-major with ``tp`` innermost); otherwise its ring crosses the network and runs at the
per-device inter-node bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import DeviceProfile
from .layout import Layout, Run
from .memory import Memory, microbatch_tokens, stage_params
from .model import ModelSpec


@dataclass
class Link:
    bytes_per_s: float
    alpha_s: float

    def ring(self, n: int, nbytes: float, kind: str) -> float:
        """Seconds of one ``kind`` collective (``ag``, ``rs``, ``ar``) over ``n`` ranks."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        one = (n - 1) * self.alpha_s + (n - 1) / n * nbytes / self.bytes_per_s
        return 2 * one if kind == "ar" else one

    def p2p(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s


def wire_bytes(n: int, nbytes: float, kind: str) -> float:
    """Bytes one rank sends for a ring collective of full size ``nbytes``."""
    if n <= 1:
        return 0.0
    return (2 if kind == "ar" else 1) * (n - 1) / n * nbytes


def link_for(dim: str, layout: Layout, run: Run, profile: DeviceProfile) -> Link:
    span = layout.stride(dim) * layout.size(dim)
    if span <= run.gpus_per_node:
        return Link(profile.intra_bytes_per_s * profile.link_efficiency, profile.intra_alpha_s)
    return Link(profile.inter_bytes_per_s * profile.link_efficiency, profile.inter_alpha_s)


def step_flops(spec: ModelSpec, run: Run, activation_checkpointing: bool) -> float:
    """FLOPs of one optimizer step over all ranks: ``6 * P * tokens`` for the matmuls
    (forward 2, backward 4; 8 with activation checkpointing, which repeats the forward) plus
    causal attention, ``2 * seq * q_dim`` per token per layer forward."""
    tokens = run.global_batch * run.seq_len
    factor = 8 if activation_checkpointing else 6
    attn_fwd = 2 * run.seq_len * spec.q_dim * spec.num_layers
    return factor * spec.matmul_parameters * tokens + factor / 2 * attn_fwd * tokens


@dataclass
class StepTime:
    """Predicted seconds of one step and what each part costs (seconds, per rank)."""

    step_s: float
    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    fsdp_exposed_s: float
    dp_exposed_s: float
    optimizer_s: float
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per mesh dim, per rank

    @property
    def step_ms(self) -> float:
        return self.step_s * 1e3


def step_time(spec: ModelSpec, run: Run, layout: Layout, profile: DeviceProfile,
              memory: Memory) -> StepTime:
    m, pp, tp = layout.microbatches, layout.pp, layout.tp
    cb = run.compute_bytes
    rate = profile.flops(run.param_dtype)
    compute_step = step_flops(spec, run, layout.activation_checkpointing) / run.world / rate
    compute_mb = compute_step / m
    tokens = microbatch_tokens(run, layout)
    layers = spec.num_layers // pp
    comm: dict[str, float] = {"tp": 0.0, "dp_shard": 0.0, "dp_replicate": 0.0, "pp": 0.0}

    # tensor (+sequence) parallel: per layer 2 all-gathers + 2 reduce-scatters forward and
    # backward (2 all-reduces each way without sp); repeated in the recomputed forward.
    tp_mb = 0.0
    if tp > 1:
        act_bytes = tokens * spec.hidden_size * cb
        passes = 3 if layout.activation_checkpointing else 2
        link = link_for("tp", layout, run, profile)
        per_layer = 2 * (link.ring(tp, act_bytes, "ag") + link.ring(tp, act_bytes, "rs"))
        tp_mb = passes * layers * per_layer
        comm["tp"] = m * passes * layers * 2 * (wire_bytes(tp, act_bytes, "ag")
                                                + wire_bytes(tp, act_bytes, "rs"))

    # pipeline: one activation forward and one gradient backward per microbatch and boundary
    pp_mb = 0.0
    if pp > 1:
        msg = tokens * spec.hidden_size * cb / (tp if layout.sequence_parallel else 1)
        pp_mb = 2 * link_for("pp", layout, run, profile).p2p(msg)
        comm["pp"] = 2 * m * msg

    # fully_shard: all-gather each unit forward and backward, reduce-scatter its gradients,
    # every microbatch; prefetching one unit ahead hides it behind compute except the first.
    stage = memory.stage
    ds, dr = layout.dp_shard, layout.dp_replicate
    sp = stage_params(spec, tp, ds, pp, stage)
    fsdp_mb_exposed = 0.0
    if ds > 1:
        link = link_for("dp_shard", layout, run, profile)
        # units of a stage: its layers (all the same size) and the root unit, if any
        counts = [spec.num_layers // pp] + [sp.units - spec.num_layers // pp]
        unit_bytes = [(n, b * cb) for n, b in zip(counts, sp.unit_gathered, strict=False)]
        per_mb = sum(n * (2 * link.ring(ds, b, "ag") + link.ring(ds, b, "rs"))
                     for n, b in unit_bytes)
        first = link.ring(ds, unit_bytes[0][1], "ag")
        fsdp_mb_exposed = max(0.0, per_mb - compute_mb) + first
        comm["dp_shard"] = m * sum(n * (2 * wire_bytes(ds, b, "ag") + wire_bytes(ds, b, "rs"))
                                   for n, b in unit_bytes)

    ac_factor = 4 / 3 if layout.activation_checkpointing else 1.0  # one more forward
    overhead_mb = layers * profile.layer_overhead_s * ac_factor
    tau = compute_mb + overhead_mb + tp_mb + pp_mb + fsdp_mb_exposed
    slots = m + pp - 1
    pipe = slots * tau
    bubble = (pp - 1) * tau

    # data-parallel replicas: one all-reduce of the (sharded) gradients per step, in buckets
    # launched during the last microbatch's backward (2/3 of its compute).
    dp_exposed = 0.0
    if dr > 1:
        grad_bytes = sp.local * cb
        t_ar = link_for("dp_replicate", layout, run, profile).ring(dr, grad_bytes, "ar")
        dp_exposed = max(0.0, t_ar - 2 / 3 * compute_mb)
        comm["dp_replicate"] = wire_bytes(dr, grad_bytes, "ar")

    # optimizer: memory-bound, reads and writes params, grads and states once
    optimizer = 2 * memory.states / profile.hbm_bytes_per_s
    total = pipe + dp_exposed + optimizer
    return StepTime(step_s=total, compute_s=compute_step, bubble_s=bubble, tp_s=tp_mb * m,
                    pp_s=pp_mb * m, fsdp_exposed_s=fsdp_mb_exposed * m, dp_exposed_s=dp_exposed,
                    optimizer_s=optimizer, comm_bytes=comm)
