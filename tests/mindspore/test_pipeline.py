"""Pipelines of MindSpore Cells on real ranks: ``hyperpar.pipeline``'s ``PipelineModule`` /
``initialize`` / ``train_batch`` (GPipe, 1F1B, interleaved 1F1B, zero-bubble (ZB-H1) and
interleaved zero-bubble, whose split backward must show up as I and W actions; ``LayerSpec`` and a
``TiedLayerSpec`` whose gradient is summed over the two stages that hold it; on 4 ranks pp x dp,
pp x fully_shard and pp x tp) against the same model built in plain MindSpore in one process and
trained on the whole batch, over several SGD steps: the loss on every rank and every parameter
of every stage.

Tolerance: weights normal(0, 0.4), inputs normal(0, 1), widths 6: values O(1). The pipeline and
one process differ in the order of float32 sums (the batch mean split into microbatch means,
weighted by 1/m, the tied gradient summed from two partial gradients): each sum of <= 24 terms
moves by <= 24 * 2^-24 ~ 1.5e-6 relative, carried over 3 steps with a gain below 2 each. We allow
2e-5 * max(1, max|want|); a missing microbatch, a doubled tied gradient or a gradient not
accumulated is O(1e-2) or more off.

A stage that raises is named on every rank: the failing rank keeps its own error, its peer
raises ``PipelineStageError("stage S (rank R) failed: ...")`` (a notice sent in the channel the
peer is reading; no timeout).
"""

from __future__ import annotations

import numpy as np
import pytest

from hyperpar.testing.harness import DistributedError, WorkerPool

pytestmark = pytest.mark.timeout(900)

D, MICRO, STEPS, LR = 6, 2, 3, 0.1
RTOL = 2e-5


def _init(n_layers: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = {}
    for i in range(n_layers):
        w[f"w{i}"] = (rng.standard_normal((D, D)) * 0.4).astype(np.float32)
        w[f"b{i}"] = (rng.standard_normal(D) * 0.4).astype(np.float32)
    w["emb"] = (rng.standard_normal((D, D)) * 0.4).astype(np.float32)
    return w


def _data(m: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((MICRO, D)).astype(np.float32),
             rng.standard_normal((MICRO, D)).astype(np.float32)) for _ in range(m * steps)]


def _cells():
    """Cell classes (defined on the ranks, where MindSpore is imported)."""
    import mindspore as ms
    from mindspore import nn, ops

    class Affine(nn.Cell):
        def __init__(self, w: np.ndarray, b: np.ndarray, act: bool) -> None:
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(w), name="weight")
            self.bias = ms.Parameter(ms.Tensor(b), name="bias")
            self.act = act

        def construct(self, x):
            y = ops.matmul(x, self.weight.T) + self.bias
            return ops.tanh(y) if self.act else y

    class Embed(nn.Cell):   # a "tied embedding": x @ E.T in, h @ E out
        def __init__(self, e: np.ndarray) -> None:
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(e), name="weight")

        def construct(self, x):
            return ops.matmul(x, self.weight.T)

    return ms, nn, ops, Affine, Embed


def _head(cell, h):
    from mindspore import ops

    return ops.matmul(h, cell.weight)


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _layer_list(n_layers: int, tied: bool) -> list:
    from hyperpar.pipeline import LayerSpec, TiedLayerSpec

    _ms, _nn, _ops, Affine, Embed = _cells()
    w = _init(n_layers)
    layers: list = [TiedLayerSpec("emb", Embed, w["emb"])] if tied else []
    layers += [LayerSpec(Affine, w[f"w{i}"], w[f"b{i}"], i < n_layers - 1)
               for i in range(n_layers)]
    if tied:
        layers.append(TiedLayerSpec("emb", Embed, w["emb"], forward_fn=_head))
    return layers


