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

The layout (its name, its refusals) lives in :mod:`.moe_layout`, the bytes per rank in
:mod:`.moe_memory`; their public names are importable from here too. What is estimated
rather than exact (docs/planning.md, "MoE"): activations (per token per layer,
:func:`moe_layer_activation_bytes`), balanced routing (every expert receives
``tokens x top_k x capacity / experts`` rows, as the published benchmarks force), compute at
the profile's efficiency times the grouped GEMM's tile efficiency. Not modelled, refused:
context parallelism with MoE. No framework is imported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .devices import DeviceProfile
from .layout import Layout, Run
from .moe import MoESpec

# the layout and memory parts live in their own modules; their names stay importable here
from .moe_layout import MoELayout, moe_shape_problems, parse_moe_layout
from .moe_memory import (
    MoEMemory,
    _stage_split,
    microbatch_tokens,
    moe_layer_activation_bytes,
    moe_layer_activation_elems,
    moe_memory_per_rank,
    moe_stage_memory,
    stage_param_counts,
)
from .timing import Link

__all__ = ["GEMM_TILE", "MoECandidate", "MoELayout", "MoEMemory", "MoEStepTime", "a2a_seconds",
           "bubble_factor", "enumerate_moe_layouts", "microbatch_tokens",
           "moe_evaluate", "moe_layer_activation_bytes", "moe_layer_activation_elems",
           "moe_memory_per_rank", "moe_plan",
           "moe_shape_problems", "moe_stage_memory", "moe_step_time", "parse_moe_layout",
           "recompute_flops_per_token",
           "stage_param_counts", "tile_efficiency"]

#: Tile edge of the grouped GEMM kernels (CUTLASS grouped GEMM and DeepGEMM's ``BLOCK_M``
#: / ``BLOCK_N`` = 128): each expert's rows and its output width are computed in whole tiles.
GEMM_TILE = 128


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


def recompute_flops_per_token(spec: MoESpec) -> float:
    """FLOPs per token of recomputing MLA's up-projections (``q_b``: query latent to the
    queries, ``kv_b``: KV latent to keys and values) in backward, over every layer and MTP
    module (``rcup``); 0 without MLA. Norm and SwiGLU recomputation are elementwise: the
    MoE step time counts matmuls and attention only."""
    if spec.attention != "mla":
        return 0.0
    n = spec.num_heads
    up = (spec.q_lora_rank * n * (spec.qk_nope_dim + spec.qk_rope_dim) if spec.q_lora_rank
          else 0) + spec.kv_lora_rank * n * (spec.qk_nope_dim + spec.v_head_dim)
    return 2.0 * up * (spec.num_layers + spec.mtp)


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
    # rcup (without full checkpointing, which recomputes everything already): MLA's up-
    # projections run forward once more in backward, 2 FLOPs per weight per token
    rebuilt = recompute_flops_per_token(spec) if "up" in lay.recompute and not ac else 0.0
    rows_per_expert = (microbatch_tokens(run, lay) * b.dp * spec.top_k * (lay.capacity or 1.0)
                       / spec.experts / lay.edp)
    eff = tile_efficiency(rows_per_expert, spec.expert_intermediate / lay.etp)
    rate = profile.flops(run.param_dtype)
    compute_step = (((factor * other_active + rebuilt) / float8
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
