"""InspectedModel: hooks on a tensor-/data-parallel model see the full activation, equal to the
unsharded model's at the same module names; edits change the sharded model exactly as they
change the unsharded one (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.inspect import InspectedModel
from hyperpar.platform import get_platform

B = 4


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_MLP(), _MLP()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _x() -> torch.Tensor:
    return torch.linspace(-1, 1, B * 8).reshape(B, 8)


def _zero_middle(t: torch.Tensor) -> torch.Tensor:
    """Zero columns 4..11: crosses the boundary of the two TP shards (0..7 | 8..15)."""
    t = t.clone()
    t[:, 4:12] = 0
    return t


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _tp_model(mesh) -> nn.Module:
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(_Net(), mesh, {"layers.*.up": ColwiseParallel(),
                                             "layers.*.down": RowwiseParallel()})


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference(edit_up0=None, edit_grad_down1=None) -> dict[str, torch.Tensor]:
    """The unsharded model with the same hooks, in this process."""
    model = _Net()
    seen: dict[str, torch.Tensor] = {}
    for name in ("layers.0.up", "layers.1.up", "layers.0.down", "layers.1.down"):
        def hook(m, a, out, name=name):
            seen[name] = out.detach().clone()
            if name == "layers.0.up" and edit_up0 is not None:
                out = edit_up0(out)
            if name == "layers.1.down":
                def grad_hook(g):
                    seen["layers.1.down.grad"] = g.clone()
                    return edit_grad_down1(g) if edit_grad_down1 else None
                out.register_hook(grad_hook)
            return out
        model.get_submodule(name).register_forward_hook(hook)
    out = model(_x())
    out.pow(2).sum().backward()
    seen["out"] = out.detach()
    for n, p in model.named_parameters():
        seen[f"grad:{n}"] = p.grad.clone()
    return seen


def _inspect_tp(edit_up0: bool, edit_grad: bool) -> tuple[dict, torch.Tensor, dict]:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    im = InspectedModel(_tp_model(mesh), mesh=mesh)
    # The Colwise output is a local (B, 8) shard: its sharded dim is inferred from (B, 16).
    im.register_forward_hook("layers.0.up", (B, 16), _zero_middle if edit_up0 else None)
    im.register_forward_hook("layers.1.up", (B, 16), sharded_dim=1)
    im.register_forward_hook("layers.*.down", (None, 8))
    im.register_backward_hook("layers.1.down", (B, 8), _double if edit_grad else None)
    out = im(_x())
    out.pow(2).sum().backward()
    im.flush()
    grads = {f"grad:{n}": _full(p.grad).detach().clone() for n, p in im.module.named_parameters()}
    return dict(im.captured), out.detach(), grads


@pytest.mark.parametrize(("edit_up0", "edit_grad"), [(False, False), (True, True)],
                         ids=["capture", "edit"])
def test_tp2_captures_and_edits_match_the_unsharded_model(run_on_ranks, edit_up0, edit_grad):
    results = run_on_ranks(2, _inspect_tp, edit_up0, edit_grad)
    ref = _reference(_zero_middle if edit_up0 else None, _double if edit_grad else None)
    captured, out, grads = results[0]
    assert sorted(captured) == ["layers.0.down", "layers.0.up", "layers.1.down",
                                "layers.1.down.grad", "layers.1.up"]
    for key, value in captured.items():
        assert value.device.type == torch.device("cpu").type
        torch.testing.assert_close(value, ref[key], msg=key)
    assert results[1][0] == {}, "only rank 0 holds captures"
    for _, out_r, grads_r in results:
        torch.testing.assert_close(out_r, ref["out"])
        for key, g in grads_r.items():
            torch.testing.assert_close(g, ref[key], msg=key)
    if edit_up0:
        assert not torch.allclose(ref["out"], _reference()["out"]), "the edit had an effect"


def _dp_tp_capture() -> dict:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    im = InspectedModel(_tp_model(mesh["tp"]), mesh=mesh, dp_dim="dp")
    im.register_forward_hook("layers.*.up", (B, 16), _zero_middle)
    im.register_forward_hook("head", (B, 3))
    im.register_backward_hook("layers.1.up", (B, 16))
    dp = mesh.get_local_rank("dp")
    out = im(_x()[dp * B // 2:(dp + 1) * B // 2])
    out.pow(2).sum().backward()
    im.flush()
    return {"captured": dict(im.captured), "out": out.detach()}


def test_dp2_tp2_hooks_see_the_full_batch_and_edits_apply_to_every_replica(run_on_ranks):
    results = run_on_ranks(4, _dp_tp_capture)
    model = _Net()
    seen = {}

    def edit(m, a, out):
        seen[m._name] = out.detach().clone()
        return _zero_middle(out)

    for name in ("layers.0.up", "layers.1.up"):
        model.get_submodule(name)._name = name
        model.get_submodule(name).register_forward_hook(edit)
    out = model(_x())
    ref_out = out.detach()
    grads = {}

    def grad_of_up1(m, a, o):
        o.register_hook(lambda g: grads.setdefault("layers.1.up.grad", g.clone()))

    model.get_submodule("layers.1.up").register_forward_hook(grad_of_up1)
    model(_x()).pow(2).sum().backward()
    captured = results[0]["captured"]
    assert sorted(captured) == ["head", "layers.0.up", "layers.1.up", "layers.1.up.grad"]
    torch.testing.assert_close(captured["layers.1.up.grad"], grads["layers.1.up.grad"])
    torch.testing.assert_close(captured["layers.0.up"], seen["layers.0.up"])
    torch.testing.assert_close(captured["layers.1.up"], seen["layers.1.up"])
    torch.testing.assert_close(captured["head"], ref_out)
    for rank, r in enumerate(results):
        dp = rank // 2
        torch.testing.assert_close(r["out"], ref_out[dp * B // 2:(dp + 1) * B // 2])


def _groups() -> list[list[str]]:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    im = InspectedModel(_tp_model(mesh), mesh=mesh)
    # the up projection's output is split over tp: its global shape says along which dim
    im.register_forward_hook("layers.0.up", (B, 16), group="first")
    im.register_forward_hook("layers.0.down", group="first")
    im.register_forward_hook("head", group="last")
    seen = []
    for groups in ("first", "last", None):
        im.clear()
        im(_x(), hook_groups=groups)
        seen.append(sorted(im.captured))
    im.disable("first")
    im.clear()
    im(_x())
    seen.append(sorted(im.captured))
    return seen


def test_hook_groups_switch_per_forward_call(run_on_ranks):
    first, last, every, without_first = run_on_ranks(2, _groups)[0]
    assert first == ["layers.0.down", "layers.0.up"]
    assert last == ["head"]
    assert every == ["head", "layers.0.down", "layers.0.up"]
    assert without_first == ["head"]


def _mismatch() -> str:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    im = InspectedModel(_tp_model(mesh), mesh=mesh)
    im.register_forward_hook("layers.0.down", (B, 9))
    try:
        im(_x())
    except ValueError as exc:
        return str(exc)
    return ""


def test_expected_shape_mismatch_names_both_shapes(run_on_ranks):
    msg = run_on_ranks(2, _mismatch)[0]
    assert "'layers.0.down'" in msg and "(4, 8)" in msg and "(4, 9)" in msg


def _unknown_name() -> str:
    im = InspectedModel(_Net())
    try:
        im.register_forward_hook("layers.*.upp")
    except KeyError as exc:
        return str(exc)
    return ""


def test_unknown_module_name_raises_with_closest_names(run_on_ranks):
    msg = run_on_ranks(2, _unknown_name)[0]
    assert "layers.*.upp" in msg and "closest" in msg


class _Staged(nn.Module):
    """Pipeline-like: rank 0 holds ``layers.0``, rank 1 holds ``layers.1`` (global names)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        net = _Net()
        self.layers = nn.ModuleDict({str(rank): net.layers[rank]})
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        platform = get_platform()
        if self.rank == 1:
            platform.recv(x, 0)
        x = self.layers[str(self.rank)](x)
        if self.rank == 0:
            platform.send(x.detach().contiguous(), 1)
        return x


