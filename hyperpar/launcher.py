"""``hyperpar run``: a thin layer over ``torchrun`` (:mod:`torch.distributed.run`).

This is not a process manager. It builds torchrun's argument list, pins the backend for every
worker (``HYPERPAR_BACKEND``, plus the backend's visible-devices variable with ``--devices``),
and runs torchrun's own ``run()`` in this process, so rendezvous, multi-node and restarts behave
exactly as torchrun's do.

What it adds is failure reporting: every worker starts through :func:`worker_main` (``python -m
hyperpar.launcher script.py ...``), which runs the user's script as ``python script.py`` would
and writes an exception to torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``, the
format of torch elastic's ``@record``). When the run fails the launcher prints, as the last
lines of the output, the first failed worker's global rank, exit code and traceback, after one
line for each worker that failed in consequence.

This module may import torchrun itself (``torch.distributed.run`` and its
``torch.distributed.elastic`` machinery), nothing else of ``torch.distributed``: process groups
are the platform's (``tests/test_layering.py`` checks it).

A worker that finished its script and then died while the interpreter shut down is reported
as exactly that, and as a failure (see :func:`format_teardown_failure`).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

QUIET_ENV = "HYPERPAR_QUIET"
TIMEOUT_ENV = "HYPERPAR_TIMEOUT"
FINISHED_MESSAGE = "finished its script, then exited abnormally during interpreter teardown"


class LaunchError(RuntimeError):
    """The launch request is invalid (bad backend, bad device list, bad node options)."""


@dataclass
class LaunchOptions:
    """Everything ``hyperpar run`` accepts, already parsed."""

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    max_restarts: int = 0
    backend: str | None = None
    devices: str | None = None
    quiet: bool = False
    timeout_s: float | None = None


@dataclass
class WorkerFailure:
    """One failed worker as the launcher reports it."""

    rank: int
    local_rank: int
    exitcode: int
    message: str
    traceback: str
    # Set on the culprit named by a collective diagnosis (health.py): the rank that held up
    # the others, with the reporting rank's traceback (where it waited).
    blamed_by: int | None = None


# --------------------------------------------------------------------------- preparation
def resolve_backend(name: str | None) -> tuple[str, str]:
    """Validate the backend the workers will use; return ``(name, rule)``.

    ``name`` (from ``--backend``) wins over ``HYPERPAR_BACKEND``, which wins over auto-detect.
    Raises :class:`hyperpar.platform.BackendError` with the registry's message (an unknown name
    lists the installed backends; an unavailable one gives the probe's reason).
    """
    from hyperpar.platform import get_platform, reset, selection_rule, set_backend

    if name:
        set_backend(name)
        set_backend(None)
        return name, "--backend"
    reset()
    platform = get_platform()
    return platform.name, selection_rule()


def worker_env(backend: str, devices: str | None, quiet: bool,
               timeout_s: float | None = None) -> dict[str, str]:
    """Environment variables every worker gets (on top of the launcher's own)."""
    from hyperpar.platform import backends

    env = {"HYPERPAR_BACKEND": backend}
    if timeout_s is not None:
        if not timeout_s > 0:
            raise LaunchError(f"--timeout must be a positive number of seconds, got {timeout_s}")
        env[TIMEOUT_ENV] = repr(float(timeout_s))
    if devices is not None:
        var = backends()[backend].cls.visible_devices_env
        if var is None:
            raise LaunchError(
                f"--devices was given, but backend {backend!r} has no visible-devices variable "
                f"(it has no devices to choose from); drop --devices or pick another backend"
            )
        items = [d.strip() for d in devices.split(",") if d.strip()]
        if not items:
            raise LaunchError(f"--devices {devices!r} lists no device; use e.g. --devices 0,1")
        env[var] = ",".join(items)
    if quiet:
        env[QUIET_ENV] = "1"
    return env


def _visible_devices_only(backend: str, devices: str) -> dict[str, str]:
    from hyperpar.platform import backends

    info = backends().get(backend)
    var = info.cls.visible_devices_env if info is not None else None
    return {var: devices.replace(" ", "")} if var else {}


def torchrun_args(opts: LaunchOptions) -> list[str]:
    """The argument list handed to ``torch.distributed.run`` for ``opts``."""
    args = ["--nproc-per-node", str(opts.nproc_per_node), "--nnodes", str(opts.nnodes),
            "--max-restarts", str(opts.max_restarts)]
    max_nodes = str(opts.nnodes).split(":")[-1]
    if opts.rdzv_endpoint:
        args += ["--rdzv-backend", opts.rdzv_backend, "--rdzv-endpoint", opts.rdzv_endpoint,
                 "--node-rank", str(opts.node_rank)]
        if opts.rdzv_id:
            args += ["--rdzv-id", opts.rdzv_id]
    elif max_nodes.strip() in ("", "1"):
        args.append("--standalone")
    else:
        raise LaunchError(
            f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node); "
            "a single-node run needs neither"
        )
    # Every worker starts through worker_main so its exception lands in torchrun's error file.
    args += ["--module", "hyperpar.launcher"]
    if opts.module:
        args.append("-m")
    args += [opts.script, *opts.script_args]
    return args


