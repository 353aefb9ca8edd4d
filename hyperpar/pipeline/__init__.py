"""Pipeline parallelism: deferred layers, stage partitioning, schedules as data, executors, and
a DeepSpeed-style engine (``initialize`` / ``PipelineEngine.train_batch``).

>>> from hyperpar.pipeline import LayerSpec, PipelineModule, Schedule1F1B   # doctest: +SKIP
>>> module = PipelineModule([LayerSpec(nn.Linear, 16, 16) for _ in range(8)],
...                         loss_fn=nn.functional.mse_loss)
>>> loss = Schedule1F1B(module, n_microbatches=4).step(x, target=y)

Where torch is not installed (a MindSpore venv), ``PipelineModule``, ``PipelineEngine``,
``initialize``, ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleZeroBubble`` and ``get_schedule_class`` are MindSpore's
(:mod:`hyperpar_mindspore.pipeline`, :mod:`hyperpar_mindspore.pipeline_engine`); the specs,
partitioners, plans and the instruction loop are the same framework-neutral code. In a venv
with both frameworks import the MindSpore ones from ``hyperpar_mindspore`` directly.
"""

from typing import Any as _Any

from hyperpar.platform.registry import torch_installed as _torch_installed

from .partition import partition_balanced, partition_layers, partition_uniform
from .runner import StepTimings
from .schedules import (
    Action,
    B,
    Backward,
    BackwardInput,
    BackwardWeight,
    F,
    Forward,
    I,
    ScheduleError,
    W,
    bubble_fraction_theory,
    check_plans,
    forward_only_plan,
    gpipe_plan,
    interleaved_1f1b_plan,
    interleaved_zero_bubble_plan,
    lower,
    lower_all,
    one_f_one_b_plan,
    rank_program,
    rank_stages,
    simulate,
    stage_rank,
    timeline,
    zbv_plan,
    zero_bubble_plan,
)
from .spec import LayerSpec, LayerSpecTypeError, TiedLayerSpec
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

if _torch_installed():
    from .engine import PipelineEngine, RepeatingLoader, initialize
    from .executor import (
        PipelineSchedule,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZeroBubble,
        get_schedule_class,
        merge_microbatches,
        split_microbatches,
    )
    from .module import PipelineModule
else:   # no torch: the platform's implementations (MindSpore's), imported on first use
    _FRAMEWORK_BOUND = frozenset({"PipelineModule", "PipelineEngine", "PipelineSchedule",
                                  "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                                  "ScheduleZeroBubble", "get_schedule_class", "initialize"})

    def __getattr__(name: str) -> _Any:
        if name not in _FRAMEWORK_BOUND:
            raise AttributeError(f"module 'hyperpar.pipeline' has no attribute {name!r} without "
                                 f"torch (there it offers {sorted(_FRAMEWORK_BOUND)} and the "
                                 f"framework-neutral specs, partitioners and plans)")
        from hyperpar.platform import get_platform  # the backend is never named here

        value = getattr(get_platform().parallel_api(), name)
        globals()[name] = value
        return value

__all__ = [
    "Action", "B", "Backward", "BackwardInput", "BackwardWeight", "F", "Forward", "I", "LayerSpec",
    "LayerSpecTypeError", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
    "PipelineEngine", "PipelineModule", "PipelineSchedule", "ProcessTopology", "RepeatingLoader",
    "Schedule1F1B", "ScheduleError", "ScheduleGPipe",
    "ScheduleInterleaved1F1B", "ScheduleZeroBubble", "StepTimings", "TiedLayerSpec", "W",
    "bubble_fraction_theory", "check_plans", "forward_only_plan", "get_schedule_class",
    "gpipe_plan", "initialize",
    "interleaved_1f1b_plan", "interleaved_zero_bubble_plan", "lower", "lower_all",
    "merge_microbatches", "one_f_one_b_plan", "partition_balanced", "partition_layers",
    "partition_uniform", "rank_program", "rank_stages", "simulate", "split_microbatches",
    "stage_rank", "timeline", "zbv_plan", "zero_bubble_plan",
]
