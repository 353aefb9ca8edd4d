"""Testing tools for hyperpar and its backends: a multi-process harness, parity helpers, the
device emulations and the backend conformance kit (a pytest plugin)."""

from .harness import DistributedError, WorkerPool, free_port, run_distributed
from .parity import assert_close_to_reference

__all__ = [
    "DistributedError",
    "WorkerPool",
    "assert_close_to_reference",
    "free_port",
    "run_distributed",
]
