"""Sequence parallelism on MindSpore Cells (a Megatron-SP block) against the same Cells trained
in one process, the bad inputs it must refuse, and the ``from hyperpar import ...`` path.

The parallel model is built with the names torch users import (``from hyperpar import
SequenceParallel, ...``) inside real ranks started with ``HYPERPAR_BACKEND=mindspore``; the
reference is plain MindSpore (no hyperpar, no communication) built from the same numpy weights.

Plan, as torchtitan writes it for a transformer block::

    ""          PrepareModuleOutput(Shard(1) -> Replicate())   gather the sequence at the end
    block       PrepareModuleInput(Replicate() -> Shard(1))    keep this rank's positions
    block.norm  SequenceParallel()                             LayerNorm on those positions
    block.fc1   ColwiseParallel(input_layouts=Shard(1))        all-gather / reduce-scatter
    block.fc2   RowwiseParallel(output_layouts=Shard(1))       reduce-scatter / all-gather
    norm_f      SequenceParallel()                             after the residual add

Variants: both re-layouts on the root (``PrepareModuleInputOutput``), and token ids through a
vocabulary-parallel embedding reduce-scattered over the sequence
(``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``) in place of the
block's ``PrepareModuleInput``.

Tolerance: per position the arithmetic is the one-process arithmetic; what changes is the order
of float32 sums -- fc2's contraction split over ranks (<= 16 terms), the norms' parameter
gradients summed per rank then all-reduced (<= 16 positions x 2 batches). With values O(1), that
is below ~32 * 2**-24 * scale per step, ~6e-6 * scale over 3 SGD steps; we allow 2e-5 * scale.
A missing all-reduce of a norm's gradient, a wrong slice or a double-counted bias is O(scale).
"""

from __future__ import annotations

import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from tests.mindspore._cells import set_weights, train_sgd

