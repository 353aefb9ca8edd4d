"""``PipelineStage``: one stage of a ``torch.distributed.pipelining``-style pipeline.

Stage ``s`` of ``num_stages`` runs on pipeline rank ``s % group_size`` (torch's loop layout:
with ``v`` stages per rank, rank ``r`` holds stages ``r, r + p, ...``), or for the V schedules
(``ScheduleZBVZeroBubble``) on ranks ``0 .. p-1`` and back (rank ``r`` holds ``r`` and
``2p - 1 - r``); the schedule checks that each rank built its own stages. Shapes need not be
given: they travel with the first activation of every (stage, microbatch) as a small header
(:mod:`hyperpar.pipeline.p2p`), so no warm-up pass runs and no gradients are left behind by
one. ``input_args`` / ``output_args``, when given, are checked against what really flows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.mesh import ensure_world
from hyperpar.platform import get_platform
from hyperpar.platform.base import Group


def _shapes(value: Any) -> list[tuple[int, ...]] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, torch.Tensor) else list(value)
    if not all(isinstance(t, torch.Tensor) for t in items):
        kinds = [type(t).__name__ for t in items]
        raise TypeError(f"PipelineStage: input_args/output_args must be a tensor or a tuple of "
                        f"tensors (example microbatch values), got {kinds}")
    return [tuple(t.shape) for t in items]


class PipelineStage:
    """Torch's ``PipelineStage(submodule, stage_index, num_stages, device, input_args=None,
    output_args=None, group=None)``.

    ``submodule`` is this stage's part of the model (already on ``device``); ``group`` is the
    pipeline's platform group (default: the world). ``input_args`` and ``output_args`` are
    optional example microbatch values (any device, ``meta`` included); when given, a mismatch
    with the real activations raises naming the stage.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: Any = None, input_args: Any = None, output_args: Any = None,
                 group: Group = None, dw_builder: Any = None,
                 get_mesh: Any = None) -> None:
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be an nn.Module, got "
                            f"{type(submodule).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineStage: num_stages must be a positive int, got "
                             f"{num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index!r} is outside "
                             f"0..{num_stages - 1}; pass the index of this stage in the model")
        if dw_builder is not None:
            raise NotImplementedError("PipelineStage: dw_builder (custom weight-gradient "
                                      "functions) is not supported by hyperpar.pipelining")
        platform = get_platform()
        if group is None:
            ensure_world(platform)
        self.submod = submodule
        # torch's callback for rebuilding DTensor activations' meshes between stages; stages
        # here pass plain tensors (a DTensor activation raises where it is sent), so it is kept
        # only for code that reads it back.
        self.get_mesh = get_mesh
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = device
        self.group = group
        self.group_size = platform.world_size(group)
        self.stage_ranks: list[int] = list(platform.group_ranks(group))
        self.group_rank = self.stage_ranks.index(platform.rank())
        if num_stages % self.group_size:
            raise ValueError(f"PipelineStage: num_stages={num_stages} is not a multiple of the "
                             f"pipeline group size {self.group_size}; each rank must hold the same "
                             f"number of stages")
        self.input_shapes = _shapes(input_args)
        self.output_shapes = _shapes(output_args)

    @property
    def is_first(self) -> bool:
        """Whether this is stage 0 (it takes the model inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (it computes the loss and returns outputs)."""
        return self.stage_index == self.num_stages - 1

    def check_shapes(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        """Raise when ``tensors`` do not have the shapes given as ``input_args``/``output_args``."""
        want = self.input_shapes if what == "input" else self.output_shapes
        got = [tuple(t.shape) for t in tensors]
        if want is not None and got != want:
            raise ValueError(
                f"stage {self.stage_index}: the {what} has shapes {got} but {what}_args "
                f"declared {want}; fix {what}_args of PipelineStage({self.stage_index}) or the "
                f"model/microbatch size")

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide every parameter gradient of the stage by ``grad_scale_factor`` (torch's
        ``scale_grads=True`` divides by the microbatch count once per step)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"rank={self.group_rank}/{self.group_size})")
