"""Entry point of the ``hyperpar.backends`` group for the simulation backend."""

from hyperpar.platform import hookimpl


@hookimpl
def hyperpar_backends():
    from .platform import SimPlatform

    return [SimPlatform]