def _stage_params(model) -> dict[str, np.ndarray]:
    """``"layer index.weight"`` -> value for every Cell of this rank's stages (fully-sharded
    Cells gathered whole: a collective over their replicas)."""
    params = {}
    for stage, positions in model._stage_positions.items():
        for j, pos in enumerate(positions):
            if pos.cell is None:
                continue
            values = (pos.cell.full_parameters() if hasattr(pos.cell, "full_parameters") else
                      dict(pos.cell.parameters_and_names()))
            for name, p in values.items():
                params[f"{model.parts[stage] + j}.{name.split('.')[-1]}"] = p.asnumpy()
    return params


def _pipeline(schedule: str, n_layers: int, tied: bool, m: int) -> dict:
    """Train STEPS batches through the pipeline; return the losses and this stage's params."""
    from hyperpar.pipeline import PipelineEngine, PipelineModule, initialize

    _ms, nn, _ops, _a, _e = _cells()
    virtual = 2 if schedule.startswith("interleaved") else 1
    model = PipelineModule(_layer_list(n_layers, tied), loss_fn=_mse, partition_method="uniform",
                           virtual_stages=virtual)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=LR)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m}
    if schedule in ("1f1b", "interleaved1f1b"):   # initialize's defaults, as on torch
        engine, *_ = initialize(model=model, optimizer=optimizer, config=config)
    else:
        engine = PipelineEngine(model, optimizer, config, schedule=schedule)
    it = iter([(_ms.Tensor(x), _ms.Tensor(y)) for x, y in _data(m, STEPS + 1)])
    losses = [float(engine.train_batch(it).asnumpy()) for _ in range(STEPS)]
    kinds = "".join(sorted({a.kind for a in engine.schedule.last_actions}))   # what ran
    # then one forward-only batch: its loss on every rank, the parameters left as they were
    eval_loss = float(engine.eval_batch(it).asnumpy())
    return {"losses": losses, "eval_loss": eval_loss, "params": _stage_params(model),
            "stage": model.stage_id, "parts": model.parts, "local": model.local_stages,
            "schedule": type(engine.schedule).__name__, "kinds": kinds}


def _reference(n_layers: int, tied: bool, m: int) -> dict:
    """The same model in plain MindSpore, one process, the whole batch (m microbatches)."""
    ms, nn, _ops, Affine, Embed = _cells()
    w = _init(n_layers)
    emb = Embed(w["emb"])
    body = [Affine(w[f"w{i}"], w[f"b{i}"], i < n_layers - 1) for i in range(n_layers)]
    cells = nn.CellList(([emb] if tied else []) + body)

    def forward(x):
        h = emb(x) if tied else x
        for cell in body:
            h = cell(h)
        return _head(emb, h) if tied else h

    opt = nn.SGD(cells.trainable_params(), learning_rate=LR)
    grad_fn = ms.value_and_grad(lambda x, y: _mse(forward(x), y), None, opt.parameters)
    data = _data(m, STEPS + 1)
    losses = []
    for s in range(STEPS):
        batch = data[s * m:(s + 1) * m]
        x = ms.Tensor(np.concatenate([b[0] for b in batch]))
        y = ms.Tensor(np.concatenate([b[1] for b in batch]))
        loss, grads = grad_fn(x, y)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    batch = data[STEPS * m:]
    x = ms.Tensor(np.concatenate([b[0] for b in batch]))
    y = ms.Tensor(np.concatenate([b[1] for b in batch]))
    eval_loss = float(_mse(forward(x), y).asnumpy())
    params = {}
    offset = 1 if tied else 0
    for i, cell in enumerate(body):
        params[f"{i + offset}.weight"] = cell.weight.asnumpy()
        params[f"{i + offset}.bias"] = cell.bias.asnumpy()
    if tied:
        params["0.weight"] = params[f"{n_layers + 1}.weight"] = emb.weight.asnumpy()
    return {"losses": losses, "eval_loss": eval_loss, "params": params}


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = RTOL * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def _check(results: list[dict], ref: dict) -> None:
    seen = set()
    for rank, res in enumerate(results):
        for s, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            _close(np.float32(got), np.float32(want), f"rank {rank} loss of step {s}")
        _close(np.float32(res["eval_loss"]), np.float32(ref["eval_loss"]),
               f"rank {rank} eval_batch loss")
        for name, value in res["params"].items():
            _close(value, ref["params"][name], f"rank {rank} parameter {name}")
            seen.add(name)
    assert seen == set(ref["params"]), (sorted(seen), sorted(ref["params"]))
    # the model moved: a pipeline that never stepped would fail here, not pass silently
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3


