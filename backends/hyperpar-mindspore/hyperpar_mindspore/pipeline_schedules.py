"""Run hyperpar's pipeline schedules on MindSpore Cells (the DeepSpeed-style engine over them is
:mod:`hyperpar_mindspore.pipeline_engine`).

What runs when is hyperpar's, shared with torch: the plan (:mod:`hyperpar.pipeline.schedules`:
``gpipe_plan``, ``one_f_one_b_plan``, ``interleaved_1f1b_plan``, ``zero_bubble_plan``,
``interleaved_zero_bubble_plan``), its lowering to batches of
sends and receives (``rank_program``), and the instruction loop
(:func:`hyperpar.pipeline.runner.run_program`). This module supplies the MindSpore mechanics
of one action:

* forward of microbatch ``mb``: run the stage Cell on its input (no gradient graph) and send the
  output on; the stage input is kept for the backward;
* backward of ``mb``: ``mindspore.vjp`` of the stage (of ``loss * weight`` on the last stage)
  with respect to the stage's float inputs and its trainable parameters, applied to the output
  gradient received from the next stage; the input gradient is sent back and the weight
  gradients accumulate over the microbatches;
* zero-bubble split of that backward: ``I`` is the vjp with respect to the stage's float inputs
  only (sent back at once), ``W`` later the vjp with respect to its parameters only, from the
  same output gradient (kept, with the stage input, until ``W``);
* after the step: tied gradients summed over their owning stages, then every gradient averaged
  over the stage's data-parallel replicas (fully_shard shards excepted: already averaged).

MindSpore's PyNative mode keeps one gradient graph at a time (a second ``vjp`` before the first
one's backward left the first unusable on MindSpore 2.10), so the backward recomputes the stage
forward, as activation checkpointing does: about one extra forward per microbatch and stage, and
only the stage inputs are held between forward and backward. A stage must therefore be
deterministic (no dropout). For the same reason the zero-bubble ``I`` and ``W`` each recompute
the forward: a zero-bubble schedule costs one more forward per microbatch and stage than 1F1B,
trading compute for bubble.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import mindspore as ms

from hyperpar.pipeline._faults import PipelineStageError
from hyperpar.pipeline.runner import StepTimings, run_program
from hyperpar.pipeline.schedules import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Comm,
    Forward,
    PlanFn,
    Step,
    choose_lowering,
    forward_only_program,
    gpipe_plan,
    interleaved_1f1b_plan,
    interleaved_zero_bubble_plan,
    one_f_one_b_plan,
    rank_program,
    zero_bubble_plan,
)
from hyperpar.platform import get_platform

from .fully_shard import pending_gradients, reset_backward, set_backward_mode
from .pipeline import PipelineModule
from .pipeline_p2p import MindSporeP2P
from .tensors import copy_tensor

__all__ = ["PipelineSchedule", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "ScheduleZeroBubble", "get_schedule_class"]


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
    :attr:`last_actions` lists the compute actions this rank ran in the last step, in order.
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
        # stages over pipeline ranks: stage s on pipeline rank s % n_ranks (several per rank
        # under virtual_stages); the plans and their lowering are hyperpar's neutral ones
        self.n_stages, self.n_ranks = module.total_stages, module.num_stages
        plan_fn = type(self).plan_fn
        fuse = choose_lowering(plan_fn, self.n_stages, n_microbatches, self.n_ranks)
        self._plan = plan_fn(self.n_stages, n_microbatches, module.stage_id, self.n_ranks)
        self.program: list[Step] = rank_program(plan_fn, self.n_stages, n_microbatches,
                                                module.stage_id, self.n_ranks, fuse=fuse)
        self.p2p = MindSporeP2P(module.stage_ranks)
        self.weights = module.trainable_params()
        self.grads: list[Any] = []
        self.last_timings = StepTimings()
        self.last_actions: list[Action] = []
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
        # keyed by (stage receiving it, microbatch): a rank may hold several stages
        self._saved: dict[tuple[int, int], Any] = {}
        # zero-bubble: (stage input, output gradient or None on the last stage), from I to W
        self._held: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._act_in: dict[tuple[int, int], Any] = {}
        self._grad_in: dict[tuple[int, int], Any] = {}
        self._outbox: dict[Comm, tuple[list[Any], bool]] = {}
        self._losses: list[Any] = [None] * m
        self._train = train
        self.grads = [ms.ops.zeros(p.shape, p.dtype) for p in self.weights] if train else []
        self._pc, self._sent_upto = 0, 0
        # fully_shard units of the stages: reduce-scattered once per step, in each stage's
        # last backward (the others accumulate), as torch's FSDP2 does under accumulation
        self._fsdp_units = _units(mod) if train else []
        self._backwards_done: dict[int, int] = {}
        self.last_actions = []
        self._stage: int | None = None
        timings = StepTimings()
        start = time.perf_counter()
        try:
            if data_error is not None:
                raise ValueError(data_error)
            if 0 in mod.local_stages and (inputs is None or len(inputs) != m):
                raise ValueError(f"the rank holding stage 0 needs {m} microbatch inputs, got "
                                 f"{None if inputs is None else len(inputs)}")
            if last in mod.local_stages and (targets is None or len(targets) != m):
                raise ValueError(f"the rank holding the last stage ({last}) needs {m} "
                                 f"microbatch targets, got "
                                 f"{None if targets is None else len(targets)}")
            run_program(self._counted(), self._communicate, self._run, timings, self._blame)
            self.p2p.wait_sends()
            if train:
                self._check_reduced()
                self._reduce_tied()
        except Exception as exc:
            self._fail(exc)
            raise
        finally:
            reset_backward(self._fsdp_units)
        timings.step_s = time.perf_counter() - start
        self.last_timings = timings
        return list(self._losses) if last in mod.local_stages else None

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
                if c.what == "act":   # the output of stage c.stage, for stage c.stage + 1
                    self._act_in[c.stage + 1, c.mb] = bufs[0] if single else tuple(bufs)
                else:                 # the input gradient of stage c.stage, for c.stage - 1
                    self._grad_in[c.stage - 1, c.mb] = bufs

    # ------------------------------------------------------------------ compute
    def _run(self, action: Action) -> None:
        self.last_actions.append(action)
        if self._fsdp_units and isinstance(action, Backward | BackwardInput | BackwardWeight):
            set_backward_mode(self._fsdp_units, self._backward_mode(action))
        if isinstance(action, Forward):
            self._forward(action.stage, action.mb)
        elif isinstance(action, Backward):
            self._backward(action.stage, action.mb, "B")
        elif isinstance(action, BackwardInput):
            self._backward(action.stage, action.mb, "I")
        elif isinstance(action, BackwardWeight):
            self._backward(action.stage, action.mb, "W")
        else:
            raise NotImplementedError(f"{type(self).__name__}: {type(action).__name__} actions "
                                      f"are not supported on MindSpore")

    def _backward_mode(self, action: Action) -> str:
        """What the fully_shard units do with this backward's parameter gradients: nothing
        for I (input gradients only), reduce in the stage's last B or W of the step (each
        microbatch has one per stage), accumulate before it. Only the running stage's units
        take part in a backward, so setting every unit's mode is enough."""
        if isinstance(action, BackwardInput):
            return "discard"
        done = self._backwards_done.get(action.stage, 0) + 1
        self._backwards_done[action.stage] = done
        return "sync" if done == self.n_microbatches else "accumulate"

    def _check_reduced(self) -> None:
        """A gradient accumulated but never reduced would be lost silently: refuse."""
        left = pending_gradients(self._fsdp_units)
        if left:
            raise RuntimeError(f"internal error: fully_shard units {left} hold gradients this "
                               f"step never reduced; please report it")

    def _local(self, stage: int) -> bool:
        return self.module.stage_owner(stage) == self.module.stage_id

    def _forward(self, stage: int, mb: int) -> None:
        x = self._inputs[mb] if stage == 0 else self._act_in.pop((stage, mb))
        if self._train:
            self._saved[stage, mb] = x
        self.module.select_stage(stage)
        out = self.module(x)
        if stage == self.n_stages - 1:
            self._losses[mb] = self.loss_fn(out, self._targets[mb])
            return
        if self._local(stage + 1):   # the next stage is on this rank too: no message
            self._act_in[stage + 1, mb] = out
            return
        tensors, single = _flatten(out, f"output of stage {stage}")
        peer = self.module.stage_owner(stage + 1)
        self._outbox[Comm("send", "act", mb, stage, peer)] = (tensors, single)

    def _backward(self, stage: int, mb: int, part: str) -> None:
        """``part`` "B": input and parameter gradients from one vjp; "I": the input gradient
        only (the stage input and output gradient are held for W); "W": the parameter
        gradients only, from what I held. Each part re-runs the stage forward (see the module
        docstring)."""
        last = stage == self.n_stages - 1
        if part == "W":
            x, got = self._held.pop((stage, mb))
        else:
            x = self._saved.pop((stage, mb))
            got = None if last else self._grad_in.pop((stage, mb))
        if isinstance(x, ms.Tensor):
            parts, single = [x], True
        else:
            parts, single = list(x), False
        floats = [i for i, t in enumerate(parts) if isinstance(t, ms.Tensor) and _is_float(t)]
        if stage == 0 or part == "W":
            floats = []   # model inputs (no gradient to send anywhere), or W: parameters only
        if part == "I":
            self._held[stage, mb] = (x, got)
            if not floats:   # stage 0: nothing to send back; W does all the work
                return
        weight = 1.0 / self.n_microbatches
        target = self._targets[mb] if last else None

        def stage_fn(*diff: Any) -> Any:
            vals = list(parts)
            for i, t in zip(floats, diff, strict=True):
                vals[i] = t
            self.module.select_stage(stage)
            out = self.module(vals[0] if single else tuple(vals))
            return self.loss_fn(out, target) * weight if last else out

        out, vjp_fn = ms.vjp(stage_fn, *[parts[i] for i in floats],
                             weights=None if part == "I" else self.weights)
        if last:
            sens: Any = ms.ops.ones_like(out)
        else:
            sens = got[0] if isinstance(out, ms.Tensor) else tuple(got)
        if part == "I":
            in_grads = vjp_fn(sens)
        else:
            in_grads, w_grads = vjp_fn(sens)
            for i, g in enumerate(w_grads):
                self.grads[i] = self.grads[i] + g
        if stage > 0 and part != "W":
            in_grads = in_grads if isinstance(in_grads, tuple | list) else (in_grads,)
            if self._local(stage - 1):
                self._grad_in[stage - 1, mb] = list(in_grads)
                return
            peer = self.module.stage_owner(stage - 1)
            self._outbox[Comm("send", "grad", mb, stage, peer)] = (list(in_grads), False)

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
                grad = copy_tensor(self.grads[i])
                platform.all_reduce(grad, "sum", group=group)
                self.grads[i] = grad


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards."""

    plan_fn = staticmethod(gpipe_plan)


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-flush): at most ``p - rank`` microbatches' inputs held."""

    plan_fn = staticmethod(one_f_one_b_plan)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B (Megatron-LM) over a ``PipelineModule(..., virtual_stages=v)``: each
    rank runs ``v`` stages; the bubble shrinks by about ``v``."""

    plan_fn = staticmethod(interleaved_1f1b_plan)


class ScheduleZeroBubble(PipelineSchedule):
    """Zero-bubble (ZB-H1, :func:`~hyperpar.pipeline.schedules.zero_bubble_plan`): each
    backward split into ``I``, the gradient with respect to the stage input only (sent
    upstream at once), and ``W``, the gradient with respect to the stage's parameters only,
    deferred into what would be 1F1B's bubble. Same activation budget as 1F1B.

    On MindSpore PyNative ``I`` and ``W`` are two vjp calls and each re-runs the stage forward
    (one gradient graph is kept at a time, so a vjp cannot be held from ``I`` to ``W``):
    ``W`` costs one extra forward per microbatch and stage over 1F1B. Zero-bubble trades that
    compute for the bubble; it pays only where the bubble (about ``(p - 1) / (m + p - 1)`` of
    the step) outweighs a forward's share of the step."""

    plan_fn = staticmethod(zero_bubble_plan)


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """Interleaved zero-bubble (:func:`~hyperpar.pipeline.schedules.
    interleaved_zero_bubble_plan`) over ``PipelineModule(..., virtual_stages=v)``: interleaved
    1F1B's order with each backward split into ``I`` and a deferred ``W`` as in
    :class:`ScheduleZeroBubble`, with the same extra forward per microbatch and stage."""

    plan_fn = staticmethod(interleaved_zero_bubble_plan)


