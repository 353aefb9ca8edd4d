"""``hyperpar plan``: rank every parallel layout of a model on N devices by predicted step time.

Registered as a subcommand by ``hyperpar/cli.py`` (:func:`add_arguments`, :func:`run`);
``python -m hyperpar.plan.cli`` runs it on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence

from .devices import PROFILES, DeviceProfile, get_profile, load_profile, with_topology
from .layout import SCHEDULES, Run, parse_layout
from .model import EXAMPLES, ModelSpec, example_spec, from_hf_config
from .moe import moe_keys
from .report import describe_one, plot, ruled_out_summary, table, write_json
from .search import Candidate, PlanResult, RuledOut, evaluate, plan

#: The one rule for byte sizes (docs/planning.md): SI suffixes are decimal (``GB`` = 10**9, as
#: vendors print them), ``iB`` suffixes and the bare letters binary (``GiB`` = ``G`` = 2**30,
#: as ``nvidia-smi`` and the planner's tables print them).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``80GiB`` / ``141G`` (binary: 2**30), ``80GB`` (decimal: 10**9), ``8e10`` -> bytes."""
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


def parse_rate(text: str) -> float:
    """``50GB/s`` (bytes, decimal), ``400Gb/s`` or ``400Gbit/s`` (bits, decimal), ``5e10``
    (bytes/s) -> bytes per second."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(B|b|bit)?(/s)?\s*", text)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    try:
        assert match
        value = float(match.group(1)) * scale[match.group(2).lower()]
    except (AssertionError, ValueError):
        raise argparse.ArgumentTypeError(
            f"bandwidth {text!r} not understood; write e.g. 50GB/s (bytes) or 400Gb/s "
            "(bits)") from None
    return value / 8 if match.group(3) in ("b", "bit") else value


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", metavar="HF_CONFIG.json",
                     help="Hugging Face config.json of a Llama-family or GPT-style model, or of an "
                          "MoE model (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, gpt-oss)")
    src.add_argument("--example", choices=sorted(EXAMPLES),
                     help="the model of examples/llama (tiny: ModelArgs.tiny(), llama: "
                          "ModelArgs())")
    p.add_argument("--world", type=int, required=True, metavar="N", help="number of devices")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                   help="devices per node (default 8)")
    p.add_argument("--intra-node-bandwidth", type=parse_rate, default=None, metavar="RATE",
                   help="per device inside a node, one direction, e.g. 450GB/s (default: "
                        "the profile's)")
    p.add_argument("--nics-per-node", type=int, default=None, metavar="K",
                   help="network cards per node, shared by its devices (default: one per "
                        "device at the profile's speed)")
    p.add_argument("--nic-bandwidth", type=parse_rate, default=None, metavar="RATE",
                   help="one NIC, one direction, e.g. 400Gb/s (default: the profile's "
                        "per-device inter-node figure)")
    p.add_argument("--device", default="h100", metavar="NAME",
                   help=f"shipped device profile: {', '.join(sorted(PROFILES))} (default h100)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="measured device profile (JSON; overrides --device)")
    p.add_argument("--device-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory per device, e.g. 80GiB or 80G (binary, 2^30) or 80GB "
                        "(decimal, 10^9) (default: the profile's)")
    p.add_argument("--seq-len", type=int, required=True, metavar="S")
    p.add_argument("--global-batch", type=int, required=True, metavar="B",
                   help="sequences per optimizer step")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype (bfloat16: mixed precision with fp32 masters)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-momentum"), default="adamw")
    p.add_argument("--optimizer-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the optimizer's states (AdamW's moments; default float32). "
                        "bfloat16: DeepSeek-V3's (sec. 3.3.3); the masters stay fp32")
    p.add_argument("--zero-grad-dtype", choices=("compute", "float32"), default="compute",
                   help="dtype ZeRO-1/2 layouts keep gradients in (default: the compute dtype, "
                        "hyperpar's ZeRO; float32: Megatron-core's fp32 main grads, "
                        "DeepSeek-V3's 'gradients ... retained in FP32')")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="pipeline schedule for pp > 1 (default 1f1b; interleaved1f1b with "
                        "--virtual-stages chunks per rank; zbh1: zero-bubble H1)")
    p.add_argument("--virtual-stages", type=int, default=2, metavar="V",
                   help="model chunks per pipeline rank under interleaved1f1b (default 2)")
    p.add_argument("--attention", choices=("flash", "eager"), default="flash",
                   help="flash: a fused kernel (default); eager: materialised attention, its "
                        "seq x seq softmax probabilities saved per layer")
    p.add_argument("--loss", choices=("eager", "fused", "torch-lp"), default="eager",
                   help="eager: F.cross_entropy(logits.float()) (default; hyperpar's and "
                        "torchtitan's): fp32 log-softmax and two fp32 gradients of the logits' "
                        "size in its backward; fused: a fused kernel keeping the logits and "
                        "making one gradient in their dtype (flash-attn's CrossEntropyLoss, "
                        "llm-foundry's default); torch-lp: eager, with .lp layouts' loss "
                        "parallel by torch's loss_parallel (torchtitan), 16 bytes per logit "
                        "shard in backward")
    p.add_argument("--reduce-dtype", choices=("compute", "float32"), default="compute",
                   help="dtype gradients are reduced in over data-parallel ranks (default: "
                        "the compute dtype)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="layouts with tp compute the loss on vocabulary shards "
                        "(hyperpar.loss_parallel; names end in .lp) instead of all-gathering "
                        "the logits")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fully_shard(reshard_after_forward=False): layers stay gathered from "
                        "forward to backward (one all-gather per microbatch; names end in .nrf)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="layouts with tp run it without sequence parallelism (names end in "
                        ".nosp)")
    p.add_argument("--max-tp", type=int, default=None, metavar="T",
                   help="consider tp up to T only (default: any)")
    p.add_argument("--layout", default=None, metavar="NAME",
                   help="evaluate this one layout, named as the table names them (e.g. "
                        "dp8.fsdp128.tp8.pp16.mb16, optionally .gpipe, .ac, .gstep for "
                        "gradients synced once per step as torch pipelining does): its memory "
                        "and time breakdown, also when it does not fit; MoE configs add "
                        "epN, etpN, capP, nlM, dualpipe and the activation knobs rcnorm, rcup, "
                        "rcswiglu, fp8act, wexpert (docs/planning.md)")
    p.add_argument("--float8", type=float, default=1.0, metavar="F",
                   help="Float8 linears: their FLOP/s times F (default 1, bf16; the H100/H800 "
                        "datasheet ceiling is 2: 1,979 vs 989 TFLOP/s dense; set what your "
                        "run reaches). Attention and the elementwise ops stay in bf16")
    p.add_argument("--compile-fusion", type=float, default=1.0, metavar="F",
                   help="torch.compile: the elementwise ops' HBM traffic divided by F (default "
                        "1, eager; fusion cuts the passes over each activation). Dense models")
    p.add_argument("--a2a-overlap", type=float, default=None, metavar="F",
                   help="MoE: fraction of the all-to-all hidden behind compute (default: "
                        "1 under dualpipe, else 0)")
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
    if args.config:
        try:
            config = _read_config(args.config)
        except (ValueError, FileNotFoundError) as err:
            print(f"hyperpar plan: {err}", file=sys.stderr)
            return 2
        if moe_keys(config):
            return _run_moe(config, args)
    try:
        if not 1 <= args.float8 <= 4 or args.compile_fusion < 1:
            raise ValueError(f"--float8 {args.float8} / --compile-fusion "
                             f"{args.compile_fusion}: factors of at least 1 (float8 at most 4)")
        spec = from_hf_config(args.config) if args.config else example_spec(args.example)
        profile = load_profile(args.profile) if args.profile else get_profile(args.device)
        profile = with_topology(profile, gpus_per_node=args.gpus_per_node,
                                intra_bytes_per_s=args.intra_node_bandwidth,
                                nics_per_node=args.nics_per_node,
                                nic_bytes_per_s=args.nic_bandwidth)
        memory = args.device_memory or profile.memory_bytes
        job = Run(world=args.world, seq_len=args.seq_len, global_batch=args.global_batch,
                  param_dtype=args.param_dtype, optimizer=args.optimizer,
                  gpus_per_node=args.gpus_per_node, device_memory=memory,
                  attention=args.attention, reduce_dtype=args.reduce_dtype,
                  loss=args.loss, float8=args.float8, compile_fusion=args.compile_fusion,
                  optimizer_dtype=args.optimizer_dtype, zero_grad_dtype=args.zero_grad_dtype)
        given = (parse_layout(args.layout, args.schedule, args.virtual_stages) if args.layout
                 else None)
        if args.measure and spec.block != "llama":
            raise ValueError("--measure runs the Llama example (examples/llama); a GPT-style "
                             "block is predicted only: leave out --measure")
        if given is not None and args.measure:
            raise ValueError("--layout evaluates one layout by the model; --measure runs the "
                             "best ones on this machine: give one of them")
        one = evaluate(spec, job, given, profile) if given is not None else None
    except (ValueError, FileNotFoundError) as err:
        print(f"hyperpar plan: {err}", file=sys.stderr)
        return 2
    try:
        if one is not None:
            return _report_one(spec, job, profile, one, args)
        return _report_search(spec, job, profile, args)
    except BrokenPipeError:
        # the reader (`| head`) left: the files were written first; silence the final flush
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _read_config(path: str) -> dict:
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist; give the path of a "
                                "Hugging Face config.json") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path!r} is not valid JSON ({err})") from None


def _run_moe(config: dict, args: argparse.Namespace) -> int:
    """An MoE config: its layouts (ep, etp) by :mod:`.moe_plan`, predicted only."""
    from dataclasses import replace

    from . import moe_report
    from .moe import moe_from_hf_config
    from .moe_plan import moe_evaluate, moe_plan, parse_moe_layout

    try:
        if args.measure:
            raise ValueError("--measure runs the dense Llama example; MoE layouts are "
                             "predicted only (no expert-parallel run to measure yet)")
        if not 1 <= args.float8 <= 4:
            raise ValueError(f"--float8 {args.float8}: a factor from 1 to 4")
        spec = moe_from_hf_config(config, name=os.path.basename(args.config))
        profile = load_profile(args.profile) if args.profile else get_profile(args.device)
        profile = with_topology(profile, gpus_per_node=args.gpus_per_node,
                                intra_bytes_per_s=args.intra_node_bandwidth,
                                nics_per_node=args.nics_per_node,
                                nic_bytes_per_s=args.nic_bandwidth)
        job = Run(world=args.world, seq_len=args.seq_len, global_batch=args.global_batch,
                  param_dtype=args.param_dtype, optimizer=args.optimizer,
                  gpus_per_node=args.gpus_per_node,
                  device_memory=args.device_memory or profile.memory_bytes,
                  reduce_dtype=args.reduce_dtype, loss=args.loss,
                  optimizer_dtype=args.optimizer_dtype, zero_grad_dtype=args.zero_grad_dtype)
        print(moe_report.header(spec, job, profile))
        if args.layout:
            lay = parse_moe_layout(args.layout, args.schedule, args.virtual_stages)
            if args.a2a_overlap is not None:
                lay = replace(lay, a2a_overlap=args.a2a_overlap)
            if lay.world != job.world:
                raise ValueError(f"layout {lay.name} has {lay.world} ranks but --world is "
                                 f"{job.world}")
            one = moe_evaluate(spec, job, lay, profile, float8=args.float8)
            if args.json:
                moe_report.write_json(args.json, spec, job, [one] if one.fits else [],
                                      [] if one.fits else [(lay.name, one.reason)])
            print(moe_report.describe(one))
            return 0 if one.fits else 1
        start = time.perf_counter()
        ranked, ruled, n = moe_plan(spec, job, profile, float8=args.float8,
                                    schedule=args.schedule)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as err:
        print(f"hyperpar plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        moe_report.write_json(args.json, spec, job, ranked, ruled)
    print(moe_report.table(ranked, args.top))
    print(f"\n{len(ruled)} ruled out; searched {n} MoE layouts in {elapsed:.2f} s")
    if ranked:
        print(moe_report.describe(ranked[0]))
    return 0 if ranked else 1


def _report_one(spec: ModelSpec, job: Run, profile: DeviceProfile, one: Candidate | RuledOut,
                args: argparse.Namespace) -> int:
    result = PlanResult(spec, job, profile, considered=1)
    if isinstance(one, Candidate):
        result.ranked.append(one)
    else:
        result.ruled_out.append(one)
    if args.json:
        write_json(result, args.json)
    print(describe_one(result, one))
    if args.json:
        print(f"wrote {args.json}")
    return 0 if result.ranked else 1


def _report_search(spec: ModelSpec, job: Run, profile: DeviceProfile,
                   args: argparse.Namespace) -> int:
    start = time.perf_counter()
    result = plan(spec, job, profile, schedule=args.schedule, max_tp=args.max_tp,
                  loss_parallel=args.loss_parallel, virtual_stages=args.virtual_stages,
                  reshard_after_forward=not args.no_reshard_after_forward,
                  sequence_parallel=not args.no_sequence_parallel)
    elapsed = time.perf_counter() - start
    if args.measure:
        from .measure import measure_top

        measure_top(result, spec, args)
    # files first: a reader that stops early (`| head`) must not cost them
    written = plot(result, args.plot) if args.plot else None
    if args.json:
        write_json(result, args.json)
    print(table(result, args.top))
    print()
    print(ruled_out_summary(result))
    print(f"\nsearched {result.considered} layouts in {elapsed:.2f} s")
    if args.json:
        print(f"wrote {args.json}")
    if written:
        print(f"wrote {written}")
    return 0 if result.ranked else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyperpar plan", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
