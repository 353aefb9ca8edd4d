"""torch's tensor-parallel options on MindSpore Cells, each against plain one-process MindSpore:
``src_data_rank``, tied parameters, the already-parallelized check, uneven (``torch.chunk``)
shards and keyword-input layouts -- all through hyperpar's one ``parallelize_module``.

Tolerance, as in ``test_tensor_parallel.py``: only the order of float32 sums changes (inner dims
<= 16, values O(1), 3 SGD steps at lr 0.1): below ~6e-6 * scale; we allow 2e-5 * scale, far
below a real error (a missing reduction, a wrong slice: O(scale)).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyperpar.dtensor.placement import Replicate, Shard, chunk_bounds
from tests.mindspore._cells import param_arrays, set_weights, train_sgd

STEPS = 3
LR = 0.1
D, VOCAB = 8, 11


def _mesh():
    from hyperpar import init_device_mesh
    from hyperpar.platform import get_platform

    return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))


def _piece(full: np.ndarray, dim: int | None, n: int, r: int) -> np.ndarray:
    """Rank ``r``'s torch.chunk piece of ``full`` along ``dim`` (written out here, not taken
    from the library)."""
    if dim is None:
        return full
    step = -(-full.shape[dim] // n)
    return np.take(full, np.arange(min(r * step, full.shape[dim]),
                                   min((r + 1) * step, full.shape[dim])), axis=dim)


def _assert_close(res: dict, splits: dict[str, int | None]) -> None:
    scale = max(1.0, float(np.abs(res["ref_out"]).max()))
    tol = 2e-5 * scale
    assert res["ref_losses"][-1] < res["ref_losses"][0]  # the steps moved the parameters
    np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=2e-5, atol=tol)
    np.testing.assert_allclose(res["out"], res["ref_out"], rtol=0, atol=tol)
    assert set(res["mine"]) == set(res["ref"]) == set(splits)
    for name, dim in splits.items():
        want = _piece(res["ref"][name], dim, res["n"], res["r"])
        pscale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(res["mine"][name], want, rtol=0, atol=2e-5 * pscale,
                                   err_msg=f"parameter {name}")


# --------------------------------------------------------------------------- uneven shards
class Uneven(nn.Cell):
    """Every split uneven on 2 and 4 ranks: vocab 11, embedding dim 7, hidden 7."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)          # rowwise: 11 rows
        self.emb2 = nn.Embedding(VOCAB, 7)         # colwise: 7 columns, gathered
        self.mix = nn.Dense(7, D)
        self.fc1 = nn.Dense(D, 7)                  # colwise: 7 outputs
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(7, D)                  # rowwise: 7 inputs

    def construct(self, ids):
        h = self.emb(ids) + self.mix(self.emb2(ids))
        return self.fc2(self.act(self.fc1(h)))


def _run_uneven() -> dict:
    from hyperpar import ColwiseParallel, RowwiseParallel, parallelize_module

    rng = np.random.default_rng(3)
    ids = ms.Tensor(rng.integers(0, VOCAB, (3, 5)).astype(np.int32))
    y = ms.Tensor(rng.standard_normal((3, 5, D)).astype(np.float32))
    reference, model = Uneven(), Uneven()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    parallelize_module(model, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate()),
        "emb2": ColwiseParallel(output_layouts=Replicate()),
        "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ref_losses, ref_out = train_sgd(reference, ids, y, STEPS, LR)
    losses, out = train_sgd(model, ids, y, STEPS, LR)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "ref_losses": ref_losses,
            "losses": losses, "ref_out": ref_out, "out": out, "ref": param_arrays(reference),
            "mine": param_arrays(model)}


@pytest.mark.parametrize("n", [2, 4])
def test_uneven_shards_follow_torch_chunk_and_train_like_one_process(pool2, pool4, n):
    splits = {"emb.embedding_table": 0, "emb2.embedding_table": 1, "mix.weight": None,
              "mix.bias": None, "fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1,
              "fc2.bias": None}
    for res in (pool2 if n == 2 else pool4).run(_run_uneven):
        _assert_close(res, splits)


def test_chunk_bounds_is_the_rule_the_test_writes_out():
    for size in range(1, 13):
        for n in (2, 3, 4):
            for r in range(n):
                start, length = chunk_bounds(size, n, r)
                assert _piece(np.arange(size), 0, n, r).tolist() == list(
                    range(start, start + length))


# --------------------------------------------------------------------------- src_data_rank
class MLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(D, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(16, D)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


_MLP_SPLITS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}