def check_counts(opts: LaunchOptions) -> None:
    """``-n`` and ``--nnodes`` name at least one process/node (torchrun asserts otherwise)."""
    nproc = str(opts.nproc_per_node).strip()
    if nproc not in ("auto", "cpu", "gpu", "xpu") and not (nproc.isdigit() and int(nproc) > 0):
        raise LaunchError(
            f"-n/--nproc-per-node must be a positive number of processes (or 'auto'), got "
            f"{opts.nproc_per_node!r}; e.g. -n 2"
        )
    for part in str(opts.nnodes).split(":"):
        if not (part.strip().isdigit() and int(part) > 0):
            raise LaunchError(
                f"--nnodes must be a positive number of nodes (or MIN:MAX), got {opts.nnodes!r}"
            )


def _check_devices_cover(opts: LaunchOptions) -> None:
    if opts.devices is None or not str(opts.nproc_per_node).isdigit():
        return
    count = len([d for d in opts.devices.split(",") if d.strip()])
    if int(opts.nproc_per_node) > count:
        raise LaunchError(
            f"-n {opts.nproc_per_node} processes per node but --devices {opts.devices} makes "
            f"only {count} visible; list more devices or lower -n"
        )


# --------------------------------------------------------------------------- running
def launch(opts: LaunchOptions, *, out=None) -> int:
    """Run ``opts.script`` on every worker through torchrun; return the exit status.

    On failure the last thing written to ``out`` (default stderr) is the failed workers' ranks,
    exit codes and tracebacks.
    """
    from hyperpar.platform import BackendError, backends

    out = out or sys.stderr
    if not opts.module and not os.path.isfile(opts.script):
        print(f"hyperpar run: error: script {opts.script!r} not found", file=out)
        return 2
    saved = dict(os.environ)
    try:  # launch() may be called in-process (tests, notebooks): leave the environment as found
        try:
            named = opts.backend or os.environ.get("HYPERPAR_BACKEND", "").strip()
            if named and opts.devices is not None:
                # Restrict the devices before the availability probe: it sees what workers see.
                os.environ.update(_visible_devices_only(named, opts.devices))
            check_counts(opts)
            backend, rule = resolve_backend(opts.backend)
            env = worker_env(backend, opts.devices, opts.quiet, opts.timeout_s)
            _check_devices_cover(opts)
            if str(opts.nproc_per_node).isdigit():  # one rank per device on cuda/npu
                backends()[backend].cls().check_world_fits(int(opts.nproc_per_node))
            args = torchrun_args(opts)
        except (BackendError, LaunchError) as exc:
            print(f"hyperpar run: error: {exc}", file=out)
            return 2
        os.environ.update(env)
        nproc = str(opts.nproc_per_node)
        if (opts.quiet and "OMP_NUM_THREADS" not in os.environ and nproc.isdigit()
                and int(nproc) > 1):
            os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's own default, without its banner
        own = backends()[backend].cls.launch_workers(opts, env, out)  # e.g. MindSpore's
        if own is not None:
            return own
        return _run_torchrun(opts, args, backend, rule, env, out)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_torchrun(opts: LaunchOptions, args: list[str], backend: str, rule: str,
                  env: dict[str, str], out) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not opts.quiet:
        extra = "".join(f" {k}={v}" for k, v in env.items() if k != "HYPERPAR_BACKEND")
        print(f"hyperpar run: {opts.nproc_per_node} process(es) per node x {opts.nnodes} "
              f"node(s), backend {backend} (by {rule}){extra}: {opts.script}", file=out)
        out.flush()
    try:
        run(parse_args(args))
    except ChildFailedError as exc:
        crashed_after_finishing = finished_ranks(exc)
        if crashed_after_finishing:
            print(format_teardown_failure(opts.script, exc, crashed_after_finishing), file=out)
            out.flush()
            return 1
        failures = collect_failures(exc)
        print(format_failures(opts.script, failures), file=out)
        out.flush()
        code = failures[-1].exitcode
        return code if 0 < code < 256 else 1
    except Exception as exc:  # rendezvous and agent errors: say what failed, not a traceback
        print(f"hyperpar run: error: torchrun failed: {type(exc).__name__}: {exc}", file=out)
        return 1
    return 0


def finished_ranks(exc) -> list[int]:
    """The failed ranks when every one of them had finished its script (a crash at exit:
    the run succeeded); empty when any failure happened while a script was still running."""
    done = []
    for rank, failure in exc.failures.items():
        message = failure.message
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        if not extra.get("hyperpar_finished"):
            return []
        done.append(rank)
    return sorted(done)


