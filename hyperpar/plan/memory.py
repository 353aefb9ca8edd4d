"""Memory per rank of one layout: parameters, gradients, optimizer states, FSDP buffers and
activations, for the pipeline stage that needs the most.

Parameters, gradients and optimizer states are *exact* for hyperpar's own sharding: tensor
parallelism splits a weight's ``tp_dim`` with ``torch.chunk`` semantics, then ``fully_shard``
splits dim 0 of the tp-local tensor the same way (``hyperpar/fsdp/_param.py``) over
``Layout.fsdp_shard`` ranks (``dp_shard``, or ``dp_shard * cp`` when fully_shard runs over the
flattened ``dp_shard x cp`` group of context parallelism); rank 0 holds
``ceil(rows / n)`` rows at every split, the most any rank holds, and that is what is reported.
Masters, gradients and optimizer states are fp32 (bf16 mixed precision keeps fp32 masters and
gathers bf16 copies). FSDP buffers and activations are estimates; see docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .layout import Layout, Run
from .model import ModelSpec, ParamTensor

MASTER_BYTES = 4  # fp32 masters, gradients and optimizer states


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tp_local_shape(t: ParamTensor, tp: int) -> tuple[int, ...]:
    """Rank 0's tensor-parallel shard of ``t`` (``torch.chunk`` on ``t.tp_dim``)."""
    if t.tp_dim is None or tp == 1:
        return t.shape
    shape = list(t.shape)
    shape[t.tp_dim] = _cdiv(shape[t.tp_dim], tp)
    return tuple(shape)


def local_numel(t: ParamTensor, tp: int, dp_shard: int) -> int:
    """Elements of ``t`` on rank 0 after tp and fully_shard (dim 0 of the tp-local shard)."""
    shape = tp_local_shape(t, tp)
    row = 1
    for s in shape[1:]:
        row *= s
    return _cdiv(shape[0], dp_shard) * row


def gathered_numel(t: ParamTensor, tp: int, dp_shard: int) -> int:
    """Elements of fully_shard's padded all-gather output for ``t``: every rank's piece padded
    to ``ceil(rows / dp_shard)`` rows."""
    return dp_shard * local_numel(t, tp, dp_shard)


