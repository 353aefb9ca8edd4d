"""Forward/backward hooks of fully_shard modules and the per-root context they share.

The root (the outermost fully_shard module, found at its first forward) owns a
:class:`RootContext`: the order in which groups ran forward (recorded on the first forward and
used to prefetch the next group's all-gather), the reduce-scatters in flight, and the
end-of-backward callback that waits for them, writes the sharded gradients and reshards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ._group import ParamGroup


def _graph_task_id() -> int:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


class RootContext:
    """State shared by every fully_shard group under one root module."""

    def __init__(self, root: ParamGroup, groups: list[ParamGroup]) -> None:
        self.root = root
        self.groups = groups
        self.order: list[ParamGroup] = []
        self.order_done = False
        self.implicit_prefetch = True
        self.forward_prefetch: dict[int, list[ParamGroup]] = {}
        self.backward_prefetch: dict[int, list[ParamGroup]] = {}
        self.reductions: list[tuple[ParamGroup, Any, torch.Tensor]] = []
        self.callback_queued = False
        self.is_last_backward = True
        for g in groups:
            g.ctx = self

    # ------------------------------------------------------------------ prefetch
    def record(self, group: ParamGroup) -> None:
        if self.order_done:
            return
        if group in self.order:  # forward order wrapped around (next microbatch / step)
            self.order_done = True
        else:
            self.order.append(group)

    def _neighbour(self, group: ParamGroup, step: int) -> list[ParamGroup]:
        if not self.implicit_prefetch or not self.order_done or group not in self.order:
            return []
        i = self.order.index(group) + step
        return [self.order[i]] if 0 <= i < len(self.order) else []

    def prefetch_forward(self, group: ParamGroup) -> None:
        for nxt in self.forward_prefetch.get(id(group)) or self._neighbour(group, 1):
            nxt.unshard(async_op=True)

    def prefetch_backward(self, group: ParamGroup) -> None:
        for prev in self.backward_prefetch.get(id(group)) or self._neighbour(group, -1):
            if prev is not self.root:
                prev.unshard(async_op=True)

    # ------------------------------------------------------------------ reductions
    def add_reduction(self, group: ParamGroup, work: Any, out: torch.Tensor) -> None:
        # keep one reduce-scatter in flight: it overlaps the next group's backward, and
        # finished buffers are freed instead of piling up to a whole model's gradients
        self.drain()
        self.reductions.append((group, work, out))

    def drain(self) -> None:
        pending, self.reductions = self.reductions, []
        for group, work, out in pending:
            group.finish_reduction(work, out)

    def ensure_final_callback(self) -> None:
        if self.callback_queued:
            return
        self.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of a backward pass: reduce what was not reduced yet (groups whose last grads
        came late or not at all), wait for every reduction, reshard every group."""
        self.callback_queued = False
        for group in self.groups:
            if group.used_in_backward and not group.reduced_in_backward:
                group.post_backward()
        self.drain()
        for group in self.groups:
            if group.reshard_after_backward:
                group.reshard()
            group.end_backward()

    def sync_gradients(self) -> None:
        """Reduce-scatter the gradients accumulated under no-sync now (every group, in the
        same order on every rank)."""
        for group in self.groups:
            if group.params:
                group.reduce_grads()
        self.drain()


def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def outside_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run eagerly even when called from code that ``torch.compile`` traces.

    fully_shard's hooks swap parameters, launch and wait on collectives and keep Python state
    across modules: tracing them breaks graphs, builds ``nn.Parameter`` inside the graph and
    recompiles on every step. Kept out of the trace (as torch FSDP2 keeps its hooks), a
    compiled module's ``_call_impl`` runs them eagerly and its ``forward`` compiles as a frame
    of its own: one graph per block, no graph break, the same parameter objects every step.
    Importing dynamo here costs nothing extra in training: ``torch.optim`` imports it too."""
    return torch.compiler.disable(fn, recursive=True)


class Hooks:
    """Forward pre/post hooks of one fully_shard module (``pre_forward`` and
    ``post_forward`` are the versions kept out of ``torch.compile``'s trace)."""

    def __init__(self, module: nn.Module, group: ParamGroup) -> None:
        self.module = module
        self.group = group
        self.pre_forward = outside_compile(self._pre_forward)
        self.post_forward = outside_compile(self._post_forward)

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        group = self.group
        ctx = group.ctx
        if group is ctx.root and ctx.reductions and _graph_task_id() == -1:
            ctx.drain()  # a backward that raised left reductions behind
        ctx.record(group)
        group.unshard()
        ctx.prefetch_forward(group)
        if group.mp.cast_forward_inputs and group.mp.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), group.mp.param_dtype)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        group = self.group
        ctx = group.ctx
        if group is ctx.root:
            ctx.order_done = True
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        # a list group reshards after the last of its modules ran
        group.forward_count += 1
        if group.forward_count >= len(group.modules):
            group.forward_count = 0
            # reshard_after_forward=None: the root keeps its parameters for backward; without
            # autograd there is no backward to free them, so it reshards too (an optimizer
            # step may come before the next forward)
            rf = group.reshard_after_forward
            if rf is None:
                rf = group is not ctx.root or not torch.is_grad_enabled()
            if rf:
                group.reshard()
        return _cast(output, group.mp.output_dtype)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        group = self.group
        ctx = group.ctx
        ctx.ensure_final_callback()
        if not group.used_in_backward:
            group.unshard()
            group.begin_backward()
            ctx.prefetch_backward(group)
        return grad
