"""``hyperpar.pipelining.get_schedule_class`` and the names torchtitan imports, against torch's."""

import pytest

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

import hyperpar.pipelining as hp  # noqa: E402

NAMES = ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble",
         "PipelineScheduleSingle", "PipelineScheduleMulti", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("name", NAMES)
def test_same_class_names_as_torch(name: str) -> None:
    try:
        expected = torch_schedules.get_schedule_class(name).__name__
    except ValueError:
        pytest.skip(f"this torch has no {name} schedule")
    assert hp.get_schedule_class(name).__name__ == expected
    assert hp.get_schedule_class(name.lower()) is hp.get_schedule_class(name)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="Unknown schedule name 'ZeroBubbleX'.*1F1B"):
        hp.get_schedule_class("ZeroBubbleX")


def test_kinds_as_torch() -> None:
    """torchtitan picks single- vs multi-stage by issubclass; unbuilt ones raise when made."""
    assert issubclass(hp.get_schedule_class("1F1B"), hp.PipelineScheduleSingle)
    assert issubclass(hp.get_schedule_class("Interleaved1F1B"), hp.PipelineScheduleMulti)
    for name in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        assert issubclass(hp.get_schedule_class(name), hp.PipelineScheduleMulti)
    for cls in (hp.ScheduleDualPipeV, hp._PipelineScheduleRuntime):
        with pytest.raises(NotImplementedError, match="is not implemented"):
            cls(None, 4)
    assert hp._PipelineSchedule in hp.Schedule1F1B.__mro__
