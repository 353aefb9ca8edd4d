"""``torch.distributed.pipelining`` schedules on hyperpar's written-once plans.

Each schedule names a plan of :mod:`hyperpar.pipeline.schedules` (GPipe, 1F1B, interleaved
1F1B), lowered to batched sends/receives by the same :func:`lower` and checked for
deadlock by the same :func:`check_plans`; activations and gradients travel by platform P2P
(:class:`hyperpar.pipeline.p2p.P2P`). So one microbatch schedule runs on every backend.

Semantics follow torch: ``step`` returns the merged last-stage outputs (``None`` elsewhere),
``losses`` receives the per-microbatch losses, each microbatch's loss is backpropagated
unscaled and, with ``scale_grads=True``, the stage gradients are divided by the microbatch
count after the step. ``fully_shard`` modules inside a stage accumulate without gradient sync
until their stage's last backward of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from hyperpar.fsdp.api import FSDPModule
from hyperpar.pipeline._faults import pipeline_step
from hyperpar.pipeline.executor import merge_microbatches, split_microbatches
from hyperpar.pipeline.mailbox import StageMailbox
from hyperpar.pipeline.p2p import P2P, Meta, flatten, meta_of
from hyperpar.pipeline.runner import StepTimings, run_program
from hyperpar.pipeline.schedules import (
    Action,
    B,
    Backward,
    Comm,
    F,
    Forward,
    Plan,
    PlanFn,
    Step,
    Style,
    check_plans,
    choose_lowering,
    gpipe_plan,
    interleaved_1f1b_plan,
    interleaved_zero_bubble_plan,
    lower_all,
    one_f_one_b_plan,
    rank_stages,
    stage_rank,
    zbv_plan,
)
from hyperpar.pipeline.split_backward import (
    capture_leaf_outputs,
    exact_pieces,
    input_gradients,
    weight_gradients,
)

from .stage import PipelineStage


def looped_bfs_plan(n_stages: int, n_microbatches: int, rank: int,
                    n_ranks: int | None = None) -> Plan:
    """Looped BFS (breadth-first): every microbatch through each local stage in turn, then the
    backwards, last local stage first."""
    p = n_stages if n_ranks is None else n_ranks
    local = list(range(rank, n_stages, p))
    return ([F(mb, s) for s in local for mb in range(n_microbatches)]
            + [B(mb, s) for s in reversed(local) for mb in range(n_microbatches)])


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detach(v) for v in value)
    return value


class _PipelineSchedule(StageMailbox):
    """Shared executor of the torch-compatible schedules."""

    plan_fn: ClassVar[PlanFn]
    multi: ClassVar[bool] = False
    #: where stage s lives: "loop" (rank s % p) or "v" (down the ranks and back up)
    style: ClassVar[Style] = "loop"
    #: zero-bubble schedules: each backward runs as I (input gradient) and W (weights)
    split_backward: ClassVar[bool] = False

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None, args_chunk_spec: Any,
                 kwargs_chunk_spec: Any, output_merge_spec: Any, scale_grads: bool,
                 dynamic_shapes: bool) -> None:
        name = type(self).__name__
        for what, spec in (("args_chunk_spec", args_chunk_spec),
                           ("kwargs_chunk_spec", kwargs_chunk_spec),
                           ("output_merge_spec", output_merge_spec)):
            if spec is not None:
                raise NotImplementedError(
                    f"{name}: {what} is not supported by hyperpar.pipelining; inputs are split "
                    f"and outputs merged along dim 0 (torch's default). Leave it None")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{name}: n_microbatches must be a positive int, got "
                             f"{n_microbatches!r}")
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}: expected hyperpar.pipelining.PipelineStage objects, got "
                            f"{[type(s).__name__ for s in stages]}")
        first = stages[0]
        for s in stages:
            if (s.num_stages, s.stage_ranks) != (first.num_stages, first.stage_ranks):
                raise ValueError(f"{name}: the stages of one rank disagree on num_stages or "
                                 f"group: {list(stages)}")
        n_ranks, n_stages = first.group_size, first.num_stages
        if len(stages) * n_ranks != n_stages:
            raise ValueError(
                f"{name}: {len(stages)} stage(s) on each of {n_ranks} ranks make "
                f"{len(stages) * n_ranks} stages, but the stages say num_stages={n_stages}; "
                f"give every rank num_stages / group size = {n_stages / n_ranks:g} stages")
        self._stages = {s.stage_index: s for s in stages}
        if len(self._stages) != len(stages):
            raise ValueError(f"{name}: duplicate stage indices {[s.stage_index for s in stages]}")
        style = type(self).style
        mine = rank_stages(first.group_rank, n_stages, n_ranks, style)
        if sorted(self._stages) != mine:
            rule = ("stage s runs on rank s % p" if style == "loop" else
                    "V placement: rank r holds stages r and 2p - 1 - r")
            raise ValueError(
                f"{name}: pipeline rank {first.group_rank} of {n_ranks} built stages "
                f"{sorted(self._stages)}, but this schedule places stages {mine} there ({rule}); "
                f"build those PipelineStages on this rank")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._has_backward = loss_fn is not None
        self.n_stages, self.n_ranks = n_stages, n_ranks
        # what hyperpar.pipeline._faults needs to name a failing stage on every rank
        self.stage_ranks, self.stage_id = first.stage_ranks, first.group_rank
        plan_fn = type(self).plan_fn
        self.fuse = choose_lowering(plan_fn, n_stages, n_microbatches, n_ranks, style)
        all_plans = [plan_fn(n_stages, n_microbatches, r, n_ranks) for r in range(n_ranks)]
        self._plan = all_plans[self.stage_id]
        self._program = lower_all(all_plans, n_stages, n_ranks, fuse=self.fuse,
                                  style=style)[self.stage_id]
        self._last_backward = {a.stage: a for a in self._plan if isinstance(a, Backward)}
        # eval: the training plan's forwards in their order. (forward_only_plan runs each
        # local stage to the end first, which deadlocks under rendezvous sends once a later
        # stage comes back to this rank with more than a few microbatches.)
        plans = [[a for a in plan if isinstance(a, Forward)] for plan in all_plans]
        check_plans(plans, n_stages, n_microbatches, n_ranks, forward_only=True, style=style)
        self._eval_program = lower_all(plans, n_stages, n_ranks, style=style)[self.stage_id]
        self._train_p2p = P2P(first.group, first.stage_ranks, dynamic_shapes)
        self._eval_p2p = P2P(first.group, first.stage_ranks, dynamic_shapes)

    # ------------------------------------------------------------------ public API
    def plan(self) -> list[Action]:
        """This rank's compute actions for one training step."""
        return list(self._plan)

    def step(self, *args: Any, target: Any = None, losses: list | None = None,
             return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None,
             arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None,
             **kwargs: Any) -> Any:
        """One step over the whole batch: split ``args``/``kwargs`` (and ``target`` on the last
        stage's rank) into microbatches along dim 0, run the schedule, and return the merged
        last-stage outputs there (``None`` on other ranks). With a ``loss_fn`` this is a
        training step; ``losses`` is cleared and filled with the per-microbatch losses.

        As torch 2.14: ``arg_mbs``/``kwarg_mbs``/``target_mbs`` pass inputs already split (one
        tuple / dict / target per microbatch) instead of the whole batch, and ``loss_kwargs``
        goes to every ``loss_fn(output, target, **loss_kwargs)`` call."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step() needs gradients enabled for its "
                               f"backward; it was called under torch.no_grad(). Call eval() "
                               f"for a forward-only pass")
        pre = self._presplit("step", args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        self._loss_kwargs = dict(loss_kwargs or {})
        if self._has_backward:
            return self._execute(self._program, self._train_p2p, True, args, kwargs, target,
                                 losses, return_outputs, pre)
        with torch.no_grad():
            return self._execute(self._eval_program, self._eval_p2p, False, args, kwargs,
                                 target, losses, return_outputs, pre)

    def eval(self, *args: Any, target: Any = None, losses: list | None = None,
             arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None,
             **kwargs: Any) -> Any:
        """Forward only (no gradients): merged outputs on the last stage's rank; with a
        ``target`` and ``loss_fn`` the per-microbatch losses go to ``losses``. Pre-split
        inputs as in :meth:`step`."""
        pre = self._presplit("eval", args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        self._loss_kwargs = {}
        with torch.no_grad():
            return self._execute(self._eval_program, self._eval_p2p, False, args, kwargs,
                                 target, losses, True, pre)

    def _presplit(self, what: str, args: tuple, kwargs: dict, target: Any, arg_mbs: Any,
                  kwarg_mbs: Any, target_mbs: Any) -> tuple[Any, Any, Any] | None:
        """Check pre-split microbatch inputs (torch 2.14's ``arg_mbs`` & co.); ``None`` when
        the whole batch is passed instead."""
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return None
        if args or kwargs or target is not None:
            raise ValueError(f"{what}(): pass either the whole batch (positional args, "
                             f"keyword args, target=) or pre-split arg_mbs/kwarg_mbs/"
                             f"target_mbs, not both")
        m = self._n_microbatches
        for name, value in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs),
                            ("target_mbs", target_mbs)):
            if value is not None and (not isinstance(value, list | tuple) or len(value) != m):
                raise ValueError(f"{what}(): {name} must be a list of one entry per "
                                 f"microbatch ({m}), got {type(value).__name__} of length "
                                 f"{len(value) if hasattr(value, '__len__') else '?'}")
        return (None if arg_mbs is None else [tuple(a) for a in arg_mbs],
                None if kwarg_mbs is None else [dict(k or {}) for k in kwarg_mbs],
                None if target_mbs is None else list(target_mbs))

    # ------------------------------------------------------------------ execution
    def _execute(self, program: list[Step], p2p: P2P, train: bool, args: tuple, kwargs: dict,
                 target: Any, losses: list | None, return_outputs: bool,
                 pre: tuple[Any, Any, Any] | None = None) -> Any:
        m, last = self._n_microbatches, self.n_stages - 1
        self._p2p, self._train = p2p, train
        self._act_in: dict[tuple[int, int], Any] = {}
        self._grad_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._out_meta: dict[tuple[int, int], Meta] = {}
        self._outbox: dict[Comm, tuple[Sequence[torch.Tensor], bool]] = {}
        self._losses: list[torch.Tensor | None] = [None] * m
        self._mb_outputs: list[Any] = [None] * m
        self._pieces: dict[tuple[int, int], list[Any]] = {}
        self._weight_work: dict[tuple[int, int], tuple[list, list, list]] = {}
        self._fault_stage: int | None = None
        self._fault_peers: list[int] = []
        with pipeline_step(self, lambda: self._fault_stage, lambda: self._fault_peers):
            self._mb_args = self._mb_kwargs = self._mb_targets = None
            if pre is not None:
                self._mb_args, self._mb_kwargs, targets = pre
                if 0 in self._stages and self._mb_args is None:
                    raise ValueError("step(): the rank holding stage 0 needs the model inputs; "
                                     "pass arg_mbs there")
                if last in self._stages:
                    self._mb_targets = targets
            else:
                if 0 in self._stages:
                    if not args:
                        raise ValueError("step(): the rank holding stage 0 needs the model "
                                         "inputs; pass them to step()/eval() there")
                    self._mb_args = split_microbatches(tuple(args), m)
                self._mb_kwargs = split_microbatches(dict(kwargs), m)
                if last in self._stages and target is not None:
                    self._mb_targets = split_microbatches(target, m)
            if last in self._stages and train and self._mb_targets is None:
                raise ValueError(f"step(): no target on the rank holding the last stage "
                                 f"({last}), but the schedule has a loss_fn; pass target= to "
                                 f"step() there")
            held = self._hold_fsdp_sync() if train and type(self).split_backward else []
            try:
                run_program(program, self._communicate, self._run, StepTimings(), self._blame)
            except BaseException:
                self._restore_fsdp(held)   # settings only: no collective on a failing rank
                raise
            self._fault_stage = None
            self._fault_peers = list(self.stage_ranks)
            p2p.wait_sends()
            self._fault_peers = []
            if held:
                self._release_fsdp_sync(held)
        if train:
            factor = m if self.scale_grads else 1
            for stage in self._stages.values():
                stage.scale_grads(factor)
        if last not in self._stages:
            return None
        if losses is not None and (train or self._mb_targets is not None):
            losses.clear()
            losses.extend(loss for loss in self._losses if loss is not None)
        if not return_outputs:
            return None
        return merge_microbatches(self._mb_outputs)

    def _stage_ranks(self) -> Sequence[int]:
        return self.stage_ranks

    def _is_local(self, stage: int, neighbour: int) -> bool:
        return neighbour in self._stages   # the next stage on this rank (or a V's turn)

    def _rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.n_stages, self.n_ranks, type(self).style)

    def _forward(self, s: int, mb: int) -> None:
        stage = self._stages[s]
        kwargs = self._mb_kwargs[mb] if self._mb_kwargs is not None else {}
        if s == 0:
            args = tuple(self._mb_args[mb])
            stage.check_shapes("input", [a for a in args if isinstance(a, torch.Tensor)])
            ins: list[torch.Tensor] = []
        else:
            x = self._act_in.pop((s, mb))
            args = (x,) if isinstance(x, torch.Tensor) else tuple(x)
            stage.check_shapes("input", args)
            ins = [t for t in args if t.requires_grad]
        self._inputs[(s, mb)] = ins
        if self._train and type(self).split_backward:
            captured: list = []
            handles = capture_leaf_outputs([stage.submod], captured)
            try:
                out = stage.submod(*args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
            self._pieces[(s, mb)] = exact_pieces(captured, stage.submod.parameters())
        else:
            out = stage.submod(*args, **kwargs)
        tensors, single = flatten(out, f"output of stage {s}")
        stage.check_shapes("output", tensors)
        if s == self.n_stages - 1:
            self._mb_outputs[mb] = _detach(out)
            target = self._mb_targets[mb] if self._mb_targets is not None else None
            if self._loss_fn is None or (target is None and not self._train):
                return
            loss = self._loss_fn(out, target, **getattr(self, "_loss_kwargs", {}))
            self._losses[mb] = loss.detach()
            if self._train:
                self._outputs[(s, mb)] = [loss]
            return
        self._out_meta[(s, mb)] = meta_of(tensors, single)
        self._outputs[(s, mb)] = [t for t in tensors if t.requires_grad]
        self._hand_off("act", s, mb, tensors, single)

    def _backward(self, s: int, mb: int) -> None:
        stage = self._stages[s]
        last = self._last_backward[s] == B(mb, s)
        # torch's rule for data parallelism inside a stage: accumulate unsynced gradients
        # and reduce once, in the stage's last backward of the step.
        fsdp = [mod for mod in stage.submod.modules() if isinstance(mod, FSDPModule)]
        for mod in fsdp:
            mod.set_requires_gradient_sync(last, recurse=False)
        if isinstance(stage.submod, FSDPModule):
            stage.submod.set_is_last_backward(last)
        outs = self._outputs.pop((s, mb))
        grads = None if s == self.n_stages - 1 else self._grad_in.pop((s, mb))
        if outs:
            torch.autograd.backward(outs, grads)
        if s > 0:
            ins = self._inputs.pop((s, mb))
            full = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]
            self._hand_off("grad", s, mb, full, False)
        else:
            self._inputs.pop((s, mb), None)


    def _blame(self, stage: int | None) -> None:
        self._fault_stage = stage   # the stage computing now: a failure is blamed on it

    def _hold_fsdp_sync(self) -> list[tuple[Any, Any, Any, Any]]:
        """Zero-bubble with ``fully_shard`` stages (as torch's runtime schedules do): keep every
        group's parameters gathered and its gradients unreduced for the whole step, since
        weight gradients (W) arrive after the backward that produced the input gradient (I)
        has ended. Returns each group with the settings to restore."""
        held = []
        for stage in self._stages.values():
            for mod in stage.submod.modules():
                if isinstance(mod, FSDPModule):
                    for g in mod._fsdp_groups(recurse=False):
                        held.append((g, g.reshard_after_forward, g.reshard_after_backward,
                                     g.requires_gradient_sync))
                        g.reshard_after_forward = False
                        g.reshard_after_backward = False
                        g.requires_gradient_sync = False
        return held

    def _release_fsdp_sync(self, held: list[tuple[Any, Any, Any, Any]]) -> None:
        """After the step's last W: reduce-scatter each stage's accumulated gradients once
        (every group of a fully_shard root, in the same order on every rank), then restore the
        groups' settings and reshard the ones that reshard after backward."""
        sync = [g for g, _, _, requires_sync in held if requires_sync]
        for g in sync:
            g.requires_gradient_sync = True
        contexts = {id(g.ctx): g.ctx for g in sync if getattr(g, "ctx", None) is not None}
        for ctx in contexts.values():
            ctx.sync_gradients()
        self._restore_fsdp(held)
        for g, _, after_backward, _ in held:
            if after_backward:
                g.reshard()

    @staticmethod
    def _restore_fsdp(held: list[tuple[Any, Any, Any, Any]]) -> None:
        for g, after_forward, after_backward, requires_sync in held:
            g.reshard_after_forward = after_forward
            g.reshard_after_backward = after_backward
            g.requires_gradient_sync = requires_sync

    def _backward_input(self, s: int, mb: int) -> None:
        """Zero-bubble ``I``: the stage input's gradient, sent upstream at once; the weight
        gradient waits for ``W`` (:mod:`hyperpar.pipeline.split_backward`)."""
        outs = self._outputs.pop((s, mb))
        grads = ([torch.ones_like(t) for t in outs] if s == self.n_stages - 1
                 else list(self._grad_in.pop((s, mb))))
        ins = self._inputs.pop((s, mb))
        pieces = self._pieces.pop((s, mb), [])
        got = input_gradients(outs, grads, ins, pieces)
        self._weight_work[(s, mb)] = (outs, grads, pieces)
        if s > 0:
            self._hand_off("grad", s, mb, got, False)

    def _backward_weight(self, s: int, mb: int) -> None:
        """Zero-bubble ``W``: accumulate the stage's parameter gradients for microbatch ``mb``."""
        outs, grads, pieces = self._weight_work.pop((s, mb))
        weight_gradients(outs, grads, pieces, list(self._stages[s].submod.parameters()))


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule with one stage per rank: ``Schedule(stage, n_microbatches, loss_fn=None,
    args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads=True)``
    as in torch (``dynamic_shapes=True``, hyperpar's addition, re-sends shapes every step)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, *,
                 dynamic_shapes: bool = False) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} takes one PipelineStage, got "
                            f"{type(stage).__name__}; use ScheduleInterleaved1F1B for "
                            f"several stages per rank")
        self._stage = stage
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads, dynamic_shapes)


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule with several stages per rank: ``Schedule(stages, n_microbatches, loss_fn=None,
    args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads=True)``."""

    multi = True

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, *,
                 dynamic_shapes: bool = False) -> None:
        # torch's keywords (torchtitan passes them): only their default behaviour exists here
        if backward_requires_autograd is not True:
            raise NotImplementedError(
                f"{type(self).__name__}(backward_requires_autograd={backward_requires_autograd!r})"
                ": hyperpar.pipelining runs each stage's backward through autograd; leave it "
                "True (torch's default)")
        if defer_pp_recv:
            raise NotImplementedError(
                f"{type(self).__name__}(defer_pp_recv=True) is not supported by "
                "hyperpar.pipelining; leave it False (torch's default)")
        if isinstance(stages, PipelineStage):
            stages = [stages]
        self._stages_list = list(stages)
        super().__init__(self._stages_list, n_microbatches, loss_fn, args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads, dynamic_shapes)


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards."""

    plan_fn = staticmethod(gpipe_plan)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: warm-up forwards, then one forward and one backward alternately."""

    plan_fn = staticmethod(one_f_one_b_plan)


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (Megatron-LM) over several stages per rank; ``n_microbatches`` below
    ``2 * ranks`` or a multiple of the rank count."""

    plan_fn = staticmethod(interleaved_1f1b_plan)


