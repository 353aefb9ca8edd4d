"""The ``hyperpar`` command (also ``python -m hyperpar``).

    hyperpar info [--json] [--check]          versions, installed backends, the selection
    hyperpar run -n N [...] script.py [args]  launch N processes per node through torchrun
    hyperpar bench [--out DIR] [names...]     run benchmarks/bench_*.py, write a report
    hyperpar plan --config C --world N ...    rank parallel layouts by predicted step time

``--backend NAME`` (before or after the subcommand) selects the backend for the command, as
``HYPERPAR_BACKEND=NAME`` would.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from hyperpar import __version__

BACKEND_ENV = "HYPERPAR_BACKEND"


def _backend_option(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--backend", metavar="NAME", default=default,
        help=f"backend to use (sets {BACKEND_ENV}); default: {BACKEND_ENV} or auto-detect",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperpar",
        description="hardware-agnostic tensor, sequence, pipeline and data parallelism for "
                    "PyTorch",
    )
    parser.add_argument("--version", action="version", version=f"hyperpar {__version__}")
    _backend_option(parser, None)
    # Subcommands accept --backend too; SUPPRESS keeps them from overwriting the global one.
    common = argparse.ArgumentParser(add_help=False)
    _backend_option(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", parents=[common], help="versions, backends and selection",
                          description="Report hyperpar/torch versions, every installed backend "
                                      "(available or why not), the selected one and the rule "
                                      "that chose it, and collective fallbacks in use.")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.add_argument("--check", action="store_true",
                      help="exit 1 (with the reason on stderr) when no backend is selected")

    run = sub.add_parser(
        "run", parents=[common], help="launch a script on N processes (wraps torchrun)",
        description="Launch SCRIPT on every worker through torchrun (torch.distributed.run). "
                    "Single node by default (torchrun --standalone); for several nodes give "
                    "--nnodes and the same --rdzv-endpoint on every node. A failed worker makes "
                    "the command exit non-zero and its rank and traceback are printed last.",
        usage="hyperpar run [options] (SCRIPT | -m MODULE) [script args ...]",
        epilog="environment: HYPERPAR_TIMEOUT=S collective timeout in seconds (default 300; "
               "--timeout sets it); HYPERPAR_DEBUG_COLLECTIVES=1 checks every collective's "
               "name, dtypes and shapes across ranks before issuing it, and the inputs of "
               "parallelized modules (replicated inputs equal, shards torch.chunk's pieces) "
               "(slow; names the mismatching call or module and ranks).",
    )
    run.add_argument("-n", "--nproc-per-node", default="1", metavar="N",
                     help="processes per node (default 1; torchrun also accepts 'auto')")
    run.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                     help="number of nodes (default 1)")
    run.add_argument("--node-rank", type=int, default=0,
                     help="rank of this node (static rendezvous only)")
    run.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="rendezvous endpoint, the same on every node (multi-node)")
    run.add_argument("--rdzv-backend", default="c10d", help="rendezvous backend (default c10d)")
    run.add_argument("--rdzv-id", default=None, help="job id shared by every node")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restarts of the worker group before failing (default 0)")
    run.add_argument("--devices", default=None, metavar="LIST",
                     help="devices made visible to the workers, e.g. 0,1 (sets the backend's "
                          "visible-devices variable, e.g. CUDA_VISIBLE_DEVICES)")
    run.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="seconds a collective waits for its peers before failing; the "
                          "failure then names the rank that did not reach it (sets "
                          "HYPERPAR_TIMEOUT; default: HYPERPAR_TIMEOUT or 300)")
    run.add_argument("-q", "--quiet", action="store_true",
                     help="no launcher banner; workers get HYPERPAR_QUIET=1 (no progress lines)")
    run.add_argument("-m", "--module", action="store_true",
                     help="SCRIPT is a module name, run as `python -m MODULE`")
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")

    bench = sub.add_parser(
        "bench", parents=[common], help="run benchmarks/bench_*.py and write a report",
        description="Run every benchmarks/bench_*.py (or the NAMEs given: 'tp' runs "
                    "bench_tp.py) on the selected backend and write DIR/results.md, "
                    "DIR/results.json and DIR/ratios.png.",
    )
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default all)")
    bench.add_argument("--out", default="bench-results", metavar="DIR",
                       help="output folder (default ./bench-results)")
    bench.add_argument("--dir", default=None, metavar="DIR",
                       help="folder of bench_*.py scripts (default ./benchmarks)")
    bench.add_argument("--timeout", type=float, default=600.0, metavar="S",
                       help="seconds allowed per benchmark script (default 600)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--update-doc", default=None, metavar="FILE",
                       help="also replace the results block of FILE (docs/performance.md)")
    bench.add_argument("--write-profile", default=None, metavar="FILE",
                       help="instead of the benchmarks: measure this machine's device profile "
                            "(rates and fixed costs, under a minute) and write it as JSON for "
                            "'hyperpar plan --profile FILE'")
    bench.add_argument("--ranks", type=int, default=2, metavar="N",
                       help="with --write-profile: processes to measure with (default 2)")
    plan = sub.add_parser("plan", parents=[common], help="rank parallel layouts of a model",
                          description="Enumerate every dp_replicate x dp_shard x tp x pp layout "
                                      "and every dp_replicate x dp_shard x cp layout (context "
                                      "parallel, tp = pp = 1) of a model on N devices, rule out "
                                      "those that do not fit or divide, rank the rest by "
                                      "predicted step time.")
    from hyperpar.plan.cli import add_arguments as plan_arguments

    plan_arguments(plan)
    return parser


def _select_backend(name: str | None) -> None:
    if name:
        os.environ[BACKEND_ENV] = name
    from hyperpar.platform import reset

    reset()


def cmd_info(args: argparse.Namespace) -> int:
    from hyperpar.platform.info import collect_info

    report = collect_info()
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(report.to_text())
    if args.check and not report.selected:
        print(f"hyperpar info: no backend selected: {report.selection_error}", file=sys.stderr)
        return 1
    return 0


def usable_cores() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription_warning(nproc: str, backend: str | None,
                             cores: int | None = None) -> str | None:
    """The warning for ``-n nproc`` workers on a device-less backend (cpu) with more
    workers than cores, or ``None``. ``backend`` is the name given (``--backend`` or
    ``HYPERPAR_BACKEND``); ``None`` resolves it as the workers would (auto-detect)."""
    nproc = str(nproc).strip()
    if not nproc.isdigit():
        return None
    cores = usable_cores() if cores is None else cores
    if int(nproc) <= cores:
        return None
    try:
        from hyperpar.platform import backends, get_platform

        name = backend or get_platform().name
        info = backends().get(name)
    except Exception:  # an unknown/unavailable backend: launch() reports it
        return None
    if info is None or info.cls.visible_devices_env is not None:
        return None  # a device backend: one rank per device, checked by the platform
    return (f"-n {nproc} starts {nproc} worker processes per node on backend {name!r}, but "
            f"this host has {cores} CPU core(s): the workers will time-share the cores "
            f"(slow; memory grows with every worker). Use -n {cores} or fewer unless you "
            f"mean to oversubscribe")


def cmd_run(args: argparse.Namespace) -> int:
    from hyperpar.launcher import LaunchOptions, launch

    if args.timeout is None:
        from hyperpar.platform.timeout import default_timeout_s

        try:
            default_timeout_s()  # every worker would fail on a bad HYPERPAR_TIMEOUT
        except ValueError as exc:
            print(f"hyperpar run: error: {exc}", file=sys.stderr)
            return 2
    named = args.backend or os.environ.get(BACKEND_ENV, "").strip() or None
    warning = oversubscription_warning(args.nproc_per_node, named)
    if warning:
        print(f"hyperpar run: warning: {warning}", file=sys.stderr)
    opts = LaunchOptions(
        script=args.script, script_args=list(args.script_args), module=args.module,
        nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts, backend=args.backend, devices=args.devices,
        quiet=args.quiet, timeout_s=args.timeout,
    )
    return launch(opts)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.write_profile:
        from hyperpar.plan.calibrate import write_profile

        if args.backend:
            os.environ[BACKEND_ENV] = args.backend
        return write_profile(args.write_profile, args.ranks)
    from hyperpar import bench

    return bench.main(names=args.names, out_dir=args.out, bench_dir=args.dir,
                      timeout_s=args.timeout, list_only=args.list,
                      update_doc_path=args.update_doc)


def cmd_plan(args: argparse.Namespace) -> int:
    from hyperpar.plan.cli import run as plan_run

    if args.backend:  # only --measure uses a backend; resolving it now would import torch
        os.environ[BACKEND_ENV] = args.backend

    return plan_run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hyperpar`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # `run` validates and pins the backend itself; `plan` needs none (and no torch)
    if args.command not in ("run", "plan"):
        _select_backend(args.backend)
    handler = {"info": cmd_info, "run": cmd_run, "bench": cmd_bench,
               "plan": cmd_plan}[args.command]
    return handler(args)


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
