"""Op sharding rules keyed by neutral op names, written once for every framework (no framework
import). A rule maps (op name, each tensor input's placements and global shape, the op's
non-tensor arguments) to the placements each input must take, the output placements and global
shape(s), and the mesh dims where a replicated input's gradient must be summed.

>>> from hyperpar.dtensor.rules import TensorMeta, propagate
>>> from hyperpar.dtensor.placement import Replicate, Shard
>>> r = propagate("matmul", (TensorMeta((Shard(0),), (8, 4)), TensorMeta((Replicate(),), (4, 3))),
...               (2,))
>>> r.outputs, r.shapes, r.grad_sum
(((Shard(dim=0),),), ((8, 3),), ((), (0,)))

Ops with rules: ``add sub neg identity mul div elementwise`` (broadcasting, the Partial algebra),
``matmul bmm linear``, ``sum mean max max_dim``,
``prod var std var_mean std_mean argmax argmin logsumexp all any norm`` (gathered),
``cumsum cumprod``, ``softmax log_softmax``,
``reshape transpose permute``, ``getitem expand`` (basic indexing, broadcast_to),
``cat stack split unbind``,
``layer_norm rms_norm group_norm`` (normalisation), ``sdpa`` (attention),
``embedding gather_d cross_entropy``, ``sort_along histogram scatter_d index_add
grouped_mm`` (MoE routing and experts). Each platform maps its own functions (torch functions,
MindSpore OpCalls) to these names. An op or a layout without a rule raises
:class:`ShardingError` naming both.
"""

from . import (  # noqa: F401  (fill the table)
    attention,
    cat,
    elementwise,
    index,
    local_dims,
    matmul,
    nn,
    norm,
    reduction,
    routing,
    view,
)
from .base import (
    P_SUM,
    RULES,
    GlobalMean,
    MaskedLookup,
    OpSharding,
    ShardingError,
    TensorMeta,
    grad_sum_dims,
    no_rule,
    propagate,
    rule,
)
from .elementwise import broadcast_shapes, elementwise_plan
from .view import infer_shape

__all__ = ["P_SUM", "RULES", "GlobalMean", "MaskedLookup", "OpSharding", "ShardingError",
           "TensorMeta", "broadcast_shapes", "elementwise_plan", "grad_sum_dims", "infer_shape",
           "no_rule", "propagate", "rule"]
