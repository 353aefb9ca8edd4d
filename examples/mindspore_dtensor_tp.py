"""DTensor ops and a tensor + sequence parallel Cell on MindSpore, with the torch import line.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 examples/mindspore_dtensor_tp.py
    HYPERPAR_BACKEND=mindspore hyperpar run -n 4 examples/mindspore_dtensor_tp.py

Part 1 lays tensors out over the ranks (uneven rows: 7 over 4 ranks is 2, 2, 2, 1), runs ops on
the DTensors (``x + b``, ``x @ w``, ``sum``, ``transpose``, ``reshape``, ``softmax``) and takes
gradients through them; every result and gradient is compared with the same computation on the
whole tensors in this process.

Part 2 parallelizes a small language model the way torchtitan plans a transformer block
(vocabulary-parallel embedding reduce-scattered over the sequence, ``SequenceParallel`` norms,
column/row-wise MLP, a column-wise head returning a vocabulary-sharded DTensor with
``use_local_output=False``) and trains it with ``loss_parallel`` (the vocabulary is never
gathered). Its losses and logits are compared with the same model trained in this process.

Tolerance: only the order of float32 sums differs (inner dims <= 16, values O(1)), below
~1e-6 * scale per op; we allow 2e-5 * scale. A wrong layout or a missing reduction is O(scale).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

# The import line torch users write: with HYPERPAR_BACKEND=mindspore these are the Cell versions.
from hyperpar import (
    ColwiseParallel,
    DTensor,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    distribute_tensor,
    init_device_mesh,
    loss_parallel,
    parallelize_module,
)

RTOL = 2e-5
D, H, VOCAB, BATCH, SEQ, STEPS, LR = 8, 16, 12, 2, 8, 3, 0.1


def check(what: str, got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference, raising when it is beyond float32 summation-order noise."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    if diff > RTOL * scale:
        raise AssertionError(f"{what}: max |diff| {diff:.2e} > {RTOL * scale:.2e}")
    return diff


def dtensor_ops(mesh) -> float:
    """Ops and gradients on DTensors against the whole tensors."""
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((7, 5)).astype(np.float32)
    w_np = rng.standard_normal((5, 3)).astype(np.float32)
    b_np = rng.standard_normal((5,)).astype(np.float32)
    x_full, w_full, b_full = ms.Tensor(x_np), ms.Tensor(w_np), ms.Tensor(b_np)

    x = distribute_tensor(x_full, mesh, [Shard(0)])     # rows, torch.chunk's pieces
    w = distribute_tensor(w_full, mesh, [Replicate()])
    b = distribute_tensor(b_full, mesh, [Replicate()])
    cols = distribute_tensor(x_full, mesh, [Shard(1)])
    assert tuple(x.shape) == (7, 5) and isinstance(x, DTensor)
    worst = check("Shard(1) round trip", cols.full_tensor().asnumpy(), x_np)

    y = mint.matmul(x + b, w)
    results = {
        "x + b": ((x + b).full_tensor(), x_np + b_np),
        "(x + b) @ w": (y.full_tensor(), (x_np + b_np) @ w_np),
        "sum(0)": (y.sum(0).full_tensor(), ((x_np + b_np) @ w_np).sum(0)),
        "transpose": (y.transpose(0, 1).full_tensor(), ((x_np + b_np) @ w_np).T),
        "reshape": (y.reshape(7 * 3).full_tensor(), ((x_np + b_np) @ w_np).reshape(21)),
        "softmax": (ops.softmax(y, -1).full_tensor(),
                    ops.softmax(mint.matmul(x_full + b_full, w_full), -1).asnumpy()),
        "redistribute": (cols.redistribute(mesh, [Shard(0)]).full_tensor(), x_np),
    }
    for name, (got, want) in results.items():
        worst = max(worst, check(name, got.asnumpy(), want))

    def loss(a, m):
        return (ops.softmax(mint.matmul(a, m), -1) * mint.matmul(a, m)).sum()

    # MindSpore's own value_and_grad: DTensor inputs get DTensor gradients (PyNative)
    value, (gx, gw) = ms.value_and_grad(loss, (0, 1))(x, w)
    ref_value, (rgx, rgw) = ms.value_and_grad(loss, (0, 1))(x_full, w_full)
    value = value.full_tensor() if isinstance(value, DTensor) else value
    worst = max(worst, check("loss", value.asnumpy(), ref_value.asnumpy()),
                check("d loss / d x", gx.full_tensor().asnumpy(), rgx.asnumpy()),
                check("d loss / d w", gw.full_tensor().asnumpy(), rgw.asnumpy()))
    assert gx.placements == x.placements, gx.placements
    return worst


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((D,))
        self.fc1 = nn.Dense(D, H)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(H, D)

    def construct(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TinyLM(nn.Cell):
    """A plain MindSpore model: no parallel code in it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.block = Block()
        self.norm_f = nn.LayerNorm((D,))
        self.head = nn.Dense(D, VOCAB, has_bias=False)

    def construct(self, ids):
        return self.head(self.norm_f(self.block(self.emb(ids))))


PLAN = {
    "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "block.norm": SequenceParallel(),
    "block.fc1": ColwiseParallel(input_layouts=Shard(1)),
    "block.fc2": RowwiseParallel(output_layouts=Shard(1)),
    "norm_f": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
}


def build() -> TinyLM:
    model = TinyLM()
    rng = np.random.default_rng(1)
    for _, param in sorted(model.parameters_and_names()):
        param.set_data(ms.Tensor((rng.standard_normal(param.shape) * 0.5).astype(np.float32)))
    return model


def train(model: TinyLM, ids: ms.Tensor, labels: ms.Tensor, parallel: bool
          ) -> tuple[list[float], np.ndarray]:
    opt = nn.SGD(model.trainable_params(), learning_rate=LR)

    def loss_fn(tokens, target):
        logits = model(tokens)
        return ops.cross_entropy(logits.reshape(BATCH * SEQ, VOCAB), target.reshape(-1))

    step = ms.value_and_grad(loss_fn, None, opt.parameters)
    losses = []
    for _ in range(STEPS):
        if parallel:
            with loss_parallel():  # may wrap the whole gradient call, as on torch
                loss, grads = step(ids, labels)
        else:
            loss, grads = step(ids, labels)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    logits = model(ids)
    return losses, (logits.full_tensor() if isinstance(logits, DTensor) else logits).asnumpy()


def main() -> None:
    world = _world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("tp",))
    worst_ops = dtensor_ops(mesh)

    rng = np.random.default_rng(2)
    ids = ms.Tensor(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
    model = parallelize_module(build(), mesh, PLAN)
    head_out = model(ids)
    assert isinstance(head_out, DTensor), type(head_out)
    assert head_out.placements in ((Shard(-1),), (Shard(2),)), head_out.placements
    losses, logits = train(model, ids, labels, parallel=True)
    ref_losses, ref_logits = train(build(), ids, labels, parallel=False)
    worst_tp = max(check("losses", np.array(losses), np.array(ref_losses)),
                   check("logits after training", logits, ref_logits))
    if mesh.get_local_rank() == 0:
        print(f"ranks: {world}; DTensor ops and gradients vs whole tensors: max |diff| "
              f"= {worst_ops:.2e}")
        print("TP + SP + loss_parallel losses:", " ".join(f"{v:.6f}" for v in losses))
        print(f"parity with one process: max |diff| over losses and logits = {worst_tp:.2e} "
              f"-> OK")


def _world_size() -> int:
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    return platform.world_size()


if __name__ == "__main__":
    main()
