"""The zero-bubble backward split, written once for both torch pipeline front ends.

A stage's backward is run in two parts: ``I`` computes only the gradient with respect to the
stage input (what the previous stage waits for) and ``W`` the parameter gradients later, to fill
idle time. So that ``W`` does not redo ``I``'s work, the forward records the output of every
submodule that owns parameters directly; ``I`` asks autograd for the gradients of the input
*and* of those outputs, and ``W`` then runs each submodule's own small backward from its output
to its parameters. When that split is not exact (a submodule called twice, parameters shared
or used outside their module, an output changed in place) ``W`` instead backpropagates the
whole stage again with respect to its parameters: still correct, only slower.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hyperpar.platform import get_platform

#: One exact piece of a weight gradient: [submodule output, its own parameters, output grad].
Piece = list[Any]


def capture_leaf_outputs(modules: Iterable[torch.nn.Module], captured: list) -> list[Any]:
    """Forward hooks appending ``(module, output, output version)`` to ``captured`` for every
    submodule (of ``modules``) that owns a parameter requiring grad; returns the handles."""
    platform = get_platform()

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            captured.append((module, output, output._version))

    handles = []
    for top in modules:
        for sub in top.modules():
            if any(p.requires_grad for p in sub.parameters(recurse=False)):
                handles.append(platform.register_forward_hook(sub, hook))
    return handles


def exact_pieces(captured: Sequence[tuple[torch.nn.Module, torch.Tensor, int]],
                 params: Iterable[torch.Tensor]) -> list[Piece]:
    """The per-submodule pieces of a weight gradient, or ``[]`` when they would not cover
    ``params`` exactly once (then the whole unit's weight gradient runs as one piece)."""
    if not captured:
        return []
    pieces: list[Piece] = []
    seen_mods: set[int] = set()
    seen_params: set[int] = set()
    for module, out, version in captured:
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if id(module) in seen_mods or out._version != version or not out.requires_grad \
                or any(id(p) in seen_params for p in own):
            return []
        seen_mods.add(id(module))
        seen_params.update(id(p) for p in own)
        pieces.append([out, own, None])
    wanted = {id(p) for p in params if p.requires_grad}
    return pieces if seen_params == wanted else []


def input_gradients(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    ins: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """``I``: the gradient of every tensor in ``ins`` (zeros where unused), keeping the graph
    for ``W`` and storing each piece's output gradient in it."""
    wanted = list(ins) + [piece[0] for piece in pieces]
    if not (wanted and outs):
        return [torch.zeros_like(t) for t in ins]
    got = torch.autograd.grad(list(outs), wanted, list(grads), retain_graph=True,
                              allow_unused=True)
    for piece, g in zip(pieces, got[len(ins):], strict=True):
        piece[2] = g
    return [g if g is not None else torch.zeros_like(t)
            for g, t in zip(got[:len(ins)], ins, strict=True)]


def weight_gradients(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     pieces: Sequence[Piece], params: Sequence[torch.Tensor]) -> None:
    """``W``: accumulate the parameter gradients into ``.grad`` (per piece when exact)."""
    if pieces:
        for out, own, grad in pieces:
            if grad is not None:
                torch.autograd.backward(out, grad, inputs=own)
        return
    params = [p for p in params if p.requires_grad]
    if params and outs:
        torch.autograd.backward(list(outs), list(grads), inputs=params)
