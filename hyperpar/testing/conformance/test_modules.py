"""Module detection, parameter replacement and hooks through the Platform."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.platform import get_platform


class RMSNorm(nn.Module):
    """A user-defined RMSNorm, as Llama-style code writes it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_linear_embedding_and_norms_are_detected():
    p = get_platform()
    assert p.is_linear(nn.Linear(2, 3)) and not p.is_linear(nn.Embedding(4, 2))
    assert p.is_embedding(nn.Embedding(4, 2)) and not p.is_embedding(nn.Linear(2, 2))
    for norm in (nn.LayerNorm(4), nn.BatchNorm1d(4), nn.GroupNorm(2, 4), RMSNorm(4)):
        assert p.is_norm(norm), type(norm).__name__
    assert not p.is_norm(nn.Linear(2, 2))


def test_is_module_class_accepts_module_classes_only():
    p = get_platform()
    assert p.is_module_class(nn.Linear)
    assert not p.is_module_class(nn.Linear(2, 2))
    assert not p.is_module_class(int)
    assert not p.is_module_class(lambda x: x)


def test_set_parameter_registers_and_keeps_requires_grad():
    p = get_platform()
    lin = nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    new_w = p.set_parameter(lin, "weight", torch.zeros(2, 3))
    new_b = p.set_parameter(lin, "bias", torch.ones(2))
    assert isinstance(new_w, nn.Parameter) and lin.weight is new_w and new_w.requires_grad
    assert lin.bias is new_b and not new_b.requires_grad
    assert dict(lin.named_parameters())["weight"] is new_w
    torch.testing.assert_close(lin(torch.ones(1, 3)), torch.ones(1, 2))


def test_forward_pre_hook_with_kwargs_can_replace_inputs_and_be_removed():
    p = get_platform()

    class Scale(nn.Module):
        def forward(self, x, *, factor=1.0):
            return x * factor

    m = Scale()
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs.get("factor"))
        return (args[0] + 1,), {"factor": 10.0}

    handle = p.register_forward_pre_hook(m, hook, with_kwargs=True)
    assert m(torch.ones(2), factor=2.0).tolist() == [20.0, 20.0]
    assert seen == [2.0]
    handle.remove()
    assert m(torch.ones(2), factor=2.0).tolist() == [2.0, 2.0]


def test_forward_hook_sees_kwargs_and_can_replace_output():
    p = get_platform()
    lin = nn.Linear(2, 2)
    captured = {}

    def hook(module, args, kwargs, output):
        captured["out"] = output.detach().clone()
        return output * 0

    handle = p.register_forward_hook(lin, hook, with_kwargs=True)
    x = torch.randn(3, 2)
    assert torch.count_nonzero(lin(x)) == 0
    torch.testing.assert_close(captured["out"], x @ lin.weight.T + lin.bias)
    handle.remove()
    assert torch.count_nonzero(lin(x)) > 0


def test_prepended_forward_hook_runs_first():
    p = get_platform()
    lin = nn.Linear(2, 2)
    order = []
    p.register_forward_hook(lin, lambda m, a, o: order.append("second"))
    p.register_forward_hook(lin, lambda m, a, o: order.append("first"), prepend=True)
    lin(torch.ones(1, 2))
    assert order == ["first", "second"]


def test_full_backward_hook_sees_output_gradient_and_can_scale_input_gradient():
    p = get_platform()
    lin = nn.Linear(2, 2, bias=False)
    grads = {}

    def hook(module, grad_input, grad_output):
        grads["out"] = grad_output[0].clone()
        return (grad_input[0] * 3,)

    handle = p.register_full_backward_hook(lin, hook)
    x = torch.randn(4, 2, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(grads["out"], torch.ones(4, 2))
    torch.testing.assert_close(x.grad, 3 * torch.ones(4, 2) @ lin.weight)
    handle.remove()
    x.grad = None
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ lin.weight)