def _run_src_data_rank(src: int | None) -> dict:
    from hyperpar import ColwiseParallel, RowwiseParallel, parallelize_module
    from hyperpar.platform import get_platform

    me = get_platform().rank()
    rng = np.random.default_rng(1)
    x = ms.Tensor(rng.standard_normal((4, 3, D)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((4, 3, D)).astype(np.float32))
    model = MLP()
    set_weights(model, seed=10 + me)  # every rank starts from different values
    own = {n: a.copy() for n, a in param_arrays(model).items()}
    mesh = _mesh()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
                       src_data_rank=src)
    # copies: asnumpy() may share the Parameter's memory, which training then updates
    out = {"n": mesh.size(), "r": mesh.get_local_rank(), "own": own,
           "first": {n: a.copy() for n, a in param_arrays(model).items()}}
    if src is not None:  # then the model is rank src's, trained as one process would
        reference = MLP()
        set_weights(reference, seed=10 + src)
        out["ref_losses"], out["ref_out"] = train_sgd(reference, x, y, STEPS, LR)
        out["losses"], out["out"] = train_sgd(model, x, y, STEPS, LR)
        out["ref"], out["mine"] = param_arrays(reference), param_arrays(model)
    return out


@pytest.mark.parametrize("src", [1, None])
def test_src_data_rank_scatters_that_ranks_parameters_or_keeps_each_ranks_own(pool2, src):
    results = pool2.run(_run_src_data_rank, src)
    for res in results:
        origin = results[src]["own"] if src is not None else res["own"]
        for name, dim in _MLP_SPLITS.items():
            np.testing.assert_array_equal(res["first"][name],
                                          _piece(origin[name], dim, res["n"], res["r"]),
                                          err_msg=name)
        if src is not None:
            _assert_close(res, _MLP_SPLITS)


def _bad_src_data_rank() -> str:
    from hyperpar import ColwiseParallel, parallelize_module

    try:
        parallelize_module(MLP(), _mesh(), {"fc1": ColwiseParallel()}, src_data_rank=5)
    except ValueError as exc:
        return str(exc)
    return ""


def test_src_data_rank_outside_the_group_is_refused_on_every_rank(pool2):
    for msg in pool2.run(_bad_src_data_rank):
        assert "src_data_rank=5 is not a rank of the 2-rank tensor-parallel group" in msg


