"""Point a copy of torchtitan's distributed imports at hyperpar's -- imports only.

    python rewrite_imports.py PATH/TO/torchtitan      # rewrites the tree in place

Only ``import`` / ``from ... import`` lines of torch's public parallel modules change; every other
line, and every private torch module (``torch.distributed.tensor._random``,
``torch.distributed.fsdp._fully_shard...``, context-parallel internals, checkpoint, c10d), is left
as it is. Prints each rewritten line and, at the end, the private imports it left alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# Longest module first: a prefix must not win over a more specific entry.
MODULES = {
    "torch.distributed.tensor.parallel": "hyperpar.parallel",
    "torch.distributed.tensor.placement_types": "hyperpar.dtensor",
    "torch.distributed.tensor.experimental": "hyperpar.dtensor.experimental",
    "torch.distributed.tensor": "hyperpar.dtensor",
    "torch.distributed._tensor": "hyperpar.dtensor",
    "torch.distributed.device_mesh": "hyperpar.dtensor",
    "torch.distributed._composable.fsdp.fully_shard": "hyperpar.fsdp",
    "torch.distributed._composable.fsdp": "hyperpar.fsdp",
    "torch.distributed.fsdp": "hyperpar.fsdp",
    "torch.distributed.pipelining.schedules": "hyperpar.pipelining",
    "torch.distributed.pipelining.stage": "hyperpar.pipelining",
    "torch.distributed.pipelining": "hyperpar.pipelining",
    "torch.distributed._functional_collectives": "hyperpar.dtensor.functional_collectives",
}
_FROM = re.compile(r"^(\s*)from\s+([\w.]+)\s+import\b")
_IMPORT_AS = re.compile(r"^(\s*)import\s+([\w.]+)\s+as\s+(\w+)\s*$")


def rewrite_line(line: str) -> tuple[str, str | None]:
    """The rewritten line and, when a torch.distributed import was kept, its module."""
    m = _FROM.match(line)
    if m and m.group(2).startswith("torch.distributed"):
        target = MODULES.get(m.group(2))
        if target is None:
            return line, m.group(2)
        return line[:m.start(2)] + target + line[m.end(2):], None
    m = _IMPORT_AS.match(line)
    if m and m.group(2).startswith("torch.distributed"):
        target = MODULES.get(m.group(2))
        if target is None:
            return line, m.group(2)
        return f"{m.group(1)}import {target} as {m.group(3)}\n", None
    return line, None


def rewrite_tree(root: Path) -> tuple[int, dict[str, int]]:
    """Rewrite every .py file under ``root``; (lines changed, kept torch modules -> count)."""
    changed, kept = 0, {}
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines(keepends=True)
        out = []
        for line in lines:
            new, kept_mod = rewrite_line(line)
            if kept_mod is not None:
                kept[kept_mod] = kept.get(kept_mod, 0) + 1
            if new != line:
                changed += 1
            out.append(new)
        if out != lines:
            path.write_text("".join(out))
    return changed, kept


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0], "__init__.py").is_file():
        print("usage: rewrite_imports.py PATH/TO/torchtitan (a copy of the package)",
              file=sys.stderr)
        return 2
    changed, kept = rewrite_tree(Path(argv[0]))
    print(f"rewrite_imports: {changed} import lines now point at hyperpar")
    for mod, n in sorted(kept.items()):
        print(f"  kept (torch): {mod} x{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
