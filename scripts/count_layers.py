#!/usr/bin/env python3
"""Count the non-blank lines of DTensor + tensor parallelism per layer: the framework-neutral
core, the torch stack and the MindSpore backend's mechanics (the file sets docs/architecture.md
names), and the framework-specific share (issue 29's goal: at most 25%).

Usage: ``python scripts/count_layers.py [--files] [ROOT]`` (ROOT defaults to this checkout).
The last line also gives the share without :data:`TORCH_ONLY`, the torch features MindSpore has
no counterpart for (a second view for comparison; the goal is stated on the full count)."""

from __future__ import annotations

import sys
from pathlib import Path

MS = "backends/hyperpar-mindspore/hyperpar_mindspore"
#: layer -> glob patterns relative to the repository root
LAYERS: dict[str, list[str]] = {
    "core": ["hyperpar/dtensor/api_core.py", "hyperpar/dtensor/errors.py",
             "hyperpar/dtensor/layout.py",
             "hyperpar/dtensor/mesh.py", "hyperpar/dtensor/placement.py",
             "hyperpar/dtensor/remesh.py",
             "hyperpar/dtensor/rules/*.py", "hyperpar/parallel/spec.py",
             "hyperpar/parallel/driver.py", "hyperpar/parallel/styles.py",
             "hyperpar/parallel/loss_plan.py", "hyperpar/parallel/easydel.py",
             "hyperpar/parallel/prepare_plan.py", "hyperpar/parallel/layer_plan.py",
             "hyperpar/platform/dim_collectives.py",
             # the MoE core (deepspeed.py there is a torch-only re-export: counted as torch)
             "hyperpar/moe/__init__.py", "hyperpar/moe/errors.py", "hyperpar/moe/placement.py",
             "hyperpar/moe/routing.py", "hyperpar/moe/exchange.py", "hyperpar/moe/styles.py"],
    "torch": ["hyperpar/torch/**/*.py", "hyperpar/moe/deepspeed.py"],
    "mindspore": [f"{MS}/{n}.py" for n in ("dtensor", "dtensor_core", "dispatch", "opnames",
                                            "redistribute", "localops", "lossops", "listops",
                                            "loss", "parallel", "prepare", "comm", "graph",
                                            "layers", "param_readback", "gradwrap",
                                            "moe", "moe_styles")],
}

#: torch stack files of features with no MindSpore counterpart (factories and nn.init, foreach,
#: random, local_map, functional collectives, distribute_module, complex views, custom autograd
#: Functions over DTensors, the debug input checks)
TORCH_ONLY: list[str] = [f"hyperpar/torch/{n}.py" for n in (
    "dtensor/factories", "dtensor/_ops/factory", "dtensor/_ops/foreach", "dtensor/random",
    "dtensor/local_map", "dtensor/functional_collectives", "dtensor/module",
    "dtensor/_ops/complex", "dtensor/autograd_function", "parallel/_debug_checks")]


def non_blank(path: Path) -> int:
    """Lines of ``path`` holding anything but whitespace."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def count(root: Path) -> dict[str, dict[str, int]]:
    """layer -> {file: non-blank lines} under ``root``."""
    out: dict[str, dict[str, int]] = {}
    for layer, patterns in LAYERS.items():
        files = sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()})
        out[layer] = {str(p.relative_to(root)): non_blank(p) for p in files}
    return out


def main(argv: list[str]) -> int:
    show = "--files" in argv
    args = [a for a in argv if a != "--files"]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    counts = count(root)
    totals = {layer: sum(files.values()) for layer, files in counts.items()}
    for layer, files in counts.items():
        if show:
            for name, n in files.items():
                print(f"  {n:6,d}  {name}")
        print(f"{layer:10s} {totals[layer]:7,d}")
    specific = totals["torch"] + totals["mindspore"]
    print(f"framework-specific: {specific:,d} of {sum(totals.values()):,d} = "
          f"{100 * specific / sum(totals.values()):.0f}% (goal <= 25%)")
    torch_only = sum(n for name, n in counts["torch"].items() if name in TORCH_ONLY)
    shared = sum(totals.values()) - torch_only
    print(f"without the torch-only features ({torch_only:,d} lines): "
          f"{specific - torch_only:,d} of {shared:,d} = "
          f"{100 * (specific - torch_only) / shared:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
