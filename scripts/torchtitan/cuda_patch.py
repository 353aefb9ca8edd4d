"""Patch torchtitan's own CUDA assumptions so that it runs on CPU ranks (gloo).

    python cuda_patch.py PATH/TO/torchtitan      # patches the tree in place

Applied to both the native and the hyperpar copy, so the two runs differ only in their
distributed imports. Each edit replaces one exact snippet and fails loudly when the snippet is
not found (a torchtitan version this patch was not written for). Patched lines say
``[cuda_patch]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CPU_MODULE = '''

class _CpuDeviceModule:
    """[cuda_patch] torch.cpu plus the torch.cuda calls torchtitan makes (no memory stats)."""

    class memory:  # noqa: N801
        @staticmethod
        def _record_memory_history(*args, **kwargs):
            return None

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def set_device(self, device):
        return None

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def get_device_name(self, device=None):
        return "cpu"

    def get_device_properties(self, device=None):
        import types
        return types.SimpleNamespace(
            name="cpu",
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def reset_peak_memory_stats(self, device=None):
        return None

    def empty_cache(self):
        return None

    def memory_stats(self, device=None):
        return {}
'''


_SDPA_HELPER = '''def _sdpa_with_block_mask(q, k, v, block_mask, scale, enable_gqa, return_aux):
    """[cuda_patch] SDPA over the token-level mask of ``block_mask`` (its mask_mod)."""
    from torch.nn.attention.flex_attention import create_mask

    if return_aux is not None and getattr(return_aux, "lse", False):
        raise NotImplementedError("cuda_patch: the SDPA stand-in returns no lse")
    B, _, q_len, kv_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, B, None, q_len, kv_len, device="cpu")
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
'''

# (file, old, new, why)
EDITS: list[tuple[str, str, str, str]] = [
    ("tools/utils.py",
     '    device_type = _get_available_device_type() or "cuda"\n'
     "    device_module = _get_device_module(device_type)  # default device_module:torch.cuda\n"
     "    return device_type, device_module\n",
     '    device_type = _get_available_device_type() or "cpu"  # [cuda_patch] was "cuda"\n'
     '    if device_type == "cpu":\n'
     "        return device_type, _CpuDeviceModule()\n"
     "    device_module = _get_device_module(device_type)  # default device_module:torch.cuda\n"
     "    return device_type, device_module\n" + _CPU_MODULE,
     "no accelerator: torchtitan defaults to CUDA and reads torch.cuda's memory statistics"),
    ("tools/utils.py",
     "    return torch.device(device_type, device_index)\n",
     '    if device_type == "cpu":  # [cuda_patch] a CPU device has no index\n'
     '        return torch.device("cpu")\n'
     "    return torch.device(device_type, device_index)\n",
     "CPU tensors cannot live on cpu:1"),
    ("distributed/utils.py",
     "    torch.distributed.barrier(device_ids=[device_module.current_device()])\n",
     '    if device_type == "cpu":  # [cuda_patch] gloo takes no device_ids\n'
     "        torch.distributed.barrier()\n"
     "    else:\n"
     "        torch.distributed.barrier(device_ids=[device_module.current_device()])\n",
     "barrier(device_ids=) is NCCL-only"),
    ("models/common/attention.py",
     "        with spmd.no_typecheck():\n"
     "            out, aux = FlexAttention._compiled_flex_attn(\n",
     "        if q.device.type == \"cpu\":  # [cuda_patch] no FlexAttention backward on CPU\n"
     "            return _sdpa_with_block_mask(q, k, v, block_mask, scale, enable_gqa,\n"
     "                                         return_aux), None\n"
     "        with spmd.no_typecheck():\n"
     "            out, aux = FlexAttention._compiled_flex_attn(\n",
     "FlexAttention has no backward on CPU: SDPA with the same (dense) mask"),
    ("models/common/attention.py",
     "class FlexAttention(Module):\n",
     _SDPA_HELPER + "\n\nclass FlexAttention(Module):\n",
     "the SDPA stand-in for FlexAttention on CPU"),
    ("distributed/fsdp.py",
     "            module.set_gradient_divide_factor(1.0)\n",
     "            module.set_gradient_divide_factor(1.0)\n"
     "            if device_type == \"cpu\":  # [cuda_patch] gloo has no PREMUL_SUM\n"
     "                module.set_force_sum_reduction_for_comms(True)\n",
     "a divide factor makes FSDP reduce with PREMUL_SUM, which gloo lacks"),
    ("distributed/fsdp.py",
     "from torch.distributed._composable.fsdp import FSDPModule\n",
     "from torch.distributed._composable.fsdp import FSDPModule\n"
     "from torchtitan.tools.utils import device_type  # [cuda_patch]\n",
     "device_type for the PREMUL_SUM edit"),
]


def apply(root: Path) -> int:
    """Apply every edit under ``root``; returns how many."""
    for rel, old, new, why in EDITS:
        path = root / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"cuda_patch: {rel}: expected exactly one {old[:60]!r} "
                             f"({why}); found {text.count(old)} -- another torchtitan version?")
        path.write_text(text.replace(old, new))
    return len(EDITS)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0], "__init__.py").is_file():
        print("usage: cuda_patch.py PATH/TO/torchtitan", file=sys.stderr)
        return 2
    print(f"cuda_patch: {apply(Path(argv[0]))} edits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
