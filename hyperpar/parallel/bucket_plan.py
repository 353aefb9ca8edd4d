"""The framework-neutral half of data parallelism: which gradients share a bucket, which
collective averages them, and which group they are averaged over.

Written once here and used by the PyTorch :func:`~hyperpar.parallel.data_parallel.data_parallel`
(``_bucket.py`` adds torch's tensor mechanics) and the MindSpore one
(``hyperpar_mindspore.data_parallel``). Imports no framework.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from hyperpar.platform import get_platform

__all__ = ["FIRST_BUCKET_BYTES", "averaging", "plan_buckets", "resolve_group"]

#: DDP's rule: the first bucket (the last layers' gradients, ready first) is small, so its
#: all-reduce starts early in backward and overlaps the rest of it.
FIRST_BUCKET_BYTES = 1024 * 1024


def averaging(group: Any, divisor: int | None = None) -> tuple[str, float | None]:
    """``(op, scale)`` that averages over ``group`` (or divides by ``divisor``, e.g. the whole
    HSDP world when the replicas' sum follows): the library's ``avg`` when native and the
    divisor is the group's size, else ``sum`` of inputs pre-multiplied by ``scale``."""
    platform = get_platform()
    n = platform.world_size(group)
    divisor = n if divisor is None else divisor
    if divisor == n and "reduce op 'avg'" not in platform.collective_fallbacks():
        return "avg", None
    return "sum", (None if divisor == 1 else 1.0 / divisor)


def plan_buckets(items: Sequence[tuple[Hashable, int]], cap_bytes: int,
                 first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group gradients into buckets: ``items`` is one ``(key, nbytes)`` per parameter in
    registration order (``key``: what must match within a bucket, e.g. dtype and device);
    returns each bucket's item indices, buckets in launch order.

    Gradients arrive roughly in reverse registration order, so buckets fill from the end; a
    bucket closes once its bytes reach ``cap_bytes`` (the first one: at most
    ``first_cap_bytes``); partly filled buckets close last, one per key."""
    buckets: list[list[int]] = []
    current: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    for i in reversed(range(len(items))):
        key, nbytes = items[i]
        current.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + nbytes
        cap = min(cap_bytes, first_cap_bytes) if not buckets else cap_bytes
        if sizes[key] >= cap:
            buckets.append(current.pop(key))
            sizes[key] = 0
    buckets.extend(idx for idx in current.values() if idx)
    return buckets


def resolve_group(mesh: Any = None, dim: str | int | None = "dp", group: Any = None) -> Any:
    """The process group of mesh dimension ``dim`` (resolved by ``mesh.get_mesh(dim,
    default="dp")``: an unnamed 1-D mesh needs no name), or ``group`` as given, or the world
    group when neither is given."""
    if group is not None:
        if mesh is not None:
            raise ValueError("data_parallel: pass either mesh= (with dim=) or group=, not both")
        return group
    if mesh is None:
        return None
    return mesh.get_mesh(dim, default="dp").get_group()
