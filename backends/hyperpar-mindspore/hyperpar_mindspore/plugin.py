"""Entry point of the ``hyperpar.backends`` group for the MindSpore backend.

Importing this module imports no MindSpore (a 2-7 s import): the Platform class is defined
without it, and its availability probe only looks for the package.
"""

from hyperpar.platform import hookimpl


@hookimpl
def hyperpar_backends():
    from .platform import MindSporePlatform

    return [MindSporePlatform]
