"""torch mechanics of DTensor: the tensor subclass (``api``), its dispatch and torch-keyed op
table (``_ops``), redistribution as autograd Functions, factories, random, ``local_map`` and
functional collectives. Imported through :mod:`hyperpar.dtensor`."""

# The public package first: importing a module here directly (``hyperpar.torch.dtensor._ops``)
# must not start the op table before the neutral placements and the mesh exist.
import hyperpar.dtensor  # noqa: E402,F401
