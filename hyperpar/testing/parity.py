"""Parity helpers: compare a parallel run against the same computation in one process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

#: Default tolerances for float32 parity (reductions in another order differ by ~1e-6).
RTOL = 1e-5
ATOL = 1e-5


def assert_close_to_reference(actual: object, expected: object, *, rtol: float = RTOL,
                              atol: float = ATOL, what: str = "value") -> None:
    """Assert that ``actual`` equals ``expected`` within tolerance, recursing into sequences and
    mappings of tensors; the error names the path of the first mismatch."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{what}: expected a mapping, got {type(actual)}"
        assert set(actual) == set(expected), (
            f"{what}: keys differ: missing {sorted(set(expected) - set(actual))}, "
            f"extra {sorted(set(actual) - set(expected))}"
        )
        for key in expected:
            assert_close_to_reference(actual[key], expected[key], rtol=rtol, atol=atol,
                                      what=f"{what}[{key!r}]")
        return
    if isinstance(expected, Sequence) and not isinstance(expected, str):
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close_to_reference(a, e, rtol=rtol, atol=atol, what=f"{what}[{i}]")
        return
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), rtol=rtol,
                               atol=atol, msg=lambda m: f"{what}: {m}")
