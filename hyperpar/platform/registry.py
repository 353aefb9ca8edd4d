"""Backend discovery and selection.

Every backend -- in-tree or third-party -- is a pluggy plugin found through the entry-point
group ``hyperpar.backends``. Selection order: :func:`set_backend` > ``HYPERPAR_BACKEND`` >
auto-detect (highest ``priority`` among available backends; cpu is always available and lowest).
Resolution is lazy and cached until :func:`reset`; nothing is decided at import time.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import threading
from dataclasses import dataclass, field

import pluggy

from . import hookspecs
from .base import Availability, BackendError, Platform

ENV_VAR = "HYPERPAR_BACKEND"


@dataclass
class BackendInfo:
    """One registered backend: its class, the distribution that provides it, and its probe."""

    name: str
    cls: type[Platform]
    distribution: str
    _availability: Availability | None = field(default=None, repr=False)

    @property
    def priority(self) -> int:
        return self.cls.priority

    @property
    def availability(self) -> Availability:
        """The backend's probe result, computed once (probes may import heavy modules)."""
        if self._availability is None:
            try:
                self._availability = self.cls.is_available()
            except Exception as exc:  # a probe must not break selection of other backends
                self._availability = Availability(False, f"probe raised {exc!r}")
        return self._availability


@dataclass
class _State:
    manager: pluggy.PluginManager | None = None
    backends: dict[str, BackendInfo] | None = None
    override: str | None = None
    platform: Platform | None = None
    rule: str = ""
    extra_plugins: list[tuple[object, str]] = field(default_factory=list)


_state = _State()
_lock = threading.RLock()


def _distribution_name(manager: pluggy.PluginManager, plugin: object) -> str:
    for plug, dist in manager.list_plugin_distinfo():
        if plug is plugin:
            return f"{dist.metadata['name']} {dist.version}"
    for plug, source in _state.extra_plugins:
        if plug is plugin:
            return source
    return "<unknown distribution>"


def _validate(cls: object, source: str) -> type[Platform]:
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise BackendError(f"{source}: hyperpar_backends() returned {cls!r}, not a Platform class")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing or inspect.isabstract(cls):
        raise BackendError(
            f"{source}: backend class {cls.__qualname__} does not implement the Platform "
            f"members {', '.join(missing)}; implement them (or subclass TorchPlatform)"
        )
    for attr in ("name", "device_type", "dist_backend"):
        value = getattr(cls, attr, None)
        if not isinstance(value, str) or not value:
            raise BackendError(f"{source}: {cls.__qualname__}.{attr} must be a non-empty string")
    if not isinstance(cls.priority, int) or isinstance(cls.priority, bool):
        raise BackendError(
            f"{source}: {cls.__qualname__}.priority must be an int, got {cls.priority!r}"
        )
    return cls