# --------------------------------------------------------------------------- tied parameters
class Tied(nn.Cell):
    """Token embedding and output head share one (VOCAB, D) table (``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc = nn.Dense(D, D)
        self.head = nn.Dense(D, VOCAB, has_bias=False)
        self.head.weight = self.emb.embedding_table

    def construct(self, ids):
        return self.head(self.fc(self.emb(ids)))


def _run_tied() -> dict:
    from hyperpar import ColwiseParallel, RowwiseParallel, parallelize_module

    rng = np.random.default_rng(2)
    ids = ms.Tensor(rng.integers(0, VOCAB, (3, 4)).astype(np.int32))
    y = ms.Tensor(rng.standard_normal((3, 4, VOCAB)).astype(np.float32))
    reference, model = Tied(), Tied()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    # both holders Shard(0): vocabulary-parallel lookup, vocabulary-parallel logits (gathered)
    parallelize_module(model, mesh, {"emb": RowwiseParallel(input_layouts=Replicate()),
                                     "head": ColwiseParallel(output_layouts=Replicate())})
    one = model.head.weight is model.emb.embedding_table
    ref_losses, ref_out = train_sgd(reference, ids, y, STEPS, LR)
    losses, out = train_sgd(model, ids, y, STEPS, LR)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "one": one,
            "count": len(model.trainable_params()), "ref_losses": ref_losses, "losses": losses,
            "ref_out": ref_out, "out": out, "ref": param_arrays(reference),
            "mine": param_arrays(model)}


def test_a_tied_parameter_stays_one_and_trains_like_one_process(pool2):
    for res in pool2.run(_run_tied):
        assert res["one"] and res["count"] == 3  # table, fc.weight, fc.bias
        _assert_close(res, {"emb.embedding_table": 0, "fc.weight": None, "fc.bias": None})


def _tie_mismatch() -> tuple[str, bool]:
    from hyperpar import ColwiseParallel, TiedParameterError, parallelize_module

    model = Tied()
    before = {n: p.shape for n, p in model.parameters_and_names()}
    try:  # the embedding would split columns (Shard(1)), the head rows (Shard(0))
        parallelize_module(model, _mesh(), {"emb": ColwiseParallel(), "head": ColwiseParallel()})
    except TiedParameterError as exc:
        return str(exc), before == {n: p.shape for n, p in model.parameters_and_names()}
    return "", False


def test_a_plan_that_would_split_a_tie_is_refused_before_anything_changes(pool2):
    for msg, untouched in pool2.run(_tie_mismatch):
        assert "'emb.embedding_table' and 'head.weight' are one tied parameter" in msg
        assert "Shard(dim=1)" in msg and "Shard(dim=0)" in msg
        assert untouched


# --------------------------------------------------------------------------- applied twice
def _twice() -> list[tuple[str, bool]]:
    from hyperpar import (
        AlreadyParallelizedError,
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh()
    out = []
    model = MLP()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for plan in ({"fc1": ColwiseParallel()},
                 {"fc2": PrepareModuleInput(input_layouts=Shard(-1),
                                            desired_input_layouts=Replicate()),
                  "fc1": RowwiseParallel()}):
        before = {n: p.shape for n, p in model.parameters_and_names()}
        try:
            parallelize_module(model, mesh, plan)
            out.append(("", False))
        except AlreadyParallelizedError as exc:
            out.append((str(exc), before == {n: p.shape for n, p in
                                              model.parameters_and_names()}))
    fresh = MLP()
    try:  # one module claimed twice in one plan
        parallelize_module(fresh, mesh, {"fc1": ColwiseParallel(), "fc*": ColwiseParallel()})
        out.append(("", False))
    except AlreadyParallelizedError as exc:
        out.append((str(exc), fresh.fc1.weight.shape == (16, D)))
    return out


def test_an_already_parallelized_cell_is_refused_and_left_alone(pool2):
    for (again, ok1), (mixed, ok2), (in_plan, ok3) in pool2.run(_twice):
        assert "'fc1' (Dense) is already parallelized: ColwiseParallel(" in again
        assert "'fc1' (Dense) is already parallelized" in mixed  # PrepareModuleInput on fc2 ok
        assert "'fc1' (Dense) is already parallelized" in in_plan
        assert ok1 and ok2 and ok3


# --------------------------------------------------------------------------- keyword inputs
class Gated(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(D, D)

    def construct(self, x, gate=None):
        return self.fc(x) * gate


class GatedModel(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Gated()

    def construct(self, x, g):
        return self.inner(x, gate=g)


def _run_kwarg_layouts() -> dict:
    from hyperpar import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    rng = np.random.default_rng(4)
    x = ms.Tensor(rng.standard_normal((2, 6, D)).astype(np.float32))
    g = ms.Tensor(rng.standard_normal((2, 6, D)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((2, 6, D)).astype(np.float32))
    reference, model = GatedModel(), GatedModel()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    parallelize_module(model, mesh, {
        "": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        "inner": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                    input_kwarg_layouts={"gate": Replicate()},
                                    desired_input_kwarg_layouts={"gate": Shard(1)}),
        "inner.fc": SequenceParallel()})  # each rank's positions; gradients all-reduced

    def train(m):
        opt = nn.SGD(m.trainable_params(), learning_rate=LR)
        step = ms.value_and_grad(lambda a, b, t: ((m(a, b) - t) ** 2).mean(), None,
                                 opt.parameters)
        losses = []
        for _ in range(STEPS):
            loss, grads = step(x, g, y)
            opt(grads)
            losses.append(float(loss.asnumpy()))
        return losses, m(x, g).asnumpy()

    ref_losses, ref_out = train(reference)
    losses, out = train(model)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "ref_losses": ref_losses,
            "losses": losses, "ref_out": ref_out, "out": out, "ref": param_arrays(reference),
            "mine": param_arrays(model)}


def test_keyword_input_layouts_reshard_a_keyword_argument(pool2):
    for res in pool2.run(_run_kwarg_layouts):
        _assert_close(res, {"inner.fc.weight": None, "inner.fc.bias": None})


def test_kwarg_layouts_need_matching_keys():
    from hyperpar_mindspore import PrepareModuleInput

    with pytest.raises(ValueError, match="keys \\['a'\\] and desired_input_kwarg_layouts keys"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(1)}, desired_input_kwarg_layouts={})


# --------------------------------------------------------------------------- Shard -> Shard
class Resharded(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(D, D)
        self.b = nn.Tanh()

    def construct(self, x):
        return self.b(self.a(x))


def _run_all_to_all(seq: int) -> dict:
    from hyperpar import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        SequenceParallel,
        parallelize_module,
    )

    rng = np.random.default_rng(8)
    x = ms.Tensor(rng.standard_normal((2, seq, D)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((2, seq, D)).astype(np.float32))
    reference, model = Resharded(), Resharded()
    set_weights(reference)
    set_weights(model)
    mesh = _mesh()
    # a runs on this rank's positions; b re-shards them to this rank's features (all-to-all,
    # uneven both ways when seq is odd) and gathers the features on the way out
    parallelize_module(model, mesh, {
        "a": SequenceParallel(),
        "": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
        "b": PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Shard(2),
                                      output_layouts=Shard(2),
                                      desired_output_layouts=Replicate())})
    ref_losses, ref_out = train_sgd(reference, x, y, STEPS, LR)
    losses, out = train_sgd(model, x, y, STEPS, LR)
    return {"n": mesh.size(), "r": mesh.get_local_rank(), "ref_losses": ref_losses,
            "losses": losses, "ref_out": ref_out, "out": out, "ref": param_arrays(reference),
            "mine": param_arrays(model)}


@pytest.mark.parametrize("seq", [4, 5])
def test_shard_to_shard_all_to_all_trains_like_one_process(pool2, seq):
    for res in pool2.run(_run_all_to_all, seq):
        _assert_close(res, {"a.weight": None, "a.bias": None})
