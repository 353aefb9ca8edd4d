"""``hyperpar plan``: rank every parallel layout of a model on N devices by predicted step time.

Registered as a subcommand by ``hyperpar/cli.py`` (:func:`add_arguments`, :func:`run`);
``python -m hyperpar.plan.cli`` runs it on its own.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence

from .devices import PROFILES, get_profile, load_profile
from .layout import Run
from .model import EXAMPLES, example_spec, from_hf_config
from .report import plot, ruled_out_summary, table, write_json
from .search import plan

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``141G`` (binary), ``8e10`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"device memory {text!r} not understood; write e.g. 80GiB, 80GB, 141G or 8e10")
    try:
        value = float(match.group(1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"device memory {text!r}: {match.group(1)!r} is not "
                                         "a number") from None
    return int(value * _UNITS[match.group(2).lower()])


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", metavar="HF_CONFIG.json",
                     help="Hugging Face config.json of a Llama-family model")
    src.add_argument("--example", choices=sorted(EXAMPLES),
                     help="the model of examples/llama (tiny: ModelArgs.tiny(), llama: "
                          "ModelArgs())")
    p.add_argument("--world", type=int, required=True, metavar="N", help="number of devices")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                   help="devices per node (default 8)")
    p.add_argument("--device", default="h100", metavar="NAME",
                   help=f"shipped device profile: {', '.join(sorted(PROFILES))} (default h100)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="measured device profile (JSON; overrides --device)")
    p.add_argument("--device-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory per device, e.g. 80GiB (default: the profile's)")
    p.add_argument("--seq-len", type=int, required=True, metavar="S")
    p.add_argument("--global-batch", type=int, required=True, metavar="B",
                   help="sequences per optimizer step")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype (bfloat16: mixed precision with fp32 masters)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-momentum"), default="adamw")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule for pp > 1 (default 1f1b)")
    p.add_argument("--max-tp", type=int, default=None, metavar="T",
                   help="consider tp up to T only (default: any)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows of the table")
    p.add_argument("--json", default=None, metavar="OUT", help="write the plan as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png|svg",
                   help="write the frontier plot (peak memory vs step time)")
    p.add_argument("--measure", action="store_true",
                   help="run the best layouts that fit this machine for real (2 and 4 ranks "
                        "of the selected backend; needs --example) and print predicted vs "
                        "measured")
    p.add_argument("--save-profile", default=None, metavar="FILE",
                   help="with --measure: write the profile calibrated on this machine (2 "
                        "ranks) as JSON, for --profile")


def run(args: argparse.Namespace) -> int:
    try:
        spec = from_hf_config(args.config) if args.config else example_spec(args.example)
        profile = load_profile(args.profile) if args.profile else get_profile(args.device)
        memory = args.device_memory or profile.memory_bytes
        job = Run(world=args.world, seq_len=args.seq_len, global_batch=args.global_batch,
                  param_dtype=args.param_dtype, optimizer=args.optimizer,
                  gpus_per_node=args.gpus_per_node, device_memory=memory)
    except (ValueError, FileNotFoundError) as err:
        print(f"hyperpar plan: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    result = plan(spec, job, profile, schedule=args.schedule, max_tp=args.max_tp)
    elapsed = time.perf_counter() - start
    if args.measure:
        from .measure import measure_top

        measure_top(result, spec, args)
    print(table(result, args.top))
    print()
    print(ruled_out_summary(result))
    print(f"\nsearched {result.considered} layouts in {elapsed:.2f} s")
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        written = plot(result, args.plot)
        print(f"wrote {written}")
    return 0 if result.ranked else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyperpar plan", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
