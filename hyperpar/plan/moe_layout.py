"""The MoE layout: a dense :class:`~hyperpar.plan.layout.Layout` plus expert parallelism
(``ep``), expert tensor parallelism (``etp``), routing capacity, node-limited routing, DualPipe
and the activation-memory knobs (recompute, FP8 activation caching, where the routing weights
are applied); its name as ``--layout`` takes it, and why a layout cannot run a model.
No framework is imported here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .layout import Layout, Run, batch_problems, parse_layout
from .moe import MoESpec

#: What ``recompute`` may name, in the order a layout name prints them: RMSNorm outputs, MLA's
#: up-projection outputs (and the queries, keys, values built from them), the SwiGLU output.
RECOMPUTE = ("norm", "up", "swiglu")


@dataclass(frozen=True)
class MoELayout:
    """A dense :class:`Layout` (dp_replicate, dp_shard, tp, pp, microbatches, checkpointing,
    schedule, ZeRO) plus the expert dims. ``capacity``: 0 dropless, else the capacity factor
    (each expert computes ``capacity x`` its balanced share of rows, padded). ``node_limit``:
    a token's experts lie on at most that many nodes and it crosses the network once per node
    (DeepSeek-V3's routing, M = 4); 0: no limit, each copy travels on its own.
    ``dualpipe``: DeepSeek-V3's bidirectional schedule (the base schedule is then ignored).

    Activation-memory knobs (default off: every intermediate kept in the compute dtype, as an
    eager layer saves it), each a mechanism a published run states:

    * ``recompute`` (name parts ``rcnorm``, ``rcup``, ``rcswiglu``): outputs rebuilt in
      backward instead of kept: every RMSNorm's output; MLA's up-projections (queries, keys
      and values rebuilt from the kept latents); the SwiGLU output (and its SiLU) from the
      kept SwiGLU inputs. DeepSeek-V3 sec. 3.2.3 states the first two, sec. 3.3.3 the third.
    * ``fp8_cache`` (``fp8act``): the inputs of the linears and of the SwiGLU kept in FP8
      (1 byte), the input of the linear after attention in E5M6 (1.5 bytes); DeepSeek-V3
      sec. 3.3.3. Gating, norms and the residual stream stay in the compute dtype.
    * ``weights_on_expert`` (``wexpert``): the routing weights travel with the dispatched
      tokens and scale them on the expert's side (DeepEP's training path: dispatch returns
      the weights, their gradients come back through the dispatch's backward combine, and
      the forward combine is a plain sum; Megatron-core's weighted SwiGLU), so no copy's
      expert output is kept for the weights' gradient; off: the combine weighs the returned
      outputs and keeps every copy's output for that gradient."""

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
    recompute: frozenset[str] = frozenset()
    fp8_cache: bool = False
    weights_on_expert: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.recompute) - set(RECOMPUTE)
        if unknown:
            raise ValueError(f"hyperpar plan: recompute {sorted(unknown)}: accepted "
                             f"{', '.join(RECOMPUTE)}")

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
        knobs = ([f"rc{r}" for r in RECOMPUTE if r in self.recompute]
                 + (["fp8act"] if self.fp8_cache else [])
                 + (["wexpert"] if self.weights_on_expert else []))
        return ".".join(parts[:at] + extra + parts[at:] + knobs)


def parse_moe_layout(name: str, schedule: str = "1f1b", virtual_stages: int = 2) -> MoELayout:
    """A name as :attr:`MoELayout.name` prints it: the dense parts (:func:`parse_layout`) and
    ``epN``, ``etpN``, ``capP`` (capacity factor in percent, ``cap125``; default dropless),
    ``nlM`` (node-limited routing), ``dualpipe``, and the activation knobs ``rcnorm``,
    ``rcup``, ``rcswiglu``, ``fp8act``, ``wexpert`` (:class:`MoELayout`), e.g.
    ``dp128.pp16.ep64.nl4.mb120.zero1.dualpipe.rcnorm.rcup.rcswiglu.fp8act``."""
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
        elif part.startswith("rc") and part[2:] in RECOMPUTE:
            fields["recompute"] = frozenset(fields.get("recompute", frozenset())  # type: ignore[arg-type]
                                            ) | {part[2:]}
        elif part in ("fp8act", "wexpert"):
            fields["fp8_cache" if part == "fp8act" else "weights_on_expert"] = True
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
    out.extend(batch_problems(run, dp, m, pp))
    if lay.dualpipe and (pp % 2 or m % 2 or pp < 2 or m < 2 * pp):
        out.append(f"dualpipe needs an even pp >= 2 and an even microbatch count of at least "
                   f"2 pp (pp={pp}, microbatches={m}; DeepSeek-V3 sec. 3.2.1; its published "
                   "schedule runs half of them each way, at least pp per direction)")
    if b.schedule == "interleaved1f1b" and pp > 1 and not lay.dualpipe:
        if m % pp:
            out.append(f"microbatches={m} % pp={pp} != 0 (interleaved 1F1B)")
        if pp * b.virtual_stages > spec.num_layers:
            out.append(f"pp*virtual_stages={pp * b.virtual_stages} > layers")
    if b.activation_checkpointing and b.selective_ac:
        out.append("activation_checkpointing and selective_ac: choose one")
    if b.selective_ac:
        out.append("selective op checkpointing (sac) of an MoE layer: not modelled (write ac)")
    if "up" in lay.recompute and spec.attention != "mla":
        out.append("rcup recomputes MLA's up-projections; this model's attention is "
                   f"{spec.attention}")
    if lay.world != run.world:
        out.append(f"layout has {lay.world} ranks, the run {run.world}")
    return out
