"""``torch.distributed.pipelining`` compatibility on hyperpar's schedules and platform P2P.

Change the imports of a torch pipelining script and it runs on every hyperpar backend::

    from hyperpar.pipelining import PipelineStage, Schedule1F1B   # was torch.distributed.pipelining
    stage = PipelineStage(stage_module, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    out = schedule.step(x, target=y, losses=losses)   # last stage: merged outputs

See ``docs/pipelining.md``.
"""

from .schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,  # noqa: F401  (torchtitan imports these private names)
    _PipelineScheduleRuntime,  # noqa: F401
    get_schedule_class,
    looped_bfs_plan,
)
from .stage import PipelineStage

__all__ = [
    "PipelineScheduleMulti", "PipelineScheduleSingle", "PipelineStage", "Schedule1F1B",
    "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "get_schedule_class",
    "looped_bfs_plan",
]