def _failed_entry_point(exc: Exception) -> str:
    """Name the entry point (and distribution) whose import failed -- pluggy does not say."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as err:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "<unknown distribution>"
            return (f"backend plugin {ep.name!r} ({dist}, {ep.value}) failed to import: "
                    f"{type(err).__name__}: {err}; fix or uninstall that distribution")
    return f"loading a '{hookspecs.ENTRY_POINT_GROUP}' entry point failed: {exc!r}"


def _call_hook(impl: pluggy.HookImpl, source: str) -> list[object]:
    """Run one plugin's ``hyperpar_backends`` hook; a hook that raises is named with its
    plugin and distribution (pluggy would let a bare ``KeyError`` out of the registry)."""
    plugin = impl.plugin_name or getattr(impl.plugin, "__name__", repr(impl.plugin))
    try:
        classes = impl.function()
    except Exception as exc:
        raise BackendError(
            f"backend plugin {plugin!r} ({source}): its hyperpar_backends() hook raised "
            f"{type(exc).__name__}: {exc}; fix or uninstall that distribution"
        ) from exc
    if classes is None:
        return []
    try:
        return list(classes)
    except TypeError as exc:
        raise BackendError(
            f"backend plugin {plugin!r} ({source}): hyperpar_backends() must return a list of "
            f"Platform classes, got {type(classes).__name__}"
        ) from exc


def _discover() -> dict[str, BackendInfo]:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    try:
        manager.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
    except Exception as exc:
        raise BackendError(_failed_entry_point(exc)) from exc
    for plugin, _source in _state.extra_plugins:
        if not manager.is_registered(plugin):
            manager.register(plugin)
    found: dict[str, BackendInfo] = {}
    for impl in manager.hook.hyperpar_backends.get_hookimpls():
        source = _distribution_name(manager, impl.plugin)
        for cls in _call_hook(impl, source):
            cls = _validate(cls, source)
            if cls.name in found and found[cls.name].cls is not cls:
                raise BackendError(
                    f"two plugins claim the backend name {cls.name!r}: "
                    f"{found[cls.name].distribution} and {source}; uninstall one of them"
                )
            found[cls.name] = BackendInfo(cls.name, cls, source)
    _state.manager = manager
    return found


def backends() -> dict[str, BackendInfo]:
    """Every installed backend by name (discovered on first use, cached until :func:`reset`)."""
    with _lock:
        if _state.backends is None:
            _state.backends = _discover()
        return dict(_state.backends)


def register_plugin(plugin: object, source: str = "<registered at runtime>") -> None:
    """Register a plugin object (module or instance with a ``hyperpar_backends`` hookimpl)
    without an entry point -- for notebooks and tests. Survives :func:`reset`."""
    with _lock:
        _state.extra_plugins.append((plugin, source))
        _state.backends = None
        _state.platform = None


def unregister_plugin(plugin: object) -> None:
    """Undo :func:`register_plugin`."""
    with _lock:
        _state.extra_plugins = [(p, s) for p, s in _state.extra_plugins if p is not plugin]
        _state.backends = None
        _state.platform = None


def _installed_list(found: dict[str, BackendInfo]) -> str:
    return ", ".join(f"{n} ({i.distribution})" for n, i in sorted(found.items())) or "none"


def _resolve() -> tuple[str, str]:
    """The backend name to use and the rule that chose it."""
    found = backends()
    if _state.override is not None:
        return _state.override, "hyperpar.set_backend()"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"{ENV_VAR}={env}"
    available = [i for i in found.values() if i.availability.ok]
    if not available:
        raise BackendError(
            "no hyperpar backend is available. Installed: "
            f"{_installed_list(found)}. Install one, e.g. `pip install hyperpar-cpu`."
        )
    best = max(available, key=lambda i: (i.priority, i.name))
    return best.name, "auto-detect (highest priority available)"


def _check_usable(name: str, found: dict[str, BackendInfo]) -> BackendInfo:
    if name not in found:
        raise BackendError(
            f"unknown hyperpar backend {name!r}. Installed backends: {_installed_list(found)}. "
            f"Pick one of them (HYPERPAR_BACKEND / hyperpar.set_backend) or install "
            f"'hyperpar-{name}'."
        )
    info = found[name]
    if not info.availability.ok:
        raise BackendError(
            f"hyperpar backend {name!r} ({info.distribution}) is installed but unavailable: "
            f"{info.availability.reason}"
        )
    return info


def get_platform() -> Platform:
    """The selected backend's :class:`Platform` instance (resolved lazily, then cached)."""
    platform = _state.platform
    if platform is not None:
        # Hot path without the lock: reading one reference is atomic, and torch.compile cannot
        # trace a lock (a graph break at every collective of a compiled region).
        return platform
    with _lock:
        if _state.platform is None:
            name, rule = _resolve()
            info = _check_usable(name, backends())
            _state.platform = info.cls()
            _state.rule = rule
        return _state.platform


def selection_rule() -> str:
    """How the current platform was chosen (resolves it if needed)."""
    get_platform()
    return _state.rule


def set_backend(name: str | None) -> Platform | None:
    """Select backend ``name`` for this process (overrides ``HYPERPAR_BACKEND``); ``None``
    clears the override. Validates immediately and returns the platform (or ``None``)."""
    with _lock:
        if name is None:
            _state.override, _state.platform = None, None
            return None
        info = _check_usable(name, backends())
        _state.override = name
        _state.platform = info.cls()
        _state.rule = "hyperpar.set_backend()"
        return _state.platform


def reset() -> None:
    """Forget the selection, the override and the discovered plugins (they are found again on
    next use). Runtime-registered plugins stay registered."""
    with _lock:
        _state.manager = None
        _state.backends = None
        _state.override = None
        _state.platform = None
        _state.rule = ""


def torch_installed() -> bool:
    """Whether torch can be imported here (without importing it): where it cannot (a MindSpore
    venv), the packages that offer torch implementations resolve names through the platform."""
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:   # an import hook that refuses torch: not usable here either
        return False
