"""The reduce-scatter probe agrees with the installed torch's real gloo process group, and
``hyperpar info`` lists exactly the ops it found wrong (torch 2.6: max, min, product)."""

import torch
import torch.distributed as dist

OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def _native_vs_probe():
    from hyperpar.platform import get_platform, probes

    p = get_platform()
    n, r = p.world_size(), p.rank()
    native_ok = {}
    for op, torch_op in OPS.items():
        inputs = [torch.arange(2 * n, dtype=torch.float32) * (i + 1) - 3 for i in range(n)]
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, inputs[r], torch_op)  # the library, not hyperpar
        expected = {"max": torch.stack(inputs).amax(0), "min": torch.stack(inputs).amin(0),
                    "product": torch.stack(inputs).prod(0)}[op][2 * r: 2 * r + 2]
        native_ok[op] = torch.equal(out, expected)
    return native_ok, probes.reduce_scatter_verdicts(p.dist_backend), p.collective_fallbacks()


def test_probe_verdict_matches_the_process_groups_own_answer(run_on_ranks):
    for native_ok, verdicts, fallbacks in run_on_ranks(2, _native_vs_probe):
        assert verdicts == native_ok, f"torch {torch.__version__}"
        listed = {k for k in fallbacks if k.startswith("reduce_scatter op")}
        assert listed == {f"reduce_scatter op {op!r}" for op, ok in native_ok.items() if not ok}
