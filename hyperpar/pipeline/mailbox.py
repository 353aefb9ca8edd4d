"""Routing of stage activations and gradients between pipeline stages, written once.

Both pipeline front ends -- the DeepSpeed-style executor (:mod:`hyperpar.pipeline.executor`) and
torch's ``pipelining`` schedules (:mod:`hyperpar.pipelining.schedules`) -- run the same plans of
``Comm`` steps. This mixin holds what they share: handing a stage's outputs (or input gradients)
to the neighbour stage, locally when that stage lives on this rank and through the outbox and
:class:`~hyperpar.pipeline.p2p.P2P` otherwise, and posting one step's sends and receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.platform.health import P2P_COUNTER

from .p2p import P2P, Meta
from .schedules import Action, Backward, BackwardInput, BackwardWeight, Comm, Forward


def as_leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A detached copy of ``t`` that starts a new graph (requiring grad where it can)."""
    t = t.detach()
    return t.requires_grad_() if requires_grad and (t.is_floating_point() or t.is_complex()) \
        else t


class StageMailbox:
    """Inboxes and outbox of one rank's stages; subclasses say which stages are local.

    A subclass sets ``_p2p``, ``_act_in``, ``_grad_in``, ``_out_meta``, ``_outbox``,
    ``_fault_stage`` and ``_fault_peers`` before a step, and implements :meth:`_stage_ranks`
    and :meth:`_is_local`.
    """

    _p2p: P2P
    _act_in: dict[tuple[int, int], Any]
    _grad_in: dict[tuple[int, int], list[torch.Tensor]]
    _out_meta: dict[tuple[int, int], Meta]
    _outbox: dict[Comm, tuple[Sequence[torch.Tensor], bool]]
    _fault_stage: int | None
    _fault_peers: list[int]
    n_ranks: int

    def _stage_ranks(self) -> Sequence[int]:
        """Global rank of each pipeline rank (index = pipeline rank)."""
        raise NotImplementedError

    def _is_local(self, stage: int, neighbour: int) -> bool:
        """Whether ``neighbour`` runs on the same rank as ``stage``."""
        raise NotImplementedError

    def _run(self, action: Action) -> None:
        """One compute action; the subclass implements ``_forward``, ``_backward`` and, for
        zero-bubble plans, ``_backward_input`` / ``_backward_weight``."""
        if isinstance(action, Forward):
            self._forward(action.stage, action.mb)
        elif isinstance(action, Backward):
            self._backward(action.stage, action.mb)
        elif isinstance(action, BackwardInput):
            self._backward_input(action.stage, action.mb)
        elif isinstance(action, BackwardWeight):
            self._backward_weight(action.stage, action.mb)
        else:
            raise TypeError(f"unknown action {action!r}")

    def _rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage`` (torch's loop layout unless overridden)."""
        return stage % self.n_ranks

    def _communicate(self, comms: Sequence[Comm]) -> None:
        """Post one step's sends and receives together and file what arrived."""
        sends, recvs = [], []
        ranks = self._stage_ranks()
        # The peers a failure would wait on (receives first: a send completes in the background).
        self._fault_peers = [ranks[c.peer] for c in sorted(comms, key=lambda c: c.kind != "recv")]
        for c in comms:
            P2P_COUNTER.enter(c.kind, ranks[c.peer])
            if c.kind == "send":
                self._fault_stage = c.stage   # a send raising locally (shape change) is ours
                tensors, single = self._outbox.pop(c)
                sends.append((c, tensors, single))
            elif c.what == "act":
                recvs.append((c, None))
            else:  # gradient for our stage c.stage - 1's outputs: shapes known locally
                meta = self._out_meta[(c.stage - 1, c.mb)]
                recvs.append((c, Meta(False, tuple(t for t in meta.tensors
                                                   if t.requires_grad))))
        got = self._p2p.exchange(sends, recvs)
        for c, bufs in got.items():
            if c.what == "act":
                meta = self._p2p.meta(c)
                leaves = [as_leaf(b, t.requires_grad)
                          for b, t in zip(bufs, meta.tensors, strict=True)]
                self._act_in[(c.stage + 1, c.mb)] = leaves[0] if meta.single else tuple(leaves)
            else:
                self._grad_in[(c.stage - 1, c.mb)] = bufs
        self._fault_peers = []

    def _hand_off(self, what: str, stage: int, mb: int, tensors: Sequence[torch.Tensor],
                  single: bool) -> None:
        """Deliver to the neighbour stage: locally if it is on this rank, else via the outbox."""
        nxt = stage + 1 if what == "act" else stage - 1
        if self._is_local(stage, nxt):
            if what == "act":
                leaves = [as_leaf(t, t.requires_grad) for t in tensors]
                self._act_in[(nxt, mb)] = leaves[0] if single else tuple(leaves)
            else:
                self._grad_in[(nxt, mb)] = list(tensors)
            return
        self._outbox[Comm("send", what, mb, stage, self._rank_of(nxt))] = (tensors, single)
