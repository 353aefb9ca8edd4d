"""One torchtitan training run on CPU ranks, native or on hyperpar; per-step losses to JSON.

    torchrun --nproc-per-node N run.py TREE OUT.json [torchtitan args...]   # OUT.json.rankR

TREE is a patched copy (``trees/native`` or ``trees/hyperpar``, made by setup.sh). This file is
torchtitan's ``train.main`` without its logging set-up, plus two things both runs share: every
parameter is overwritten with the same values (drawn per parameter name from a fixed seed, then
laid out with the run's own ``distribute_tensor``), so both runs start from the same weights
whatever their random-number layout; and the loss and gradient norm of each step are recorded.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

TREE, OUT = sys.argv[1], sys.argv[2]
sys.argv = [sys.argv[0], *sys.argv[3:]]
sys.path.insert(0, TREE)

import torch  # noqa: E402

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _canonical(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _full_value(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if len(shape) == 1:  # norm weights
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


@torch.no_grad()
def same_initial_weights(model_parts: list[torch.nn.Module], hyperpar: bool) -> int:
    """Overwrite every parameter with its name's values; returns how many were set."""
    if hyperpar:
        from hyperpar.dtensor import distribute_tensor
    else:
        from torch.distributed.tensor import distribute_tensor
    n = 0
    for part in model_parts:
        for name, p in part.named_parameters():
            full = _full_value(_canonical(name), p.shape, p.dtype)
            if hasattr(p, "device_mesh") and hasattr(p, "to_local"):
                local = distribute_tensor(full, p.device_mesh, p.placements,
                                          src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)
            n += 1
    return n


def main() -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args()
    trainer = config.build()
    hyperpar = "hyperpar" in os.path.basename(os.path.normpath(TREE))
    n = same_initial_weights(trainer.model_parts, hyperpar)
    first = next(trainer.model_parts[0].parameters())
    first_type = f"{type(first).__module__}.{type(first).__qualname__}"  # whose DTensor ran
    records: list[dict] = []
    log = trainer.metrics_processor.log

    def recording_log(step, global_avg_loss, global_max_loss, grad_norm, *a, **kw):
        records.append({"step": int(step), "loss": float(global_avg_loss),
                        "grad_norm": float(grad_norm)})
        return log(step, global_avg_loss, global_max_loss, grad_norm, *a, **kw)

    trainer.metrics_processor.log = recording_log
    try:
        trainer.train()
    finally:
        trainer.close()
    # Every rank writes its own record; under PP only the last stage's ranks know the loss
    # (the others log -1), so readers take the first rank whose losses are real.
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{OUT}.rank{rank}", "w") as f:
        json.dump({"params_set": n, "param_type": first_type, "steps": records}, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
