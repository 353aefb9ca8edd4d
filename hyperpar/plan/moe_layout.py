"""The MoE layout: a dense :class:`~hyperpar.plan.layout.Layout` plus expert parallelism
(``ep``), expert tensor parallelism (``etp``), routing capacity, node-limited routing, DualPipe
and the activation-memory knobs (recompute, FP8 activation caching, where the routing weights
are applied); its name as ``--layout`` takes it, and why a layout cannot run a model.
No framework is imported here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .layout import Layout, Run, parse_layout
from .moe import MoESpec


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