# the compute actions each schedule must have run: the zero-bubble ones split every backward
# into I (input gradient) and W (parameter gradient), so a silent 1F1B fallback fails here
_KINDS = {"gpipe": "BF", "1f1b": "BF", "zerobubble": "FIW", "interleaved1f1b": "BF",
          "interleavedzerobubble": "FIW"}


@pytest.mark.parametrize(("schedule", "tied"), [
    ("gpipe", False), ("gpipe", True), ("1f1b", False), ("1f1b", True), ("zerobubble", True)])
def test_two_stages_match_one_process(pool2, schedule: str, tied: bool) -> None:
    m, n_layers = 4, 3
    results = pool2.run(_pipeline, schedule, n_layers, tied, m)
    assert [r["stage"] for r in results] == [0, 1]
    assert [r["kinds"] for r in results] == [_KINDS[schedule]] * 2, results
    ref = pool2.run(_reference, n_layers, tied, m)[0]
    _check(results, ref)


def test_interleaved_two_stages_per_rank_match_one_process(pool2) -> None:
    # 4 stages on 2 ranks (rank 0: stages 0 and 2), the tied embedding on stages 0 and 3;
    # interleaved 1F1B and interleaved zero-bubble on the same spawn
    m, n_layers = 4, 3
    ref = pool2.run(_reference, n_layers, True, m)[0]
    for schedule, cls in (("interleaved1f1b", "ScheduleInterleaved1F1B"),
                          ("interleavedzerobubble", "ScheduleInterleavedZeroBubble")):
        results = pool2.run(_pipeline, schedule, n_layers, True, m)
        assert [r["local"] for r in results] == [[0, 2], [1, 3]]
        assert {r["schedule"] for r in results} == {cls}
        assert [r["kinds"] for r in results] == [_KINDS[schedule]] * 2, results
        _check(results, ref)


def test_four_stages_1f1b_tied_match_one_process(pool4) -> None:
    m, n_layers = 5, 4   # 6 positions over 4 stages; 5 microbatches: 1F1B's steady state
    results = pool4.run(_pipeline, "1f1b", n_layers, True, m)
    ref = pool4.run(_reference, n_layers, True, m)[0]
    _check(results, ref)


# ------------------------------------------------------------ pp x dp and pp x fully_shard
# 4 ranks on a ("pp", "dp") = (2, 2) mesh: two pipelines of 2 stages, each replica fed its own m
# microbatches; one process trains on all dp * m of them per step (the reference above with
# dp * m microbatches: replica d's are the d-th m of each step's). The replicas' mean of
# microbatch means is the whole batch's mean (equal sizes), so losses and parameters must
# match within RTOL (the dp average adds one 2-term sum to the tolerance's <= 24-term sums).
PP, DP = 2, 2


def _attempter(out: dict[str, str], errors: tuple[type[Exception], ...]):
    """``attempt(key, fn)``: run ``fn``; record "accepted" or the message of one of ``errors``."""

    def attempt(key: str, fn) -> None:
        try:
            fn()
            out[key] = "accepted"
        except errors as exc:
            out[key] = str(exc)

    return attempt


