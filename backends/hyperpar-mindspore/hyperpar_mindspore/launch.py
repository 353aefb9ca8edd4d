"""``hyperpar run`` on MindSpore: the scheduler process plus one worker per rank, no msrun.

msrun was seen to hang after a worker failed; here the launcher owns every process. When a worker
fails, the others get a short grace period to fail in consequence, then every remaining process
(workers and scheduler) is killed and the failed rank is named with its traceback, last.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from hyperpar.testing.harness import free_port

#: Seconds the other workers get to finish or fail after the first failure, before being killed.
GRACE_S = 10.0


def _error(out: Any, message: str) -> int:
    print(f"hyperpar run: error: {message}", file=out)
    return 2


def run(opts: Any, env: dict[str, str], out: Any) -> int:
    """Start the job described by ``opts`` (:class:`hyperpar.launcher.LaunchOptions`); return its
    exit status (0 when every rank succeeded)."""
    nproc = str(opts.nproc_per_node)
    if not nproc.isdigit():
        return _error(out, f"-n must be a number of processes on the mindspore backend, got "
                           f"{nproc!r}")
    if str(opts.nnodes) != "1" or opts.rdzv_endpoint:
        return _error(out, "the mindspore backend runs on one node for now; drop --nnodes and "
                           "--rdzv-endpoint (or use msrun for several nodes)")
    n = int(nproc)
    port = free_port()
    base = dict(os.environ, **env)
    base.setdefault("GLOG_v", "3")
    base.update({"MS_WORKER_NUM": str(n), "MS_SCHED_HOST": "127.0.0.1",
                 "MS_SCHED_PORT": str(port), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                 "HYPERPAR_MS_PARENT": str(os.getpid())})
    if not opts.quiet:
        print(f"hyperpar run: {n} process(es), backend mindspore (scheduler on port {port}): "
              f"{opts.script}", file=out)
        out.flush()
    target = (["-m", opts.script] if opts.module else [opts.script]) + list(opts.script_args)
    with tempfile.TemporaryDirectory(prefix="hyperpar-ms-") as errors:
        procs: list[subprocess.Popen] = []
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "hyperpar_mindspore.scheduler"],
            env=dict(base, MS_ROLE="MS_SCHED"), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            for r in range(n):
                worker_env = dict(base, MS_ROLE="MS_WORKER", MS_NODE_ID=str(r), RANK=str(r),
                                  LOCAL_RANK=str(r),
                                  HYPERPAR_MS_ERROR_FILE=os.path.join(errors, f"{r}.txt"))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "hyperpar_mindspore.worker", *target],
                    env=worker_env))
            return _watch(procs, errors, out)
        finally:
            for p in [*procs, scheduler]:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _watch(procs: list[subprocess.Popen], errors: str, out: Any) -> int:
    failed: list[tuple[float, int, int]] = []  # (when, rank, exit code)
    deadline = None
    while True:
        now = time.monotonic()
        for r, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and all(r != f[1] for f in failed):
                failed.append((now, r, code))
        if all(p.poll() is not None for p in procs):
            break
        if failed and deadline is None:
            deadline = now + GRACE_S
        if deadline is not None and now > deadline:
            break
        time.sleep(0.1)
    if not failed:
        return 0
    first = min(failed)[1]
    for _, r, code in sorted(failed):
        if r != first:
            print(f"hyperpar run: rank {r} failed too (exit code {code})", file=out)
    stuck = [r for r, p in enumerate(procs) if p.poll() is None]
    if stuck:
        print(f"hyperpar run: killed rank(s) {', '.join(map(str, stuck))} still running "
              f"{GRACE_S:.0f} s after rank {first} failed", file=out)
    path = os.path.join(errors, f"{first}.txt")
    trace = open(path).read() if os.path.exists(path) else "(no traceback: the process died)"
    code = dict((r, c) for _, r, c in failed)[first]
    print(f"hyperpar run: rank {first} failed first (exit code {code}):\n{trace.rstrip()}",
          file=out)
    out.flush()
    return 1
