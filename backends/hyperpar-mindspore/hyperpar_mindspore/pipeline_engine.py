"""DeepSpeed's pipeline engine on MindSpore Cells: :class:`PipelineEngine` (``train_batch`` /
``eval_batch``: config checks agreed over every rank, microbatches drawn per data-parallel
replica, gradients averaged over the stage's replicas, the optimizer step, the mean loss) and
:func:`initialize`, over the schedules of :mod:`hyperpar_mindspore.pipeline_schedules` (whose
names stay importable from here: ``PipelineSchedule``, ``ScheduleGPipe``, ``Schedule1F1B``, ...,
``get_schedule_class``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import mindspore as ms
from mindspore import nn

from hyperpar.platform import get_platform

from .pipeline import PipelineModule
from .pipeline_schedules import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZeroBubble,
    _units,
    get_schedule_class,
)

__all__ = ["PipelineEngine", "PipelineSchedule", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZeroBubble",
           "get_schedule_class", "initialize"]

_CONFIG_KEYS = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "train_batch_size"}


def _agree_or_raise(error: Exception | None) -> None:
    """Raise on every rank if any rank's arguments were refused: that rank its own error, the
    others a ValueError naming it. Collective (one small all-gather over the world)."""
    errors = get_platform().all_gather_object(
        None if error is None else f"{type(error).__name__}: {error}")
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if error is not None:
        raise error
    if bad:
        rank, message = bad[0]
        raise ValueError(f"PipelineEngine: rank {rank} refused its arguments, so no rank "
                         f"starts: {message}")


class PipelineEngine:
    """``PipelineEngine(model, optimizer, config, *, schedule=None)`` on MindSpore: DeepSpeed's
    ``train_batch`` over a :class:`PipelineModule`. ``optimizer`` is a ``mindspore.nn.Optimizer``
    over ``model.trainable_params()``; ``config`` takes ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps`` and ``train_batch_size`` (other sections -- fp16, bf16,
    optimizer, gradient_clipping -- are torch-only for now and refused). ``schedule``: a class
    or a name (default ``"1f1b"``, ``"interleaved1f1b"`` for ``virtual_stages > 1``).

    With data-parallel replicas (``model.dp_size > 1``) each replica draws its own
    microbatches; after the pipeline step the gradients are averaged over ``model.dp_group``
    (one bucketed all-reduce; the shards of Cells prepared by ``fully_shard(cell,
    mesh=mesh["dp"])`` come out of their reduce-scatter averaged already) and the returned
    loss is the mean over the replicas, as torch's engine does."""

    @staticmethod
    def _check(model: Any, optimizer: Any, cfg: dict[str, Any]) -> tuple[int, int]:
        """This rank's arguments, checked before any peer is waited for: (micro, gas)."""
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine trains a hyperpar PipelineModule, got "
                            f"{type(model).__name__}; build the model with "
                            f"PipelineModule(layers=..., loss_fn=...)")
        extra = sorted(set(cfg) - _CONFIG_KEYS)
        if extra:
            raise ValueError(f"PipelineEngine on MindSpore: config keys {extra} are not "
                             f"supported yet (accepted: {sorted(_CONFIG_KEYS)}); build the "
                             f"optimizer yourself and pass optimizer=")
        micro = int(cfg.get("train_micro_batch_size_per_gpu", 1))
        gas = cfg.get("gradient_accumulation_steps")
        total = cfg.get("train_batch_size")
        if gas is None:
            gas = total // micro if total is not None else 1
        if total is not None and total != micro * gas:
            raise ValueError(f"PipelineEngine: train_batch_size={total} must equal "
                             f"train_micro_batch_size_per_gpu ({micro}) x "
                             f"gradient_accumulation_steps ({gas})")
        if gas < 1 or micro < 1:
            raise ValueError(f"PipelineEngine: micro batch size and gradient_accumulation_steps "
                             f"must be >= 1, got {micro} and {gas}")
        _check_fully_shard(model)
        if not isinstance(optimizer, nn.Optimizer):
            raise TypeError(f"PipelineEngine: optimizer must be a mindspore.nn.Optimizer over "
                            f"model.trainable_params(), got {type(optimizer).__name__}")
        mine = {p.name for p in model.trainable_params()}
        theirs = [p.name for p in optimizer.parameters]
        if set(theirs) != mine:
            raise ValueError(f"PipelineEngine: the optimizer's parameters {sorted(theirs)} are "
                             f"not this stage's trainable parameters {sorted(mine)}; build it "
                             f"as nn.SGD(model.trainable_params(), ...)")
        return micro, int(gas)

    def __init__(self, model: PipelineModule, optimizer: nn.Optimizer,
                 config: Mapping[str, Any] | None = None, *,
                 schedule: type[PipelineSchedule] | str | None = None) -> None:
        cfg = dict(config or {})
        # Checked here, then agreed with every peer: a rank whose optimizer (say) is wrong must
        # not leave the others waiting at their first receive until the transport times out.
        error: Exception | None = None
        try:
            micro, gas = self._check(model, optimizer, cfg)
        except (TypeError, ValueError) as exc:
            error = exc
        _agree_or_raise(error)
        self.module, self.optimizer = model, optimizer
        self.micro_batch_size, self.gradient_accumulation_steps = micro, gas
        if schedule is None:
            schedule = "interleaved1f1b" if model.virtual_stages > 1 else "1f1b"
        cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
        self.schedule = cls(model, self.gradient_accumulation_steps)
        self._dp = _DataParallelGrads(model, self.schedule.weights)
        self.global_steps = 0
        self.platform = get_platform()

    def is_first_stage(self) -> bool:
        return 0 in self.module.local_stages

    def is_last_stage(self) -> bool:
        return self.module.total_stages - 1 in self.module.local_stages

    def _draw(self, data_iter: Iterator[Any], where: str
              ) -> tuple[list[Any] | None, list[Any] | None, str | None]:
        """``gradient_accumulation_steps`` pairs ``(inputs, labels)`` from ``data_iter`` on the
        first and the last stage; a bad iterator gives an error text, raised inside the step
        so the other stages are told."""
        m, first, last = self.gradient_accumulation_steps, self.is_first_stage(), \
            self.is_last_stage()
        inputs: list[Any] | None = [] if first else None
        targets: list[Any] | None = [] if last else None
        error = None
        if first or last:
            for i in range(m):
                try:
                    batch = next(data_iter)
                except StopIteration:
                    batch = None
                if batch is None or not (isinstance(batch, tuple | list) and len(batch) == 2):
                    error = (
                        f"{where}: the data iterator ran out after {i} of the {m} "
                        f"microbatches" if batch is None else
                        f"{where}: each item of the data iterator must be a pair "
                        f"(inputs, labels), got {type(batch).__name__}")
                    break
                if first:
                    inputs.append(batch[0])
                if last:
                    targets.append(batch[1])
        return inputs, targets, error

    def _mean_loss(self, losses: list[Any] | None) -> ms.Tensor:
        # The last stage's mean microbatch loss, averaged over the replicas, broadcast over
        # the pipeline so every rank returns it.
        mod = self.module
        buf = ms.ops.zeros((1,), ms.float32)
        if self.is_last_stage():
            buf = ms.ops.stack([x.astype(ms.float32) for x in losses]).mean().reshape(1)
            if mod.dp_size > 1:
                self.platform.all_reduce(buf, "avg", group=mod.dp_group)
        if mod.num_stages > 1:
            src = mod.stage_ranks[mod.stage_owner(mod.total_stages - 1)]
            self.platform.broadcast(buf, src=src, group=mod.group)
        return buf[0]

    def train_batch(self, data_iter: Iterator[Any]) -> ms.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` microbatches ``(inputs,
        labels)`` drawn from ``data_iter`` (on the first and the last stage); returns the mean
        microbatch loss (a float32 scalar) on every rank."""
        inputs, targets, error = self._draw(data_iter, "train_batch")
        losses = self.schedule.run_microbatches(inputs, targets, data_error=error)
        grads = dict(zip([id(p) for p in self.schedule.weights],
                         self._dp.average(self.schedule.grads), strict=True))
        self.optimizer(tuple(grads[id(p)] for p in self.optimizer.parameters))
        self.global_steps += 1
        return self._mean_loss(losses)

    def eval_batch(self, data_iter: Iterator[Any]) -> ms.Tensor:
        """Forward ``gradient_accumulation_steps`` microbatches from ``data_iter`` through the
        forward-only plan, without gradients and leaving the parameters unchanged; returns
        the mean microbatch loss (float32 scalar) on every rank, as :meth:`train_batch`. The
        Cells run with ``set_train(False)`` (dropout off) and get their mode back after."""
        inputs, targets, error = self._draw(data_iter, "eval_batch")
        was_training = self.module.training
        self.module.set_train(False)
        try:
            losses = self.schedule.run_microbatches(inputs, targets, data_error=error,
                                                    train=False)
        finally:
            self.module.set_train(was_training)
        return self._mean_loss(losses)


def _check_fully_shard(model: PipelineModule) -> None:
    """A fully_shard unit inside a pipeline must shard over the stage's replicas (its
    reduce-scatter is then the data-parallel averaging): refused otherwise, locally."""
    platform = get_platform()
    want = sorted(platform.group_ranks(model.dp_group)) if model.dp_size > 1 else \
        [platform.rank()]
    for unit in _units(model):
        ranks = set(platform.group_ranks(unit.shard_group))
        if unit.plan.replicate > 1:
            ranks |= set(platform.group_ranks(unit.gather.replicate_group))
        if sorted(ranks) != want:
            raise ValueError(
                f"PipelineEngine: {type(unit.cell).__name__} is fully_shard-ed over ranks "
                f"{sorted(ranks)}, but the replicas of this pipeline stage are ranks {want}; "
                f"shard each stage's Cells over the data-parallel dimension of the pipeline's "
                f"mesh: fully_shard(cell, mesh=mesh['dp'])")


class _DataParallelGrads:
    """Averages a stage's gradients over its replicas (``model.dp_group``), bucketed, as
    :func:`~hyperpar_mindspore.data_parallel.data_parallel` does; the shards of fully_shard
    units are left alone (their reduce-scatter averaged them)."""

    def __init__(self, model: PipelineModule, weights: list[Any]) -> None:
        from .data_parallel import _Reducer

        sharded = {id(p) for unit in _units(model) for p in unit.shards}
        self.index = [i for i, p in enumerate(weights) if id(p) not in sharded]
        self.reducer = (_Reducer([weights[i] for i in self.index], model.dp_group, 25 << 20)
                        if model.dp_size > 1 and self.index else None)

    def average(self, grads: list[Any]) -> list[Any]:
        if self.reducer is None:
            return grads
        out = list(grads)
        reduced = self.reducer.reduce([grads[i] for i in self.index])
        for i, g in zip(self.index, reduced, strict=True):
            out[i] = g
        return out


def initialize(args: Any = None, model: PipelineModule | None = None, optimizer: Any = None,
               config: Mapping[str, Any] | None = None,
               config_params: Mapping[str, Any] | None = None,
               **unsupported: Any) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` for MindSpore pipelines: ``(engine, optimizer, None, None)``."""
    del args
    given = sorted(k for k, v in unsupported.items() if v is not None)
    if given:
        raise ValueError(f"initialize on MindSpore: {given} are not supported yet; pass model=, "
                         f"optimizer= and config=")
    if model is None:
        raise ValueError("initialize: model= (a PipelineModule) is required")
    engine = PipelineEngine(model, optimizer, config if config is not None else config_params)
    return engine, engine.optimizer, None, None
