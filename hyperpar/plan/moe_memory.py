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


#: Bytes of an FP8 element and of DeepSeek-V3's E5M6 (12 bits: the input of the linear after
#: attention, sec. 3.3.3), the dtypes ``fp8act`` caches in (scales, 1 per 128, not counted).
FP8_BYTES, E5M6_BYTES = 1.0, 1.5


def moe_layer_activation_bytes(spec: MoESpec, run: Run, lay: MoELayout) -> tuple[float, float,
                                                                                  float]:
    """The per-layer activation term in bytes per token of a rank's microbatch (before the tp
    split of the sequence): (an MoE layer, a dense layer, what a checkpointed layer keeps).

    What an eager layer saves for backward, each tensor once, in the compute dtype ``c``:
    around each block the norm input (the residual stream) and output (split under sequence
    parallelism) and the gathered input of the column-parallel projections (kept whole, as
    hyperpar saves it). Attention: GQA as the Llama block; MLA the query latent before and
    after its norm, the KV latent (with the shared rotary key) before and after its norm,
    the up-projections' outputs (queries, ``kv_b``'s keys and values), the queries and keys
    after rotary, the values and the attention output; split over tp (the latents too: an
    estimate). The MoE block: the router's fp32 logits and probabilities (its input is the
    norm output, counted), per routed copy (``top_k x capacity x etp`` per token: expert
    tensor parallelism gathers the etp group's tokens) the dispatched input, the expert
    output (the combine's weights need it) and the SwiGLU's gate and up outputs, the SiLU
    and the product (``4 f / etp``); the shared experts and dense MLPs as that SwiGLU.

    The :class:`MoELayout` knobs take out or shrink what they name: ``rcnorm`` the norm
    outputs (and their gathered copies), ``rcup`` MLA's queries, keys and values (the latents
    stay), ``rcswiglu`` the SiLU and product, ``wexpert`` the per-copy expert output;
    ``fp8act`` keeps the linears' and the SwiGLU's inputs in FP8 and the attention output
    in E5M6 (the residual stream, the latents before their norms, the SiLU and the router
    stay in ``c``)."""
    h, tp, c = spec.hidden, lay.base.tp, run.compute_bytes
    sp = lay.base.sequence_parallel
    rc = lay.recompute
    lin = FP8_BYTES if lay.fp8_cache else c  # a linear's (or the SwiGLU's) cached input
    norm_out = 0.0 if "norm" in rc else lin
    # two blocks: norm input, norm output (and the gathered copy under sequence parallelism)
    outer = (2 * h / tp * c + (2 * h / tp + 2 * h) * norm_out) if sp else 2 * h * (c + norm_out)
    n = spec.num_heads
    if spec.attention == "mla":
        qk = spec.qk_nope_dim + spec.qk_rope_dim
        up = 0.0 if "up" in rc else c
        latents = (spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_dim) * c  # norm inputs
        normed = (spec.q_lora_rank + spec.kv_lora_rank) * norm_out  # the up-projections' inputs
        derived = (n * qk                                     # queries out of q_b
                   + n * (spec.qk_nope_dim + spec.v_head_dim)  # kv_b's output
                   + 2 * n * qk + n * spec.v_head_dim) * up   # q, k after rotary; v
        out = n * spec.v_head_dim * (E5M6_BYTES if lay.fp8_cache else c)
        attn = latents + normed + derived + out
    else:
        q, kv = n * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attn = (4 * q + 3 * kv) * c
    attn /= tp

    def swiglu(width: float) -> float:
        """A SwiGLU of ``width``: gate and up outputs, SiLU, product (the down input)."""
        rebuilt = "swiglu" in rc
        return width * (2 * lin + (0.0 if rebuilt else c + lin))

    cap = lay.capacity or 1.0
    per_copy = (h * lin + (0.0 if lay.weights_on_expert else h * c)
                + swiglu(spec.expert_intermediate / lay.etp))
    tokens_split = 1 / tp if sp else 1.0  # the MoE block sees the sequence-parallel shard
    routed = spec.top_k * cap * lay.etp * per_copy * tokens_split
    router = 2 * spec.experts * MASTER_BYTES * tokens_split
    shared_w = spec.shared_intermediate or spec.expert_intermediate
    shared = spec.shared_experts * swiglu(shared_w / tp)
    moe = attn + outer + routed + router + shared
    dense = attn + outer + swiglu(spec.dense_intermediate / tp)
    saved = (h / tp if sp else h) * c
    return moe, dense, saved


def moe_layer_activation_elems(spec: MoESpec, run: Run, lay: MoELayout) -> tuple[float, float,
                                                                                  float]:
    """:func:`moe_layer_activation_bytes` in compute-dtype elements per token."""
    c = run.compute_bytes
    return tuple(x / c for x in moe_layer_activation_bytes(spec, run, lay))  # type: ignore[return-value]


def microbatch_tokens(run: Run, lay: MoELayout) -> int:
    """Tokens of one data-parallel rank's microbatch (shared by its tp ranks)."""
    b = lay.base
    return run.global_batch // (b.dp * b.microbatches) * run.seq_len


