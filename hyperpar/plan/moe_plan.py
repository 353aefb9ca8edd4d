"""Memory and step time of a Mixture-of-Experts layout: expert parallelism (``ep``) and expert
tensor parallelism (``etp``) beside ``dp_replicate x dp_shard x tp x pp``, the experts' own
data-parallel group, ZeRO-1/2 or fully_shard, dropless or capacity-bounded routing,
all-to-all dispatch/combine over NVLink and NICs (node-limited routing), grouped-GEMM tile
efficiency, and the DualPipe schedule beside 1F1B / interleaved / ZB-H1.

Groups, as Megatron-core defines them: on the ``world / pp`` ranks of a stage the dense part
is ``dp x tp`` (``dp = dp_replicate x dp_shard``) and the experts are ``edp x ep x etp``, so
the experts' data-parallel group has ``edp = world / (pp x ep x etp)`` ranks. Under
fully_shard the experts are sharded over ``edp / dp_replicate`` of them (torchtitan's
``dp_shard_mod_ep``), replicated over ``dp_replicate``.

What is estimated rather than exact (docs/planning.md, "MoE"): activations (per token per
layer, :func:`moe_layer_activation_elems`), balanced routing (every expert receives
``tokens x top_k x capacity / experts`` rows, as the published benchmarks force), compute at
the profile's efficiency times the grouped GEMM's tile efficiency. Not modelled, refused:
context parallelism with MoE. No framework is imported here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from .devices import DeviceProfile
from .layout import Layout, Run, parse_layout
from .memory import MASTER_BYTES, in_flight, stage_layers
from .moe import MoESpec
from .timing import Link

#: Tile edge of the grouped GEMM kernels (CUTLASS grouped GEMM and DeepGEMM's ``BLOCK_M``
#: / ``BLOCK_N`` = 128): each expert's rows and its output width are computed in whole tiles.
GEMM_TILE = 128


@dataclass(frozen=True)
class MoELayout:
    """A dense :class:`Layout` (dp_replicate, dp_shard, tp, pp, microbatches, checkpointing,
    schedule, ZeRO) plus the expert dims. ``capacity``: 0 dropless, else the capacity factor
    (each expert computes ``capacity x`` its balanced share of rows, padded). ``node_limit``:
    a token's experts lie on at most that many nodes and it crosses the network once per node
    (DeepSeek-V3's routing, M = 4); 0: no limit, each copy travels on its own.
    ``dualpipe``: DeepSeek-V3's bidirectional schedule (the base schedule is then ignored)."""

    base: Layout
    ep: int = 1
    etp: int = 1
    capacity: float = 0.0
    node_limit: int = 0
    dualpipe: bool = False
    #: the fraction of the all-to-all that hides behind computation: None = the schedule's
    #: own (DualPipe 1: its paired chunks overlap dispatch/combine with compute, DeepSeek-V3
    #: sec. 3.2.1; the others 0: dispatch and combine block the layer)
    a2a_overlap: float | None = None

    @property
    def world(self) -> int:
        return self.base.world

    @property
    def edp(self) -> int:
        """Ranks of the experts' data-parallel group."""
        return self.world // (self.base.pp * self.ep * self.etp)

    @property
    def expert_shard(self) -> int:
        """Ranks fully_shard splits an expert over (1 without fully_shard)."""
        if self.base.dp_shard == 1:
            return 1
        return max(1, self.edp // self.base.dp_replicate)

    @property
    def name(self) -> str:
        parts = self.base.name.split(".")
        if self.dualpipe:
            parts = [p for p in parts if p not in ("1f1b",)] + ["dualpipe"]
        extra = [f"ep{self.ep}"] + ([f"etp{self.etp}"] if self.etp > 1 else [])
        if self.capacity:
            extra.append(f"cap{round(self.capacity * 100)}")
        if self.node_limit:
            extra.append(f"nl{self.node_limit}")
        # the expert dims after the dense ones, before the microbatch count
        at = next((i for i, p in enumerate(parts) if p.startswith("mb")), len(parts))
        return ".".join(parts[:at] + extra + parts[at:])


def parse_moe_layout(name: str, schedule: str = "1f1b", virtual_stages: int = 2) -> MoELayout:
    """A name as :attr:`MoELayout.name` prints it: the dense parts (:func:`parse_layout`) and
    ``epN``, ``etpN``, ``capP`` (capacity factor in percent, ``cap125``; default dropless),
    ``nlM`` (node-limited routing), ``dualpipe``, e.g.
    ``dp128.pp16.ep64.nl4.mb120.zero1.dualpipe``."""
    fields: dict[str, object] = {}
    rest = []
    for part in name.strip().lower().split("."):
        m = re.fullmatch(r"(ep|etp|nl)(\d+)", part)
        if m:
            key = {"ep": "ep", "etp": "etp", "nl": "node_limit"}[m.group(1)]
            if key in fields:
                raise ValueError(f"hyperpar plan: layout {name!r} gives {m.group(1)} twice")
            fields[key] = int(m.group(2))
            if fields[key] < 1:
                raise ValueError(f"hyperpar plan: layout {name!r}: {part} must be >= 1")
        elif re.fullmatch(r"cap\d+", part):  # in percent: cap125 is a factor of 1.25
            fields["capacity"] = int(part[3:]) / 100
            if fields["capacity"] < 1:  # type: ignore[operator]
                raise ValueError(f"hyperpar plan: layout {name!r}: {part}: a capacity factor "
                                 "below 1 drops tokens even with balanced routing; write "
                                 "cap100 or more (percent), or leave it out (dropless)")
        elif part == "dropless":
            fields["capacity"] = 0.0
        elif part == "dualpipe":
            fields["dualpipe"] = True
        else:
            rest.append(part)
    base = parse_layout(".".join(rest) or "single", schedule, virtual_stages)  # type: ignore[arg-type]
    return MoELayout(base=base, **fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------ problems
def moe_shape_problems(spec: MoESpec, run: Run, lay: MoELayout) -> list[str]:
    """Why ``lay`` cannot run ``spec`` (empty: it can)."""
    b, out = lay.base, []
    tp, pp, m, dp = b.tp, b.pp, b.microbatches, b.dp
    heads_kv = spec.num_kv_heads if spec.attention == "gqa" else spec.num_heads
    if spec.num_heads % tp or heads_kv % tp:
        out.append(f"attention heads ({spec.num_heads}, kv {heads_kv}) % tp={tp} != 0")
    if b.sequence_parallel and run.seq_len % tp:
        out.append(f"seq_len={run.seq_len} % tp={tp} != 0 (sequence parallel splits it)")
    if b.cp > 1:
        out.append(f"cp={b.cp} with an MoE model: not modelled (write cp1)")
    if spec.experts % lay.ep:
        out.append(f"experts={spec.experts} % ep={lay.ep} != 0")
    if spec.expert_intermediate % lay.etp:
        out.append(f"moe_intermediate_size={spec.expert_intermediate} % etp={lay.etp} != 0")
    inner = run.world // pp if run.world % pp == 0 else 0
    if not inner or inner % (lay.ep * lay.etp):
        out.append(f"ep*etp={lay.ep * lay.etp} does not divide the world/pp={run.world}/{pp} "
                   "ranks of a stage")
    elif b.dp_shard > 1 and lay.edp % b.dp_replicate:
        out.append(f"experts' data-parallel group {lay.edp} % dp_replicate={b.dp_replicate}"
                   " != 0 (fully_shard splits experts over the rest)")
    if pp > spec.num_layers:
        out.append(f"pp={pp} > num_hidden_layers={spec.num_layers}")
    if run.global_batch % dp:
        out.append(f"global_batch={run.global_batch} % (dp_replicate*dp_shard)={dp} != 0")
    elif (run.global_batch // dp) % m:
        out.append(f"per-replica batch {run.global_batch // dp} % microbatches={m} != 0")
    if pp > 1 and m < pp:
        out.append(f"microbatches={m} < pp={pp} leaves stages idle")
    if lay.dualpipe and (pp % 2 or m % 2 or pp < 2):
        out.append(f"dualpipe needs an even pp >= 2 and an even microbatch count "
                   f"(pp={pp}, microbatches={m}; DeepSeek-V3 sec. 3.2.1)")
    if b.schedule == "interleaved1f1b" and pp > 1 and not lay.dualpipe:
        if m % pp:
            out.append(f"microbatches={m} % pp={pp} != 0 (interleaved 1F1B)")
        if pp * b.virtual_stages > spec.num_layers:
            out.append(f"pp*virtual_stages={pp * b.virtual_stages} > layers")
    if b.activation_checkpointing and b.selective_ac:
        out.append("activation_checkpointing and selective_ac: choose one")
    if b.selective_ac:
        out.append("selective op checkpointing (sac) of an MoE layer: not modelled (write ac)")
    if lay.world != run.world:
        out.append(f"layout has {lay.world} ranks, the run {run.world}")
    return out


# ------------------------------------------------------------------ parameters
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


# ------------------------------------------------------------------ time
def tile_efficiency(rows: float, width: float) -> float:
    """Useful share of a grouped GEMM's work when each expert's ``rows`` and its output
    ``width`` are computed in whole :data:`GEMM_TILE` tiles: fine-grained experts (narrow,
    few rows each) waste the padding."""
    def share(n: float) -> float:
        return n / (math.ceil(n / GEMM_TILE) * GEMM_TILE) if n > 0 else 1.0
    return share(rows) * share(width)


@dataclass
class MoEStepTime:
    """Predicted seconds of one step and its parts (per rank)."""

    step_s: float
    compute_s: float
    bubble_s: float
    a2a_s: float
    a2a_exposed_s: float
    tp_s: float
    pp_s: float
    fsdp_exposed_s: float
    dp_exposed_s: float
    optimizer_s: float
    gemm_efficiency: float

    @property
    def step_ms(self) -> float:
        return self.step_s * 1e3


def a2a_seconds(spec: MoESpec, run: Run, lay: MoELayout, profile: DeviceProfile,
                tokens: float) -> float:
    """One dispatch (or combine) of ``tokens`` local tokens: each sends ``top_k x capacity``
    copies of ``h`` elements to the ep group, whose members fill a node ``g`` at a time
    (``ep`` innermost after ``etp``). Copies to the own node ride NVLink; to other nodes the
    NICs: without node limit each remote copy on its own, with ``nl M`` once per remote node
    it reaches (``min(M, nodes)`` nodes, DeepSeek-V3's IB-then-NVLink forwarding). The two
    run at once; the slower sets the time."""
    if lay.ep == 1:
        return 0.0
    copies = spec.top_k * (lay.capacity or 1.0)
    row = spec.hidden * run.compute_bytes
    g = max(1, min(lay.ep, run.gpus_per_node // lay.etp))
    nodes = math.ceil(lay.ep / g)
    intra = tokens * copies * (g - 1) / lay.ep * row
    if nodes == 1:
        inter = 0.0
    elif lay.node_limit:
        reached = min(lay.node_limit, nodes)
        inter = tokens * reached * (nodes - 1) / nodes * row
        intra += tokens * copies * (lay.ep - g) / lay.ep * row  # forwarded inside the node
    else:
        inter = tokens * copies * (lay.ep - g) / lay.ep * row
    eff = profile.link_efficiency
    t = intra / (profile.intra_bytes_per_s * eff)
    if inter:
        t = max(t, inter / (profile.inter_bytes_per_s * eff)) + profile.inter_alpha_s
    return t + profile.intra_alpha_s


def bubble_factor(lay: MoELayout) -> float:
    """The bubble relative to 1F1B's ``(pp - 1)(F + B)``. DualPipe's published bubble is
    ``(pp / 2 - 1)(F&B + B - 3W)`` (DeepSeek-V3 Table 2); with a backward of twice the
    forward split evenly into input and weight gradients (``F = W = (F + B) / 3``) and the
    overlapped ``F&B`` costing ``F + B``, that is ``(pp / 2 - 1) x 2/3 (F + B)``. Interleaved
    ``1 / v``, ZB-H1 ``1 / 3``, GPipe and 1F1B 1 (as the dense planner)."""
    b = lay.base
    if b.pp == 1:
        return 0.0
    if lay.dualpipe:
        return (b.pp / 2 - 1) * 2 / 3 / (b.pp - 1)
    if b.schedule == "interleaved1f1b":
        return 1 / b.virtual_stages
    if b.schedule == "zbh1":
        return 1 / 3
    return 1.0


def moe_step_time(spec: MoESpec, run: Run, lay: MoELayout, profile: DeviceProfile,
                  memory: MoEMemory, *, float8: float = 1.0) -> MoEStepTime:
    """Seconds of one step. Compute: ``6 x active matmul params x tokens + attention``
    (:meth:`MoESpec.flops_per_token`, the MTP modules' layer and head added, a recomputed
    forward under ``ac``) over the world at the profile's rate, the linears ``float8`` times
    faster (the user's Float8 factor, 1: bf16) and the routed experts' share divided by
    :func:`tile_efficiency`. Per microbatch on the critical path: tp's sequence-parallel
    all-gathers/reduce-scatters, the pipeline's messages, the all-to-all less what the
    schedule overlaps, fully_shard's collectives beyond what compute hides; per step the
    bubble, the data-parallel gradient reduction (dense part over ``dp``, experts over
    ``edp``) beyond what the last backward hides, ZeRO's parameter all-gather, the optimizer."""
    b = lay.base
    m, pp, tp, cb = b.microbatches, b.pp, b.tp, run.compute_bytes
    tokens_step = run.global_batch * run.seq_len
    h = spec.hidden
    mtp_active = spec.mtp * (spec.top_k * 3 * h * spec.expert_intermediate
                             + spec.shared_experts * 3 * h * (spec.shared_intermediate
                                                              or spec.expert_intermediate)
                             + 2 * h * h + spec.vocab * h + spec._attention_matmul)
    routed_active = spec.moe_layers * spec.top_k * 3 * h * spec.expert_intermediate
    other_active = spec.active_matmul_parameters + mtp_active - routed_active
    ac = 1.0 if b.activation_checkpointing else 0.0
    factor = 6 + 2 * ac
    attn = spec.attention_flops_per_token(run.seq_len) * (1 + ac / 3.5)
    rows_per_expert = (microbatch_tokens(run, lay) * b.dp * spec.top_k * (lay.capacity or 1.0)
                       / spec.experts / lay.edp)
    eff = tile_efficiency(rows_per_expert, spec.expert_intermediate / lay.etp)
    rate = profile.flops(run.param_dtype)
    compute_step = ((factor * other_active / float8
                     + factor * routed_active / float8 / eff) * tokens_step
                    + attn * tokens_step) / run.world / rate
    compute_mb = compute_step / m * (math.ceil(spec.num_layers / pp) * pp / spec.num_layers)

    def link(span: int, members: int) -> Link:
        if span <= run.gpus_per_node:
            return Link(profile.intra_bytes_per_s * profile.link_efficiency,
                        profile.intra_alpha_s)
        g = max(1, min(members, run.gpus_per_node))
        bw = min(profile.intra_bytes_per_s, g * profile.inter_bytes_per_s)
        return Link(bw * profile.link_efficiency, profile.inter_alpha_s)

    layers = math.ceil(spec.num_layers / pp) * (2 if lay.dualpipe else 1)
    d0, moe0 = _stage_split(spec, pp, 0)
    moe_layers = max(_stage_split(spec, pp, s)[1] for s in range(pp))
    if lay.dualpipe:
        moe_layers = max(_stage_split(spec, pp, s)[1] + _stage_split(spec, pp, pp - 1 - s)[1]
                         for s in range(pp))
    tokens_mb = microbatch_tokens(run, lay)
    passes = 2 + ac  # forward, backward, a recomputed forward
    tp_mb = 0.0
    if tp > 1:
        act = tokens_mb * h * cb
        tp_mb = link(tp, tp).ring(tp, act, "ag") * 4 * passes / 2 * layers
    # all-to-all: dispatch and combine forward, their gradients backward, again when recomputed
    local_tokens = tokens_mb / tp if b.sequence_parallel else tokens_mb
    a2a_mb = 2 * passes * moe_layers * a2a_seconds(spec, run, lay, profile, local_tokens)
    overlap = lay.a2a_overlap if lay.a2a_overlap is not None else (1.0 if lay.dualpipe
                                                                  else 0.0)
    a2a_exposed_mb = max(0.0, a2a_mb - overlap * compute_mb)
    pp_mb = 0.0
    if pp > 1:
        msg = tokens_mb * h * cb / (tp if b.sequence_parallel else 1)
        pp_mb = 2 * link(run.world, 1).p2p(msg) * b.virtual_stages
    fsdp_exposed_mb = 0.0
    dense, routed, unit = stage_param_counts(spec, lay, memory.stage)
    if b.dp_shard > 1:
        gathers = 2 if b.reshard_after_forward else 1
        span = run.world // pp
        t = (link(span, b.dp_shard).ring(b.dp_shard, dense * cb, "ag") * gathers
             + link(span, b.dp_shard).ring(b.dp_shard, dense * run.reduce_bytes, "rs")
             + link(span, lay.expert_shard).ring(lay.expert_shard, routed * cb, "ag") * gathers
             + link(span, lay.expert_shard).ring(lay.expert_shard, routed * run.reduce_bytes,
                                                 "rs"))
        fsdp_exposed_mb = max(0.0, t - profile.comm_overlap * compute_mb)
    tau = compute_mb + tp_mb + pp_mb + a2a_exposed_mb + fsdp_exposed_mb
    bubble = (pp - 1) * tau * bubble_factor(lay)
    pipe = m * tau + bubble
    dp_exposed = 0.0
    if b.dp_shard == 1 and (b.dp > 1 or lay.edp > 1):
        span = run.world // pp
        kind = "rs" if b.zero == 2 else "ar"
        t_ar = (link(span, b.dp).ring(b.dp, dense * run.reduce_bytes, kind)
                + link(span, lay.edp).ring(lay.edp, routed * run.reduce_bytes, kind))
        dp_exposed = max(0.0, t_ar - profile.comm_overlap * 2 / 3 * compute_mb)
        if b.zero:  # the updated parameters all-gathered from their owners after the step
            dp_exposed += (link(span, b.dp).ring(b.dp, dense * cb, "ag")
                           + link(span, lay.edp).ring(lay.edp, routed * cb, "ag"))
    optimizer = 2 * memory.states / profile.hbm_bytes_per_s
    total = pipe + dp_exposed + optimizer
    del d0, moe0
    return MoEStepTime(step_s=total, compute_s=compute_step, bubble_s=bubble,
                       a2a_s=a2a_mb * m, a2a_exposed_s=a2a_exposed_mb * m, tp_s=tp_mb * m,
                       pp_s=pp_mb * m, fsdp_exposed_s=fsdp_exposed_mb * m,
                       dp_exposed_s=dp_exposed, optimizer_s=optimizer, gemm_efficiency=eff)


# ------------------------------------------------------------------ search
@dataclass
class MoECandidate:
    layout: MoELayout
    memory: MoEMemory
    time: MoEStepTime
    tokens_per_s_per_device: float
    fits: bool
    reason: str = ""


def moe_evaluate(spec: MoESpec, run: Run, lay: MoELayout, profile: DeviceProfile, *,
                 float8: float = 1.0) -> MoECandidate:
    """One layout: its memory and time, ``fits`` False with the reason when its peak exceeds
    the device. Raises ``ValueError`` naming every problem when it cannot run at all."""
    problems = moe_shape_problems(spec, run, lay)
    if problems:
        raise ValueError(f"hyperpar plan: layout {lay.name} cannot run {spec.name}: "
                         + "; ".join(problems))
    mem = moe_memory_per_rank(spec, run, lay)
    t = moe_step_time(spec, run, lay, profile, mem, float8=float8)
    tps = run.global_batch * run.seq_len / t.step_s / run.world
    fits = mem.peak <= run.device_memory
    reason = "" if fits else (f"OOM: peak {mem.peak / 2**30:.2f} GiB > "
                              f"{run.device_memory / 2**30:.2f} GiB")
    return MoECandidate(lay, mem, t, tps, fits, reason)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_moe_layouts(spec: MoESpec, run: Run, *, max_microbatches: int = 4,
                          schedule: str = "1f1b") -> list[MoELayout]:
    """Layouts with ``ep`` beside the dense dims: every ``pp`` (powers of two up to 16 and the
    divisors of the world), ``tp`` up to the node, ``ep`` dividing the experts and the stage's
    ranks, ``etp`` 1 or ``tp``, fully_shard or ZeRO-1 over the rest, dropless, the smallest
    microbatch counts a pipeline allows, checkpointing off and on, DualPipe beside
    ``schedule`` for even ``pp``. Node-limited routing is applied where ep spans nodes and
    the model has more than one expert group (``nl4``, DeepSeek's M)."""
    out: list[MoELayout] = []
    w = run.world
    for pp in [p for p in _divisors(w) if p <= min(spec.num_layers, 64)]:
        inner = w // pp
        for tp in [t for t in _divisors(inner) if t <= run.gpus_per_node]:
            dp = inner // tp
            if run.global_batch % dp:
                continue
            per = run.global_batch // dp
            mbs = [mb for mb in _divisors(per) if mb >= pp][:max_microbatches] if pp > 1 \
                else _divisors(per)[:max_microbatches]
            for ep in [e for e in _divisors(inner) if spec.experts % e == 0]:
                for etp in sorted({1, tp}):
                    if inner % (ep * etp):
                        continue
                    for fsdp in (True, False):
                        dims = dict(dp_shard=dp) if fsdp else dict(dp_replicate=dp)
                        if not fsdp and dp == 1:
                            continue
                        for mb in mbs:
                            for ac in (False, True):
                                base = Layout(tp=tp, pp=pp, microbatches=mb,
                                              activation_checkpointing=ac,
                                              schedule=schedule if pp > 1 else "1f1b",  # type: ignore[arg-type]
                                              virtual_stages=2 if schedule ==
                                              "interleaved1f1b" and pp > 1 else 1,
                                              zero=0 if fsdp else 1,
                                              **dims)  # type: ignore[arg-type]
                                nl = 4 if ep > run.gpus_per_node else 0
                                out.append(MoELayout(base, ep=ep, etp=etp, node_limit=nl))
                                if pp > 1 and pp % 2 == 0 and mb % 2 == 0:
                                    out.append(MoELayout(replace(base, schedule="1f1b",
                                                                 virtual_stages=1),
                                                         ep=ep, etp=etp, node_limit=nl,
                                                         dualpipe=True))
    return out


def moe_plan(spec: MoESpec, run: Run, profile: DeviceProfile, *, float8: float = 1.0,
             schedule: str = "1f1b") -> tuple[list[MoECandidate], list[tuple[str, str]], int]:
    """Rank the MoE layouts of ``run``: (fitting candidates fastest first, (name, reason) of
    those ruled out, layouts considered)."""
    ranked: list[MoECandidate] = []
    ruled: list[tuple[str, str]] = []
    layouts = enumerate_moe_layouts(spec, run, schedule=schedule)
    for lay in layouts:
        problems = moe_shape_problems(spec, run, lay)
        if problems:
            ruled.append((lay.name, "; ".join(problems)))
            continue
        c = moe_evaluate(spec, run, lay, profile, float8=float8)
        if c.fits:
            ranked.append(c)
        else:
            ruled.append((lay.name, c.reason))
    ranked.sort(key=lambda c: (c.time.step_s, c.memory.peak))
    return ranked, ruled, len(layouts)
