"""The DTensor API's mistakes, one body for torch and MindSpore, on 2 real ranks.

``from_local``, ``redistribute`` and ``distribute_tensor`` decide their arguments in one
framework-neutral module (:mod:`hyperpar.dtensor.api_core`), so the same mistake raises the same
error type on both frameworks: the type ``torch.distributed.tensor`` (2.13) raises for it. What
torch accepts (``distribute_tensor`` of a DTensor already laid out so: returned as it is) is
accepted on both. Each error but the one-rank local-shape check must be raised on every rank
before any collective: the case list ends with a ``distribute_tensor`` + ``full_tensor`` that
would fail or hang if an earlier case had left a rank inside a collective.

In the torch venv the cases that torch's own DTensor refuses alike are also run through
``torch.distributed.tensor`` on the same ranks, so a torch release that changes its error type
fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hyperpar import Replicate, Shard
from tests.both._frameworks import get

pytestmark = pytest.mark.timeout(900)

#: case -> (error type, words the message must hold), or None: accepted
EXPECTED: dict[str, tuple[str, str] | None] = {
    "from_local of a DTensor": ("RuntimeError", "got a DTensor"),
    "from_local run_check, uneven local shapes": ("ValueError", "local shapes disagree"),
    "redistribute without placements": ("RuntimeError", "placements= is required"),
    "redistribute to another mesh": ("NotImplementedError", "across meshes"),
    "redistribute to Partial('product')": ("RuntimeError", "Partial('product')"),
    "redistribute to Partial('sum')": None,
    "distribute_tensor of a DTensor laid out so": None,
    "distribute_tensor of a DTensor, other placements": ("ValueError", "redistribute"),
    "distribute_tensor to Partial('product')": ("ValueError", "Partial('product')"),
    "distribute_tensor, src_data_rank=2": ("ValueError", "src_data_rank=2"),
    "distribute_tensor, src_data_rank=-1": ("ValueError", "src_data_rank=-1"),
}
#: the cases torch's own DTensor refuses as well (it accepts the others or cannot run them)
TORCH_REFUSES_ALIKE = ("from_local of a DTensor", "from_local run_check, uneven local shapes",
                       "redistribute without placements", "redistribute to Partial('product')",
                       "distribute_tensor of a DTensor, other placements",
                       "distribute_tensor to Partial('product')")


def _cases(api: Any, mesh: Any, other_mesh: Any, x: Any, rows: Any) -> dict[str, Callable]:
    """Each case as a call; ``api`` has ``DTensor``, ``distribute_tensor`` and the placements
    (hyperpar's public names, or torch.distributed.tensor)."""
    DTensor, dist = api.DTensor, api.distribute_tensor
    S0, R, prod = api.Shard(0), api.Replicate(), api.Partial("product")
    d = dist(x, mesh, [S0])
    rep = dist(x, mesh, [R])
    return {
        "from_local of a DTensor": lambda: DTensor.from_local(d, mesh, [S0]),
        "from_local run_check, uneven local shapes":
            lambda: DTensor.from_local(rows, mesh, [S0], run_check=True),
        "redistribute without placements": lambda: d.redistribute(mesh, None),
        "redistribute to another mesh": lambda: d.redistribute(other_mesh, [R]),
        "redistribute to Partial('product')": lambda: rep.redistribute(mesh, [prod]),
        "redistribute to Partial('sum')": lambda: rep.redistribute(mesh, [api.Partial("sum")]),
        "distribute_tensor of a DTensor laid out so": lambda: dist(d, mesh, [S0]) is d or "copy",
        "distribute_tensor of a DTensor, other placements": lambda: dist(d, mesh, [R]),
        "distribute_tensor to Partial('product')": lambda: dist(x, mesh, [prod]),
        "distribute_tensor, src_data_rank=2": lambda: dist(x, mesh, [S0], src_data_rank=2),
        "distribute_tensor, src_data_rank=-1": lambda: dist(x, mesh, [S0], src_data_rank=-1),
    }


def _outcomes(cases: dict[str, Callable], names: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        try:
            r = cases[name]()
            out[name] = r if isinstance(r, str) else None
        except Exception as exc:  # noqa: BLE001 - the type is what the test compares
            out[name] = (type(exc).__name__, str(exc))
    return out


def _run(framework: str) -> dict[str, Any]:
    import hyperpar
    from hyperpar import DTensor, init_device_mesh

    fw = get(framework)
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    other = init_device_mesh((2,), mesh_dim_names=("other",))
    rank = mesh.get_local_rank()
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    rows = fw.tensor(np.ones((3 - rank, 3), np.float32))  # 3 rows on rank 0, 2 on rank 1
    res = {"hyperpar": _outcomes(_cases(hyperpar, mesh, other, fw.tensor(x), rows), EXPECTED)}
    # given shape=: only the rank whose piece is wrong knows it (rank 1 holds 2 of 5 rows)
    try:
        DTensor.from_local(fw.tensor(np.ones((3, 3), np.float32)), mesh, [Shard(0)],
                           shape=(5, 3))
        res["wrong piece"] = None
    except ValueError as exc:
        res["wrong piece"] = str(exc)
    # no rank was left inside a collective: this one still pairs up
    res["full"] = fw.numpy(hyperpar.distribute_tensor(fw.tensor(x), mesh, [Shard(0)])
                           .full_tensor())
    res["default placements"] = tuple(hyperpar.distribute_tensor(fw.tensor(x), mesh).placements)
    if framework == "torch":
        import torch.distributed.tensor as tdt
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        tmesh = torch_mesh("cpu", (2,))
        same = "distribute_tensor of a DTensor laid out so"
        res["torch"] = _outcomes(_cases(tdt, tmesh, None, fw.tensor(x), rows),
                                 (*TORCH_REFUSES_ALIKE, same))
    return res


def test_api_mistakes_raise_torchs_error_types_on_every_rank(framework, pool) -> None:
    for rank, res in enumerate(pool(2).run(_run, framework)):
        for name, want in EXPECTED.items():
            got = res["hyperpar"][name]
            if want is None:
                assert got is None, (rank, name, got)
                continue
            assert got is not None and got[0] == want[0] and want[1] in got[1], (rank, name, got)
        if rank == 1:
            assert "does not match (2, 3)" in res["wrong piece"], res["wrong piece"]
        else:
            assert res["wrong piece"] is None, res["wrong piece"]
        np.testing.assert_array_equal(res["full"], np.arange(12, dtype=np.float32).reshape(4, 3))
        assert res["default placements"] == (Replicate(),)
        if framework == "torch":
            for name in TORCH_REFUSES_ALIKE:
                assert res["torch"][name][0] == EXPECTED[name][0], (name, res["torch"][name])
            assert res["torch"]["distribute_tensor of a DTensor laid out so"] is None
