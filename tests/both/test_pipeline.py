"""Pipelines, one body for torch and MindSpore: ``PipelineModule`` of ``LayerSpec`` layers with a
``TiedLayerSpec`` embedding on both ends, trained on 2 ranks (stages) by ``PipelineEngine``'s
``train_batch`` under GPipe and 1F1B, against the same model trained in one process with the
plain framework on the whole batch: the loss on every rank and every parameter, 3 SGD steps.

What differs between the frameworks is only how a layer class is written (``nn.Module`` /
``nn.Cell``) and the optimizer (``torch.optim.SGD(model.parameters())`` /
``nn.SGD(model.trainable_params())``). MindSpore-only cases (4 stages, failures) are in
tests/mindspore/test_pipeline.py; torch-only ones in tests/pipeline/.

Tolerance: weights normal(0, 0.4), inputs normal(0, 1), width 6: values O(1). The pipeline and
one process differ in the order of float32 sums (microbatch means weighted by 1/m; the tied
gradient summed from two stages' parts): <= 24 terms, ~1.5e-6 relative, over 3 steps with a
gain below 2 each. We allow 2e-5 * max(1, max|want|); a missing microbatch or a tied gradient
not summed is O(1e-2) off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.both._frameworks import get

pytestmark = pytest.mark.timeout(900)

D, MICRO, M, STEPS, LR, N_LAYERS = 6, 2, 4, 3, 0.1, 3
RTOL = 2e-5
_BUILT: list[Any] = []   # every layer built in this process, to read its parameters back


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = {"emb": (rng.standard_normal((D, D)) * 0.4).astype(np.float32)}
    for i in range(N_LAYERS):
        w[f"w{i}"] = (rng.standard_normal((D, D)) * 0.4).astype(np.float32)
        w[f"b{i}"] = (rng.standard_normal(D) * 0.4).astype(np.float32)
    return w


def _data() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((MICRO, D)).astype(np.float32),
             rng.standard_normal((MICRO, D)).astype(np.float32)) for _ in range(M * STEPS)]


def _classes(name: str) -> tuple[type, type]:
    """``Affine(name, w, b, act)`` (``x @ w.T + b``, tanh when ``act``) and ``Embed(w)``
    (``x @ w.T``) as the framework's module class."""
    if name == "torch":
        import torch
        from torch import nn

        class TorchAffine(nn.Module):
            def __init__(self, key: str, w: np.ndarray, b: np.ndarray, act: bool) -> None:
                super().__init__()
                self.key, self.act = key, act
                self.weight = nn.Parameter(torch.from_numpy(w.copy()))
                self.bias = nn.Parameter(torch.from_numpy(b.copy()))
                _BUILT.append(self)

            def forward(self, x: Any) -> Any:
                y = x @ self.weight.T + self.bias
                return torch.tanh(y) if self.act else y

        class TorchEmbed(nn.Module):
            def __init__(self, w: np.ndarray) -> None:
                super().__init__()
                self.key = "emb"
                self.weight = nn.Parameter(torch.from_numpy(w.copy()))
                _BUILT.append(self)

            def forward(self, x: Any) -> Any:
                return x @ self.weight.T

        return TorchAffine, TorchEmbed
    import mindspore as ms
    from mindspore import nn, ops

    class MSAffine(nn.Cell):
        def __init__(self, key: str, w: np.ndarray, b: np.ndarray, act: bool) -> None:
            super().__init__()
            self.key, self.act = key, act
            self.weight = ms.Parameter(ms.Tensor(w), name="weight")
            self.bias = ms.Parameter(ms.Tensor(b), name="bias")
            _BUILT.append(self)

        def construct(self, x: Any) -> Any:
            y = ops.matmul(x, self.weight.T) + self.bias
            return ops.tanh(y) if self.act else y

    class MSEmbed(nn.Cell):
        def __init__(self, w: np.ndarray) -> None:
            super().__init__()
            self.key = "emb"
            self.weight = ms.Parameter(ms.Tensor(w), name="weight")
            _BUILT.append(self)

        def construct(self, x: Any) -> Any:
            return ops.matmul(x, self.weight.T)

    return MSAffine, MSEmbed


def _head(embed: Any, h: Any) -> Any:   # the tied output layer: h @ E
    return h @ embed.weight


def _mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def _built_params(fw: Any) -> dict[str, np.ndarray]:
    out = {}
    for layer in _BUILT:
        out[f"{layer.key}.weight"] = fw.numpy(layer.weight.detach() if fw.name == "torch"
                                              else layer.weight)
        if hasattr(layer, "bias"):
            out[f"{layer.key}.bias"] = fw.numpy(layer.bias.detach() if fw.name == "torch"
                                                else layer.bias)
    return out


def _pipeline(name: str, schedule: str) -> dict:
    from hyperpar.pipeline import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

    fw = get(name)
    Affine, Embed = _classes(name)
    w = _weights()
    _BUILT.clear()
    layers = [TiedLayerSpec("emb", Embed, w["emb"]),
              *[LayerSpec(Affine, f"l{i}", w[f"w{i}"], w[f"b{i}"], i < N_LAYERS - 1)
                for i in range(N_LAYERS)],
              TiedLayerSpec("emb", Embed, w["emb"], forward_fn=_head)]
    model = PipelineModule(layers, 2, loss_fn=_mse, partition_method="uniform")
    if name == "torch":
        import torch

        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        optimizer = fw.nn.SGD(model.trainable_params(), learning_rate=LR)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M}
    engine = PipelineEngine(model, optimizer, config, schedule=schedule)
    it = iter([(fw.tensor(x), fw.tensor(y)) for x, y in _data()])
    losses = [float(fw.numpy(engine.train_batch(it))) for _ in range(STEPS)]
    return {"losses": losses, "params": _built_params(fw)}


def _reference(name: str) -> dict:
    fw = get(name)
    Affine, Embed = _classes(name)
    w = _weights()
    _BUILT.clear()
    children = {"emb": Embed(w["emb"])}
    children.update({f"l{i}": Affine(f"l{i}", w[f"w{i}"], w[f"b{i}"], i < N_LAYERS - 1)
                     for i in range(N_LAYERS)})

    def forward(m: Any, x: Any) -> Any:
        h = m.emb(x)
        for i in range(N_LAYERS):
            h = getattr(m, f"l{i}")(h)
        return _head(m.emb, h)

    model = fw.container(forward, **children)
    step = fw.sgd(model, LR)
    data = _data()
    losses = []
    for s in range(STEPS):
        batch = data[s * M:(s + 1) * M]
        x = fw.tensor(np.concatenate([b[0] for b in batch]))
        y = fw.tensor(np.concatenate([b[1] for b in batch]))
        losses.append(step(lambda x=x, y=y: _mse(model(x), y)))
    return {"losses": losses, "params": _built_params(fw)}


def _close(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = RTOL * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_with_a_tied_embedding_matches_one_process(
        framework: str, pool: Any, schedule: str) -> None:
    workers = pool(2)
    results = workers.run(_pipeline, framework, schedule)
    ref = workers.run(_reference, framework)[0]
    seen: set[str] = set()
    for rank, res in enumerate(results):
        for s, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            _close(got, want, f"{framework} rank {rank}: loss of step {s}")
        for key, value in res["params"].items():
            _close(value, ref["params"][key], f"{framework} rank {rank}: {key}")
            seen.add(key)
    assert seen == set(ref["params"]), (sorted(seen), sorted(ref["params"]))
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3   # the model moved
