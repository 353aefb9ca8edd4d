"""Tensor parallelism, one body for torch and MindSpore: plans trained on real ranks against the
same model built independently in plain torch / plain MindSpore in one process.

* an MLP (Linear -> ReLU -> Linear, hidden 7: uneven over 2 and 4 ranks) with
  ``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}``, and with fc2's output left a
  ``Partial`` DTensor (``output_layouts=Partial(), use_local_output=False``, summed by
  ``full_tensor()`` in the loss);
* a TP + SP block (LayerNorm + MLP + residual, sequence 7: 2, 2, 2, 1 over 4 ranks) with
  ``SequenceParallel``, ``ColwiseParallel(input_layouts=Shard(1))``,
  ``RowwiseParallel(output_layouts=Shard(1))``, entered and left through
  ``PrepareModuleInput`` / ``PrepareModuleOutput``;
* Megatron's layers (``VocabParallelEmbedding``, ``ColumnParallelLinear``,
  ``RowParallelLinear``: the same keywords on both frameworks, Cells on MindSpore), against a
  plain model built from their gathered initial weights;
* a small LM (vocabulary-parallel embedding, ``SequenceParallel`` norm, a column-wise head with
  ``use_local_output=False``) trained with ``loss_parallel`` cross-entropy on the vocabulary-
  sharded logits DTensor, plain and with class weights, label smoothing and ignored labels.

Each trains 3 SGD steps (lr 0.1); the losses, the final output and every parameter (gathered
with ``full_tensor()``) are compared with the one-process model.

Tolerance: weights normal(0, 0.5), inputs normal(0, 1), inner dims <= 16, so activations and
gradients are O(1-10). Parallel and one-process runs differ only in the order of float32 sums:
a K-term sum (K <= 16; the cross-entropy sum of exponentials is split over ranks, <= 11 terms)
moves by <= K * 2^-24 relative, ~1e-6; a forward + backward chains a few such sums and 3 SGD
steps at lr 0.1 carry the difference forward with a gain below 2 each, giving < ~6e-6 * scale.
We allow 2e-5 * max(1, max|want|): robust across x86 CPUs (vectorized sums or not), while a
missing all-reduce, a wrong shard or a doubled bias is O(scale).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest

from hyperpar import Replicate, Shard
from tests.both._frameworks import Framework, get
from tests.both._numpy_layout import close

pytestmark = pytest.mark.timeout(900)

RTOL = 2e-5
STEPS, LR = 3, 0.1
B, D, H, VOCAB = 2, 8, 7, 11  # H = 7 and VOCAB = 11 split unevenly over 2 and 4 ranks


def _weights(seed: int, **shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def _train(fw: Framework, model: Any, loss_of: Callable[[Any], Any],
           ctx: Callable[[], Any] = nullcontext) -> list[float]:
    step = fw.sgd(model, LR)
    losses = []
    for _ in range(STEPS):
        with ctx():  # loss_parallel wraps the backward too (torch requires it)
            losses.append(step(lambda: loss_of(model)))
    return losses


# -------------------------------------------------------------------------------- the MLP
def _mlp(fw: Framework, w: dict[str, np.ndarray]) -> Any:
    return fw.container(lambda m, x: m.fc2(fw.relu(m.fc1(x))),
                        fc1=fw.linear(w["w1"], w["b1"]), fc2=fw.linear(w["w2"], w["b2"]))


def _run_mlp(framework: str, n: int, output: str = "local") -> dict:
    from hyperpar import (
        ColwiseParallel,
        Partial,
        RowwiseParallel,
        init_device_mesh,
        parallelize_module,
    )

    fw = get(framework)
    mesh = init_device_mesh((n,))
    w = _weights(0, w1=(H, D), b1=(H,), w2=(D, H), b2=(D,))
    rng = np.random.default_rng(1)
    x = fw.tensor(rng.standard_normal((4, D)).astype(np.float32))
    y = fw.tensor(rng.standard_normal((4, D)).astype(np.float32))

    def plain(out: Any) -> Any:  # a Partial DTensor output is summed over the ranks
        return out.full_tensor() if hasattr(out, "full_tensor") else out

    def loss_of(model: Any) -> Any:
        return ((plain(model(x)) - y) ** 2).mean()

    # output="partial": fc2 leaves its partial sums unreduced (a Partial DTensor); its whole
    # bias must enter that sum once, not once per rank
    fc2 = (RowwiseParallel(output_layouts=Partial(), use_local_output=False)
           if output == "partial" else RowwiseParallel())
    model = parallelize_module(_mlp(fw, w), mesh, {"fc1": ColwiseParallel(), "fc2": fc2})
    if output == "partial":
        out = model(x)
        assert tuple(out.placements) == (Partial(),), out.placements
    losses = _train(fw, model, loss_of)
    ref = _mlp(fw, w)
    ref_losses = _train(fw, ref, loss_of)
    layout = {  # (module, parameter) -> its planned placement
        ("fc1", "weight"): (Shard(0), (H, D)), ("fc1", "bias"): (Shard(0), (H,)),
        ("fc2", "weight"): (Shard(1), (D, H)), ("fc2", "bias"): (Replicate(), (D,)),
    }
    copied = copy.deepcopy(model)  # keeps each parameter's layout and full_tensor()
    params, ref_params, copy_same = {}, {}, []
    for (mod, kind), (placement, shape) in layout.items():
        getter = fw.weight if kind == "weight" else fw.bias
        params[f"{mod}.{kind}"] = fw.full_param(getter(getattr(model, mod)), mesh, placement,
                                                shape)
        ref_params[f"{mod}.{kind}"] = fw.numpy(getter(getattr(ref, mod)))
        # the same pieces gathered the same way: equal exactly
        copy_same.append(np.array_equal(params[f"{mod}.{kind}"], fw.full_param(
            getter(getattr(copied, mod)), mesh, placement, shape)))
    return {"losses": losses, "ref_losses": ref_losses, "out": fw.numpy(plain(model(x))),
            "ref_out": fw.numpy(ref(x)), "params": params, "ref_params": ref_params,
            "copy_same": copy_same}


# -------------------------------------------------------------------------------- Megatron layers
def _run_layers(framework: str, n: int) -> dict:
    """``VocabParallelEmbedding -> ColumnParallelLinear -> relu -> RowParallelLinear``, built
    as hyperpar's layers (each framework's own initialisation, scattered from rank 0); the
    one-process reference is built from the gathered initial weights."""
    from hyperpar import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        init_device_mesh,
    )

    fw = get(framework)
    mesh = init_device_mesh((n,))
    forward = lambda m, ids: m.fc2(fw.relu(m.fc1(m.emb(ids))))  # noqa: E731
    model = fw.container(forward, emb=VocabParallelEmbedding(VOCAB, D),
                         fc1=ColumnParallelLinear(D, H), fc2=RowParallelLinear(H, D))
    layout = {  # (module, parameter) -> its placement and global shape
        ("emb", "weight"): (Shard(0), (VOCAB, D)),
        ("fc1", "weight"): (Shard(0), (H, D)), ("fc1", "bias"): (Shard(0), (H,)),
        ("fc2", "weight"): (Shard(1), (D, H)), ("fc2", "bias"): (Replicate(), (D,)),
    }

    def gathered() -> dict[str, np.ndarray]:
        return {f"{mod}.{kind}": fw.full_param(
                    (fw.weight if kind == "weight" else fw.bias)(getattr(model, mod)), mesh,
                    placement, shape)
                for (mod, kind), (placement, shape) in layout.items()}

    w0 = gathered()
    ref = fw.container(forward, emb=fw.embedding(w0["emb.weight"]),
                       fc1=fw.linear(w0["fc1.weight"], w0["fc1.bias"]),
                       fc2=fw.linear(w0["fc2.weight"], w0["fc2.bias"]))
    rng = np.random.default_rng(7)
    ids = fw.index(rng.integers(0, VOCAB, (B, 6)))
    y = fw.tensor(rng.standard_normal((B, 6, D)).astype(np.float32))

    def loss_of(m: Any) -> Any:
        return ((m(ids) - y) ** 2).mean()

    losses, ref_losses = _train(fw, model, loss_of), _train(fw, ref, loss_of)
    ref_params = {f"{mod}.{kind}": fw.numpy(
                      (fw.weight if kind == "weight" else fw.bias)(getattr(ref, mod)))
                  for mod, kind in layout}
    return {"losses": losses, "ref_losses": ref_losses, "out": fw.numpy(model(ids)),
            "ref_out": fw.numpy(ref(ids)), "params": gathered(), "ref_params": ref_params}


# -------------------------------------------------------------------------------- TP + SP block
def _block_model(fw: Framework, w: dict[str, np.ndarray]) -> Any:
    def block_forward(m: Any, x: Any) -> Any:
        return x + m.fc2(fw.relu(m.fc1(m.norm(x))))

    block = fw.container(block_forward, norm=fw.layer_norm(w["g"], w["beta"]),
                         fc1=fw.linear(w["w1"], w["b1"]), fc2=fw.linear(w["w2"], w["b2"]))
    return fw.container(lambda m, x: m.block(x), block=block)


def _run_block(framework: str, n: int, seq: int) -> dict:
    from hyperpar import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        init_device_mesh,
        parallelize_module,
    )

    fw = get(framework)
    mesh = init_device_mesh((n,))
    w = _weights(2, g=(D,), beta=(D,), w1=(H, D), b1=(H,), w2=(D, H), b2=(D,))
    w["g"] += 1.0
    rng = np.random.default_rng(3)
    x = fw.tensor(rng.standard_normal((B, seq, D)).astype(np.float32))
    y = fw.tensor(rng.standard_normal((B, seq, D)).astype(np.float32))

    def loss_of(model: Any) -> Any:
        return ((model(x) - y) ** 2).mean()

    plan = {
        # The whole input enters the block as a DTensor of this rank's positions, and fc2's
        # output stays a DTensor, so the residual adds two sequence-sharded DTensors that know
        # their global length (7 over 4 ranks: 2, 2, 2, 1); the root gathers the sequence back.
        "": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        "block": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                    use_local_output=False),
        "block.norm": SequenceParallel(),
        "block.fc1": ColwiseParallel(input_layouts=Shard(1)),
        "block.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    model = parallelize_module(_block_model(fw, w), mesh, plan)
    losses = _train(fw, model, loss_of)
    ref = _block_model(fw, w)
    ref_losses = _train(fw, ref, loss_of)
    layout = {
        ("norm", "weight"): (Replicate(), (D,)), ("norm", "bias"): (Replicate(), (D,)),
        ("fc1", "weight"): (Shard(0), (H, D)), ("fc1", "bias"): (Shard(0), (H,)),
        ("fc2", "weight"): (Shard(1), (D, H)), ("fc2", "bias"): (Replicate(), (D,)),
    }
    params, ref_params = {}, {}
    for (mod, kind), (placement, shape) in layout.items():
        getter = fw.weight if kind == "weight" else fw.bias
        params[f"{mod}.{kind}"] = fw.full_param(getter(getattr(model.block, mod)), mesh,
                                                placement, shape)
        ref_params[f"{mod}.{kind}"] = fw.numpy(getter(getattr(ref.block, mod)))
    return {"losses": losses, "ref_losses": ref_losses, "out": fw.numpy(model(x)),
            "ref_out": fw.numpy(ref(x)), "params": params, "ref_params": ref_params}


# ---------------------------------------------------------------------- LM + loss_parallel
def _lm(fw: Framework, w: dict[str, np.ndarray]) -> Any:
    return fw.container(lambda m, ids: m.head(m.norm_f(m.emb(ids))),
                        emb=fw.embedding(w["emb"]), norm_f=fw.layer_norm(w["g"], w["beta"]),
                        head=fw.linear(w["head"], None))


def _run_lm(framework: str, n: int, loss: str = "plain") -> dict:
    from hyperpar import (
        ColwiseParallel,
        DTensor,
        RowwiseParallel,
        SequenceParallel,
        init_device_mesh,
        loss_parallel,
        parallelize_module,
    )

    fw = get(framework)
    mesh = init_device_mesh((n,))
    seq = 8
    w = _weights(4, emb=(VOCAB, D), g=(D,), beta=(D,), head=(VOCAB, D))
    w["g"] += 1.0
    rng = np.random.default_rng(5)
    ids = fw.index(rng.integers(0, VOCAB, (B, seq)))
    label_ids = rng.integers(0, VOCAB, (B * seq,))
    options: dict[str, Any] = {}
    if loss == "weighted":  # class weights, label smoothing, two ignored positions
        label_ids[[3, 11]] = -100
        options = {"weight": fw.tensor(rng.uniform(0.5, 2.0, VOCAB).astype(np.float32)),
                   "label_smoothing": 0.1}
    labels = fw.index(label_ids)

    def loss_of(model: Any) -> Any:
        return fw.cross_entropy(model(ids).reshape(B * seq, VOCAB), labels, **options)

    plan = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }
    model = parallelize_module(_lm(fw, w), mesh, plan)
    norm_out = model.norm_f(model.emb(ids))
    sp_output = "DTensor" if isinstance(norm_out, DTensor) else "local"
    logits = model(ids)
    is_dtensor = isinstance(logits, DTensor)
    placements = tuple(logits.placements) if is_dtensor else None
    losses = _train(fw, model, loss_of, ctx=loss_parallel)
    ref = _lm(fw, w)
    ref_losses = _train(fw, ref, loss_of)
    layout = {
        ("emb", "weight"): (Shard(0), (VOCAB, D)),
        ("norm_f", "weight"): (Replicate(), (D,)), ("norm_f", "bias"): (Replicate(), (D,)),
        ("head", "weight"): (Shard(0), (VOCAB, D)),
    }
    params, ref_params = {}, {}
    for (mod, kind), (placement, shape) in layout.items():
        getter = fw.weight if kind == "weight" else fw.bias
        params[f"{mod}.{kind}"] = fw.full_param(getter(getattr(model, mod)), mesh, placement,
                                                shape)
        ref_params[f"{mod}.{kind}"] = fw.numpy(getter(getattr(ref, mod)))
    return {"losses": losses, "ref_losses": ref_losses,
            "out": fw.numpy(model(ids).full_tensor()), "ref_out": fw.numpy(ref(ids)),
            "params": params, "ref_params": ref_params, "is_dtensor": is_dtensor,
            "placements": placements, "shape": tuple(logits.shape), "sp_output": sp_output}


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        close(f"rank {rank}: losses", np.array(res["losses"]), np.array(res["ref_losses"]), RTOL)
        close(f"rank {rank}: output after training", res["out"], res["ref_out"], RTOL)
        assert res["params"].keys() == res["ref_params"].keys()
        for name, want in res["ref_params"].items():
            close(f"rank {rank}: {name}", res["params"][name], want, RTOL)
        # The loss moved: a plan that trained nothing would match an untrained reference only.
        assert res["losses"][0] != res["losses"][-1]


@pytest.mark.parametrize("n, output", [(2, "local"), (4, "local"), (4, "partial")])
def test_colwise_rowwise_mlp_trains_like_one_process(framework, pool, n, output) -> None:
    results = pool(n).run(_run_mlp, framework, n, output)
    _check(results)
    assert all(all(res["copy_same"]) for res in results), [r["copy_same"] for r in results]


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_layers_train_like_one_process(framework, pool, n) -> None:
    _check(pool(n).run(_run_layers, framework, n))


@pytest.mark.parametrize("n, seq", [(2, 8), (4, 8), (4, 7)])
def test_sequence_parallel_block_trains_like_one_process(framework, pool, n, seq) -> None:
    _check(pool(n).run(_run_block, framework, n, seq))


@pytest.mark.parametrize("n, loss", [(2, "plain"), (4, "plain"), (4, "weighted")])
def test_dtensor_head_with_loss_parallel_trains_like_one_process(framework, pool, n,
                                                                 loss) -> None:
    results = pool(n).run(_run_lm, framework, n, loss)
    _check(results)
    for res in results:
        assert res["is_dtensor"], "use_local_output=False must return a DTensor"
        assert res["shape"] == (B, 8, VOCAB), res["shape"]
        # torch reports the class dim as given (Shard(-1) normalized or not, by version);
        # both are the vocabulary dim.
        assert res["placements"] in ((Shard(-1),), (Shard(2),)), res["placements"]
        # A real difference, documented in docs/mindspore.md: torch's SequenceParallel returns a
        # DTensor by default (use_local_output=False); MindSpore's returns the local slice.
        if framework == "torch":
            assert res["sp_output"] == "DTensor", res["sp_output"]
        else:
            assert res["sp_output"] == "local", res["sp_output"]


# ------------------------------------------------------------------- one error, every framework
def _run_bad_arguments(framework: str, n: int) -> dict:
    """Arguments the neutral core refuses, on every rank, before any collective and before
    anything changes: a ``src_data_rank`` outside the group (an index would fail inside the
    broadcast; -1 would silently pick the last rank), a style on a module that is neither a
    linear nor an embedding, a plan whose second module would get an empty piece (MindSpore's
    kernels refuse those; torch computes on them), a style's DTensor input on a 2-D mesh,
    ``loss_parallel`` on logits whose classes are not sharded (torch's own ``loss_parallel``
    raises too) and targets/weights of the wrong shape. Also ``loss_parallel`` on a 2-D mesh
    (class shard on mesh dim 1: the kernel over that dim's group; a size-1 batch shard on mesh
    dim 0: the per-op cross_entropy), against the one-process loss."""
    from hyperpar import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        distribute_tensor,
        init_device_mesh,
        loss_parallel,
        parallelize_module,
    )

    fw = get(framework)
    mesh = init_device_mesh((n,))
    w = _weights(0, w1=(H, D), b1=(H,), w2=(D, H), b2=(D,))
    errors: dict[str, str] = {}

    def refused(key: str, call: Callable[[], Any], model: Any) -> None:
        try:
            call()
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
        # nothing changed: both weights whole on every rank
        errors[key + " untouched"] = str(tuple(fw.weight(model.fc1).shape) == (H, D)
                                         and tuple(fw.weight(model.fc2).shape) == (D, H))

    for src in (n, -1):
        model = _mlp(fw, w)
        refused(f"src {src}", lambda m=model, s=src: parallelize_module(
            m, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, src_data_rank=s),
            model)
    model = _mlp(fw, w)
    refused("sequence src", lambda: parallelize_module(model, mesh, {"fc1": SequenceParallel()},
                                                       src_data_rank=n), model)
    model = _mlp(fw, w)
    refused("root", lambda: parallelize_module(model, mesh, {"": ColwiseParallel(),
                                                             "fc1": ColwiseParallel()}), model)
    # fc2's one output feature over 2 ranks: torch.chunk gives [1, 0]
    model = fw.container(lambda m, x: m.fc2(m.fc1(x)), fc1=fw.linear(w["w1"], w["b1"]),
                         fc2=fw.linear(w["w2"][:1], w["b2"][:1]))
    try:
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": ColwiseParallel()})
        errors["empty"] = "applied"
    except ValueError as exc:
        errors["empty"] = f"ValueError: {exc}"
    errors["empty fc1"] = str(tuple(fw.weight(model.fc1).shape))  # whole when refused

    head = parallelize_module(fw.linear(w["w1"], None), mesh,
                              ColwiseParallel(use_local_output=False))
    prep = parallelize_module(fw.linear(w["w1"], None), mesh, PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate()))
    mesh2 = init_device_mesh((1, n))
    wide = distribute_tensor(fw.tensor(np.ones((4, D), np.float32)), mesh2,
                             (Replicate(), Replicate()))
    for key, module in (("2-D input", head), ("2-D prepared input", prep)):
        try:
            module(wide)
        except ValueError as exc:
            errors[key] = f"ValueError: {exc}"
    logits = head(fw.tensor(np.ones((4, D), np.float32)))  # (4, H), Shard(-1)
    rng = np.random.default_rng(3)
    full = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([0, 3, H - 1, 2], np.int64)
    for key, placements in (("replicated logits", (Replicate(),)),
                            ("row-sharded logits", (Shard(0),))):
        try:
            with loss_parallel():
                fw.cross_entropy(distribute_tensor(fw.tensor(full), mesh, placements),
                                 fw.index(ids))
        except ValueError as exc:
            errors[key] = f"ValueError: {exc}"
    want = float(fw.numpy(fw.cross_entropy(fw.tensor(full), fw.index(ids))))
    for key, placements, target in (
            ("2-D class shard", (Replicate(), Shard(1)), fw.index(ids)),
            ("2-D batch and class shard", (Shard(0), Shard(1)),
             distribute_tensor(fw.index(ids), mesh2, (Shard(0), Replicate())))):
        with loss_parallel():
            got = fw.cross_entropy(distribute_tensor(fw.tensor(full), mesh2, placements),
                                   target)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        # a 7-term fp32 sum of exponentials, split over ranks: ~1e-6 relative of a loss ~2
        errors[key] = str(abs(float(fw.numpy(got)) - want) <= RTOL * max(1.0, abs(want)))
    for key, target, weight in (("target", np.zeros(5, np.int64), None),
                                ("weight", np.zeros(4, np.int64), np.ones(3, np.float32))):
        try:
            with loss_parallel():
                fw.cross_entropy(logits, fw.index(target),
                                 None if weight is None else fw.tensor(weight))
        except ValueError as exc:
            errors[key] = f"ValueError: {exc}"
    return errors


def test_bad_arguments_raise_the_same_error_on_every_framework(framework, pool) -> None:
    n = 2
    group = "is not a rank of the 2-rank tensor-parallel group; give 0..1, or None for each " \
            "rank to keep its own parameters"
    for errors in pool(n).run(_run_bad_arguments, framework, n):
        assert errors["src 2"] == f"ValueError: ColwiseParallel: src_data_rank=2 {group}"
        assert errors["src -1"] == f"ValueError: ColwiseParallel: src_data_rank=-1 {group}"
        assert errors["sequence src"] == f"ValueError: SequenceParallel: src_data_rank=2 {group}"
        root = errors["root"]
        assert root.startswith("UnsupportedModuleError: cannot apply ColwiseParallel to "
                               "'<root>' ("), root
        assert "): it shards linear and embedding modules (" in root, root
        assert root.endswith("and their subclasses); give a plan entry for the "
                             "linear/embedding modules inside it instead"), root
        assert errors["target"] == ("ValueError: loss_parallel: target shape (5,) must be the "
                                    f"logits' global shape (4, {H}) without its sharded class "
                                    "dim 1: (4,)")
        assert errors["weight"] == ("ValueError: loss_parallel: weight must hold one value per "
                                    f"class ({H}), got shape (3,)")
        assert all(v == "True" for k, v in errors.items() if k.endswith("untouched")), errors
        if framework == "mindspore":  # refused before fc1 changed: fc1 still whole
            assert errors["empty"] == (
                "ValueError: ColwiseParallel on 'fc2': weight: cannot split dim 0 of size 1 "
                f"(shape (1, {H})) over 2 tensor-parallel ranks: torch.chunk's pieces [1, 0] "
                "leave a rank an empty piece, which MindSpore's kernels cannot compute on; use "
                "a size that gives every rank at least one (near 1: 2, 3), or fewer ranks")
            assert errors["empty fc1"] == str((H, D)), errors
        else:  # torch computes on an empty piece
            assert errors["empty"] == "applied", errors
        fix = ("got placements (Replicate(), Replicate()); pass the input as a DTensor on the "
               "tensor-parallel slice of the mesh (mesh['tp'], the mesh the plan was applied "
               "with) or as this rank's local tensor")
        assert errors["2-D input"] == (
            f"ValueError: ColwiseParallel input: expected a DTensor on a 1-D mesh, {fix}")
        assert errors["2-D prepared input"] == (
            f"ValueError: PrepareModuleInput input 0: expected a DTensor on a 1-D mesh, {fix}")
        for key, placements in (("replicated logits", "(Replicate(),)"),
                                ("row-sharded logits", "(Shard(dim=0),)")):
            assert errors[key] == (
                "ValueError: loss_parallel: cross_entropy needs logits sharded on their class "
                "dim 1 by exactly one mesh dim, other mesh dims Shard or Replicate (Shard(-1) "
                "of (rows, classes) logits from ColwiseParallel(use_local_output=False)), got "
                f"placements {placements} for shape (4, {H}); shard the classes, or compute "
                "this loss outside loss_parallel()"), errors[key]
        assert errors["2-D class shard"] == errors["2-D batch and class shard"] == "True"


# --------------------------------------------------------------------------- written once
_STYLES = ("ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput")


def test_the_styles_are_one_set_of_classes_on_every_framework(framework: str) -> None:
    """``hyperpar.ColwiseParallel`` (and every other style) is the class of
    :mod:`hyperpar.parallel.styles` whichever backend is loaded; only the mechanics the
    platform supplies differ."""
    import importlib

    import hyperpar
    from hyperpar.parallel import styles
    from hyperpar.platform import get_platform

    get(framework)  # imports the framework
    backend = importlib.import_module("hyperpar_mindspore" if framework == "mindspore"
                                      else "hyperpar.parallel")
    for name in _STYLES:
        assert getattr(hyperpar, name) is getattr(styles, name), name
        assert getattr(backend, name) is getattr(styles, name), name
    mechanics = get_platform().tp_mechanics()
    assert type(mechanics).__module__ == ("hyperpar_mindspore.prepare" if framework == "mindspore"
                                          else "hyperpar.torch.parallel.prepare")
    # The one documented difference: with use_local_output not passed, MindSpore keeps local
    # tensors where torch gives DTensors; passed, it is the same everywhere.
    local = framework == "mindspore"
    assert hyperpar.SequenceParallel().use_local_output is local
    assert hyperpar.PrepareModuleInput().use_local_output is local
    assert hyperpar.SequenceParallel(use_local_output=False).use_local_output is False
    assert hyperpar.ColwiseParallel().input_layouts == (Replicate(),)
    assert hyperpar.RowwiseParallel().input_layouts == (Shard(-1),)
