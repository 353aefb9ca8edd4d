"""What the MindSpore parity tests do the same way to a parallel Cell and its one-process
reference: seed the weights, train with SGD, read the parameters back."""
from __future__ import annotations

from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import nn, ops


def set_weights(model: nn.Cell, seed: int = 0) -> None:
    """Every parameter from a normal(0, 0.5) stream, in sorted name order."""
    rng = np.random.default_rng(seed)
    for _name, param in sorted(model.parameters_and_names()):
        param.set_data(ms.Tensor((rng.standard_normal(param.shape) * 0.5).astype(np.float32)))


def mean_squared_error(out: ms.Tensor, target: ms.Tensor) -> ms.Tensor:
    return ((out - target) ** 2).mean()


def train_sgd(model: nn.Cell, x: ms.Tensor, y: ms.Tensor, steps: int, lr: float,
              criterion: Callable[[ms.Tensor, ms.Tensor], ms.Tensor] = mean_squared_error,
              ) -> tuple[list[float], np.ndarray]:
    """``steps`` SGD steps on ``criterion(model(x), y)``; the losses and the final output."""
    opt = nn.SGD(model.trainable_params(), learning_rate=lr)

    def loss_fn(inp, target):
        return criterion(model(inp), target)

    step = ms.value_and_grad(loss_fn, None, opt.parameters)
    losses = []
    for _ in range(steps):
        loss, grads = step(x, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, model(x).asnumpy()


def param_arrays(model: nn.Cell) -> dict[str, np.ndarray]:
    return {name: p.asnumpy() for name, p in model.parameters_and_names()}


# ------------------------------------------------------------------ a tiny causal transformer
# Plain MindSpore, each piece seeded on its own (set_weights on the piece, in its constructor):
# a pipeline that builds the pieces from LayerSpecs and a one-process model that composes them
# hold the same weights. Sizes are tiny so a step costs milliseconds on a CPU.
TFM_IN, TFM_HIDDEN, TFM_HEADS, TFM_SEQ, TFM_OUT = 5, 16, 2, 8, 3


class InputProjection(nn.Cell):
    """Dense ``TFM_IN -> TFM_HIDDEN`` on each position (the "embedding" of real inputs)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.proj = nn.Dense(TFM_IN, TFM_HIDDEN)
        set_weights(self, seed)

    def construct(self, x):
        return self.proj(x)


class TransformerBlock(nn.Cell):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``; causal multi-head
    self-attention from wq/wk/wv Denses, matmuls and a softmax; a GELU MLP of width 4h.
    Tensor-parallel as torchtitan's Llama: :data:`TFM_TP_PLAN`."""

    def __init__(self, seed: int, hidden: int = TFM_HIDDEN, heads: int = TFM_HEADS) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1 = nn.LayerNorm((hidden,))
        # q, k and v as separate Denses (torchtitan's wq/wk/wv), so ColwiseParallel on each
        # splits whole heads and the attention sees heads / tp local heads (see _attention).
        # No q/k/v bias: a key bias adds q . b_k to a whole row of scores, which softmax
        # cancels, so its gradient is 0 up to rounding -- and Adam turns that rounding into
        # +-lr steps
        self.wq = nn.Dense(hidden, hidden, has_bias=False)
        self.wk = nn.Dense(hidden, hidden, has_bias=False)
        self.wv = nn.Dense(hidden, hidden, has_bias=False)
        self.attn_out = nn.Dense(hidden, hidden)
        self.ln2 = nn.LayerNorm((hidden,))
        self.fc1 = nn.Dense(hidden, 4 * hidden)
        self.fc2 = nn.Dense(4 * hidden, hidden)
        set_weights(self, seed)
        # 0 on and below the diagonal, -1e9 above it: softmax gives future positions exactly 0
        self.mask = ms.Tensor(np.triu(np.full((TFM_SEQ, TFM_SEQ), -1e9, np.float32), 1))

    def _heads(self, t):
        """``(b, s, width) -> (b, local heads, s, head_dim)``: the head count comes from the
        width, so the same code runs whole (``heads``) and under tensor parallelism, where a
        column-parallel wq/wk/wv gives this rank ``heads / tp`` whole heads."""
        b, s, _ = t.shape
        return t.reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)

    def _attention(self, x):
        b, s, _ = x.shape
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / float(np.sqrt(self.head_dim))
        weights = ops.softmax(scores + self.mask[:s, :s], axis=-1)
        # (b, s, local heads * head_dim): the row-parallel attn_out's input shard
        out = ops.matmul(weights, v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        return self.attn_out(out)

    def construct(self, x):
        x = x + self._attention(self.ln1(x))
        return x + self.fc2(ops.gelu(self.fc1(self.ln2(x))))


class OutputHead(nn.Cell):
    """Final LayerNorm and Dense ``TFM_HIDDEN -> TFM_OUT``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm((TFM_HIDDEN,))
        self.out = nn.Dense(TFM_HIDDEN, TFM_OUT)
        set_weights(self, seed)

    def construct(self, x):
        return self.out(self.ln(x))


class TinyTransformer(nn.Cell):
    """InputProjection (seed s), ``n_blocks`` TransformerBlocks (seeds s+1..), OutputHead:
    ``(batch, TFM_SEQ, TFM_IN) -> (batch, TFM_SEQ, TFM_OUT)``."""

    def __init__(self, n_blocks: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.embed = InputProjection(seed)
        self.blocks = nn.CellList([TransformerBlock(seed + 1 + i) for i in range(n_blocks)])
        self.head = OutputHead(seed + 1 + n_blocks)

    def construct(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


#: the Megatron plan of a TransformerBlock (under a TinyTransformer: keys prefixed
#: ``blocks.*.``): heads split by the column-parallel q/k/v, attn_out row-parallel, the MLP
#: column- then row-parallel -- one all-reduce each for attention and MLP, forward and back.
TFM_TP_PLAN = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "attn_out": "rowwise",
               "fc1": "colwise", "fc2": "rowwise"}


def transformer_data(rows: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` sequences of inputs normal(0, 1) and regression targets normal(0, 1)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, TFM_SEQ, TFM_IN)).astype(np.float32)
    y = rng.standard_normal((rows, TFM_SEQ, TFM_OUT)).astype(np.float32)
    return x, y
