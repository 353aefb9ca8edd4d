"""The MindSpore platform's process groups and collectives, over ``mindspore.mint.distributed``.

Where MindSpore has no kernel for the target (on CPU: all-gather into one tensor, reduce-scatter,
all-to-all) the collective is composed from ones that exist (:data:`CPU_COMPOSITIONS`, listed by
``hyperpar info``). Only the member ranks of a group may create MindSpore's group:
``new_group`` keeps hyperpar's contract (every rank calls it with the same ranks) and creates it
on the members only. :class:`MindSporeCollectives` is this part of
:class:`~hyperpar_mindspore.platform.MindSporePlatform`; it imports MindSpore only when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyperpar.platform.base import REDUCE_OPS, Group, P2POp, Work

from .runtime import _world_group_name
from .runtime import load_dist as _dist
from .runtime import load_mindspore as _ms
from .tensors import copy_tensor
from .tensors import rows as _rows

#: Collectives MindSpore has no CPU kernel for, and how the platform composes them.
CPU_COMPOSITIONS = {
    "all_gather_into_tensor": "list all_gather, then concatenate along dim 0",
    "reduce_scatter_tensor": "all_reduce of a copy, then this rank's slice",
    "all_to_all_single": "all_gather of the (padded) inputs, then select this rank's pieces",
    "reduce op 'avg'": "sum, then divide by the group size",
    "all_to_all_single_autograd": "the composed all_to_all_single in a Cell whose bprop runs "
                                  "it with the split lists swapped (no AlltoAllV CPU kernel)",
}

#: CPU reduce-scatter takes the point-to-point ring from ``RING_MIN_BYTES * n**2`` input bytes
#: on: each of its ``n - 1`` steps costs a round trip, so small inputs are faster through the
#: all-reduce composition. Measured (MindSpore 2.10, 2 cores), ring / all-reduce time: n=2
#: 1.51 at 16 KiB, 0.88 at 256 KiB, 0.73 at 4 MiB; n=4 1.68 at 256 KiB, 0.98 at 4 MiB, 0.73 at
#: 16 MiB.
RING_MIN_BYTES = 256 * 1024


@dataclass(frozen=True)
class MSGroup:
    """A process group: its global ranks and, on member ranks, MindSpore's group name."""

    ranks: tuple[int, ...]
    name: str | None


