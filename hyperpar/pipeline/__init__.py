"""Pipeline parallelism: deferred layers, stage partitioning, schedules as data, executors, and
a DeepSpeed-style engine (``initialize`` / ``PipelineEngine.train_batch``).

>>> from hyperpar.pipeline import LayerSpec, PipelineModule, Schedule1F1B   # doctest: +SKIP
>>> module = PipelineModule([LayerSpec(nn.Linear, 16, 16) for _ in range(8)],
...                         loss_fn=nn.functional.mse_loss)
>>> loss = Schedule1F1B(module, n_microbatches=4).step(x, target=y)
"""

from .engine import PipelineEngine, RepeatingLoader, initialize
from .executor import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    StepTimings,
    get_schedule_class,
    merge_microbatches,
    split_microbatches,
)
from .module import PipelineModule
from .partition import partition_balanced, partition_layers, partition_uniform
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
    lower,
    one_f_one_b_plan,
    simulate,
    timeline,
    zero_bubble_plan,
)
from .spec import LayerSpec, LayerSpecTypeError, TiedLayerSpec
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "Action", "B", "Backward", "BackwardInput", "BackwardWeight", "F", "Forward", "I", "LayerSpec",
    "LayerSpecTypeError", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
    "PipelineEngine", "PipelineModule", "PipelineSchedule", "ProcessTopology", "RepeatingLoader",
    "Schedule1F1B", "ScheduleError", "ScheduleGPipe",
    "ScheduleInterleaved1F1B", "ScheduleZeroBubble", "StepTimings", "TiedLayerSpec", "W",
    "bubble_fraction_theory", "check_plans", "forward_only_plan", "get_schedule_class",
    "gpipe_plan", "initialize",
    "interleaved_1f1b_plan", "lower", "merge_microbatches", "one_f_one_b_plan",
    "partition_balanced", "partition_layers", "partition_uniform", "simulate",
    "split_microbatches", "timeline", "zero_bubble_plan",
]