def _refused_layouts() -> dict[str, str]:
    """Bad layouts: each refused on every rank before any collective (no rank waits)."""
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipeline import PipelineEngine, PipelineModule

    _ms, nn, _ops, _a, _e = _cells()
    out: dict[str, str] = {}
    attempt = _attempter(out, (TypeError, ValueError, KeyError))

    layers = _layer_list(2, tied=False)
    attempt("divisible", lambda: PipelineModule(layers, 3, loss_fn=_mse))
    no_pp = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    attempt("no_pp", lambda: PipelineModule(layers, mesh=no_pp, loss_fn=_mse))
    mesh = init_device_mesh((PP, DP), mesh_dim_names=("pp", "dp"))
    attempt("no_dim", lambda: PipelineModule(layers, mesh=mesh, mesh_dim="stages",
                                             loss_fn=_mse))
    model = PipelineModule(layers, mesh=mesh, loss_fn=_mse, partition_method="uniform")
    for cell in model.stage_layers:   # sharded over the world, not over the stage's replicas
        fully_shard(cell)
    attempt("shard_group", lambda: PipelineEngine(
        model, nn.SGD(model.trainable_params(), learning_rate=LR), {}))
    return out


def _pp_dp(n_layers: int, m: int) -> dict:
    """Both variants on one spawn: "dp" (a PipeDataParallelTopology, a tied embedding) and
    "fsdp" (a mesh, every stage Cell fully_shard-ed over mesh["dp"])."""
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipeline import (
        PipeDataParallelTopology,
        PipelineEngine,
        PipelineModule,
        initialize,
    )

    ms, nn, _ops, _a, _e = _cells()
    out: dict = {"refused": _refused_layouts()}
    mesh = init_device_mesh((PP, DP), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh.get_local_rank("dp")
    data = _data(DP * m, STEPS + 1)
    mine = [data[s * DP * m + dp_rank * m:s * DP * m + (dp_rank + 1) * m]
            for s in range(STEPS + 1)]
    for variant in ("dp", "fsdp", "fsdp_zb"):
        tied = variant == "dp"
        layers = _layer_list(n_layers, tied)
        if variant == "dp":
            model = PipelineModule(layers, topology=PipeDataParallelTopology(num_pp=PP,
                                                                            num_dp=DP),
                                   loss_fn=_mse, partition_method="uniform")
        else:
            model = PipelineModule(layers, mesh=mesh, loss_fn=_mse, partition_method="uniform")
            whole = sum(p.asnumpy().nbytes for p in model.trainable_params())
            for cell in model.stage_layers:
                fully_shard(cell, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            held = sum(p.asnumpy().nbytes for p in model.trainable_params())
            out["bytes"] = (held, whole)
        optimizer = nn.SGD(model.trainable_params(), learning_rate=LR)
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m}
        if variant == "fsdp_zb":   # I discards the units' gradients, W reduces them
            engine = PipelineEngine(model, optimizer, config, schedule="zerobubble")
        else:
            engine, *_ = initialize(model=model, optimizer=optimizer, config=config)
        it = iter([(ms.Tensor(x), ms.Tensor(y)) for batch in mine for x, y in batch])
        losses, reductions = _count_reduce_scatters(
            lambda: float(engine.train_batch(it).asnumpy()))  # noqa: B023 (called right here)
        out[variant] = {"losses": losses, "eval_loss": float(engine.eval_batch(it).asnumpy()),
                        "params": _stage_params(model), "stage": model.stage_id,
                        "dp_size": model.dp_size, "reductions": reductions,
                        "units": sum(1 for _n, c in model.cells_and_names()
                                     if (u := c.__dict__.get("_hp_fsdp_unit")) and u.shards)}
    out["tp"] = _pp_tp(m)
    return out


def _count_reduce_scatters(step) -> tuple[list, list[int]]:
    """``STEPS`` results of ``step()`` and the platform's reduce-scatters in each (the
    platform's own method, wrapped to count)."""
    from hyperpar.platform import get_platform

    platform, calls = get_platform(), []
    real = platform.reduce_scatter_tensor

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    platform.reduce_scatter_tensor = counted
    results, per_step = [], []
    try:
        for _ in range(STEPS):
            before = len(calls)
            results.append(step())
            per_step.append(len(calls) - before)
    finally:
        platform.reduce_scatter_tensor = real
    return results, per_step


# pp x tp: a ("pp", "tp") = (2, 2) mesh, one MLP block per stage (Dense D -> 2D, tanh,
# Dense 2D -> D), each block's fc1 colwise and fc2 rowwise over mesh["tp"]; every rank of a
# pipeline gets the same m microbatches. Same tolerance: tensor parallelism only splits the
# 2D-term sums of fc2 into two partial sums added by an all-reduce.
_TP_SPLITS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}


