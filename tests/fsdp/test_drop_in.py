"""fully_shard accepts what torch's FSDP2 accepts (issue 19 items 1-8, issue 20's fully_shard
items): list groups, shard_placement_fn, ignored_params, the root's reshard_after_forward,
meta-device init with every torch.nn.init function, frozen and tied parameters, torch 2.13's
FSDPModule methods, (dp, tp) placements, and clear errors for an optimizer built before
fully_shard and a non-floating MixedPrecisionPolicy. Every training check compares with the
same model trained in one process on the whole batch (AdamW, float32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.testing.parity import assert_close_to_reference

STEPS, BATCH = 3, 8


class Net(nn.Module):
    """Linear -> LayerNorm -> Linear, plus a bias-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.out = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


class Tied(nn.Module):
    """Embedding and output head sharing one weight."""

    def __init__(self, vocab: int = 12, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(tokens))))


def _data(step: int, tied: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if tied:
        return torch.randint(0, 12, (BATCH, 3), generator=g), torch.randint(0, 12, (BATCH, 3),
                                                                            generator=g)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 5, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tied: bool) -> torch.Tensor:
    out = model(x)
    if tied:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model: nn.Module, rows: slice, *, tied: bool = False, steps: int = STEPS,
           after_first_step=None) -> tuple[list[float], dict, dict]:
    """AdamW; returns per-step losses, the full gradients of the first step (before the
    optimizer touches anything) and the final full parameters."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads0 = [], {}
    for step in range(steps):
        x, y = _data(step, tied)
        loss = _loss(model, x[rows], y[rows], tied)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads0 = {n: _full(p.grad) for n, p in model.named_parameters()
                      if p.grad is not None}
        opt.step()
        opt.zero_grad()
        if step == 0 and after_first_step is not None:
            after_first_step(model)
    return losses, grads0, {n: _full(p) for n, p in model.named_parameters()}


def _rows() -> slice:
    from hyperpar.platform import get_platform

    pf = get_platform()
    per = BATCH // pf.world_size()
    return slice(pf.rank() * per, (pf.rank() + 1) * per)


def _reference(build, **kw) -> tuple[list[float], dict, dict]:
    torch.manual_seed(0)
    return _train(build(), slice(0, BATCH), **kw)


def _assert_same(results, ref, what: str) -> None:
    _ref_losses, ref_grads, ref_state = ref
    for _losses, grads, state in results:
        assert_close_to_reference(grads, ref_grads, what=f"{what} grads before step 1")
        assert_close_to_reference(state, ref_state, what=f"{what} params after {STEPS} steps")


# ----------------------------------------------------------------------------- 1. list group
def _list_group():
    from hyperpar import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard([model.norm, model.out])
    fully_shard(model)
    assert model.norm._fsdp_group is model.out._fsdp_group
    return _train(model, _rows())


@pytest.mark.parametrize("world", [2, 4])
def test_a_list_of_modules_is_one_group(run_on_ranks, world):
    _assert_same(run_on_ranks(world, _list_group), _reference(Net), "list group")


# ----------------------------------------------------------------------------- 2. placement fn
def _shard_dim1():
    from hyperpar import Shard, fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return placements, local, _train(model, _rows())


@pytest.mark.parametrize("world", [2, 4])
def test_shard_placement_fn_splits_the_chosen_dim(run_on_ranks, world):
    """4 ranks: dim 1 of 6 and of 10 is uneven (torch.chunk: 2,2,2,0 and 3,3,3,1 columns),
    which torch refuses and hyperpar handles."""
    from hyperpar import Shard

    results = run_on_ranks(world, _shard_dim1)
    for rank, (placements, local, _) in enumerate(results):
        assert placements["inp.weight"] == (Shard(1),)
        assert placements["inp.bias"] == (Shard(0),)
        cols = [c.shape[1] for c in torch.empty(1, 6).chunk(world, dim=1)]
        cols += [0] * (world - len(cols))
        assert local["inp.weight"] == (10, cols[rank])
        cols = [c.shape[1] for c in torch.empty(1, 10).chunk(world, dim=1)]
        cols += [0] * (world - len(cols))
        assert local["out.weight"] == (5, cols[rank])
    _assert_same([r[2] for r in results], _reference(Net), f"Shard(1) on {world} ranks")


def _ignored():
    from hyperpar import fully_shard
    from hyperpar.dtensor import DTensor

    torch.manual_seed(0)
    model = Net()
    fully_shard(model, ignored_params={model.out.bias})
    assert not isinstance(model.out.bias, DTensor)
    assert isinstance(model.out.weight, DTensor)
    x, y = _data(0)
    rows = _rows()
    _loss(model, x[rows], y[rows], False).backward()
    return {n: _full(p.grad) for n, p in model.named_parameters()}


def test_ignored_params_stay_plain_and_unreduced(run_on_ranks):
    results = run_on_ranks(2, _ignored)
    for rank, grads in enumerate(results):
        torch.manual_seed(0)
        ref = Net()
        x, y = _data(0)
        _loss(ref, x, y, False).backward()  # the mean over the batch: the reduced grads
        local = Net()
        local.load_state_dict(ref.state_dict())
        rows = slice(rank * 4, rank * 4 + 4)
        _loss(local, x[rows], y[rows], False).backward()  # this rank's own: not reduced
        want = {n: p.grad for n, p in ref.named_parameters()}
        want["out.bias"] = local.out.bias.grad
        assert_close_to_reference(grads, want, what=f"rank {rank}")


# ----------------------------------------------------------------------------- 3. root reshard
def _root_state(value):
    from hyperpar import fully_shard

    model = Net()
    fully_shard(model.inp)
    fully_shard(model, reshard_after_forward=value)
    model(torch.randn(2, 6)).sum().backward()  # the first step records the root
    out = model(torch.randn(2, 6))
    state = model._fsdp_group.state
    out.sum().backward()
    return state


def test_root_reshards_after_forward_unless_none(run_on_ranks):
    assert run_on_ranks(2, _root_state, True) == ["sharded"] * 2
    assert run_on_ranks(2, _root_state, None) == ["unsharded"] * 2
    assert run_on_ranks(2, _root_state, False) == ["unsharded"] * 2


def _bad_reshard(value):
    from hyperpar import fully_shard

    try:
        fully_shard(Net(), reshard_after_forward=value)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


def test_reshard_after_forward_is_type_checked(run_on_ranks):
    for (kind, msg) in run_on_ranks(2, _bad_reshard, "no"):
        assert kind == "TypeError" and "'no'" in msg and "bool" in msg
    for (kind, msg) in run_on_ranks(2, _bad_reshard, 3):
        assert kind == "ValueError" and "divide" in msg


# ----------------------------------------------------------------------------- 4. meta init
def _meta_init():
    from hyperpar import fully_shard
    from hyperpar.dtensor import random as dtrandom

    with torch.device("meta"):
        model = Net()
    fully_shard(model.inp)
    fully_shard(model)
    model.to_empty(device="cpu")
    dtrandom.manual_seed(7)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return {n: (_full(p), tuple(p.to_local().shape)) for n, p in model.named_parameters()}


def test_meta_init_reset_parameters_equals_the_offset_generator_in_one_process(run_on_ranks):
    from hyperpar.dtensor import random as dtrandom

    # one process, the same calls: Linear draws weight then bias (kaiming bound
    # 1/sqrt(fan_in) for both), LayerNorm fills ones/zeros
    dtrandom.manual_seed(7)
    want = {}
    for name, fan, shape in (("inp", 6, (10, 6)), ("out", 10, (5, 10))):
        bound = 1 / math.sqrt(fan)
        for kind, shp in (("weight", shape), ("bias", shape[:1])):
            u = dtrandom.uniform_block(shp, shp, (0,) * len(shp), torch.float64,
                                       torch.device("cpu"))
            want[f"{name}.{kind}"] = (-bound + 2 * bound * u).float()
    want["norm.weight"], want["norm.bias"] = torch.ones(10), torch.zeros(10)
    order = ["inp.weight", "inp.bias", "norm.weight", "norm.bias", "out.weight", "out.bias"]
    results = run_on_ranks(2, _meta_init)
    for got in results:
        assert list(got) == order
        for name in order:
            assert torch.equal(got[name][0], want[name]), name
    assert results[0]["inp.weight"][1] == (5, 6)
    # the two halves are different numbers (torch's CPU DTensor repeats one stream per rank)
    assert not torch.equal(want["inp.weight"][:5], want["inp.weight"][5:])


INITS = [
    ("uniform_", {"a": -0.5, "b": 0.5}), ("normal_", {"std": 0.02}),
    ("trunc_normal_", {"std": 0.5}), ("kaiming_uniform_", {"a": math.sqrt(5)}),
    ("kaiming_normal_", {}), ("xavier_uniform_", {}), ("xavier_normal_", {"gain": 2.0}),
    ("zeros_", {}), ("ones_", {}), ("constant_", {"val": 0.3}), ("orthogonal_", {}),
    ("eye_", {}), ("sparse_", {"sparsity": 0.5}),
]
NEEDS_GENERATOR = {"uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_"}


def _every_init():
    from hyperpar import fully_shard

    out = {}
    for name, kw in INITS:
        model = nn.Linear(6, 9, bias=False)
        fully_shard(model)
        fn = getattr(torch.nn.init, name)
        torch.manual_seed(11)  # sparse_ draws its zero pattern from the global generator
        if name in NEEDS_GENERATOR:
            fn(model.weight, generator=torch.Generator().manual_seed(5), **kw)
        else:
            fn(model.weight, **kw)
        out[name] = _full(model.weight)
        # without a generator, too: no error, and the values are finite
        fresh = nn.Linear(6, 9, bias=False)
        fully_shard(fresh)
        fn(fresh.weight, **kw)
        assert torch.isfinite(_full(fresh.weight)).all()
    conv = nn.Conv1d(4, 4, 3)
    fully_shard(conv)
    torch.nn.init.dirac_(conv.weight)
    out["dirac_"] = _full(conv.weight)
    return out


def test_every_nn_init_function_works_on_sharded_parameters(run_on_ranks):
    """With a generator, each equals one process bitwise (the whole tensor drawn from it)."""
    for got in run_on_ranks(2, _every_init):
        for name, kw in INITS:
            want = torch.empty(9, 6)
            fn = getattr(torch.nn.init, name)
            torch.manual_seed(11)
            if name in NEEDS_GENERATOR:
                fn(want, generator=torch.Generator().manual_seed(5), **kw)
            else:
                fn(want, **kw)
            assert torch.equal(got[name], want), name
        want = torch.empty(4, 4, 3)
        torch.nn.init.dirac_(want)
        assert torch.equal(got["dirac_"], want)


# ----------------------------------------------------------------------------- 5. frozen
def _frozen_submodule():
    from hyperpar import fully_shard

    torch.manual_seed(0)
    model = Net()
    # the root group holds a frozen norm and a trainable head; the head's gradients are
    # complete before backward reaches the norm, whose weight it still needs (to send a
    # gradient on to the separately sharded input layer)
    model.norm.requires_grad_(False)
    fully_shard(model.inp)
    fully_shard(model)
    return _train(model, _rows())


def _frozen_ref_build():
    model = Net()
    model.norm.requires_grad_(False)
    return model


def test_a_group_with_a_frozen_submodule_trains_like_one_process(run_on_ranks):
    _assert_same(run_on_ranks(2, _frozen_submodule), _reference(_frozen_ref_build), "frozen")


def _freeze_after_shard():
    from hyperpar import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.out)
    fully_shard(model)
    model.out.requires_grad_(False)  # after fully_shard: must be honoured
    before = _full(model.out.weight)
    res = _train(model, _rows())
    assert torch.equal(_full(model.out.weight), before)
    assert model.out.weight.grad is None
    return res


def test_requires_grad_false_after_fully_shard_is_honoured(run_on_ranks):
    def build():
        m = Net()
        m.out.requires_grad_(False)
        return m

    _assert_same(run_on_ranks(2, _freeze_after_shard), _reference(build), "frozen later")


# ----------------------------------------------------------------------------- 6. tied
def _tied():
    from hyperpar import fully_shard

    torch.manual_seed(0)
    model = Tied()
    fully_shard(model.mid)
    fully_shard(model)
    assert model.head.weight is model.emb.weight
    return _train(model, _rows(), tied=True)


@pytest.mark.parametrize("world", [2, 4])
def test_tied_weights_inside_one_unit_train_like_one_process(run_on_ranks, world):
    _assert_same(run_on_ranks(world, _tied), _reference(Tied, tied=True), "tied")


def _tied_across_units():
    from hyperpar import fully_shard

    model = Tied()
    fully_shard(model.head)
    try:
        fully_shard(model)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_weight_tied_across_two_units_is_refused(run_on_ranks):
    for msg in run_on_ranks(2, _tied_across_units):
        assert msg is not None and "tied across two fully_shard units" in msg
        assert "emb.weight" in msg or "weight" in msg


# ----------------------------------------------------------------------------- 7. methods
def test_fsdp_module_has_every_method_of_torch_fsdp_module():
    import torch.distributed.fsdp as tfsdp

    from hyperpar.fsdp import FSDPModule

    theirs = {m for m in dir(tfsdp.FSDPModule) if not m.startswith("_")}
    missing = sorted(m for m in theirs if not hasattr(FSDPModule, m))
    assert not missing, missing


def _forward_method():
    from hyperpar import fully_shard
    from hyperpar.fsdp import register_fsdp_forward_method

    class WithGenerate(Net):
        def generate(self, x):
            return self.out.weight.shape, self.out(torch.tanh(self.norm(self.inp(x))))

    torch.manual_seed(0)
    model = WithGenerate()
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")
    with torch.no_grad():  # without autograd the root reshards after it, too
        shape, y = model.generate(torch.ones(1, 6))
    return tuple(shape), model._fsdp_group.state, y.detach()


def test_register_fsdp_forward_method_gathers_for_that_method(run_on_ranks):
    torch.manual_seed(0)
    want = Net()(torch.ones(1, 6)).detach()
    for shape, state, y in run_on_ranks(2, _forward_method):
        assert shape == (5, 10) and state == "sharded"  # gathered inside, freed after
        assert_close_to_reference(y, want, what="generate")


# ----------------------------------------------------------------------------- 8. dp x tp
def _dp_tp_placements():
    from hyperpar import RowwiseParallel, fully_shard, init_device_mesh, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    want = model[0].weight.detach().clone()
    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    w = model[0].weight
    return tuple(w.placements), w.device_mesh.mesh_dim_names, torch.equal(_full(w), want)


def test_tp_then_fsdp_placements_read_in_torch_order(run_on_ranks):
    from hyperpar import Shard

    for placements, names, same in run_on_ranks(4, _dp_tp_placements):
        assert placements == (Shard(0), Shard(1)) and names == ("dp", "tp") and same


# ----------------------------------------------------------------------------- issue 20
def _optimizer_before():
    from hyperpar import fully_shard

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fully_shard(model)
    model(torch.randn(2, 6)).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_an_optimizer_built_before_fully_shard_is_refused_at_step(run_on_ranks):
    for msg in run_on_ranks(2, _optimizer_before):
        assert msg is not None and "built before fully_shard" in msg
        assert "model.parameters() after" in msg


def test_mixed_precision_policy_needs_a_floating_dtype():
    from hyperpar.fsdp import MixedPrecisionPolicy

    with pytest.raises(ValueError, match="param_dtype=torch.int32 is not a floating dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="reduce_dtype"):
        MixedPrecisionPolicy(reduce_dtype=torch.int64)
    MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # fine


def test_fully_shard_on_torch_refuses_a_mindspore_dtype():
    """The policy class imports no framework and takes MindSpore's dtypes too (read from the
    object's type); torch's fully_shard refuses them, before any collective."""
    from hyperpar.fsdp import MixedPrecisionPolicy, fully_shard

    # what mindspore.float16 looks like to the policy, without importing MindSpore here
    float16 = type("Float", (), {"__module__": "mindspore._c_expression.typing"})()
    policy = MixedPrecisionPolicy(param_dtype=float16)
    with pytest.raises(TypeError, match="mp_policy.param_dtype=.* is not a torch.dtype"):
        fully_shard(torch.nn.Linear(2, 2), mp_policy=policy)


LONE_SCRIPT = '''
import copy
import torch
from torch import nn
from hyperpar import fully_shard
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
reference = copy.deepcopy(model)
for layer in (model[0], model[2]):
    fully_shard(layer)  # no mesh, no init_process_group: torch joins a world of one
fully_shard(model)
x = torch.randn(3, 4)
torch.testing.assert_close(model(x), reference(x), atol=0, rtol=0)
print("lone fully_shard OK")
'''


def test_fully_shard_without_a_mesh_or_process_group_joins_the_world(tmp_path) -> None:
    """torch's fully_shard() with no mesh initialises the default group itself; hyperpar's
    raised torch's raw 'Default process group has not been initialized'."""
    import os
    import subprocess
    import sys

    script = tmp_path / "lone.py"
    script.write_text(LONE_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["HYPERPAR_BACKEND"] = "cpu"
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lone fully_shard OK" in proc.stdout