def _staged() -> dict:
    im = InspectedModel(_Staged(get_platform().rank()))
    im.register_forward_hook("layers.*.up", (B, 16))
    with torch.no_grad():
        im(_x().clone())
    return dict(im.captured)


def test_modules_on_other_pipeline_stages_are_captured_on_rank_zero(run_on_ranks):
    captured = run_on_ranks(2, _staged)[0]
    ref = _reference()
    assert sorted(captured) == ["layers.0.up", "layers.1.up"]
    for key, value in captured.items():
        torch.testing.assert_close(value, ref[key], msg=key)


def _dtensor_outputs() -> tuple[dict, torch.Tensor, dict]:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    model = parallelize_module(_Net(), mesh, {
        "layers.*.up": ColwiseParallel(use_local_output=False),
        "layers.*.down": RowwiseParallel(use_local_output=False)})
    for layer in model.layers:  # the residual stream stays a plain tensor
        layer.forward = lambda x, layer=layer: x + layer.down(
            torch.tanh(layer.up(x))).full_tensor()
    im = InspectedModel(model)  # DTensor outputs carry their own mesh: none needed here
    im.register_forward_hook("layers.0.up", (B, 16), _zero_middle)
    im.register_forward_hook("layers.1.up", (B, 16))
    im.register_forward_hook("layers.*.down", (B, 8))
    im.register_backward_hook("layers.1.down", (B, 8), _double)
    out = im(_x())
    out.pow(2).sum().backward()
    im.flush()
    grads = {f"grad:{n}": _full(p.grad).detach().clone() for n, p in im.module.named_parameters()}
    return dict(im.captured), out.detach(), grads


