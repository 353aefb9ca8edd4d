"""SimPlatform: one process is rank ``r`` of a world of ``n`` (any ``n``); nothing is sent.

Use it to run the real ``parallelize_module`` / ``fully_shard`` / pipeline code for a large mesh
in one process -- build the model on the ``meta`` device so no memory is spent -- and read the
exact local shards and the collectives each step would issue::

    from hyperpar_sim import simulate
    with simulate(world=1024, rank=0) as sim:
        mesh = init_device_mesh((128, 8), mesh_dim_names=("dp", "tp"))
        ...                                   # the real hyperpar calls
        sim.records                           # [CollectiveRecord(op, nbytes, group), ...]
        sim.volume_by_dim(mesh)               # {"dp": bytes, "tp": bytes}

What "right-shaped" means: every collective leaves its output with the shape and dtype the
contract gives. On ``meta`` tensors there are no values. On real tensors the values are what a
world of identical ranks would produce (all-gather repeats this rank's input, reduce-scatter
returns this rank's rows of the input, all-reduce and broadcast leave the tensor as it is;
sum-reductions are *not* multiplied by the group size), so numerics are not simulated.
Received point-to-point buffers are left untouched.

Recorded ``nbytes``: all-reduce and broadcast: the tensor; all-gather: the output (the full
gathered tensor); reduce-scatter: the input (the full tensor); all-to-all: the input;
send/recv: the message. Not supported: ``all_gather_object`` with differing objects
(every rank is assumed to hold this rank's object).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hyperpar.platform import Availability, P2POp
from hyperpar.platform.torch_platform import HostDevicePlatform

WORLD_ENV, RANK_ENV = "HYPERPAR_SIM_WORLD", "HYPERPAR_SIM_RANK"


@dataclass(frozen=True)
class SimGroup:
    """A process group of the simulation: just its global ranks."""

    ranks: tuple[int, ...]

    def __repr__(self) -> str:
        if len(self.ranks) > 6:
            return f"SimGroup({self.ranks[:3]}...{self.ranks[-1]}, n={len(self.ranks)})"
        return f"SimGroup({self.ranks})"


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank would have issued."""

    op: str
    nbytes: int
    group: tuple[int, ...]


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SimPlatform(HostDevicePlatform):
    """Rank ``HYPERPAR_SIM_RANK`` of a world of ``HYPERPAR_SIM_WORLD`` (or what
    :func:`simulate` / ``init_process_group(rank=, world_size=)`` set), in one process."""

    name = "sim"
    device_type = "meta"  # the platform's device: fully_shard's buffers cost nothing
    dist_backend = "none"
    priority = -100  # never auto-selected
    visible_devices_env = None
    traceable_collectives = False

    def __init__(self) -> None:
        super().__init__()
        self._world: int | None = None
        self._rank = 0
        self.records: list[CollectiveRecord] = []

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True)

    # ------------------------------------------------------------------ world and groups
    def init_process_group(self, *, rank=None, world_size=None, init_method=None,
                           timeout_s=None) -> None:
        if self._world is not None:
            return
        world = world_size if world_size is not None else int(os.environ.get(WORLD_ENV, "1"))
        me = rank if rank is not None else int(os.environ.get(RANK_ENV, "0"))
        if world < 1 or not 0 <= me < world:
            raise ValueError(f"sim: rank {me} of world {world} is impossible; set {WORLD_ENV} "
                             f">= 1 and 0 <= {RANK_ENV} < {WORLD_ENV} (or use "
                             "hyperpar_sim.simulate(world=, rank=))")
        self._world, self._rank = int(world), int(me)
        self._groups.clear()

    def destroy_process_group(self) -> None:
        self._world = None
        self._groups.clear()

    def is_initialized(self) -> bool:
        return self._world is not None

    def _require(self) -> int:
        if self._world is None:
            raise RuntimeError("sim: no world yet; call init_process_group(rank=, world_size=) "
                               "or use hyperpar_sim.simulate(world=, rank=)")
        return self._world

    def new_group(self, ranks: Sequence[int]) -> SimGroup:
        world = self._require()
        key = tuple(int(r) for r in ranks)
        if len(set(key)) != len(key):
            raise ValueError(f"new_group: duplicate ranks in {list(key)}")
        bad = [r for r in key if not 0 <= r < world]
        if bad:
            raise ValueError(f"new_group: ranks {bad} outside the world (size {world})")
        return self._groups.setdefault(key, SimGroup(key))

    def _members(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(self._require()))
        return group.ranks

    def rank(self, group: Any = None) -> int:
        members = self._members(group)
        return members.index(self._rank) if self._rank in members else -1

    def world_size(self, group: Any = None) -> int:
        return len(self._members(group))

    def group_ranks(self, group: Any = None) -> list[int]:
        return list(self._members(group))

    def _record(self, op: str, nbytes: int, group: Any) -> _Done:
        self.records.append(CollectiveRecord(op, int(nbytes), self._members(group)))
        return _Done()

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        work = self._record("all_reduce", _nbytes(tensor), group)
        return work if async_op else None

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        n = self.world_size(group)
        if output.shape[0] != n * input.shape[0] or output.shape[1:] != input.shape[1:]:
            raise ValueError(f"all_gather_into_tensor: output {tuple(output.shape)} is not "
                             f"{n} x input {tuple(input.shape)} along dim 0")
        if output.device.type != "meta":
            with torch.no_grad():
                output.detach().copy_(input.detach().repeat(n, *([1] * (input.ndim - 1))))
        work = self._record("all_gather", _nbytes(output), group)
        return work if async_op else None

    def reduce_scatter_tensor(self, output, input, op="sum", group=None, async_op=False):
        n = self.world_size(group)
        if input.shape[0] != n * output.shape[0] or output.shape[1:] != input.shape[1:]:
            raise ValueError(f"reduce_scatter_tensor: input {tuple(input.shape)} is not "
                             f"{n} x output {tuple(output.shape)} along dim 0")
        if output.device.type != "meta":
            me = max(self.rank(group), 0)
            with torch.no_grad():
                output.detach().copy_(input.detach().chunk(n)[me])
        work = self._record("reduce_scatter", _nbytes(input), group)
        return work if async_op else None

    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None, group=None, async_op=False):
        if output.device.type != "meta" and output.shape == input.shape:
            with torch.no_grad():
                output.detach().copy_(input.detach())
        work = self._record("all_to_all", _nbytes(input), group)
        return work if async_op else None

    def broadcast(self, tensor, src, group=None, async_op=False):
        work = self._record("broadcast", _nbytes(tensor), group)
        return work if async_op else None

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Any]:
        works = []
        for p in ops:
            self.records.append(CollectiveRecord(p.kind, _nbytes(p.tensor),
                                                 tuple(sorted({self._rank, p.peer}))))
            works.append(_Done())
        return works

    def send(self, tensor, dst, group=None, tag=0) -> None:
        self.batch_isend_irecv([P2POp("send", tensor, dst, group, tag)])

    def recv(self, tensor, src, group=None, tag=0) -> None:
        self.batch_isend_irecv([P2POp("recv", tensor, src, group, tag)])

    def isend(self, tensor, dst, group=None, tag=0):
        return self.batch_isend_irecv([P2POp("send", tensor, dst, group, tag)])[0]

    def irecv(self, tensor, src, group=None, tag=0):
        return self.batch_isend_irecv([P2POp("recv", tensor, src, group, tag)])[0]

    def barrier(self, group=None) -> None:
        self._record("barrier", 0, group)

    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        return [obj] * self.world_size(group)

    def broadcast_object(self, obj: Any, src: int, group: Any = None) -> Any:
        return obj

    def collective_fallbacks(self) -> dict[str, str]:
        return {"all collectives": "simulated: shapes only, nothing is communicated"}

    # ------------------------------------------------------------------ reading the records
    def volume_by_dim(self, mesh: Any, ops: Sequence[str] | None = None) -> dict[str, int]:
        """Recorded bytes per mesh dim name of ``mesh``. A collective belongs to the dim whose
        group it ran on; a send or receive to the dim whose group holds both ends (pipeline
        messages: ``pp``). Anything else is reported under its rank tuple's repr. ``ops``
        filters by op name (``"send"``: what this rank sends)."""
        names = {}
        for i, name in enumerate(mesh.mesh_dim_names or ()):
            names[tuple(mesh._group_ranks[i])] = name
        out: dict[str, int] = {}
        for r in self.records:
            if ops is not None and r.op not in ops:
                continue
            key = names.get(r.group)
            if key is None and r.op in ("send", "recv"):
                key = next((n for g, n in names.items() if set(r.group) <= set(g)), None)
            if key is None:
                key = repr(SimGroup(r.group))
            out[key] = out.get(key, 0) + r.nbytes
        return out


@contextmanager
def simulate(world: int, rank: int = 0) -> Iterator[SimPlatform]:
    """Select the sim backend (``hyperpar.set_backend``) as rank ``rank`` of ``world`` for the
    block; afterwards the selection is reset (found again from ``HYPERPAR_BACKEND`` or
    auto-detection on next use)."""
    from hyperpar.platform import reset, set_backend

    pf = set_backend("sim")
    assert isinstance(pf, SimPlatform)
    pf.destroy_process_group()
    pf.records.clear()
    pf.init_process_group(rank=rank, world_size=world)
    try:
        yield pf
    finally:
        pf.destroy_process_group()
        set_backend(None)
        reset()