def _tp_block():
    """A Cell class ``Block(seed)`` (defined on the ranks, where MindSpore is imported)."""
    from mindspore import nn, ops

    from tests.mindspore._cells import set_weights

    class Block(nn.Cell):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.fc1 = nn.Dense(D, 2 * D)
            self.fc2 = nn.Dense(2 * D, D)
            set_weights(self, seed)

        def construct(self, x):
            return self.fc2(ops.tanh(self.fc1(x)))

    return Block


def _pp_tp(m: int) -> dict:
    from hyperpar import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from hyperpar.pipeline import LayerSpec, PipelineModule, initialize

    ms, nn, _ops, _a, _e = _cells()
    Block = _tp_block()
    mesh = init_device_mesh((PP, 2), mesh_dim_names=("pp", "tp"))
    model = PipelineModule([LayerSpec(Block, 0), LayerSpec(Block, 1)], mesh=mesh, loss_fn=_mse,
                           partition_method="uniform")
    for cell in model.stage_layers:
        parallelize_module(cell, mesh["tp"], {"fc1": ColwiseParallel(),
                                              "fc2": RowwiseParallel()})
    engine, *_ = initialize(model=model,
                            optimizer=nn.SGD(model.trainable_params(), learning_rate=LR),
                            config={"train_micro_batch_size_per_gpu": MICRO,
                                    "gradient_accumulation_steps": m})
    it = iter([(ms.Tensor(x), ms.Tensor(y)) for x, y in _data(m, STEPS)])
    losses = [float(engine.train_batch(it).asnumpy()) for _ in range(STEPS)]
    params = {f"{model.stage_id}.{name}": p.asnumpy()
              for name, p in model.stage_layers[0].parameters_and_names()}
    return {"losses": losses, "params": params, "stage": model.stage_id,
            "tp_rank": mesh.get_local_rank("tp"), "dp_size": model.dp_size}


def _tp_reference(m: int) -> dict:
    import mindspore as ms
    from mindspore import nn

    Block = _tp_block()
    blocks = [Block(0), Block(1)]
    cells = nn.CellList(blocks)
    opt = nn.SGD(cells.trainable_params(), learning_rate=LR)
    grad_fn = ms.value_and_grad(lambda x, y: _mse(blocks[1](blocks[0](x)), y), None,
                                opt.parameters)
    data, losses = _data(m, STEPS), []
    for s in range(STEPS):
        batch = data[s * m:(s + 1) * m]
        loss, grads = grad_fn(ms.Tensor(np.concatenate([b[0] for b in batch])),
                              ms.Tensor(np.concatenate([b[1] for b in batch])))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    params = {f"{i}.{name}": p.asnumpy() for i, block in enumerate(blocks)
              for name, p in block.parameters_and_names()}
    return {"losses": losses, "params": params}


def _check_tp(results: list[dict], ref: dict) -> None:
    seen = set()
    for rank, res in enumerate(results):
        for s, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            _close(np.float32(got), np.float32(want), f"pp x tp rank {rank} loss of step {s}")
        for key, value in res["params"].items():
            want = ref["params"][key]
            dim = _TP_SPLITS[key.split(".", 1)[1]]
            if dim is not None:
                want = np.split(want, 2, axis=dim)[res["tp_rank"]]
            _close(value, want, f"pp x tp rank {rank} parameter {key}")
            seen.add(key)
    assert seen == set(ref["params"]), (sorted(seen), sorted(ref["params"]))
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3   # the model moved


