"""Entry point of the ``hyperpar.backends`` group for the npu backend."""

from hyperpar.platform import hookimpl


@hookimpl
def hyperpar_backends():
    from .platform import NPUPlatform

    return [NPUPlatform]
