"""Bytes per rank of an MoE layout: parameters, gradients and optimizer states of the dense
part and of the routed experts (fully_shard, ZeRO-1/2 or replicated), the activations a
pipeline stage keeps for its in-flight microbatches, and the logits around the loss.
No framework is imported here."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .layout import Run
from .memory import MASTER_BYTES, in_flight, stage_layers
from .moe import MoESpec
from .moe_layout import MoELayout


@lru_cache(maxsize=65536)
def _stage_split(spec: MoESpec, pp: int, stage: int) -> tuple[int, int]:
    """(dense layers, MoE layers) on ``stage``: contiguous layers, as many as
    :func:`stage_layers` gives it, the dense ones first in the model."""
    start = sum(stage_layers(spec.num_layers, pp, s) for s in range(stage))
    n = stage_layers(spec.num_layers, pp, stage)
    dense = set(range(spec.first_dense)) | set(spec.dense_layers)
    d = sum(1 for i in range(start, start + n) if i in dense)
    return d, n - d


@dataclass(frozen=True)
class MoEMemory:
    """Bytes on one rank of the stage with the highest peak (``stage``)."""

    params: int
    grads: int
    optimizer: int
    fsdp_buffers: int
    activations: int
    stage: int

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.fsdp_buffers + self.activations

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_json(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations + self.fsdp_buffers, "peak": self.peak}


def stage_param_counts(spec: MoESpec, lay: MoELayout, stage: int) -> tuple[float, float, float]:
    """(dense-part elements on one rank, routed-expert elements on one rank before any
    data-parallel sharding, one gathered unit's elements) of ``stage``: the dense part
    (attention, norms, router, shared experts, dense MLPs, embedding on the first stage, head
    and the MTP modules' dense part on the last) split over ``tp``; the routed experts split
    ``ep`` ways by expert and ``etp`` ways by width. DualPipe holds two stages per rank
    (``stage`` and ``pp - 1 - stage``)."""
    b = lay.base
    stages = [stage] + ([b.pp - 1 - stage] if lay.dualpipe and b.pp - 1 - stage != stage
                        else [])
    dense = routed = 0.0
    unit = 0.0
    for s in stages:
        d, moe = _stage_split(spec, b.pp, s)
        non_expert = spec.moe_layer_params - spec.experts * spec.expert_params
        dense += d * spec.dense_layer_params + moe * non_expert
        routed += moe * spec.experts * spec.expert_params
        if s == 0:
            dense += spec.vocab * spec.hidden
        if s == b.pp - 1:
            dense += spec.embed_params - spec.vocab * spec.hidden
            if spec.mtp:
                h = spec.hidden
                dense += spec.mtp * (non_expert + 2 * h * h + 3 * h)
                routed += spec.mtp * spec.experts * spec.expert_params
        layer = max(spec.dense_layer_params / b.tp if d else 0,
                    non_expert / b.tp + spec.experts * spec.expert_params
                    / (lay.ep * lay.etp) if moe else 0)
        unit = max(unit, layer)
    return dense / b.tp, routed / (lay.ep * lay.etp), unit


def moe_layer_activation_elems(spec: MoESpec, run: Run, lay: MoELayout) -> tuple[float, float,
                                                                                  float]:
    """The per-layer activation term, in compute-dtype elements per token of a rank's
    microbatch (before the tp split of the sequence): (an MoE layer, a dense layer, what a
    checkpointed layer keeps). The one function :mod:`hyperpar.plan.memory`'s TP+SP switch
    (issue 52) will have to follow here too.

    Attention (GQA as the Llama block; MLA: the query latent, queries before and after rotary,
    the KV latent before and after its norm, ``kv_b``'s output, keys, values, the attention
    output), split over tp (the latents are counted split too: an estimate). Around each
    block the norm input and output (split under sequence parallelism) and the gathered
    input of the column-parallel projections (kept whole, as hyperpar saves it). The MoE
    block: the router's input and its fp32 logits and probabilities, per routed copy
    (``top_k x capacity x etp`` per token: expert tensor parallelism gathers the etp group's
    tokens) the dispatched input and expert output (``2h``) and the SwiGLU intermediates
    (``4 f / etp``); the shared experts as a dense SwiGLU split over tp."""
    h, tp = spec.hidden, lay.base.tp
    sp = lay.base.sequence_parallel
    outer = 4 * h / tp + 2 * h if sp else 4 * h
    n = spec.num_heads
    if spec.attention == "mla":
        qk = spec.qk_nope_dim + spec.qk_rope_dim
        attn = (spec.q_lora_rank + 2 * n * qk + 2 * spec.kv_lora_rank + spec.qk_rope_dim
                + n * (spec.qk_nope_dim + spec.v_head_dim) + n * qk + 2 * n * spec.v_head_dim)
    else:
        q, kv = n * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attn = 4 * q + 3 * kv
    attn /= tp
    cap = lay.capacity or 1.0
    per_copy = 2 * h + 4 * spec.expert_intermediate / lay.etp
    tokens_split = 1 / tp if sp else 1.0  # the MoE block sees the sequence-parallel shard
    routed = spec.top_k * cap * lay.etp * per_copy * tokens_split
    router = (h + 2 * spec.experts * MASTER_BYTES / run.compute_bytes) * tokens_split
    shared_w = spec.shared_intermediate or spec.expert_intermediate
    shared = 4 * spec.shared_experts * shared_w / tp
    moe = attn + outer + routed + router + shared
    dense = attn + outer + 4 * spec.dense_intermediate / tp
    saved = h / tp if sp else h
    return moe, dense, saved


def microbatch_tokens(run: Run, lay: MoELayout) -> int:
    """Tokens of one data-parallel rank's microbatch (shared by its tp ranks)."""
    b = lay.base
    return run.global_batch // (b.dp * b.microbatches) * run.seq_len


def _in_flight(lay: MoELayout, stage: int) -> float:
    """Microbatches of activations a stage holds: DualPipe ``pp + 1`` of a stage's (its
    Table 2, against 1F1B's ``pp``) on every rank, an upper bound; else the dense rule."""
    if lay.dualpipe:
        return min(lay.base.pp + 1, lay.base.microbatches)
    return in_flight(lay.base, stage)


def moe_stage_memory(spec: MoESpec, run: Run, lay: MoELayout, stage: int) -> MoEMemory:
    b, cb = lay.base, run.compute_bytes
    dense, routed, unit = stage_param_counts(spec, lay, stage)
    k = run.optimizer_states
    if b.dp_shard > 1:  # fully_shard: fp32 masters, grads and states sharded
        local = dense / b.dp_shard + routed / lay.expert_shard
        params, grads, opt = local * MASTER_BYTES, local * MASTER_BYTES, local * MASTER_BYTES * k
        buffers = 3 * unit * cb
    elif b.zero:  # ZeRO-1/2 over dp (dense part) and edp (experts)
        part = dense / b.dp + routed / lay.edp
        params = (dense + routed) * cb
        grads = part * cb if b.zero == 2 else (dense + routed) * cb
        opt = part * MASTER_BYTES * (1 + k)
        buffers = 0.0
    else:
        local = dense + routed
        params = local * (MASTER_BYTES + (cb if cb != MASTER_BYTES else 0))
        grads, opt, buffers = local * MASTER_BYTES, local * MASTER_BYTES * k, 0.0
    d, moe = _stage_split(spec, b.pp, stage)
    if lay.dualpipe and b.pp - 1 - stage != stage:
        d2, m2 = _stage_split(spec, b.pp, b.pp - 1 - stage)
        d, moe = d + d2, moe + m2
        d, moe = d / 2, moe / 2  # one chunk's layers per in-flight microbatch
    moe_e, dense_e, saved = moe_layer_activation_elems(spec, run, lay)
    tokens = microbatch_tokens(run, lay)
    per_mb = (moe * moe_e + d * dense_e) * tokens * cb
    if b.activation_checkpointing:
        per_mb_kept = (moe + d) * saved * tokens * cb
        act = _in_flight(lay, stage) * per_mb_kept + max(moe_e, dense_e) * tokens * cb
    else:
        act = _in_flight(lay, stage) * per_mb
    if stage == b.pp - 1 or lay.dualpipe:
        # the logits on vocabulary shards and the eager loss's fp32 log-softmax and gradient;
        # each MTP module predicts once more from its own layer
        vocab = spec.vocab / b.tp
        act += (1 + spec.mtp) * tokens * vocab * (cb + 2 * MASTER_BYTES)
    return MoEMemory(int(params), int(grads), int(opt), int(buffers), int(act), stage)


def moe_memory_per_rank(spec: MoESpec, run: Run, lay: MoELayout) -> MoEMemory:
    """The stage with the highest peak."""
    pp = lay.base.pp
    # the first stage (embedding, dense layers), the last (head, loss, MTP) and the first
    # all-MoE stage holding the most layers: the others repeat one of these three
    most = max(stage_layers(spec.num_layers, pp, s) for s in range(pp))
    inner = next((s for s in range(pp) if _stage_split(spec, pp, s) == (0, most)), 0)
    stages = sorted({0, pp - 1, inner})
    if lay.dualpipe:  # a rank holds stages s and pp - 1 - s: every pairing differs
        stages = sorted({0, inner, pp // 2 - 1})
    return max((moe_stage_memory(spec, run, lay, s) for s in stages), key=lambda m: m.peak)
