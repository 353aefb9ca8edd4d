"""The MindSpore process runtime under the platform: which target this process runs on, the
thread and launch settings, where the graph compiler writes, MindSpore's scheduler process for a
world started without ``msrun``, and the world group's name that ``mint.distributed`` caches.

The bottom of the backend: imports no other module of it, and MindSpore only when called (the
backend is listed and probed without the import).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from typing import Any

#: Targets hyperpar knows, by the name MindSpore's ``set_device`` takes.
TARGETS = ("CPU", "Ascend", "GPU")
TARGET_ENV = "HYPERPAR_MS_DEVICE"
# How the library is called per target (MindSpore's own name on CPU is its "MCCL").
_LIBRARY = {"CPU": "mccl", "Ascend": "hccl", "GPU": "nccl"}


def load_mindspore() -> Any:
    """``mindspore``, imported on first use."""
    import mindspore

    return mindspore


def load_dist() -> Any:
    """``mindspore.mint.distributed``, imported on first use."""
    import mindspore.mint.distributed as dist

    return dist


def detect_target() -> str:
    """The device target: ``HYPERPAR_MS_DEVICE`` if set, else Ascend or GPU when MindSpore sees
    one, else CPU."""
    wanted = os.environ.get(TARGET_ENV, "").strip()
    if wanted:
        match = [t for t in TARGETS if t.lower() == wanted.lower()]
        if not match:
            raise ValueError(f"{TARGET_ENV}={wanted!r} is not a MindSpore target; use one of "
                             f"{', '.join(TARGETS)}")
        return match[0]
    hal = load_mindspore().hal
    for target in ("Ascend", "GPU"):
        try:
            if hal.is_available(target) and hal.device_count(target) > 0:
                return target
        except Exception:  # a target whose plugin cannot load is simply not there
            continue
    return "CPU"


#: What :func:`tune_threads` sets per target. CPU: MindSpore's defaults start many threads per
#: process, which on a shared host made every collective 5-10x slower. Ascend/GPU: nothing is
#: forced -- a blocking launch would make every kernel launch on the NPU/GPU synchronous.
TUNING = {
    "CPU": {"op threads": "1", "dispatch threads": "1", "kernel launches": "blocking"},
    "Ascend": {"kernel launches": "asynchronous (MindSpore's default)"},
    "GPU": {"kernel launches": "asynchronous (MindSpore's default)"},
}


def compiler_output_dir() -> str:
    """Where MindSpore's graph compiler writes ``rank_N/om/`` (``analyze_fail.ir`` after a
    failed ``ms.jit`` compile): ``MS_OM_PATH`` when the user set it, else a folder under the
    system's temporary directory -- never the user's working directory."""
    return os.environ.get("MS_OM_PATH") or os.path.join(tempfile.gettempdir(),
                                                        "hyperpar-mindspore")


def route_compiler_output() -> None:
    """Point ``MS_OM_PATH`` at :func:`compiler_output_dir` unless the user chose one (measured
    on MindSpore 2.10: read at the failure, so setting it after import works; the error
    message names the file's full path)."""
    os.environ.setdefault("MS_OM_PATH", compiler_output_dir())


def quiet_cpu_synchronize() -> None:
    """MindSpore 2.10's ``runtime.synchronize()`` (which its own ``barrier`` calls) logs "CPU
    device is not supported" as an ERROR on its first call on CPU and skips that call; the C
    function it wraps works on CPU (measured), so mark the first call as made: no false ERROR
    line on every rank, and that first call synchronizes too."""
    try:
        from mindspore.runtime import stream
        stream.function_stream_status["synchronize"] = True
    except (ImportError, AttributeError, TypeError):  # another MindSpore version: leave it
        pass


def tune_threads(ms: Any, target: str = "CPU") -> None:
    """Apply :data:`TUNING` for ``target`` (CPU only: one op thread, one dispatch thread,
    blocking launches). ``HYPERPAR_MS_KEEP_THREADS=1`` keeps MindSpore's defaults."""
    if os.environ.get("HYPERPAR_MS_KEEP_THREADS") or target != "CPU":
        return
    try:
        ms.device_context.cpu.op_tuning.threads_num(1)
        ms.runtime.dispatch_threads_num(1)
        ms.runtime.launch_blocking()
    except RuntimeError:  # already set in this process (they may be set once)
        pass


def start_scheduler(host: str, port: int, world: int, target: str) -> subprocess.Popen:
    """Start MindSpore's scheduler process for a world of ``world`` workers."""
    env = dict(os.environ, MS_ROLE="MS_SCHED", MS_WORKER_NUM=str(world), MS_SCHED_HOST=host,
               MS_SCHED_PORT=str(port), HYPERPAR_MS_DEVICE=target,
               HYPERPAR_MS_PARENT=str(os.getpid()))
    env.pop("MS_NODE_ID", None)
    env.setdefault("GLOG_v", "3")
    proc = subprocess.Popen([sys.executable, "-m", "hyperpar_mindspore.scheduler"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _address(init_method: str | None) -> tuple[str, int]:
    if init_method and init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://"):].rpartition(":")
        return host, int(port)
    try:
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    except KeyError:
        raise ValueError("init_process_group: a world of more than one process needs "
                         "MASTER_PORT (or init_method='tcp://host:port'), or start it with "
                         "`hyperpar run -n N script.py`") from None


def _world_group_name() -> str:
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def _point_p2p_at_world_group() -> None:
    # mint.distributed binds the world group's name as a default argument at import time, before
    # init() knows the real one; point-to-point calls then look up a group that does not exist.
    module = sys.modules.get("mindspore.mint.distributed.distributed")
    if module is None:
        import mindspore.mint.distributed.distributed as module
    world = _world_group_name()
    for fn_name in ("get_cache_group_size", "get_cache_group_rank"):
        fn = getattr(module, fn_name, None)
        if fn is not None and fn.__defaults__:
            fn.__defaults__ = (world,)

