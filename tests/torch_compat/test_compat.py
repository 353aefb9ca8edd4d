"""Every case of ``_cases.py`` runs the same script body against torch-native and against
hyperpar (only the imports differ) on 2 and 4 gloo ranks; hyperpar must pass where torch
passes, with the same outputs, gradients and placements (within 1e-5), and must raise where
torch raises on bad input. Behaviours hyperpar chose to differ on are listed in
``KNOWN_DIFFERENCES`` and in docs/migration.md."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _apis import missing_in_torch
from _cases import CASES, run_cases

WORLDS = (2, 4)
TOL = 1e-5

#: case -> (what hyperpar does instead, why). Each is asserted, not skipped.
KNOWN_DIFFERENCES: dict[str, tuple[str, str]] = {
    "unmatched_plan_key": (
        "PlanKeyError",
        "torch warns and skips a plan key that matches no submodule; a typo then leaves the "
        "layer unsharded silently, so hyperpar raises and names the closest paths"),
}


#: case -> (first torch measured with today's behaviour, what older torch does). hyperpar follows
#: the newer torch; measured: these differ on 2.6.0, agree on 2.13 and 2.14.1.
NEWER_TORCH_BEHAVIOUR: dict[str, tuple[tuple[int, int], str]] = {
    "root_key": ((2, 13), "torch 2.6 ignores plan key '' (the root module)"),
    "error_from_local_of_dtensor": ((2, 13), "torch 2.6 accepts a DTensor in from_local"),
    "error_distribute_module_twice": ((2, 13), "torch 2.6 lets distribute_module run twice"),
}


def _older_torch_reason(name: str) -> str | None:
    if name not in NEWER_TORCH_BEHAVIOUR:
        return None
    since, what = NEWER_TORCH_BEHAVIOUR[name]
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return f"{what}; hyperpar follows torch >= {since[0]}.{since[1]}" if version < since else None


@pytest.fixture(scope="module")
def results(run_batch: Any) -> Any:
    cache: dict[int, Any] = {}

    def get(n: int) -> list[dict[str, Any]]:
        if n not in cache:  # one batch per world size; a failed batch is not re-run per case
            try:
                cache[n] = run_batch(n, run_cases, sorted(CASES))
            except Exception as exc:  # noqa: BLE001
                cache[n] = exc
        if isinstance(cache[n], Exception):
            raise cache[n]
        return cache[n]

    return get


def differences(theirs: Any, ours: Any, path: str = "") -> list[str]:
    """Where ``ours`` differs from ``theirs`` (torch's); a part torch could not compute
    (recorded as ``"raised ..."``) is not compared."""
    if isinstance(theirs, str) and theirs.startswith("raised "):
        return []
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor):
            return [f"{path}: torch gave a tensor, hyperpar {ours!r}"]
        if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
            return [f"{path}: shape/dtype {tuple(theirs.shape)}/{theirs.dtype} vs "
                    f"{tuple(ours.shape)}/{ours.dtype}"]
        if not torch.allclose(theirs.double(), ours.double(), atol=TOL, rtol=TOL,
                              equal_nan=True):
            err = (theirs.double() - ours.double()).abs().max().item()
            return [f"{path}: max difference {err:.3g}"]
        return []
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or set(theirs) - set(ours):
            return [f"{path}: keys {sorted(map(str, theirs))} vs "
                    f"{sorted(map(str, ours)) if isinstance(ours, dict) else ours!r}"]
        return [d for k in theirs for d in differences(theirs[k], ours[k], f"{path}.{k}")]
    if isinstance(theirs, tuple | list):
        if not isinstance(ours, tuple | list) or len(theirs) != len(ours):
            return [f"{path}: {theirs!r} vs {ours!r}"]
        return [d for i, (a, b) in enumerate(zip(theirs, ours, strict=True))
                for d in differences(a, b, f"{path}[{i}]")]
    return [] if theirs == ours else [f"{path}: {theirs!r} vs {ours!r}"]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_as_torch(results: Any, name: str, n: int) -> None:
    lacking = sorted(missing_in_torch() & set(CASES[name].__code__.co_names))
    if lacking:
        pytest.skip(f"torch {torch.__version__} has no {', '.join(lacking)} to compare with")
    if _older_torch_reason(name):
        pytest.skip(_older_torch_reason(name))
    per_rank = results(n)
    for rank, res in enumerate(per_rank):
        (t_status, t_value), (h_status, h_value) = res[name]["torch"], res[name]["hyperpar"]
        if name in KNOWN_DIFFERENCES:
            expected, _why = KNOWN_DIFFERENCES[name]
            assert h_status == "raised" and h_value.startswith(expected), (rank, h_value)
            continue
        if t_status == "raised":
            if name.startswith("error_"):
                assert h_status == "raised", (
                    f"rank {rank}: torch raises ({t_value}) but hyperpar returned {h_value!r}")
                continue
            pytest.skip(f"torch-native fails this case: {t_value}")
        assert h_status == "ok", f"rank {rank}: torch passes, hyperpar raised {h_value}"
        diffs = differences(t_value, h_value, name)
        assert not diffs, f"rank {rank}:\n" + "\n".join(diffs[:20])


def test_every_error_case_raises_in_torch_too(results: Any) -> None:
    """An ``error_`` case documents an error torch raises: it must raise there."""
    for name in (c for c in CASES if c.startswith("error_") and not _older_torch_reason(c)):
        status, value = results(2)[0][name]["torch"]
        assert status == "raised", f"{name}: torch did not raise ({value!r})"