class _NotImplementedSchedule:
    """A torch schedule hyperpar.pipelining does not run; constructing it raises."""

    why = "it is not built"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"hyperpar.pipelining.{type(self).__name__} is not implemented: {self.why}. Use "
            f"ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble / "
            f"ScheduleInterleavedZeroBubble")


class ScheduleLoopedBFS(_NotImplementedSchedule):
    """Not implemented: every microbatch through stage ``r`` before stage ``r + p`` makes
    the last rank send activations back to a rank still sending its own, which deadlocks
    when a send waits for its receive (the rendezvous model every plan here is checked
    against, NCCL's included). :func:`looped_bfs_plan` is kept to show it."""

    why = ("its plan deadlocks under rendezvous sends (see looped_bfs_plan and "
           "hyperpar.pipeline.check_plans)")


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved zero-bubble: interleaved 1F1B's stages and order with each backward split
    into the input gradient (sent at once) and the weight gradient (deferred into the waits);
    see :func:`hyperpar.pipeline.interleaved_zero_bubble_plan`."""

    plan_fn = staticmethod(interleaved_zero_bubble_plan)
    split_backward = True


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """Zero-bubble V: exactly two stages per rank, rank ``r`` holding stages ``r`` and
    ``2p - 1 - r`` (so the loss is computed on rank 0), backward split into input and weight
    gradients; see :func:`hyperpar.pipeline.zbv_plan`."""

    plan_fn = staticmethod(zbv_plan)
    split_backward = True
    style = "v"


class ScheduleDualPipeV(_NotImplementedSchedule):
    """Not implemented (raises :class:`NotImplementedError` naming the alternatives): DualPipeV
    exists to overlap one microbatch's forward with another's backward on separate streams,
    which hyperpar's executor does not do; ``ScheduleZBVZeroBubble`` runs the same V placement
    with split backwards."""

    why = ("it overlaps one microbatch's forward with another's backward on separate streams, "
           "which hyperpar's executor does not do (ScheduleZBVZeroBubble runs the same V "
           "placement)")


class _PipelineScheduleRuntime(_NotImplementedSchedule):
    """torch's runtime for a schedule read from a CSV file (``pipeline_parallel_schedule_csv``);
    not implemented: constructing it raises."""

    why = "schedules read from a CSV action list are not run"


_SCHEDULE_NAMES: dict[str, type] = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


def get_schedule_class(schedule_name: str) -> type:
    """The schedule class for ``schedule_name`` (case-insensitive), as torch's function of the
    same name; an unknown name raises ``ValueError`` listing the valid ones."""
    by_lower = {k.lower(): v for k, v in _SCHEDULE_NAMES.items()}
    cls = by_lower.get(str(schedule_name).lower())
    if cls is None:
        raise ValueError(f"Unknown schedule name {schedule_name!r}. The valid options are "
                         f"{list(_SCHEDULE_NAMES)}")
    return cls
