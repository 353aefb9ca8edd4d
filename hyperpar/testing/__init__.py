"""Testing tools for hyperpar and its backends: a multi-process harness, parity helpers, the
device emulations and the backend conformance kit (a pytest plugin)."""

from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use (PEP 562): the pytest plugin in this package is loaded into every pytest
# session, and the harness imports torch through the platform.
_EXPORTS = {
    "DistributedError": "harness",
    "WorkerPool": "harness",
    "free_port": "harness",
    "run_distributed": "harness",
    "assert_close_to_reference": "parity",
}

__all__ = [
    "DistributedError",
    "WorkerPool",
    "assert_close_to_reference",
    "free_port",
    "run_distributed",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpar.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