def test_pp_x_dp_fully_shard_and_tp_match_one_process(pool4) -> None:
    m, n_layers = 2, 3   # per replica; D = 6 rows split 3 + 3 over dp: no padding
    results = pool4.run(_pp_dp, n_layers, m)
    for rank, res in enumerate(results):
        refused = res["refused"]
        assert "num_stages=3 does not divide the group size 4" in refused["divisible"], \
            (rank, refused)
        assert "no dimension named 'pp'" in refused["no_pp"], (rank, refused)
        assert "no dimension named 'stages'" in refused["no_dim"], (rank, refused)
        assert "mesh=mesh['dp']" in refused["shard_group"], (rank, refused)
        held, whole = res["bytes"]
        assert held * DP == whole, (rank, held, whole)   # 1/dp of the stage's bytes
    for variant, tied in (("dp", True), ("fsdp", False), ("fsdp_zb", False)):
        got = [res[variant] for res in results]
        # ("pp", "dp") row-major: ranks 0, 1 hold stage 0; ranks 2, 3 stage 1
        assert [r["stage"] for r in got] == [0, 0, 1, 1], variant
        assert {r["dp_size"] for r in got} == {DP}, variant
        _check(got, _reference(n_layers, tied, DP * m))
    for rank, res in enumerate(results):
        # fully_shard inside the pipeline reduces once per step (the stage's last backward),
        # not once per microbatch (m = 2); plain dp uses all-reduces
        for fsdp in (res["fsdp"], res["fsdp_zb"]):
            assert fsdp["units"] > 0 and fsdp["reductions"] == [fsdp["units"]] * STEPS, \
                (rank, fsdp)
        assert res["dp"]["reductions"] == [0] * STEPS, (rank, res["dp"]["reductions"])
    tp = [res["tp"] for res in results]
    assert [r["stage"] for r in tp] == [0, 0, 1, 1] and [r["tp_rank"] for r in tp] == [0, 1] * 2
    assert {r["dp_size"] for r in tp} == {1}
    _check_tp(tp, _tp_reference(m))


# ---------------------------------------------------------------------------------- faults
def _boom(x):
    raise ValueError("boom in the second stage")


def _failing(case: str) -> str:
    from hyperpar.pipeline import LayerSpec, PipelineModule, initialize

    ms, nn, _ops, Affine, _e = _cells()
    w = _init(2)
    layers: list = [LayerSpec(Affine, w["w0"], w["b0"], True),
                    LayerSpec(Affine, w["w1"], w["b1"], False)]
    if case == "raises":
        layers.append(_boom)
    model = PipelineModule(layers, loss_fn=_mse, partition_method=[0, 1, len(layers)])
    engine, *_ = initialize(model=model,
                            optimizer=nn.SGD(model.trainable_params(), learning_rate=LR),
                            config={"train_micro_batch_size_per_gpu": MICRO,
                                    "gradient_accumulation_steps": 2})
    from hyperpar.platform import get_platform

    data = [(ms.Tensor(x), ms.Tensor(y)) for x, y in _data(2, 1)]
    if case == "data_runs_out" and get_platform().rank() == 0:
        data = data[:1]
    try:
        engine.train_batch(iter(data))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_failing_stage_is_named_on_every_rank() -> None:
    # Its own pool: a failed step may leave undelivered messages between the ranks. The data
    # case runs first: stage 0 fails before sending anything, so it leaves none behind.
    cases = [("data_runs_out", "stage 0 (rank 0)", "ran out after 1 of the 2 microbatches"),
             ("raises", "stage 1 (rank 1)", "ValueError: boom in the second stage")]
    with WorkerPool(2, backend="mindspore", start_timeout_s=600.0,
                    collective_timeout_s=120.0,
                    env={"GLOG_v": "3", "HYPERPAR_MS_DEVICE": "CPU"}) as pool:
        for case, culprit, cause in cases:
            try:
                errors = pool.run(_failing, case, timeout_s=120.0)
            except DistributedError as exc:   # a hang or a crash is the defect under test
                pytest.fail(f"{case}: the ranks did not both report: {exc}")
            for rank, text in enumerate(errors):
                assert cause in text, (case, rank, text)
                if f"(rank {rank})" not in culprit:   # the peer names the culprit
                    assert text.startswith("PipelineStageError: ") and culprit in text, \
                        (case, rank, text)


