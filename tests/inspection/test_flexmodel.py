"""FlexModel's API (hyperpar.inspect.FlexModel): the seed's usage example runs with only its
import line changed (sizes shrunk) on a TP=2 and on a DP=2 model, and the activation in
``output_ptr`` on rank 0 equals the unsharded model's; editing functions, hook groups,
trainable modules, save_ctx, get_module_parameter, restore and dropping the wrapper."""

from __future__ import annotations

import gc

import torch
from torch import nn

from hyperpar.platform import get_platform

B, S, H = 4, 6, 8  # the seed's (16, 1024, 4096), shrunk


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MyModel(nn.Module):
    """Stands in for the seed's ``MyModel.from_pretrained(...)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.my_model = _Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.my_model(x)

    @classmethod
    def from_pretrained(cls, parallel: str = "none") -> MyModel:
        model = cls()
        if parallel == "tp":  # a tensor-parallel checkpoint loads already sharded
            from hyperpar.dtensor import init_device_mesh
            from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
            parallelize_module(model, mesh, {"my_model.layers.*.mlp.up": ColwiseParallel(),
                                             "my_model.layers.*.mlp.down": RowwiseParallel()})
        return model


def _inputs() -> torch.Tensor:
    return torch.linspace(-2, 2, B * S * H).reshape(B, S, H)


def _unsharded(name: str, edit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation of ``name``, model output) of the unsharded model on the whole batch."""
    model = MyModel()
    seen = {}

    def hook(m, a, out):
        seen[name] = out.detach().clone()
        return edit(out) if edit is not None else None

    model.get_submodule(name).register_forward_hook(hook)
    out = model(_inputs()).detach()
    return seen[name], out


