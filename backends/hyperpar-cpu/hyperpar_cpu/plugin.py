"""Entry point of the ``hyperpar.backends`` group for the cpu backend."""

from hyperpar.platform import hookimpl


@hookimpl
def hyperpar_backends():
    from .platform import CPUPlatform

    return [CPUPlatform]