# ---------------------------------------------------------------------------------- refusals
def _refusals() -> dict:
    from hyperpar.pipeline import PipelineEngine, PipelineModule, get_schedule_class

    _ms, nn, _ops, _a, _e = _cells()
    out: dict[str, str] = {}
    attempt = _attempter(out, (TypeError, ValueError, NotImplementedError))

    layers = _layer_list(2, tied=False)
    attempt("stages", lambda: PipelineModule(layers, 4, loss_fn=_mse))
    attempt("layer", lambda: PipelineModule([*layers, 3], loss_fn=_mse))
    model = PipelineModule(layers, loss_fn=_mse, partition_method="uniform")
    other = nn.SGD(nn.Dense(2, 2).trainable_params(), learning_rate=LR)
    mine = nn.SGD(model.trainable_params(), learning_rate=LR)
    attempt("optimizer", lambda: PipelineEngine(model, other, {}))
    attempt("config", lambda: PipelineEngine(model, mine, {"fp16": {"enabled": True}}))
    attempt("sizes", lambda: PipelineEngine(model, mine, {
        "train_batch_size": 5, "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2}))
    attempt("zbv", lambda: get_schedule_class("ZBV"))
    attempt("unknown", lambda: get_schedule_class("zero_bubble_v2"))
    model = PipelineModule(_layer_list(4, tied=False), loss_fn=_mse, partition_method="uniform",
                           virtual_stages=2)
    attempt("zb_virtual", lambda: PipelineEngine(
        model, nn.SGD(model.trainable_params(), learning_rate=LR), {}, schedule="zerobubble"))
    return out


def test_bad_input_is_refused_on_every_rank(pool2) -> None:
    for rank, res in enumerate(pool2.run(_refusals)):
        assert "num_stages=4 does not divide the group size 2" in res["stages"], (rank, res)
        assert "layer 2 is a int" in res["layer"], (rank, res)
        assert "not this stage's trainable parameters" in res["optimizer"], (rank, res)
        assert "['fp16'] are not supported yet" in res["config"], (rank, res)
        assert "train_batch_size=5 must equal" in res["sizes"], (rank, res)
        assert "(ZB-V) is not supported on MindSpore" in res["zbv"], (rank, res)
        assert "'interleavedzerobubble'" in res["zbv"], (rank, res)
        assert "unknown pipeline schedule 'zero_bubble_v2'" in res["unknown"], (rank, res)
        for name in ("'1f1b'", "'zerobubble'", "'interleavedzerobubble'"):
            assert name in res["unknown"], (rank, res)
        assert "zero-bubble runs one stage per rank" in res["zb_virtual"], (rank, res)


def _one_rank_refused() -> str:
    from hyperpar.pipeline import PipelineEngine, PipelineModule
    from hyperpar.platform import get_platform

    _ms, nn, _ops, _a, _e = _cells()
    model = PipelineModule(_layer_list(2, tied=False), loss_fn=_mse, partition_method="uniform")
    wrong = get_platform().rank() == 1
    params = nn.Dense(2, 2).trainable_params() if wrong else model.trainable_params()
    try:
        PipelineEngine(model, nn.SGD(params, learning_rate=LR), {})
    except ValueError as exc:
        return str(exc)
    return "constructed"


def test_a_refusal_on_one_rank_is_raised_on_every_rank_before_any_p2p(pool2) -> None:
    mine, peer = pool2.run(_one_rank_refused)[::-1]  # rank 1 refused its own optimizer
    assert "not this stage's trainable parameters" in mine
    assert peer.startswith("PipelineEngine: rank 1 refused its arguments"), peer
    assert "not this stage's trainable parameters" in peer


# ------------------------------------------------------------------------------ transformer
# The tiny causal transformer of tests/mindspore/_cells.py as 4 LayerSpecs (input projection,
# 2 blocks, head; seeds 0..3 as TinyTransformer(seed=0) uses them), 2 stages of 2 under 1F1B.
# Tolerance: as above, plus the blocks' LayerNorm (16 terms), softmax (8) and matmul (<= 64)
# reductions, whose order may change with the batch shape (2 rows per microbatch vs 8): ~100
# terms, ~6e-6 relative each, through 2 blocks and 3 steps. We allow 5e-5 * max(1, max|want|);
# a missing microbatch or a gradient not accumulated is O(1e-2) off.
TFM_M, TFM_RTOL = 4, 5e-5


def _tfm_pipeline() -> dict:
    import mindspore as ms
    from mindspore import nn

    from hyperpar.pipeline import LayerSpec, PipelineModule, initialize
    from tests.mindspore._cells import (
        InputProjection,
        OutputHead,
        TransformerBlock,
        transformer_data,
    )

    layers = [LayerSpec(InputProjection, 0), LayerSpec(TransformerBlock, 1),
              LayerSpec(TransformerBlock, 2), LayerSpec(OutputHead, 3)]
    model = PipelineModule(layers, loss_fn=_mse, partition_method="uniform")
    engine, *_ = initialize(model=model,
                            optimizer=nn.SGD(model.trainable_params(), learning_rate=LR),
                            config={"train_micro_batch_size_per_gpu": MICRO,
                                    "gradient_accumulation_steps": TFM_M})
    x, y = transformer_data(MICRO * TFM_M * STEPS)
    it = iter([(ms.Tensor(x[i:i + MICRO]), ms.Tensor(y[i:i + MICRO]))
               for i in range(0, len(x), MICRO)])
    losses = [float(engine.train_batch(it).asnumpy()) for _ in range(STEPS)]
    params = {}
    for j, pos in enumerate(model._positions):
        for name, p in pos.cell.parameters_and_names():
            params[f"{model.parts[model.stage_id] + j}.{name}"] = p.asnumpy()
    return {"losses": losses, "params": params, "stage": model.stage_id}


def _tfm_reference() -> dict:
    import mindspore as ms
    from mindspore import nn

    from tests.mindspore._cells import TinyTransformer, transformer_data

    model = TinyTransformer(n_blocks=2, seed=0)
    opt = nn.SGD(model.trainable_params(), learning_rate=LR)
    grad_fn = ms.value_and_grad(lambda x, y: _mse(model(x), y), None, opt.parameters)
    x, y = transformer_data(MICRO * TFM_M * STEPS)
    rows = MICRO * TFM_M
    losses = []
    for s in range(STEPS):
        loss, grads = grad_fn(ms.Tensor(x[s * rows:(s + 1) * rows]),
                              ms.Tensor(y[s * rows:(s + 1) * rows]))
        opt(grads)
        losses.append(float(loss.asnumpy()))
    params = {}
    for name, p in model.parameters_and_names():   # embed.* -> 0.*, blocks.i.* -> i+1, head.*
        first, _, rest = name.partition(".")
        if first == "blocks":
            index, _, rest = rest.partition(".")
            first = str(int(index) + 1)
        params[f"{ {'embed': '0', 'head': '3'}.get(first, first)}.{rest}"] = p.asnumpy()
    return {"losses": losses, "params": params}


def test_transformer_two_stages_1f1b_match_one_process(pool2) -> None:
    results = pool2.run(_tfm_pipeline)
    assert [r["stage"] for r in results] == [0, 1]
    ref = _tfm_reference()
    seen = set()
    for rank, res in enumerate(results):
        for s, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            err = abs(got - want)
            assert err <= TFM_RTOL * max(1.0, abs(want)), (rank, s, got, want)
        for name, value in res["params"].items():
            want = ref["params"][name]
            err = float(np.abs(value - want).max())
            assert err <= TFM_RTOL * max(1.0, float(np.abs(want).max())), (rank, name, err)
            seen.add(name)
    assert seen == set(ref["params"]), (sorted(seen), sorted(ref["params"]))
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3   # the model moved
