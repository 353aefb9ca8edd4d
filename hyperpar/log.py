"""Rank-aware logging for training scripts: rank-0-only loggers, a progress line, a quiet switch.

>>> from hyperpar.log import get_logger, Progress
>>> log = get_logger(__name__)                   # doctest: +SKIP
>>> log.info("model has %d parameters", n)       # printed once, by rank 0
>>> progress = Progress(total_steps=100, tokens_per_step=batch * seq)
>>> for step in range(100):
...     loss = train_step()
...     progress.step(loss)                      # "step 10/100 | loss 2.3012 | 51,200 tok/s"

The rank is read at each call, not at import: the process group's rank once the platform has
joined one, else the ``RANK`` environment variable that ``torchrun``/``hyperpar run`` set, else 0.

Quiet mode (``HYPERPAR_QUIET=1``, ``hyperpar run --quiet`` or :func:`set_quiet`) silences
progress lines and INFO/DEBUG messages; warnings and errors are always shown.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, TextIO

QUIET_ENV = "HYPERPAR_QUIET"
_TRUE = ("1", "true", "yes", "on")

_quiet_override: bool | None = None


def set_quiet(quiet: bool | None) -> None:
    """Force quiet mode on or off for this process; ``None`` goes back to ``HYPERPAR_QUIET``."""
    global _quiet_override
    _quiet_override = quiet


def is_quiet() -> bool:
    """True when progress lines and INFO messages are suppressed."""
    if _quiet_override is not None:
        return _quiet_override
    return os.environ.get(QUIET_ENV, "").strip().lower() in _TRUE


def current_rank() -> int:
    """This process's global rank: the platform's once a process group exists, else the
    ``RANK`` environment variable, else 0. Never starts or selects anything new."""
    try:
        from hyperpar.platform import BackendError, get_platform

        try:
            platform = get_platform()
        except BackendError:
            platform = None
        if platform is not None and platform.is_initialized():
            return int(platform.rank())
    except Exception:  # logging must never be the thing that crashes a run
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def is_rank_zero() -> bool:
    """True on global rank 0 (and in a single process)."""
    return current_rank() == 0


class _RankFilter(logging.Filter):
    """Drops records from ranks other than 0 (unless ``all_ranks``) and INFO/DEBUG in quiet
    mode; stamps each record with ``rank``."""

    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        if record.levelno < logging.WARNING and is_quiet():
            return False
        return self.all_ranks or rank == 0


def get_logger(name: str = "hyperpar", *, all_ranks: bool = False,
               level: int = logging.INFO, stream: TextIO | None = None) -> logging.Logger:
    """A logger that prints on rank 0 only (every rank with ``all_ranks=True``, each line then
    prefixed with ``[rank N]``), honours quiet mode, and writes to ``stream`` (stderr).

    Calling it again with the same name returns the same logger, reconfigured.
    """
    logger = logging.getLogger(name)
    for h in [h for h in logger.handlers if getattr(h, "_hyperpar", False)]:
        logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._hyperpar = True  # type: ignore[attr-defined]
    # On the handler, not the logger: records of child loggers ("name.sub") are filtered too.
    handler.addFilter(_RankFilter(all_ranks))
    fmt = "[rank %(rank)s] %(message)s" if all_ranks else "%(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def rank0_print(*args: Any, force: bool = False, **kwargs: Any) -> None:
    """``print`` on rank 0 only, silenced in quiet mode unless ``force``."""
    if is_rank_zero() and (force or not is_quiet()):
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def _number(value: Any) -> float:
    if hasattr(value, "detach"):  # a tensor: one host sync, only when a line is printed
        value = value.detach().float().item()
    return float(value)


def progress_line(step: int, loss: Any = None, tokens_per_s: float | None = None, *,
                  total_steps: int | None = None, lr: float | None = None,
                  step_time_s: float | None = None, **extra: Any) -> str:
    """One progress line, e.g. ``step 10/100 | loss 2.3012 | 51,200 tok/s | lr 3.0e-04``.

    ``loss`` may be a float or a 0-d tensor. ``extra`` values are appended as ``key value``.
    """
    width = len(str(total_steps)) if total_steps else 0
    parts = [f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"]
    if loss is not None:
        value = _number(loss)
        parts.append(f"loss {value:.4f}" if math.isfinite(value) else f"loss {value}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    if step_time_s is not None:
        parts.append(f"{step_time_s * 1e3:.1f} ms/step")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    for key, value in extra.items():
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


def log_progress(step: int, loss: Any = None, tokens_per_s: float | None = None,
                 **kwargs: Any) -> None:
    """Print :func:`progress_line` on rank 0 unless quiet."""
    if is_rank_zero() and not is_quiet():
        print(progress_line(step, loss, tokens_per_s, **kwargs), flush=True)


class Progress:
    """Times training steps and prints a progress line every ``every`` steps (rank 0 only).

    ``tokens_per_step`` is the number of tokens one step consumes on the whole job (global
    batch x sequence length); tokens/s is measured over the steps since the last line.
    """

    def __init__(self, total_steps: int | None = None, tokens_per_step: int | None = None,
                 every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"Progress(every=...) must be >= 1, got {every}")
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.every = every
        self.steps = 0
        self._mark = time.perf_counter()
        self._since_mark = 0
        self.last_line = ""

    def step(self, loss: Any = None, **extra: Any) -> str | None:
        """Count one step; every ``every`` steps (and at the last) print and return a line."""
        self.steps += 1
        self._since_mark += 1
        last = self.total_steps is not None and self.steps == self.total_steps
        if self.steps % self.every and not last:
            return None
        now = time.perf_counter()
        elapsed = max(now - self._mark, 1e-9)
        per_step = elapsed / self._since_mark
        tps = self.tokens_per_step / per_step if self.tokens_per_step else None
        self._mark, self._since_mark = now, 0
        self.last_line = progress_line(self.steps, loss, tps, total_steps=self.total_steps,
                                       step_time_s=per_step, **extra)
        if is_rank_zero() and not is_quiet():
            print(self.last_line, flush=True)
        return self.last_line