def format_teardown_failure(script: str, exc, ranks: list[int]) -> str:
    """The report of a run whose failed ranks all finished the script and then died while the
    interpreter shut down. It is a failure (exit status 1), not a success: the script's
    ``atexit`` handlers, buffered output and files closed at exit may not have completed on
    those ranks -- but it says precisely what is known, that the script itself returned."""
    crashed = [r for r in ranks if exc.failures[r].exitcode != -15] or ranks
    how = []
    for rank in crashed:
        code = exc.failures[rank].exitcode
        how.append(f"rank {rank} " + (f"was killed by signal {-code}"
                                      + (" (SIGABRT)" if code == -6 else "")
                                      if code < 0 else f"exited with code {code}"))
    return (f"hyperpar run: FAILED at exit: every failed rank had finished {script} (the "
            f"script returned), then {', '.join(how)} while the interpreter shut down; exit "
            f"handlers and output flushed at exit may be incomplete on those ranks. Reported "
            f"as a failure (exit status 1)")


def collect_failures(exc) -> list[WorkerFailure]:
    """The failed workers of a ``ChildFailedError``, the root cause (first failure) last."""
    rows: list[WorkerFailure] = []
    for rank, failure in exc.failures.items():
        message = failure.message
        if isinstance(message, dict):
            text = str(message.get("message", ""))
            tb = str(message.get("extraInfo", {}).get("py_callstack", ""))
        else:
            text, tb = str(message), ""
            if failure.exitcode > 0 and text.startswith("To enable traceback"):
                text = f"exited with code {failure.exitcode} (no Python exception was recorded)"
        rows.append(WorkerFailure(rank, failure.local_rank, failure.exitcode, text,
                                  trim_traceback(tb)))
    # The root cause is the earliest failure that was not torchrun stopping the survivors
    # (negative exit code = killed by a signal), ordered by sub-second time where recorded.
    def when(rank: int) -> tuple[bool, float]:
        failure = exc.failures[rank]
        extra = failure.message.get("extraInfo", {}) if isinstance(failure.message, dict) else {}
        precise = float(extra.get("hyperpar_time", failure.timestamp))
        return (failure.exitcode < 0, precise)

    root_rank = min(exc.failures, key=when)
    blamed = _diagnosed_culprit(exc, rows)
    if blamed is not None:
        root_rank = blamed.rank
        rows = [r for r in rows if r.rank != root_rank] + [blamed]
    rows.sort(key=lambda r: (r.rank == root_rank, r.rank))
    return rows


def _diagnosed_culprit(exc, rows: list[WorkerFailure]) -> WorkerFailure | None:
    """The rank a failed collective's diagnosis blames (the rank that did not reach it), as a
    failure row -- also when that rank itself exited 0 -- or ``None`` without a diagnosis."""
    for rank in sorted(exc.failures):
        message = exc.failures[rank].message
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        culprits = extra.get("hyperpar_culprits")
        if not culprits:
            continue
        culprit = int(culprits[0])
        reporter = next(r for r in rows if r.rank == rank)
        diagnosis = str(extra.get("hyperpar_diagnosis", reporter.message))
        found = next((r for r in rows if r.rank == culprit), None)
        if found is None:  # it finished without the collective (or runs on another node)
            return WorkerFailure(culprit, -1, 0, f"{diagnosis} [rank {culprit} did not fail "
                                 "on this node: it exited 0, or runs on another node]",
                                 reporter.traceback, blamed_by=rank)
        how = (f" [it was stopped by the launcher, signal {-found.exitcode}]"
               if found.exitcode < 0 else "")
        if found.traceback:  # it raised too: its own traceback says where it was
            return WorkerFailure(found.rank, found.local_rank, found.exitcode,
                                 f"{diagnosis} [then: {found.message}]", found.traceback)
        return WorkerFailure(found.rank, found.local_rank, found.exitcode, diagnosis + how,
                             reporter.traceback, blamed_by=rank)
    return None


_LAUNCH_FRAMES = (f"{os.sep}runpy.py", "<frozen runpy>", f"hyperpar{os.sep}launcher.py",
                  f"elastic{os.sep}multiprocessing{os.sep}errors")