def stage_layers(num_layers: int, pp: int, stage: int) -> int:
    """Decoder layers on pipeline ``stage``: ``ceil(num_layers / pp)`` each, less one on the
    stages that make up the difference, taken first from the first stage (which also holds the
    embedding), then the last (the head and loss), then alternately inward, as torchtitan's
    ``first/last_stage_less_layers`` do: Llama 3.1 405B's 126 layers on 8 stages are
    ``15, 16 x 6, 15``; on 16 stages ``7, 8 x 14, 7``. Needs ``pp <= num_layers``."""
    per = _cdiv(num_layers, pp)
    short = per * pp - num_layers  # stages that hold one layer less, all distinct (< pp)
    order = [i // 2 if i % 2 == 0 else pp - 1 - i // 2 for i in range(pp)]
    return per - (stage in order[:short])


def max_stage_layers(num_layers: int, pp: int) -> int:
    """The most layers any stage holds (the stage the pipeline waits for)."""
    return _cdiv(num_layers, pp)


@dataclass(frozen=True)
class StageParams:
    """Elements of one pipeline stage's parameters on rank 0: ``local`` (the shards it keeps)
    and per fully_shard unit (one per layer, one root unit for embedding/norm/head) the padded
    all-gather size."""

    local: int
    unit_gathered: tuple[int, ...]  # distinct unit sizes: (block, root) or (block,)
    units: int


@lru_cache(maxsize=4096)
def _group_numels(spec: ModelSpec, tensors: tuple[ParamTensor, ...], tp: int,
                  ds: int) -> tuple[int, int]:
    return (sum(local_numel(t, tp, ds) for t in tensors),
            sum(gathered_numel(t, tp, ds) for t in tensors))


@lru_cache(maxsize=65536)
def stage_params(spec: ModelSpec, tp: int, dp_shard: int, pp: int, stage: int) -> StageParams:
    """The parameters of ``stage`` (:func:`stage_layers` layers; embedding on the first stage,
    norm and head on the last). Layers are identical, so one is computed and multiplied."""
    per_stage = stage_layers(spec.num_layers, pp, stage)
    block_local, block_gathered = _group_numels(spec, tuple(spec.block_tensors()), tp, dp_shard)
    root: list[ParamTensor] = []
    if stage == 0:
        root += spec.embed_tensors()
    if stage == pp - 1:
        root += spec.final_tensors(pipeline=pp > 1)
    root_local, root_gathered = _group_numels(spec, tuple(root), tp, dp_shard)
    units = (block_gathered,) * (per_stage > 0) + ((root_gathered,) if root else ())
    return StageParams(local=per_stage * block_local + root_local, unit_gathered=units,
                       units=per_stage + (1 if root else 0))


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank. ``peak``: parameters, optimizer states, FSDP buffers, activations,
    and the gradients when they exist while the most activations are held (``grads_at_peak``):
    under data_parallel (its buckets hold them), and with more than one microbatch, the first
    backward makes them while other microbatches' activations are held (gradient accumulation,
    every pipeline schedule). With one microbatch the gradients grow while backward frees the
    activations, so they do not add to the peak."""

    params: int
    grads: int
    optimizer: int
    fsdp_buffers: int
    activations: int
    stage: int
    grads_at_peak: bool = True

    @property
    def peak(self) -> int:
        grads = self.grads if self.grads_at_peak else 0
        return self.params + grads + self.optimizer + self.fsdp_buffers + self.activations

    @property
    def states(self) -> int:
        """params + grads + optimizer: the part the model gives exactly."""
        return self.params + self.grads + self.optimizer

    def to_json(self) -> dict[str, int | bool]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations + self.fsdp_buffers, "peak": self.peak,
                "grads_at_peak": self.grads_at_peak}


def in_flight(layout: Layout, stage: int) -> float:
    """Microbatches whose activations (of all the stage's layers) a stage holds at once: GPipe
    all of them, 1F1B and ZB-H1 ``pp - stage`` (at most ``microbatches``; ZB-H1 keeps 1F1B's
    peak, Qi et al. 2023), no pipeline one (gradient accumulation).

    Interleaved 1F1B with ``v`` chunks per rank: the chunks its warm-up runs before the first
    backward, plus the one forward of the first steady step, as torch pipelining's
    ``ScheduleInterleaved1F1B`` schedules them (``_get_warmup_ops``: ``(v - 1) R + 2 (pp - 1
    - rank)``, at most ``microbatches x v``, ``R`` the microbatches per round, ``pp`` when
    ``pp`` divides them), in whole-rank units (a chunk holds ``1 / v`` of the rank's layers).
    On the first rank with many microbatches that is Narayanan et al. 2021's
    ``pp (1 + (pp - 1) / (pp v))``; on the last it is ``((v - 1) R + 1) / v``, not 1: the
    last rank runs its first chunk for a whole round before its first backward."""
    if layout.pp == 1:
        return 1
    m = layout.microbatches
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved1f1b":
        v, pp = layout.virtual_stages, layout.pp
        per_round = m // max(1, m // pp)
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - stage), m * v)
        return min(warmup + 1, m * v) / v
    return min(layout.pp - stage, m)


def checkpointed_layers(layers: int, layout: Layout) -> int:
    """How many of ``layers`` consecutive layers full checkpointing recomputes: all, or with
    ``ac_every = k`` layers ``0, k, 2k, ...``: ``ceil(layers / k)``."""
    if not layout.activation_checkpointing:
        return 0
    return _cdiv(layers, layout.ac_every)


def microbatch_tokens(run: Run, layout: Layout) -> int:
    """Tokens in one microbatch on one rank (a data-parallel rank's microbatch, split ``cp``
    ways along the sequence under context parallelism)."""
    return run.global_batch // (layout.dp * layout.microbatches) * run.seq_len // layout.cp


def cp_activation_bytes(spec: ModelSpec, run: Run, layout: Layout) -> tuple[float, float]:
    """What context parallelism adds to the saved activations: (bytes per local token and
    layer, bytes once). Attention saves the K and V gathered over cp (``cp`` times the local
    ones, of which the local ``2 kv`` are already counted) in every layer, and the causal mask,
    one byte per (local query, key) pair: ``seq / cp x seq``, built once per context and shared
    by the layers, the batch and the heads."""
    if layout.cp == 1:
        return 0.0, 0.0
    per_token = 2 * spec.kv_dim / layout.tp * (layout.cp - 1) * run.compute_bytes
    return per_token, run.seq_len // layout.cp * run.seq_len


def layer_activation_elems(spec: ModelSpec, layout: Layout,
                           compute_bytes: int = 2) -> tuple[float, float]:
    """(elements saved per token by one layer for backward, elements saved per token under
    activation checkpointing), in the compute dtype (one-byte dropout masks counted as
    ``1 / compute_bytes`` elements). Assumes a fused attention kernel (no ``s x s`` scores; see
    :func:`eager_scores_bytes`).

    Llama block: norm inputs/outputs (4h), q/k/v before and after rotary (2q + 3kv), attention
    output (q), the SwiGLU intermediates (4f). GPT block (Korthikanti et al. 2022, sec. 4.1):
    the LayerNorms' inputs and the linears' inputs they feed (4h), q/k/v (q + 2kv), attention
    output (q), GeLU's input and output (2f), and with dropout two masks (2h bytes).

    Under tp the head/hidden tensors are split; with sequence parallelism the norm tensors and
    masks are too, and the inputs of the column-parallel linears (2h) are kept as their
    sequence shards and gathered again in backward (``layout.sp_reshard_input``, hyperpar's
    default and Megatron-LM's: the paper's ``34 s b h / t`` in fp16) or kept whole as torch's
    ColwiseParallel does (``(30 / t + 4) s b h``)."""
    h, f, tp = spec.hidden_size, spec.intermediate_size, layout.tp
    sp = layout.sequence_parallel
    gathered = 2 * h / tp if layout.sp_reshard_input else 2 * h  # what the all-gathers keep
    if spec.block == "gpt":
        inner = (2 * spec.q_dim + 2 * spec.kv_dim + 2 * f) / tp
        masks = 2 * h / compute_bytes if spec.dropout else 0.0
        if sp:  # LN inputs and masks split; LN outputs only feed the all-gathers
            outer = (2 * h + masks) / tp + gathered
        else:
            outer = 4 * h + masks
        return inner + outer, h / tp if sp else h
    inner = (3 * spec.q_dim + 3 * spec.kv_dim + 4 * f) / tp
    if sp:
        outer = 4 * h / tp + gathered
        saved = h / tp
    else:
        outer = 4 * h
        saved = h
    return inner + outer, saved


def sac_saved_elems(spec: ModelSpec, layout: Layout, compute_bytes: int) -> float:
    """Elements per token one layer saves under torchtitan's selective "op" checkpointing:
    the layer's input (split under sequence parallelism), the outputs of the odd-numbered
    matmuls in forward order (wq, wv, w1 split over tp; w2's, whole before its reduction),
    attention's output (split) and its fp32 log-sum-exp per head (split). The even matmuls
    (wk, wo, w3), norms, rotary and SwiGLU's elementwise ops are recomputed."""
    h, tp = spec.hidden_size, layout.tp
    layer_input = h / tp if layout.sequence_parallel else h
    split = (spec.q_dim + spec.kv_dim + spec.intermediate_size + spec.q_dim) / tp
    lse = spec.num_heads / tp * MASTER_BYTES / compute_bytes
    if spec.block == "gpt":  # wq, wk, wv, wo, fc1, fc2: the odd ones are wq, wv and fc1
        return layer_input + split + lse
    return layer_input + split + h + lse


def eager_scores_bytes(spec: ModelSpec, run: Run, layout: Layout) -> float:
    """What materialised (``eager``) attention saves per layer and microbatch on one rank: the
    softmax probabilities, ``heads / tp`` of ``(seq / cp) x seq`` per sequence in the compute
    dtype (the ``5 a s / h`` term of Korthikanti et al. 2022 less its dropout mask and
    pre-softmax scores, which a dropout-free block does not keep; with ``spec.dropout`` its
    one-byte mask and its output in the compute dtype too: ``5 a s / h`` in fp16). 0 with a
    fused kernel."""
    if run.attention == "flash":
        return 0.0
    sequences = run.global_batch // (layout.dp * layout.microbatches)
    per_elem = run.compute_bytes + (1 + run.compute_bytes if spec.dropout else 0)
    return (sequences * spec.num_heads / layout.tp * (run.seq_len // layout.cp) * run.seq_len
            * per_elem)


def pipeline_outputs_bytes(spec: ModelSpec, run: Run, layout: Layout) -> int:
    """What torch.distributed.pipelining's last stage keeps of its outputs (``.gstep``, the
    engine that syncs gradients once per step): ``PipelineStage.forward_one_chunk`` appends
    every microbatch's output, the logits in the compute dtype (vocabulary shards under loss
    parallel), to ``output_chunks``, held to the end of ``step`` for ``merge_output_chunks``
    (``step(return_outputs=True)``, the default) — all ``microbatches`` of them at the last
    microbatch's loss backward, where the planner's loss term counts only fp32 tensors. 0
    without a pipeline or under hyperpar.pipeline's engine (``grad_sync="microbatch"``),
    which returns only the loss."""
    if layout.pp == 1 or layout.grad_sync != "step":
        return 0
    vocab = spec.vocab_size
    if layout.tp > 1 and layout.loss_parallel:
        vocab = _cdiv(vocab, layout.tp)
    return layout.microbatches * microbatch_tokens(run, layout) * vocab * run.compute_bytes


def stage_memory(spec: ModelSpec, run: Run, layout: Layout, stage: int) -> Memory:
    tp, ds = layout.tp, layout.fsdp_shard  # fully_shard's group: dp_shard (x cp)
    sp = stage_params(spec, tp, ds, layout.pp, stage)
    local = sp.local
    cb = run.compute_bytes
    params = local * MASTER_BYTES
    if ds == 1 and cb != MASTER_BYTES:
        params += local * cb  # the compute-dtype copy; fully_shard gathers it per unit instead
    grads = local * MASTER_BYTES
    optimizer = local * run.optimizer_state_bytes * run.optimizer_states
    if layout.zero:
        # ZeRO (Rajbhandari et al. 2020, sec. 5.1): compute-dtype parameters and gradients
        # replicated, the fp32 masters and optimizer states partitioned evenly over the data-
        # parallel group (one flat buffer: ceil(local / n) elements each), and with ZeRO-2 the
        # gradients too: (2 + 2 + K / n) and (2 + (2 + K) / n) bytes per parameter, K = 12
        n = layout.dp_replicate  # with cp > 1 refused by search.shape_problems
        part = _cdiv(local, n)
        params = local * cb
        grads = (part if layout.zero == 2 else local) * run.zero_grad_bytes
        optimizer = part * (MASTER_BYTES + run.optimizer_state_bytes * run.optimizer_states)
    block_buffers = buffers = 0
    if ds > 1:
        # a layer in use, the one prefetched ahead and one layer's unsharded gradients; the
        # root unit (embedding, norm, head) stays gathered from its forward to its backward
        block, *root = sp.unit_gathered
        block_buffers = 3 * block * cb
        if not layout.reshard_after_forward:
            # every layer of the stage stays gathered from its forward to its backward, plus
            # the one prefetched and one layer's unsharded gradients
            block_buffers = (stage_layers(spec.num_layers, layout.pp, stage) + 2) * block * cb
        buffers = block_buffers + sum(root) * cb
        if layout.grad_sync == "step" and layout.microbatches > 1:
            # torch pipelining's schedules turn gradient sync and resharding after backward
            # off but for a stage's last backward: every unit stays gathered (with one
            # layer's compute-dtype gradient before it is added) and every unit's unsharded
            # gradient accumulates in the reduce dtype (FSDP2's ``unsharded_accumulated_grad``)
            layers = stage_layers(spec.num_layers, layout.pp, stage)
            block_buffers = max(block_buffers, (layers + 1) * block * cb)
            gathered = layers * block + sum(root)
            buffers = block_buffers + sum(root) * cb + gathered * run.reduce_bytes
    tokens = microbatch_tokens(run, layout)
    full, saved = layer_activation_elems(spec, layout, cb)
    layers = stage_layers(spec.num_layers, layout.pp, stage)
    k = in_flight(layout, stage)
    cp_token, cp_layer = cp_activation_bytes(spec, run, layout)
    # the causal mask is built once per context and shared by every layer and microbatch
    scores = eager_scores_bytes(spec, run, layout)
    if layout.activation_checkpointing:
        # checkpointed layers keep their input; the others (acN) all they save; one
        # checkpointed layer's recomputed activations are live in its backward
        ckpt = checkpointed_layers(layers, layout)
        act = (k * ckpt * saved * tokens * cb
               + k * (layers - ckpt) * (full * tokens * cb + cp_token * tokens + scores)
               + full * tokens * cb + cp_token * tokens + cp_layer)
        act += scores  # one layer's, recomputed in its backward
    elif layout.selective_ac:
        # the saved part of every layer held, and one layer's recomputed rest in its backward
        sac = sac_saved_elems(spec, layout, cb)
        act = (k * layers * (sac * tokens * cb + cp_token * tokens)
               + (full - sac) * tokens * cb + cp_layer)
        act += scores  # attention's output is saved, its probabilities recomputed
    else:
        act = k * layers * (full * tokens * cb + cp_token * tokens + scores) + cp_layer
    if stage == layout.pp - 1:
        # the loss, ``F.cross_entropy(logits.float(), labels)``: each microbatch held to its
        # backward keeps its fp32 log-softmax (GPipe holds them all); the loss's backward
        # makes two more fp32 tensors of the logits' size at once, nll_loss's gradient (zeros
        # but the label entries) and log_softmax's, before the head's backward (forward holds
        # at most the compute-dtype logits, their fp32 copy and the log-softmax: less);
        # under tp the head's local vocabulary shard before the logits are all-gathered to
        # replicate (the plan without loss_parallel). Measured: tests/plan/test_memory.py
        held = layout.microbatches if layout.pp > 1 and layout.schedule == "gpipe" else 1
        vocab = spec.vocab_size
        if tp > 1 and layout.loss_parallel:
            # loss_parallel: logits, log-softmax and its gradient stay vocabulary shards
            vocab = _cdiv(vocab, tp)
        if run.loss == "fused":
            # a fused kernel keeps the logits and a per-token fp32 log-sum-exp; its backward
            # writes one gradient of the logits' size and dtype
            act += held * tokens * (vocab * cb + MASTER_BYTES)
            around_loss = tokens * vocab * cb
        else:
            act += held * tokens * vocab * MASTER_BYTES
            around_loss = tokens * vocab * 2 * MASTER_BYTES
            if run.loss == "torch-lp" and tp > 1 and layout.loss_parallel:
                # torch's loss_parallel backward (_nll_loss_and_log_softmax_backward) holds
                # zeros_like(x), exp(x) and their sum at once beside the saved log-softmax:
                # 16 bytes per logit shard (measured with the profiler's allocator events)
                around_loss += tokens * vocab * MASTER_BYTES
        if tp > 1 and not layout.loss_parallel:
            around_loss += tokens * _cdiv(vocab, tp) * cb
        if ds > 1 and not layout.activation_checkpointing:
            # fully_shard reshards every block after its forward and gathers the last one
            # again only once backward has passed the loss: the loss's transient tensors and
            # the gathered blocks are not live at once, the peak holds the larger. (Under
            # activation checkpointing the peak is in a recomputed block's backward, where the
            # gradients of its recomputed activations, not counted apart, take their place.)
            around_loss = max(around_loss - block_buffers, 0)
        act += around_loss
        act += pipeline_outputs_bytes(spec, run, layout)
    # data_parallel (over dp_replicate x cp) keeps the gradients in its flat buckets from the
    # first backward on; with dp_shard > 1 fully_shard (over dp_shard x cp) reduces them instead
    ddp = (layout.dp_replicate > 1 or layout.cp > 1) and ds == 1
    # sync once per step: the sharded gradients appear only after the last backward
    step_sync = layout.grad_sync == "step" and ds > 1
    return Memory(params=params, grads=grads, optimizer=optimizer, fsdp_buffers=int(buffers),
                  activations=int(act), stage=stage,
                  grads_at_peak=ddp or (layout.microbatches > 1 and not step_sync))


def memory_per_rank(spec: ModelSpec, run: Run, layout: Layout) -> Memory:
    """The memory of the stage with the highest peak (first, last or a middle stage)."""
    stages = {0, layout.pp - 1}
    if layout.pp > 2:
        stages.add(1)
    if spec.num_layers % layout.pp:  # uneven: the first stage holding the most layers too
        stages.add(next(s for s in range(layout.pp)
                        if stage_layers(spec.num_layers, layout.pp, s)
                        == max_stage_layers(spec.num_layers, layout.pp)))
    return max((stage_memory(spec, run, layout, s) for s in sorted(stages)),
               key=lambda m: m.peak)