STEPS = 3
LR = 0.1
D, H, BATCH, SEQ, VOCAB = 8, 16, 2, 8, 12


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((D,))
        self.fc1 = nn.Dense(D, H)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(H, D)

    def construct(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Model(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.norm_f = nn.LayerNorm((D,))

    def construct(self, x):
        return self.norm_f(self.block(x))


class EmbedModel(Model):
    """Token ids in: a vocabulary-parallel embedding whose output is reduce-scattered over the
    sequence (torchtitan's ``tok_embeddings`` entry) feeds the block directly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)

    def construct(self, ids):
        return self.norm_f(self.block(self.emb(ids)))


def _sp_plan(boundaries: str = "separate") -> dict:
    from hyperpar import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        Replicate,
        RowwiseParallel,
        SequenceParallel,
        Shard,
    )
    layers = {
        "block.norm": SequenceParallel(),
        "block.fc1": ColwiseParallel(input_layouts=Shard(1)),
        "block.fc2": RowwiseParallel(output_layouts=Shard(1)),
        "norm_f": SequenceParallel(),
    }
    if boundaries == "embedding":
        return {
            "": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            **layers,
        }
    if boundaries == "separate":
        return {
            "": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
            "block": PrepareModuleInput(input_layouts=Replicate(),
                                        desired_input_layouts=Shard(1)),
            **layers,
        }
    # both re-layouts on the root: slice the sequence on the way in, gather it on the way out
    return {"": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                         output_layouts=Shard(1),
                                         desired_output_layouts=Replicate()),
            **layers}


def _run_sp_parity(boundaries: str = "separate", seq: int = SEQ) -> dict:
    import hyperpar_mindspore

    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    assert parallelize_module is hyperpar_mindspore.parallelize_module  # the Cell version
    rng = np.random.default_rng(1)
    x = ms.Tensor(rng.standard_normal((BATCH, seq, D)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((BATCH, seq, D)).astype(np.float32))
    make = Model
    if boundaries == "embedding":
        make = EmbedModel
        x = ms.Tensor(rng.integers(0, VOCAB, (BATCH, seq)).astype(np.int32))
    reference, model = make(), make()
    set_weights(reference)
    set_weights(model, seed=0 if get_platform().rank() == 0 else 7)  # rank 0's values must win
    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, _sp_plan(boundaries))
    ref_losses, ref_out = train_sgd(reference, x, y, STEPS, LR)
    losses, out = train_sgd(model, x, y, STEPS, LR)
    return {"tp_rank": mesh.get_local_rank(), "tp_size": mesh.size(), "ref_losses": ref_losses,
            "losses": losses, "ref_out": ref_out, "out": out,
            "ref": {n: p.asnumpy() for n, p in reference.parameters_and_names()},
            "mine": {n: p.asnumpy() for n, p in model.parameters_and_names()}}


# Which dim of each parameter the plan splits (None: whole), written out independently of the
# library's spec so the test checks the layout rather than repeating it.
_SPLITS = {"block.norm.gamma": None, "block.norm.beta": None, "block.fc1.weight": 0,
           "block.fc1.bias": 0, "block.fc2.weight": 1, "block.fc2.bias": None,
           "norm_f.gamma": None, "norm_f.beta": None}


@pytest.mark.parametrize(("n", "boundaries", "seq"),
                         [(2, "separate", SEQ), (4, "separate", SEQ), (2, "both", SEQ),
                          (4, "embedding", SEQ), (2, "separate", 5), (4, "embedding", 7)])
def test_megatron_sp_block_trains_like_one_process(pool2, pool4, n, boundaries, seq):
    # seq 5 over 2 ranks, 7 over 4: uneven slices of the sequence, as torch.chunk cuts them
    results = (pool2 if n == 2 else pool4).run(_run_sp_parity, boundaries, seq)
    assert sorted(r["tp_rank"] for r in results) == list(range(n))
    splits = dict(_SPLITS, **({"emb.embedding_table": 0} if boundaries == "embedding" else {}))
    for res in results:
        scale = max(1.0, float(np.abs(res["ref_out"]).max()))
        tol = 2e-5 * scale
        # The steps must move the parameters, or equal parameters would prove nothing.
        assert res["ref_losses"][-1] < res["ref_losses"][0]
        np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=2e-5, atol=tol)
        np.testing.assert_allclose(res["out"], res["ref_out"], rtol=0, atol=tol)
        assert set(res["mine"]) == set(res["ref"]) == set(splits)
        for name, dim in splits.items():
            want = res["ref"][name]
            if dim is not None:
                want = np.split(want, res["tp_size"], axis=dim)[res["tp_rank"]]
            pscale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(res["mine"][name], want, rtol=0, atol=2e-5 * pscale,
                                       err_msg=f"parameter {name}")


# --------------------------------------------------------------------------- bad inputs
def _odd_sequence(seq: int) -> dict:
    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform

    platform = get_platform()
    mesh = init_device_mesh((platform.world_size(),), mesh_dim_names=("tp",))
    model = Model()
    set_weights(model)
    parallelize_module(model, mesh, _sp_plan())
    x = ms.Tensor(np.ones((BATCH, seq, D), np.float32))
    try:
        model(x)
        error = ""
    except ValueError as exc:
        error = str(exc)
    # Had any rank entered a collective the others skipped, this one would pair with it and
    # return a wrong sum (or time out): the ranks must still be in step.
    probe = ms.Tensor(np.array([platform.rank() + 1.0], np.float32))
    platform.all_reduce(probe, "sum")
    return {"error": error, "probe": float(probe.asnumpy()[0])}


@pytest.mark.parametrize(("n", "seq"), [(4, 6), (4, 3)])
def test_a_sequence_leaving_a_rank_empty_raises_on_every_rank_before_communicating(
        pool2, pool4, n, seq):
    # torch.chunk cuts 6 into [2, 2, 2, 0] and 3 into [1, 1, 1, 0]: MindSpore's kernels cannot
    # compute on the empty piece, so every rank refuses before the first collective.
    results = (pool2 if n == 2 else pool4).run(_odd_sequence, seq)
    for res in results:
        assert f"cannot split dim 1 of size {seq}" in res["error"]
        assert "leave a rank an empty piece" in res["error"]
        assert "PrepareModuleInput input 0" in res["error"]  # names where it happened
        assert res["probe"] == n * (n + 1) / 2


def test_styles_refuse_bad_layouts():
    from hyperpar_mindspore import PrepareModuleInput, PrepareModuleOutput

    from hyperpar.dtensor.placement import Replicate, Shard

    with pytest.raises(TypeError, match="must be Shard"):
        PrepareModuleOutput(output_layouts="row", desired_output_layouts=Replicate())
    with pytest.raises(ValueError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=Replicate())


# --------------------------------------------------------------------------- one import line
_SAME_IMPORT = """
import sys
from hyperpar import (init_device_mesh, parallelize_module, ColwiseParallel, RowwiseParallel,
                      SequenceParallel, PrepareModuleInput, PrepareModuleOutput)
import hyperpar, hyperpar_mindspore
for name in ("init_device_mesh", "parallelize_module", "ColwiseParallel", "RowwiseParallel",
             "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput"):
    assert getattr(hyperpar, name) is getattr(hyperpar_mindspore, name), name
namespace = {}
exec("from hyperpar import *", namespace)  # the torch stack's names are left out, not broken
assert namespace["parallelize_module"] is hyperpar_mindspore.parallelize_module
assert namespace["fully_shard"] is hyperpar_mindspore.fully_shard  # Cells have fully_shard now
assert "PipelineModule" not in namespace and "get_platform" in namespace
# a torch FSDP2 script's import line, rewritten (torch.distributed.fsdp -> hyperpar.fsdp)
from hyperpar.fsdp import fully_shard
assert fully_shard is hyperpar_mindspore.fully_shard
import hyperpar.fsdp
try:
    hyperpar.fsdp.FSDPModule
except AttributeError as e:
    assert "not available without torch" in str(e) and "fully_shard" in str(e), e
else:
    raise AssertionError("hyperpar.fsdp.FSDPModule resolved without torch")
assert "torch" not in sys.modules, "the MindSpore path imported torch"
print("ok")
"""


def test_the_torch_import_line_gives_the_cell_styles_without_torch():
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("this venv has torch; the check needs the MindSpore-only venv")
    env = {**os.environ, "HYPERPAR_BACKEND": "mindspore", "HYPERPAR_MS_DEVICE": "CPU",
           "GLOG_v": "3"}
    done = subprocess.run([sys.executable, "-c", _SAME_IMPORT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
