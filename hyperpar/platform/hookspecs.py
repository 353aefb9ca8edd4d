"""pluggy hook specifications for hyperpar backends (project name ``"hyperpar"``).

A backend distribution declares an entry point in the group ``hyperpar.backends`` that points
to a module (or object) implementing :func:`hyperpar_backends`::

    # pyproject.toml of "hyperpar-mydevice"
    [project.entry-points."hyperpar.backends"]
    mydevice = "hyperpar_mydevice.plugin"

    # hyperpar_mydevice/plugin.py
    from hyperpar.platform import hookimpl
    @hookimpl
    def hyperpar_backends():
        return [MyDevicePlatform]
"""

from __future__ import annotations

import pluggy

PROJECT = "hyperpar"
ENTRY_POINT_GROUP = "hyperpar.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hyperpar_backends() -> list[type]:
    """Return the :class:`~hyperpar.platform.Platform` subclasses this plugin provides.

    Each class must implement every abstract member of ``Platform`` and set ``name``,
    ``device_type``, ``dist_backend`` and an integer ``priority``. The registry validates them
    when the plugin loads and names the distribution at fault if one is incomplete.
    """
