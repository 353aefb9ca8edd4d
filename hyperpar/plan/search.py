"""Enumerate every layout of a run, rule out the impossible ones (with the reason), rank the
rest by predicted step time.

Cost: every factorisation of ``world`` into ``dp_replicate x dp_shard x tp x pp``, and into
``dp_replicate x dp_shard x cp`` with ``cp > 1`` (``tp = pp = 1``), times the
divisors of the per-replica batch as microbatch counts, times activation checkpointing on/off;
each candidate costs O(layers / pp) (one pass over a stage's tensors). See docs/planning.md for
measured planner times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import DeviceProfile
from .layout import Layout, Run, Schedule, batch_problems
from .memory import Memory, memory_per_rank
from .model import ModelSpec
from .timing import StepTime, step_time


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class Candidate:
    """A layout that fits, with its predicted memory and time."""

    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_s_per_device: float
    measured: dict[str, float] | None = None


@dataclass
class RuledOut:
    """A layout that cannot run: ``kind`` ``divisibility`` (its dims do not divide the model
    or batch; no numbers) or ``oom`` (``memory`` and ``time`` as if it had the memory)."""

    layout: Layout
    reason: str
    kind: str  # "divisibility" or "oom"
    memory: Memory | None = None
    time: StepTime | None = None
    device_memory: int = 0

    @property
    def over_bytes(self) -> int:
        """Bytes the peak exceeds the device by (0 unless ``oom``)."""
        return 0 if self.memory is None else self.memory.peak - self.device_memory


@dataclass
class PlanResult:
    spec: ModelSpec
    run: Run
    profile: DeviceProfile
    ranked: list[Candidate] = field(default_factory=list)
    ruled_out: list[RuledOut] = field(default_factory=list)
    considered: int = 0


def shape_problems(spec: ModelSpec, run: Run, layout: Layout) -> list[str]:
    """Why ``layout`` cannot run this model at all (empty: it can)."""
    out = []
    tp, pp, m, dp = layout.tp, layout.pp, layout.microbatches, layout.dp
    if spec.num_heads % tp:
        out.append(f"num_attention_heads={spec.num_heads} % tp={tp} != 0")
    if spec.num_kv_heads % tp:
        out.append(f"num_key_value_heads={spec.num_kv_heads} % tp={tp} != 0")
    if spec.intermediate_size % tp:
        out.append(f"intermediate_size={spec.intermediate_size} % tp={tp} != 0")
    if layout.sequence_parallel and run.seq_len % tp:
        out.append(f"seq_len={run.seq_len} % tp={tp} != 0 (sequence parallel splits it)")
    if layout.cp > 1 and run.seq_len % (2 * layout.cp):
        out.append(f"seq_len={run.seq_len} % (2*cp)={2 * layout.cp} != 0 (context parallel "
                   "splits it into 2*cp head-tail chunks)")
    if pp > spec.num_layers:
        out.append(f"pp={pp} > num_hidden_layers={spec.num_layers} leaves stages without a "
                   "layer")
    out.extend(batch_problems(run, dp, m, pp))
    if layout.activation_checkpointing and layout.selective_ac:
        out.append("activation_checkpointing and selective_ac: choose one (ac or sac)")
    if layout.ac_every < 1 or (layout.ac_every > 1 and not layout.activation_checkpointing):
        out.append(f"ac_every={layout.ac_every}: every N-th layer checkpointed needs "
                   "activation_checkpointing and N >= 1 (write acN)")
    if layout.zero and layout.cp > 1:
        out.append(f"zero{layout.zero} with cp={layout.cp}: not modelled (ZeRO over the "
                   "dp_replicate ranks only; write cp1)")
    if layout.cp_shard and layout.cp == 1:
        out.append("cpfs (fully_shard over the cp ranks) needs cp > 1")
    if layout.cp_shard and layout.dp_shard > 1:
        out.append("cpfs with dp_shard > 1: fully_shard already spans dp_shard x cp; "
                   "leave cpfs out")
    if not layout.sp and tp == 1:
        out.append("sp=False (tp without sequence parallel) needs tp > 1")
    if not layout.reshard_after_forward and layout.fsdp_shard == 1:
        out.append("reshard_after_forward=False needs fully_shard (dp_shard > 1)")
    v = layout.virtual_stages
    if layout.schedule == "interleaved1f1b" and pp > 1:
        if v < 2:
            out.append(f"interleaved1f1b needs virtual_stages >= 2, got {v}")
        if pp > 1 and m % pp:
            out.append(f"microbatches={m} % pp={pp} != 0 (interleaved 1F1B runs microbatches "
                       "in groups of pp)")
        if pp * v > spec.num_layers:
            out.append(f"pp*virtual_stages={pp * v} > num_hidden_layers={spec.num_layers}")
    elif v != 1:
        out.append(f"virtual_stages={v} needs schedule interleaved1f1b, not "
                   f"{layout.schedule}")
    if layout.world != run.world:
        out.append(f"layout has {layout.world} ranks, the run {run.world}")
    return out


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d,) + rest for d in divisors(n) for rest in _factorisations(n // d, parts - 1)]


def enumerate_layouts(spec: ModelSpec, run: Run, *, schedule: Schedule = "1f1b",
                      max_tp: int | None = None, loss_parallel: bool = False,
                      virtual_stages: int = 2,
                      reshard_after_forward: bool = True,
                      sequence_parallel: bool = True) -> list[Layout]:
    """Every ``dp_replicate x dp_shard x tp x pp`` of ``run.world``, and every
    ``dp_replicate x dp_shard x cp`` with ``cp > 1`` (context parallelism is searched with
    ``tp = pp = 1``: its composition with tp and pp is not modelled; with ``dp_shard > 1``
    fully_shard runs over the flattened ``dp_shard x cp`` group; with ``dp_shard == 1`` both
    data_parallel over ``dp_replicate x cp`` and, ``cpfs``, fully_shard over the cp ranks),
    every microbatch count
    dividing the per-replica batch (or the smallest ones for pp>1), activation checkpointing
    off, full and selective. Layouts whose dims do not even divide are kept so that they can
    be reported."""
    out = []
    shapes = [(dr, ds, tp, pp, 1) for dr, ds, tp, pp in _factorisations(run.world, 4)]
    shapes += [(dr, ds, 1, 1, cp) for dr, ds, cp in _factorisations(run.world, 3) if cp > 1]
    for dr, ds, tp, pp, cp in shapes:
        if max_tp is not None and tp > max_tp:
            continue
        dp = dr * ds
        per_replica = run.global_batch // dp if run.global_batch % dp == 0 else 1
        # cp without dp_shard: data_parallel over dp_replicate x cp (hyperpar's default), and
        # fully_shard over the cp ranks (cpfs, torchtitan's FSDP 1 x CP n)
        for m, cpfs in ((m, f) for m in divisors(per_replica)
                        for f in ((False, True) if cp > 1 and ds == 1 else (False,))):
            for ac, sac in ((False, False), (True, False), (False, True)):
                out.append(Layout(dp_replicate=dr, dp_shard=ds, tp=tp, pp=pp, cp=cp,
                                  cp_shard=cpfs, microbatches=m, selective_ac=sac,
                                  activation_checkpointing=ac, schedule=schedule,
                                  loss_parallel=loss_parallel and tp > 1,
                                  virtual_stages=virtual_stages
                                  if schedule == "interleaved1f1b" and pp > 1 else 1,
                                  reshard_after_forward=reshard_after_forward
                                  or (ds == 1 and not cpfs),
                                  sp=sequence_parallel or tp == 1))
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan(spec: ModelSpec, run: Run, profile: DeviceProfile, *,
         schedule: Schedule = "1f1b", max_tp: int | None = None,
         loss_parallel: bool = False, virtual_stages: int = 2,
         reshard_after_forward: bool = True, sequence_parallel: bool = True) -> PlanResult:
    """Search every layout of ``run`` for ``spec`` on ``profile``'s devices
    (``loss_parallel``: the layouts with tp compute the loss on vocabulary shards;
    ``virtual_stages``: chunks per pipeline rank under ``interleaved1f1b``;
    ``reshard_after_forward=False``: fully_shard keeps layers gathered to their backward;
    ``sequence_parallel=False``: tensor parallelism without sequence parallelism)."""
    result = PlanResult(spec, run, profile)
    tokens = run.global_batch * run.seq_len
    for layout in enumerate_layouts(spec, run, schedule=schedule, max_tp=max_tp,
                                    loss_parallel=loss_parallel,
                                    virtual_stages=virtual_stages,
                                    reshard_after_forward=reshard_after_forward,
                                    sequence_parallel=sequence_parallel):
        result.considered += 1
        problems = shape_problems(spec, run, layout)
        if problems:
            result.ruled_out.append(RuledOut(layout, "; ".join(problems), "divisibility"))
            continue
        mem = memory_per_rank(spec, run, layout)
        t = step_time(spec, run, layout, profile, mem)
        if mem.peak > run.device_memory:
            result.ruled_out.append(RuledOut(layout, oom_reason(mem, run), "oom", mem, t,
                                             run.device_memory))
            continue
        result.ranked.append(Candidate(layout, mem, t, tokens / t.step_s / run.world))
    result.ranked.sort(key=lambda c: (c.time.step_s, c.memory.peak))
    return result


def oom_reason(mem: Memory, run: Run) -> str:
    return (f"OOM by {gib(mem.peak - run.device_memory)} (peak {gib(mem.peak)} on stage "
            f"{mem.stage} > {gib(run.device_memory)})")


def evaluate(spec: ModelSpec, run: Run, layout: Layout,
             profile: DeviceProfile) -> Candidate | RuledOut:
    """One given layout: a :class:`Candidate` when it fits, else a :class:`RuledOut` with the
    reason (and, when only memory rules it out, its memory and time as if it fitted)."""
    if layout.world != run.world:
        raise ValueError(f"hyperpar plan: layout {layout.name} has {layout.world} ranks but "
                         f"--world is {run.world}; give a layout whose dims multiply to the "
                         "world size")
    problems = shape_problems(spec, run, layout)
    if problems:
        return RuledOut(layout, "; ".join(problems), "divisibility")
    mem = memory_per_rank(spec, run, layout)
    t = step_time(spec, run, layout, profile, mem)
    if mem.peak > run.device_memory:
        return RuledOut(layout, oom_reason(mem, run), "oom", mem, t, run.device_memory)
    return Candidate(layout, mem, t, run.global_batch * run.seq_len / t.step_s / run.world)
