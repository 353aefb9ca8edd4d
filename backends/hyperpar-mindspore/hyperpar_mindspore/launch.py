"""``hyperpar run`` on MindSpore: the scheduler process plus one worker per rank, no msrun.

Several nodes: ``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` on every node; node 0 runs
MindSpore's scheduler on HOST:PORT, node R starts global ranks ``R*n .. R*n+n-1``. Each node reports
its own ranks' failures as below.

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
    nodes = str(opts.nnodes)
    if not nodes.isdigit() or int(nodes) < 1:
        return _error(out, f"--nnodes must be a fixed number of nodes on the mindspore backend "
                           f"(MindSpore has no elastic range), got {nodes!r}")
    nnodes, node = int(nodes), int(opts.node_rank)
    if not 0 <= node < nnodes:
        return _error(out, f"--node-rank {node} must be in 0..{nnodes - 1} for --nnodes {nnodes}")
    if nnodes > 1 and not opts.rdzv_endpoint:
        return _error(out, f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every "
                           f"node: node 0 runs MindSpore's scheduler there")
    n = int(nproc)
    if opts.rdzv_endpoint:
        host, _, port_text = opts.rdzv_endpoint.rpartition(":")
        if not host or not port_text.isdigit():
            return _error(out, f"--rdzv-endpoint must be HOST:PORT, got {opts.rdzv_endpoint!r}")
        port = int(port_text)
    else:
        host, port = "127.0.0.1", free_port()
    world = n * nnodes
    base = dict(os.environ, **env)
    base.setdefault("GLOG_v", "3")
    base.update({"MS_WORKER_NUM": str(world), "MS_SCHED_HOST": host,
                 "MS_SCHED_PORT": str(port), "WORLD_SIZE": str(world),
                 "LOCAL_WORLD_SIZE": str(n), "HYPERPAR_MS_PARENT": str(os.getpid())})
    if not opts.quiet:
        where = f"node {node} of {nnodes}, " if nnodes > 1 else ""
        sched = "here" if node == 0 else "on node 0"
        print(f"hyperpar run: {n} process(es), {where}backend mindspore (scheduler {sched}, "
              f"{host}:{port}): {opts.script}", file=out)
        out.flush()
    target = (["-m", opts.script] if opts.module else [opts.script]) + list(opts.script_args)
    with tempfile.TemporaryDirectory(prefix="hyperpar-ms-") as errors:
        procs: list[subprocess.Popen] = []
        scheduler = None
        if node == 0:
            scheduler = subprocess.Popen(
                [sys.executable, "-m", "hyperpar_mindspore.scheduler"],
                env=dict(base, MS_ROLE="MS_SCHED"), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        try:
            for local in range(n):
                r = node * n + local
                worker_env = dict(base, MS_ROLE="MS_WORKER", MS_NODE_ID=str(r), RANK=str(r),
                                  LOCAL_RANK=str(local), DEVICE_ID=str(local),
                                  HYPERPAR_MS_ERROR_FILE=os.path.join(errors, f"{r}.txt"))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "hyperpar_mindspore.worker", *target],
                    env=worker_env))
            return _watch(procs, errors, out, first_rank=node * n)
        finally:
            for p in [*procs, *([scheduler] if scheduler else [])]:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _watch(procs: list[subprocess.Popen], errors: str, out: Any, first_rank: int = 0) -> int:
    """Wait for this node's workers (global ranks from ``first_rank``); report failures."""
    failed: list[tuple[float, int, int]] = []  # (when, global rank, exit code)
    deadline = None
    while True:
        now = time.monotonic()
        for r, p in enumerate(procs, first_rank):
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
    stuck = [r for r, p in enumerate(procs, first_rank) if p.poll() is None]
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
