"""What ``hyperpar info`` reports: versions, installed backends, the selection and its rule."""

from __future__ import annotations

import platform as _host
import sys
from dataclasses import dataclass, field

from . import registry


@dataclass
class BackendRow:
    """One installed backend as ``hyperpar info`` shows it."""

    name: str
    distribution: str
    priority: int
    device_type: str
    dist_backend: str
    available: bool
    reason: str


@dataclass
class InfoReport:
    """Everything ``hyperpar info`` prints, as data (``--json`` dumps it)."""

    hyperpar_version: str
    torch_version: str
    python_version: str
    host: str
    backends: list[BackendRow] = field(default_factory=list)
    selected: str | None = None
    rule: str = ""
    selection_error: str = ""
    device_count: int | None = None
    max_local_ranks: int | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    frameworks: dict[str, str] = field(default_factory=dict)

    def to_text(self) -> str:
        versions = "".join(f"  {name} {v}" for name, v in self.frameworks.items()
                           if v != "not installed") or "  (no tensor framework installed)"
        lines = [
            f"hyperpar {self.hyperpar_version}{versions}  "
            f"python {self.python_version}  ({self.host})",
            "",
            "installed backends:",
        ]
        for row in self.backends:
            state = "available" if row.available else f"unavailable: {row.reason}"
            mark = "*" if row.name == self.selected else " "
            lines.append(
                f" {mark} {row.name:<8} priority {row.priority:<4} device={row.device_type:<6} "
                f"collectives={row.dist_backend:<6} [{row.distribution}]  {state}"
            )
        if not self.backends:
            lines.append("   none -- install one, e.g. `pip install hyperpar-cpu` (PyTorch) or "
                         "`pip install hyperpar-mindspore` (MindSpore)")
        lines.append("")
        if self.selected:
            lines.append(f"selected: {self.selected}  (by {self.rule})")
            lines.append(f"device count: {self.device_count}")
            lines.append("ranks per host: " + (
                "any (ranks share the device)" if self.max_local_ranks is None
                else f"up to {self.max_local_ranks} (one per device)"))
            if self.fallbacks:
                lines.append("collective fallbacks in use:")
                lines += [f"  {op}: {how}" for op, how in sorted(self.fallbacks.items())]
            else:
                lines.append("collective fallbacks in use: none")
            if self.settings:
                lines.append("runtime settings: " + ", ".join(
                    f"{name} {value}" for name, value in self.settings.items()))
        else:
            lines.append(f"selected: none -- {self.selection_error}")
        return "\n".join(lines)


def collect_info() -> InfoReport:
    """Probe every installed backend and the current selection; never raises for a bad
    selection (the error is part of the report)."""
    from hyperpar import __version__

    frameworks = framework_versions()
    report = InfoReport(
        hyperpar_version=__version__, torch_version=frameworks["torch"],
        python_version=sys.version.split()[0],
        host=f"{_host.system()} {_host.machine()}", frameworks=frameworks,
    )
    try:
        found = registry.backends()
    except registry.BackendError as exc:
        report.selection_error = str(exc)
        return report
    for info in sorted(found.values(), key=lambda i: (-i.priority, i.name)):
        report.backends.append(BackendRow(
            info.name, info.distribution, info.priority, info.cls.device_type,
            info.cls.dist_backend, info.availability.ok, info.availability.reason,
        ))
    try:
        platform = registry.get_platform()
    except registry.BackendError as exc:
        report.selection_error = str(exc)
        return report
    report.selected = platform.name
    report.rule = registry.selection_rule()
    try:
        report.device_count = platform.device_count()
        report.max_local_ranks = platform.max_local_ranks()
    except Exception as exc:  # a device that fails to count is worth reporting, not crashing
        report.selection_error = f"device_count() raised {exc!r}"
    report.fallbacks = platform.collective_fallbacks()
    report.settings = platform.runtime_settings()
    return report


def framework_versions() -> dict[str, str]:
    """Installed version of each tensor framework a backend may use, without importing it
    (``"not installed"`` where absent): ``hyperpar info`` must work with either one alone."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("torch", "mindspore"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    return found
