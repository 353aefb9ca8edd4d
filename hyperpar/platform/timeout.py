"""The collective timeout every backend uses, read from ``HYPERPAR_TIMEOUT`` (framework-neutral:
``hyperpar run`` checks it before launching, in a venv that may have no torch)."""

from __future__ import annotations

import math
import os

DEFAULT_TIMEOUT_S = 300.0


def default_timeout_s() -> float:
    """Collective timeout in seconds: ``HYPERPAR_TIMEOUT`` if set, else 300.

    Raises ``ValueError`` naming the variable when it is not a positive, finite number.
    """
    raw = os.environ.get("HYPERPAR_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"HYPERPAR_TIMEOUT={raw!r} is not a collective timeout: it must be a positive "
            f"number of seconds, e.g. HYPERPAR_TIMEOUT=300 (or unset it for the default 300)"
        )
    return value
