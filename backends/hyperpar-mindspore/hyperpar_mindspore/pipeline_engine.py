"""Run hyperpar's pipeline schedules on MindSpore Cells, and the DeepSpeed-style engine.

What runs when is hyperpar's, shared with torch: the plan (:mod:`hyperpar.pipeline.schedules`:
``gpipe_plan``, ``one_f_one_b_plan``), its lowering to batches of sends and receives
(``rank_program``), and the instruction loop (:func:`hyperpar.pipeline.runner.run_program`).
This module supplies the MindSpore mechanics of one action:

* forward of microbatch ``mb``: run the stage Cell on its input (no gradient graph) and send the
  output on; the stage input is kept for the backward;
* backward of ``mb``: ``mindspore.vjp`` of the stage (of ``loss * weight`` on the last stage)
  with respect to the stage's float inputs and its trainable parameters, applied to the output
  gradient received from the next stage; the input gradient is sent back and the weight
  gradients accumulate over the microbatches.

MindSpore's PyNative mode keeps one gradient graph at a time (a second ``vjp`` before the first
one's backward left the first unusable on MindSpore 2.10), so the backward recomputes the stage
forward, as activation checkpointing does: about one extra forward per microbatch and stage, and
only the stage inputs are held between forward and backward. A stage must therefore be
deterministic (no dropout).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import mindspore as ms
from mindspore import nn

from hyperpar.pipeline._faults import PipelineStageError
from hyperpar.pipeline.runner import StepTimings, run_program
from hyperpar.pipeline.schedules import (
    Action,
    Backward,
    Comm,
    Forward,
    PlanFn,
    Step,
    choose_lowering,
    forward_only_program,
    gpipe_plan,
    one_f_one_b_plan,
    rank_program,
)
from hyperpar.platform import get_platform

from .pipeline import PipelineModule
from .pipeline_p2p import MindSporeP2P

__all__ = ["PipelineEngine", "PipelineSchedule", "Schedule1F1B", "ScheduleGPipe",
           "get_schedule_class", "initialize"]


def _flatten(value: Any, where: str) -> tuple[list[Any], bool]:
    if isinstance(value, ms.Tensor):
        return [value], True
    if isinstance(value, tuple | list) and all(isinstance(t, ms.Tensor) for t in value):
        return list(value), False
    raise TypeError(f"{where}: a value crossing pipeline stages must be a mindspore.Tensor or a "
                    f"tuple of them, got {type(value).__name__}")


def _is_float(t: Any) -> bool:
    return t.dtype in (ms.float16, ms.float32, ms.float64, ms.bfloat16)


class PipelineSchedule:
    """Executor of one schedule on a MindSpore :class:`PipelineModule`.

    ``run_microbatches(inputs, targets)`` runs one step over ``n_microbatches`` microbatches
    (``inputs`` on stage 0, ``targets`` on the last stage); afterwards :attr:`grads` holds the
    accumulated gradients of ``module.trainable_params()`` (each microbatch loss weighs
    ``1 / n_microbatches``) and the method returns the microbatch losses on the last stage
    (``None`` elsewhere). Tied gradients are summed over their owning stages.
    """

    plan_fn: ClassVar[PlanFn]

    def __init__(self, module: PipelineModule, n_microbatches: int, *,
                 loss_fn: Any = None) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"{type(self).__name__} drives a hyperpar_mindspore PipelineModule, "
                            f"got {type(module).__name__}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self.module = module
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn if loss_fn is not None else module.loss_fn
        if self.loss_fn is None:
            raise ValueError(f"{type(self).__name__}: no loss function; pass loss_fn= to "
                             f"PipelineModule")
        self.n_stages = self.n_ranks = module.num_stages
        plan_fn = type(self).plan_fn
        fuse = choose_lowering(plan_fn, self.n_stages, n_microbatches, self.n_ranks)
        self._plan = plan_fn(self.n_stages, n_microbatches, module.stage_id, self.n_ranks)
        self.program: list[Step] = rank_program(plan_fn, self.n_stages, n_microbatches,
                                                module.stage_id, self.n_ranks, fuse=fuse)
        self.p2p = MindSporeP2P(module.stage_ranks)
        self.weights = module.trainable_params()
        self.grads: list[Any] = []
        self.last_timings = StepTimings()
        self._broken: str | None = None
        self._train = True
        self._eval_program: list[Step] | None = None

    def plan(self) -> list[Action]:
        """This rank's compute actions for one step."""
        return list(self._plan)

    # ------------------------------------------------------------------ step
    def run_microbatches(self, inputs: list[Any] | None, targets: list[Any] | None, *,
                         data_error: str | None = None, train: bool = True) -> list[Any] | None:
        """One training step; see the class docstring. ``data_error`` (the engine's: the data
        iterator ran out) is raised inside the step, so the other stages are told.
        ``train=False`` runs the forward-only plan instead: no backward, :attr:`grads` empty."""
        if self._broken is not None:
            raise RuntimeError(
                f"this pipeline failed in an earlier step ({self._broken}); messages its ranks "
                f"never received may still be in flight, so it cannot run again: restart the "
                f"job")
        mod, m, last = self.module, self.n_microbatches, self.n_stages - 1
        self._inputs, self._targets = inputs, targets
        self._saved: dict[int, Any] = {}
        self._act_in: dict[int, Any] = {}
        self._grad_in: dict[int, Any] = {}
        self._outbox: dict[Comm, tuple[list[Any], bool]] = {}
        self._losses: list[Any] = [None] * m
        self._train = train
        self.grads = [ms.ops.zeros(p.shape, p.dtype) for p in self.weights] if train else []
        self._pc, self._sent_upto = 0, 0
        self._stage: int | None = None
        timings = StepTimings()
        start = time.perf_counter()
        try:
            if data_error is not None:
                raise ValueError(data_error)
            if mod.stage_id == 0 and (inputs is None or len(inputs) != m):
                raise ValueError(f"the rank holding stage 0 needs {m} microbatch inputs, got "
                                 f"{None if inputs is None else len(inputs)}")
            if mod.stage_id == last and (targets is None or len(targets) != m):
                raise ValueError(f"the rank holding the last stage ({last}) needs {m} "
                                 f"microbatch targets, got "
                                 f"{None if targets is None else len(targets)}")
            run_program(self._counted(), self._communicate, self._run, timings, self._blame)
            self.p2p.wait_sends()
            if train:
                self._reduce_tied()
        except Exception as exc:
            self._fail(exc)
            raise
        timings.step_s = time.perf_counter() - start
        self.last_timings = timings
        return list(self._losses) if mod.stage_id == last else None

    def _forward_program(self) -> list[Step]:
        # Built on first use: the forward-only plan of eval_batch, lowered like the train plan.
        if self._eval_program is None:
            self._eval_program = forward_only_program(self.n_stages, self.n_microbatches,
                                                      self.module.stage_id, self.n_ranks)
        return self._eval_program

    def _counted(self) -> Iterator[Step]:
        program = self.program if self._train else self._forward_program()
        for i, step in enumerate(program):
            self._pc = i
            yield step

    def _blame(self, stage: int | None) -> None:
        self._stage = stage

    # ------------------------------------------------------------------ failures
    def _fail(self, exc: BaseException) -> None:
        """Tell every peer still waiting for a message from this rank which stage failed, so it
        raises too instead of hanging; then refuse further steps."""
        mod = self.module
        stage = mod.stage_id if self._stage is None else self._stage
        if isinstance(exc, PipelineStageError):
            origin, text = exc.rank, str(exc).split(" failed: ", 1)[-1].split("\n")[0]
            stage, skip = exc.stage, {exc.rank}
            # the neighbour that told us: it stopped at the message it sent
            skip |= {mod.stage_ranks[c.peer] for c in self.program[self._pc].comms
                     if c.kind == "recv"}
        else:
            origin = get_platform().rank()
            text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            skip = set()
        owed = {c.peer for step in self.program[self._sent_upto:] for c in step.comms
                if c.kind == "send"} | {c.peer for c in self._outbox}
        self.p2p.drop_sends()
        for peer in sorted(owed):
            if mod.stage_ranks[peer] not in skip:
                self.p2p.send_failure(peer, stage if stage is not None else -1, text[:120])
        self.p2p.drop_sends()
        self._broken = f"stage {stage} (rank {origin}): {text[:200]}"

    # ------------------------------------------------------------------ communication
    def _communicate(self, comms: tuple[Comm, ...]) -> None:
        for c in comms:
            if c.kind == "send":
                tensors, single = self._outbox.pop(c)
                self.p2p.send(tensors, single, c.peer, c.stage)
        self._sent_upto = self._pc + 1   # this step's sends are out
        for c in comms:
            if c.kind == "recv":
                bufs, single = self.p2p.recv(c.peer)
                if c.what == "act":
                    self._act_in[c.mb] = bufs[0] if single else tuple(bufs)
                else:
                    self._grad_in[c.mb] = bufs

    # ------------------------------------------------------------------ compute
    def _run(self, action: Action) -> None:
        if isinstance(action, Forward):
            self._forward(action.stage, action.mb)
        elif isinstance(action, Backward):
            self._backward(action.stage, action.mb)
        else:
            raise NotImplementedError(f"{type(self).__name__}: {type(action).__name__} actions "
                                      f"(zero-bubble) are not supported on MindSpore yet")

    def _forward(self, stage: int, mb: int) -> None:
        x = self._inputs[mb] if stage == 0 else self._act_in.pop(mb)
        if self._train:
            self._saved[mb] = x
        out = self.module(x)
        if stage == self.n_stages - 1:
            self._losses[mb] = self.loss_fn(out, self._targets[mb])
            return
        tensors, single = _flatten(out, f"output of stage {stage}")
        self._outbox[Comm("send", "act", mb, stage, stage + 1)] = (tensors, single)

    def _backward(self, stage: int, mb: int) -> None:
        x = self._saved.pop(mb)
        last = stage == self.n_stages - 1
        if isinstance(x, ms.Tensor):
            parts, single = [x], True
        else:
            parts, single = list(x), False
        floats = [i for i, t in enumerate(parts) if isinstance(t, ms.Tensor) and _is_float(t)]
        if stage == 0:
            floats = []   # the model inputs: no gradient to send anywhere
        weight = 1.0 / self.n_microbatches
        target = self._targets[mb] if last else None

        def stage_fn(*diff: Any) -> Any:
            vals = list(parts)
            for i, t in zip(floats, diff, strict=True):
                vals[i] = t
            out = self.module(vals[0] if single else tuple(vals))
            return self.loss_fn(out, target) * weight if last else out

        out, vjp_fn = ms.vjp(stage_fn, *[parts[i] for i in floats], weights=self.weights)
        if last:
            sens: Any = ms.ops.ones_like(out)
        else:
            got = self._grad_in.pop(mb)
            sens = got[0] if isinstance(out, ms.Tensor) else tuple(got)
        in_grads, w_grads = vjp_fn(sens)
        for i, g in enumerate(w_grads):
            self.grads[i] = self.grads[i] + g
        if stage > 0:
            in_grads = in_grads if isinstance(in_grads, tuple | list) else (in_grads,)
            self._outbox[Comm("send", "grad", mb, stage, stage - 1)] = (list(in_grads), False)

    def _reduce_tied(self) -> None:
        """Sum each tied weight's gradient over the stages that own a copy."""
        mod, platform = self.module, get_platform()
        index = {id(p): i for i, p in enumerate(self.weights)}
        for key, owners in mod.tied_owners.items():
            if len(owners) < 2:
                continue
            group = mod.tied_group(key)
            if mod.stage_id not in owners:
                continue
            for param in mod.tied_parameters(key):
                i = index[id(param)]
                grad = self.grads[i].copy()
                platform.all_reduce(grad, "sum", group=group)
                self.grads[i] = grad


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards."""

    plan_fn = staticmethod(gpipe_plan)


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-flush): at most ``p - rank`` microbatches' inputs held."""

    plan_fn = staticmethod(one_f_one_b_plan)


