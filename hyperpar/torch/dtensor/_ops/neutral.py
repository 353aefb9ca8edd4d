"""The bridge from torch rules to the neutral rules of :mod:`hyperpar.dtensor.rules`.

A torch family normalises its function's arguments into a neutral op name and keyword
arguments; :func:`neutral_sharding` asks the neutral rule (written once for every framework)
and turns its answer into this stack's :class:`~.registry.Sharding`. Rules run only on a plan
cache miss, so the bridge costs nothing per cached call."""

from __future__ import annotations

from typing import Any

from hyperpar.dtensor.rules import TensorMeta
from hyperpar.dtensor.rules.base import RULES, OpSharding, no_rule
from hyperpar.torch.dtensor._ops.registry import OpCall, Sharding
from hyperpar.torch.dtensor.api import DTensorSpec


def decide(op: str, specs: list[DTensorSpec], **args: Any) -> OpSharding:
    """The neutral rule of ``op`` applied to DTensor ``specs`` (same mesh) and ``args``."""
    metas = tuple(TensorMeta(s.placements, tuple(s.shape)) for s in specs)
    fn = RULES.get(op)
    if fn is None:
        raise no_rule(op, metas, "no sharding rule is registered for it")
    return fn(op, metas, tuple(specs[0].mesh.shape), **args)


def neutral_sharding(op: str, call: OpCall, **args: Any) -> Sharding:
    """The :class:`Sharding` of ``call`` decided by the neutral rule of ``op`` on the call's
    DTensor inputs (in order) and the normalised non-tensor ``args``.

    The neutral result's ``grad_sum`` is not used: the torch dispatch derives the same mesh
    dims from the outputs (``reduce_grad``). A rule that needs ``divide_by`` calls
    :func:`decide` and :func:`to_sharding` itself (it knows the torch function to run locally)."""
    return to_sharding(decide(op, [d._spec for d in call.dtensors], **args))


def to_sharding(res: OpSharding) -> Sharding:
    """A neutral rule's answer as this stack's :class:`Sharding` (``divide_by`` left out)."""
    outputs = res.outputs[0] if len(res.outputs) == 1 else list(res.outputs)
    shapes = res.shapes[0] if len(res.shapes) == 1 else list(res.shapes)
    return Sharding(list(res.inputs), outputs, shapes)


def ordered_sharding(op: str, call: OpCall, tensors: list[Any], **args: Any) -> Sharding:
    """:func:`neutral_sharding` with the rule's inputs given as ``tensors`` (DTensors of the
    call, in the rule's order; the call may hold them in another, e.g. passed by keyword). Each
    DTensor of the call takes the target of the first of ``tensors`` that is it (identity);
    one not among them is left as it is."""
    res = decide(op, [t._spec for t in tensors], **args)
    inputs: list[Any] = []
    for d in call.dtensors:
        k = next((i for i, t in enumerate(tensors) if t is d), None)
        inputs.append(None if k is None else res.inputs[k])
    sh = to_sharding(res)
    sh.inputs = inputs
    return sh