# ---------------------------------------------------------------------------- the seed example
def _seed_example_dp() -> dict:
    from hyperpar.inspect import FlexModel, HookFunction  # was: from flex_model import ...
    from hyperpar.parallel import data_parallel as FSDP  # was: torch's FSDP

    rank = get_platform().rank()
    inputs = _inputs()[rank * B // 2:(rank + 1) * B // 2]  # this replica's half of the batch

    # --- the seed's example from here on (sizes shrunk) ---
    # Load model.
    model = MyModel.from_pretrained()

    # Distribute model over many workers using fully-sharded data parallel.
    model = FSDP(model)

    # Create output dictionary where activations will stream to.
    output_dict = {}

    # Wrap the model.
    flex_model = FlexModel(
        model,
        output_dict,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=2,
    )

    # Create hook function for post-mlp.
    my_hook_function = HookFunction(
        "my_model.layers.1.mlp",
        expected_shape=(B, S, H),
        editing_function=None,
    )

    # Register the hook function (same as PyTorch API).
    flex_model.register_forward_hook(my_hook_function)

    # Run forward pass. Output dictionary will become populated.
    outputs = flex_model(inputs)
    return {"output_dict": output_dict, "outputs": outputs.detach()}


def test_seed_example_on_dp2_gives_rank0_the_unsharded_activation(run_on_ranks):
    results = run_on_ranks(2, _seed_example_dp)
    act, out = _unsharded("my_model.layers.1.mlp")
    got = results[0]["output_dict"]
    assert list(got) == ["my_model.layers.1.mlp"] and len(got["my_model.layers.1.mlp"]) == 1
    value = got["my_model.layers.1.mlp"][0]
    assert value.device.type == "cpu"
    torch.testing.assert_close(value, act, rtol=1e-6, atol=1e-6)
    assert results[1]["output_dict"] == {}, "activations land on rank 0 only"
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["outputs"], out[rank * B // 2:(rank + 1) * B // 2])


def _seed_example_tp(hook_name: str) -> dict:
    from hyperpar.inspect import FlexModel, HookFunction  # was: from flex_model import ...

    inputs = _inputs()
    # Load model.
    model = MyModel.from_pretrained("tp")
    # Create output dictionary where activations will stream to.
    output_dict = {}
    # Wrap the model.
    flex_model = FlexModel(
        model,
        output_dict,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        data_parallel_size=1,
    )
    # Create hook function for post-mlp.
    my_hook_function = HookFunction(
        hook_name,
        expected_shape=(B, S, 2 * H) if hook_name.endswith("up") else (B, S, H),
        editing_function=None,
    )
    # Register the hook function (same as PyTorch API).
    flex_model.register_forward_hook(my_hook_function)
    # Run forward pass. Output dictionary will become populated.
    outputs = flex_model(inputs)
    return {"output_dict": output_dict, "outputs": outputs.detach()}


def test_seed_example_on_tp2_gives_rank0_the_unsharded_activation(run_on_ranks):
    # the mlp's output is replicated over tp; its first projection's is split in two
    for name in ("my_model.layers.1.mlp", "my_model.layers.0.mlp.up"):
        results = run_on_ranks(2, _seed_example_tp, name)
        act, out = _unsharded(name)
        got = results[0]["output_dict"]
        assert list(got) == [name] and len(got[name]) == 1, got
        torch.testing.assert_close(got[name][0], act, rtol=1e-5, atol=1e-6)
        assert results[1]["output_dict"] == {}
        for r in results:
            torch.testing.assert_close(r["outputs"], out, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- surgery
def _scale_and_remember(current_module, inputs, save_ctx, modules):
    """FlexModel's editing-function signature: the full activation in, the new one out."""
    save_ctx.seen_shape = tuple(inputs.shape)
    save_ctx.module_type = type(current_module).__name__
    return modules["scale"](inputs)


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def _surgery() -> dict:
    from hyperpar.inspect import FlexModel, HookFunction

    output_dict: dict = {}
    flex = FlexModel(MyModel.from_pretrained("tp"), output_dict, tensor_parallel_size=2)
    flex.register_trainable_module("scale", _Scale())
    edit = HookFunction("my_model.layers.0.mlp.up", (B, S, 2 * H), _scale_and_remember)
    flex.register_forward_hook(edit)
    flex.create_hook_group("downs", "mlp.down", expected_shape=(B, S, H))
    flex.update_hook_groups(edit, "edits")
    groups = {"edit": sorted(flex.get_hook_function_groups(edit)),
              "downs": sorted(h.module_name for h in flex.get_group_hook_functions("downs"))}
    runs = {}
    for label, kwargs in [("all", {}), ("downs", {"groups": "downs"}),
                          ("not-downs", {"groups": "downs", "complement": True})]:
        output_dict.clear()
        out = flex(_inputs(), **kwargs)
        runs[label] = {"keys": sorted(output_dict), "out": out.detach(),
                       "up0": output_dict.get("my_model.layers.0.mlp.up")}
    flex.remove_hook_groups("mlp.down", "downs")
    groups["downs_after_remove"] = len(flex.get_group_hook_functions("downs"))
    weight = flex.get_module_parameter("my_model.layers.0.mlp.up.weight", (2 * H, H))
    try:
        flex.get_module_parameter("my_model.layers.0.mlp.up.weight", (H, H))
        wrong = ""
    except ValueError as exc:
        wrong = str(exc)
    ctx = vars(flex.save_ctx)
    model = flex.restore()
    output_dict.clear()
    plain = model(_inputs())
    return {"groups": groups, "runs": runs, "ctx": ctx, "weight": weight, "wrong": wrong,
            "after_restore": (sorted(output_dict), plain.detach()),
            "n_params": len(list(flex.parameters()))}


def test_editing_function_groups_parameters_and_restore(run_on_ranks):
    res = run_on_ranks(2, _surgery)
    r0 = res[0]
    scale = _Scale()
    act, edited_out = _unsharded("my_model.layers.0.mlp.up", edit=lambda t: scale(t))
    _, clean_out = _unsharded("my_model.layers.0.mlp.up")
    assert r0["groups"] == {"edit": ["all", "edits"],
                            "downs": ["my_model.layers.0.mlp.down", "my_model.layers.1.mlp.down"],
                            "downs_after_remove": 0}
    every = ["my_model.layers.0.mlp.down", "my_model.layers.0.mlp.up",
             "my_model.layers.1.mlp.down"]
    assert r0["runs"]["all"]["keys"] == every
    assert r0["runs"]["downs"]["keys"] == every[::2]
    assert r0["runs"]["not-downs"]["keys"] == ["my_model.layers.0.mlp.up"]
    torch.testing.assert_close(r0["runs"]["all"]["up0"][0], act)  # captured before the edit
    for r in res:  # the edit runs on every rank, through the trainable module
        torch.testing.assert_close(r["runs"]["all"]["out"], edited_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["runs"]["downs"]["out"], clean_out, rtol=1e-5, atol=1e-6)
        assert r["ctx"] == {"seen_shape": (B, S, 2 * H), "module_type": "Linear"}
        torch.testing.assert_close(r["weight"], MyModel().my_model.layers[0].mlp.up.weight.data)
        assert "global shape (16, 8)" in r["wrong"] and "expected_shape is (8, 8)" in r["wrong"]
        assert r["after_restore"][0] == []
        torch.testing.assert_close(r["after_restore"][1], clean_out, rtol=1e-5, atol=1e-6)
    assert res[1]["runs"]["all"]["keys"] == []
    assert r0["n_params"] == len(list(MyModel().parameters())), "trainable modules excluded"


def _backward_tp() -> dict:
    from hyperpar.inspect import FlexModel, HookFunction

    output_dict: dict = {}
    flex = FlexModel(MyModel.from_pretrained("tp"), output_dict, tensor_parallel_size=2)
    flex.register_full_backward_pre_hook(HookFunction("my_model.layers.0.mlp.up",
                                                      (B, S, 2 * H)))
    flex(_inputs()).pow(2).sum().backward()
    return output_dict


def test_backward_pre_hook_captures_the_full_output_gradient_after_backward(run_on_ranks):
    got = run_on_ranks(2, _backward_tp)
    model = MyModel()
    seen = {}

    def watch(m, a, out) -> None:
        out.register_hook(lambda g: seen.setdefault("g", g.clone()))

    model.my_model.layers[0].mlp.up.register_forward_hook(watch)
    model(_inputs()).pow(2).sum().backward()
    assert list(got[0]) == ["my_model.layers.0.mlp.up.grad"] and got[1] == {}
    torch.testing.assert_close(got[0]["my_model.layers.0.mlp.up.grad"][0], seen["g"],
                               rtol=1e-5, atol=1e-6)


def _dropped() -> tuple[int, int, int]:
    from hyperpar.inspect import FlexModel, HookFunction

    model = MyModel()
    before = sum(len(m._forward_hooks) for m in model.modules())
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("my_model.layers.0.mlp"))
    during = sum(len(m._forward_hooks) for m in model.modules())
    del flex
    gc.collect()
    after = sum(len(m._forward_hooks) for m in model.modules())
    return before, during, after


def test_dropping_the_wrapper_takes_its_hooks_off_the_model():
    before, during, after = _dropped()
    assert (before, during, after) == (0, 1, 0)


def test_dropping_or_restoring_an_inspected_model_takes_its_hooks_off_the_model():
    from hyperpar.inspect import InspectedModel

    def hooks(m: nn.Module) -> int:
        return sum(len(sub._forward_hooks) for sub in m.modules())

    model = MyModel()
    im = InspectedModel(model)
    im.register_forward_hook("my_model.layers.*.mlp")
    assert hooks(model) == 2
    del im
    gc.collect()
    assert hooks(model) == 0
    im = InspectedModel(model)
    im.register_forward_hook("my_model.layers.0.mlp")
    assert im.restore() is model and hooks(model) == 0


def _sizes_error() -> str:
    from hyperpar.inspect import FlexModel

    try:
        FlexModel(MyModel(), {}, tensor_parallel_size=4)
    except ValueError as exc:
        return str(exc)
    return ""


def test_sizes_that_do_not_multiply_to_the_world_raise_on_every_rank(run_on_ranks):
    for msg in run_on_ranks(2, _sizes_error):
        assert "= 4, but the world has 2 rank(s)" in msg, msg
