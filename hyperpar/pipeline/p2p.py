"""Point-to-point transfer of stage activations and gradients, through the Platform only.

Shapes and dtypes travel once per (kind, stage, microbatch) -- as a small int64 header ahead of
the data -- and are cached on both sides; ``dynamic_shapes=True`` sends them every time. Every
batch of sends and receives is posted together; receives are waited at once, sends at the end of
the step. A plan that passes the rendezvous model of
:func:`hyperpar.pipeline.schedules.check_plans` therefore cannot deadlock here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyperpar.platform import get_platform
from hyperpar.platform.base import Group

from .schedules import Comm

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient flows back for one tensor crossing a stage."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Meta:
    """What one stage hands the next: a single tensor (``single``) or a tuple of tensors."""

    single: bool
    tensors: tuple[TensorMeta, ...]

    def encode(self, device: torch.device) -> torch.Tensor:
        out = [int(self.single), len(self.tensors)]
        for t in self.tensors:
            out += [_CODE[t.dtype], int(t.requires_grad), len(t.shape), *t.shape]
        return torch.tensor(out, dtype=torch.int64, device=device)

    @staticmethod
    def decode(buf: torch.Tensor) -> Meta:
        v = buf.tolist()
        single, n, i, tensors = bool(v[0]), v[1], 2, []
        for _ in range(n):
            code, rg, nd = v[i], v[i + 1], v[i + 2]
            tensors.append(TensorMeta(tuple(v[i + 3:i + 3 + nd]), _DTYPES[code], bool(rg)))
            i += 3 + nd
        return Meta(single, tuple(tensors))


def flatten(value: Any, where: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(tensors, single)`` for a tensor or a tuple/list of tensors; anything else raises."""
    if isinstance(value, torch.Tensor):
        return (value,), True
    if isinstance(value, tuple | list) and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value), False
    raise TypeError(
        f"{where}: a value crossing pipeline stages must be a tensor or a tuple of tensors, got "
        f"{type(value).__name__}"
        + (f" holding {[type(t).__name__ for t in value]}" if isinstance(value, tuple | list)
           else "")
    )


def meta_of(tensors: Sequence[torch.Tensor], single: bool) -> Meta:
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"pipeline P2P cannot carry dtype {t.dtype}; supported: {_DTYPES}")
    return Meta(single, tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
                              for t in tensors))


class P2P:
    """Batched sends/receives between pipeline ranks (``stage_ranks[i]`` is pipeline rank i)."""

    def __init__(self, group: Group, stage_ranks: Sequence[int], dynamic_shapes: bool = False):
        self.group = group
        self.stage_ranks = list(stage_ranks)
        self.dynamic_shapes = dynamic_shapes
        self._sent_meta: dict[tuple[str, int, int], Meta] = {}
        self._recv_meta: dict[tuple[str, int, int], Meta] = {}
        self._pending_sends: list[tuple[Any, list[torch.Tensor]]] = []

    def exchange(self, sends: Sequence[tuple[Comm, Sequence[torch.Tensor], bool]],
                 recvs: Sequence[tuple[Comm, Meta | None]]) -> dict[Comm, list[torch.Tensor]]:
        """Post ``sends`` (comm, tensors, single) and ``recvs`` (comm, known meta or None to
        receive it) together; wait for the receives and return their tensors. Sends complete
        in the background (:meth:`wait_sends` at the end of a step), which only relaxes the
        rendezvous model the schedules are checked against."""
        from hyperpar.platform.base import P2POp

        platform = get_platform()
        device = platform.device()
        ops: list[P2POp] = []
        keep: list[torch.Tensor] = []
        for comm, tensors, single in sends:
            peer = self.stage_ranks[comm.peer]
            key = (comm.what, comm.stage, comm.mb)
            meta = meta_of(tensors, single) if comm.what == "act" else None
            if meta is not None and not self.dynamic_shapes and key in self._sent_meta \
                    and self._sent_meta[key] != meta:
                raise ValueError(
                    f"stage {comm.stage} output for microbatch {comm.mb} changed from "
                    f"{[t.shape for t in self._sent_meta[key].tensors]} to "
                    f"{[t.shape for t in meta.tensors]} since the last step; shapes are sent "
                    f"once -- create the schedule with dynamic_shapes=True when they vary"
                )
            if meta is not None and (self.dynamic_shapes or key not in self._sent_meta):
                header = meta.encode(device)
                size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
                keep += [size, header]
                ops += [P2POp("send", size, peer, self.group), P2POp("send", header, peer,
                                                                     self.group)]
                self._sent_meta[key] = meta
            for t in tensors:
                t = t.detach().contiguous()
                keep.append(t)
                ops.append(P2POp("send", t, peer, self.group))
        send_works = platform.batch_isend_irecv(ops) if ops else []
        self._pending_sends += [(w, keep) for w in send_works]
        works: list[Any] = []
        out: dict[Comm, list[torch.Tensor]] = {}
        for comm, meta in recvs:  # in channel order: a header must not overtake earlier data
            peer = self.stage_ranks[comm.peer]
            key = (comm.what, comm.stage, comm.mb)
            if meta is None:
                meta = None if self.dynamic_shapes else self._recv_meta.get(key)
                if meta is None:
                    size = torch.empty(1, dtype=torch.int64, device=device)
                    platform.recv(size, peer, self.group)
                    header = torch.empty(int(size.item()), dtype=torch.int64, device=device)
                    platform.recv(header, peer, self.group)
                    meta = Meta.decode(header)
                    self._recv_meta[key] = meta
            bufs = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in meta.tensors]
            out[comm] = bufs
            works += platform.batch_isend_irecv([P2POp("recv", b, peer, self.group)
                                                 for b in bufs])
        for w in works:
            w.wait()
        return out

    def wait_sends(self) -> None:
        """Wait for every send posted so far (their buffers are kept alive until then)."""
        pending, self._pending_sends = self._pending_sends, []
        for w, _ in pending:
            w.wait()

    def meta(self, comm: Comm) -> Meta:
        return self._recv_meta[(comm.what, comm.stage, comm.mb)]