def dualpipe_in_flight(lay: MoELayout, stage: int) -> tuple[float, float]:
    """Microbatches a DualPipe rank holds of each of its two stages: of ``r = min(stage, pp -
    1 - stage)`` (the direction it enters first) ``pp - r``, of ``pp - 1 - r`` ``r + 1``,
    ``pp + 1`` in all (DeepSeek-V3 Table 2). From its published schedule: ``2 (pp / 2 - r -
    1)`` forwards of the first direction, then ``r + 1`` of each, zero-bubble steps that keep
    the second direction's count, then paired forward-and-backward steps whose forward runs
    before the backward frees its microbatch; the mirror rank ``pp - 1 - r`` holds the same
    (the same two stages, directions swapped). Each direction has ``microbatches / 2``."""
    pp, half = lay.base.pp, lay.base.microbatches / 2
    r = min(stage, pp - 1 - stage)
    return min(pp - r, half), min(r + 1, half)


def _in_flight(lay: MoELayout, stage: int) -> float:
    """Microbatches of activations a (non-DualPipe) stage holds: the dense rule."""
    return in_flight(lay.base, stage)


def holds_head(lay: MoELayout, stage: int) -> bool:
    """Whether the rank of ``stage`` holds the output head (and the MTP modules), so the
    logits and the loss: the last stage; under DualPipe the rank holding stages 0 and
    ``pp - 1`` (ranks 0 and ``pp - 1``: DeepSeek-V3 sec. 3.2.3 puts the embedding and the
    head on the same PP rank), not the ranks between."""
    pp = lay.base.pp
    return stage == pp - 1 or (lay.dualpipe and stage == 0)


def loss_bytes_per_logit(run: Run) -> float:
    """Bytes per logit (on its vocabulary shard) held around the loss of one microbatch: the
    compute-dtype logits and, by ``run.loss``, the eager loss's fp32 log-softmax and its
    gradient (``eager``; ``torch-lp`` one fp32 tensor more) or nothing (``fused``)."""
    extra = {"eager": 2, "fused": 0, "torch-lp": 3}[run.loss]
    return run.compute_bytes + extra * MASTER_BYTES


def moe_stage_memory(spec: MoESpec, run: Run, lay: MoELayout, stage: int) -> MoEMemory:
    """Bytes on one rank of ``stage`` (under DualPipe: of the rank holding ``stage`` and
    ``pp - 1 - stage``). Optimizer states in ``run.optimizer_dtype``, ZeRO's gradients in
    ``run.zero_grad_dtype``; activations for the schedule's in-flight microbatches."""
    b, cb = lay.base, run.compute_bytes
    dense, routed, unit = stage_param_counts(spec, lay, stage)
    k, sb = run.optimizer_states, run.optimizer_state_bytes
    if b.dp_shard > 1:  # fully_shard: fp32 masters, grads and states sharded
        local = dense / b.dp_shard + routed / lay.expert_shard
        params, grads, opt = local * MASTER_BYTES, local * MASTER_BYTES, local * sb * k
        buffers = 3 * unit * cb
    elif b.zero:  # ZeRO-1/2 over dp (dense part) and edp (experts)
        part = dense / b.dp + routed / lay.edp
        params = (dense + routed) * cb
        grads = (part if b.zero == 2 else dense + routed) * run.zero_grad_bytes
        opt = part * (MASTER_BYTES + sb * k)
        buffers = 0.0
    else:
        local = dense + routed
        params = local * (MASTER_BYTES + (cb if cb != MASTER_BYTES else 0))
        grads, opt, buffers = local * MASTER_BYTES, local * sb * k, 0.0
    moe_b, dense_b, saved = moe_layer_activation_bytes(spec, run, lay)
    tokens = microbatch_tokens(run, lay)
    # (stage, microbatches held) for each stage on this rank; the MTP modules' blocks (MoE
    # layers) ride with the head
    if lay.dualpipe:
        r = min(stage, b.pp - 1 - stage)
        first, second = dualpipe_in_flight(lay, r)
        held = [(r, first)] + ([(b.pp - 1 - r, second)] if b.pp - 1 - r != r else [])
    else:
        held = [(stage, _in_flight(lay, stage))]
    act = 0.0
    for s, n_mb in held:
        d, moe = _stage_split(spec, b.pp, s)
        moe += spec.mtp if s == b.pp - 1 else 0
        if b.activation_checkpointing:
            act += n_mb * (moe + d) * saved * tokens
        else:
            act += n_mb * (moe * moe_b + d * dense_b) * tokens
    if b.activation_checkpointing:  # the one layer being recomputed, whole
        act += max(moe_b, dense_b) * tokens
    if holds_head(lay, stage):
        # one microbatch's logits on vocabulary shards and the loss's tensors (1F1B and
        # DualPipe run the loss's backward right after its forward); each MTP module
        # predicts once more from its own layer
        vocab = spec.vocab / b.tp
        act += (1 + spec.mtp) * tokens * vocab * loss_bytes_per_logit(run)
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
        stages = list(range(pp // 2))
    return max((moe_stage_memory(spec, run, lay, s) for s in stages), key=lambda m: m.peak)
