"""``hyperpar plan --measure``: run layouts for real on this machine and compare.

Each measured layout runs the example Llama (``examples/llama``) on real processes of the
selected backend (``HYPERPAR_BACKEND``; the cpu backend, gloo, on a machine without
accelerators) through a :class:`hyperpar.testing.WorkerPool`, laid out as
:mod:`hyperpar.plan._runs` does it with the real ``parallelize_module``, ``fully_shard`` (HSDP
with ``dp_replicate``; over the flattened ``dp_shard x cp`` group under cp), ``data_parallel``,
``context_parallel`` and ``PipelineModule`` + schedule, trains with AdamW, and reports for the
rank holding the stage the planner reports (the one with the highest predicted peak):

* ``states``: bytes of the local parameter shards, their gradients and the optimizer states
  (``exp_avg``, ``exp_avg_sq``) -- the figure the memory model gives exactly;
* ``peak``: the most bytes of live tensor storage during one step, the highest of any rank
  (:class:`hyperpar.plan.live_bytes.LiveBytes`);
* ``step_ms``: the median of timed steps (forward, backward, optimizer) after warm-up, the
  slowest rank.

Before measuring a world size, the profile of this machine for that many processes is measured
(:func:`hyperpar.plan.calibrate.calibrate`). This module imports torch when it runs; nothing
else of the planner does.
"""

from __future__ import annotations

import argparse
from typing import Any

from .calibrate import calibrate, describe
from .devices import DeviceProfile, save_profile
from .layout import Layout, Run
from .memory import memory_per_rank
from .model import EXAMPLES, ModelSpec, spec_from_model_args
from .search import PlanResult, plan
from .timing import step_time

MEASURABLE_WORLDS = (2, 4)


def measurable(layout: Layout, spec: ModelSpec | None = None) -> bool:
    """Whether ``--measure`` can run ``layout`` (2 or 4 ranks; a pipeline without tp, its
    layers split evenly; cp with dp_replicate and dp_shard, ``tp = pp = 1``)."""
    if (layout.world not in MEASURABLE_WORLDS or layout.loss_parallel
            or not layout.reshard_after_forward or not layout.sp or layout.selective_ac
            or layout.ac_every != 1 or layout.cp_shard  # _runs has no fully_shard-over-cp
            or layout.schedule not in ("1f1b", "gpipe")):
        return False
    if spec is not None and spec.num_layers % layout.pp:
        return False  # _runs splits the layers evenly
    if layout.cp > 1 and (layout.tp > 1 or layout.pp > 1):
        return False
    return not (layout.pp > 1 and layout.tp > 1)


def _sizes(example: str | dict[str, int]) -> dict[str, int]:
    sizes = EXAMPLES[example] if isinstance(example, str) else example
    return {k: v for k, v in sizes.items() if k != "max_seq_len"}


def measure_layout(example: str | dict[str, int], layout: Layout, run: Run, *,
                   steps: int = 5, warmup: int = 2, peak: bool = True,
                   pool: Any = None) -> dict[str, float]:
    """Run ``layout`` for real on ``layout.world`` processes. ``example``: ``tiny``/``llama``,
    or a dict of ``examples/llama`` ``ModelArgs`` sizes. Returns ``states`` of the first rank
    of the stage with the highest predicted peak, ``peak`` (the highest of any rank),
    ``step_ms`` (the slowest rank's median), ``fb_ms``/``opt_ms`` and ``stage``; and
    ``per_rank``, every rank's figures."""
    from hyperpar.testing import WorkerPool

    from ._runs import run_layout

    fields = {k: getattr(layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp",
                                               "microbatches", "activation_checkpointing",
                                               "schedule")}
    args = (_sizes(example), fields, run.seq_len, run.global_batch, steps, warmup, peak)
    if pool is None:
        with WorkerPool(layout.world, collective_timeout_s=300) as own:
            got = own.run(run_layout, *args, timeout_s=300)
    else:
        got = pool.run(run_layout, *args, timeout_s=300)
    stage = memory_per_rank(spec_from_model_args(_sizes(example)), run, layout).stage
    mine = next(r for r in got if int(r["stage"]) == stage)
    out = {"states": mine["states"], "stage": float(stage),
           "step_ms": max(r["step_ms"] for r in got), "fb_ms": max(r["fb_ms"] for r in got),
           "opt_ms": max(r["opt_ms"] for r in got), "per_rank": got}
    if peak:
        out["peak"] = max(r["peak"] for r in got)
    return out


