"""Inside ``torch.compile`` the platform's reduce-scatter gives the reduced rows for every op
(torch 2.6's gloo answers max/min/product with the sum: the compiled path must not trust it
unless the probe measured it correct)."""

import torch

OPS = ("sum", "max", "min", "product")


def _compiled_reduce_scatter():
    from hyperpar.platform import get_platform

    p = get_platform()
    n, r = p.world_size(), p.rank()

    def rank_input(i):
        return torch.arange(4.0 * n).view(2 * n, 2) * (i + 1) - 5 * i

    wrong = []
    for op in OPS:
        def step(x, op=op):
            out = torch.empty(2, 2)
            p.reduce_scatter_tensor(out, x, op)
            return out * 1.0

        got = torch.compile(step, backend="aot_eager", fullgraph=True)(rank_input(r))
        stacked = torch.stack([rank_input(i) for i in range(n)])
        full = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0),
                "product": stacked.prod(0)}[op]
        if not torch.equal(got, full[2 * r: 2 * r + 2]):
            wrong.append(f"{op}: got {got.tolist()}, expected {full[2 * r: 2 * r + 2].tolist()}")
    return wrong


def test_compiled_reduce_scatter_reduces_with_every_op(run_on_ranks):
    assert run_on_ranks(2, _compiled_reduce_scatter) == [[], []]