def get_schedule_class(name: str) -> type[PipelineSchedule]:
    """``"gpipe"`` or ``"1f1b"`` (case and ``_``/``-`` ignored); the interleaved and
    zero-bubble schedules are torch-only for now."""
    key = name.lower().replace("_", "").replace("-", "").replace("schedule", "")
    table = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if key in ("interleaved1f1b", "zerobubble", "zb", "zbh1"):
        raise NotImplementedError(f"pipeline schedule {name!r} is not supported on MindSpore "
                                  f"yet; use 'gpipe' or '1f1b'")
    if key not in table:
        raise ValueError(f"unknown pipeline schedule {name!r}; known on MindSpore: "
                         f"{sorted(table)}")
    return table[key]


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
    """``PipelineEngine(model, optimizer, config, *, schedule="1f1b")`` on MindSpore: DeepSpeed's
    ``train_batch`` over a :class:`PipelineModule`. ``optimizer`` is a ``mindspore.nn.Optimizer``
    over ``model.trainable_params()``; ``config`` takes ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps`` and ``train_batch_size`` (other sections -- fp16, bf16,
    optimizer, gradient_clipping -- are torch-only for now and refused)."""

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
                 schedule: type[PipelineSchedule] | str = "1f1b") -> None:
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
        cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
        self.schedule = cls(model, self.gradient_accumulation_steps)
        self.global_steps = 0
        self.platform = get_platform()

    def is_first_stage(self) -> bool:
        return self.module.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.module.stage_id == self.module.num_stages - 1

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
        # The last stage's mean microbatch loss, broadcast so every rank returns it.
        buf = ms.ops.zeros((1,), ms.float32)
        if self.is_last_stage():
            buf = ms.ops.stack([x.astype(ms.float32) for x in losses]).mean().reshape(1)
        self.platform.broadcast(buf, src=self.module.stage_ranks[-1])
        return buf[0]

    def train_batch(self, data_iter: Iterator[Any]) -> ms.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` microbatches ``(inputs,
        labels)`` drawn from ``data_iter`` (on the first and the last stage); returns the mean
        microbatch loss (a float32 scalar) on every rank."""
        inputs, targets, error = self._draw(data_iter, "train_batch")
        losses = self.schedule.run_microbatches(inputs, targets, data_error=error)
        grads = dict(zip([id(p) for p in self.schedule.weights], self.schedule.grads,
                         strict=True))
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