class _DoneWork:
    """Handle of a collective that already completed (composed collectives run eagerly)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class MindSporeCollectives:
    """Groups, ranks and collectives of the MindSpore platform (mixed into
    :class:`~hyperpar_mindspore.platform.MindSporePlatform`, which joins the world and sets the
    state read here)."""

    target: str
    _initialized: bool
    _rank: int
    _world: int
    _groups: dict[tuple[int, ...], MSGroup]

    def new_group(self, ranks: Sequence[int]) -> MSGroup:
        """Group of ``ranks`` (every rank calls it; only members create MindSpore's group)."""
        key = tuple(int(r) for r in ranks)
        if key not in self._groups:
            if sorted(set(key)) != sorted(key) or any(not 0 <= r < self._world for r in key):
                raise ValueError(f"new_group: ranks {list(key)} must be distinct ranks of the "
                                 f"world 0..{self._world - 1}")
            name = None
            if key == tuple(range(self._world)):
                name = None if self._world == 1 else _world_group_name()
            elif self._rank in key:
                name = _dist().new_group(list(key))
            self._groups[key] = MSGroup(key, name)
        return self._groups[key]

    def _ranks(self, group: Group) -> tuple[int, ...]:
        if not self._initialized:  # a world size of 1 here would be silently wrong under a launcher
            raise RuntimeError("the MindSpore platform has not joined a process group: call "
                               "get_platform().init_process_group() (init_device_mesh does) "
                               "before asking for ranks or running collectives")
        return tuple(range(self._world)) if group is None else group.ranks

    def rank(self, group: Group = None) -> int:
        ranks = self._ranks(group)
        return ranks.index(self._rank) if self._rank in ranks else -1

    def world_size(self, group: Group = None) -> int:
        return len(self._ranks(group))

    def group_ranks(self, group: Group = None) -> list[int]:
        return list(self._ranks(group))

    def _name(self, group: Group, what: str) -> str | None:
        if group is None:
            return None
        if self._rank not in group.ranks:
            raise ValueError(f"{what}: rank {self._rank} is not a member of the group of ranks "
                             f"{list(group.ranks)}; only members may call its collectives")
        return group.name

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group = None,
                   async_op: bool = False) -> Work | None:
        _check_op(op)
        n = self.world_size(group)
        if n == 1:
            return _DoneWork() if async_op else None
        name = self._name(group, "all_reduce")
        from mindspore.ops import ReduceOp

        native = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX,
                  "min": ReduceOp.MIN, "product": ReduceOp.PROD}[op]
        work = _dist().all_reduce(tensor, native, group=name, async_op=async_op and op != "avg")
        if op == "avg":
            tensor.copy_(tensor / n)
            return _DoneWork() if async_op else None
        return work

    def gather_list(self, tensor: Any, group: Group, what: str) -> list[Any]:
        """Every rank's ``tensor`` (equal shapes), in group-rank order: MindSpore's native list
        all-gather, the building block of the composed collectives. ``what`` names the caller
        in errors."""
        n = self.world_size(group)
        if n == 1:
            return [tensor]
        name = self._name(group, what)
        out = [_ms().mint.empty_like(tensor) for _ in range(n)]
        _dist().all_gather(out, tensor, group=name)
        return out

    def all_gather_into_tensor(self, output: Any, input: Any, group: Group = None,
                               async_op: bool = False) -> Work | None:
        n = self.world_size(group)
        if tuple(output.shape) != (n * input.shape[0], *input.shape[1:]):
            raise ValueError(f"all_gather_into_tensor: output shape {tuple(output.shape)} must be "
                             f"({n} * {input.shape[0]}, *{tuple(input.shape[1:])})")
        output.copy_(_ms().mint.cat(self.gather_list(input, group, "all_gather_into_tensor")))
        return _DoneWork() if async_op else None

    def reduce_scatter_tensor(self, output: Any, input: Any, op: str = "sum",
                              group: Group = None, async_op: bool = False) -> Work | None:
        _check_op(op)
        n = self.world_size(group)
        rows = output.shape[0]
        if tuple(input.shape) != (n * rows, *output.shape[1:]):
            raise ValueError(f"reduce_scatter_tensor: input shape {tuple(input.shape)} must be "
                             f"({n} * {rows}, *{tuple(output.shape[1:])})")
        if n == 1:
            output.copy_(input)
        elif self.target == "CPU" and input.nbytes >= RING_MIN_BYTES * n * n:
            output.copy_(self._ring_reduce_scatter(input, rows, op, group))
        else:
            total = copy_tensor(input)
            self.all_reduce(total, op, group)
            output.copy_(_rows(total, self.rank(group) * rows, rows))
        return _DoneWork() if async_op else None

    def _ring_reduce_scatter(self, input: Any, rows: int, op: str, group: Group) -> Any:
        """This rank's reduced rows by a ring of point-to-point exchanges: ``n - 1`` steps,
        each sending one ``rows`` block to the next rank and adding the block received from
        the previous one, so a rank sends ``(n - 1) / n`` of the input. MindSpore's CPU build
        has no ReduceScatter kernel; the all-reduce composition it replaces moved the whole
        input and took 1.6-2x as long for 4-16 MiB on 2 ranks (measured, MindSpore 2.10)."""
        ranks = self._ranks(group)
        n, me = len(ranks), ranks.index(self._rank)
        nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]
        combine = {"sum": _ms().mint.add, "avg": _ms().mint.add,
                   "max": _ms().mint.maximum, "min": _ms().mint.minimum,
                   "product": _ms().mint.mul}[op]
        send = _rows(input, ((me - 1) % n) * rows, rows)
        for step in range(n - 1):
            recv = _ms().ops.zeros_like(send)
            ops = [P2POp("send", send, nxt, group), P2POp("recv", recv, prev, group)]
            # even ranks send first, odd ones receive first: no cycle of blocked sends
            for work in self.batch_isend_irecv(ops if me % 2 == 0 else ops[::-1]):
                work.wait()
            block = (me - step - 2) % n
            send = combine(recv, _rows(input, block * rows, rows))
        return send / n if op == "avg" else send

    def all_to_all_single(self, output: Any, input: Any,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: Group = None,
                          async_op: bool = False) -> Work | None:
        mint = _ms().mint
        n, me = self.world_size(group), self.rank(group)
        sends = _splits(input_split_sizes, input.shape[0], n, "input")
        _splits(output_split_sizes, output.shape[0], n, "output")
        # Every rank learns every rank's split table, pads its input to the longest, gathers.
        table = self.gather_list(_ms().Tensor(sends, _ms().int64), group, "all_to_all_single")
        table = [[int(v) for v in row.asnumpy()] for row in table]
        longest = max(sum(row) for row in table)
        padded = input
        if input.shape[0] < longest:
            pad = mint.zeros((longest - input.shape[0], *input.shape[1:]), dtype=input.dtype)
            padded = mint.cat([input, pad])
        pieces = []
        for src, data in enumerate(self.gather_list(padded, group, "all_to_all_single")):
            start = sum(table[src][:me])
            pieces.append(_rows(data, start, table[src][me]))
        got = mint.cat(pieces) if pieces else output
        if tuple(got.shape) != tuple(output.shape):
            raise ValueError(f"all_to_all_single: received {tuple(got.shape)} rows in total but "
                             f"output has shape {tuple(output.shape)}; check output_split_sizes")
        output.copy_(got)
        return _DoneWork() if async_op else None

    def broadcast(self, tensor: Any, src: int, group: Group = None,
                  async_op: bool = False) -> Work | None:
        if self.world_size(group) == 1:
            return _DoneWork() if async_op else None
        return _dist().broadcast(tensor, src, group=self._name(group, "broadcast"),
                                 async_op=async_op)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        dist = _dist()
        works = []
        for op in ops:
            name = self._name(op.group, f"{op.kind} to/from rank {op.peer}")
            call = dist.isend if op.kind == "send" else dist.irecv
            works.append(call(op.tensor, op.peer, group=name, tag=op.tag))
        return works

    def barrier(self, group: Group = None) -> None:
        if self.world_size(group) > 1:
            _dist().barrier(group=self._name(group, "barrier"))

    # ------------------------------------------------------------------ object collectives
    def all_gather_object(self, obj: Any, group: Group = None) -> list[Any]:
        """Picklable ``obj`` from every rank of ``group``, in group-rank order."""
        if self.world_size(group) == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size(group)
        _dist().all_gather_object(out, obj, group=self._name(group, "all_gather_object"))
        return out

    def broadcast_object(self, obj: Any, src: int, group: Group = None) -> Any:
        """Picklable ``obj`` of global rank ``src``, returned on every rank."""
        if self.world_size(group) == 1:
            return obj
        box = [obj]
        _dist().broadcast_object_list(box, src, group=self._name(group, "broadcast_object"))
        return box[0]

    def collective_fallbacks(self) -> dict[str, str]:
        if self.target == "CPU":
            return dict(CPU_COMPOSITIONS)
        return {"reduce op 'avg'": CPU_COMPOSITIONS["reduce op 'avg'"]}


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")


def _splits(sizes: Sequence[int] | None, rows: int, n: int, what: str) -> list[int]:
    if sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all_single: {what} has {rows} rows, not divisible by the "
                             f"group size {n}; pass {what}_split_sizes")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"all_to_all_single: {what}_split_sizes {sizes} must be {n} "
                         f"non-negative counts summing to the {rows} rows of {what}")
    return sizes
