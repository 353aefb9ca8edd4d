"""DTensor op rules, by family (``hyperpar.torch.dtensor._ops``).

``neutral`` bridges torch rules to the framework-neutral rules of
:mod:`hyperpar.dtensor.rules` (the sharding decided once); ``registry`` holds the table
(:data:`~.registry.OP_TABLE`), the one decorator
(:func:`~.registry.register_op`), what rules see and return (``OpCall``/``Sharding``) and the
errors; ``dispatch`` is ``DTensor.__torch_function__`` with the one bounded plan cache. Each
family file registers its ops: ``pointwise``, ``matmul``, ``reduction``, ``view``, ``factory``,
``nn`` (softmax, norms, attention, embedding, dropout, losses), ``tensor`` (metadata, autograd,
comparisons), ``foreach`` (foreach and fused optimizer ops). Importing this package fills the table.
"""

# Order does not matter: no torch function is registered by two families (checked by
# tests/dtensor/test_op_registry.py); dispatch installs __torch_function__.
from hyperpar.torch.dtensor._ops import (  # noqa: F401
    complex,
    dispatch,
    factory,
    foreach,
    matmul,
    neutral,
    nn,
    pointwise,
    reduction,
    registry,
    routing,
    tensor,
    view,
)

# after every other family: it takes only the functions they leave unregistered
from hyperpar.torch.dtensor._ops import extra  # noqa: F401, E402  (isort: skip)
from hyperpar.torch.dtensor._ops.dispatch import PLAN_CACHE, PlanCache, infer_shapes
from hyperpar.torch.dtensor._ops.matmul import einsum_sharding
from hyperpar.torch.dtensor._ops.pointwise import pointwise_sharding
from hyperpar.torch.dtensor._ops.registry import (
    OP_TABLE,
    MixedTensorError,
    OpCall,
    OpEntry,
    OpOverlay,
    Sharding,
    ShardingError,
    register_op,
    registered_ops,
    unshard,
)

__all__ = [
    "OP_TABLE",
    "PLAN_CACHE",
    "MixedTensorError",
    "OpCall",
    "OpEntry",
    "OpOverlay",
    "PlanCache",
    "Sharding",
    "ShardingError",
    "einsum_sharding",
    "infer_shapes",
    "pointwise_sharding",
    "register_op",
    "registered_ops",
    "unshard",
]
