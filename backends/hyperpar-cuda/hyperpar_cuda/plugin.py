"""Entry point of the ``hyperpar.backends`` group for the cuda backend."""

from hyperpar.platform import hookimpl


@hookimpl
def hyperpar_backends():
    from .platform import CUDAPlatform

    return [CUDAPlatform]
