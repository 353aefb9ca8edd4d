"""Executors: run a schedule's plan on a :class:`~hyperpar.pipeline.PipelineModule`.

The plan (pure data, see :mod:`hyperpar.pipeline.schedules`) is lowered to batches of sends and
receives plus compute actions, checked for deadlock once per shape of the pipeline, and then
replayed by :meth:`PipelineSchedule.step`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ._faults import pipeline_step
from .mailbox import StageMailbox
from .mailbox import as_leaf as _leaf
from .module import PipelineModule
from .p2p import P2P, Meta, flatten, meta_of
from .runner import StepTimings, run_program
from .schedules import (
    Action,
    Comm,
    PlanFn,
    Step,
    bubble_fraction_theory,
    choose_lowering,
    forward_only_program,
    gpipe_plan,
    interleaved_1f1b_plan,
    one_f_one_b_plan,
    rank_program,
    zero_bubble_plan,
)
from .split_backward import (
    capture_leaf_outputs,
    exact_pieces,
    input_gradients,
    weight_gradients,
)


def split_microbatches(value: Any, n: int, dim: int = 0) -> list[Any]:
    """Split tensors (recursively inside tuples, lists and dicts) into ``n`` chunks along
    ``dim`` (``torch.tensor_split``: sizes differ by at most one); other values are repeated."""
    if isinstance(value, torch.Tensor):
        if value.dim() <= dim or value.shape[dim] < n:
            raise ValueError(
                f"cannot split a tensor of shape {tuple(value.shape)} into {n} microbatches "
                f"along dim {dim}: it needs at least {n} rows there. Use fewer microbatches or "
                f"a larger batch."
            )
        return list(torch.tensor_split(value, n, dim=dim))
    if isinstance(value, tuple | list):
        parts = [split_microbatches(v, n, dim) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(n)]
    if isinstance(value, dict):
        parts = {k: split_microbatches(v, n, dim) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(n)]
    return [value] * n


def merge_microbatches(chunks: Sequence[Any], dim: int = 0) -> Any:
    """Inverse of :func:`split_microbatches` for tensors and tuples of tensors."""
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(chunks), dim=dim)
    if isinstance(first, tuple | list):
        return type(first)(merge_microbatches([c[i] for c in chunks], dim)
                           for i in range(len(first)))
    return first


@dataclass
class _Unit:
    layers: list[int]
    ins: list[torch.Tensor]          # leaves of the unit's input that require grad
    outs: list[torch.Tensor]         # unit outputs that require grad
    grads: list[torch.Tensor] | None = None
    # finer split: (output of a parameter-owning submodule, its own parameters, grad)
    leaves: list[list[Any]] = field(default_factory=list)


class PipelineSchedule(StageMailbox):
    """Base executor; subclasses set :attr:`plan_fn`.

    ``PipelineSchedule(module, n_microbatches, *, loss_fn=None, batch_dim=0,
    dynamic_shapes=None)`` (``None``: the module's ``dynamic_shape``).
    ``step(*args, target=None, losses=None, **kwargs)`` splits
    ``args``/``kwargs`` (used on the rank holding stage 0) and ``target`` (used on the rank
    holding the last stage) into microbatches along ``batch_dim``, runs forward and backward,
    and returns the loss of the whole batch on the last stage's rank (``None`` elsewhere).

    Each microbatch loss is weighted by its share of the batch, so the gradients equal those
    of one large batch for a loss that averages over the batch (``mean`` reduction). Gradients
    accumulate into ``.grad`` like ``loss.backward()``; tied-weight gradients are summed over
    their owning stages at the end of the step.
    """

    plan_fn: ClassVar[PlanFn]
    one_stage_per_rank: ClassVar[bool] = True
    split_backward: ClassVar[bool] = False

    def __init__(self, module: PipelineModule, n_microbatches: int, *,
                 loss_fn: Any = None, batch_dim: int = 0,
                 dynamic_shapes: bool | None = None) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"{type(self).__name__} drives a PipelineModule, got "
                            f"{type(module).__name__}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        if self.one_stage_per_rank and module.virtual_stages != 1:
            raise ValueError(
                f"{type(self).__name__} runs one stage per rank but the module has "
                f"virtual_stages={module.virtual_stages}; use ScheduleInterleaved1F1B"
            )
        self.module = module
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn if loss_fn is not None else module.loss_fn
        if self.loss_fn is None:
            raise ValueError(f"{type(self).__name__}: no loss function; pass loss_fn= to the "
                             f"schedule or to PipelineModule")
        self.batch_dim = batch_dim
        if dynamic_shapes is None:   # PipelineModule(dynamic_shape=...) decides
            dynamic_shapes = bool(getattr(module, "dynamic_shape", False))
        #: multiplies every loss before backward (the engine's fp16 loss scale); 1.0 = off
        self.grad_scale = 1.0
        self.n_stages = module.total_stages
        self.n_ranks = module.num_stages
        plan_fn = type(self).plan_fn
        self.fuse = choose_lowering(plan_fn, self.n_stages, n_microbatches, self.n_ranks)
        self._plan = plan_fn(self.n_stages, n_microbatches, module.stage_id, self.n_ranks)
        self.program: list[Step] = rank_program(plan_fn, self.n_stages, n_microbatches,
                                                module.stage_id, self.n_ranks, fuse=self.fuse)
        self._train_p2p = P2P(module.group, module.stage_ranks, dynamic_shapes)
        self._eval_p2p = P2P(module.group, module.stage_ranks, dynamic_shapes)
        self._eval_program: list[Step] | None = None
        self.last_timings = StepTimings()

    # ------------------------------------------------------------------ introspection
    def plan(self) -> list[Action]:
        """This rank's compute actions for one step."""
        return list(self._plan)

    def bubble_fraction_theory(self) -> float:
        return bubble_fraction_theory(self.n_ranks, self.n_microbatches,
                                      self.module.virtual_stages)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(stages={self.n_stages}, ranks={self.n_ranks}, "
                f"microbatches={self.n_microbatches})")

    # ------------------------------------------------------------------ step
    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
             return_outputs: bool = False, **kwargs: Any) -> Any:
        """One training step over ``n_microbatches`` microbatches; see the class docstring.
        ``losses`` (a list) receives the unweighted per-microbatch losses; with
        ``return_outputs=True`` the last stage returns ``(loss, outputs)``, the model outputs
        merged back along ``batch_dim`` (detached)."""
        return self._execute(self.program, self._train_p2p, True,
                             *self._split(args, kwargs, target), losses, return_outputs)

    def eval_step(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
                  return_outputs: bool = False, **kwargs: Any) -> Any:
        """Forward only, without gradients: the batch loss on the last stage (``None`` without a
        ``target``), or ``(loss, outputs)`` with ``return_outputs=True``; ``None`` elsewhere."""
        with torch.no_grad():
            return self._execute(self._forward_program(), self._eval_p2p, False,
                                 *self._split(args, kwargs, target), losses, return_outputs)

    def _forward_program(self) -> list[Step]:
        if self._eval_program is None:
            self._eval_program = forward_only_program(self.n_stages, self.n_microbatches,
                                                      self.module.stage_id, self.n_ranks)
        return self._eval_program

    def run_microbatches(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, *,
                         train: bool = True, losses: list[Any] | None = None,
                         return_outputs: bool = False) -> Any:
        """Like :meth:`step` (``train=True``) or :meth:`eval_step`, on microbatches already
        split: ``inputs[i]`` is microbatch ``i``'s input to layer 0 (a tensor or a tuple, needed
        on the rank holding stage 0), ``targets[i]`` its target (on the last stage's rank, or
        ``None``). Every microbatch loss weighs ``1 / n_microbatches`` (DeepSpeed's mean)."""
        m = self.n_microbatches
        for what, seq in (("inputs", inputs), ("targets", targets)):
            if seq is not None and len(seq) != m:
                raise ValueError(f"run_microbatches: {len(seq)} {what} for a schedule of {m} "
                                 f"microbatches")
        mb_args = [(x,) for x in inputs] if inputs is not None else None
        mb_kwargs = [{} for _ in range(m)] if inputs is not None else None
        split = (mb_args, mb_kwargs, list(targets) if targets is not None else None, [1.0 / m] * m)
        if not train:
            with torch.no_grad():
                return self._execute(self._forward_program(), self._eval_p2p, False, *split,
                                     losses, return_outputs)
        return self._execute(self.program, self._train_p2p, True, *split, losses, return_outputs)

    def _split(self, args: tuple, kwargs: dict, target: Any) -> tuple:
        """Per-microbatch args, kwargs, targets and loss weights (share of the batch)."""
        mod, m, last = self.module, self.n_microbatches, self.n_stages - 1
        mb_args = mb_kwargs = mb_targets = None
        if 0 in mod.local_stages:
            if not args:
                raise ValueError("step(): the rank holding stage 0 needs the model inputs")
            mb_args = split_microbatches(args, m, self.batch_dim)
            mb_kwargs = split_microbatches(kwargs, m, self.batch_dim)
        weights = [1.0 / m] * m
        if last in mod.local_stages and target is not None:
            mb_targets = split_microbatches(target, m, self.batch_dim)
            if isinstance(target, torch.Tensor):
                total = target.shape[self.batch_dim]
                weights = [t.shape[self.batch_dim] / total for t in mb_targets]
        return mb_args, mb_kwargs, mb_targets, weights

    def _execute(self, program: list[Step], p2p: P2P, train: bool, mb_args: list | None,
                 mb_kwargs: list | None, mb_targets: list | None, weights: list[float],
                 losses: list[Any] | None, return_outputs: bool) -> Any:
        mod, m, last = self.module, self.n_microbatches, self.n_stages - 1
        t_step = time.perf_counter()
        timings = StepTimings()
        if 0 in mod.local_stages and mb_args is None:
            raise ValueError("step(): the rank holding stage 0 needs the model inputs")
        self._args, self._kwargs, self._targets = mb_args, mb_kwargs, mb_targets
        self._weights = weights
        self._inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._units: dict[tuple[int, int], list[_Unit]] = {}
        self._act_in: dict[tuple[int, int], Any] = {}
        self._grad_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._outbox: dict[Comm, tuple[Sequence[torch.Tensor], bool]] = {}
        self._out_meta: dict[tuple[int, int], Meta] = {}
        self._losses: list[torch.Tensor | None] = [None] * m
        self._keep_outputs = return_outputs
        self._mb_outputs: list[Any] = [None] * m
        self._p2p, self._train = p2p, train
        self._fault_stage: int | None = None
        self._fault_peers: list[int] = []
        with pipeline_step(mod, lambda: self._fault_stage, lambda: self._fault_peers):
            stash = mod._stash_tied_gradients() if train else []
            run_program(program, self._communicate, self._run, timings, self._blame)
            t0 = time.perf_counter()
            self._fault_peers = list(mod.stage_ranks)   # any of them may be the one missing
            self._p2p.wait_sends()
            if train:
                mod.allreduce_tied_gradients()
                mod._restore_tied_gradients(stash)
            self._fault_peers = []
            timings.comm_s += time.perf_counter() - t0
        timings.step_s = time.perf_counter() - t_step
        self.last_timings = timings
        if last not in mod.local_stages:
            return None
        mb_losses = [loss for loss in self._losses if loss is not None]
        if losses is not None:
            losses.extend(mb_losses)
        loss = (sum(loss * w for loss, w in zip(mb_losses, self._weights, strict=True))
                if mb_losses else None)
        if return_outputs:
            return loss, merge_microbatches(self._mb_outputs, self.batch_dim)
        return loss

    def _blame(self, stage: int | None) -> None:
        self._fault_stage = stage   # the stage computing now: a failure is blamed on it

    # ------------------------------------------------------------------ communication
    def _stage_ranks(self) -> Sequence[int]:
        return self.module.stage_ranks

    def _is_local(self, stage: int, neighbour: int) -> bool:
        return neighbour % self.n_ranks == stage % self.n_ranks   # a one-rank pipeline

    # ------------------------------------------------------------------ compute
    def _forward(self, stage: int, mb: int) -> None:
        mod = self.module
        kwargs: dict[str, Any] = {}
        if stage == 0:
            args = self._args[mb]
            x = args[0] if len(args) == 1 else tuple(args)
            kwargs = self._kwargs[mb]
        else:
            x = self._act_in.pop((stage, mb))
        ins, _ = flatten(x, f"input of stage {stage}") if stage > 0 else ((), True)
        self._inputs[(stage, mb)] = [t for t in ins if t.requires_grad]
        if self.split_backward and self._train:
            out = self._forward_units(stage, mb, x, kwargs)
        else:
            out = mod.forward_stage(stage, x, **kwargs)
        if stage == self.n_stages - 1:
            if self._keep_outputs:
                self._mb_outputs[mb] = (out.detach() if isinstance(out, torch.Tensor) else
                                        type(out)(t.detach() for t in out))
            target = self._targets[mb] if self._targets is not None else None
            if not self._train:
                if target is not None:
                    self._losses[mb] = self.loss_fn(out, target).detach()
                return
            if target is None and self._loss_needs_target():
                raise ValueError(
                    f"step(): no target for microbatch {mb} on the rank holding the last stage "
                    f"({stage}), but loss_fn {getattr(self.loss_fn, '__qualname__', self.loss_fn)}"
                    f" takes one; pass target= to step() (or targets to run_microbatches) there")
            loss = self.loss_fn(out, target) if target is not None else self.loss_fn(out)
            self._losses[mb] = loss.detach()
            scaled = loss * (self._weights[mb] * self.grad_scale)
            self._outputs[(stage, mb)] = [scaled]
            if self.split_backward:
                self._units[(stage, mb)][-1].outs = [scaled]
            return
        tensors, single = flatten(out, f"output of stage {stage}")
        self._out_meta[(stage, mb)] = meta_of(tensors, single)
        self._outputs[(stage, mb)] = [t for t in tensors if t.requires_grad]
        self._hand_off("act", stage, mb, tensors, single)

    def _loss_needs_target(self) -> bool:
        """True when ``loss_fn`` cannot be called with the output alone."""
        needs = getattr(self, "_needs_target", None)
        if needs is None:
            try:
                inspect.signature(self.loss_fn).bind(None)
                needs = False
            except TypeError:
                needs = True
            except ValueError:   # no signature to inspect (a builtin): let the call decide
                needs = False
            self._needs_target = needs
        return needs

    def _output_grads(self, stage: int, mb: int) -> list[torch.Tensor] | None:
        if stage == self.n_stages - 1:
            return None
        return self._grad_in.pop((stage, mb))

    def _send_input_grads(self, stage: int, mb: int, grads: Sequence[torch.Tensor | None]
                          ) -> None:
        if stage == 0:
            return
        ins = self._inputs.pop((stage, mb))
        full = [g if g is not None else torch.zeros_like(t)
                for g, t in zip(grads, ins, strict=True)]
        self._hand_off("grad", stage, mb, full, False)

    def _backward(self, stage: int, mb: int) -> None:
        outs = self._outputs.pop((stage, mb))
        grads = self._output_grads(stage, mb)
        if outs:
            torch.autograd.backward(outs, grads)
        ins = self._inputs.get((stage, mb), [])
        self._send_input_grads(stage, mb, [t.grad for t in ins])
        self._inputs.pop((stage, mb), None)

    # zero-bubble: forward unit by unit so each unit's weight gradient can run on its own
    def _forward_units(self, stage: int, mb: int, x: Any, kwargs: dict[str, Any]) -> Any:
        mod = self.module
        units: list[_Unit] = []
        ins = list(self._inputs[(stage, mb)])
        for j, layers in enumerate(mod.stage_units(stage)):
            if j > 0:
                if isinstance(x, torch.Tensor):
                    x = _leaf(x, x.requires_grad)
                    ins = [x] if x.requires_grad else []
                elif isinstance(x, tuple | list):
                    x = type(x)(_leaf(t, t.requires_grad) if isinstance(t, torch.Tensor) else t
                                for t in x)
                    ins = [t for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
            captured: list[tuple[torch.nn.Module, torch.Tensor, int]] = []
            handles = self._capture_leaves(layers, captured)
            try:
                out = mod.run_unit(layers, x, **(kwargs if j == 0 else {}))
            finally:
                for h in handles:
                    h.remove()
            outs = ([out] if isinstance(out, torch.Tensor) else
                    [t for t in out if isinstance(t, torch.Tensor)]
                    if isinstance(out, tuple | list) else [])
            unit = _Unit(layers, ins, [t for t in outs if t.requires_grad])
            unit.leaves = self._leaf_split(layers, captured)
            units.append(unit)
            x = out
        self._units[(stage, mb)] = units
        return x

    def _capture_leaves(self, layers: list[int], captured: list) -> list[Any]:
        """Hooks recording the output of every submodule that owns parameters directly."""
        if self.module.activation_checkpoint_interval:
            return []   # recomputed units: keep the per-unit split
        return capture_leaf_outputs((top for i in layers for top in self.module._layer_modules[i]),
                                    captured)

    def _leaf_split(self, layers: list[int], captured: list) -> list[list[Any]]:
        """Per-submodule weight-gradient pieces, or ``[]`` when the unit cannot be split
        exactly: then the whole unit's weight gradient runs as one piece."""
        return exact_pieces(captured, self.module.unit_parameters(layers))

    def _backward_input(self, stage: int, mb: int) -> None:
        units = self._units[(stage, mb)]
        self._outputs.pop((stage, mb))
        grads = self._output_grads(stage, mb)
        if grads is None:   # last stage: the (scaled) loss
            grads = [torch.ones_like(t) for t in units[-1].outs]
        for unit in reversed(units):
            unit.grads = list(grads)
            grads = input_gradients(unit.outs, unit.grads, unit.ins, unit.leaves)
        self._send_input_grads(stage, mb, grads)
        self._inputs.pop((stage, mb), None)

    def _backward_weight(self, stage: int, mb: int) -> None:
        for unit in self._units.pop((stage, mb)):
            weight_gradients(unit.outs, unit.grads or [], unit.leaves,
                             self.module.unit_parameters(unit.layers))


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards. Any microbatch count."""

    plan_fn = staticmethod(gpipe_plan)


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-flush): same bubble as GPipe, at most ``p - rank`` microbatches'
    activations alive. Any microbatch count."""

    plan_fn = staticmethod(one_f_one_b_plan)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B over ``PipelineModule(..., virtual_stages=v)``: bubble about ``v``
    times smaller. Microbatch count below ``2p`` or a multiple of ``p``."""

    plan_fn = staticmethod(interleaved_1f1b_plan)
    one_stage_per_rank = False


class ScheduleZeroBubble(PipelineSchedule):
    """Zero-bubble (ZB-H1 style): backward split into input-gradient and deferred
    weight-gradient actions, run per layer (per checkpoint unit when checkpointing)."""

    plan_fn = staticmethod(zero_bubble_plan)
    split_backward = True


def get_schedule_class(name: str) -> type[PipelineSchedule]:
    """Schedule class by name (``"gpipe"``, ``"1f1b"``, ``"interleaved1f1b"``,
    ``"zerobubble"``; case and ``_``/``-`` ignored)."""
    table = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved1f1b": ScheduleInterleaved1F1B, "zerobubble": ScheduleZeroBubble,
             "zb": ScheduleZeroBubble, "zbh1": ScheduleZeroBubble}
    key = name.lower().replace("_", "").replace("-", "").replace("schedule", "")
    if key not in table:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(table)}")
    return table[key]