_SCHEDULES: dict[str, type[PipelineSchedule]] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
    "zerobubble": ScheduleZeroBubble, "zb": ScheduleZeroBubble, "zbh1": ScheduleZeroBubble,
    "interleavedzerobubble": ScheduleInterleavedZeroBubble}


def get_schedule_class(name: str) -> type[PipelineSchedule]:
    """``"gpipe"``, ``"1f1b"``, ``"interleaved1f1b"``, ``"zerobubble"`` (or ``"zb"``,
    ``"zbh1"``) or ``"interleavedzerobubble"`` (case and ``_``/``-`` ignored). ZB-V
    (``"zbv"``) is torch-only: its V placement of stages is not in MindSpore's
    ``PipelineModule``."""
    key = name.lower().replace("_", "").replace("-", "").replace("schedule", "")
    table = _SCHEDULES
    if key in ("zbv", "zbvzerobubble", "zerobubblev"):
        raise NotImplementedError(
            f"pipeline schedule {name!r} (ZB-V) is not supported on MindSpore: its V placement "
            f"(rank r holding stages r and 2p-1-r) is not in MindSpore's PipelineModule; use "
            f"'zerobubble' (one stage per rank) or 'interleavedzerobubble' "
            f"(virtual_stages=2), or run ZB-V on torch")
    if key not in table:
        raise ValueError(f"unknown pipeline schedule {name!r}; known on MindSpore: "
                         f"{sorted(table)}")
    return table[key]



def _units(model: PipelineModule) -> list[Any]:
    """The fully_shard units (:mod:`.fully_shard`) among ``model``'s Cells."""
    return [unit for _name, cell in model.cells_and_names()
            if (unit := cell.__dict__.get("_hp_fsdp_unit")) is not None]

