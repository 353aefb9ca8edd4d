"""DeviceMesh, placements and DTensor, written once above the Platform.

Names mirror torch's own DTensor API: :class:`DeviceMesh`, :func:`init_device_mesh`,
:class:`Shard`, :class:`Replicate`, :class:`Partial`, :class:`DTensor`,
:func:`distribute_tensor`, :func:`distribute_module` and the factories
``zeros/ones/empty/full/rand/randn``.
"""

# The torch stack loads only where torch is installed: a MindSpore-only venv still gets the
# framework-neutral part of this package (the mesh and the placements).
from .mesh import DeviceMesh, MeshDimError, current_mesh, init_device_mesh
from .placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,  # noqa: F401  (isinstance checks in ported code)
)

try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised by tests/test_layering.py
    _torch = None

if _torch is not None:
    from hyperpar.torch import alias_submodules as _alias

    # Importing _ops installs DTensor.__torch_function__ and fills the op table.
    from hyperpar.torch.dtensor._ops import (
        MixedTensorError,
        OpCall,
        Sharding,
        ShardingError,
        register_op,
        registered_ops,
    )
    from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, distribute_tensor
    from hyperpar.torch.dtensor.autograd_function import install as _install_function_apply
    from hyperpar.torch.dtensor.factories import empty, full, ones, rand, randn, zeros
    from hyperpar.torch.dtensor.local_map import local_map
    from hyperpar.torch.dtensor.module import distribute_module
    from hyperpar.torch.dtensor.random import manual_seed

    # custom autograd.Functions over DTensors stay in the graph (torch.autograd.Function.apply)
    _install_function_apply()

    # The torch files live under hyperpar/torch/; their old paths stay importable.
    _alias(
        "hyperpar.torch.dtensor",
        __name__,
        ("api", "_ops", "experimental", "factories", "functional_collectives", "local_map",
         "module", "random", "redistribute", "_remesh", "_shape_check"),
    )

__all__ = [
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "MeshDimError",
    "MixedTensorError",
    "OpCall",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Sharding",
    "ShardingError",
    "current_mesh",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "init_device_mesh",
    "local_map",
    "manual_seed",
    "ones",
    "rand",
    "randn",
    "register_op",
    "registered_ops",
    "zeros",
]
