"""hyperpar: hardware-agnostic tensor, sequence, pipeline and data parallelism for PyTorch.

Public names are re-exported lazily (PEP 562) so ``import hyperpar`` stays cheap and never
resolves a backend at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # platform
    "Platform": "hyperpar.platform",
    "get_platform": "hyperpar.platform",
    "set_backend": "hyperpar.platform",
    "BackendError": "hyperpar.platform",
    # testing
    "run_distributed": "hyperpar.testing",
    "WorkerPool": "hyperpar.testing",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
