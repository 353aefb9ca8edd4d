"""Testing tools for hyperpar and its backends: a multi-process harness, parity helpers, the
device emulations and the backend conformance kit (a pytest plugin).

Names are resolved lazily (PEP 562): the pytest plugin loads this package in every pytest run,
including a venv with MindSpore and no torch, where the torch parity helpers cannot import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DistributedError": ".harness",
    "WorkerPool": ".harness",
    "free_port": ".harness",
    "run_distributed": ".harness",
    "assert_close_to_reference": ".parity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpar.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