def trim_traceback(tb: str) -> str:
    """Drop the launcher's own frames (runpy, ``@record``, :func:`worker_main`) from a worker
    traceback so it starts at the user's script."""
    lines = tb.splitlines()
    kept: list[str] = []
    skipping = False
    for line in lines:
        if line.startswith("  File "):
            skipping = any(part in line for part in _LAUNCH_FRAMES)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def format_failures(script: str, failures: Sequence[WorkerFailure]) -> str:
    """The summary printed at the end of a failed ``hyperpar run``: one line per worker that
    failed as a consequence, then the first failure with its traceback, last."""
    *others, root = failures
    lines = ["", "=" * 72, f"hyperpar run: {script} FAILED ({len(failures)} worker(s) failed)"]
    if others:
        lines.append("also failed (most likely because of the first failure):")
        lines += [f"  rank {f.rank} (local rank {f.local_rank}), exit code {f.exitcode}: "
                  f"{f.message.splitlines()[0] if f.message else ''}" for f in others]
    lines.append("-" * 72)
    local = f"local rank {root.local_rank}" if root.local_rank >= 0 else "local rank ?"
    if root.blamed_by is not None:
        lines.append(f"culprit: rank {root.rank} ({local}), exit code {root.exitcode}")
        if root.traceback:
            lines.append(f"where rank {root.blamed_by} waited for it:")
    else:
        lines.append(f"first failure: rank {root.rank} ({local}), exit code {root.exitcode}")
    if root.traceback:
        lines.append(root.traceback.rstrip())
    lines.append(f"rank {root.rank}: {root.message}")
    if root.exitcode == -6 and root.blamed_by is None:
        lines.append(
            f"(SIGABRT: a native abort, e.g. in the collective library; rank {root.rank}'s "
            "Python stack is printed above, after 'Fatal Python error'. If the abort mentions "
            "a size or collective mismatch, rerun with HYPERPAR_DEBUG_COLLECTIVES=1 to name "
            "the call and the ranks that disagree.)")
    lines.append("=" * 72)
    return "\n".join(lines)


# --------------------------------------------------------------------------- worker side
def _run_target(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        name, rest = argv[1], argv[2:]
        sys.argv = [name, *rest]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    script, rest = argv[0], argv[1:]
    sys.argv = [script, *rest]
    # What `python script.py` would do: the script's folder first on the import path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _is_launch_frame(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or any(
        part in filename for part in _LAUNCH_FRAMES)


def _blamed_error(exc: BaseException | None) -> BaseException | None:
    """The first exception in ``exc``'s cause/context chain that names culprit ranks (a
    :class:`hyperpar.platform.health.CollectiveError`, possibly wrapped by user code)."""
    seen = 0
    while exc is not None and seen < 20:
        if getattr(exc, "culprits", None):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _record_failure(exc: BaseException) -> str:
    """Write ``exc`` to torchrun's error file (its JSON format, plus a sub-second timestamp that
    orders failures within one second) and return the traceback without launcher frames."""
    tb = exc.__traceback__
    while tb is not None and _is_launch_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        now = time.time()
        extra = {"py_callstack": text, "timestamp": str(int(now)), "hyperpar_time": repr(now)}
        blamed = _blamed_error(exc)
        if blamed is not None:  # a collective failed because of other ranks: name them
            extra["hyperpar_culprits"] = list(blamed.culprits)
            extra["hyperpar_diagnosis"] = str(blamed).splitlines()[0]
        data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": extra}}
        with open(path, "w") as fp:
            json.dump(data, fp)
    return text


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of every worker: run the user's script (or ``-m module``) as ``python``
    would; an exception is written to ``TORCHELASTIC_ERROR_FILE`` for the launcher to report,
    printed (rank-prefixed, without launcher frames) and turned into exit code 1."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m hyperpar.launcher script.py [args] | -m module [args]"
                         "  (worker entry point of `hyperpar run`; use `hyperpar run`)")
    get_error_handler().initialize()  # faulthandler: native crashes print the Python stack
    try:
        _run_target(argv)
    except Exception as exc:
        text = _record_failure(exc)
        prefix = f"[rank{os.environ.get('RANK', '?')}]: "
        sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
        sys.exit(1)
    _finish()


def _finish() -> None:
    """After the script returned: say so in the error file (a crash during interpreter
    teardown is then reported as such, not as a failure inside the script) and leave the
    process group through the platform, whose library threads and pending work otherwise meet
    interpreter shutdown (``terminate called without an active exception``). A world joined
    through hyperpar also closes itself at exit; this covers one the script joined itself."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        now = time.time()
        with open(path, "w") as fp:
            json.dump({"message": {
                "message": FINISHED_MESSAGE,
                "extraInfo": {"py_callstack": "", "timestamp": str(int(now)),
                              "hyperpar_time": repr(now), "hyperpar_finished": True},
            }}, fp)
    if "torch" not in sys.modules:  # the script never imported torch: no process group
        return
    import gc

    # Autograd graphs kept by the script's globals hold process groups; free them first.
    gc.collect()
    try:
        from hyperpar.platform import get_platform

        platform = get_platform()
        if platform.is_initialized():
            platform.destroy_process_group()
    except Exception:  # never turn a finished run into a failure here
        pass


if __name__ == "__main__":
    worker_main()
