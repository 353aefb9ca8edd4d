"""Gradient buckets: pack gradients into one flat buffer, reduce it with one async collective.

Shared by the replicated :func:`~hyperpar.parallel.data_parallel.data_parallel` (one row per
bucket, all-reduced) and ``fully_shard`` (one row per shard rank, reduce-scattered). A bucket is
a ``[rows, width]`` buffer; a gradient owns the columns ``[offset, offset + padded)`` and its
flattened values fill that column block row by row, the rest zero (fully_shard pads every
rank's piece to the same length; data_parallel has one row and no padding).

Averaging is folded into packing: where the collective library has no native ``avg`` (gloo),
each gradient is multiplied by ``1/n`` as it is copied in and the bucket is summed -- one pass
over the data instead of a copy, a sum and a division.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.platform import get_platform

from .bucket_plan import averaging

__all__ = ["Bucket", "averaging", "pack"]


def pack(block: torch.Tensor, grad: torch.Tensor | None, scale: float | None) -> None:
    """Write ``grad`` (flattened, times ``scale``) row-major into the ``[rows, padded]`` column
    block of a bucket, zeros after it (or everywhere when ``grad`` is None)."""
    if grad is None:
        block.zero_()
        return
    rows, padded = block.shape
    flat = grad.reshape(-1)
    full, rest = divmod(flat.numel(), padded)
    if full > rows or (full == rows and rest):
        raise ValueError(f"gradient of {flat.numel()} elements does not fit a "
                         f"[{rows}, {padded}] bucket block")
    if full:
        _copy(block[:full], flat[:full * padded].view(full, padded), scale)
    if rest:
        _copy(block[full, :rest], flat[full * padded:], scale)
        block[full, rest:].zero_()
        full += 1
    if full < rows:
        block[full:].zero_()


def _copy(dst: torch.Tensor, src: torch.Tensor, scale: float | None) -> None:
    if scale is None:
        dst.copy_(src)
    else:
        torch.mul(src, scale, out=dst)  # copy, cast and scale in one pass


class Bucket:
    """A ``[rows, width]`` gradient buffer and the async collective that reduces it."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device,
                 group: Any) -> None:
        self.rows, self.width = rows, width
        self.dtype, self.device = dtype, device
        self.group = group
        self.buffer: torch.Tensor | None = None
        self.work: Any = None
        self.launched = False

    def allocate(self) -> torch.Tensor:
        """The buffer of this round (a fresh one per round: gradients handed out as views of
        the last round's buffer stay the caller's)."""
        if self.buffer is None:
            self.buffer = torch.empty(self.rows, self.width, dtype=self.dtype,
                                      device=self.device)
        return self.buffer

    def block(self, offset: int, padded: int) -> torch.Tensor:
        """The ``[rows, padded]`` column block of the gradient at ``offset``."""
        return self.allocate()[:, offset:offset + padded]

    def all_reduce(self, op: str) -> None:
        """Launch the all-reduce of the whole buffer (async)."""
        platform = get_platform()
        self.work = platform.all_reduce(self.allocate(), op=op, group=self.group,
                                        async_op=True)
        self.launched = True

    def reduce_scatter(self, op: str) -> torch.Tensor:
        """Launch the reduce-scatter (row ``r`` to rank ``r``; async); returns this rank's
        ``[width]`` output, valid after :meth:`wait`."""
        platform = get_platform()
        out = torch.empty(self.width, dtype=self.dtype, device=self.device)
        buf = self.allocate()
        if self.rows == 1:
            out.copy_(buf[0])
        else:
            self.work = platform.reduce_scatter_tensor(out, buf.view(-1), op=op,
                                                       group=self.group, async_op=True)
        self.launched = True
        return out

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def reset(self) -> None:
        """Wait for an outstanding collective and forget this round's buffer."""
        self.wait()
        self.buffer = None
        self.launched = False
