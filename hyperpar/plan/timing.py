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

from .devices import GROUP_COSTS, DeviceProfile
from .layout import Layout, Run
from .memory import (
    MASTER_BYTES,
    Memory,
    checkpointed_layers,
    eager_scores_bytes,
    layer_activation_elems,
    max_stage_layers,
    microbatch_tokens,
    stage_layers,
    stage_params,
)
from .model import ModelSpec, ParamTensor, is_matmul


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


def ranks_per_node(dim: str, layout: Layout, run: Run) -> int:
    """Members of one ``dim`` group inside one node: consecutive members are ``stride`` ranks
    apart, so a node of ``gpus_per_node`` holds ``gpus_per_node // stride`` of them (at least
    one, at most the group). fully_shard's flattened ``dp_shard x cp`` group (booked on
    ``dp_shard``) has ``dp_shard * cp`` members, cp's stride apart."""
    stride, size = layout.stride(dim), layout.size(dim)
    if dim == "dp_shard" and layout.cp > 1:
        stride, size = layout.stride("cp"), layout.fsdp_shard
    return max(1, min(size, run.gpus_per_node // stride))


def link_for(dim: str, layout: Layout, run: Run, profile: DeviceProfile) -> Link:
    """The link a ring over ``dim`` runs at. Inside a node: the per-device intra-node
    bandwidth. Across nodes, a ring with ``g`` members per node (:func:`ranks_per_node`)
    enters and leaves each node once per ring, and NCCL runs one ring per NIC: the ``g``
    members together use ``g`` devices' share of the node's NICs (``g x inter_bytes_per_s``)
    while their intra-node hops ride NVLink, so the ring's bandwidth is
    ``min(intra, g x inter)``. With one member per node (``tp`` inside, the group across
    nodes) that is one device's NIC share, as before."""
    span = layout.stride(dim) * layout.size(dim)
    if span <= run.gpus_per_node:
        return Link(profile.intra_bytes_per_s * profile.link_efficiency, profile.intra_alpha_s)
    g = ranks_per_node(dim, layout, run)
    bw = min(profile.intra_bytes_per_s, g * profile.inter_bytes_per_s)
    return Link(bw * profile.link_efficiency, profile.inter_alpha_s)


def sac_recomputed_parameters(spec: ModelSpec) -> int:
    """Matmul parameters per layer whose forward selective "op" checkpointing repeats: the
    even-numbered matmuls wk, wo and w3."""
    h = spec.hidden_size
    return spec.kv_dim * h + h * spec.q_dim + spec.intermediate_size * h


def recompute_share(spec: ModelSpec, layout: Layout) -> float:
    """The share of the model's layers whose forward full checkpointing repeats (1 with
    ``.ac``, ``ceil(L / k) / L`` with ``.acK``; 0 without)."""
    return checkpointed_layers(spec.num_layers, layout) / spec.num_layers


def attention_passes(run: Run, activation_checkpointing: bool | float) -> float:
    """Attention's FLOPs per step in units of its forward's. Forward: two matmuls (``Q K^T``
    and ``P V``). Materialised attention's backward: four (``dP = dO V^T``, ``dV = P^T dO``,
    ``dQ = dS K``, ``dK = dS^T Q``), 2 forwards. A fused (flash) kernel keeps no ``P`` and
    computes ``Q K^T`` again in backward: five, 2.5 forwards (Dao et al. 2022, Algorithm 4).
    Full checkpointing repeats the forward (a number: the share of layers it repeats)."""
    backward = 2.5 if run.attention == "flash" else 2.0
    return 1 + backward + float(activation_checkpointing)


def step_flops(spec: ModelSpec, run: Run, activation_checkpointing: bool | float,
               selective_ac: bool = False) -> float:
    """FLOPs of one optimizer step over all ranks: ``6 * P * tokens`` for the matmuls
    (forward 2, backward 4; 8 with activation checkpointing, which repeats the forward) plus
    causal attention, ``2 * seq * q_dim`` per token per layer forward, times
    :func:`attention_passes`. Selective checkpointing repeats only the forward of wk, wo and
    w3 (:func:`sac_recomputed_parameters`), not attention's. ``activation_checkpointing`` as
    a number: the share of layers recomputed (:func:`recompute_share`)."""
    tokens = run.global_batch * run.seq_len
    factor = 6 + 2 * float(activation_checkpointing)
    attn_fwd = 2 * run.seq_len * spec.q_dim * spec.num_layers
    out = (factor * spec.matmul_parameters * tokens
           + attention_passes(run, activation_checkpointing) * attn_fwd * tokens)
    if selective_ac and not activation_checkpointing:
        out += 2 * sac_recomputed_parameters(spec) * spec.num_layers * tokens
    return out


def matmul_step_flops(spec: ModelSpec, run: Run, layout: Layout) -> float:
    """The linears' part of :func:`step_flops` (what Float8 speeds up): ``6 P tokens``, 8
    for the recomputed layers, plus selective checkpointing's repeated wk, wo, w3."""
    tokens = run.global_batch * run.seq_len
    share = recompute_share(spec, layout)
    out = (6 + 2 * share) * spec.matmul_parameters * tokens
    if layout.selective_ac and not share:
        out += 2 * sac_recomputed_parameters(spec) * spec.num_layers * tokens
    return out


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of kind ``ag``/``rs``/``ar``/``p2p`` along mesh dim ``dim``, each
    moving a full tensor of ``nbytes`` (the gathered size for all-gather, the unreduced input
    for reduce-scatter), issued once per ``microbatch`` or once per ``step``."""

    dim: str
    kind: str
    nbytes: float
    count: int
    per: str  # "microbatch" or "step"
    what: str

    def per_step(self, microbatches: int) -> float:
        return self.count * (microbatches if self.per == "microbatch" else 1)


def collectives(spec: ModelSpec, run: Run, layout: Layout, stage: int) -> list[Collective]:
    """Every collective one rank of ``stage`` issues in a step, as hyperpar's styles and
    fully_shard issue them (checked against the simulation backend in tests/plan)."""
    tp, pp, dr = layout.tp, layout.pp, layout.dp_replicate
    ds = layout.fsdp_shard  # fully_shard's group: dp_shard, or the flattened dp_shard x cp
    cb = run.compute_bytes
    rb = run.reduce_bytes  # gradients are reduced in the compute dtype, or fp32
    tokens = microbatch_tokens(run, layout)
    layers = stage_layers(spec.num_layers, pp, stage)
    first, last = stage == 0, stage == pp - 1
    out: list[Collective] = []
    if tp > 1 and not layout.sequence_parallel:
        out += _tp_without_sp(spec, layout, tokens * spec.hidden_size * cb, layers, first, last,
                              tokens, cb)
    elif tp > 1:
        act = tokens * spec.hidden_size * cb
        # sequence parallel: per layer 2 all-gathers + 2 reduce-scatters forward, the same
        # backward, and again in a recomputed forward
        # (every recomputed layer once more)
        passes = 2 * layers + checkpointed_layers(layers, layout)
        # selective: wk and w3 are recomputed from their norms' gathered inputs (gathered
        # again); the reduce-scattered outputs are saved
        gathers = 3 * layers if layout.selective_ac else passes
        # saving the shard (sp_reshard_input): each layer's two gathered inputs are gathered
        # again in backward, except where checkpointing recomputes the layer anyway
        regather = layout.sp_reshard_input and not layout.selective_ac
        if regather:
            gathers += layers - checkpointed_layers(layers, layout)
        out += [Collective("tp", "ag", act, 2 * gathers, "microbatch", "layer inputs"),
                Collective("tp", "rs", act, 2 * passes, "microbatch", "layer outputs")]
        if first:  # vocab-parallel embedding: reduce-scatter out, all-gather its gradient back
            out += [Collective("tp", "rs", act, 1, "microbatch", "embedding output"),
                    Collective("tp", "ag", act, 1, "microbatch", "embedding grad")]
        if last:  # head input gathered (grad reduce-scattered), logits gathered to replicate
            out += [Collective("tp", "ag", act, 2 if regather else 1, "microbatch",
                               "head input"),
                    Collective("tp", "rs", act, 1, "microbatch", "head input grad")]
            if layout.loss_parallel:
                # the loss on vocabulary shards: the max, the sum of exponentials and the
                # target's logit are all-reduced per token (fp32), not the logits gathered
                out.append(Collective("tp", "ar", tokens * MASTER_BYTES, 3, "microbatch",
                                      "loss-parallel reductions"))
            else:
                out.append(Collective("tp", "ag", tokens * spec.vocab_size * cb, 1,
                                      "microbatch", "logits"))
        # tp-replicated h-sized tensors (norms; a GPT block's LayerNorm biases and
        # row-parallel biases) see a sequence slice: their gradients are all-reduced over tp
        def replicated(ts: list[ParamTensor]) -> int:
            return sum(1 for t in ts if t.tp_dim is None)
        norms = (replicated(spec.block_tensors()) * layers
                 + (replicated(spec.final_tensors()) if last else 0))
        out.append(Collective("tp", "ar", spec.hidden_size * MASTER_BYTES, norms, "step",
                              "norm weight grads"))
    if pp > 1:
        msg = tokens * spec.hidden_size * cb / (tp if layout.sequence_parallel else 1)
        # messages sent: the activation to the next stage, the input gradient to the previous
        sends = (0 if last else 1) + (0 if first else 1)
        out.append(Collective("pp", "p2p", msg, sends, "microbatch", "activations/grads"))
    sp = stage_params(spec, tp, ds, pp, stage)
    if ds > 1:
        block, *root = sp.unit_gathered
        # each layer: all-gather forward and again backward, reduce-scatter its gradients;
        # the root unit stays gathered from forward to backward. Under cp the group is the
        # flattened dp_shard x cp one; its bytes are booked on "dp_shard" (group_size)
        gathers = 2 if layout.reshard_after_forward else 1  # backward reuses the forward's
        # the reduce-scatter also carries one "had a gradient" flag per parameter and rank
        # (fully_shard leaves grad None where no rank's backward reached a parameter)
        block_flags = ds * len(spec.block_tensors())
        root_flags = ds * len(_root_tensors(spec, pp, first, last))
        # sync once per step (torch pipelining): gathered once, kept, reduce-scattered once
        per = "step" if layout.grad_sync == "step" else "microbatch"
        if per == "step":
            gathers = 1
        out += [Collective("dp_shard", "ag", block * cb, gathers * layers, per, "layers"),
                Collective("dp_shard", "rs", (block + block_flags) * rb, layers, per,
                           "layer grads")]
        for r in root:
            out += [Collective("dp_shard", "ag", r * cb, 1, per, "root"),
                    Collective("dp_shard", "rs", (r + root_flags) * rb, 1, per,
                               "root grads")]
    if dr > 1 and ds > 1:
        # HSDP: every unit's reduce-scattered gradient shard is all-reduced over the replicas
        block, *root = sp.unit_gathered
        n_block = len(spec.block_tensors())
        n_root = len(_root_tensors(spec, pp, first, last))
        out.append(Collective("dp_replicate", "ar", (block // ds + n_block) * rb, layers,
                              "microbatch", "layer grad shards"))
        for r in root:
            out.append(Collective("dp_replicate", "ar", (r // ds + n_root) * rb, 1,
                                  "microbatch", "root grad shards"))
    elif dr > 1 and layout.cp == 1 and layout.zero:
        # ZeRO-1: the gradients all-reduced (ZeRO-2: reduce-scattered) once per step, then
        # the updated compute-dtype parameters all-gathered from their owners
        kind = "rs" if layout.zero == 2 else "ar"
        out += [Collective("dp_replicate", kind, sp.local * rb, 1, "step", "grads"),
                Collective("dp_replicate", "ag", sp.local * cb, 1, "step", "params")]
    elif dr > 1 and layout.cp == 1:
        # data_parallel: the gradients accumulate locally (no_sync), one all-reduce per step
        out.append(Collective("dp_replicate", "ar", sp.local * rb, 1, "step", "grads"))
    out += cp_collectives(spec, run, layout, stage)
    return out


def _root_tensors(spec: ModelSpec, pp: int, first: bool, last: bool) -> list:
    """The parameters of a stage's root fully_shard unit (embedding first, norm and head last)."""
    return ((spec.embed_tensors() if first else [])
            + (spec.final_tensors(pipeline=pp > 1) if last else []))


def _tp_without_sp(spec: ModelSpec, layout: Layout, act: float, layers: int, first: bool,
                   last: bool, tokens: int, cb: int) -> list[Collective]:
    """Tensor parallelism without sequence parallelism (Megatron's f/g operators): per layer an
    all-reduce after each row-parallel linear forward and of each column-parallel linear's
    input gradient backward (again in a recomputed forward); the vocabulary-parallel
    embedding's output all-reduced; the head's input gradient all-reduced; norms replicated
    on the whole sequence, so their gradients agree without a collective."""
    passes = 2 * layers + checkpointed_layers(layers, layout)  # recomputed layers once more
    out = [Collective("tp", "ar", act, 2 * passes, "microbatch", "layer all-reduces")]
    if first:
        out.append(Collective("tp", "ar", act, 1, "microbatch", "embedding output"))
    if last:
        out.append(Collective("tp", "ar", act, 1, "microbatch", "head input grad"))
        if layout.loss_parallel:
            out.append(Collective("tp", "ar", tokens * MASTER_BYTES, 3, "microbatch",
                                  "loss-parallel reductions"))
        else:
            out.append(Collective("tp", "ag", tokens * spec.vocab_size * cb, 1, "microbatch",
                                  "logits"))
    return out


# ------------------------------------------------------------------ context parallelism
def cp_collectives(spec: ModelSpec, run: Run, layout: Layout, stage: int) -> list[Collective]:
    """What ``hyperpar.parallel.context_parallel`` issues on one rank per step, on mesh dim
    ``cp``: per layer and microbatch an all-gather of K and one of V forward (again in a
    recomputed forward), a reduce-scatter of dK and one of dV backward, each of the gathered
    ``seq x kv_dim`` size; and, with ``dp_shard == 1``, once per step the gradient all-reduce
    of ``data_parallel`` over the flattened ``dp_replicate x cp`` group (:func:`group_size`).
    With ``dp_shard > 1`` the gradients are reduce-scattered by fully_shard over the flattened
    ``dp_shard x cp`` group instead (in :func:`collectives`, booked on ``dp_shard``)."""
    if layout.cp == 1:
        return []
    layers = stage_layers(spec.num_layers, layout.pp, stage)
    kv = microbatch_tokens(run, layout) * layout.cp * spec.kv_dim // layout.tp * run.compute_bytes
    passes = layers + checkpointed_layers(layers, layout)  # recomputed layers gather again
    out = [Collective("cp", "ag", kv, 2 * passes, "microbatch", "attention K, V"),
           Collective("cp", "rs", kv, 2 * layers, "microbatch", "attention dK, dV")]
    if layout.fsdp_shard == 1:
        local = stage_params(spec, layout.tp, 1, layout.pp, stage).local
        out.append(Collective("cp", "ar", local * run.reduce_bytes, 1, "step",
                              "grads over dp_replicate x cp"))
    return out


def group_size(c: Collective, layout: Layout) -> int:
    """Ranks in ``c``'s group. Two collectives span a flattened group and are booked on one of
    its dims: ``data_parallel``'s gradient all-reduce on ``cp`` spans ``dp_replicate x cp``,
    and fully_shard's all-gathers and reduce-scatters on ``dp_shard`` span ``dp_shard x cp``
    (:attr:`Layout.fsdp_shard`, which is ``dp_shard`` without cp). Every other collective
    spans its mesh dim."""
    if c.dim == "cp" and c.kind == "ar":
        return layout.dp_replicate * layout.cp
    if c.dim == "dp_shard":
        return layout.fsdp_shard
    return layout.size(c.dim)


def cp_link_dim(c: Collective) -> str:
    """The mesh dim whose link a collective runs on: the outermost dim its group spans. The
    gradient all-reduce of ``dp_replicate x cp`` runs on dp_replicate's (outer) link; the
    flattened ``dp_shard x cp`` group on dp_shard's, whose span (``stride * size``) already
    covers the inner cp dim."""
    return "dp_replicate" if c.dim == "cp" and c.kind == "ar" else c.dim


def cp_attention_flops(spec: ModelSpec, run: Run, layout: Layout) -> float:
    """Attention FLOPs of one step (all ranks) that context parallelism adds: each rank scores
    its queries against every gathered key and masks (no causal skipping): the masked half, as
    much again as the causal attention of :func:`step_flops`."""
    if layout.cp == 1:
        return 0.0
    tokens = run.global_batch * run.seq_len
    passes = attention_passes(run, recompute_share(spec, layout))
    return passes * 2 * run.seq_len * spec.q_dim * spec.num_layers * tokens


def local_tensors(spec: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameter tensors a rank of ``stage`` holds (what the optimizer loops over)."""
    n = stage_layers(spec.num_layers, layout.pp, stage) * len(spec.block_tensors())
    if stage == 0:
        n += len(spec.embed_tensors())
    if stage == layout.pp - 1:
        n += len(spec.final_tensors(pipeline=layout.pp > 1))
    return n


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
    # bytes one rank sends per step, per mesh dim; a flattened group's are booked on one of its
    # dims (group_size): dp_replicate x cp on "cp", fully_shard's dp_shard x cp on "dp_shard"
    comm_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def step_ms(self) -> float:
        return self.step_s * 1e3


def matmul_size(spec: ModelSpec, run: Run, layout: Layout) -> float:
    """The edge of the cube matmul doing as much work per call as a rank's typical one: a
    microbatch's tokens (gathered whole under sequence parallelism; split over cp) times
    ``hidden x hidden / tp`` (a column- or row-parallel projection). Small matmuls run far
    below the peak; their per-call cost follows their work, not their narrowest side."""
    tokens = microbatch_tokens(run, layout)
    return float(tokens * spec.hidden_size * spec.hidden_size / layout.tp) ** (1 / 3)


def ramp_speed(run: Run, layout: Layout, profile: DeviceProfile) -> float:
    """The cost of a pipeline ramp slot relative to a full one. Where a node runs more ranks
    than it has cores (``profile.cores``), every cost was measured with all of them busy; in
    the ramp-up and ramp-down slots half of the stages (on average) wait asleep in a receive,
    and the rest get their cores: the slot takes ``max(busy / cores, 1) / (ranks / cores)`` of
    a full one. Ranks with a device of their own (``cores == 0``) ramp at full cost."""
    if not profile.cores or layout.pp == 1:
        return 1.0
    ranks = min(run.world, run.gpus_per_node)
    shared = ranks / profile.cores
    if shared <= 1:
        return 1.0
    return max(ranks / 2 / profile.cores, 1.0) / shared


def bubble_factor(layout: Layout) -> float:
    """The pipeline bubble relative to 1F1B's ``(pp - 1)`` slots of one microbatch's forward
    + backward: interleaved 1F1B with ``v`` chunks per rank ``1 / v`` (Narayanan et al. 2021,
    eq. 2); ZB-H1 ``1 / 3``: ``(pp - 1)(T_F + T_B - T_W)`` with forward, input-gradient and
    weight-gradient passes of equal cost (Qi et al. 2023, "Zero Bubble Pipeline
    Parallelism", sec. 3.1); GPipe and 1F1B 1."""
    if layout.schedule == "interleaved1f1b":
        return 1 / layout.virtual_stages
    if layout.schedule == "zbh1":
        return 1 / 3
    return 1.0


#: HBM passes over a layer's activations outside the matmuls: forward writes each one and
#: the next op reads it (2), backward reads it, reads its gradient and writes the gradient of
#: its input (3); a recomputed forward (full or selective checkpointing) repeats the 2.
ELEMENTWISE_PASSES = 5
RECOMPUTE_PASSES = 2


def elementwise_seconds(spec: ModelSpec, run: Run, layout: Layout,
                        profile: DeviceProfile) -> float:
    """Seconds per step (one rank, the stage with the most layers) of the non-matmul ops:
    memory-bound, so priced as HBM traffic, :data:`ELEMENTWISE_PASSES` (+
    :data:`RECOMPUTE_PASSES` under checkpointing) over every byte a layer's forward produces
    for backward (:func:`hyperpar.plan.memory.layer_activation_elems`, plus materialised
    attention's probabilities with ``--attention eager``: its softmax, mask and dropout run
    over ``seq x seq`` per head). Their share grows as the matmuls shrink (``1 / h``) and as
    FLOP/s outgrow memory bandwidth. 0 where the profile measures them
    (``elementwise_hbm`` off)."""
    if not profile.elementwise_hbm:
        return 0.0
    tokens = microbatch_tokens(run, layout)
    full, _ = layer_activation_elems(spec, layout, run.compute_bytes)
    per_layer = full * tokens * run.compute_bytes + eager_scores_bytes(spec, run, layout)
    passes = ELEMENTWISE_PASSES + RECOMPUTE_PASSES * recompute_share(spec, layout)
    if layout.selective_ac:
        passes += RECOMPUTE_PASSES
    layers = max_stage_layers(spec.num_layers, layout.pp)
    return passes * per_layer * layers * layout.microbatches / profile.hbm_bytes_per_s


def step_time(spec: ModelSpec, run: Run, layout: Layout, profile: DeviceProfile,
              memory: Memory) -> StepTime:
    m, pp = layout.microbatches, layout.pp
    rate = profile.flops_at(run.param_dtype, matmul_size(spec, run, layout))
    flops = step_flops(spec, run, recompute_share(spec, layout), layout.selective_ac)
    if run.float8 != 1:  # the linears' share runs float8 times faster
        flops -= (1 - 1 / run.float8) * matmul_step_flops(spec, run, layout)
    compute_step = flops / run.world / rate
    compute_mb = compute_step / m
    layers = max_stage_layers(spec.num_layers, pp)  # the stage the pipeline waits for
    colls = collectives(spec, run, layout, memory.stage)
    tp_on = layout.tp > 1
    compute_step += cp_attention_flops(spec, run, layout) / run.world / rate
    # uneven stages: the pipeline runs at the pace of the stage with the most layers
    compute_mb = compute_step / m * (layers * pp / spec.num_layers)
    # that stage's already; torch.compile's fusion divides the passes
    elementwise = elementwise_seconds(spec, run, layout, profile) / run.compile_fusion
    compute_step += elementwise
    compute_mb += elementwise / m
    comm: dict[str, float] = {"tp": 0.0, "dp_shard": 0.0, "dp_replicate": 0.0, "pp": 0.0,
                              "cp": 0.0}
    for c in colls:
        comm[c.dim] += c.per_step(m) * (c.nbytes if c.kind == "p2p"
                                        else wire_bytes(group_size(c, layout), c.nbytes, c.kind))

    def seconds(c: Collective) -> float:
        link = link_for(cp_link_dim(c), layout, run, profile)
        if c.kind == "p2p":
            # a send/recv pair involves two ranks: the measured fixed cost of a 2-rank
            # exchange, not the whole link's (on a cpu that is the world's collective latency)
            pair = profile.latency(2)
            return link.p2p(c.nbytes) if pair is None else pair + c.nbytes / link.bytes_per_s
        n = group_size(c, layout)
        fixed = profile.latency(n)
        if fixed is None or n <= 1:
            return link.ring(n, c.nbytes, c.kind)
        return fixed + wire_bytes(n, c.nbytes, c.kind) / link.bytes_per_s

    overlap = profile.comm_overlap
    # on the critical path, per microbatch: tensor-parallel and pipeline messages
    tp_mb = sum(seconds(c) * c.count for c in colls
                if c.dim in ("tp", "cp") and c.per == "microbatch")
    tp_step = sum(seconds(c) * c.count for c in colls if c.dim == "tp" and c.per == "step")
    # pipeline: a stage waits for one activation forward and one gradient backward
    # (interleaved: each of a rank's v chunks sends and receives)
    pp_mb = sum(2 * seconds(c) for c in colls if c.dim == "pp") * layout.virtual_stages
    # fully_shard (and HSDP's replica all-reduces): prefetching one unit ahead hides the
    # collectives behind compute (the part ``comm_overlap`` allows), all but the first
    # all-gather and whatever exceeds the compute
    fsdp = [c for c in colls if c.dim == "dp_shard"
            or (c.dim == "dp_replicate" and c.per == "microbatch")]
    fsdp_mb_exposed = 0.0
    if fsdp:
        # once-per-step ones (``grad_sync="step"``) spread over the step's microbatches
        def share(c: Collective) -> float:
            return seconds(c) / (m if c.per == "step" else 1)
        per_mb = sum(share(c) * c.count for c in fsdp)
        first = share(fsdp[0])
        fsdp_mb_exposed = first + max(0.0, per_mb - first - overlap * compute_mb)

    # group fixed costs, looked up by the size of the group they are paid over
    def fixed(key: str) -> float:
        return profile.fixed_cost(key, layout.size(GROUP_COSTS[key]))

    ac_factor = 1 + recompute_share(spec, layout) / 3  # one more forward of those layers
    if layout.selective_ac:  # the share of the forward's matmuls repeated
        block = sum(t.numel for t in spec.block_tensors() if is_matmul(t))
        ac_factor = 1 + sac_recomputed_parameters(spec) / block / 3
    overhead_mb = layers * ac_factor * (profile.layer_overhead_s
                                        + (fixed("tp_layer_overhead_s") if tp_on else 0.0))
    if layout.fsdp_shard > 1:  # paid over fully_shard's group (dp_shard, x cp when flattened)
        overhead_mb += (layers + 1) * profile.fixed_cost("fsdp_unit_overhead_s",
                                                         layout.fsdp_shard)
    overhead_mb += profile.root_overhead_s  # the embedding / head stage dominates the pipe
    if tp_on:
        overhead_mb += fixed("tp_root_overhead_s")
    if pp > 1:
        overhead_mb += 2 * fixed("pp_action_overhead_s")
    if layout.cp > 1:
        overhead_mb += layers * ac_factor * fixed("cp_layer_overhead_s")
    tau = compute_mb + overhead_mb + tp_mb + pp_mb + fsdp_mb_exposed
    bubble = (pp - 1) * tau * ramp_speed(run, layout, profile) * bubble_factor(layout)
    pipe = m * tau + bubble

    # data_parallel replicas: one all-reduce of the gradients per step, in buckets launched
    # during the last microbatch's backward (2/3 of its compute, as far as overlap allows)
    dp_exposed = 0.0
    t_ar = sum(seconds(c) * c.count for c in colls if c.dim in ("dp_replicate", "cp")
               and c.per == "step" and c.what != "params")
    if t_ar:
        dp_exposed = max(0.0, t_ar - overlap * 2 / 3 * compute_mb)
    # ZeRO's parameter all-gather follows the optimizer step: nothing to hide it behind
    dp_exposed += sum(seconds(c) * c.count for c in colls
                      if c.dim == "dp_replicate" and c.what == "params")

    # optimizer: memory-bound (reads and writes params, grads and states once) plus a fixed
    # cost per local parameter tensor
    n_tensors = local_tensors(spec, layout, memory.stage)
    per_tensor = (profile.sharded_optimizer_tensor_overhead_s if tp_on or layout.fsdp_shard > 1
                  else profile.optimizer_tensor_overhead_s)
    optimizer = 2 * memory.states / profile.hbm_bytes_per_s + n_tensors * per_tensor
    if (layout.dp_replicate > 1 or layout.cp > 1) and layout.fsdp_shard == 1:
        # data_parallel's gradient averaging spans the replicas and the cp ranks together
        dp_exposed += profile.fixed_cost("dp_overhead_s", layout.dp_replicate * layout.cp)
    total = pipe + tp_step + dp_exposed + optimizer
    return StepTime(step_s=total, compute_s=compute_step, bubble_s=bubble, tp_s=tp_mb * m,
                    pp_s=pp_mb * m, fsdp_exposed_s=fsdp_mb_exposed * m, dp_exposed_s=dp_exposed,
                    optimizer_s=optimizer, comm_bytes=comm)
