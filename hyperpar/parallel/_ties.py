"""Tied parameters through ``parallelize_module``.

A parameter shared by two modules before the plan is applied (``lm_head.weight =
embed.weight``, Hugging Face's ``tie_word_embeddings``) stays ONE parameter after it: when every
module holding it is sharded the same way, all of them get the same DTensor parameter (one
``.grad``, gradients as in one process). torch splits such a tie into two parameters whose
gradients then differ from one process; hyperpar refuses a plan that would shard the two
holders differently (or one of them not at all), naming both paths.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.platform import get_platform

__all__ = ["TiedParameterError", "check_ties", "find_ties", "retie"]

#: slots of one shared parameter: [(path "module.name", owner module, attribute name)]
Tie = list[tuple[str, nn.Module, str]]
_UNKNOWN = "unknown"


class TiedParameterError(ValueError):
    """A plan shards the holders of one tied parameter differently."""


def find_ties(module: nn.Module) -> list[Tie]:
    """Every parameter held by more than one (module, attribute) slot under ``module``."""
    slots: dict[int, Tie] = {}
    for fqn, sub in module.named_modules():
        for name, p in sub._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((f"{fqn}.{name}" if fqn else name, sub, name))
    return [tie for tie in slots.values() if len(tie) > 1]


def _predicted(style: Any, sub: nn.Module, owner: nn.Module, name: str) -> Any:
    """The placements ``style`` (applied to ``sub``) gives ``owner.name``: a tuple, ``None``
    (left alone) or ``_UNKNOWN`` (a custom style: checked after applying)."""
    from .prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
    from .style import ColwiseParallel, RowwiseParallel, SequenceParallel

    kind = type(style)
    if kind in (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput):
        return None
    if kind is SequenceParallel:
        return (Replicate(),)
    if kind not in (ColwiseParallel, RowwiseParallel):
        return _UNKNOWN
    if owner is not sub:  # these styles shard the module's own parameters only
        return None
    platform = get_platform()
    if platform.is_linear(sub):
        if kind is ColwiseParallel:
            return (Shard(0),)
        return (Shard(1),) if name == "weight" else (Replicate(),)
    if platform.is_embedding(sub):
        return (Shard(1),) if kind is ColwiseParallel else (Shard(0),)
    return _UNKNOWN


def _covers(sub: nn.Module, owner: nn.Module) -> bool:
    return owner is sub or any(m is owner for m in sub.modules())


def _describe(placements: Any) -> str:
    return "left unsharded" if placements is None else f"sharded as {tuple(placements)}"


def _mismatch(tie: Tie, placements: list[Any]) -> TiedParameterError:
    (a, _, _), (b, _, _) = tie[0], next(
        (s for s, p in zip(tie, placements, strict=True) if p != placements[0]), tie[1])
    pa = placements[0]
    pb = placements[[s[0] for s in tie].index(b)]
    return TiedParameterError(
        f"{a!r} and {b!r} are one tied parameter, but the plan leaves {a!r} "
        f"{_describe(pa)} and {b!r} {_describe(pb)}; a tie can only be kept when both are "
        f"sharded the same way (e.g. RowwiseParallel(input_layouts=Replicate()) on an Embedding "
        f"and ColwiseParallel() on the Linear head: both Shard(0)). Change one style, or untie "
        f"them before parallelize_module"
    )


def check_ties(ties: list[Tie], entries: list[tuple[str, nn.Module, Any]]) -> None:
    """Before anything is applied: raise if the plan would shard a tie's holders differently
    (styles whose placements are known ahead; custom ones are checked by :func:`retie`)."""
    for tie in ties:
        placements = []
        for _, owner, name in tie:
            got = None
            for _, sub, style in entries:
                if _covers(sub, owner):
                    p = _predicted(style, sub, owner, name)
                    got = p if p is not None else got
            placements.append(got)
        if _UNKNOWN in placements:
            continue
        if any(p != placements[0] for p in placements):
            raise _mismatch(tie, placements)


def retie(ties: list[Tie]) -> None:
    """After the styles ran: point every holder of a tie at one DTensor parameter."""
    from hyperpar.dtensor import DTensor

    for tie in ties:
        params = [owner._parameters.get(name) for _, owner, name in tie]
        if all(not isinstance(p, DTensor) for p in params):
            continue
        placements = [tuple(p.placements) if isinstance(p, DTensor) else None for p in params]
        if any(p != placements[0] for p in placements) or any(
                p.shape != params[0].shape for p in params):
            raise _mismatch(tie, placements)
        for _, owner, name in tie:
            owner._parameters[name] = params[0]
