"""Point-to-point transfer of stage activations and gradients between MindSpore ranks.

Every message is a fixed-size int64 header followed by the data tensors. The header carries the
tensors' dtypes and shapes (so shapes may change from step to step) -- or, in place of data, a
failure notice: a stage that raises sends one to every peer still waiting for a message from it,
and the peer raises :class:`~hyperpar.pipeline._faults.PipelineStageError` naming the stage, the
rank and the error. MindSpore has no rendezvous store for torch's way of doing it (see
:mod:`hyperpar.pipeline._faults`); the notice rides in the channel the peer is reading.

Sends are posted with ``isend`` and waited at the end of the step; receives are waited at once,
in channel order (a header never overtakes earlier data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms

from hyperpar.pipeline._faults import PipelineStageError
from hyperpar.platform import get_platform
from hyperpar.platform.base import P2POp

HEADER = 128   # int64 slots: status, stage, rank, then tensors (or the error text)
_OK, _FAIL = 0, 1
_DTYPES = [ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int64, ms.int32, ms.int16,
           ms.int8, ms.uint8, ms.bool_]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def _header(values: Sequence[int]) -> ms.Tensor:
    buf = [0] * HEADER
    buf[:len(values)] = [int(v) for v in values]
    return ms.Tensor(buf, ms.int64)


def encode_meta(tensors: Sequence[Any], single: bool, stage: int, rank: int) -> ms.Tensor:
    """The header announcing ``tensors`` (a stage's output or input gradients)."""
    out = [_OK, stage, rank, int(single), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"pipeline P2P cannot carry dtype {t.dtype}; supported: {_DTYPES}")
        out += [_CODE[t.dtype], len(t.shape), *t.shape]
    if len(out) > HEADER:
        raise ValueError(f"a value crossing pipeline stages has too many tensors or dimensions "
                         f"for the {HEADER}-slot header ({len(out)} needed); pack it into fewer "
                         f"tensors")
    return _header(out)


def encode_failure(stage: int, rank: int, error: str) -> ms.Tensor:
    """A failure notice: ``error`` (truncated to fit) from ``stage`` on global rank ``rank``."""
    text = error.encode("utf-8", "replace")[:HEADER - 4]
    return _header([_FAIL, stage, rank, len(text), *text])


def decode(header: ms.Tensor) -> tuple[bool, list[tuple[Any, tuple[int, ...]]]]:
    """``(single, [(dtype, shape), ...])``; a failure notice raises PipelineStageError."""
    v = [int(x) for x in header.asnumpy()]
    if v[0] == _FAIL:
        text = bytes(v[4:4 + v[3]]).decode("utf-8", "replace")
        raise PipelineStageError(f"stage {v[1]} (rank {v[2]}) failed: {text}", stage=v[1],
                                 rank=v[2])
    single, n, i, metas = bool(v[3]), v[4], 5, []
    for _ in range(n):
        code, nd = v[i], v[i + 1]
        metas.append((_DTYPES[code], tuple(v[i + 2:i + 2 + nd])))
        i += 2 + nd
    return single, metas


class MindSporeP2P:
    """Sends and receives of one pipeline (``stage_ranks[i]``: global rank of pipeline rank i)."""

    def __init__(self, stage_ranks: Sequence[int]) -> None:
        self.stage_ranks = list(stage_ranks)
        self.platform = get_platform()
        self._pending: list[tuple[Any, list[Any]]] = []

    def send(self, tensors: Sequence[Any], single: bool, peer: int, stage: int) -> None:
        """Post ``tensors`` (header first) to pipeline rank ``peer``; waited in
        :meth:`wait_sends`."""
        rank = self.platform.rank()
        header = encode_meta(tensors, single, stage, rank)
        data = [header, *(t.contiguous() for t in tensors)]
        dst = self.stage_ranks[peer]
        works = self.platform.batch_isend_irecv([P2POp("send", t, dst, None) for t in data])
        self._pending += [(w, data) for w in works]

    def send_failure(self, peer: int, stage: int, error: str) -> None:
        """Tell pipeline rank ``peer`` (waiting for our next message) that ``stage`` failed."""
        header = encode_failure(stage, self.platform.rank(), error)
        dst = self.stage_ranks[peer]
        works = self.platform.batch_isend_irecv([P2POp("send", header, dst, None)])
        self._pending += [(w, [header]) for w in works]

    def recv(self, peer: int) -> tuple[list[Any], bool]:
        """The next message from pipeline rank ``peer``: ``(tensors, single)``."""
        src = self.stage_ranks[peer]
        header = ms.ops.zeros((HEADER,), ms.int64)
        for w in self.platform.batch_isend_irecv([P2POp("recv", header, src, None)]):
            w.wait()
        single, metas = decode(header)
        bufs = [ms.ops.zeros(shape, dtype) for dtype, shape in metas]
        works = self.platform.batch_isend_irecv([P2POp("recv", b, src, None) for b in bufs])
        for w in works:
            w.wait()
        return bufs, single

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for w, _ in pending:
            w.wait()

    def drop_sends(self) -> None:
        """Forget the posted sends after a failure (their peers may never receive them)."""
        self._pending = []