def test_dtensor_outputs_are_gathered_and_edited_through_their_own_layout(run_on_ranks):
    captured, out, grads = run_on_ranks(2, _dtensor_outputs)[0]
    ref = _reference(_zero_middle, _double)
    assert sorted(captured) == ["layers.0.down", "layers.0.up", "layers.1.down",
                                "layers.1.down.grad", "layers.1.up"]
    for key, value in captured.items():
        torch.testing.assert_close(value, ref[key], msg=key)
    torch.testing.assert_close(out, ref["out"])
    for key, g in grads.items():
        torch.testing.assert_close(g, ref[key], msg=key)


def _pipeline_capture() -> dict:
    from hyperpar.pipeline import PipelineModule, ScheduleGPipe

    torch.manual_seed(0)
    net = _Net()
    pipe = PipelineModule([net.layers[0], net.layers[1], net.head], num_stages=2,
                          partition_method="uniform", loss_fn=lambda y, t: y.pow(2).sum())
    im = InspectedModel(pipe)
    im.register_forward_hook("*.up", (None, 16))
    im.register_forward_hook("2", (B // 2, 3))  # the head, on the last stage
    ScheduleGPipe(pipe, n_microbatches=2).step(_x(), target=torch.zeros(B, 3))
    im.flush()
    return dict(im.captured)


def test_pipeline_stage_activations_of_every_microbatch_reach_rank_zero(run_on_ranks):
    captured = run_on_ranks(2, _pipeline_capture)[0]
    ref = _reference()
    model = _Net()
    ref_head = model(_x()).detach()
    assert sorted(captured) == ["0.up", "1.up", "2"]
    torch.testing.assert_close(captured["0.up"], ref["layers.0.up"])
    torch.testing.assert_close(captured["1.up"], ref["layers.1.up"])
    torch.testing.assert_close(captured["2"], ref_head)


class _UnevenShard(nn.Module):
    """Returns this rank's torch.chunk piece of the columns (3 + 2 columns of 5 on 2 ranks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        platform = get_platform()
        return x.chunk(platform.world_size(), dim=1)[platform.rank()] * 1.0


class _UnevenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shard = _UnevenShard()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard(x)


def _uneven() -> tuple[dict, torch.Tensor]:
    from hyperpar.dtensor import init_device_mesh

    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    im = InspectedModel(_UnevenNet(), mesh=mesh)
    im.register_forward_hook("shard", None, lambda t: t.flip(1), sharded_dim=1)
    x = torch.arange(10.0).reshape(2, 5)
    out = im(x)
    return dict(im.captured), out


def test_uneven_local_shards_are_gathered_and_edits_resharded(run_on_ranks):
    (captured0, out0), (_, out1) = run_on_ranks(2, _uneven)
    x = torch.arange(10.0).reshape(2, 5)
    torch.testing.assert_close(captured0["shard"], x)
    flipped = x.flip(1)
    torch.testing.assert_close(out0, flipped[:, :3])
    torch.testing.assert_close(out1, flipped[:, 3:])


def _pp_tp_capture() -> dict:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from hyperpar.pipeline import PipelineModule, ScheduleGPipe

    mesh = init_device_mesh((2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(0)
    net = _Net()
    pipe = PipelineModule([net.layers[0], net.layers[1], net.head], mesh=mesh, mesh_dim="pp",
                          partition_method=[0, 1, 3], loss_fn=lambda y, t: y.pow(2).sum())
    parallelize_module(pipe, mesh["tp"], {"*.up": ColwiseParallel(),
                                          "*.down": RowwiseParallel()})
    im = InspectedModel(pipe, mesh=mesh)
    im.register_forward_hook("*.up", (B // 2, 16))  # one microbatch; local shards are (2, 8)
    im.register_backward_hook("1.down", (B // 2, 8))
    ScheduleGPipe(pipe, n_microbatches=2).step(_x(), target=torch.zeros(B, 3))
    im.flush()
    return dict(im.captured)


def test_pp2_tp2_stage_activations_and_gradients_are_gathered_to_rank_zero(run_on_ranks):
    results = run_on_ranks(4, _pp_tp_capture)
    captured = results[0]
    assert all(r == {} for r in results[1:])
    ref = _reference()
    assert sorted(captured) == ["0.up", "1.down.grad", "1.up"]
    torch.testing.assert_close(captured["0.up"], ref["layers.0.up"])
    torch.testing.assert_close(captured["1.up"], ref["layers.1.up"])
    # The schedule weights each of its 2 microbatch losses by 1/2: gradients are halved.
    torch.testing.assert_close(captured["1.down.grad"], ref["layers.1.down.grad"] / 2)
