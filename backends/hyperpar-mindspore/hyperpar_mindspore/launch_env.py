"""Who this process is, read from whichever launcher started it (no MindSpore import).

=====================  ==========================================================================
launcher               variables it sets (what hyperpar reads them as)
=====================  ==========================================================================
``hyperpar run``       ``MS_ROLE``, ``MS_NODE_ID`` and ``RANK`` (rank), ``MS_WORKER_NUM`` and
                       ``WORLD_SIZE`` (world), ``LOCAL_RANK`` and ``DEVICE_ID`` (local rank,
                       device), ``LOCAL_WORLD_SIZE``
``msrun``              ``MS_ROLE``, ``MS_NODE_ID`` and ``RANK_ID`` (rank), ``MS_WORKER_NUM`` and
                       ``RANK_SIZE`` (world), ``DEVICE_ID`` (device = local rank); no local world
torchrun-style         ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
(hyperpar's harness)   ``MASTER_ADDR``/``MASTER_PORT``
``python script.py``   none: a world of one on device 0
=====================  ==========================================================================

The device a rank pins is ``DEVICE_ID``, else ``LOCAL_RANK``, else 0 -- so under msrun, which sets
no ``LOCAL_RANK``, each rank still takes its own Ascend/GPU device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as its launcher described it."""

    launcher: str  # "hyperpar run", "msrun", "torchrun-style" or "none"
    rank: int
    world_size: int
    local_rank: int
    device_id: int
    local_world_size: int | None  # None where the launcher does not say (msrun)


def _int(env: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            if not value.lstrip("-").isdigit() or int(value) < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer; fix the "
                                 f"launcher's environment (or unset {name})")
            return int(value)
    return default


def read_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """The :class:`LaunchEnv` ``env`` (usually ``os.environ``) describes. Raises ``ValueError``
    naming the variable when one is malformed or a rank lies outside the world."""
    if "MS_ROLE" in env:
        launcher = "hyperpar run" if "HYPERPAR_MS_PARENT" in env else "msrun"
    elif "RANK" in env or "WORLD_SIZE" in env:
        launcher = "torchrun-style"
    else:
        launcher = "none"
    rank = _int(env, ("MS_NODE_ID", "RANK_ID", "RANK"), 0)
    world = _int(env, ("MS_WORKER_NUM", "RANK_SIZE", "WORLD_SIZE"), 1)
    local_rank = _int(env, ("LOCAL_RANK", "DEVICE_ID"), 0)
    device_id = _int(env, ("DEVICE_ID", "LOCAL_RANK"), 0)
    local_world = _int(env, ("LOCAL_WORLD_SIZE",), None)
    assert rank is not None and world is not None and local_rank is not None
    assert device_id is not None
    if world < 1 or rank >= world:
        raise ValueError(f"the launcher says rank {rank} of a world of {world} ({launcher}); "
                         f"the rank must be below the world size -- check MS_NODE_ID/RANK_ID/RANK "
                         f"against MS_WORKER_NUM/RANK_SIZE/WORLD_SIZE")
    return LaunchEnv(launcher, rank, world, local_rank, device_id, local_world)


def ranks_needed_here(launch: LaunchEnv) -> int:
    """How many devices this host must show for this rank to get its own: the local world size
    where the launcher says it, else (msrun) this rank's device id + 1 -- never the whole world,
    which would refuse a multi-node job."""
    if launch.local_world_size is not None:
        return launch.local_world_size
    return launch.device_id + 1