def calibrate_cpu(ranks: int, pool: Any = None) -> DeviceProfile:
    """This machine's profile for ``ranks`` processes (:func:`calibrate.calibrate`)."""
    return calibrate(ranks, pool=pool)


def compare(example: str | dict[str, int], layout: Layout, run: Run, profile: DeviceProfile,
            pool: Any = None, peak: bool = True) -> dict[str, Any]:
    """Predicted vs measured for one layout: a row of the ``--measure`` table
    (``peak_measured`` is 0 with ``peak=False``)."""
    spec = spec_from_model_args(_sizes(example))
    mem = memory_per_rank(spec, run, layout)
    pred = step_time(spec, run, layout, profile, mem)
    got = measure_layout(example, layout, run, pool=pool, peak=peak)
    return {"world": layout.world, "layout": layout.name, "stage": mem.stage,
            "states_predicted": mem.states, "states_measured": int(got["states"]),
            "peak_predicted": mem.peak, "peak_measured": int(got.get("peak", 0)),
            "step_ms_predicted": pred.step_ms, "step_ms_measured": got["step_ms"]}


def measured_entry(row: dict[str, Any]) -> dict[str, float]:
    """What ``--json`` keeps of a ``--measure`` row: the measured peak and step and the
    prediction the printed table compares them with (this machine's calibrated profile)."""
    return {"peak": row["peak_measured"], "step_ms": row["step_ms_measured"],
            "predicted_peak": row["peak_predicted"],
            "predicted_step_ms": row["step_ms_predicted"]}


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'world':>5}  {'layout':<22} {'states pred':>12} {'states meas':>12} "
          f"{'peak pred':>10} {'peak meas':>10} {'err':>5} {'step ms pred':>12} "
          f"{'step ms meas':>12} {'err':>5}")
    for r in rows:
        pe = (r["peak_predicted"] - r["peak_measured"]) / r["peak_measured"]
        te = (r["step_ms_predicted"] - r["step_ms_measured"]) / r["step_ms_measured"]
        print(f"{r['world']:>5}  {r['layout']:<22} {r['states_predicted']:>12,} "
              f"{r['states_measured']:>12,} {r['peak_predicted']:>10,} "
              f"{r['peak_measured']:>10,} {pe:>+5.0%} {r['step_ms_predicted']:>12.2f} "
              f"{r['step_ms_measured']:>12.2f} {te:>+5.0%}")


def _family(layout: Layout) -> tuple[bool, ...]:
    return tuple(layout.size(d) > 1 for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))


def measure_top(result: PlanResult, spec: ModelSpec, args: argparse.Namespace,
                per_world: int = 4) -> list[dict[str, Any]]:
    """Measure the best measurable layout of up to ``per_world`` families (which of
    dp_replicate, dp_shard, tp, pp, cp are > 1) at 2 and 4 ranks, and the best cp layout;
    fills ``candidate.measured`` in ``result`` for those of its world and prints a
    comparison."""
    from hyperpar.testing import WorkerPool

    if not getattr(args, "example", None):
        raise SystemExit("hyperpar plan --measure runs the examples' models: give --example "
                         "tiny or --example llama")
    rows = []
    for world in MEASURABLE_WORLDS:
        run = Run(world=world, seq_len=args.seq_len, global_batch=args.global_batch,
                  param_dtype="float32", optimizer="adamw", gpus_per_node=world,
                  device_memory=result.run.device_memory)
        with WorkerPool(world, collective_timeout_s=300) as pool:
            profile = calibrate_cpu(world, pool=pool)
            print(describe(profile))
            if world == MEASURABLE_WORLDS[0] and getattr(args, "save_profile", None):
                save_profile(profile, args.save_profile)
                print(f"wrote {args.save_profile}")
            local = plan(spec, run, profile, schedule=args.schedule)
            picked, seen = [], set()
            for c in local.ranked:
                if measurable(c.layout, spec) and _family(c.layout) not in seen:
                    seen.add(_family(c.layout))
                    picked.append(c)
            chosen = picked[:per_world]
            # context parallelism rarely ranks first at this size: measure its best one too
            chosen += [c for c in picked[per_world:] if c.layout.cp > 1][:1]
            for c in chosen:
                row = compare(args.example, c.layout, run, profile, pool=pool)
                rows.append(row)
                c.measured = measured_entry(row)
                if world == result.run.world:
                    for mine in result.ranked:
                        if mine.layout == c.layout:
                            mine.measured = c.measured
    print("predicted vs measured on this machine (fp32, AdamW; states: the reported stage's "
          "first rank, peak: the highest rank, step: the slowest rank):")
    print_rows(rows)
    print()
    return rows
