"""Peak bytes of live tensor storage in one process, for ``hyperpar plan --measure`` on a device
whose allocator keeps no statistics (the cpu).

:class:`LiveBytes` is a ``TorchDispatchMode``: every op's outputs register their storage (once,
by a weak reference, so a storage shared by views counts once and leaves when its last tensor
dies); after every op it sums the current size of every live storage, so storages resized in
place (fully_shard's unsharded parameters grow and shrink with ``storage.resize_``) are counted
at their size of the moment. Tensors that exist before the mode starts (parameters, gradients,
optimizer states) are added with :meth:`LiveBytes.track`. Bytes that no tensor owns (the
allocator's slack, a communication library's own buffers) are not counted. Imports torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as lb: ...``; then ``lb.peak`` (bytes) and ``lb.current``."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.peak = 0

    def track(self, tensors: Iterable[Any]) -> None:
        """Count ``tensors`` (plain or DTensor; ``None`` skipped) from now on."""
        for t in tensors:
            if t is None:
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            if isinstance(local, torch.Tensor):
                self._add(local)
        self._sample()

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._live:
            self._live[key] = weakref.ref(storage, lambda _, k=key: self._live.pop(k, None))

    @property
    def current(self) -> int:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def _sample(self) -> None:
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self._sample()
        return out
